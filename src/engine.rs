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
//! advance the LR schedule (every boundary, as scheduler.step() in a GradScaler loop)
//! ```

use crate::coverage::Coverage;
use crate::grads::{GradBuffers, GradStats, Limit};
use crate::optim::{AdamW, AdamWConfig, Impl, LrSchedule, OptimPath, Optimizer, StepInputs};
use crate::params::{Param, ParamStore};
use crate::precision::Precision;
use crate::profile::PhaseTimes;
use crate::scaler::{LossScaler, ScalerConfig, ScalerState};
use crate::timing::{Mark, StepSpans};
use anyhow::{bail, Context, Result};
use candle_core::{backprop::GradStore, DType, Tensor};

/// Which optimizer the engine runs.
#[derive(Debug, Clone, PartialEq)]
pub enum OptimizerConfig {
    /// AdamW with decoupled weight decay.
    AdamW(AdamWConfig),
    /// SGD with momentum, dampening, Nesterov and coupled (L2) weight decay.
    Sgd(crate::optim::SgdConfig),
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

#[derive(Debug, Clone)]
enum ScaleValue {
    Host(f32),
    Device(Tensor),
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

    /// At a boundary: the global L2 norm of the unscaled gradients, before clipping.
    pub fn grad_norm(&self) -> Result<Option<f64>> {
        Ok(match &self.stats {
            Some(s) => Some(s.read()?.norm),
            None => None,
        })
    }

    /// The loss scale this micro-batch's backward used.
    pub fn loss_scale(&self) -> Result<f32> {
        Ok(match &self.loss_scale {
            ScaleValue::Host(s) => *s,
            ScaleValue::Device(t) => t.to_vec1::<f32>()?[0],
        })
    }
}

/// The training engine: parameters, optimizer, loss scaler and gradient buffers.
pub struct Engine {
    store: ParamStore,
    config: EngineConfig,
    optimizer: Box<dyn Optimizer>,
    imp: Impl,
    scaler: LossScaler,
    /// `[scale, growth_tracker, hysteresis_left, applied_steps]` on the device (fused CUDA).
    amp_state: Option<Tensor>,
    grads: GradBuffers,
    /// Accumulation boundaries so far (applied or skipped): the schedule's step.
    boundaries: u64,
    /// Applied optimizer steps (host paths; on the fused CUDA path `amp_state[3]`).
    applied_steps: u64,
    check_coverage_next: bool,
    // ---- dist: data parallelism (src/dist/ddp.rs); None: single process, unchanged ----
    dist: Option<crate::dist::ddp::Ddp>,
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
        let imp = config.path.resolve(store.device())?;
        let optimizer: Box<dyn Optimizer> = match &config.optimizer {
            OptimizerConfig::AdamW(c) => Box::new(AdamW::new(c.clone(), imp)?),
            OptimizerConfig::Sgd(c) => Box::new(crate::optim::Sgd::new(c.clone(), imp)?),
        };
        let scaler = LossScaler::new(
            config
                .scaler
                .clone()
                .unwrap_or_else(|| ScalerConfig::default_for(store.precision())),
        )?;
        let amp_state = match imp {
            Impl::FusedCuda => {
                let s = scaler.state();
                let v = [
                    s.scale,
                    s.growth_tracker as f32,
                    s.hysteresis_left as f32,
                    0.0,
                ];
                Some(Tensor::new(&v, store.device())?)
            }
            _ => None,
        };
        Ok(Self {
            grads: GradBuffers::new(store.len()),
            store,
            config,
            optimizer,
            imp,
            scaler,
            amp_state,
            boundaries: 0,
            applied_steps: 0,
            check_coverage_next: true,
            dist: None,
        })
    }

