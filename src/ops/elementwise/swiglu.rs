//! SwiGLU, the gated activation of Llama's MLP `down(silu(gate(x)) * up(x))` (Shazeer 2020,
//! "GLU Variants Improve Transformer", arXiv:2002.05202), fused and differentiable, on the
//! fused gate/up projection:
//!
//! ```text
//! gate_up: (.., 2F) = [g | u]            s = sigmoid(g) = 1 / (1 + exp(-g))
//! y  = silu(g) * u = g s u               (.., F)
//! dg = dy * u * s * (1 + g (1 - s))      du = dy * silu(g)
//! ```
//! One forward and one backward kernel where candle composes a narrow per half, the silu, the
//! product, and in the backward the zero-padded gradients of both narrows plus their sum.
//! Arithmetic is f32 whatever the storage dtype, rounded once. Kernels: `kernels/swiglu.cu`.

use crate::ops::common::{check_float, cpu_slice, Elem};
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, D,
};
use half::{bf16, f16};
use rayon::prelude::*;

/// Fused, differentiable SwiGLU of `gate_up: (.., 2F)` (f32, bf16 or f16, any rank >= 1 and
/// layout; made contiguous first): the gate `g` is the first F columns of the last dimension,
/// the up projection `u` the last F; returns `silu(g) * u` of shape `(.., F)` in gate_up's
/// dtype, with `silu(g) = g / (1 + exp(-g))`, computed in f32. The gradient with respect to
/// gate_up is in its dtype. Not twice differentiable.
///
/// Errors (no panics): a scalar, an odd last dimension, a dtype other than f32/bf16/f16. An
/// empty gate_up gives an empty `(.., F)` result.
pub fn swiglu(gate_up: &Tensor) -> Result<Tensor> {
    let f = gated_width("swiglu", gate_up)?;
    if gate_up.elem_count() == 0 {
        return gate_up.narrow(D::Minus1, 0, f);
    }
    gate_up.contiguous()?.apply_op1(SwiGlu)
}

/// The width F of a gated activation's input `gate_up: (.., 2F)` (the gate then the up
/// projection), checked for [`swiglu`] and [`crate::ops::geglu_tanh`].
///
/// Errors: a dtype other than f32/bf16/f16, a scalar, an odd last dimension.
pub(in crate::ops) fn gated_width(op: &str, gate_up: &Tensor) -> Result<usize> {
    check_float(op, "gate_up", gate_up.dtype())?;
    let Some(&f2) = gate_up.dims().last() else {
        bail!("{op}: gate_up must have a last dimension of 2F (gate | up), found a scalar")
    };
    if f2 % 2 != 0 {
        bail!(
            "{op}: gate_up's last dimension {f2} must be even: 2F columns, the gate then the up \
             projection (shape {:?})",
            gate_up.dims()
        )
    }
    Ok(f2 / 2)
}

/// The op of [`swiglu`] (for a block op that keeps it and calls its backward itself).
pub(in crate::ops) struct SwiGlu;
struct SwiGluBwd;

/// `(rows, F)` of a `(.., 2F)` layout.
fn rows_f(l: &Layout) -> (usize, usize) {
    let f2 = *l.dims().last().unwrap_or(&0);
    (l.shape().elem_count() / f2.max(1), f2 / 2)
}

fn out_shape(l: &Layout) -> Shape {
    let mut d = l.dims().to_vec();
    if let Some(last) = d.last_mut() {
        *last /= 2;
    }
    Shape::from(d)
}

fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + (-g).exp())
}

impl CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (_, f) = rows_f(l);
        macro_rules! run {
            ($t:ty) => {{
                let x = cpu_slice::<$t>(op, "gate_up", s, l)?;
                let mut y = vec![<$t>::from32(0.0); x.len() / 2];
                y.par_chunks_mut(f)
                    .zip(x.par_chunks(2 * f))
                    .for_each(|(yr, xr)| {
                        let (g, u) = xr.split_at(f);
                        for ((o, g), u) in yr.iter_mut().zip(g).zip(u) {
                            let g = g.to32();
                            *o = <$t>::from32(g / (1.0 + (-g).exp()) * u.to32());
                        }
                    });
                <$t as candle_core::WithDType>::to_cpu_storage_owned(y)
            }};
        }
        Ok((with_type!(op, s.dtype(), run), out_shape(l)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, f) = rows_f(l);
        let y = cuda::launch("swiglu_fwd", &[(s, l)], rows, f, rows * f)?;
        Ok((y, out_shape(l)))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let dy = if dy.dtype() == x.dtype() {
            dy.contiguous()?
        } else {
            dy.to_dtype(x.dtype())?.contiguous()?
        };
        Ok(Some(x.apply_op2_no_bwd(&dy, &SwiGluBwd)?))
    }
}

