//! Optimizers over fp32 master weights.
//!
//! Two kinds of rule ([`rule`]): element-wise ([`UpdateRule`], run over chunks by [`Driver`])
//! and whole-tensor ([`TensorRule`], run one whole parameter at a time by [`TensorDriver`]).
//! Like `torch.optim` (single-tensor / foreach / fused), every element-wise optimizer has two
//! implementations of one algorithm, chosen by [`OptimPath`] and tested against each other:
//! - **reference**: plain candle tensor ops, any device; the correctness oracle and the
//!   "unfused" baseline of the benchmarks;
//! - **fused**: one pass per element over all tensors (rayon on the CPU; multi-tensor CUDA
//!   kernels with the `cuda` feature).
//!
//! Optimizers: [`AdamW`] (decoupled decay) and [`Sgd`] (momentum, dampening, Nesterov, coupled
//! L2 decay), element-wise, and [`Muon`] (Newton–Schulz orthogonalised momentum for 2-D
//! weights), whole-tensor, all with `torch.optim` semantics; [`Grouped`] is an optimizer made
//! of parameter groups, each with its own rule ([`groups`]: Muon for the hidden layers'
//! matrices, AdamW for the rest).
//!
//! The engine hands the optimizer raw fp32 gradient buffers plus one multiplier
//! (`unscale * clip`), so unscaling and clipping cost no extra pass. What every optimizer
//! shares (work list, state, step counts, save/load, ZeRO-1 ownership) is in the drivers
//! ([`driver`], [`TensorDriver`]); an optimizer file holds only its rule.

pub mod adamw;
pub mod driver;
pub mod groups;
mod host;
pub mod muon;
pub mod rule;
pub mod schedule;
pub mod sgd;
mod state;
mod whole;
mod work;

pub use crate::grads::{GradStats, HostStats};
pub use adamw::{AdamW, AdamWConfig};
pub use driver::Driver;
pub use groups::{Grouped, ParamGroup, ParamGroups, RuleConfig, Select};
pub use muon::{AdjustLr, Muon, MuonConfig};
pub use rule::{TensorRule, UpdateRule};
pub use schedule::LrSchedule;
pub use sgd::{Sgd, SgdConfig};
pub use whole::TensorDriver;

use crate::params::Param;
use anyhow::Result;
use candle_core::{Device, Tensor};

/// Which implementation runs the update, as asked by the user.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OptimPath {
    /// Fused where the device has a fused implementation, reference elsewhere.
    #[default]
    Auto,
    /// Plain candle tensor ops.
    Reference,
    /// The fused implementation; an error on a device that has none.
    Fused,
}

/// The implementation that actually runs, resolved for a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Impl {
    /// candle tensor ops (any device).
    Reference,
    /// One rayon pass per element (CPU).
    FusedCpu,
    /// Multi-tensor CUDA kernels, no host synchronisation (feature `cuda`).
    FusedCuda,
}

impl Impl {
    /// True for the fused implementations.
    pub fn is_fused(self) -> bool {
        self != Impl::Reference
    }
}

impl OptimPath {
    /// Resolves the path for `device`: CPU → fused CPU; CUDA → fused CUDA kernels when the
    /// crate is built with `cuda`; `Reference` everywhere on request.
    pub fn resolve(self, device: &Device) -> Result<Impl> {
        let fused = if device.is_cpu() {
            Some(Impl::FusedCpu)
        } else if cfg!(feature = "cuda") && device.is_cuda() {
            Some(Impl::FusedCuda)
        } else {
            None
        };
        match (self, fused) {
            (OptimPath::Reference, _) | (OptimPath::Auto, None) => Ok(Impl::Reference),
            (_, Some(f)) => Ok(f),
            (OptimPath::Fused, None) => anyhow::bail!(
                "OptimPath::Fused: no fused optimizer for {device:?} in this build; use OptimPath::Auto or Reference"
            ),
        }
    }
}

/// What an optimizer step consumes besides parameters and gradients.
#[derive(Debug, Clone, Copy)]
pub struct StepInputs<'a> {
    /// found_inf, global norm and the gradient multiplier (unscale × clip).
    pub stats: &'a GradStats,
    /// This step's learning rate.
    pub lr: f64,
    /// Seed for stochastic rounding of working copies at this step (the engine's boundary
    /// count, which checkpoints record, so a resumed run rounds the same way).
    pub seed: u64,
    /// Write bf16/f16 working copies with stochastic rounding instead of round-to-nearest-even
    /// (fused CUDA path; see [`crate::EngineConfig::stochastic_rounding`]).
    pub stochastic_rounding: bool,
}

