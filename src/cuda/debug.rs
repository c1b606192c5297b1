//! Launcher of kernels/debug.cu (test helpers).

use super::ptx;
use anyhow::Result;
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda::WrapErr;
use candle_core::cuda_backend::CudaDevice;

/// Keeps candle's stream on `dev` busy for about `cycles` GPU clock cycles (one thread).
pub fn spin(dev: &CudaDevice, cycles: i64) -> Result<()> {
    let func = dev.get_or_load_custom_func("spin_cycles", "wick_debug", ptx::DEBUG)?;
    let mut b = func.builder();
    b.arg(&cycles);
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