impl CustomOp2 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "swiglu_backward"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        dy: &CpuStorage,
        ldy: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        check_bwd(op, lx, ldy, x.dtype(), dy.dtype())?;
        let (_, f) = rows_f(lx);
        macro_rules! run {
            ($t:ty) => {{
                let xv = cpu_slice::<$t>(op, "gate_up", x, lx)?;
                let gv = cpu_slice::<$t>(op, "dy", dy, ldy)?;
                let mut dx = vec![<$t>::from32(0.0); xv.len()];
                dx.par_chunks_mut(2 * f)
                    .zip(xv.par_chunks(2 * f).zip(gv.par_chunks(f)))
                    .for_each(|(dr, (xr, gr))| {
                        let (dg, du) = dr.split_at_mut(f);
                        for j in 0..f {
                            let (g, u, d) = (xr[j].to32(), xr[f + j].to32(), gr[j].to32());
                            let s = sigmoid(g);
                            dg[j] = <$t>::from32(d * u * s * (1.0 + g * (1.0 - s)));
                            du[j] = <$t>::from32(d * g * s);
                        }
                    });
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
        check_bwd(self.name(), lx, ldy, x.dtype(), dy.dtype())?;
        let (rows, f) = rows_f(lx);
        let dx = cuda::launch("swiglu_bwd", &[(x, lx), (dy, ldy)], rows, f, 2 * rows * f)?;
        Ok((dx, lx.shape().clone()))
    }
}

/// dy must be gate_up's shape with the last dimension halved, and of its dtype.
fn check_bwd(op: &str, lx: &Layout, ldy: &Layout, x: DType, dy: DType) -> Result<()> {
    if out_shape(lx).dims() != ldy.dims() || x != dy {
        bail!(
            "{op}: gate_up {:?} {x:?} and dy {:?} {dy:?} do not match (internal error)",
            lx.dims(),
            ldy.dims()
        )
    }
    Ok(())
}

/// CUDA launcher for `kernels/swiglu.cu`.
#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::launch::{alloc, dtype_name, grid_stride_cfg, in_ptr, out_ptr, vec_ok};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::WrapErr;
    use candle_core::{bail, CudaStorage, Layout, Result};

    /// Runs `{kernel}_{dtype}[_vec](inputs..., out, rows, F)`; the output has `n` elements of
    /// the first input's dtype.
    pub(super) fn launch(
        kernel: &str,
        inputs: &[(&CudaStorage, &Layout)],
        rows: usize,
        f: usize,
        n: usize,
    ) -> Result<CudaStorage> {
        let op = if kernel.ends_with("bwd") {
            "swiglu_backward"
        } else {
            "swiglu"
        };
        if f > (i32::MAX as usize) / 2 {
            bail!(
                "{op}: rows of 2F = {} elements exceed the kernel's i32 range",
                2 * f
            )
        }
        let (first, _) = inputs[0];
        let dev = first.device();
        let mut out = alloc(dev, first.dtype(), n)?;
        let stream = dev.cuda_stream();
        {
            let mut ptrs = Vec::with_capacity(inputs.len() + 1);
            let mut guards = Vec::with_capacity(inputs.len());
            for (i, (s, l)) in inputs.iter().enumerate() {
                let (p, g) = in_ptr(op, if i == 0 { "gate_up" } else { "dy" }, s, l, &stream)?;
                ptrs.push(p);
                guards.push(g);
            }
            let (op_ptr, _go) = out_ptr(&mut out, &stream)?;
            ptrs.push(op_ptr);
            let elem = first.dtype().size_in_bytes();
            let vec = vec_ok(f, elem, &ptrs);
            let name = format!(
                "{kernel}_{}{}",
                dtype_name(op, first.dtype())?,
                if vec { "_vec" } else { "" }
            );
            let func =
                dev.get_or_load_custom_func(&name, "wick_ops_swiglu", crate::cuda::ptx::SWIGLU)?;
            let per_thread = if vec { 16 / elem } else { 1 };
            let (rows_i, f_i) = (rows as i64, f as i32);
            let mut lb = func.builder();
            for p in &ptrs {
                lb.arg(p);
            }
            lb.arg(&rows_i).arg(&f_i);
            // SAFETY: gate_up (and dx) hold rows * 2F elements, y (and dy) rows * F, all of the
            // kernel's dtype; the vector kernel only with F a whole number of 16-byte vectors
            // and 16-byte aligned pointers.
            unsafe { lb.launch(grid_stride_cfg(rows * f / per_thread)) }.w()?;
            drop(guards);
        }
        Ok(out)
    }
}
