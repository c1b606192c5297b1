//! Optimizers over fp32 master weights.
//!
//! Like `torch.optim` (single-tensor / foreach / fused), every optimizer has two
//! implementations of one algorithm, chosen by [`OptimPath`] and tested against each other:
//! - **reference**: plain candle tensor ops, any device; the correctness oracle and the
//!   "unfused" baseline of the benchmarks;
//! - **fused**: one pass per element over all tensors (rayon on the CPU; multi-tensor CUDA
//!   kernels with the `cuda` feature, in a later release).
//!
//! The engine hands the optimizer raw fp32 gradient buffers plus one multiplier
//! (`unscale * clip`), so unscaling and clipping cost no extra pass.

pub mod adamw;
pub mod schedule;

pub use adamw::{AdamW, AdamWConfig};
pub use schedule::LrSchedule;

use crate::params::Param;
use anyhow::Result;
use candle_core::{Device, Tensor};

/// Which implementation runs the update.
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

impl OptimPath {
    /// Resolves `Auto` for `device`: true means fused. Today the fused path exists on the CPU;
    /// the CUDA multi-tensor kernels come with the `cuda` kernels release.
    pub fn resolve(self, device: &Device) -> Result<bool> {
        let has_fused = device.is_cpu();
        match self {
            OptimPath::Auto => Ok(has_fused),
            OptimPath::Reference => Ok(false),
            OptimPath::Fused if has_fused => Ok(true),
            OptimPath::Fused => anyhow::bail!(
                "OptimPath::Fused: no fused optimizer for {device:?} in this build; use OptimPath::Auto or Reference"
            ),
        }
    }
}

/// The optimizer seam: update masters from gradient buffers.
pub trait Optimizer: Send {
    /// Applies one update. `grads[i]` is the fp32 gradient buffer of `params[i]` (`None`: no
    /// gradient, parameter untouched, its step count not advanced), to be multiplied by
    /// `grad_multiplier` before use; `lr` is this step's learning rate.
    fn step(
        &mut self,
        params: &[Param],
        grads: &[Option<Tensor>],
        grad_multiplier: f64,
        lr: f64,
    ) -> Result<()>;

    /// Number of applied steps (skipped steps are not counted).
    fn step_count(&self) -> u64;

    /// Optimizer state by name (`"{param}.exp_avg"`, ...), for checkpoints and tests.
    fn state_tensors(&self, params: &[Param]) -> Result<Vec<(String, Tensor)>>;
}