    // ---- dist: data parallelism (src/dist/ddp.rs) ------------------------------------------
    /// Attaches a process group: checks that every rank has the same parameter layout,
    /// broadcasts rank 0's parameters to every rank, and from then on all-reduces the gradients
    /// at each accumulation boundary (in buckets, f32, weighted by the micro-batch weights of
    /// every rank) before clipping, the norm and found_inf, which are therefore global; every
    /// rank skips together. Call it on every rank, right after [`Engine::new`] (or after
    /// restoring a checkpoint, which every rank restores alike). World size 1: only the
    /// collective is stored; steps run exactly as without it.
    pub fn with_collective(
        mut self,
        collective: Box<dyn crate::dist::Collective>,
        config: crate::dist::DdpConfig,
    ) -> Result<Self> {
        if self.grads.micro_steps() != 0 {
            bail!("Engine::with_collective: attach the collective at an accumulation boundary");
        }
        if config.zero1
            && self.config.stochastic_rounding
            && collective.world_size() > 1
            && self.store.precision().is_mixed()
        {
            bail!(
                "Engine::with_collective: ZeRO-1 with stochastic rounding would give the ranks \
                 different working copies (only a parameter's owner rounds stochastically); \
                 turn one of them off"
            );
        }
        let mut ddp = crate::dist::ddp::Ddp::new(collective, config)?;
        ddp.shard_owners(&self.store.params())?;
        ddp.broadcast_parameters(&self.store)
            .context("broadcasting the parameters from rank 0")?;
        self.dist = Some(ddp);
        Ok(self)
    }

    /// With ZeRO-1: the data-parallel state and each parameter's owner rank (a function of
    /// the field, so that the optimizer can be borrowed beside it).
    fn zero1(dist: &Option<crate::dist::ddp::Ddp>) -> Option<(&crate::dist::ddp::Ddp, &[usize])> {
        let d = dist.as_ref()?;
        Some((d, d.owners()?))
    }

    /// The attached process group, if any.
    pub fn collective(&self) -> Option<&dyn crate::dist::Collective> {
        self.dist.as_ref().map(|d| d.collective())
    }
    // ---- end dist ----------------------------------------------------------------------------

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
    /// here waits for the device.
    ///
    /// Errors: the loss is not a one-element float tensor; `weight` not finite and > 0; a
    /// trainable parameter got no gradient on the first backward (see [`crate::coverage`]).
    /// An error leaves the parameters and optimizer state untouched.
    pub fn step_weighted<F, E>(&mut self, weight: f64, forward: F) -> Result<StepReport>
    where
        F: FnOnce(&StepCtx) -> std::result::Result<Tensor, E>,
        E: Into<anyhow::Error>,
    {
        let result = self.step_inner(weight, false, forward);
        #[cfg(feature = "cuda")]
        if let (Err(e), candle_core::Device::Cuda(d)) = (&result, self.store.device()) {
            if crate::cuda::memory::is_out_of_memory(e) {
                let d = d.clone();
                return result.map_err(|e| crate::cuda::memory::explain_out_of_memory(e, &d));
            }
        }
        result
    }

    /// Runs one micro-batch like [`Engine::step_weighted`] and closes the accumulation window
    /// at it even if fewer than `accumulation_steps` micro-batches were accumulated (the applied
    /// gradient is the weighted mean of what the window holds): for an epoch's last, partial
    /// window, which Lightning steps on too.
    ///
    /// Errors: as [`Engine::step_weighted`].
    pub fn step_weighted_closing<F, E>(&mut self, weight: f64, forward: F) -> Result<StepReport>
    where
        F: FnOnce(&StepCtx) -> std::result::Result<Tensor, E>,
        E: Into<anyhow::Error>,
    {
        let result = self.step_inner(weight, true, forward);
        #[cfg(feature = "cuda")]
        if let (Err(e), candle_core::Device::Cuda(d)) = (&result, self.store.device()) {
            if crate::cuda::memory::is_out_of_memory(e) {
                let d = d.clone();
                return result.map_err(|e| crate::cuda::memory::explain_out_of_memory(e, &d));
            }
        }
        result
    }

    fn step_inner<F, E>(&mut self, weight: f64, close: bool, forward: F) -> Result<StepReport>
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
        let loss = forward(&ctx)
            .map_err(Into::into)
            .context("the forward closure failed")?;
        let loss = scalar_loss(loss)?;
        let m1 = Mark::now(&device)?;

        // scale the loss, backward
        let loss_scale = self.current_scale()?;
        let grads = self
            .scale_loss(&loss, &loss_scale)?
            .backward()
            .context("backward failed")?;
        let m2 = Mark::now(&device)?;

