//! Crash-test helper for checkpoints: trains a 4.2M-parameter MLP (16.8 MB of f32 masters,
//! 50 MB per checkpoint with the AdamW moments) one small step at a time and saves a checkpoint
//! after every step, forever — resuming from the newest checkpoint at start-up. On Ctrl-C
//! (SIGINT/SIGTERM) it saves at the next step boundary and exits with status 130, as tools
//! stopped by Ctrl-C do (`checkpoint::INTERRUPTED_EXIT_CODE`).
//!
//! ```text
//! cargo run --release --example ckpt_crash -- DIR [KEEP_LAST]
//! ```
//! Prints `ready step=N` after start-up (N: the step resumed from, 0 on a fresh start),
//! `saved step=N` after each checkpoint is durable, and `interrupted step=N` before a clean exit.
//! `tests/checkpoint.rs` runs the same loop in a child process, kills it with SIGKILL at random
//! moments and checks that `checkpoint::latest` always loads.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use std::io::Write;
use std::path::Path;
use wick::checkpoint::{self, Checkpointer};
use wick::{loss, nn, Engine, EngineConfig, ParamStore, Precision};

/// The crash-test model: 1024 → 2048 → 1024 → 16 with biases (4,213,776 parameters).
pub struct CrashModel {
    l1: nn::Linear,
    l2: nn::Linear,
    l3: nn::Linear,
}

impl CrashModel {
    /// Creates the parameters in `store`.
    pub fn new(store: &ParamStore) -> Result<Self> {
        Ok(Self {
            l1: nn::Linear::new(store, "l1", 1024, 2048, true)?,
            l2: nn::Linear::new(store, "l2", 2048, 1024, true)?,
            l3: nn::Linear::new(store, "l3", 1024, 16, true)?,
        })
    }

    /// Logits `(N, 16)`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.l1.forward(x)?.relu()?;
        let h = self.l2.forward(&h)?.relu()?;
        self.l3.forward(&h)
    }
}

/// The model and an fp32 AdamW engine over it (`seed` drives the initialisation).
pub fn build(seed: u64) -> Result<(CrashModel, Engine)> {
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, seed);
    let model = CrashModel::new(&store)?;
    let engine = Engine::new(store, EngineConfig::adamw(1e-4))?;
    Ok((model, engine))
}

/// The deterministic batch of step `step`: 4 samples.
fn batch(step: u64) -> Result<(Tensor, Tensor)> {
    let x = Tensor::arange(0u32, 4 * 1024, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .affine(1e-4, (step % 7) as f64 * 1e-2)?
        .sin()?
        .reshape((4, 1024))?;
    let y = Tensor::new(&[(step % 16) as u32, 1, 2, 3], &Device::Cpu)?;
    Ok((x, y))
}

/// Resumes from the newest checkpoint under `dir` (if any), then trains and saves after every
/// step, keeping `keep_last` checkpoints, until `max_saves` saves (forever when `None`) or an
/// interrupt, which ends the process with status 130 after the save. Prints the progress
/// lines described in the module docs.
pub fn run(dir: &Path, keep_last: usize, max_saves: Option<u64>) -> Result<()> {
    checkpoint::install_interrupt_handler()?;
    let (model, mut engine) = build(0)?;
    let ckpt = Checkpointer::new(dir, keep_last);
    if let Some(resumed) = ckpt.resume(&mut engine)? {
        eprintln!("resumed from {resumed}");
    }
    let mut out = std::io::stdout();
    writeln!(out, "ready step={}", engine.boundaries())?;
    out.flush()?;
    let mut saves = 0u64;
    loop {
        let (x, y) = batch(engine.boundaries())?;
        engine.step(|_| loss::cross_entropy(&model.forward(&x)?, &y))?;
        let step = engine.boundaries();
        ckpt.save(&engine, serde_json::json!({ "next_step": step }))?;
        saves += 1;
        if let Some(code) = checkpoint::interrupted_exit_code() {
            writeln!(out, "interrupted step={step}")?;
            out.flush()?;
            std::process::exit(code);
        }
        writeln!(out, "saved step={step}")?;
        out.flush()?;
        if max_saves.is_some_and(|m| saves >= m) {
            return Ok(());
        }
    }
}

#[allow(dead_code)] // also compiled into tests/checkpoint.rs as a module
fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .context("usage: ckpt_crash DIR [KEEP_LAST] (checkpoints are written under DIR)")?;
    let keep_last = match args.next() {
        Some(k) => wick::cli::non_negative_usize(&k)
            .map_err(|e| anyhow::anyhow!("KEEP_LAST (checkpoints to keep, 0: all) {e}"))?,
        None => 2,
    };
    run(Path::new(&dir), keep_last, None)
}
