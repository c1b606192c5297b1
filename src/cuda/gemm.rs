//! Row-major GEMMs on device addresses, through candle's cuBLAS handle (so on candle's
//! stream), with the `alpha` and `beta` that candle's `matmul` does not expose:
//!
//! ```text
//! C = alpha op(A) op(B) + beta C      op(A): (m, k), op(B): (k, n), C: (m, n) row-major
//! ```
//!
//! `beta = 1` accumulates into an existing output (no separate add pass) and the leading
//! dimensions let an operand or the output be a column block of a wider matrix. The compute
//! type is candle's for the same dtype (`CUBLAS_COMPUTE_32F`, or its reduced-precision modes
//! when `candle_core::cuda::set_gemm_reduced_precision_*` turned them on), so results equal
//! candle's `matmul` on the same operands.
//!
//! cuBLAS is column-major: a row-major `C = op(A) op(B)` is the column-major
//! `C^T = op(B)^T op(A)^T`, which is the call made below with the operands swapped.

use candle_core::cuda::cudarc::cublas::{result, sys};
use candle_core::{bail, CudaDevice, DType, Result};
use std::ffi::c_void;

/// One operand: a row-major matrix at device address `ptr` with row stride `ld` elements,
/// used as stored (`trans = false`) or transposed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Operand {
    pub ptr: u64,
    pub ld: usize,
    pub trans: bool,
}

impl Operand {
    /// The matrix as stored.
    pub fn n(ptr: u64, ld: usize) -> Self {
        Self {
            ptr,
            ld,
            trans: false,
        }
    }

    /// The transpose of the stored matrix.
    pub fn t(ptr: u64, ld: usize) -> Self {
        Self {
            ptr,
            ld,
            trans: true,
        }
    }
}

fn cuda_type(dtype: DType) -> Result<(sys::cudaDataType_t, sys::cublasComputeType_t)> {
    use candle_core::cuda as c;
    use sys::cublasComputeType_t as ct;
    use sys::cudaDataType_t as dt;
    Ok(match dtype {
        DType::F32 if c::gemm_reduced_precision_f32() => (dt::CUDA_R_32F, ct::CUBLAS_COMPUTE_32F_FAST_TF32),
        DType::F32 => (dt::CUDA_R_32F, ct::CUBLAS_COMPUTE_32F),
        DType::BF16 if c::gemm_reduced_precision_bf16() => (dt::CUDA_R_16BF, ct::CUBLAS_COMPUTE_32F_FAST_16BF),
        DType::BF16 => (dt::CUDA_R_16BF, ct::CUBLAS_COMPUTE_32F),
        DType::F16 => (dt::CUDA_R_16F, ct::CUBLAS_COMPUTE_32F),
        d => bail!("gemm: no cuBLAS GEMM for dtype {d:?}; use f32, bf16 or f16"),
    })
}

/// `C = alpha op(A) op(B) + beta C` with `(m, n, k)` the GEMM's sizes; every operand and the
/// output in `dtype`, scalars in f32 (the compute type's scale type). The caller keeps the
/// addresses valid (their storages' guards alive) until the call returns; the work is queued on
/// candle's stream.
///
/// Errors: a size or leading dimension beyond cuBLAS's i32 range, a dtype other than
/// f32/bf16/f16, or a cuBLAS failure.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    dev: &CudaDevice,
    dtype: DType,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    a: Operand,
    b: Operand,
    beta: f32,
    c: u64,
    ldc: usize,
) -> Result<()> {
    let i = |v: usize, what: &str| -> Result<i32> {
        i32::try_from(v).or_else(|_| bail!("gemm: {what} = {v} exceeds cuBLAS's i32 range"))
    };
    let (data, compute) = cuda_type(dtype)?;
    let op = |t: bool| {
        if t {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let blas = dev.cublas_handle();
    // SAFETY: the addresses are live device allocations on this device sized for the shapes
    // (the callers' contract); cuBLAS runs on candle's stream, ordered with the kernels that
    // wrote them.
    unsafe {
        result::gemm_ex(
            *blas.handle(),
            op(b.trans),
            op(a.trans),
            i(n, "n")?,
            i(m, "m")?,
            i(k, "k")?,
            &alpha as *const f32 as *const c_void,
            b.ptr as *const c_void,
            data,
            i(b.ld, "ldb")?,
            a.ptr as *const c_void,
            data,
            i(a.ld, "lda")?,
            &beta as *const f32 as *const c_void,
            c as *mut c_void,
            data,
            i(ldc, "ldc")?,
            compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
        )
        .map_err(|e| candle_core::Error::Msg(format!("gemm: cuBLAS failed: {e:?}")))
    }
}
