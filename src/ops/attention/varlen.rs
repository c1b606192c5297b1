//! Variable-length (packed documents) attention: several documents concatenated in one row
//! `(1, N)`, their boundaries given as FlashAttention's cumulative offsets `cu_seqlens`
//! ([`Segments`]; `flash_attn_varlen_func`'s semantics). Query `i` of document `d` attends to
//! keys `j` with `start(d) <= j <= i` (and, with a sliding window of W keys, `i - j < W`),
//! never across documents: the per-query lower bound on the keys that the sliding window
//! already is, a second time.
//!
//! One graph node where the fused attention applies (the CPU reference; on CUDA the flash
//! kernels of `kernels/attention.cuh`, which skip the key tiles before a query tile's first
//! document and mask the tiles that cross a boundary), the composition
//! [`grouped_varlen_attention_composed`] elsewhere.

use super::causal::{binding_window, fused_with, AttentionOp, Masks};
use super::composed::grouped_attention_masked;
use super::qkv::{qkv_head_dim, split_qkv};
use super::segments::Segments;
use crate::ops::common::check_float;
use candle_core::{bail, Result, Tensor};

/// Fused, differentiable grouped-query attention over the documents packed in one row:
/// `qkv: (1, N, (H + 2 Hkv) Dh)` (columns `[q heads | k heads | v heads]` as
/// [`crate::ops::grouped_causal_attention`] takes them; q and k already rotated, with positions
/// restarting in each document: [`Segments::positions`]), `n_head = H` query heads sharing
/// `n_kv_head = Hkv` key/value heads, an optional sliding `window` (W keys including the
/// query's own), an optional `scale` (`None`: `1 / sqrt(Dh)`; Gemma 3:
/// `query_pre_attn_scalar^-0.5`) and the documents' boundaries `segments` (FlashAttention's
/// varlen `cu_seqlens`, length N). Returns `(1, N, H Dh)` in qkv's dtype.
///
/// Query `i` sees key `j` iff `first_key[i] <= j <= i` (`first_key[i]` the first token of
/// `i`'s document) and, with a window, `i - j < W`: the same as running
/// [`crate::ops::grouped_window_attention`] (with that scale) on each document alone and
/// concatenating the results, values and gradients.
///
/// One graph node where [`crate::ops::grouped_window_attention`] is one (the CPU reference, in f32;
/// on CUDA with `Dh == 64`, compute capability 8.0 or newer: the flash kernels with the
/// per-token tables of `segments`, any scale, no host synchronisation); otherwise
/// [`grouped_varlen_attention_composed`]. A single document (`cu_seqlens == [0, N]`) is
/// [`crate::ops::grouped_window_attention`] bit for bit (at the default scale).
///
/// Errors (no panics): qkv not `(1, N, (H + 2 Hkv) Dh)` (a batch other than 1: pack the rows
/// into one and offset `cu_seqlens`), `n_head` not a non-zero multiple of `n_kv_head`, a
/// non-float dtype, `segments` covering another number of tokens than N or living on another
/// device than qkv, `window == Some(0)`, a scale that is not finite.
pub fn grouped_varlen_attention(
    qkv: &Tensor,
    n_head: usize,
    n_kv_head: usize,
    window: Option<usize>,
    scale: Option<f64>,
    segments: &Segments,
) -> Result<Tensor> {
    let op = "grouped_varlen_attention";
    let dh = check(op, qkv, n_head, n_kv_head, window, scale, segments)?;
    let t = qkv.dim(1)?;
    if t == 0 {
        return Tensor::zeros((1, 0, n_head * dh), qkv.dtype(), qkv.device());
    }
    match fused_checked(op, qkv, dh, n_head, n_kv_head, window, scale, segments)? {
        Some((y, _)) => Ok(y),
        None => grouped_varlen_attention_composed(qkv, n_head, n_kv_head, window, scale, segments),
    }
}

