//! LayerNorm over the last dimension (Ba, Kiros & Hinton 2016, "Layer Normalization",
//! arXiv:1607.06450), fused and differentiable:
//!
//! ```text
//! mean = sum(x) / D
//! var  = sum((x - mean)^2) / D            (biased, as PyTorch's nn.LayerNorm)
//! rstd = 1 / sqrt(var + eps)
//! y    = (x - mean) * rstd * w + b
//! ```
//! and its backward, with `xhat = (x - mean) * rstd`, `g = dy * w`:
//! ```text
//! dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
//! dw = sum_rows(dy * xhat),   db = sum_rows(dy)
//! ```
//!
//! This file also holds the machinery shared with RMSNorm ([`crate::ops::rms_norm`], the same
//! computation without the mean and the bias): the forward and backward `CustomOp`s, their CPU
//! loops and their CUDA launchers (kernels in `kernels/layernorm.cu`, `kernels/rmsnorm.cu`,
//! `kernels/norm.cuh`).
//!
//! The parameter gradients are reduced deterministically on both devices: per-chunk partial
//! sums (fixed chunks of rows on the CPU, one partial per thread block on CUDA) added in a fixed
//! order by a second pass; no float atomics.

use crate::grad_sink::offer;
use crate::ops::common::{check_device, check_float, cpu_slice, Elem, SideOutput};
use crate::precision::to_f32;
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D,
};
use half::{bf16, f16};
use rayon::prelude::*;

/// Fused, differentiable LayerNorm over the last dimension, output in x's dtype.
///
/// - `x`: `(.., D)` in f32, bf16 or f16 (any layout; made contiguous first).
/// - `w` (gain), `b` (bias): `(D,)`, used in f32 (other float dtypes are cast, differentiably).
/// - `eps`: added to the variance, finite and `>= 0` (PyTorch's default is `1e-5`).
///
/// Returns `y` with x's shape and dtype. Statistics and arithmetic are f32 whatever the storage
/// dtype. Differentiable with respect to `x`, `w` and `b` on the CPU and on CUDA (gradients in
/// each argument's dtype); not twice differentiable. Same math as
/// `candle_nn::ops::layer_norm_slow` (Ba et al. 2016), in one graph node instead of ten.
///
/// Errors (no panics) when x is a scalar, has an empty last dimension or a dtype other than
/// f32/bf16/f16, when `w` or `b` is not `(D,)` or lives on another device, or when `eps` is
/// negative or not finite.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    layer_norm_with_dtype(x, w, b, eps, x.dtype())
}

/// [`layer_norm`] with the output dtype chosen: x's dtype, f32 (e.g. bf16 in, f32 out, the
/// policy of wick's `nn::LayerNorm`, without a separate cast kernel), or for f32 x bf16/f16
/// (the statistics and the affine map in f32, then one rounding: bit-identical to an f32 output
/// cast to the half dtype, but without the f32 tensor, the cast kernel and their graph node,
/// the form a following matmul in the compute dtype wants). The gradient of `x` comes back in
/// x's dtype. Errors for any other `out_dtype`.
pub fn layer_norm_with_dtype(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    eps: f64,
    out_dtype: DType,
) -> Result<Tensor> {
    let kind = Kind::Layer;
    let (x, w, d) = prepare(kind, x, w, eps, out_dtype)?;
    let b = prepare_param(kind.name(), "b", &x, b, d)?;
    x.apply_op3(
        &w,
        &b,
        NormFwd {
            kind,
            eps: eps as f32,
            out: out_dtype,
        },
    )
}

/// Which normalisation: LayerNorm (centred, with bias) or RMSNorm (no mean, no bias).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::ops) enum Kind {
    Layer,
    Rms,
}

impl Kind {
    pub(in crate::ops) fn name(self) -> &'static str {
        match self {
            Kind::Layer => "layer_norm",
            Kind::Rms => "rms_norm",
        }
    }

    fn center(self) -> bool {
        self == Kind::Layer
    }

    /// Number of parameter gradients: dw and db, or dw.
    fn np(self) -> usize {
        if self.center() {
            2
        } else {
            1
        }
    }
}

