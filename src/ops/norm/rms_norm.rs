//! RMSNorm over the last dimension (Zhang & Sennrich 2019, "Root Mean Square Layer
//! Normalization", arXiv:1910.07467), fused and differentiable:
//!
//! ```text
//! rstd = 1 / sqrt(sum(x^2) / D + eps)
//! y    = x * rstd * w
//! ```
//! and its backward, with `xhat = x * rstd`, `g = dy * w`:
//! ```text
//! dx = rstd * (g - xhat * mean(g * xhat))
//! dw = sum_rows(dy * xhat)
//! ```
//! It is LayerNorm without the mean and the bias; the ops, CPU loops and CUDA launchers are
//! shared with [`crate::ops::layer_norm`] (kernels in `kernels/rmsnorm.cu` and `kernels/norm.cuh`).

use super::layer_norm::{prepare, Kind, NormFwd};
use candle_core::{DType, Result, Tensor};

/// Fused, differentiable RMSNorm over the last dimension, output in x's dtype.
///
/// - `x`: `(.., D)` in f32, bf16 or f16 (any layout; made contiguous first).
/// - `w` (gain): `(D,)`, used in f32 (other float dtypes are cast, differentiably).
/// - `eps`: added to the mean square, finite and `>= 0` (LLaMA uses `1e-5` or `1e-6`).
///
/// Returns `y` with x's shape and dtype; statistics and arithmetic in f32. Differentiable with
/// respect to `x` and `w` on the CPU and on CUDA; not twice differentiable. Same math as
/// `candle_nn::ops::rms_norm_slow` (Zhang & Sennrich 2019), in one graph node.
///
/// Errors (no panics) when x is a scalar, has an empty last dimension or a dtype other than
/// f32/bf16/f16, when `w` is not `(D,)` or lives on another device, or when `eps` is negative
/// or not finite.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    rms_norm_with_dtype(x, w, eps, x.dtype())
}

/// [`rms_norm`] with the output dtype chosen: x's dtype, f32, or bf16/f16 for an f32 x. The gradient of `x` comes back
/// in x's dtype. Errors for any other `out_dtype`.
pub fn rms_norm_with_dtype(x: &Tensor, w: &Tensor, eps: f64, out_dtype: DType) -> Result<Tensor> {
    let kind = Kind::Rms;
    let (x, w, _d) = prepare(kind, x, w, eps, out_dtype)?;
    x.apply_op2(
        &w,
        NormFwd {
            kind,
            eps: eps as f32,
            out: out_dtype,
        },
    )
}
