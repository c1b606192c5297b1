//! Attention composed of differentiable ops (candle's and wick's fused ones, so autograd gives
//! the backward): grouped-query attention of queries at any absolute positions, causal with an
//! optional sliding window and any score scale, and an optional per-token document mask. The
//! path of Mistral's and Gemma 3's sliding windows at other scales, of the KV cache
//! ([`super::cached`]) and the reference of the packed documents ([`super::varlen`]).
//!
//! Sources of the semantics: transformers' `modeling_mistral.py`, `modeling_qwen3.py` and
//! `modeling_gemma3.py` (masks from `masking_utils.sliding_window_causal_mask_function`), and,
//! for comparison, candle-transformers 0.11.1's `gemma3.rs` and `qwen3.rs`.

use super::softmax::softmax_last_dim;
use crate::ops::common::{check_device, check_float};
use candle_core::{bail, DType, Result, Tensor};

/// Grouped-query attention of queries at absolute positions `start..start + T` against the
/// keys and values of positions `0..S`, `S = start + T` (a KV-cached forward: `start` cached
/// positions; training and prefill: `start == 0`):
///
/// - `q`: `(B, H, T, D)`; `k`, `v`: `(B, Hkv, S, D)`; `H` a multiple of `Hkv`, query head h
///   using key/value head `h / (H / Hkv)` (K and V are never repeated: q is viewed as
///   `(B, Hkv, G T, D)`, `G = H / Hkv`). Any float dtypes (f32, bf16, f16), one device.
/// - scores `q k^T * scale` in f32 (q and k cast first), plus an additive `(T, S)` mask built
///   on the host once per call and broadcast over batch, heads and group: the query at
///   position `p = start + i` sees key `j` iff `j <= p` and, with `window = Some(W)`,
///   `p - j < W` (W keys including itself: transformers' sliding-window mask
///   `kv_idx > q_idx - sliding_window`, as Mistral, Qwen2 and Gemma 3 use it). Note that
///   candle-transformers 0.11.1's gemma3 and mistral masks keep `W + 1` keys
///   (`j + W < p` masked).
/// - softmax in f32 (wick's fused, differentiable [`crate::ops::softmax_last_dim`]; candle-nn's
///   `softmax_last_dim` has no backward), probabilities cast to v's dtype, times v.
///
/// Returns `(B, T, H D)` in v's dtype, heads merged (`(B, T, H, D)` reshaped). Differentiable
/// with respect to q, k and v. The `(B, H, T, S)` scores are materialised (f32): this is the
/// path for sliding windows, other scales and the KV cache, not a flash kernel.
///
/// Errors (no panics): ranks other than 4, shapes that disagree (batch, head width, k vs v,
/// `S != start + T`, `H` not a multiple of `Hkv`, no key/value heads), `window == Some(0)`, a
/// scale that is not finite, non-float dtypes, tensors on different devices. `T == 0` gives an
/// empty `(B, 0, H D)`.
pub fn grouped_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    start: usize,
    window: Option<usize>,
    scale: f64,
) -> Result<Tensor> {
    grouped_attention_masked(q, k, v, start, window, scale, None)
}

