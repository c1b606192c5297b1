//! Launcher of kernels/scaler.cu's `update_scale`: the loss-scale state machine of
//! [`crate::scaler`] and the applied-step counter, updated on the device from found_inf.

use super::{addr, cuda_device, ptx};
use crate::scaler::{ScalerConfig, ScalerKind};
use anyhow::Result;
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda::WrapErr;
use candle_core::Tensor;

/// Enqueues the update of `scaler = [scale, growth_tracker, hysteresis_left]` (f32) and of
/// `applied_steps` (`(1,)` i64) from `stats[0]` (found_inf). Static and disabled scalers only
/// count steps. No host synchronisation.
pub fn update_scale(
    scaler: &Tensor,
    applied_steps: &Tensor,
    stats: &Tensor,
    c: &ScalerConfig,
) -> Result<()> {
    let dev = cuda_device(scaler)?;
    let func = dev.get_or_load_custom_func("update_scale", "wick_scaler", ptx::SCALER)?;
    let (sc, ap, st) = (addr(scaler)?, addr(applied_steps)?, addr(stats)?);
    let (interval, hyst) = (c.growth_interval as f32, c.hysteresis as f32);
    let dynamic = i32::from(c.kind == ScalerKind::Dynamic);
    let mut b = func.builder();
    b.arg(&sc)
        .arg(&ap)
        .arg(&st)
        .arg(&c.growth_factor)
        .arg(&c.backoff_factor)
        .arg(&interval)
        .arg(&hyst);
    b.arg(&c.min_scale).arg(&c.max_scale).arg(&dynamic);
    // SAFETY: scaler is 3 f32, applied_steps one i64, stats 3 f32, all on this device.
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
