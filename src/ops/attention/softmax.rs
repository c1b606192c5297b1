//! Softmax over the last dimension, fused and differentiable:
//!
//! ```text
//! y  = exp(x - max(x)) / sum(exp(x - max(x)))
//! dx = y * (dy - sum(dy * y))
//! ```
//! The forward finds the maximum and the normaliser in one pass (online softmax, Milakov &
//! Gimelshein 2018, arXiv:1805.02867); the backward needs only y and dy. Arithmetic is f32
//! whatever the storage dtype. Kernels: `kernels/softmax.cu`.

use crate::ops::common::{check_float, cpu_slice, Elem};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

/// Fused, differentiable softmax over the last dimension.
///
/// `x`: `(.., D)` in f32, bf16 or f16 (any layout; made contiguous first). Returns `y` with x's
/// shape and dtype, computed in f32. Differentiable on the CPU and on CUDA (the backward uses
/// `y`, so nothing else is kept); not twice differentiable. A row that is all `-inf` gives NaN,
/// as `candle_nn::ops::softmax` does. Same math as `candle_nn::ops::softmax(x, D::Minus1)` in
/// one graph node instead of five.
///
/// Errors (no panics) for a scalar x or a dtype other than f32/bf16/f16. An empty x is returned
/// as is.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    check_float("softmax_last_dim", "x", x.dtype())?;
    if x.rank() == 0 {
        bail!("softmax_last_dim: x is a scalar; expected a tensor (.., D)")
    }
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    x.contiguous()?
        .apply_op1(SoftmaxLastDim { mask: Mask::None })
}

/// Fused, differentiable causal softmax of attention scores: `x: (.., T, T)` holds the scores
/// of queries `i` (rows) against keys `j` (columns); the result is
/// `softmax(x + mask)` over the last dimension with `mask[i][j] = -inf` for `j > i`, i.e. what
/// `scaled_dot_product_attention(..., is_causal=True)` applies before multiplying by V.
/// The masked scores are never read and the masked outputs are exactly 0, so no mask tensor,
/// no broadcast add and no f32 copy of the scores are needed: the math is f32 and the result
/// has x's dtype (f32, bf16 or f16).
///
/// Errors (no panics) for a rank < 2 x, non-square last two dimensions, or a dtype other than
/// f32/bf16/f16. An empty x is returned as is.
pub fn causal_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    check_float("causal_softmax_last_dim", "x", x.dtype())?;
    let dims = x.dims();
    if dims.len() < 2 || dims[dims.len() - 1] != dims[dims.len() - 2] {
        bail!(
            "causal_softmax_last_dim: x must be attention scores (.., T, T), found shape {dims:?}"
        )
    }
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    x.contiguous()?
        .apply_op1(SoftmaxLastDim { mask: Mask::Causal })
}

/// Fused, differentiable softmax of attention scores over padded keys: `x: (B, .., Tk)` holds
/// the scores of batch entry `b` in `x[b]` (any number of head and query dimensions between),
/// and entry `b` has `key_lengths[b]` real keys, the first ones; the rest are padding. The
/// result is `softmax(x + mask)` with `mask = -inf` on keys `j >= key_lengths[b]`, what
/// transformers' BERT applies for `attention_mask = [1] * len + [0] * pad` (an additive mask
/// of the dtype's minimum there, which gives the same zeros). Masked scores are never read and
/// their outputs are exactly 0, so no mask tensor or broadcast add is needed; the backward is
/// the plain softmax backward (y is 0 where masked). Math in f32, the result in x's dtype
/// (f32, bf16 or f16).
///
/// Errors (no panics) for a rank < 2 x, `key_lengths.len() != B`, a length of 0 or above
/// `Tk`, or a dtype other than f32/bf16/f16. An empty x is returned as is.
pub fn key_padding_softmax_last_dim(x: &Tensor, key_lengths: &[usize]) -> Result<Tensor> {
    let op = "key_padding_softmax_last_dim";
    check_float(op, "x", x.dtype())?;
    let dims = x.dims();
    if dims.len() < 2 {
        bail!("{op}: x must be scores (B, .., Tk), found shape {dims:?}")
    }
    let (b, tk) = (dims[0], dims[dims.len() - 1]);
    if key_lengths.len() != b {
        bail!(
            "{op}: {} key lengths for a batch of {b} (x {dims:?}); give one length per batch entry",
            key_lengths.len()
        )
    }
    if let Some((i, &l)) = key_lengths
        .iter()
        .enumerate()
        .find(|(_, &l)| l == 0 || l > tk)
    {
        bail!("{op}: key_lengths[{i}] = {l} is outside 1..={tk} (the key dimension of x {dims:?})")
    }
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    let lengths = key_lengths.iter().map(|&l| l as i32).collect();
    x.contiguous()?.apply_op1(SoftmaxLastDim {
        mask: Mask::KeyLengths(lengths),
    })
}