        // accumulate; at the boundary: unscale and check, clip, update, update the scale
        if self.check_coverage_next {
            self.check_coverage(&params, &grads)?;
        }
        let keep_raw = self.config.accumulation_steps == 1;
        self.grads.accumulate(&params, &grads, weight, keep_raw)?;
        drop(grads);
        if let Some(d) = &mut self.dist {
            d.note_micro_batch(weight); // dist: this rank's weight in the global normaliser
        }
        let lr = self.config.schedule.lr(self.boundaries);
        let mut stats = None;
        if close || self.grads.micro_steps() >= self.config.accumulation_steps {
            if let Some(d) = &mut self.dist {
                // dist: global gradient before clipping, norm and found_inf
                d.reduce_gradients(&params, &mut self.grads, keep_raw)?;
            }
            if let Some(v) = self.config.clip_value {
                self.clip_values(v, &loss_scale)?;
            }
            let s = self.unscale_and_check(&loss_scale)?;
            let s = match &self.dist {
                Some(d) => d.agree_stats(s, self.store.device())?, // dist: every rank skips together
                None => s,
            };
            let applied = self.apply_update(&params, &s, lr)?;
            if applied == Some(true) && !self.optimizer.writes_working_copies() {
                self.store.refresh_working_copies()?;
            }
            self.update_scale(&s, applied)?;
            self.grads.clear();
            self.boundaries += 1;
            stats = Some(s);
        }
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

    /// The scale for this micro-batch: a host value, or a copy of `amp_state[0]` on the device.
    fn current_scale(&self) -> Result<ScaleValue> {
        Ok(match &self.amp_state {
            Some(a) => ScaleValue::Device(a.narrow(0, 0, 1)?.copy()?),
            None => ScaleValue::Host(self.scaler.scale()),
        })
    }

