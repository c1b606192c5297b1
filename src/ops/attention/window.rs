//! Causal self-attention of a fused q/k/v projection with a sliding window and any score scale
//! (Mistral's and Gemma 3's, Gemma 3's `query_pre_attn_scalar`): the fused flash op where the
//! scale is the default, the composition otherwise.
//!
//! Sources of the semantics: transformers' `modeling_mistral.py` and `modeling_gemma3.py`
//! (masks from `masking_utils.sliding_window_causal_mask_function`).

use super::causal::grouped_window_attention;
use super::composed::grouped_attention;
use super::qkv::{qkv_head_dim, split_qkv};
use crate::ops::common::check_float;
use candle_core::{Result, Tensor};

/// Causal self-attention of a fused projection `qkv: (B, T, (H + 2 Hkv) D)` (columns
/// `[q heads | k heads | v heads]`, as [`crate::ops::grouped_causal_attention`] takes it; q and k
/// already normed and rotated) with an optional sliding `window` (W keys including the
/// query's own) and `scale` (`None`: `1 / sqrt(D)`; Gemma 3: `query_pre_attn_scalar^-0.5`).
/// Returns `(B, T, H D)` in qkv's dtype.
///
/// Where the scale is the default (`None` or exactly `1 / sqrt(D)`) this is the fused
/// [`crate::ops::grouped_causal_attention`] (the window does not bind: `None` or `W >= T`) or its
/// windowed form [`crate::ops::grouped_window_attention`] (the flash kernels on CUDA with
/// `D == 64` and the CPU reference, keys outside the window skipped); otherwise
/// [`grouped_attention`] of the split heads with `start = 0` (the mask as documented there;
/// scores materialised). Differentiable either way.
///
/// Errors (no panics): as [`crate::ops::grouped_causal_attention`] and [`grouped_attention`].
pub fn window_causal_attention(
    qkv: &Tensor,
    n_head: usize,
    n_kv_head: usize,
    window: Option<usize>,
    scale: Option<f64>,
) -> Result<Tensor> {
    let op = "window_causal_attention";
    let d = qkv_head_dim(op, qkv, n_head, n_kv_head)?;
    let t = qkv.dim(1)?;
    if is_plain_causal(t, d, None, scale) && window != Some(0) {
        // the default scale: the fused op, windowed where the window binds
        return grouped_window_attention(qkv, n_head, n_kv_head, window);
    }
    check_float(op, "qkv", qkv.dtype())?;
    let (q, k, v) = split_qkv(qkv, n_head, n_kv_head, d)?;
    let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
    grouped_attention(&q, &k, &v, 0, window, scale)
}

/// Whether [`window_causal_attention`] is the fused [`crate::ops::grouped_causal_attention`] for
/// `t` positions of head width `d`: the window does not bind and the scale is the default.
pub(in crate::ops) fn is_plain_causal(
    t: usize,
    d: usize,
    window: Option<usize>,
    scale: Option<f64>,
) -> bool {
    window.is_none_or(|w| w >= t) && scale.is_none_or(|s| s == 1.0 / (d as f64).sqrt())
}