/// Checks the arguments shared by LayerNorm and RMSNorm; returns contiguous x, w as a
/// contiguous f32 `(D,)` tensor, and D.
pub(in crate::ops) fn prepare(
    kind: Kind,
    x: &Tensor,
    w: &Tensor,
    eps: f64,
    out_dtype: DType,
) -> Result<(Tensor, Tensor, usize)> {
    let op = kind.name();
    check_float(op, "x", x.dtype())?;
    let half = |d: DType| matches!(d, DType::BF16 | DType::F16);
    if !(out_dtype == x.dtype()
        || out_dtype == DType::F32
        || (x.dtype() == DType::F32 && half(out_dtype)))
    {
        bail!(
            "{op}: output dtype {out_dtype:?} is not supported for x of dtype {:?}; use x's dtype or f32 (or bf16/f16 for f32 x)",
            x.dtype()
        )
    }
    if x.rank() == 0 {
        bail!("{op}: x is a scalar; expected a tensor (.., D), normalised over its last dimension")
    }
    let d = x.dim(D::Minus1)?;
    if d == 0 {
        bail!(
            "{op}: x has shape {:?}, whose last dimension is empty; nothing to normalise",
            x.dims()
        )
    }
    if !(eps.is_finite() && eps >= 0.0) {
        bail!("{op}: eps = {eps}; expected a finite value >= 0 (PyTorch's default is 1e-5)")
    }
    let w = prepare_param(op, "w", x, w, d)?;
    Ok((x.contiguous()?, w, d))
}

/// Checks a gain or bias and returns it as a contiguous f32 `(D,)` tensor.
pub(in crate::ops) fn prepare_param(
    op: &str,
    what: &str,
    x: &Tensor,
    p: &Tensor,
    d: usize,
) -> Result<Tensor> {
    check_float(op, what, p.dtype())?;
    check_device(op, what, x, p)?;
    if p.dims() != [d] {
        bail!(
            "{op}: {what} has shape {:?}; expected ({d},), the size of x's last dimension (x: {:?})",
            p.dims(),
            x.dims()
        )
    }
    to_f32(p)?.contiguous()
}

/// The forward op. A `CustomOp3` (x, w, b) for LayerNorm and a `CustomOp2` (x, w) for RMSNorm.
#[derive(Clone, Copy)]
pub(in crate::ops) struct NormFwd {
    pub(in crate::ops) kind: Kind,
    pub(in crate::ops) eps: f32,
    pub(in crate::ops) out: DType,
}