/// [`grouped_varlen_attention`]'s one-node form with the op that ran it, for a non-empty
/// `qkv` (the arguments checked here); `None` where that function takes the composition.
pub(in crate::ops) fn fused_varlen_attention(
    qkv: &Tensor,
    n_head: usize,
    n_kv_head: usize,
    window: Option<usize>,
    scale: Option<f64>,
    segments: &Segments,
) -> Result<Option<(Tensor, AttentionOp)>> {
    let op = "grouped_varlen_attention";
    let dh = check(op, qkv, n_head, n_kv_head, window, scale, segments)?;
    fused_checked(op, qkv, dh, n_head, n_kv_head, window, scale, segments)
}

/// [`fused_varlen_attention`] for arguments [`check`] accepted (head width `dh`).
#[allow(clippy::too_many_arguments)]
fn fused_checked(
    op: &str,
    qkv: &Tensor,
    dh: usize,
    n_head: usize,
    n_kv_head: usize,
    window: Option<usize>,
    scale: Option<f64>,
    segments: &Segments,
) -> Result<Option<(Tensor, AttentionOp)>> {
    let t = qkv.dim(1)?;
    let masks = Masks {
        window: binding_window(op, window, t)?,
        // the default scale exactly as the causal op computes it
        scale: scale.filter(|&s| s != 1.0 / (dh as f64).sqrt()),
        // one document: the causal op's kernels, no tables
        segments: (segments.docs() > 1).then(|| segments.clone()),
    };
    fused_with(qkv, n_head, n_kv_head, masks)
}

/// The same attention as [`grouped_varlen_attention`] composed of separate differentiable
/// ops: q, k and v split from qkv, then [`crate::ops::grouped_attention`]'s composition (scores
/// `q k^T * scale` in f32, the causal and window mask, softmax, `@ v`) with the documents'
/// mask added: key `j` hidden from query `i` where `j < first_key[i]`, built on the device from
/// the `(N,)` table of `segments` (no host synchronisation). The `(1, H, N, N)` scores are
/// materialised. Used where the fused kernels do not apply (another head width on CUDA, other
/// devices) and as the independent reference in tests.
///
/// Errors: as [`grouped_varlen_attention`].
pub fn grouped_varlen_attention_composed(
    qkv: &Tensor,
    n_head: usize,
    n_kv_head: usize,
    window: Option<usize>,
    scale: Option<f64>,
    segments: &Segments,
) -> Result<Tensor> {
    let op = "grouped_varlen_attention_composed";
    let dh = check(op, qkv, n_head, n_kv_head, window, scale, segments)?;
    let (q, k, v) = split_qkv(qkv, n_head, n_kv_head, dh)?;
    let scale = scale.unwrap_or(1.0 / (dh as f64).sqrt());
    grouped_attention_masked(&q, &k, &v, 0, window, scale, Some(segments.first_key()))
}

/// Checks the arguments; returns the head width.
fn check(
    op: &str,
    qkv: &Tensor,
    n_head: usize,
    n_kv_head: usize,
    window: Option<usize>,
    scale: Option<f64>,
    segments: &Segments,
) -> Result<usize> {
    let dh = qkv_head_dim(op, qkv, n_head, n_kv_head)?;
    check_float(op, "qkv", qkv.dtype())?;
    let (b, n, _) = qkv.dims3()?;
    if b != 1 {
        bail!(
            "{op}: qkv has batch {b}, but packed documents live in one row (1, N, ..); \
             concatenate the rows into one and offset cu_seqlens, or call once per row"
        )
    }
    if segments.len() != n {
        bail!(
            "{op}: segments cover {} tokens (the last cu_seqlens offset) but qkv holds N = \
             {n}; build the Segments of this very row",
            segments.len()
        )
    }
    if !segments.device().same_device(qkv.device()) {
        bail!(
            "{op}: segments live on {:?} but qkv on {:?}; build them with \
             Segments::new(cu_seqlens, qkv.device())",
            segments.device(),
            qkv.device()
        )
    }
    if window == Some(0) {
        bail!("{op}: window Some(0) masks every key; use None (no window) or a window >= 1")
    }
    if let Some(s) = scale.filter(|s| !s.is_finite()) {
        bail!("{op}: scale {s} is not finite; pass None for 1 / sqrt(head_dim)")
    }
    Ok(dh)
}
