//! Loss scaling for f16 training, with the semantics and defaults of PyTorch's
//! `torch.amp.GradScaler` (`_amp_update_scale_`), plus optional hysteresis with the semantics
//! of DeepSpeed's `DynamicLossScaler` (`deepspeed/runtime/fp16/loss_scaler.py`,
//! `consecutive_hysteresis=False`) and a positive floor for the scale (DeepSpeed's
//! `min_loss_scale`).
//!
//! State machine (dynamic), after each optimizer step with `found_inf`:
//! ```text
//! if found_inf:
//!     growth_tracker = 0
//!     if hysteresis_left <= 1:            # with hysteresis = 1 (default): every overflow
//!         scale = max(scale * backoff_factor, min_scale)
//!     else:
//!         hysteresis_left -= 1            # tolerated; not refilled by a backoff
//! else:
//!     growth_tracker += 1
//!     if growth_tracker == growth_interval:
//!         if isfinite(scale * growth_factor): scale = min(scale * growth_factor, max_scale)
//!         growth_tracker = 0
//!         hysteresis_left = hysteresis    # refilled only when the scale grows
//! ```
//! With hysteresis 2 and overflows T T T T F T T from 65536 the scales are 65536, 32768,
//! 16384, 8192, 8192, 4096, 2048, as DeepSpeed's. With hysteresis 1 it is GradScaler's
//! machine, except that the scale never goes below `min_scale` (> 0; GradScaler has no floor
//! and can halve to exactly 0, after which `loss * 0` trains nothing). A step with
//! `found_inf` is skipped by the engine whatever the scaler kind.

use crate::precision::Precision;

/// The default floor of the loss scale: 2^-14, the smallest normal f16.
pub const DEFAULT_MIN_SCALE: f32 = 6.103_515_6e-5;

/// How the loss is scaled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScalerKind {
    /// No scaling (scale 1). Non-finite gradients still skip the step.
    None,
    /// A fixed scale.
    Static(f32),
    /// GradScaler-style dynamic scaling.
    Dynamic,
}

/// Loss scaler configuration. Defaults (for [`ScalerKind::Dynamic`]) are PyTorch's:
/// `init_scale = 65536`, `growth_factor = 2`, `backoff_factor = 0.5`, `growth_interval = 2000`.
#[derive(Debug, Clone, PartialEq)]
pub struct ScalerConfig {
    /// Scaling mode.
    pub kind: ScalerKind,
    /// Initial scale (dynamic).
    pub init_scale: f32,
    /// Multiplier applied after `growth_interval` clean steps (> 1).
    pub growth_factor: f32,
    /// Multiplier applied on overflow (in (0, 1)).
    pub backoff_factor: f32,
    /// Clean steps between growths (≥ 1).
    pub growth_interval: u32,
    /// Overflows tolerated before backing off (1 = back off on every overflow, GradScaler's
    /// behaviour; DeepSpeed's `hysteresis`, refilled only when the scale grows).
    pub hysteresis: u32,
    /// Lower bound for the scale: finite and > 0. Default 2^-14 (the smallest normal f16),
    /// far below any scale f16 training recovers from, and far above the f32 underflow whose
    /// reciprocal is inf.
    pub min_scale: f32,
    /// Upper bound for the scale.
    pub max_scale: f32,
}

impl Default for ScalerConfig {
    fn default() -> Self {
        Self {
            kind: ScalerKind::Dynamic,
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            hysteresis: 1,
            min_scale: DEFAULT_MIN_SCALE,
            max_scale: f32::MAX,
        }
    }
}

impl ScalerConfig {
    /// The default for a precision: f16 → dynamic; bf16 and fp32 → none.
    pub fn default_for(precision: Precision) -> Self {
        let kind = match precision {
            Precision::F16Mixed => ScalerKind::Dynamic,
            Precision::Bf16Mixed | Precision::Fp32 => ScalerKind::None,
        };
        Self {
            kind,
            ..Self::default()
        }
    }