impl CustomOp3 for NormFwd {
    fn name(&self) -> &'static str {
        self.kind.name()
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu(x, lx, w, lw, Some((b, lb)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::fwd(self, x, lx, w, lw, Some((b, lb)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, p) = backward(self, x, w, dy)?;
        let (dw, db) = (offer(w, Some(p.get(0)?))?, offer(b, Some(p.get(1)?))?);
        Ok((Some(dx), dw, db))
    }
}

impl CustomOp2 for NormFwd {
    fn name(&self) -> &'static str {
        self.kind.name()
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu(x, lx, w, lw, None)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::fwd(self, x, lx, w, lw, None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, p) = backward(self, x, w, dy)?;
        Ok((Some(dx), offer(w, Some(p.get(0)?))?))
    }
}

/// Runs `$body!(T, U)` for the supported (x dtype, output dtype) pairs.
macro_rules! with_types {
    ($op:expr, $xd:expr, $ud:expr, $body:ident) => {
        match ($xd, $ud) {
            (DType::F32, DType::F32) => $body!(f32, f32),
            (DType::BF16, DType::BF16) => $body!(bf16, bf16),
            (DType::F16, DType::F16) => $body!(f16, f16),
            (DType::BF16, DType::F32) => $body!(bf16, f32),
            (DType::F16, DType::F32) => $body!(f16, f32),
            (DType::F32, DType::BF16) => $body!(f32, bf16),
            (DType::F32, DType::F16) => $body!(f32, f16),
            (x, u) => bail!(
                "{}: x of dtype {x:?} with output dtype {u:?} is not supported",
                $op
            ),
        }
    };
}

impl NormFwd {
    fn cpu(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.kind.name();
        let w = cpu_slice::<f32>(op, "w", w, lw)?;
        let b = match b {
            Some((b, lb)) => Some(cpu_slice::<f32>(op, "b", b, lb)?),
            None => None,
        };
        let center = self.kind.center();
        macro_rules! run {
            ($t:ty, $u:ty) => {{
                let x = cpu_slice::<$t>(op, "x", x, lx)?;
                let y: Vec<$u> = fwd_cpu(x, w, b, self.eps, center)?;
                <$u as candle_core::WithDType>::to_cpu_storage_owned(y)
            }};
        }
        let y = with_types!(op, x.dtype(), self.out, run);
        Ok((y, lx.shape().clone()))
    }
}

/// Row statistics in f32: `(mean, rstd)`; mean is 0 for RMSNorm. Two passes (no cancellation).
fn row_stats<T: Elem>(xr: &[T], eps: f32, center: bool) -> (f32, f32) {
    let d = xr.len() as f32;
    let mean = if center {
        xr.iter().map(|v| v.to32()).sum::<f32>() / d
    } else {
        0.0
    };
    let var = xr
        .iter()
        .map(|v| {
            let c = v.to32() - mean;
            c * c
        })
        .sum::<f32>()
        / d;
    (mean, 1.0 / (var + eps).sqrt())
}

/// CPU forward: one row per rayon task.
fn fwd_cpu<T: Elem, U: Elem>(
    x: &[T],
    w: &[f32],
    b: Option<&[f32]>,
    eps: f32,
    center: bool,
) -> Result<Vec<U>> {
    let d = w.len();
    if d == 0 || x.len() % d != 0 {
        bail!(
            "norm: x has {} elements, not a multiple of D = {d}",
            x.len()
        )
    }
    let mut y = vec![U::from32(0.0); x.len()];
    y.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .for_each(|(yr, xr)| {
            let (mean, rstd) = row_stats(xr, eps, center);
            for (c, (yv, xv)) in yr.iter_mut().zip(xr).enumerate() {
                let xhat = (xv.to32() - mean) * rstd;
                let shift = b.map_or(0.0, |b| b[c]);
                *yv = U::from32(xhat * w[c] + shift);
            }
        });
    Ok(y)
}

/// Rows per chunk of the CPU backward's parameter-gradient partial sums. Fixed, so the
/// reduction order (and the result) does not depend on the number of threads.
const CPU_ROWS_PER_CHUNK: usize = 32;

/// CPU backward: `(dx, [dw; db])`, dw/db as `np * D` f32 values.
fn bwd_cpu<T: Elem, U: Elem>(
    x: &[T],
    w: &[f32],
    dy: &[U],
    eps: f32,
    center: bool,
) -> Result<(Vec<T>, Vec<f32>)> {
    let d = w.len();
    if d == 0 || x.len() % d != 0 || dy.len() != x.len() {
        bail!(
            "norm backward: x has {} elements, dy {}, D = {d}",
            x.len(),
            dy.len()
        )
    }
    let np = if center { 2 } else { 1 };
    let mut dx = vec![T::from32(0.0); x.len()];
    let chunk = CPU_ROWS_PER_CHUNK * d;
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(chunk)
        .zip(x.par_chunks(chunk))
        .zip(dy.par_chunks(chunk))
        .map(|((dxc, xc), dyc)| {
            let mut acc = vec![0f32; np * d];
            for ((dxr, xr), dyr) in dxc.chunks_mut(d).zip(xc.chunks(d)).zip(dyc.chunks(d)) {
                let (mean, rstd) = row_stats(xr, eps, center);
                // mean(g) and mean(g * xhat), g = dy * w
                let (mut sg, mut sgx) = (0f32, 0f32);
                for c in 0..d {
                    let xhat = (xr[c].to32() - mean) * rstd;
                    let g = dyr[c].to32() * w[c];
                    sg += g;
                    sgx += g * xhat;
                }
                let mg = if center { sg / d as f32 } else { 0.0 };
                let mgx = sgx / d as f32;
                for c in 0..d {
                    let xhat = (xr[c].to32() - mean) * rstd;
                    let dyv = dyr[c].to32();
                    dxr[c] = T::from32(rstd * (dyv * w[c] - mg - xhat * mgx));
                    acc[c] += dyv * xhat;
                    if center {
                        acc[d + c] += dyv;
                    }
                }
            }
            acc
        })
        .collect();
    let mut params = vec![0f32; np * d];
    for p in &partials {
        for (a, v) in params.iter_mut().zip(p) {
            *a += v;
        }
    }
    Ok((dx, params))
}

/// The backward op: a `CustomOp3` (x, w, dy) whose output is dx; the parameter gradients
/// (`(np, D)` f32: dw, then db for LayerNorm) come out through `params`. On CUDA, with
/// `residual` (f32, x's shape, x f32) the output is `residual + dx` and, with `low`, that sum
/// rounded to dy's dtype also comes out through `low` (see [`backward_with_residual`]).
struct NormBwd {
    kind: Kind,
    eps: f32,
    params: SideOutput,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    residual: Option<Tensor>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    low: Option<SideOutput>,
}

/// dx (x's dtype) and the `(np, D)` f32 parameter gradients for the forward op `fwd`.
pub(in crate::ops) fn backward(
    fwd: &NormFwd,
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (dx, p, _) = backward_with_residual(fwd, x, w, dy, None, None)?;
    Ok((dx, p))
}

/// The backward of a pre-norm residual step `x + branch(norm(x))` at the norm:
/// `(residual + dx, params, (residual + dx) in low)` where `residual` is the gradient reaching x
/// through the residual path and `low` the dtype the branch of the step before takes its
/// gradient in; the composition's `residual + dx` and `.to_dtype(low)`, bit for bit. On CUDA,
/// with x, residual and dx in f32 and `low` dy's dtype (or `None`), the norm's backward kernel
/// adds the residual and writes the low copy in the same pass (one read of residual instead of
/// an add kernel's two reads and a write, and no separate cast). Without `residual` it is
/// [`backward`] (and `low` is ignored).
pub(in crate::ops) fn backward_with_residual(
    fwd: &NormFwd,
    x: &Tensor,
    w: &Tensor,
    dy: &Tensor,
    residual: Option<&Tensor>,
    low: Option<DType>,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let dy = if dy.dtype() == fwd.out {
        dy.clone()
    } else {
        dy.to_dtype(fwd.out)?
    };
    let dy = dy.contiguous()?;
    let fused = residual.filter(|r| {
        x.device().is_cuda()
            && x.dtype() == DType::F32
            && r.dtype() == DType::F32
            && r.dims() == x.dims()
            && low.is_none_or(|l| l == dy.dtype())
    });
    let op = NormBwd {
        kind: fwd.kind,
        eps: fwd.eps,
        params: SideOutput::default(),
        residual: fused.map(Tensor::contiguous).transpose()?,
        low: fused.and(low).map(|_| SideOutput::default()),
    };
    let mut dx = x.apply_op3_no_bwd(w, &dy, &op)?;
    let Some(p) = op.params.take() else {
        bail!(
            "{}: the backward kernel produced no parameter gradients (internal error)",
            fwd.kind.name()
        )
    };
    let low_copy = match (fused, residual) {
        (Some(_), _) => op.low.as_ref().and_then(SideOutput::take),
        (None, Some(r)) => {
            dx = (r + dx)?;
            low.map(|l| dx.to_dtype(l)).transpose()?
        }
        (None, None) => None,
    };
    Ok((dx, p, low_copy))
}

impl CustomOp3 for NormBwd {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Layer => "layer_norm_backward",
            Kind::Rms => "rms_norm_backward",
        }
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        dy: &CpuStorage,
        ldy: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let w = cpu_slice::<f32>(op, "w", w, lw)?;
        let center = self.kind.center();
        macro_rules! run {
            ($t:ty, $u:ty) => {{
                let x = cpu_slice::<$t>(op, "x", x, lx)?;
                let dy = cpu_slice::<$u>(op, "dy", dy, ldy)?;
                let (dx, p) = bwd_cpu(x, w, dy, self.eps, center)?;
                let shape = (self.kind.np(), w.len());
                self.params
                    .put(candle_core::Storage::Cpu(CpuStorage::F32(p)), shape);
                <$t as candle_core::WithDType>::to_cpu_storage_owned(dx)
            }};
        }
        let dx = with_types!(op, x.dtype(), dy.dtype(), run);
        Ok((dx, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        dy: &candle_core::CudaStorage,
        ldy: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let saved = self.residual.as_ref();
        let (dx, p, low) =
            crate::cuda::launch::with_saved(self.name(), "residual gradient", saved, |residual| {
                let io = cuda::Io {
                    x: (x, lx),
                    w: (w, lw),
                    dy: (dy, ldy),
                    residual,
                    low: self.low.is_some(),
                };
                cuda::bwd(self.kind, self.eps, io)
            })?;
        let shape = (self.kind.np(), lw.dims()[0]);
        self.params.put(candle_core::Storage::Cuda(p), shape);
        if let (Some(out), Some(low)) = (&self.low, low) {
            out.put(candle_core::Storage::Cuda(low), lx.shape().clone());
        }
        Ok((dx, lx.shape().clone()))
    }
}

/// CUDA launchers for `kernels/layernorm.cu` and `kernels/rmsnorm.cu` (device code in
/// `kernels/norm.cuh`).
#[cfg(feature = "cuda")]
mod cuda {
    use super::{Kind, NormFwd};
    use crate::cuda::launch::{
        alloc, dtype_name, in_ptr, out_ptr, row_cfg, rows_cols, vec_ok, zeros_f32, In, ROW_THREADS,
        ROW_WARPS,
    };
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{bail, CudaStorage, DType, Layout, Result, Shape};