impl<'a> StepInputs<'a> {
    /// Inputs for a step with `stats` at learning rate `lr`: seed 0, round to nearest.
    pub fn host(stats: &'a GradStats, lr: f64) -> Self {
        Self {
            stats,
            lr,
            seed: 0,
            stochastic_rounding: false,
        }
    }
}

/// The optimizer seam: update masters (and moments) from gradient buffers. Implemented once,
/// by [`Driver`], for every [`UpdateRule`].
pub trait Optimizer: Send {
    /// Applies one update. `grads[i]` is the gradient buffer of `params[i]` (`None`: no
    /// gradient, parameter untouched), to be multiplied by the stats' multiplier before use.
    /// The step is skipped when the stats report found_inf. Returns whether it was applied when
    /// that is known on the host (`None`: decided on the device, without synchronisation).
    /// Errors (a gradient of the wrong shape, dtype or device, named) leave everything as it
    /// was.
    fn step(
        &mut self,
        params: &[Param],
        grads: &[Option<Tensor>],
        inputs: StepInputs,
    ) -> Result<Option<bool>>;

    /// Checks a step without changing anything: what [`Self::step`] would refuse (a
    /// gradient of the wrong shape, dtype or device; a parameter the rule cannot update; an
    /// option the rule does not support). [`Self::step`] checks too; a grouped optimizer calls
    /// this on every group first, so that a step fails before any group changes.
    fn check(&self, params: &[Param], grads: &[Option<Tensor>], inputs: &StepInputs) -> Result<()>;

    /// True when some parameter's update needs the whole tensor (a [`TensorRule`]): such an
    /// optimizer cannot run on the flat ZeRO-1 layout's segments, and the engine refuses it.
    fn needs_whole_tensors(&self) -> bool {
        false
    }

    /// True when the update also writes the working copies (no separate refresh needed).
    fn writes_working_copies(&self) -> bool;

    /// ZeRO-1: the parameters this rank updates and keeps state for (`owned[i]` for
    /// `params[i]`); `None`: all of them.
    fn set_owned(&mut self, owned: Option<Vec<bool>>);

    /// Optimizer state by name (`"{param}.exp_avg"`, ..., and `"{param}.step"`, an exact
    /// `i64`), for checkpoints and tests (a device read on the fused CUDA path).
    fn state_tensors(&self, params: &[Param]) -> Result<Vec<(String, Tensor)>>;

    /// Every suffix a name from [`Self::state_tensors`] can have after `"{param}."`; a tensor
    /// named `step` has one element, the others have the parameter's shape. Used to gather
    /// sharded state (ZeRO-1) without knowing the optimizer.
    fn state_suffixes(&self) -> Vec<&'static str>;

    /// Restores state saved by [`Self::state_tensors`] (tensors on any device; copied to the
    /// parameters' device); under ZeRO-1 only the owned parameters' share is kept.
    /// `applied_steps` is the engine's count of applied steps, used where a per-parameter step
    /// is absent (older checkpoints). Errors name the missing tensor or the shape mismatch.
    fn load_state_tensors(
        &mut self,
        params: &[Param],
        tensors: &std::collections::HashMap<String, Tensor>,
        applied_steps: u64,
    ) -> Result<()>;
}

/// Fetches `name` from a state map, checks its shape against `shape`, and moves it to `device`.
pub(crate) fn state_tensor(
    tensors: &std::collections::HashMap<String, Tensor>,
    name: &str,
    shape: &candle_core::Shape,
    device: &Device,
) -> Result<Tensor> {
    let t = tensors.get(name).ok_or_else(|| {
        anyhow::anyhow!("optimizer state {name:?} is missing from the checkpoint")
    })?;
    if t.shape() != shape {
        anyhow::bail!(
            "optimizer state {name:?} has shape {:?}, the parameter has {:?}",
            t.dims(),
            shape.dims()
        );
    }
    Ok(t.to_dtype(candle_core::DType::F32)?.to_device(device)?)
}
