//! CUDA plumbing of the differentiable ops (src/ops/): device pointers of candle storages,
//! output allocation, launch shapes. Kernels take raw pointers; every launch goes to candle's
//! stream.
use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{
    CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop,
};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result};
use half::{bf16, f16};

/// A CUDA storage with its layout: an op's operand as its launcher takes it.
pub(crate) type In<'a> = (&'a CudaStorage, &'a Layout);

/// Runs `f` on the CUDA storage and layout of a tensor an op saved for its backward (`None`
/// passes through as `None`); a saved tensor on another device is an internal error naming `op`
/// and `what`. The storage stays borrowed for the whole of `f`.
pub(crate) fn with_saved<R>(
    op: &str,
    what: &str,
    t: Option<&candle_core::Tensor>,
    f: impl FnOnce(Option<In<'_>>) -> Result<R>,
) -> Result<R> {
    let held = t.map(|t| t.storage_and_layout());
    let cuda = match &held {
        Some((s, l)) => match &**s {
            candle_core::Storage::Cuda(s) => Some((s, *l)),
            _ => bail!("{op}: the saved {what} is not on the GPU (internal error)"),
        },
        None => None,
    };
    f(cuda)
}

/// Threads per block of the row kernels (8 warps, one row each); `NORM_THREADS` in norm.cuh.
pub(crate) const ROW_THREADS: u32 = 256;
/// Rows per block of the row kernels; `NORM_WARPS` in norm.cuh.
pub(crate) const ROW_WARPS: usize = 8;

/// `(rows, cols)` of a tensor normalised over its last dimension, checked for the kernels' i32
/// indices.
pub(crate) fn rows_cols(op: &str, l: &Layout) -> Result<(usize, usize)> {
    let d = *l.dims().last().unwrap_or(&1);
    let rows = l.shape().elem_count().checked_div(d).unwrap_or(0);
    if rows > i32::MAX as usize || d > i32::MAX as usize {
        bail!("{op}: {rows} rows of {d} elements exceed the kernels' i32 range; split the input")
    }
    Ok((rows, d))
}

/// Kernel-name part for a storage dtype.
pub(crate) fn dtype_name(op: &str, d: DType) -> Result<&'static str> {
    Ok(match d {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        d => bail!("{op}: no CUDA kernel for dtype {d:?}; use f32, bf16 or f16"),
    })
}

/// Device address of the first element of a contiguous input, with the guard that orders
/// the read after earlier writes (keep it alive until after the launch).
pub(crate) fn in_ptr<'a>(
    op: &str,
    what: &str,
    s: &'a CudaStorage,
    l: &Layout,
    stream: &'a CudaStream,
) -> Result<(u64, SyncOnDrop<'a>)> {
    let Some((o1, _)) = l.contiguous_offsets() else {
        bail!("{op}: {what} must be contiguous (internal error: the public function makes it so)")
    };
    macro_rules! p {
        ($t:ty) => {{
            let (p, g) = s.as_cuda_slice::<$t>()?.device_ptr(stream);
            (p + (o1 * std::mem::size_of::<$t>()) as u64, g)
        }};
    }
    Ok(match s.dtype() {
        DType::F32 => p!(f32),
        DType::BF16 => p!(bf16),
        DType::F16 => p!(f16),
        DType::U32 => p!(u32),
        d => bail!("{op}: {what} has dtype {d:?}; expected f32, bf16, f16 (or u32 indices)"),
    })
}

/// Device address of an output allocated by [`alloc`].
pub(crate) fn out_ptr<'a>(
    s: &'a mut CudaStorage,
    stream: &'a CudaStream,
) -> Result<(u64, SyncOnDrop<'a>)> {
    Ok(match s.dtype() {
        DType::F32 => s.as_cuda_slice_mut::<f32>()?.device_ptr_mut(stream),
        DType::BF16 => s.as_cuda_slice_mut::<bf16>()?.device_ptr_mut(stream),
        DType::F16 => s.as_cuda_slice_mut::<f16>()?.device_ptr_mut(stream),
        d => bail!("unsupported output dtype {d:?}"),
    })
}

/// An uninitialised buffer of `n` elements (at least one, so that empty outputs are valid
/// allocations).
pub(crate) fn alloc(dev: &CudaDevice, dtype: DType, n: usize) -> Result<CudaStorage> {
    let n = n.max(1);
    // SAFETY: every element the output's shape covers is written by the kernel.
    Ok(unsafe {
        match dtype {
            DType::F32 => CudaStorage::wrap_cuda_slice(dev.alloc::<f32>(n)?, dev.clone()),
            DType::BF16 => CudaStorage::wrap_cuda_slice(dev.alloc::<bf16>(n)?, dev.clone()),
            DType::F16 => CudaStorage::wrap_cuda_slice(dev.alloc::<f16>(n)?, dev.clone()),
            DType::F64 => CudaStorage::wrap_cuda_slice(dev.alloc::<f64>(n)?, dev.clone()),
            d => bail!("unsupported output dtype {d:?}"),
        }
    })
}

/// A zeroed f32 buffer of `n` elements (at least one).
pub(crate) fn zeros_f32(dev: &CudaDevice, n: usize) -> Result<CudaStorage> {
    Ok(CudaStorage::wrap_cuda_slice(
        dev.alloc_zeros::<f32>(n.max(1))?,
        dev.clone(),
    ))
}

/// Launch shape of the one-warp-per-row kernels.
pub(crate) fn row_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(ROW_WARPS) as u32, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launch shape of the grid-stride elementwise kernels (gelu, bias, heads, embedding):
/// 256 threads per block, one block per 256 `threads` of work, at most 4224 blocks (32 per
/// SM of an H100/H200; the loops stride over the rest).
pub(crate) fn grid_stride_cfg(threads: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (threads.div_ceil(256).clamp(1, 132 * 32) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// True when the 16-byte-vector kernels apply: rows of `d` elements of `elem_size` bytes
/// split into whole 16-byte vectors and every pointer is 16-byte aligned.
pub(crate) fn vec_ok(d: usize, elem_size: usize, ptrs: &[u64]) -> bool {
    d % (16 / elem_size) == 0 && ptrs.iter().all(|p| p % 16 == 0)
}