    /// Most blocks of the backward kernel: the number of per-block partial sums of dw/db.
    const BWD_MAX_BLOCKS: usize = 1024;
    /// Shared memory a kernel may use without opting in.
    const SMEM_LIMIT: usize = 48 * 1024;

    fn module(kind: Kind) -> (&'static str, &'static str, &'static str) {
        match kind {
            Kind::Layer => (
                "layernorm",
                "wick_ops_layernorm",
                crate::cuda::ptx::LAYERNORM,
            ),
            Kind::Rms => ("rmsnorm", "wick_ops_rmsnorm", crate::cuda::ptx::RMSNORM),
        }
    }

    pub(super) fn fwd(
        op: &NormFwd,
        x: &CudaStorage,
        lx: &Layout,
        w: &CudaStorage,
        lw: &Layout,
        b: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        let name = op.kind.name();
        let (prefix, module, ptx) = module(op.kind);
        let dev = &x.device;
        let (rows, d) = rows_cols(name, lx)?;
        let mut y = alloc(dev, op.out, rows * d)?;
        if rows > 0 {
            let stream = dev.cuda_stream();
            let (xp, _gx) = in_ptr(name, "x", x, lx, &stream)?;
            let (wp, _gw) = in_ptr(name, "w", w, lw, &stream)?;
            let (bp, _gb) = match b {
                Some((b, lb)) => {
                    let (p, g) = in_ptr(name, "b", b, lb, &stream)?;
                    (p, Some(g))
                }
                None => (wp, None), // RMSNorm: unused by the kernel
            };
            let (yp, _gy) = out_ptr(&mut y, &stream)?;
            let vec = vec_ok(d, x.dtype().size_in_bytes(), &[xp, wp, bp, yp]);
            let kernel = format!(
                "{prefix}_fwd_{}_{}{}",
                dtype_name(name, x.dtype())?,
                dtype_name(name, op.out)?,
                if vec { "_vec" } else { "" }
            );
            let func = dev.get_or_load_custom_func(&kernel, module, ptx)?;
            let (rows_i, d_i) = (rows as i32, d as i32);
            let mut lb = func.builder();
            lb.arg(&xp)
                .arg(&wp)
                .arg(&bp)
                .arg(&yp)
                .arg(&rows_i)
                .arg(&d_i)
                .arg(&op.eps);
            // SAFETY: pointers from live storages of rows * d elements (w, b: d), matching the
            // kernel's parameter list.
            unsafe { lb.launch(row_cfg(rows)) }.w()?;
        }
        Ok((y, lx.shape().clone()))
    }

