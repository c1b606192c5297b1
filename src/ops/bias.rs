//! Bias add over the last dimension, fused and differentiable:
//!
//! ```text
//! y  = x + b          x: (.., C), b: (C,)
//! dx = dy             (passed through, no copy)
//! db = Σ_rows dy      (f32 accumulation)
//! ```
//! candle's `broadcast_add` runs a strided-index kernel forward (0.45 ms for gptmini's
//! 16384 x 1536 bf16 MLP activations on an H200, about 9x the cost of the 16-byte-vector
//! kernel here), and its backward reduces the rows with one thread block per column reading a
//! strided column. Here the column sum is a `ones(1, N) @ dy` GEMM for half dtypes on CUDA
//! (cuBLAS, f32 accumulation; exact ones) and an f32 `sum` otherwise (a TF32 GEMM would round
//! f32 dy; candle's CPU half GEMM accumulates in the half dtype).
//! Kernels: `kernels/bias.cu`.

use super::{check_float, cpu_slice, Elem};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

/// `x + b` broadcast over the leading dimensions of `x: (.., C)`, `b: (C,)`; the result has x's
/// dtype (b is cast to it, differentiably, when it differs). Arithmetic in f32.
///
/// Errors (no panics): b not `(C,)` for x's last dimension `C`; a dtype other than
/// f32/bf16/f16; devices that differ.
pub fn bias_add(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    check_float("bias_add", "x", x.dtype())?;
    check_float("bias_add", "b", b.dtype())?;
    super::check_device("bias_add", "b", x, b)?;
    let c = x.dims().last().copied().unwrap_or(0);
    if x.rank() == 0 || b.dims() != [c] {
        bail!(
            "bias_add: b must be (C,) for x (.., C); found x {:?} and b {:?}",
            x.dims(),
            b.dims()
        )
    }
    let b = if b.dtype() == x.dtype() {
        b.clone()
    } else {
        b.to_dtype(x.dtype())?
    };
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    x.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd)
}

struct BiasAdd;