/// The backward of the softmaxes here (masked or not): `dx = y * (dy - sum(y * dy))` per row
/// from the output `y` and its gradient `dy` (cast to y's dtype); what their autograd runs, for
/// block nodes that keep `y` themselves.
pub(in crate::ops) fn softmax_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    let dy = if dy.dtype() == y.dtype() {
        dy.clone()
    } else {
        dy.to_dtype(y.dtype())?
    };
    y.apply_op2_no_bwd(&dy.contiguous()?, &SoftmaxBwd)
}

/// Which keys a row sees.
enum Mask {
    /// All of them.
    None,
    /// Query `i` of square `(.., T, T)` scores sees keys `j <= i`.
    Causal,
    /// Batch entry `b` (the first dim) sees its first `lengths[b]` keys.
    KeyLengths(Vec<i32>),
}

impl Mask {
    /// Number of keys row `r` sees, of `d`, in a tensor of `rows` rows.
    fn valid(&self, r: usize, d: usize, rows: usize) -> usize {
        match self {
            Mask::None => d,
            Mask::Causal => r % d + 1,
            Mask::KeyLengths(l) => l[r / (rows / l.len())] as usize,
        }
    }
}

/// The forward op (x → y) under a key mask.
struct SoftmaxLastDim {
    mask: Mask,
}

/// The backward op ((y, dy) → dx).
struct SoftmaxBwd;

/// CPU reference: row `r` sees its first `mask.valid(r, ..)` keys.
fn fwd_cpu<T: Elem>(x: &[T], d: usize, mask: &Mask) -> Vec<T> {
    let mut y = vec![T::from32(0.0); x.len()];
    let rows = x.len() / d;
    y.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .enumerate()
        .for_each(|(r, (yr, xr))| {
            let valid = mask.valid(r, d, rows);
            let (xr, yr) = (&xr[..valid], &mut yr[..valid]);
            let m = xr
                .iter()
                .map(|v| v.to32())
                .fold(f32::NEG_INFINITY, f32::max);
            let s: f32 = xr.iter().map(|v| (v.to32() - m).exp()).sum();
            let inv = 1.0 / s;
            for (yv, xv) in yr.iter_mut().zip(xr) {
                *yv = T::from32((xv.to32() - m).exp() * inv);
            }
        });
    y
}

fn bwd_cpu<T: Elem>(y: &[T], dy: &[T], d: usize) -> Vec<T> {
    let mut dx = vec![T::from32(0.0); y.len()];
    dx.par_chunks_mut(d)
        .zip(y.par_chunks(d).zip(dy.par_chunks(d)))
        .for_each(|(dxr, (yr, dyr))| {
            let dot: f32 = yr.iter().zip(dyr).map(|(a, g)| a.to32() * g.to32()).sum();
            for ((o, a), g) in dxr.iter_mut().zip(yr).zip(dyr) {
                *o = T::from32(a.to32() * (g.to32() - dot));
            }
        });
    dx
}

fn last_dim(op: &str, l: &Layout) -> Result<usize> {
    match l.dims().last() {
        Some(&d) if d > 0 => Ok(d),
        _ => bail!(
            "{op}: x has shape {:?}; expected a non-empty last dimension",
            l.dims()
        ),
    }
}

impl CustomOp1 for SoftmaxLastDim {
    fn name(&self) -> &'static str {
        match self.mask {
            Mask::None => "softmax_last_dim",
            Mask::Causal => "causal_softmax_last_dim",
            Mask::KeyLengths(_) => "key_padding_softmax_last_dim",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let d = last_dim(op, l)?;
        macro_rules! run {
            ($t:ty) => {{
                let x = cpu_slice::<$t>(op, "x", s, l)?;
                <$t as candle_core::WithDType>::to_cpu_storage_owned(fwd_cpu(x, d, &self.mask))
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
        cuda::fwd(s, l, &self.mask)
    }

    fn bwd(&self, _x: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(softmax_backward(y, dy)?))
    }
}

impl CustomOp2 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "softmax_last_dim_backward"
    }