    /// The backward's operands: x, w, dy; the residual gradient added to dx (x's dtype, x's
    /// shape); whether to also write dx rounded to dy's dtype.
    pub(super) struct Io<'a> {
        pub x: In<'a>,
        pub w: In<'a>,
        pub dy: In<'a>,
        pub residual: Option<In<'a>>,
        pub low: bool,
    }

    /// dx (plus the residual), the `(np * D)` f32 parameter gradients, and dx in dy's dtype
    /// when `io.low`.
    pub(super) fn bwd(
        kind: Kind,
        eps: f32,
        io: Io<'_>,
    ) -> Result<(CudaStorage, CudaStorage, Option<CudaStorage>)> {
        let ((x, lx), (w, lw), (dy, ldy)) = (io.x, io.w, io.dy);
        let name = kind.name();
        let (prefix, module, ptx) = module(kind);
        let dev = &x.device;
        let np = kind.np();
        let (rows, d) = rows_cols(name, lx)?;
        if np * d > i32::MAX as usize {
            bail!("{name}: D = {d} exceeds the backward kernel's i32 range")
        }
        let mut dx = alloc(dev, x.dtype(), rows * d)?;
        let mut low = io
            .low
            .then(|| alloc(dev, dy.dtype(), rows * d))
            .transpose()?;
        if rows == 0 {
            return Ok((dx, zeros_f32(dev, np * d)?, low));
        }
        if let Some((r, _)) = io.residual {
            if r.dtype() != x.dtype() {
                bail!("{name}: the residual gradient must have x's dtype (internal error)")
            }
        }
        // Pass 1: dx, and one partial sum of dw (db) per block.
        let blocks = rows.div_ceil(ROW_WARPS).min(BWD_MAX_BLOCKS);
        let tmp_bytes = ROW_WARPS * np * ROW_THREADS as usize * 4;
        let acc_bytes = np * d * 4;
        let acc_in_smem = tmp_bytes + acc_bytes <= SMEM_LIMIT;
        let smem = tmp_bytes + if acc_in_smem { acc_bytes } else { 0 };
        let mut partials = alloc(dev, DType::F32, blocks * np * d)?;
        let stream = dev.cuda_stream();
        {
            let (xp, _gx) = in_ptr(name, "x", x, lx, &stream)?;
            let (wp, _gw) = in_ptr(name, "w", w, lw, &stream)?;
            let (dyp, _gdy) = in_ptr(name, "dy", dy, ldy, &stream)?;
            let (dxp, _gdx) = out_ptr(&mut dx, &stream)?;
            let (pp, _gp) = out_ptr(&mut partials, &stream)?;
            let res = io
                .residual
                .map(|(s, l)| in_ptr(name, "residual", s, l, &stream))
                .transpose()?;
            let low_g = low.as_mut().map(|s| out_ptr(s, &stream)).transpose()?;
            // 0: no residual to add, no low copy to write
            let (rp, lp) = (
                res.as_ref().map_or(0u64, |r| r.0),
                low_g.as_ref().map_or(0u64, |l| l.0),
            );
            let vec = vec_ok(d, x.dtype().size_in_bytes(), &[xp, wp, dyp, dxp, rp]);
            let kernel = format!(
                "{prefix}_bwd_{}_{}{}",
                dtype_name(name, x.dtype())?,
                dtype_name(name, dy.dtype())?,
                if vec { "_vec" } else { "" }
            );
            let func = dev.get_or_load_custom_func(&kernel, module, ptx)?;
            let (rows_i, d_i, acc_i) = (rows as i32, d as i32, acc_in_smem as i32);
            let mut lb = func.builder();
            lb.arg(&xp)
                .arg(&wp)
                .arg(&dyp)
                .arg(&dxp)
                .arg(&pp)
                .arg(&rows_i)
                .arg(&d_i)
                .arg(&eps)
                .arg(&acc_i)
                .arg(&rp)
                .arg(&lp);
            let cfg = LaunchConfig {
                grid_dim: (blocks as u32, 1, 1),
                block_dim: (ROW_THREADS, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            // SAFETY: pointers from live storages of the sizes the kernel indexes (x, dy, dx and,
            // when not null, residual and low: rows * d; w: d; partials: blocks * np * d),
            // shared memory as the kernel expects.
            unsafe { lb.launch(cfg) }.w()?;
        }
        // Pass 2: sum the per-block partials in a fixed order.
        let mut params = alloc(dev, DType::F32, np * d)?;
        {
            let (pp, _gp) = in_ptr(
                name,
                "partials",
                &partials,
                &Layout::contiguous(blocks * np * d),
                &stream,
            )?;
            let (qp, _gq) = out_ptr(&mut params, &stream)?;
            let func =
                dev.get_or_load_custom_func(&format!("{prefix}_reduce_partials"), module, ptx)?;
            let (nparts, ncols) = (blocks as i32, (np * d) as i32);
            let mut lb = func.builder();
            lb.arg(&pp).arg(&qp).arg(&nparts).arg(&ncols);
            let cfg = LaunchConfig {
                grid_dim: ((np * d).div_ceil(32) as u32, 1, 1),
                block_dim: (32, 16, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: partials holds nparts * ncols f32, params ncols.
            unsafe { lb.launch(cfg) }.w()?;
        }
        Ok((dx, params, low))
    }
}