/// [`grouped_attention`] with an optional per-token document mask (packed rows,
/// [`crate::ops::grouped_varlen_attention_composed`]): `first_key: (S,)` u32 on q's device, the
/// first key that the query at absolute position `p` may see (the first token of its
/// document); key `j < first_key[p]` is hidden as well. The mask is built on the device from
/// the table (no host synchronisation). `None` is [`grouped_attention`].
///
/// Errors: as [`grouped_attention`], and a `first_key` that is not `(S,)`.
pub(in crate::ops) fn grouped_attention_masked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    start: usize,
    window: Option<usize>,
    scale: f64,
    first_key: Option<&Tensor>,
) -> Result<Tensor> {
    let op = "grouped_attention";
    for (what, t) in [("q", q), ("k", k), ("v", v)] {
        check_float(op, what, t.dtype())?;
        check_device(op, what, q, t)?;
        if t.rank() != 4 {
            bail!(
                "{op}: {what} must be rank 4 (q (B, H, T, D), k and v (B, Hkv, S, D)); found {:?}",
                t.dims()
            )
        }
    }
    let (b, h, t, d) = q.dims4()?;
    let (bk, hkv, s, dk) = k.dims4()?;
    if k.dims() != v.dims() || bk != b || dk != d {
        bail!(
            "{op}: k and v must be (B, Hkv, S, D) with q's B and D; found q {:?}, k {:?}, v {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        )
    }
    if hkv == 0 || h % hkv != 0 {
        bail!("{op}: q's {h} heads must be a non-zero multiple of k/v's {hkv} heads (grouped-query attention)")
    }
    if s != start + t {
        bail!(
            "{op}: k and v hold {s} positions but start + T = {start} + {t}; pass the keys of \
             positions 0..start + T (the cache's and the new ones)"
        )
    }
    if window == Some(0) {
        bail!("{op}: window Some(0) masks every key; use None (no window) or a window >= 1")
    }
    if !scale.is_finite() {
        bail!("{op}: scale {scale} is not finite")
    }
    if b * t * h * d == 0 {
        return Tensor::zeros((b, t, h * d), v.dtype(), v.device());
    }
    let g = h / hkv;
    let window = window_mask(t, s, start, window)
        .map(|m| Tensor::from_vec(m, (t, s), q.device()))
        .transpose()?;
    let docs = first_key
        .map(|f| document_mask(op, f, t, s, start))
        .transpose()?;
    let mask = match (window, docs) {
        (Some(w), Some(d)) => Some((w + d)?),
        (w, d) => w.or(d),
    };
    // query head h = kv G + g at rows g T..(g + 1) T of its key/value head's (G T, D)
    let q = q.to_dtype(DType::F32)?.reshape((b, hkv, g * t, d))?;
    let k = k.to_dtype(DType::F32)?;
    let scores = q.matmul(&k.t()?)?.affine(scale, 0.0)?; // (B, Hkv, G T, S)
    let scores = match mask {
        Some(m) => scores
            .reshape((b, hkv, g, t, s))?
            .broadcast_add(&m)?
            .reshape((b, hkv, g * t, s))?,
        None => scores,
    };
    let p = softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
    let y = p.matmul(&v.contiguous()?)?; // (B, Hkv, G T, D)
    y.reshape((b, h, t, d))?
        .transpose(1, 2)?
        .reshape((b, t, h * d))
}

/// The additive `(T, S)` mask of [`grouped_attention`] (0 visible, -inf hidden), row-major;
/// `None` when every key is visible.
fn window_mask(t: usize, s: usize, start: usize, window: Option<usize>) -> Option<Vec<f32>> {
    let visible = |i: usize, j: usize| {
        let p = start + i;
        j <= p && window.is_none_or(|w| p - j < w)
    };
    let m: Vec<f32> = (0..t * s)
        .map(|r| match visible(r / s, r % s) {
            true => 0.0,
            false => f32::NEG_INFINITY,
        })
        .collect();
    m.iter().any(|v| *v != 0.0).then_some(m)
}

/// The additive `(T, S)` document mask of [`grouped_attention_masked`] (0 where key `j >=
/// first_key[start + i]`, -inf before), built on first_key's device.
fn document_mask(op: &str, first_key: &Tensor, t: usize, s: usize, start: usize) -> Result<Tensor> {
    if first_key.dims() != [s] {
        bail!(
            "{op}: the documents' first_key table must be (S,) = ({s},), one entry per \
             position; found {:?}",
            first_key.dims()
        )
    }
    let dev = first_key.device();
    let first = first_key
        .to_dtype(DType::U32)?
        .narrow(0, start, t)?
        .reshape((t, 1))?;
    let keys = Tensor::arange(0u32, s as u32, dev)?.reshape((1, s))?;
    let seen = keys.broadcast_ge(&first)?; // (T, S) u8
    let zero = Tensor::zeros((t, s), DType::F32, dev)?;
    let hidden = Tensor::full(f32::NEG_INFINITY, (t, s), dev)?;
    seen.where_cond(&zero, &hidden)
}