    fn scale_loss(&self, loss: &Tensor, scale: &ScaleValue) -> Result<Tensor> {
        Ok(match scale {
            ScaleValue::Host(s) if *s == 1.0 => loss.clone(),
            ScaleValue::Host(s) => (loss * *s as f64)?,
            ScaleValue::Device(t) => loss.mul(&t.reshape(())?)?,
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

    /// `clip_grad_value_` on the unscaled gradients, done in the scaled space: the buffers hold
    /// `scale * sum_w * g`, so they are clamped to `±v * scale * sum_w` (no device read).
    fn clip_values(&mut self, v: f64, loss_scale: &ScaleValue) -> Result<()> {
        let limit = match loss_scale {
            ScaleValue::Host(s) => Limit::Host(v * *s as f64),
            ScaleValue::Device(t) => Limit::Device((t * v)?),
        };
        self.grads.clamp(&limit)
    }

    fn unscale_and_check(&self, loss_scale: &ScaleValue) -> Result<GradStats> {
        match (&self.amp_state, loss_scale) {
            #[cfg(feature = "cuda")]
            (Some(amp), _) => self
                .grads
                .unscale_and_check_on_device(amp, self.config.max_grad_norm),
            (_, ScaleValue::Host(s)) => self.grads.unscale_and_check(
                *s,
                self.config.max_grad_norm,
                self.imp == Impl::FusedCpu,
            ),
            _ => bail!("device loss scale without the fused CUDA path"),
        }
    }

    fn apply_update(
        &mut self,
        params: &[Param],
        stats: &GradStats,
        lr: f64,
    ) -> Result<Option<bool>> {
        let inputs = StepInputs {
            stats,
            lr,
            amp_state: self.amp_state.as_ref(),
            seed: self.boundaries,
            stochastic_rounding: self.config.stochastic_rounding,
        };
        let Some((d, owners)) = Self::zero1(&self.dist) else {
            return self.optimizer.step(params, self.grads.buffers(), inputs);
        };
        // dist: ZeRO-1, update the owned parameters, then every owner broadcasts its own
        let rank = d.collective().rank();
        let owned = crate::dist::zero::owned_grads(self.grads.buffers(), owners, rank);
        let applied = self.optimizer.step(params, &owned, inputs)?;
        crate::dist::zero::broadcast_owned(d.collective(), params, owners, |p| {
            if let Some(w) = &p.working {
                w.set(&p.master.as_tensor().to_dtype(w.dtype())?)?;
            }
            Ok(())
        })?;
        Ok(applied)
    }

    /// The optimizer state by name (`"{param}.exp_avg"`, ...), as checkpoints save it. With
    /// ZeRO-1 every rank gathers the owners' state, so the result is the full state on every
    /// rank (collective: call it on every rank).
    pub fn optimizer_state(&self) -> Result<Vec<(String, Tensor)>> {
        let params = self.store.params();
        let local = self.optimizer.state_tensors(&params)?;
        match Self::zero1(&self.dist) {
            Some((d, owners)) => crate::dist::zero::gather_state(
                d.collective(),
                &params,
                owners,
                local,
                self.optimizer.state_suffixes(),
            ),
            None => Ok(local),
        }
    }

    fn update_scale(&mut self, stats: &GradStats, applied: Option<bool>) -> Result<()> {
        match &self.amp_state {
            #[cfg(feature = "cuda")]
            Some(amp) => crate::cuda::scaler::update_scale(amp, stats, self.scaler.config()),
            _ => {
                let found_inf = match applied {
                    Some(a) => !a,
                    None => stats.read()?.found_inf,
                };
                self.applied_steps += u64::from(!found_inf);
                self.scaler.update(found_inf);
                Ok(())
            }
        }
    }

    /// The counters and scaler state (device reads on the fused CUDA path). Only meaningful at
    /// an accumulation boundary; errors in the middle of an accumulation window.
    pub fn state(&self) -> Result<EngineState> {
        if self.grads.micro_steps() != 0 {
            bail!("Engine::state: {} micro-batches are accumulated; checkpoint at an accumulation boundary", self.grads.micro_steps());
        }
        Ok(EngineState {
            boundaries: self.boundaries,
            applied_steps: self.optimizer_steps()?,
            scaler: self.scaler_state()?,
        })
    }

    /// Restores counters, scaler state and optimizer state (see [`Optimizer::load_state_tensors`]).
    /// Parameters are restored separately, into the store (then call
    /// [`ParamStore::refresh_working_copies`]). Nothing changes when an error is returned.
    pub fn load_state(
        &mut self,
        state: &EngineState,
        optimizer: &std::collections::HashMap<String, Tensor>,
    ) -> Result<()> {
        let params = self.store.params();
        match Self::zero1(&self.dist) {
            Some((d, owners)) => {
                // dist: ZeRO-1 keeps the state of this rank's share only
                let rank = d.collective().rank();
                let mine: std::collections::HashMap<String, Tensor> = params
                    .iter()
                    .zip(owners)
                    .filter(|(_, &o)| o == rank)
                    .flat_map(|(p, _)| {
                        let prefix = format!("{}.", p.name);
                        optimizer
                            .iter()
                            .filter(move |(k, _)| {
                                k.strip_prefix(&prefix).is_some_and(|r| !r.contains('.'))
                            })
                            .map(|(k, v)| (k.clone(), v.clone()))
                    })
                    .collect();
                self.optimizer
                    .load_state_tensors(&params, &mine, state.applied_steps)?
            }
            None => self
                .optimizer
                .load_state_tensors(&params, optimizer, state.applied_steps)?,
        }
        self.boundaries = state.boundaries;
        self.applied_steps = state.applied_steps;
        self.scaler.load_state(state.scaler);
        if let Some(a) = &self.amp_state {
            let s = state.scaler;
            let v = [
                s.scale,
                s.growth_tracker as f32,
                s.hysteresis_left as f32,
                state.applied_steps as f32,
            ];
            self.amp_state = Some(Tensor::new(&v, a.device())?);
        }
        self.grads.clear();
        Ok(())
    }

    /// Runs the gradient-coverage check again on the next backward.
    pub fn check_gradient_coverage_next_step(&mut self) {
        self.check_coverage_next = true;
    }

    /// The parameter store.
    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// The loss scaler's state (read from the device on the fused CUDA path).
    pub fn scaler_state(&self) -> Result<ScalerState> {
        match &self.amp_state {
            Some(a) => {
                let v: Vec<f32> = a.to_vec1()?;
                Ok(ScalerState {
                    scale: v[0],
                    growth_tracker: v[1] as u32,
                    hysteresis_left: v[2] as u32,
                })
            }
            None => Ok(self.scaler.state()),
        }
    }

    /// The current loss scale (a device read on the fused CUDA path).
    pub fn loss_scale(&self) -> Result<f32> {
        Ok(self.scaler_state()?.scale)
    }

    /// The loss scaler (its configuration; use [`Self::scaler_state`] for the state).
    pub fn scaler(&self) -> &LossScaler {
        &self.scaler
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
        match &self.amp_state {
            Some(a) => Ok(a.to_vec1::<f32>()?[3] as u64),
            None => Ok(self.applied_steps),
        }
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
