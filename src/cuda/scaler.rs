//! Launcher of kernels/scaler.cu: the GradScaler state machine and the applied-step counter,
//! updated on the device from found_inf.

use super::{addr, cuda_device, ptx};
use crate::grads::GradStats;
use crate::scaler::{ScalerConfig, ScalerKind};
use anyhow::Result;
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda::WrapErr;
use candle_core::Tensor;

/// Enqueues the scale update of `amp_state = [scale, growth_tracker, hysteresis_left,
/// applied_steps]` from `stats[0]` (found_inf). Static and disabled scalers only count steps.
pub fn update_scale(amp_state: &Tensor, stats: &GradStats, c: &ScalerConfig) -> Result<()> {
    let stats = stats
        .tensor()
        .ok_or_else(|| anyhow::anyhow!("update_scale needs device stats"))?;
    let dev = cuda_device(amp_state)?;
    let func = dev.get_or_load_custom_func("update_scale", "wick_scaler", ptx::SCALER)?;
    let (amp, st) = (addr(amp_state)?, addr(stats)?);
    let (interval, hyst) = (c.growth_interval as f32, c.hysteresis as f32);
    let dynamic = i32::from(c.kind == ScalerKind::Dynamic);
    let mut b = func.builder();
    b.arg(&amp)
        .arg(&st)
        .arg(&c.growth_factor)
        .arg(&c.backoff_factor)
        .arg(&interval)
        .arg(&hyst);
    b.arg(&c.min_scale).arg(&c.max_scale).arg(&dynamic);
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        })
    }
    .w()?;
    Ok(())
}
