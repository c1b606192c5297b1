//! `Engine::step`: one training step under mixed precision.
//!
//! ```text
//! forward (user closure, autocast policy)  → loss (f32 scalar, unscaled)
//! scale_loss                                → loss * loss_scale
//! sync.backward                             → grads w.r.t. working copies / masters
//!   (data parallelism, last micro-batch)      the window's reduction begins; buckets'
//!                                              all-reduces start as grads turn final
//! check_coverage (until a backward passes)  → error if a trainable parameter got no grad
//! accumulate                                → fp32 buffers += weight * grad, window weight
//! ── at the accumulation boundary ──
//! sync.finish_window
//!   reduce                                  → the global gradient (data parallelism)
//!                                              the other buckets start; all are awaited
//!   check                                   → found_inf (grads, scaled loss, 1/scale), norm
//!   clip_value (optional, after the check)  → clamped buffers, norm measured again
//!   clip                                    → multiplier = unscale * min(1, max_norm / norm)
//!   agree                                   → every rank skips together
//! sync.update
//!   optimizer.step (skipped on found_inf)   → masters, moments, per-parameter step counts
//!   refresh working copies                  → bf16/f16 copies; ZeRO-1 broadcasts/gathers
//! amp.update                                → applied-step count, loss-scale state machine
//! advance the LR schedule (every boundary, as scheduler.step() in a GradScaler loop)
//! ```
//! The step makes three calls into the gradient-synchronisation seam ([`GradSync`]), the same
//! whatever the variant (one process, DDP, ZeRO-1); a failed boundary asks it a fourth thing,
//! whether a collective is attached (the buffers may then hold the global gradient, and the
//! next window starts empty). Attaching a process group is [`Engine::with_collective`]
//! (`engine/parallel.rs`); the optimizer state checkpoints save is `engine/state.rs`'s.
//! On the fused CUDA path every value above stays on the device; nothing waits for it.

use crate::amp::{AmpState, ScaleValue};
use crate::collective::Collective;
use crate::coverage::Coverage;
use crate::dist::reduce::Reduction;
use crate::dist::sync::MicroBatch;
use crate::dist::GradSync;
use crate::grads::{GradBuffers, GradStats, Limit};
use crate::optim::{AdamW, AdamWConfig, Impl, LrSchedule, OptimPath, Optimizer, StepInputs};
use crate::params::{Param, ParamStore};
use crate::precision::Precision;
use crate::profile::PhaseTimes;
use crate::scaler::{ScalerConfig, ScalerState};
use crate::timing::{Mark, StepSpans};
use anyhow::{bail, Context, Result};
use candle_core::{backprop::GradStore, DType, Tensor};

mod graph;
mod parallel;
mod state;
pub use graph::CapturedStep;

/// Source of [`Engine`] identities (a [`CapturedStep`] replays only on its own engine).
static NEXT_ENGINE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Which optimizer the engine runs.
#[derive(Debug, Clone, PartialEq)]
pub enum OptimizerConfig {
    /// AdamW with decoupled weight decay.
    AdamW(AdamWConfig),
    /// SGD with momentum, dampening, Nesterov and coupled (L2) weight decay.
    Sgd(crate::optim::SgdConfig),
    /// Parameter groups, each with its own rule (e.g. Muon for the hidden layers' matrices and
    /// AdamW for the rest: [`crate::optim::ParamGroups::muon_with_adamw`]).
    Groups(crate::optim::ParamGroups),
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
    /// Element-wise clipping of the unscaled gradients to `[-v, v]` (`clip_grad_value_`),
    /// applied once per optimizer step before the norm is measured.
    pub clip_value: Option<f64>,
    /// Fused CUDA path: write the bf16/f16 working copies with stochastic rounding (seeded by
    /// the step count and the tensor index, so checkpoints reproduce it) instead of
    /// round-to-nearest-even. Other paths always round to nearest.
    pub stochastic_rounding: bool,
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
            clip_value: None,
            stochastic_rounding: false,
        }
    }

    /// SGD (`torch.optim.SGD`) at learning rate `lr` with `momentum` (0: plain SGD), no
    /// dampening, no weight decay, no Nesterov; otherwise as [`EngineConfig::adamw`]. Adjust
    /// the rest through `optimizer: OptimizerConfig::Sgd(SgdConfig { .. })`.
    pub fn sgd(lr: f64, momentum: f64) -> Self {
        Self {
            optimizer: OptimizerConfig::Sgd(crate::optim::SgdConfig::new(lr, momentum)),
            ..Self::adamw(lr)
        }
    }
}