    /// Checks the ranges documented on each field.
    pub fn validate(&self) -> anyhow::Result<()> {
        let init = match self.kind {
            ScalerKind::Static(s) => s,
            _ => self.init_scale,
        };
        anyhow::ensure!(
            init.is_finite() && init > 0.0,
            "loss scale must be finite and > 0, got {init}"
        );
        anyhow::ensure!(
            self.growth_factor > 1.0,
            "growth_factor must be > 1, got {}",
            self.growth_factor
        );
        anyhow::ensure!(
            self.backoff_factor > 0.0 && self.backoff_factor < 1.0,
            "backoff_factor must be in (0, 1), got {}",
            self.backoff_factor
        );
        anyhow::ensure!(self.growth_interval >= 1, "growth_interval must be >= 1");
        anyhow::ensure!(self.hysteresis >= 1, "hysteresis must be >= 1");
        anyhow::ensure!(
            self.min_scale.is_finite() && self.min_scale > 0.0,
            "min_scale must be finite and > 0 (a scale of 0 trains nothing), got {}",
            self.min_scale
        );
        anyhow::ensure!(
            self.min_scale <= self.max_scale,
            "min_scale must be <= max_scale"
        );
        Ok(())
    }
}

/// The scaler's mutable state (what a checkpoint records), named as in GradScaler.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScalerState {
    /// Current loss scale.
    pub scale: f32,
    /// Consecutive clean steps since the last growth or overflow.
    pub growth_tracker: u32,
    /// Overflows still tolerated before the next backoff.
    pub hysteresis_left: u32,
}

impl ScalerState {
    /// Checks what a checkpoint may hold: a finite scale > 0. `Engine::state` (and so every
    /// save) and checkpoint loading both apply it, so what `save` writes, `load` accepts.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.scale.is_finite() && self.scale > 0.0,
            "invalid loss scale {} (must be finite and > 0)",
            self.scale
        );
        Ok(())
    }
}

/// A loss scaler: multiplies the loss by `scale` before backward and updates `scale` from
/// `found_inf` after each optimizer step.
#[derive(Debug, Clone)]
pub struct LossScaler {
    config: ScalerConfig,
    state: ScalerState,
}

impl LossScaler {
    /// Builds a scaler. Errors when the configuration is out of range.
    pub fn new(config: ScalerConfig) -> anyhow::Result<Self> {
        config.validate()?;
        let scale = match config.kind {
            ScalerKind::None => 1.0,
            ScalerKind::Static(s) => s,
            ScalerKind::Dynamic => config.init_scale,
        };
        let state = ScalerState {
            scale,
            growth_tracker: 0,
            hysteresis_left: config.hysteresis,
        };
        Ok(Self { config, state })
    }

    /// The current scale (1 when scaling is off).
    pub fn scale(&self) -> f32 {
        self.state.scale
    }

    /// The configuration.
    pub fn config(&self) -> &ScalerConfig {
        &self.config
    }

    /// The state, for checkpoints.
    pub fn state(&self) -> ScalerState {
        self.state
    }

    /// Restores a state saved by [`Self::state`].
    pub fn load_state(&mut self, state: ScalerState) {
        self.state = state;
    }

    /// Advances the state machine after an optimizer step (see the module docs).
    pub fn update(&mut self, found_inf: bool) {
        if self.config.kind != ScalerKind::Dynamic {
            return;
        }
        let c = &self.config;
        let s = &mut self.state;
        if found_inf {
            s.growth_tracker = 0;
            if s.hysteresis_left <= 1 {
                s.scale = (s.scale * c.backoff_factor).max(c.min_scale);
            } else {
                s.hysteresis_left -= 1;
            }
        } else {
            s.growth_tracker += 1;
            if s.growth_tracker >= c.growth_interval {
                let grown = s.scale * c.growth_factor;
                if grown.is_finite() {
                    s.scale = grown.min(c.max_scale);
                }
                s.growth_tracker = 0;
                s.hysteresis_left = c.hysteresis;
            }
        }
    }
}
