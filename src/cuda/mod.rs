//! CUDA kernels (feature `cuda`): PTX compiled from `kernels/*.cu` by build.rs, loaded once
//! per device through candle's `CudaDevice::get_or_load_custom_func`, and launched with cudarc
//! on candle's stream, so they are ordered with candle's own kernels without any host
//! synchronisation.
//!
//! Each `kernels/<name>.cu` has a launcher here (the optimizers' in `update`, the ops' in
//! their files under src/ops/, with the shared plumbing in `launch`) and a CPU reference that
//! the tests compare against (`cargo test --features cuda` on a GPU machine). The planning of
//! the multi-tensor launches ([`multi_tensor`]) is plain Rust and builds without `cuda`.

#[cfg(feature = "cuda")]
pub mod accumulate;
#[cfg(feature = "cuda")]
pub mod debug;
#[cfg(feature = "cuda")]
pub(crate) mod gemm;
#[cfg(feature = "cuda")]
pub(crate) mod gemm_bias;
#[cfg(feature = "cuda")]
pub mod grad_norm;
#[cfg(feature = "cuda")]
pub(crate) mod launch;
#[cfg(feature = "cuda")]
pub mod memory;
pub mod multi_tensor;
#[cfg(feature = "cuda")]
pub mod scaler;
#[cfg(feature = "cuda")]
pub(crate) mod tensor_map;
#[cfg(feature = "cuda")]
pub mod update;

/// The embedded PTX modules, one constant per `kernels/*.cu` file.
#[cfg(feature = "cuda")]
pub mod ptx {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

#[cfg(feature = "cuda")]
mod operands;
#[cfg(feature = "cuda")]
pub use operands::*;

/// `Device::new_cuda(ordinal)` (candle's device on the calling thread's default stream) with
/// cudarc's event tracking turned off for its context. In cudarc 0.19 every allocation of a
/// context that tracks events creates two CUDA events (and destroys them when freed), four
/// driver calls of host time per tensor, although the events are only used once a second stream
/// of the context exists (`CudaContext::new_stream`, "multi-stream mode"). wick runs every op on
/// candle's one stream (the data loader's copy stream orders itself with its own events and
/// does not put the context in multi-stream mode), so the events are dead weight there.
///
/// Do not create streams with `CudaContext::new_stream` on this device's context afterwards:
/// tensors allocated now are not synchronised across streams automatically. A build without
/// the `cuda` feature returns candle's error for a missing CUDA backend.
///
/// Errors: no such device, or the driver fails.
pub fn new_device(ordinal: usize) -> candle_core::Result<candle_core::Device> {
    let dev = candle_core::Device::new_cuda(ordinal)?;
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = &dev {
        if !d.cuda_stream().context().is_in_multi_stream_mode() {
            // SAFETY: the context is in single-stream mode, where cudarc never reads the
            // events; the contract above keeps it there.
            unsafe { d.disable_event_tracking() };
        }
    }
    Ok(dev)
}

/// Peak bytes allocated from `dev`'s CUDA memory pool since the last reset, in GB (1e9
/// bytes; the pool's `USED_MEM_HIGH`): what the examples report as peak memory. `None` on the
/// CPU, in a build without the `cuda` feature, or when the driver does not say.
pub fn peak_memory_gb(dev: &candle_core::Device) -> Option<f64> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = dev {
        return memory::memory_stats(d)
            .ok()
            .map(|m| m.peak_allocated as f64 / 1e9);
    }
    let _ = dev;
    None
}

/// Resets `dev`'s pool peaks to the current values (before a measured phase); a no-op on the
/// CPU.
///
/// Errors: the driver call fails.
pub fn reset_peak_memory(dev: &candle_core::Device) -> anyhow::Result<()> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = dev {
        return memory::reset_peak(d);
    }
    let _ = dev;
    Ok(())
}
