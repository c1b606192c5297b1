//! # wick — mixed-precision training for candle
//!
//! wick turns a candle model plus a loss into training steps that run bf16/f16 autocast over
//! fp32 master weights, with a dynamic loss scaler (PyTorch `GradScaler` semantics), gradient
//! accumulation with per-micro-batch weights, global-norm clipping, and optimizers with two
//! implementations each: a reference path in plain candle tensor ops and a fused path (a single
//! pass per element; rayon on the CPU, multi-tensor kernels on CUDA).
//!
//! ```no_run
//! use wick::{Engine, EngineConfig, ParamStore, Precision, nn, loss};
//! use candle_core::{Device, Module, Tensor};
//! # fn main() -> anyhow::Result<()> {
//! let store = ParamStore::new(Precision::Bf16Mixed, Device::Cpu, 0);
//! let l1 = nn::Linear::new(&store, "l1", 784, 10, true)?;
//! let mut engine = Engine::new(store, EngineConfig::adamw(1e-3))?;
//! let (x, y) = (Tensor::zeros((8, 784), candle_core::DType::F32, &Device::Cpu)?,
//!               Tensor::zeros(8, candle_core::DType::U32, &Device::Cpu)?);
//! let report = engine.step(|_ctx| loss::cross_entropy(&l1.forward(&x)?, &y))?;
//! println!("loss {}", report.loss()?);
//! # Ok(()) }
//! ```
//!
//! Module map: [`precision`] (the autocast policy), [`params`] (master weights and working
//! copies), [`nn`] (policy-following layers), [`ops`] (fused differentiable ops), [`loss`],
//! [`scaler`] and [`amp`] (the loss scale on the host or the device), [`grads`] (accumulation,
//! unscale, norm, clipping), [`grad_sink`] (parameter gradients written once by the engine's
//! backward), [`recompute`] (activation checkpointing), [`optim`] (element-wise
//! [`optim::UpdateRule`]s and whole-tensor [`optim::TensorRule`]s run by shared drivers,
//! parameter groups, AdamW, SGD, Muon),
//! [`cuda`] (the kernels' launchers and the multi-tensor planning), [`engine`] (one training
//! step), [`coverage`] (which parameters received no gradient, and
//! why), [`data`] (loader, sampler, datasets), [`trainer`] (the fit loop), [`checkpoint`],
//! [`profile`] and [`timing`] (per-phase timing), [`plot`], [`perf`], [`models`] (GPT, BERT, the shared decoder),
//! [`collective`] (the collective vocabulary, on the ground floor), [`dist`] (data
//! parallelism, behind the engine's [`dist::GradSync`] seam), [`serve`]
//! (published inference snapshots, a bounded feedback queue and an online trainer thread, for
//! services that keep learning), [`doctor`] and [`bench`](mod@bench) (behind the `wick`
//! command line).
//!
//! ## Examples
//!
//! The repository's `examples/` folder has complete programs: `mnist.rs` (an MLP or a CNN
//! through the [`trainer::Trainer`], with checkpoints and resume) and `char_gpt.rs` (a
//! byte-level GPT on Shakespeare, with text generation from a checkpoint); `ckpt_crash.rs`
//! is the crash test of [`checkpoint`]; `serve/` is an HTTP service (axum) that answers
//! requests and fine-tunes on feedback through [`serve`], and `serve_load.rs` its load
//! generator. Run them with
//! `cargo run --release --example mnist -- --help`; the README lists the commands.

#![warn(missing_docs)]

pub mod amp;
#[cfg(feature = "cli")]
pub mod bench;
pub mod checkpoint;
pub mod classify;
#[cfg(feature = "cli")]
pub mod cli;
pub mod collective;
pub mod coverage;
pub mod cuda;
pub mod data;
pub mod dist;
pub mod doctor;
pub mod engine;
#[cfg(feature = "tokenizers")]
pub mod finetune;
pub mod grad_sink;
pub mod grads;
pub mod lora;
pub mod loss;
pub mod models;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod params;
pub mod perf;
#[cfg(feature = "plot")]
pub mod plot;
pub mod precision;
pub mod profile;
pub mod recompute;
pub mod scaler;
pub mod serve;
pub mod throughput;
pub mod timing;
pub mod trainer;

/// The candle wick is built against (0.11.1): use `wick::candle_core` and `wick::candle_nn`
/// instead of depending on candle yourself, so that the two always match.
pub use candle_core;
/// candle-nn, the version wick is built against (see [`candle_core`]).
pub use candle_nn;
pub use engine::{Engine, EngineConfig, StepCtx, StepReport};
pub use params::{ParamOptions, ParamStore};
pub use precision::Precision;
pub use scaler::{LossScaler, ScalerConfig};

/// The device a `--device` flag names: `"cpu"`, or `"cuda"` (GPU 0), as the examples take it.
/// A CUDA device comes from [`cuda::new_device`] (one stream, no per-allocation events).
///
/// Errors: `"cuda"` without a usable CUDA device (a build without `--features cuda`, or no
/// GPU), or any other name; both messages say what to do.
pub fn device_from_flag(name: &str) -> anyhow::Result<candle_core::Device> {
    use anyhow::Context;
    match name {
        "cpu" => Ok(candle_core::Device::Cpu),
        "cuda" => cuda::new_device(0)
            .context("--device cuda: no CUDA device (build with --features cuda on a GPU machine)"),
        other => anyhow::bail!("--device must be cpu or cuda, got {other:?}"),
    }
}
