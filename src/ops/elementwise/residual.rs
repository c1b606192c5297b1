//! The residual add of a transformer block across dtypes, `out = x + f32(y)`: the residual
//! stream `x` is f32 (as in PyTorch under autocast, where a bf16 branch added to the f32 stream
//! promotes to f32) and the branch `y` comes out of a linear layer in the compute dtype.
//! candle needs two graph nodes for it (a cast, whose f32 copy of y is written and read back,
//! then an add); this is one, with one kernel each way. Kernel: `kernels/residual.cu`.

use crate::ops::common::{check_device, check_float, cpu_slice, Elem};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

/// `out = x + y` with `x: (..)` f32 and `y` of x's shape in f32, bf16 or f16 (any layouts);
/// returns f32 (y is widened exactly, the sum rounded once in f32: bit-identical to
/// `x + y.to_dtype(F32)`). Differentiable: `dx = dout`, `dy = dout` rounded to y's dtype, as
/// the backward of that composition gives.
///
/// Errors (no panics): x not f32, y not a float dtype, shapes or devices that differ.
pub fn residual_add(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    if x.dtype() != DType::F32 {
        bail!(
            "residual_add: x (the residual stream) must be f32, found {:?}; cast it with .to_dtype(DType::F32)",
            x.dtype()
        )
    }
    check_float("residual_add", "y", y.dtype())?;
    check_device("residual_add", "y", x, y)?;
    if x.dims() != y.dims() {
        bail!(
            "residual_add: x has shape {:?} but y has {:?}; they must match (no broadcasting)",
            x.dims(),
            y.dims()
        )
    }
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    x.contiguous()?.apply_op2(&y.contiguous()?, ResidualAdd)
}

pub(in crate::ops) struct ResidualAdd;

fn add_cpu<T: Elem>(x: &[f32], y: &[T]) -> Vec<f32> {
    x.iter().zip(y).map(|(a, b)| a + b.to32()).collect()
}

impl CustomOp2 for ResidualAdd {
    fn name(&self) -> &'static str {
        "residual_add"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        y: &CpuStorage,
        ly: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let xs = cpu_slice::<f32>(op, "x", x, lx)?;
        macro_rules! run {
            ($t:ty) => {{
                CpuStorage::F32(add_cpu(xs, cpu_slice::<$t>(op, "y", y, ly)?))
            }};
        }
        Ok((with_type!(op, y.dtype(), run), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        y: &candle_core::CudaStorage,
        ly: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::fwd(x, lx, y, ly)?, lx.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        y: &Tensor,
        _out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dout = dout.detach();
        let dy = dout.to_dtype(y.dtype())?;
        Ok((Some(dout), Some(dy)))
    }
}

/// CUDA launcher for `kernels/residual.cu`.
#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::launch::{alloc, dtype_name, grid_stride_cfg, in_ptr, out_ptr};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, DType, Layout, Result};

    pub(super) fn fwd(
        x: &CudaStorage,
        lx: &Layout,
        y: &CudaStorage,
        ly: &Layout,
    ) -> Result<CudaStorage> {
        let op = "residual_add";
        let dev = x.device();
        let n = lx.shape().elem_count();
        let mut out = alloc(dev, DType::F32, n)?;
        let stream = dev.cuda_stream();
        let name = format!("residual_add_{}", dtype_name(op, y.dtype())?);
        let func =
            dev.get_or_load_custom_func(&name, "wick_ops_residual", crate::cuda::ptx::RESIDUAL)?;
        {
            let (xp, _gx) = in_ptr(op, "x", x, lx, &stream)?;
            let (yp, _gy) = in_ptr(op, "y", y, ly, &stream)?;
            let (op_, _go) = out_ptr(&mut out, &stream)?;
            let n_i = n as i64;
            let mut lb = func.builder();
            lb.arg(&xp).arg(&yp).arg(&op_).arg(&n_i);
            // SAFETY: x, y and out hold n elements (x and out f32, y of the kernel's dtype).
            unsafe { lb.launch(grid_stride_cfg(n)) }.w()?;
        }
        Ok(out)
    }
}
