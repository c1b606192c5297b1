//! GELU, fused and differentiable, in its two usual forms. The tanh approximation:
//!
//! ```text
//! u  = sqrt(2/pi) (x + 0.044715 x^3),  t = tanh(u)
//! y  = 0.5 x (1 + t)
//! dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2))
//! ```
//! (Hendrycks & Gimpel 2016; GPT-2's activation, `torch.nn.functional.gelu(x,
//! approximate="tanh")`, candle's `Tensor::gelu`). The exact form with the error function, as
//! BERT's `hidden_act = "gelu"` computes it (`torch.nn.functional.gelu(x)`, candle's
//! `Tensor::gelu_erf`):
//!
//! ```text
//! y  = 0.5 x (1 + erf(x / sqrt(2)))
//! dx = dy (0.5 (1 + erf(x / sqrt(2))) + x exp(-x^2 / 2) / sqrt(2 pi))
//! ```
//! One forward and one backward kernel where
//! candle's autograd composes about ten elementwise kernels for the backward (1.7 ms against
//! 0.1 ms forward for gptmini's 64x256x1536 bf16 activations on an H200). Arithmetic is f32
//! whatever the storage dtype. Kernels: `kernels/gelu.cu`.

use crate::ops::common::{check_float, cpu_slice, Elem};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

const K0: f32 = 0.797_884_6; // sqrt(2 / pi)
const K1: f32 = 0.044_715;
const INV_SQRT2: f32 = std::f32::consts::FRAC_1_SQRT_2;
const INV_SQRT_2PI: f32 = 0.398_942_3; // 1 / sqrt(2 pi)

/// Which GELU: the tanh approximation or the exact (erf) form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::ops) enum Kind {
    Tanh,
    Erf,
}

/// Fused, differentiable GELU (tanh approximation) of `x` (f32, bf16 or f16, any shape and
/// layout; made contiguous first). Returns y with x's shape and dtype, computed in f32. Not
/// twice differentiable.
///
/// Errors (no panics) for a dtype other than f32/bf16/f16. An empty x is returned as is.
pub fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    gelu(x, Kind::Tanh)
}

/// Fused, differentiable exact GELU `0.5 x (1 + erf(x / sqrt(2)))` of `x` (f32, bf16 or f16,
/// any shape and layout; made contiguous first), BERT's activation. Returns y with x's shape
/// and dtype, computed in f32 (CPU: candle's `erf_f64`; CUDA: `erff`). Not twice
/// differentiable.
///
/// Errors (no panics) for a dtype other than f32/bf16/f16. An empty x is returned as is.
pub fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    gelu(x, Kind::Erf)
}

pub(in crate::ops) fn gelu(x: &Tensor, kind: Kind) -> Result<Tensor> {
    let op = Gelu(kind);
    check_float(op.name(), "x", x.dtype())?;
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    x.contiguous()?.apply_op1(op)
}

struct Gelu(Kind);
struct GeluBwd(Kind);

fn erf(v: f32) -> f32 {
    candle_core::cpu::erf::erf_f64(f64::from(v)) as f32
}

fn fwd_one(kind: Kind, a: f32) -> f32 {
    match kind {
        Kind::Tanh => {
            let t = (K0 * (a + K1 * a * a * a)).tanh();
            0.5 * a * (1.0 + t)
        }
        Kind::Erf => 0.5 * a * (1.0 + erf(a * INV_SQRT2)),
    }
}

fn bwd_one(kind: Kind, a: f32, g: f32) -> f32 {
    match kind {
        Kind::Tanh => {
            let t = (K0 * (a + K1 * a * a * a)).tanh();
            let du = K0 * (1.0 + 3.0 * K1 * a * a);
            g * (0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * du)
        }
        Kind::Erf => {
            let cdf = 0.5 * (1.0 + erf(a * INV_SQRT2));
            g * (cdf + a * (-0.5 * a * a).exp() * INV_SQRT_2PI)
        }
    }
}

impl Kind {
    /// Kernel name prefix in `kernels/gelu.cu`.
    #[cfg(feature = "cuda")]
    fn kernel(self) -> &'static str {
        match self {
            Kind::Tanh => "gelu",
            Kind::Erf => "gelu_erf",
        }
    }
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        match self.0 {
            Kind::Tanh => "gelu_tanh",
            Kind::Erf => "gelu_erf",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        macro_rules! run {
            ($t:ty) => {{
                let x = cpu_slice::<$t>(op, "x", s, l)?;
                let y: Vec<$t> = x
                    .par_iter()
                    .map(|v| <$t>::from32(fwd_one(self.0, v.to32())))
                    .collect();
                <$t as candle_core::WithDType>::to_cpu_storage_owned(y)
            }};
        }
        Ok((with_type!(op, s.dtype(), run), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let kernel = format!("{}_fwd", self.0.kernel());
        cuda::launch(self.name(), &kernel, &[(s, l)], l)
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(backward(self.0, x, dy)?))
    }
}

