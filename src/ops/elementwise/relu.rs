//! ReLU's backward in one kernel, for [`crate::ops::act_linear`]:
//!
//! ```text
//! dh = dy * (h > 0 ? 1 : 0)        h, dy, dh: (..), one dtype (f32, bf16 or f16)
//! ```
//! The gradient passes where `h > 0` and is 0 elsewhere, `h = 0` included (PyTorch's
//! `threshold_backward(dy, h, 0)`). It is computed as a product, as the two-launch form
//! `dy * sign(relu(h))` did (candle's `sign` and `mul`), so the values are the same bit for bit
//! (`-0` for a negative `dy`, NaN for a non-finite `dy`, where `h <= 0`). Kernel:
//! `kernels/relu.cu`.

use crate::ops::common::{check_device, check_float, cpu_slice, Elem};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

/// `dh = dy * (h > 0)` (module docs) in h's dtype, no graph: `dy` is cast to h's dtype when it
/// differs (as candle's composition cast it).
///
/// Errors (no panics): shapes that differ, a dtype other than f32/bf16/f16, devices that differ.
pub(in crate::ops) fn backward(h: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let op = ReluBwd.name();
    check_float(op, "h", h.dtype())?;
    check_float(op, "dy", dy.dtype())?;
    check_device(op, "dy", h, dy)?;
    if h.dims() != dy.dims() {
        bail!(
            "{op}: h {:?} and dy {:?} differ in shape",
            h.dims(),
            dy.dims()
        )
    }
    if h.elem_count() == 0 {
        return h.zeros_like();
    }
    let dy = if dy.dtype() == h.dtype() {
        dy.contiguous()?
    } else {
        dy.to_dtype(h.dtype())?.contiguous()?
    };
    h.detach().contiguous()?.apply_op2_no_bwd(&dy, &ReluBwd)
}

/// The one-element formula, shared by the CPU path and the tests' expectations.
fn bwd_one(h: f32, dy: f32) -> f32 {
    dy * if h > 0.0 { 1.0 } else { 0.0 }
}

struct ReluBwd;

impl CustomOp2 for ReluBwd {
    fn name(&self) -> &'static str {
        "relu_backward"
    }

    fn cpu_fwd(
        &self,
        h: &CpuStorage,
        lh: &Layout,
        dy: &CpuStorage,
        ldy: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        if lh.dims() != ldy.dims() || h.dtype() != dy.dtype() {
            bail!(
                "{op}: h {:?} and dy {:?} differ (internal error)",
                lh.dims(),
                ldy.dims()
            )
        }
        macro_rules! run {
            ($t:ty) => {{
                let hv = cpu_slice::<$t>(op, "h", h, lh)?;
                let gv = cpu_slice::<$t>(op, "dy", dy, ldy)?;
                let dh: Vec<$t> = hv
                    .par_iter()
                    .zip(gv.par_iter())
                    .map(|(a, g)| <$t>::from32(bwd_one(a.to32(), g.to32())))
                    .collect();
                <$t as candle_core::WithDType>::to_cpu_storage_owned(dh)
            }};
        }
        Ok((with_type!(op, h.dtype(), run), lh.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        h: &candle_core::CudaStorage,
        lh: &Layout,
        dy: &candle_core::CudaStorage,
        ldy: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        if lh.dims() != ldy.dims() || h.dtype() != dy.dtype() {
            bail!(
                "{}: h {:?} and dy {:?} differ (internal error)",
                self.name(),
                lh.dims(),
                ldy.dims()
            )
        }
        Ok((cuda::bwd(h, lh, dy, ldy)?, lh.shape().clone()))
    }
}

/// CUDA launcher for `kernels/relu.cu`.
#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::launch::{alloc, dtype_name, grid_stride_cfg, in_ptr, out_ptr, vec_ok};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, Layout, Result};

    const MODULE: &str = "wick_ops_relu";

    pub(super) fn bwd(
        h: &CudaStorage,
        lh: &Layout,
        dy: &CudaStorage,
        ldy: &Layout,
    ) -> Result<CudaStorage> {
        let op = "relu_backward";
        let dev = &h.device;
        let n = lh.shape().elem_count();
        let mut dh = alloc(dev, h.dtype(), n)?;
        {
            let stream = dev.cuda_stream();
            let (hp, _gh) = in_ptr(op, "h", h, lh, &stream)?;
            let (gp, _gg) = in_ptr(op, "dy", dy, ldy, &stream)?;
            let (dp, _gd) = out_ptr(&mut dh, &stream)?;
            let elem = h.dtype().size_in_bytes();
            let vec = vec_ok(n, elem, &[hp, gp, dp]);
            let name = format!(
                "relu_bwd_{}{}",
                dtype_name(op, h.dtype())?,
                if vec { "_vec" } else { "" }
            );
            let func = dev.get_or_load_custom_func(&name, MODULE, crate::cuda::ptx::RELU)?;
            let per_thread = if vec { 16 / elem } else { 1 };
            let cfg = grid_stride_cfg(n.div_ceil(per_thread));
            let n_i = n as i64;
            let mut lb = func.builder();
            lb.arg(&hp).arg(&gp).arg(&dp).arg(&n_i);
            // SAFETY: h, dy and dh hold n elements of the kernel's dtype.
            unsafe { lb.launch(cfg) }.w()?;
        }
        Ok(dh)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn relu_backward_masks_at_zero_and_below_in_every_dtype() -> Result<()> {
        let h = [-2f32, -0.0, 0.0, 1e-30, 3.0, -1.0];
        let dy = [5f32, 6.0, -7.0, 8.0, -9.0, f32::INFINITY];
        // closed form: dy where h > 0, else dy * 0 (NaN for the infinite dy, -0 for -7)
        let want = [0f32, 0.0, -0.0, 8.0, -9.0, f32::NAN];
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let ht = Tensor::new(&h, &Device::Cpu)?.to_dtype(dtype)?;
            let gt = Tensor::new(&dy, &Device::Cpu)?.to_dtype(dtype)?;
            let got: Vec<f32> = backward(&ht, &gt)?.to_dtype(DType::F32)?.to_vec1()?;
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                let same = (g.is_nan() && w.is_nan()) || g.to_bits() == w.to_bits();
                // 1e-30 is 0 in f16 (masked); bf16 keeps it
                let f16_tiny = dtype == DType::F16 && i == 3 && *g == 0.0;
                assert!(same || f16_tiny, "{dtype:?} [{i}]: got {g}, want {w}");
            }
        }
        let e = backward(
            &Tensor::zeros(3, DType::F32, &Device::Cpu)?,
            &Tensor::zeros(2, DType::F32, &Device::Cpu)?,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("differ in shape"), "{e}");
        Ok(())
    }
}