/// True when candle's cuBLAS switch makes `dtype` GEMMs accumulate in that dtype
/// (`PerfSettings::reduced_precision_reductions`): the column sum then takes the f32 path.
fn half_gemm_reduces_in_half(dtype: DType) -> bool {
    #[cfg(feature = "cuda")]
    {
        match dtype {
            DType::F16 => candle_core::cuda::gemm_reduced_precision_f16(),
            DType::BF16 => candle_core::cuda::gemm_reduced_precision_bf16(),
            _ => false,
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = dtype;
        false
    }
}

fn fwd_cpu<T: Elem>(x: &[T], b: &[T]) -> Vec<T> {
    let c = b.len();
    let mut y = vec![T::from32(0.0); x.len()];
    y.par_chunks_mut(c)
        .zip(x.par_chunks(c))
        .for_each(|(yr, xr)| {
            for ((o, v), w) in yr.iter_mut().zip(xr).zip(b) {
                *o = T::from32(v.to32() + w.to32());
            }
        });
    y
}

/// Storage-level forward, `x + b` for a contiguous `x: (.., C)` and `b: (C,)` of the same
/// dtype, into a new buffer. Shared with ops that end in a bias add (`linear`), so
/// that their bias has exactly this op's numerics.
pub(super) fn add_cpu(
    x: &CpuStorage,
    lx: &Layout,
    b: &CpuStorage,
    lb: &Layout,
) -> Result<CpuStorage> {
    let op = "bias_add";
    if x.dtype() != b.dtype() {
        bail!(
            "{op}: x is {:?} but b is {:?} (internal error: callers cast b)",
            x.dtype(),
            b.dtype()
        )
    }
    macro_rules! run {
        ($t:ty) => {{
            let xv = cpu_slice::<$t>(op, "x", x, lx)?;
            let bv = cpu_slice::<$t>(op, "b", b, lb)?;
            <$t as candle_core::WithDType>::to_cpu_storage_owned(fwd_cpu(xv, bv))
        }};
    }
    Ok(with_type!(op, x.dtype(), run))
}

/// [`add_cpu`] on the GPU (the kernels of `kernels/bias.cu`).
#[cfg(feature = "cuda")]
pub(super) fn add_cuda(
    x: &candle_core::CudaStorage,
    lx: &Layout,
    b: &candle_core::CudaStorage,
    lb: &Layout,
) -> Result<candle_core::CudaStorage> {
    if x.dtype() != b.dtype() {
        bail!(
            "bias_add: x is {:?} but b is {:?} (internal error: callers cast b)",
            x.dtype(),
            b.dtype()
        )
    }
    cuda::fwd(x, lx, b, lb)
}

/// The bias gradient of `dy: (.., C)`: the sum over all rows, `(C,)`: in dy's dtype from the
/// CUDA half GEMM, in f32 from the f32 sums (the caller casts to the bias's dtype, so an f32
/// bias master gets the f32 sum unrounded). Shared with `linear`'s backward.
pub(super) fn column_sum(dy: &Tensor, c: usize) -> Result<Tensor> {
    let rows = dy.elem_count() / c.max(1);
    let dy2 = dy.reshape((rows, c))?;
    // CUDA, half dtypes: cuBLAS GEMM (f32 accumulation); elsewhere an f32 sum (candle's CPU
    // half GEMM accumulates in the half dtype, and a TF32 GEMM would round f32 inputs)
    match dy.dtype() {
        DType::BF16 | DType::F16
            if dy.device().is_cuda() && !half_gemm_reduces_in_half(dy.dtype()) =>
        {
            Tensor::ones((1, rows), dy.dtype(), dy.device())?
                .matmul(&dy2)?
                .reshape(c)
        }
        DType::F32 => dy2.sum(0),
        _ => dy2.to_dtype(DType::F32)?.sum(0),
    }
}

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "bias_add"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok((add_cpu(x, lx, b, lb)?, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((add_cuda(x, lx, b, lb)?, lx.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let db = column_sum(dy, b.dim(0)?)?;
        let db = if db.dtype() == b.dtype() {
            db
        } else {
            db.to_dtype(b.dtype())?
        };
        Ok((Some(dy.clone()), crate::grad_sink::offer(b, Some(db))?))
    }
}

/// CUDA launcher for `kernels/bias.cu`.
#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::launch::{alloc, dtype_name, grid_stride_cfg, in_ptr, out_ptr, vec_ok};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, Layout, Result};

    const MODULE: &str = "wick_ops_bias";

    pub(super) fn fwd(
        x: &CudaStorage,
        lx: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> Result<CudaStorage> {
        let op = "bias_add";
        let dev = &x.device;
        let n = lx.shape().elem_count();
        let c = lb.shape().elem_count();
        let mut y = alloc(dev, x.dtype(), n)?;
        {
            let stream = dev.cuda_stream();
            let (xp, _gx) = in_ptr(op, "x", x, lx, &stream)?;
            let (bp, _gb) = in_ptr(op, "b", b, lb, &stream)?;
            let (yp, _gy) = out_ptr(&mut y, &stream)?;
            let elem = x.dtype().size_in_bytes();
            let vec = vec_ok(c, elem, &[xp, bp, yp]);
            let name = format!(
                "bias_add_{}{}",
                dtype_name(op, x.dtype())?,
                if vec { "_vec" } else { "" }
            );
            let func = dev.get_or_load_custom_func(&name, MODULE, crate::cuda::ptx::BIAS)?;
            let per_thread = if vec { 16 / elem } else { 1 };
            let cfg = grid_stride_cfg(n.div_ceil(per_thread));
            let (n_i, c_i) = (n as i64, c as i32);
            let mut lb = func.builder();
            lb.arg(&xp).arg(&bp).arg(&yp).arg(&n_i).arg(&c_i);
            // SAFETY: x and y hold n elements, b holds c, of the kernel's dtype.
            unsafe { lb.launch(cfg) }.w()?;
        }
        Ok(y)
    }
}
