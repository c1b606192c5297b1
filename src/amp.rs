//! `AmpState`: the engine's mixed-precision bookkeeping — the loss scale, the growth tracker,
//! hysteresis and the count of applied optimizer steps — on the host or on the device, decided
//! once, when the engine is built (the device when the fused CUDA path runs, so that nothing
//! in a step waits for it).
//!
//! The state machine is [`crate::scaler`]'s on both sides (kernels/scaler.cu mirrors it). The
//! per-parameter step counts that bias corrections use are optimizer state, kept where
//! `torch.optim` keeps them ([`crate::optim::driver`]), on the same side.

use crate::grads::GradStats;
use crate::scaler::{LossScaler, ScalerConfig, ScalerState};
use anyhow::Result;
use candle_core::{Device, Tensor};

/// The loss scale a micro-batch's backward used: a host value, or a `(1,)` f32 device copy.
#[derive(Debug, Clone)]
pub enum ScaleValue {
    /// On the host.
    Host(f32),
    /// On the device (fused CUDA path).
    Device(Tensor),
}

impl ScaleValue {
    /// `loss * scale` (no copy for a host scale of 1), differentiable with respect to `loss`
    /// only. `loss` is the engine's rank-0 f32 loss; a device scale must have one element on
    /// the loss's device (errors otherwise, as candle's `mul` would).
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        Ok(match self {
            ScaleValue::Host(s) if *s == 1.0 => loss.clone(),
            ScaleValue::Host(s) => (loss * *s as f64)?,
            ScaleValue::Device(t) => loss.apply_op2(&t.reshape(loss.shape())?, ScaleLoss)?,
        })
    }

    /// The value (a device read for a device scale).
    pub fn read(&self) -> Result<f32> {
        Ok(match self {
            ScaleValue::Host(s) => *s,
            ScaleValue::Device(t) => t.to_vec1::<f32>()?[0],
        })
    }
}

/// `loss * scale` with the gradient of `loss` only, `g * scale`: candle's `mul` would also
/// compute (and store, in a zeroed buffer) the gradient of the scale, which nothing reads: two
/// launches per step saved. The product is candle's own `mul` kernel on the storages.
struct ScaleLoss;

impl candle_core::CustomOp2 for ScaleLoss {
    fn name(&self) -> &'static str {
        "scale_loss"
    }

    fn cpu_fwd(
        &self,
        l: &candle_core::CpuStorage,
        ll: &candle_core::Layout,
        s: &candle_core::CpuStorage,
        ls: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::backend::BackendStorage;
        let y = l.binary_impl::<candle_core::op::Mul>(s, ll, ls)?;
        Ok((y, ll.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        l: &candle_core::CudaStorage,
        ll: &candle_core::Layout,
        s: &candle_core::CudaStorage,
        ls: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use candle_core::backend::BackendStorage;
        let y = l.binary_impl::<candle_core::op::Mul>(s, ll, ls)?;
        Ok((y, ll.shape().clone()))
    }

    fn bwd(
        &self,
        _loss: &Tensor,
        scale: &Tensor,
        _scaled: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(g.mul(scale)?), None))
    }
}

/// Loss-scaler state and the applied-step count, on the host or on the device.
#[derive(Debug)]
pub enum AmpState {
    /// CPU paths (and the reference path on any device).
    Host {
        /// The scaler and its state.
        scaler: LossScaler,
        /// Applied (not skipped) optimizer steps.
        applied_steps: u64,
    },
    /// Fused CUDA path.
    Device {
        /// The scaler's configuration.
        config: ScalerConfig,
        /// `[scale, growth_tracker, hysteresis_left]`, f32.
        scaler: Tensor,
        /// `(1,)` i64: applied optimizer steps.
        applied_steps: Tensor,
    },
}

impl AmpState {
    /// The initial state for `config`; on `device` when given (the fused CUDA path), on the
    /// host otherwise. Errors when the configuration is out of range.
    pub fn new(config: ScalerConfig, device: Option<&Device>) -> Result<Self> {
        let scaler = LossScaler::new(config)?;
        let mut amp = AmpState::Host {
            scaler,
            applied_steps: 0,
        };
        if let Some(d) = device {
            amp = amp.into_device(d)?;
        }
        Ok(amp)
    }

