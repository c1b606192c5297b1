//! `Engine::step`: one training step under mixed precision.
//!
//! ```text
//! forward (user closure, autocast policy)  → loss (f32 scalar, unscaled)
//! scale_loss                                → loss * loss_scale
//! backward                                  → grads w.r.t. working copies / masters
//! check_coverage (first backward)           → error if a trainable parameter got no grad
//! accumulate                                → fp32 buffers += weight * grad
//! ── at the accumulation boundary ──
//! unscale_and_check                         → found_inf, global norm
//! clip                                      → multiplier = unscale * min(1, max_norm / norm)
//! apply_update (skipped when found_inf)     → masters and moments; step count
//! refresh_working_copies                    → bf16/f16 copies from the masters
//! update_scale                              → GradScaler state machine
//! advance the LR schedule (applied steps only)
//! ```

use crate::coverage::Coverage;
use crate::grads::{clip_factor, GradBuffers, GradStats};
use crate::optim::{AdamW, AdamWConfig, LrSchedule, OptimPath, Optimizer};
use crate::params::{Param, ParamStore};
use crate::precision::Precision;
use crate::profile::PhaseTimes;
use crate::scaler::{LossScaler, ScalerConfig};
use anyhow::{bail, Context, Result};
use candle_core::{backprop::GradStore, DType, Tensor};
use std::time::Instant;

/// Which optimizer the engine runs.
#[derive(Debug, Clone, PartialEq)]
pub enum OptimizerConfig {
    /// AdamW with decoupled weight decay.
    AdamW(AdamWConfig),
}

/// Engine configuration. Start from [`EngineConfig::adamw`] and adjust fields.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The optimizer and its hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// Reference or fused implementation (default: fused where available).
    pub path: OptimPath,
    /// Learning-rate schedule (default: constant at the optimizer's lr).
    pub schedule: LrSchedule,
    /// Loss scaler; `None` picks the default for the precision (f16 → dynamic, else none).
    pub scaler: Option<ScalerConfig>,
    /// Micro-batches per optimizer step (≥ 1).
    pub accumulation_steps: usize,
    /// Global L2-norm clipping threshold (`clip_grad_norm_`'s `max_norm`).
    pub max_grad_norm: Option<f64>,
}

impl EngineConfig {
    /// AdamW with PyTorch's defaults at learning rate `lr`, constant schedule, no accumulation,
    /// no clipping, default scaler for the precision.
    pub fn adamw(lr: f64) -> Self {
        Self {
            optimizer: OptimizerConfig::AdamW(AdamWConfig {
                lr,
                ..AdamWConfig::default()
            }),
            path: OptimPath::Auto,
            schedule: LrSchedule::Constant { lr },
            scaler: None,
            accumulation_steps: 1,
            max_grad_norm: None,
        }
    }
}

/// What the forward closure sees.
pub struct StepCtx<'a> {
    store: &'a ParamStore,
    micro_step: usize,
}

impl StepCtx<'_> {
    /// The precision mode (its compute dtype is what matmul-class inputs should be cast to).
    pub fn precision(&self) -> Precision {
        self.store.precision()
    }

    /// Index of this micro-batch within the accumulation window (0-based).
    pub fn micro_step(&self) -> usize {
        self.micro_step
    }

    /// The parameter store.
    pub fn store(&self) -> &ParamStore {
        self.store
    }
}

/// The outcome of one call to [`Engine::step`].
#[derive(Debug, Clone)]
pub struct StepReport {
    loss: Tensor,
    /// True when this micro-batch closed an accumulation window (an optimizer step ran or was
    /// skipped).
    pub boundary: bool,
    /// At a boundary: the step had inf/NaN gradients and changed nothing but the loss scale.
    pub skipped: bool,
    /// At a boundary: global L2 norm of the unscaled gradients, before clipping.
    pub grad_norm: Option<f64>,
    /// Learning rate used by this step's update (the next update's rate between boundaries).
    pub lr: f64,
    /// Loss scale used for this micro-batch's backward.
    pub loss_scale: f32,
    /// Per-phase wall times of this call (data/h2d are zero: the caller measures them).
    pub times: PhaseTimes,
}

impl StepReport {
    /// The unscaled loss of this micro-batch (reads the value back from the device).
    pub fn loss(&self) -> Result<f32> {
        Ok(self.loss.to_scalar::<f32>()?)
    }

    /// The unscaled loss as a rank-0 f32 tensor (no device read).
    pub fn loss_tensor(&self) -> &Tensor {
        &self.loss
    }
}

/// The training engine: parameters, optimizer, loss scaler and gradient buffers.
pub struct Engine {
    store: ParamStore,
    config: EngineConfig,
    optimizer: Box<dyn Optimizer>,
    fused: bool,
    scaler: LossScaler,
    grads: GradBuffers,
    optimizer_steps: u64,
    check_coverage_next: bool,
}

impl Engine {
    /// Builds an engine over `store`. The model's parameters must exist in the store before the
    /// first step (create the model first). Errors on invalid configuration or when
    /// `OptimPath::Fused` is asked for on a device without a fused implementation.
    pub fn new(store: ParamStore, config: EngineConfig) -> Result<Self> {
        if config.accumulation_steps == 0 {
            bail!("accumulation_steps must be >= 1");
        }
        if let Some(c) = config.max_grad_norm {
            anyhow::ensure!(
                c > 0.0 && c.is_finite(),
                "max_grad_norm must be finite and > 0, got {c}"
            );
        }
        config.schedule.validate()?;
        let fused = config.path.resolve(store.device())?;
        let optimizer: Box<dyn Optimizer> = match &config.optimizer {
            OptimizerConfig::AdamW(c) => Box::new(AdamW::new(c.clone(), fused)?),
        };
        let scaler = LossScaler::new(
            config
                .scaler
                .clone()
                .unwrap_or_else(|| ScalerConfig::default_for(store.precision())),
        )?;
        Ok(Self {
            grads: GradBuffers::new(store.len()),
            store,
            config,
            optimizer,
            fused,
            scaler,
            optimizer_steps: 0,
            check_coverage_next: true,
        })
    }

