//! Device memory as the CUDA driver's stream-ordered allocator sees it (candle allocates with
//! `cuMemAllocAsync` from the device's default memory pool): allocated (in use), reserved (held
//! by the pool), their peaks, the free/total memory of the device, and the pool's release
//! threshold — the analogue of PyTorch's caching-allocator statistics and settings
//! (`torch.cuda.memory_allocated`, `memory_reserved`, `max_memory_allocated`).

use anyhow::{Context, Result};
use candle_core::cuda::cudarc::driver::{result, sys};
use candle_core::cuda_backend::CudaDevice;

/// Memory figures in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct MemoryStats {
    /// Bytes handed out by the pool now (`USED_MEM_CURRENT`).
    pub allocated: u64,
    /// Peak of `allocated` since the last [`reset_peak`] (`USED_MEM_HIGH`).
    pub peak_allocated: u64,
    /// Bytes the pool holds from the device now (`RESERVED_MEM_CURRENT`).
    pub reserved: u64,
    /// Peak of `reserved` (`RESERVED_MEM_HIGH`).
    pub peak_reserved: u64,
    /// Free device memory (`cuMemGetInfo`).
    pub free: u64,
    /// Total device memory.
    pub total: u64,
}

fn pool(dev: &CudaDevice) -> Result<sys::CUmemoryPool> {
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().context("binding the CUDA context")?;
    let mut pool = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the device ordinal comes from a live context.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }
        .result()
        .context("cuDeviceGetDefaultMemPool")?;
    Ok(pool)
}

fn get(pool: sys::CUmemoryPool, attr: sys::CUmemPool_attribute) -> Result<u64> {
    let mut v: u64 = 0;
    // SAFETY: these attributes are cuuint64_t values.
    unsafe { sys::cuMemPoolGetAttribute(pool, attr, &mut v as *mut u64 as *mut _) }
        .result()
        .with_context(|| format!("cuMemPoolGetAttribute({attr:?})"))?;
    Ok(v)
}

/// Current memory figures of `dev` (a host call; it does not wait for the stream).
pub fn memory_stats(dev: &CudaDevice) -> Result<MemoryStats> {
    use sys::CUmemPool_attribute::*;
    let p = pool(dev)?;
    let (free, total) = result::mem_get_info().context("cuMemGetInfo")?;
    Ok(MemoryStats {
        allocated: get(p, CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?,
        peak_allocated: get(p, CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
        reserved: get(p, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
        peak_reserved: get(p, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        free: free as u64,
        total: total as u64,
    })
}

/// Peak bytes of the driver's graph memory pool on `dev` (`CU_GRAPH_MEM_ATTR_USED_MEM_HIGH`):
/// what captured CUDA graphs ([`crate::engine::CapturedStep`]) allocated, which the default
/// pool's figures of [`memory_stats`] do not include.
/// Errors: the driver fails.
pub fn graph_memory_peak(dev: &CudaDevice) -> Result<u64> {
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().context("binding the CUDA context")?;
    let mut v: u64 = 0;
    // SAFETY: USED_MEM_HIGH is a cuuint64_t; the device comes from a live context.
    unsafe {
        sys::cuDeviceGetGraphMemAttribute(
            ctx.cu_device(),
            sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_USED_MEM_HIGH,
            &mut v as *mut u64 as *mut _,
        )
    }
    .result()
    .context("cuDeviceGetGraphMemAttribute")?;
    Ok(v)
}

/// Resets the peaks to the current values.
pub fn reset_peak(dev: &CudaDevice) -> Result<()> {
    use sys::CUmemPool_attribute::*;
    let p = pool(dev)?;
    for attr in [
        CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
    ] {
        let mut zero: u64 = 0;
        // SAFETY: resetting a high-water mark takes a cuuint64_t 0.
        unsafe { sys::cuMemPoolSetAttribute(p, attr, &mut zero as *mut u64 as *mut _) }
            .result()
            .context("cuMemPoolSetAttribute")?;
    }
    Ok(())
}

/// Sets how many bytes the pool keeps reserved when the stream synchronises instead of
/// returning them to the device (default 0: everything is released at every synchronisation,
/// and the next step allocates again). `u64::MAX` keeps everything, like PyTorch's caching
/// allocator.
pub fn set_release_threshold(dev: &CudaDevice, bytes: u64) -> Result<()> {
    let p = pool(dev)?;
    let mut v = bytes;
    // SAFETY: the release threshold is a cuuint64_t.
    unsafe {
        sys::cuMemPoolSetAttribute(
            p,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut v as *mut u64 as *mut _,
        )
    }
    .result()
    .context("cuMemPoolSetAttribute(RELEASE_THRESHOLD)")?;
    Ok(())
}

/// True when `err` (or its chain) is a CUDA out-of-memory error.
pub fn is_out_of_memory(err: &anyhow::Error) -> bool {
    err.chain().any(|e| {
        let s = e.to_string();
        s.contains("CUDA_ERROR_OUT_OF_MEMORY") || s.contains("out of memory")
    })
}

/// Adds what to do to an out-of-memory error: free and total memory, what the pool holds, and
/// the usual remedies.
pub fn explain_out_of_memory(err: anyhow::Error, dev: &CudaDevice) -> anyhow::Error {
    let stats = memory_stats(dev).ok();
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let figures = match stats {
        Some(s) => format!(
            "the device has {:.2} GiB free of {:.2} GiB; the allocator holds {:.2} GiB (peak in use {:.2} GiB)",
            gib(s.free),
            gib(s.total),
            gib(s.reserved),
            gib(s.peak_allocated)
        ),
        None => "memory figures unavailable".to_string(),
    };
    err.context(format!(
        "CUDA out of memory: {figures}. Try a smaller micro-batch with gradient accumulation \
         (EngineConfig::accumulation_steps) to keep the same effective batch, bf16-mixed \
         precision (half-size activations), or fewer other processes on this GPU (wick doctor)"
    ))
}
