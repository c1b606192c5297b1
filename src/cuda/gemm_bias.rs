//! `y = x @ w^T + b` as one cuBLASLt matmul with the bias in its epilogue
//! (`CUBLASLT_EPILOGUE_BIAS`): the bias is added to the f32 accumulator before the single
//! rounding to the output dtype, so the output is written once. The unfused form (cuBLAS GEMM,
//! then `bias.cu`'s add into a second buffer) writes it, reads it and writes it again.
//!
//! bf16 and f16 only (cudarc's cuBLASLt wrapper runs f32 in TF32, which wick's f32 path does
//! not use unless asked), w contiguous `(n, k)`, x contiguous `(m, k)` in w's dtype, b `(n,)`
//! in w's dtype. The cuBLASLt handle (with its 32 MiB workspace on sm_90) is made once per
//! stream and kept. cuBLASLt is column-major: the row-major `y (m, n)` is the column-major
//! `y^T = w x^T`, so w (column-major `(k, n)`, ld k) is operand A transposed and x (column-major
//! `(k, m)`) is operand B; the bias runs along y^T's rows, the output features.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
use candle_core::cuda::cudarc::driver::CudaView;
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaStream};
use candle_core::{bail, CudaDevice, CudaStorage, DType, Result};
use half::{bf16, f16};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// One cuBLASLt handle per stream (keyed by the stream's address), made on first use.
fn handle(stream: &Arc<CudaStream>) -> Result<Arc<CudaBlasLT>> {
    static HANDLES: OnceLock<Mutex<HashMap<usize, Arc<CudaBlasLT>>>> = OnceLock::new();
    let key = stream.cu_stream() as usize;
    let mut map = HANDLES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(h) = map.get(&key) {
        return Ok(h.clone());
    }
    let h = Arc::new(
        CudaBlasLT::new(stream.clone())
            .map_err(|e| candle_core::Error::Msg(format!("cuBLASLt handle: {e:?}")))?,
    );
    map.insert(key, h.clone());
    Ok(h)
}

/// `y (m, n) = x (m, k) @ w (n, k)^T + b (n,)` into a new buffer, all in `dtype` (bf16 or
/// f16); `x_off`, `w_off`, `b_off`: the operands' first elements in their storages. `Ok(None)`
/// for another dtype (the caller takes the unfused path).
///
/// Errors: a size beyond cuBLASLt's range, or a cuBLASLt failure (no algorithm for the shape
/// included).
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_bias(
    dev: &CudaDevice,
    (m, n, k): (usize, usize, usize),
    x: (&CudaStorage, usize),
    w: (&CudaStorage, usize),
    b: (&CudaStorage, usize),
) -> Result<Option<CudaStorage>> {
    match x.0.dtype() {
        DType::BF16 => Ok(Some(typed::<bf16>(dev, (m, n, k), x, w, b)?)),
        DType::F16 => Ok(Some(typed::<f16>(dev, (m, n, k), x, w, b)?)),
        _ => Ok(None),
    }
}

fn typed<T>(
    dev: &CudaDevice,
    (m, n, k): (usize, usize, usize),
    x: (&CudaStorage, usize),
    w: (&CudaStorage, usize),
    b: (&CudaStorage, usize),
) -> Result<CudaStorage>
where
    T: candle_core::cuda_backend::CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr,
    CudaBlasLT: Matmul<T>,
{
    let i = |v: usize, what: &str| -> Result<i64> {
        match i32::try_from(v) {
            Ok(v) => Ok(v as i64),
            Err(_) => bail!("linear (cuBLASLt): {what} = {v} exceeds cuBLASLt's i32 range"),
        }
    };
    let cfg = MatmulConfig {
        transa: true,
        transb: false,
        transc: false,
        m: i(n, "out")? as u64,
        n: i(m, "rows")? as u64,
        k: i(k, "in")? as u64,
        alpha: 1.0,
        lda: k as i64,
        ldb: k as i64,
        beta: 0.0,
        ldc: n as i64,
        stride_a: None,
        stride_b: None,
        stride_c: None,
        stride_bias: None,
        batch_size: None,
    };
    let (xv, wv, bv) = (view::<T>(x, m * k)?, view::<T>(w, n * k)?, view::<T>(b, n)?);
    let stream = dev.cuda_stream();
    let lt = handle(&stream)?;
    // SAFETY: the output covers m * n elements, each written by the matmul (beta = 0).
    let mut y = unsafe { dev.alloc::<T>(m * n)? };
    // SAFETY: the views cover the operands' m * k, n * k and n elements (bounds-checked by
    // `slice`), the output m * n; everything is on the device's stream, which cuBLASLt uses.
    unsafe { lt.matmul(cfg, &wv, &xv, &mut y, Some(&bv), None) }
        .map_err(|e| candle_core::Error::Msg(format!("linear (cuBLASLt bias epilogue): {e:?}")))?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

/// `len` elements of a storage from element `off`, bounds-checked.
fn view<'a, T>((s, off): (&'a CudaStorage, usize), len: usize) -> Result<CudaView<'a, T>>
where
    T: candle_core::cuda_backend::CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr,
{
    let slice: &CudaSlice<T> = s.as_cuda_slice::<T>()?;
    if off + len > slice.len() {
        bail!("linear (cuBLASLt): an operand's {len} elements from {off} exceed its buffer (internal error)")
    }
    Ok(slice.slice(off..off + len))
}