    fn cpu_fwd(
        &self,
        y: &CpuStorage,
        ly: &Layout,
        dy: &CpuStorage,
        ldy: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let d = last_dim(op, ly)?;
        if ly.dims() != ldy.dims() || y.dtype() != dy.dtype() {
            bail!(
                "{op}: y {:?} {:?} and dy {:?} {:?} differ",
                ly.dims(),
                y.dtype(),
                ldy.dims(),
                dy.dtype()
            )
        }
        macro_rules! run {
            ($t:ty) => {{
                let yv = cpu_slice::<$t>(op, "y", y, ly)?;
                let dyv = cpu_slice::<$t>(op, "dy", dy, ldy)?;
                <$t as candle_core::WithDType>::to_cpu_storage_owned(bwd_cpu(yv, dyv, d))
            }};
        }
        Ok((with_type!(op, y.dtype(), run), ly.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        ly: &Layout,
        dy: &candle_core::CudaStorage,
        ldy: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::bwd(y, ly, dy, ldy)
    }
}

/// CUDA launchers for `kernels/softmax.cu`.
#[cfg(feature = "cuda")]
mod cuda {
    use super::Mask;
    use crate::cuda::launch::{alloc, dtype_name, in_ptr, out_ptr, row_cfg, rows_cols, vec_ok};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::DevicePtr;
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::WrapErr;
    use candle_core::{bail, CudaStorage, Layout, Result, Shape};

    const MODULE: &str = "wick_ops_softmax";

    pub(super) fn fwd(x: &CudaStorage, l: &Layout, mask: &Mask) -> Result<(CudaStorage, Shape)> {
        let op = "softmax_last_dim";
        let dev = &x.device;
        let (rows, d) = rows_cols(op, l)?;
        let mut y = alloc(dev, x.dtype(), rows * d)?;
        if rows > 0 {
            let stream = dev.cuda_stream();
            let (xp, _gx) = in_ptr(op, "x", x, l, &stream)?;
            let (yp, _gy) = out_ptr(&mut y, &stream)?;
            let vec = vec_ok(d, x.dtype().size_in_bytes(), &[xp, yp]);
            let kernel = format!(
                "softmax_fwd_{}{}",
                dtype_name(op, x.dtype())?,
                if vec { "_vec" } else { "" }
            );
            let func = dev.get_or_load_custom_func(&kernel, MODULE, crate::cuda::ptx::SOFTMAX)?;
            let causal = i32::from(matches!(mask, Mask::Causal));
            // key lengths: a small host-to-device copy on candle's stream, alive until queued
            let lengths = match mask {
                Mask::KeyLengths(l) => Some(stream.clone_htod(l).w()?),
                _ => None,
            };
            let (len_ptr, _gl) = match &lengths {
                Some(t) => {
                    let (p, g) = t.device_ptr(&stream);
                    (p, Some(g))
                }
                None => (0, None),
            };
            let rows_per_batch = match mask {
                Mask::KeyLengths(l) => (rows / l.len()) as i64,
                _ => 1,
            };
            let (rows_i, d_i) = (rows as i32, d as i32);
            let mut lb = func.builder();
            lb.arg(&xp).arg(&yp).arg(&rows_i).arg(&d_i).arg(&causal);
            lb.arg(&len_ptr).arg(&rows_per_batch);
            // SAFETY: x and y hold rows * d elements of the kernel's dtype; the lengths (when
            // given) hold one i32 per batch entry, rows_per_batch rows each.
            unsafe { lb.launch(row_cfg(rows)) }.w()?;
        }
        Ok((y, l.shape().clone()))
    }

    pub(super) fn bwd(
        y: &CudaStorage,
        ly: &Layout,
        dy: &CudaStorage,
        ldy: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let op = "softmax_last_dim_backward";
        if ly.dims() != ldy.dims() || y.dtype() != dy.dtype() {
            bail!(
                "{op}: y {:?} {:?} and dy {:?} {:?} differ",
                ly.dims(),
                y.dtype(),
                ldy.dims(),
                dy.dtype()
            )
        }
        let dev = &y.device;
        let (rows, d) = rows_cols(op, ly)?;
        let mut dx = alloc(dev, y.dtype(), rows * d)?;
        if rows > 0 {
            let stream = dev.cuda_stream();
            let (yp, _gy) = in_ptr(op, "y", y, ly, &stream)?;
            let (dyp, _gdy) = in_ptr(op, "dy", dy, ldy, &stream)?;
            let (dxp, _gdx) = out_ptr(&mut dx, &stream)?;
            let vec = vec_ok(d, y.dtype().size_in_bytes(), &[yp, dyp, dxp]);
            let kernel = format!(
                "softmax_bwd_{}{}",
                dtype_name(op, y.dtype())?,
                if vec { "_vec" } else { "" }
            );
            let func = dev.get_or_load_custom_func(&kernel, MODULE, crate::cuda::ptx::SOFTMAX)?;
            let (rows_i, d_i) = (rows as i32, d as i32);
            let mut lb = func.builder();
            lb.arg(&yp).arg(&dyp).arg(&dxp).arg(&rows_i).arg(&d_i);
            // SAFETY: y, dy and dx hold rows * d elements of the kernel's dtype.
            unsafe { lb.launch(row_cfg(rows)) }.w()?;
        }
        Ok((dx, ly.shape().clone()))
    }
}