/// The engine's counters and loss-scaler state: with the parameters and the optimizer state,
/// what a checkpoint needs to resume a run exactly.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EngineState {
    /// Accumulation boundaries so far (the LR schedule's step).
    pub boundaries: u64,
    /// Applied (not skipped) optimizer steps.
    pub applied_steps: u64,
    /// Loss-scaler state.
    pub scaler: ScalerState,
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

    /// The autocast policy the store's layers follow ([`crate::precision::Autocast`]): ask
    /// it for the dtype of an op class, or to cast an input for it.
    pub fn autocast(&self) -> crate::precision::Autocast {
        self.store.autocast()
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

/// The outcome of one call to [`Engine::step`]. Values that live on the device (the loss, and
/// on the fused CUDA path the gradient statistics and the loss scale) are read back only when
/// their accessor is called, so logging every N steps costs one synchronisation per N steps.
#[derive(Debug, Clone)]
pub struct StepReport {
    loss: Tensor,
    stats: Option<GradStats>,
    loss_scale: ScaleValue,
    /// True when this micro-batch closed an accumulation window (an optimizer step ran or was
    /// skipped).
    pub boundary: bool,
    /// Learning rate of this window's optimizer step.
    pub lr: f64,
    /// The phases as spans on the device timeline (CUDA events on the GPU, wall clocks on the
    /// CPU); [`StepSpans::resolve`] reads them, waiting for the step's work to finish.
    pub spans: StepSpans,
}

impl StepReport {
    /// Per-phase host wall times of this call (data/h2d are zero: the caller measures them).
    /// On CUDA these are the times the host took to *queue* each phase; the GPU's times are in
    /// [`StepReport::spans`].
    pub fn times(&self) -> PhaseTimes {
        self.spans.host()
    }

    /// The unscaled loss of this micro-batch (reads the value back from the device).
    pub fn loss(&self) -> Result<f32> {
        Ok(self.loss.to_scalar::<f32>()?)
    }

    /// The unscaled loss as a rank-0 f32 tensor (no device read).
    pub fn loss_tensor(&self) -> &Tensor {
        &self.loss
    }

    /// At a boundary: whether the step had inf/NaN gradients and changed nothing but the loss
    /// scale. `false` between boundaries.
    pub fn skipped(&self) -> Result<bool> {
        Ok(match &self.stats {
            Some(s) => s.read()?.found_inf,
            None => false,
        })
    }

    /// At a boundary: the global L2 norm of the unscaled gradients, before norm clipping
    /// (after `clip_value`'s clamp, when set).
    pub fn grad_norm(&self) -> Result<Option<f64>> {
        Ok(match &self.stats {
            Some(s) => Some(s.read()?.norm),
            None => None,
        })
    }

    /// The loss scale this micro-batch's backward used.
    pub fn loss_scale(&self) -> Result<f32> {
        self.loss_scale.read()
    }
}

/// The training engine: parameters, optimizer, mixed-precision state and gradient buffers.
pub struct Engine {
    store: ParamStore,
    config: EngineConfig,
    optimizer: Box<dyn Optimizer>,
    imp: Impl,
    /// Loss scale and applied-step count, on the device on the fused CUDA path.
    amp: AmpState,
    grads: GradBuffers,
    /// How gradients are synchronised across ranks ([`GradSync::Solo`]: one process).
    sync: GradSync,
    /// Accumulation boundaries so far (applied or skipped): the schedule's step.
    boundaries: u64,
    /// The gradient-coverage check runs on every backward until one passes it.
    check_coverage_next: bool,
    /// The last passed coverage check (frozen parameters that got no gradient).
    coverage: Option<Coverage>,
    /// This engine's identity, and a count of the times its state was replaced
    /// ([`Engine::load_state`], [`Engine::with_collective`]): what a captured CUDA graph
    /// checks before a replay.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    id: u64,
    generation: u64,
}

impl Engine {
    /// Builds an engine over `store`. The model's parameters must exist in the store before the
    /// first step (create the model first). Errors on invalid configuration or when
    /// `OptimPath::Fused` is asked for on a device without a fused implementation.
    pub fn new(store: ParamStore, config: EngineConfig) -> Result<Self> {
        if config.accumulation_steps == 0 {
            bail!("EngineConfig::accumulation_steps must be >= 1, got 0");
        }
        if let Some(c) = config.max_grad_norm {
            anyhow::ensure!(
                c > 0.0 && c.is_finite(),
                "EngineConfig::max_grad_norm must be finite and > 0, got {c}"
            );
        }
        if let Some(v) = config.clip_value {
            anyhow::ensure!(
                v > 0.0 && v.is_finite(),
                "EngineConfig::clip_value must be finite and > 0, got {v}"
            );
        }
        config.schedule.validate()?;
        let imp = config.path.resolve(store.device())?;
        let optimizer: Box<dyn Optimizer> = match &config.optimizer {
            OptimizerConfig::AdamW(c) => Box::new(AdamW::new(c.clone(), imp)?),
            OptimizerConfig::Sgd(c) => Box::new(crate::optim::Sgd::new(c.clone(), imp)?),
            OptimizerConfig::Groups(g) => Box::new(crate::optim::Grouped::new(g, imp)?),
        };
        let scaler = config
            .scaler
            .clone()
            .unwrap_or_else(|| ScalerConfig::default_for(store.precision()));
        let on_device = (imp == Impl::FusedCuda).then(|| store.device());
        Ok(Self {
            amp: AmpState::new(scaler, on_device)?,
            grads: GradBuffers::new(store.len()),
            store,
            config,
            optimizer,
            imp,
            sync: GradSync::Solo,
            boundaries: 0,
            check_coverage_next: true,
            coverage: None,
            id: NEXT_ENGINE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            generation: 0,
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
    /// `accumulation_steps` calls, the optimizer step runs. On the fused CUDA path nothing in
    /// here waits for the device. `forward` runs under [`crate::grad_sink::forward_for_sink`]
    /// (the backward is [`crate::grad_sink::backward`]), so wick's block ops in it build their
    /// one-node form ([`crate::ops::pre_norm_stack`]); a closure that runs candle's own
    /// `backward` on such a graph itself (a gradient penalty, say) must build it outside
    /// `forward_for_sink` or use [`crate::grad_sink::backward`].
    ///
    /// Errors: the loss is not a one-element f32 or f64 tensor (a bf16/f16 loss is refused with
    /// the fix named: losses are computed in f32, as under torch.autocast); `weight` not finite
    /// and > 0; the closure's own error (a dtype mismatch under a mixed precision gets the fix
    /// named: cast inputs with [`StepCtx::precision`]'s `to_compute`); a
    /// trainable parameter got no gradient (see [`crate::coverage`]; checked until a backward
    /// passes). An error leaves the parameters and optimizer state untouched.
    pub fn step_weighted<F, E>(&mut self, weight: f64, forward: F) -> Result<StepReport>
    where
        F: FnOnce(&StepCtx) -> std::result::Result<Tensor, E>,
        E: Into<anyhow::Error>,
    {
        self.run_step(weight, forward, false)
    }

    /// Like [`Engine::step_weighted`], and closes the accumulation window at this micro-batch
    /// even when fewer than `accumulation_steps` were accumulated: the step applies `sum w_i
    /// g_i / sum w_i` over what the window holds (Lightning steps on an epoch's last, partial
    /// window the same way).
    pub fn step_weighted_closing<F, E>(&mut self, weight: f64, forward: F) -> Result<StepReport>
    where
        F: FnOnce(&StepCtx) -> std::result::Result<Tensor, E>,
        E: Into<anyhow::Error>,
    {
        self.run_step(weight, forward, true)
    }

    fn run_step<F, E>(&mut self, weight: f64, forward: F, close: bool) -> Result<StepReport>
    where
        F: FnOnce(&StepCtx) -> std::result::Result<Tensor, E>,
        E: Into<anyhow::Error>,
    {
        let result = self.step_inner(weight, forward, close);
        #[cfg(feature = "cuda")]
        if let (Err(e), candle_core::Device::Cuda(d)) = (&result, self.store.device()) {
            if crate::cuda::memory::is_out_of_memory(e) {
                let d = d.clone();
                return result.map_err(|e| crate::cuda::memory::explain_out_of_memory(e, &d));
            }
        }
        result
    }

    fn step_inner<F, E>(&mut self, weight: f64, forward: F, close: bool) -> Result<StepReport>
    where
        F: FnOnce(&StepCtx) -> std::result::Result<Tensor, E>,
        E: Into<anyhow::Error>,
    {
        if !(weight.is_finite() && weight > 0.0) {
            bail!("Engine::step_weighted: weight must be finite and > 0, got {weight}");
        }
        let params = self.store.params();
        let device = self.store.device().clone();
        let m0 = Mark::now(&device)?;

        // forward under the autocast policy
        let ctx = StepCtx {
            store: &self.store,
            micro_step: self.grads.micro_steps(),
        };
        // the backward below is grad_sink's: block ops may build their one-node form
        let precision = self.store.precision();
        let loss = crate::grad_sink::forward_for_sink(|| forward(&ctx))
            .map_err(|e| forward_error(e.into(), precision))?;
        let loss = scalar_loss(loss, precision)?;
        let m1 = Mark::now(&device)?;

        // scale the loss, backward; with data parallelism, a window's last backward starts its
        // gradient buckets' all-reduces as they become final
        let loss_scale = self.amp.loss_scale()?;
        let scaled = loss_scale.scale_loss(&loss)?;
        let micro = MicroBatch {
            weight,
            keep_raw: self.config.accumulation_steps == 1,
            closes_window: close || self.grads.micro_steps() + 1 >= self.config.accumulation_steps,
        };
        let backward = self.sync.backward(&scaled, &params, &self.grads, micro);
        let (grads, reduction) = backward.context("backward failed")?;
        // from here on nothing holds the forward graph: its activations are freed before the
        // optimizer runs (and allocates its moments on the first step), as PyTorch frees saved
        // tensors during the backward
        let (loss, scaled) = (loss.detach(), scaled.detach());
        let m2 = Mark::now(&device)?;

        // accumulate; every `accumulation_steps` micro-batches (or when asked): the boundary
        if self.check_coverage_next {
            self.check_coverage(&params, &grads)?;
        }
        self.grads
            .accumulate(&params, &grads, weight, micro.keep_raw)?;
        self.grads.note_scaled_loss(&scaled)?;
        drop(grads);
        let lr = self.config.schedule.lr(self.boundaries);
        let stats = match micro.closes_window {
            true => Some(self.boundary(&params, &loss_scale, lr, reduction)?),
            false => None,
        };
        let spans = StepSpans::from_marks([m0, m1, m2, Mark::now(&device)?]);
        Ok(StepReport {
            loss,
            boundary: stats.is_some(),
            stats,
            loss_scale,
            lr,
            spans,
        })
    }

    /// The accumulation boundary: the global gradient, its statistics (every rank alike), the
    /// update (skipped on found_inf), the working copies, the scaler; then a new window.
    fn boundary(
        &mut self,
        params: &[Param],
        loss_scale: &ScaleValue,
        lr: f64,
        reduction: Option<Reduction>,
    ) -> Result<GradStats> {
        let result = self.finish_and_update(params, loss_scale, lr, reduction);
        if result.is_err() && self.sync.collective().is_some() {
            // the buffers may hold the global gradient (flat ZeRO-1: this rank's segments of
            // it), not this window's accumulation: the next window starts empty
            self.grads.clear();
        }
        result
    }

    /// The global gradient and its statistics, agreed by every rank; the update; the scaler.
    fn finish_and_update(
        &mut self,
        params: &[Param],
        loss_scale: &ScaleValue,
        lr: f64,
        reduction: Option<Reduction>,
    ) -> Result<GradStats> {
        let check = BoundaryCheck {
            amp: &self.amp,
            config: &self.config,
            imp: self.imp,
            loss_scale,
        };
        let stats = self.sync.finish_window(
            &mut self.grads,
            reduction,
            self.store.device(),
            |grads, across| check.run(grads, across),
        )?;
        let inputs = StepInputs {
            stats: &stats,
            lr,
            seed: self.boundaries,
            stochastic_rounding: self.config.stochastic_rounding,
        };
        let (optimizer, grads) = (&mut self.optimizer, &self.grads);
        let applied = self.sync.update(
            params,
            &self.store,
            optimizer.writes_working_copies(),
            |updated| optimizer.step(updated, grads.buffers(), inputs),
        )?;
        self.amp.update(&stats, applied)?;
        self.grads.clear();
        self.boundaries += 1;
        Ok(stats)
    }

    fn check_coverage(&mut self, params: &[Param], grads: &GradStore) -> Result<()> {
        let coverage = Coverage::check(params, grads);
        if !coverage.is_complete() {
            // stays armed: a retried step is checked again
            bail!("gradient coverage: {coverage}");
        }
        self.check_coverage_next = false;
        if !coverage.missing_frozen.is_empty() {
            tracing::warn!("gradient coverage: {coverage}");
        }
        self.coverage = Some(coverage);
        Ok(())
    }

    /// The last passed gradient-coverage check (after the first backward; `None` before it):
    /// [`Coverage::missing_frozen`] lists the frozen parameters that got no gradient, which
    /// the engine also logs as a warning. A trainable parameter without a gradient is an
    /// error of [`Engine::step`] instead.
    pub fn coverage(&self) -> Option<&Coverage> {
        self.coverage.as_ref()
    }

    /// Runs the gradient-coverage check again on the next backward (and until one passes).
    pub fn check_gradient_coverage_next_step(&mut self) {
        self.check_coverage_next = true;
    }

    /// The parameter store.
    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// The loss scaler's state (read from the device on the fused CUDA path).
    pub fn scaler_state(&self) -> Result<ScalerState> {
        self.amp.scaler_state()
    }

    /// The current loss scale (a device read on the fused CUDA path).
    pub fn loss_scale(&self) -> Result<f32> {
        Ok(self.scaler_state()?.scale)
    }

    /// The mixed-precision state: the loss scaler's configuration and state, and the
    /// applied-step count.
    pub fn scaler(&self) -> &AmpState {
        &self.amp
    }

    /// The optimizer (for its state).
    pub fn optimizer(&self) -> &dyn Optimizer {
        self.optimizer.as_ref()
    }

    /// The implementation the optimizer runs.
    pub fn implementation(&self) -> Impl {
        self.imp
    }

    /// Applied optimizer steps so far (skipped steps do not count; a device read on the fused
    /// CUDA path).
    pub fn optimizer_steps(&self) -> Result<u64> {
        self.amp.applied_steps()
    }

    /// Accumulation boundaries so far (applied or skipped optimizer steps); the LR schedule's
    /// position, which advances on skipped steps too, as `scheduler.step()` does in a PyTorch
    /// GradScaler loop.
    pub fn boundaries(&self) -> u64 {
        self.boundaries
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }
}

/// What the boundary pass needs besides the buffers: the loss scale and where it lives, the
/// clipping options and the implementation.
struct BoundaryCheck<'a> {
    amp: &'a AmpState,
    config: &'a EngineConfig,
    imp: Impl,
    loss_scale: &'a ScaleValue,
}

impl BoundaryCheck<'_> {
    /// The boundary pass: found_inf (inf/NaN gradients, a non-finite scaled loss, a reciprocal
    /// of the scale that is not finite), the global norm and the multiplier. With
    /// `clip_value`, found_inf is taken before the clamp (PyTorch: `unscale_` finds the inf,
    /// `clip_grad_value_` clamps, the step is skipped) and the norm after it. `across`: flat
    /// ZeRO-1's collective, over whose ranks the buffers are split.
    fn run(&self, grads: &mut GradBuffers, across: Option<&dyn Collective>) -> Result<GradStats> {
        let raw = self.stats(grads, across)?;
        let Some(v) = self.config.clip_value else {
            return Ok(raw);
        };
        // the buffers hold `scale * sum_w * g`: clamp to `±v * scale * sum_w` (no device read)
        let limit = match self.loss_scale {
            ScaleValue::Host(s) => Limit::Host(v * *s as f64),
            ScaleValue::Device(t) => Limit::Device((t * v)?),
        };
        grads.clamp(&limit)?;
        self.stats(grads, across)?.with_found_inf_of(&raw)
    }

    fn stats(&self, grads: &GradBuffers, across: Option<&dyn Collective>) -> Result<GradStats> {
        let max_norm = self.config.max_grad_norm;
        match (self.amp, self.loss_scale) {
            #[cfg(feature = "cuda")]
            (AmpState::Device { scaler, .. }, _) => {
                grads.unscale_and_check_on_device(scaler, max_norm, across)
            }
            (_, ScaleValue::Host(s)) => {
                grads.unscale_and_check(*s, max_norm, self.imp == Impl::FusedCpu, across)
            }
            _ => bail!("device loss scale without the fused CUDA path"),
        }
    }
}

/// Accepts a one-element loss of any float dtype and returns it as a rank-0 f32 tensor.
fn scalar_loss(loss: Tensor, precision: Precision) -> Result<Tensor> {
    if loss.elem_count() != 1 {
        bail!(
            "the forward closure returned a loss of shape {:?}; Engine::step needs a scalar loss \
             (a mean over the micro-batch): reduce it, e.g. with .mean_all()",
            loss.dims()
        );
    }
    match loss.dtype() {
        DType::F32 | DType::F64 => {}
        DType::BF16 | DType::F16 => bail!(
            "the forward closure returned a {:?} loss (under {precision}): a loss computed in \
             half precision loses digits (torch.autocast computes losses in f32); compute it in \
             f32: wick::loss::cross_entropy does, or cast the logits first, e.g. \
             `candle_nn::loss::cross_entropy(&logits.to_dtype(DType::F32)?, &targets)`",
            loss.dtype()
        ),
        other => bail!("the loss has dtype {other:?}; a float loss is needed"),
    }
    // a rank-0 loss is used as is: a reshape is a graph node, whose backward costs a zeroed
    // buffer and an add
    let loss = if loss.rank() == 0 {
        loss
    } else {
        loss.reshape(())?
    };
    Ok(if loss.dtype() == DType::F32 {
        loss
    } else {
        loss.to_dtype(DType::F32)?
    })
}

/// The forward closure's error, with the fix named for the usual autocast mistake: an f32
/// input (or activation) meeting a parameter's half-precision working copy in a matmul.
fn forward_error(e: anyhow::Error, precision: Precision) -> anyhow::Error {
    let mixed = precision.is_mixed() && format!("{e:#}").contains("dtype mismatch");
    let e = e.context("the forward closure failed");
    if !mixed {
        return e;
    }
    e.context(format!(
        "the forward closure failed on a dtype mismatch under {precision}: the parameters' \
         working copies are {:?} (fp32 masters stay with the optimizer); cast the model's inputs \
         with `ctx.precision().to_compute(&x)?` (or `store.precision().to_compute(&x)?`), or use \
         wick::nn layers, which cast for you",
        precision.compute_dtype()
    ))
}