/// `dx` of GELU at `x` for the upstream gradient `dy` (cast to x's dtype), no graph.
pub(in crate::ops) fn backward(kind: Kind, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let dy = if dy.dtype() == x.dtype() {
        dy.contiguous()?
    } else {
        dy.to_dtype(x.dtype())?.contiguous()?
    };
    x.contiguous()?.apply_op2_no_bwd(&dy, &GeluBwd(kind))
}

/// GELU's forward kernel on a contiguous CPU storage (no graph).
pub(in crate::ops) fn forward_cpu(kind: Kind, s: &CpuStorage, l: &Layout) -> Result<CpuStorage> {
    Ok(Gelu(kind).cpu_fwd(s, l)?.0)
}

/// GELU's forward kernel on a contiguous CUDA storage (no graph).
#[cfg(feature = "cuda")]
pub(in crate::ops) fn forward_cuda(
    kind: Kind,
    s: &candle_core::CudaStorage,
    l: &Layout,
) -> Result<candle_core::CudaStorage> {
    Ok(Gelu(kind).cuda_fwd(s, l)?.0)
}

impl CustomOp2 for GeluBwd {
    fn name(&self) -> &'static str {
        match self.0 {
            Kind::Tanh => "gelu_tanh_backward",
            Kind::Erf => "gelu_erf_backward",
        }
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        dy: &CpuStorage,
        ldy: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        if lx.dims() != ldy.dims() || x.dtype() != dy.dtype() {
            bail!("{op}: x {:?} and dy {:?} differ", lx.dims(), ldy.dims())
        }
        macro_rules! run {
            ($t:ty) => {{
                let xv = cpu_slice::<$t>(op, "x", x, lx)?;
                let gv = cpu_slice::<$t>(op, "dy", dy, ldy)?;
                let dx: Vec<$t> = xv
                    .par_iter()
                    .zip(gv.par_iter())
                    .map(|(a, g)| <$t>::from32(bwd_one(self.0, a.to32(), g.to32())))
                    .collect();
                <$t as candle_core::WithDType>::to_cpu_storage_owned(dx)
            }};
        }
        Ok((with_type!(op, x.dtype(), run), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        dy: &candle_core::CudaStorage,
        ldy: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        if lx.dims() != ldy.dims() || x.dtype() != dy.dtype() {
            bail!(
                "{}: x {:?} and dy {:?} differ",
                self.name(),
                lx.dims(),
                ldy.dims()
            )
        }
        let kernel = format!("{}_bwd", self.0.kernel());
        cuda::launch(self.name(), &kernel, &[(x, lx), (dy, ldy)], lx)
    }
}

/// CUDA launcher for `kernels/gelu.cu`.
#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::launch::{alloc, dtype_name, grid_stride_cfg, in_ptr, out_ptr, vec_ok};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    const MODULE: &str = "wick_ops_gelu";

    /// Runs `{kernel}_{dtype}[_vec](inputs..., out, n)`; the output has `shape`'s layout and the
    /// first input's dtype.
    pub(super) fn launch(
        op: &str,
        kernel: &str,
        inputs: &[(&CudaStorage, &Layout)],
        shape: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (first, _) = inputs[0];
        let dev = &first.device;
        let n = shape.shape().elem_count();
        let mut out = alloc(dev, first.dtype(), n)?;
        {
            let stream = dev.cuda_stream();
            let mut ptrs = Vec::with_capacity(inputs.len() + 1);
            let mut guards = Vec::with_capacity(inputs.len());
            for (i, (s, l)) in inputs.iter().enumerate() {
                let (p, g) = in_ptr(op, if i == 0 { "x" } else { "dy" }, s, l, &stream)?;
                ptrs.push(p);
                guards.push(g);
            }
            let (op_ptr, _go) = out_ptr(&mut out, &stream)?;
            ptrs.push(op_ptr);
            let elem = first.dtype().size_in_bytes();
            let vec = vec_ok(n, elem, &ptrs);
            let name = format!(
                "{kernel}_{}{}",
                dtype_name(op, first.dtype())?,
                if vec { "_vec" } else { "" }
            );
            let func = dev.get_or_load_custom_func(&name, MODULE, crate::cuda::ptx::GELU)?;
            let per_thread = if vec { 16 / elem } else { 1 };
            let cfg = grid_stride_cfg(n.div_ceil(per_thread));
            let n_i = n as i64;
            let mut lb = func.builder();
            for p in &ptrs {
                lb.arg(p);
            }
            lb.arg(&n_i);
            // SAFETY: every pointer covers n elements of the kernel's dtype.
            unsafe { lb.launch(cfg) }.w()?;
            drop(guards);
        }
        Ok((out, shape.shape().clone()))
    }
}