    fn into_device(self, device: &Device) -> Result<Self> {
        let AmpState::Host {
            scaler,
            applied_steps,
        } = self
        else {
            return Ok(self);
        };
        let s = scaler.state();
        let v = [s.scale, s.growth_tracker as f32, s.hysteresis_left as f32];
        Ok(AmpState::Device {
            config: scaler.config().clone(),
            scaler: Tensor::new(&v, device)?,
            applied_steps: Tensor::new(&[applied_steps as i64], device)?,
        })
    }

    /// The scaler's configuration.
    pub fn config(&self) -> &ScalerConfig {
        match self {
            AmpState::Host { scaler, .. } => scaler.config(),
            AmpState::Device { config, .. } => config,
        }
    }

    /// The scale for this micro-batch (a device copy on the device: the scale there changes
    /// at the boundary, after this micro-batch's backward was queued).
    pub fn loss_scale(&self) -> Result<ScaleValue> {
        Ok(match self {
            AmpState::Host { scaler, .. } => ScaleValue::Host(scaler.scale()),
            AmpState::Device { scaler, .. } => ScaleValue::Device(scaler.narrow(0, 0, 1)?.copy()?),
        })
    }

    /// After a boundary: counts the step if it was applied and advances the scale. `applied`
    /// is the optimizer's answer when known on the host; otherwise found_inf decides (read on
    /// the host side, read by the kernel on the device side).
    pub fn update(&mut self, stats: &GradStats, applied: Option<bool>) -> Result<()> {
        match self {
            AmpState::Host {
                scaler,
                applied_steps,
            } => {
                let found_inf = match applied {
                    Some(a) => !a,
                    None => stats.read()?.found_inf,
                };
                *applied_steps += u64::from(!found_inf);
                scaler.update(found_inf);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            AmpState::Device {
                config,
                scaler,
                applied_steps,
            } => {
                let t = match stats {
                    GradStats::Device(t) => t.clone(),
                    GradStats::Host(h) => Tensor::new(
                        &[f32::from(u8::from(h.found_inf)), 0.0, 0.0],
                        scaler.device(),
                    )?,
                };
                crate::cuda::scaler::update_scale(scaler, applied_steps, &t, config)
            }
            #[cfg(not(feature = "cuda"))]
            AmpState::Device { .. } => anyhow::bail!("device AmpState in a build without `cuda`"),
        }
    }

    /// The scaler state (a device read on the device).
    pub fn scaler_state(&self) -> Result<ScalerState> {
        match self {
            AmpState::Host { scaler, .. } => Ok(scaler.state()),
            AmpState::Device { scaler, .. } => {
                let v: Vec<f32> = scaler.to_vec1()?;
                Ok(ScalerState {
                    scale: v[0],
                    growth_tracker: v[1] as u32,
                    hysteresis_left: v[2] as u32,
                })
            }
        }
    }

    /// Applied optimizer steps so far (a device read on the device).
    pub fn applied_steps(&self) -> Result<u64> {
        match self {
            AmpState::Host { applied_steps, .. } => Ok(*applied_steps),
            AmpState::Device { applied_steps, .. } => Ok(applied_steps.to_vec1::<i64>()?[0] as u64),
        }
    }

    /// Restores a scaler state and applied-step count (as a checkpoint saved them). Errors,
    /// changing nothing, when the state is invalid ([`ScalerState::validate`]).
    pub fn load(&mut self, state: ScalerState, applied: u64) -> Result<()> {
        state.validate()?;
        match self {
            AmpState::Host {
                scaler,
                applied_steps,
            } => {
                scaler.load_state(state);
                *applied_steps = applied;
            }
            AmpState::Device {
                scaler,
                applied_steps,
                ..
            } => {
                let dev = scaler.device().clone();
                let v = [
                    state.scale,
                    state.growth_tracker as f32,
                    state.hysteresis_left as f32,
                ];
                *scaler = Tensor::new(&v, &dev)?;
                *applied_steps = Tensor::new(&[applied as i64], &dev)?;
            }
        }
        Ok(())
    }
}
