//! Per-head RMSNorm of the q and k parts of a fused q/k/v projection (Qwen3's and Gemma 3's
//! `q_norm` / `k_norm`), composed of [`super::rms_norm`]'s op.
//!
//! Source of the semantics: transformers' `modeling_qwen3.py` and `modeling_gemma3.py`.

use super::rms_norm::rms_norm_with_dtype;
use crate::ops::attention::qkv::qkv_head_dim;
use crate::ops::common::check_float;
use candle_core::{bail, Result, Tensor};

/// Per-head RMSNorm of the q and k parts of a fused `(B, T, (H + 2 Hkv) D)` projection (Qwen3's
/// and Gemma 3's `q_norm` / `k_norm`: `RMSNorm(head_dim)` applied to `(B, T, heads, D)` before
/// the rotary embedding), the v part unchanged. `q_w` and `k_w` are gains `(D,)` shared by
/// every head (used in f32); statistics in f32 ([`crate::ops::rms_norm_with_dtype`] on the
/// `(B, T, H, D)` and `(B, T, Hkv, D)` views). Gemma's `(1 + w)` gain is the caller's: pass
/// `w + 1`. Returns qkv's shape, layout and dtype. Differentiable with respect to qkv and the
/// gains.
///
/// Errors (no panics): a qkv that is not `(B, T, (H + 2 Hkv) D)`, gains that are not `(D,)`,
/// eps negative or not finite, non-float dtypes, other devices.
pub fn qk_rms_norm(
    qkv: &Tensor,
    q_w: &Tensor,
    k_w: &Tensor,
    eps: f64,
    n_head: usize,
    n_kv_head: usize,
) -> Result<Tensor> {
    let op = "qk_rms_norm";
    let d = qkv_head_dim(op, qkv, n_head, n_kv_head)?;
    check_float(op, "qkv", qkv.dtype())?;
    for (what, w) in [("q_w", q_w), ("k_w", k_w)] {
        if w.dims() != [d] {
            bail!(
                "{op}: {what} must be the per-head gain (D,) = ({d},); found {:?}",
                w.dims()
            )
        }
    }
    let (b, t, _) = qkv.dims3()?;
    let norm = |first: usize, heads: usize, w: &Tensor| -> Result<Tensor> {
        let x = qkv
            .narrow(2, first * d, heads * d)?
            .reshape((b, t, heads, d))?;
        rms_norm_with_dtype(&x, w, eps, qkv.dtype())?.reshape((b, t, heads * d))
    };
    let q = norm(0, n_head, q_w)?;
    let k = norm(n_head, n_kv_head, k_w)?;
    let v = qkv.narrow(2, (n_head + n_kv_head) * d, n_kv_head * d)?;
    Tensor::cat(&[q, k, v], 2)
}
