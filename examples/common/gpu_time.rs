//! GPU time of a closure for the CUDA examples (`bench_attention`, `profile_gpt_ops`).

use anyhow::Result;
use candle_core::Device;
use wick::timing::{Mark, Span};

/// GPU ms per call of `f`: CUDA events around `iters` calls, after `warmup` calls and a
/// synchronize.
pub fn gpu_ms(
    dev: &Device,
    warmup: usize,
    iters: usize,
    f: &dyn Fn() -> Result<()>,
) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let a = Mark::now(dev)?;
    for _ in 0..iters {
        f()?;
    }
    let b = Mark::now(dev)?;
    Ok(Span::new(a, b).resolve()?.as_secs_f64() * 1e3 / iters as f64)
}
