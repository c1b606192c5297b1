//! `y = x @ w^T + b` as one cuBLASLt matmul with the bias in its epilogue
//! (`CUBLASLT_EPILOGUE_BIAS`): the bias is added to the f32 accumulator before the single
//! rounding to the output dtype, so the output is written once. The unfused form (cuBLAS GEMM,
//! then `bias.cu`'s add into a second buffer) writes it, reads it and writes it again.
//!
//! bf16 and f16 only (cudarc's cuBLASLt wrapper runs f32 in TF32, which wick's f32 path does
//! not use unless asked), w contiguous `(n, k)`, x contiguous `(m, k)` in w's dtype, b `(n,)`
//! in w's dtype, `k` and `n` multiples of 8 and every operand 16-byte aligned. The cuBLASLt
//! handle (with its 32 MiB workspace on sm_90) is made once per thread and device and kept. cuBLASLt is column-major: the row-major `y (m, n)` is the column-major
//! `y^T = w x^T`, so w (column-major `(k, n)`, ld k) is operand A transposed and x (column-major
//! `(k, m)`) is operand B; the bias runs along y^T's rows, the output features.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
use candle_core::cuda::cudarc::driver::CudaSlice;
use candle_core::cuda::cudarc::driver::CudaView;
use candle_core::cuda_backend::DeviceId;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Result};
use half::{bf16, f16};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

/// The calling thread's cuBLASLt handle for `dev`, made on first use. Per thread because
/// candle's devices launch on the calling thread's own stream (cudarc names every per-thread
/// stream alike), and because a handle's workspace must not serve two matmuls at once.
fn handle(dev: &CudaDevice) -> Result<Arc<CudaBlasLT>> {
    thread_local! {
        static HANDLES: RefCell<HashMap<DeviceId, Arc<CudaBlasLT>>> = RefCell::new(HashMap::new());
    }
    HANDLES.with(|h| {
        let mut map = h.borrow_mut();
        if let Some(h) = map.get(&dev.id()) {
            return Ok(h.clone());
        }
        let lt = CudaBlasLT::new(dev.cuda_stream())
            .map_err(|e| candle_core::Error::Msg(format!("cuBLASLt handle: {e:?}")))?;
        let lt = Arc::new(lt);
        map.insert(dev.id(), lt.clone());
        Ok(lt)
    })
}

/// `y (m, n) = x (m, k) @ w (n, k)^T + b (n,)` into a new buffer, all in x's dtype (bf16 or
/// f16); the second member of each operand pair is its first element in its storage.
/// `Ok(None)` where the epilogue is not taken (the caller runs the unfused path): another
/// dtype, `k` or `n` not a multiple of 8, or an operand not 16-byte aligned (cuBLASLt's
/// heuristic assumes aligned operands and rows).
///
/// Errors: a size beyond cuBLASLt's range, or a cuBLASLt failure (no algorithm for the shape
/// included).
pub(crate) fn linear_bias(
    dev: &CudaDevice,
    (m, n, k): (usize, usize, usize),
    x: (&CudaStorage, usize),
    w: (&CudaStorage, usize),
    b: (&CudaStorage, usize),
) -> Result<Option<CudaStorage>> {
    let aligned = [x.1, w.1, b.1].iter().all(|off| (off * 2) % 16 == 0);
    if n % 8 != 0 || k % 8 != 0 || !aligned {
        return Ok(None);
    }
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
    let lt = handle(dev)?;
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