    /// One micro-batch with weight 1 (see [`Engine::step_weighted`]).
    pub fn step<F, E>(&mut self, forward: F) -> Result<StepReport>
    where
        F: FnOnce(&StepCtx) -> std::result::Result<Tensor, E>,
        E: Into<anyhow::Error>,
    {
        self.step_weighted(1.0, forward)
    }

    /// Runs `forward` (which must return a scalar loss, a mean over its micro-batch), then
    /// backward, and accumulates the gradient with `weight` (e.g. the micro-batch's sample or
    /// token count: the applied gradient is `sum w_i g_i / sum w_i`). Every
    /// `accumulation_steps` calls, the optimizer step runs.
    ///
    /// Errors: the loss is not a scalar or not finite-typed; `weight` not finite and > 0; a
    /// trainable parameter got no gradient on the first backward (see [`crate::coverage`]).
    /// An error leaves the parameters and optimizer state untouched.
    pub fn step_weighted<F, E>(&mut self, weight: f64, forward: F) -> Result<StepReport>
    where
        F: FnOnce(&StepCtx) -> std::result::Result<Tensor, E>,
        E: Into<anyhow::Error>,
    {
        if !(weight.is_finite() && weight > 0.0) {
            bail!("Engine::step_weighted: weight must be finite and > 0, got {weight}");
        }
        let params = self.store.params();
        let mut times = PhaseTimes::default();
        let loss_scale = self.scaler.scale();

        // forward under the autocast policy
        let t = Instant::now();
        let ctx = StepCtx {
            store: &self.store,
            micro_step: self.grads.micro_steps(),
        };
        let loss = forward(&ctx)
            .map_err(Into::into)
            .context("the forward closure failed")?;
        let loss = scalar_loss(loss)?;
        times.forward = t.elapsed();

        // scale the loss, backward
        let t = Instant::now();
        let grads = self
            .scale_loss(&loss, loss_scale)?
            .backward()
            .context("backward failed")?;
        times.backward = t.elapsed();

        let t = Instant::now();
        if self.check_coverage_next {
            self.check_coverage(&params, &grads)?;
        }
        self.grads.accumulate(&params, &grads, weight)?;
        drop(grads);

        let mut report = StepReport {
            loss,
            boundary: false,
            skipped: false,
            grad_norm: None,
            lr: self.config.schedule.lr(self.optimizer_steps),
            loss_scale,
            times,
        };
        if self.grads.micro_steps() >= self.config.accumulation_steps {
            // the accumulation boundary
            let stats = self.grads.unscale_and_check(loss_scale, self.fused)?;
            if !stats.found_inf {
                self.apply_update(&params, &stats, report.lr)?;
                self.store.refresh_working_copies()?;
                self.optimizer_steps += 1;
            }
            self.scaler.update(stats.found_inf);
            self.grads.clear();
            report.boundary = true;
            report.skipped = stats.found_inf;
            report.grad_norm = Some(stats.norm);
        }
        report.times.optimizer = t.elapsed();
        Ok(report)
    }

    fn scale_loss(&self, loss: &Tensor, scale: f32) -> Result<Tensor> {
        Ok(if scale == 1.0 {
            loss.clone()
        } else {
            (loss * scale as f64)?
        })
    }

    fn check_coverage(&mut self, params: &[Param], grads: &GradStore) -> Result<()> {
        let coverage = Coverage::check(params, grads);
        self.check_coverage_next = false;
        if !coverage.is_complete() {
            bail!("gradient coverage: {coverage}");
        }
        if !coverage.missing_frozen.is_empty() {
            tracing::warn!("gradient coverage: {coverage}");
        }
        Ok(())
    }

    fn apply_update(&mut self, params: &[Param], stats: &GradStats, lr: f64) -> Result<()> {
        let clip = clip_factor(stats.norm, self.config.max_grad_norm);
        self.optimizer
            .step(params, self.grads.buffers(), stats.unscale * clip, lr)
    }

    /// Runs the gradient-coverage check again on the next backward.
    pub fn check_gradient_coverage_next_step(&mut self) {
        self.check_coverage_next = true;
    }

    /// The parameter store.
    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// The loss scaler.
    pub fn scaler(&self) -> &LossScaler {
        &self.scaler
    }

    /// The optimizer (for its state).
    pub fn optimizer(&self) -> &dyn Optimizer {
        self.optimizer.as_ref()
    }

    /// Applied optimizer steps so far.
    pub fn optimizer_steps(&self) -> u64 {
        self.optimizer_steps
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }
}

/// Accepts a one-element loss of any float dtype and returns it as a rank-0 f32 tensor.
fn scalar_loss(loss: Tensor) -> Result<Tensor> {
    if loss.elem_count() != 1 {
        bail!(
            "the forward closure returned a loss of shape {:?}; Engine::step needs a scalar loss \
             (a mean over the micro-batch): reduce it, e.g. with .mean_all()",
            loss.dims()
        );
    }
    if !loss.dtype().is_float() {
        bail!(
            "the loss has dtype {:?}; a float loss is needed",
            loss.dtype()
        );
    }
    let loss = loss.reshape(())?;
    Ok(if loss.dtype() == DType::F32 {
        loss
    } else {
        loss.to_dtype(DType::F32)?
    })
}
