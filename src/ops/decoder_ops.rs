//! Composed ops of the decoder families beyond Llama (issue 37): Mistral's and Gemma 3's
//! sliding-window attention, Gemma 3's non-default attention scale (`query_pre_attn_scalar`)
//! and GeGLU MLP, Qwen3's and Gemma 3's per-head `q_norm` / `k_norm`, and the attention of a
//! KV-cached forward. Each is a composition of differentiable ops (candle's and wick's fused
//! ones), so autograd gives the backward; [`window_causal_attention`] is the fused
//! [`super::grouped_causal_attention`] (with its sliding window where that binds) wherever the
//! scale is the default.
//!
//! Sources of the semantics: transformers' `modeling_mistral.py`, `modeling_qwen3.py` and
//! `modeling_gemma3.py` (masks from `masking_utils.sliding_window_causal_mask_function`), and,
//! for comparison, candle-transformers 0.11.1's `gemma3.rs` and `qwen3.rs`.

use super::check_float;
use candle_core::{bail, DType, Result, Tensor, D};

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
/// - softmax in f32 (wick's fused, differentiable [`super::softmax_last_dim`]; candle-nn's
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
/// [`super::grouped_varlen_attention_composed`]): `first_key: (S,)` u32 on q's device, the
/// first key that the query at absolute position `p` may see (the first token of its
/// document); key `j < first_key[p]` is hidden as well. The mask is built on the device from
/// the table (no host synchronisation). `None` is [`grouped_attention`].
///
/// Errors: as [`grouped_attention`], and a `first_key` that is not `(S,)`.
pub(super) fn grouped_attention_masked(
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
        super::check_device(op, what, q, t)?;
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
    let p = super::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
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

/// The head width `D` of a fused `(B, T, (H + 2 Hkv) D)` projection, checked.
pub(super) fn qkv_head_dim(
    op: &str,
    qkv: &Tensor,
    n_head: usize,
    n_kv_head: usize,
) -> Result<usize> {
    if n_head == 0 || n_kv_head == 0 || n_head % n_kv_head != 0 {
        bail!("{op}: n_head {n_head} must be a non-zero multiple of n_kv_head {n_kv_head}")
    }
    let w = n_head + 2 * n_kv_head;
    match qkv.dims() {
        &[_, _, c] if c % w == 0 && c > 0 => Ok(c / w),
        dims => bail!(
            "{op}: qkv must be (B, T, (H + 2 Hkv) D) = (B, T, {w} D) with columns [q heads | k \
             heads | v heads]; found {dims:?}"
        ),
    }
}

/// Whether [`window_causal_attention`] is the fused [`super::grouped_causal_attention`] for
/// `t` positions of head width `d`: the window does not bind and the scale is the default.
pub(super) fn is_plain_causal(
    t: usize,
    d: usize,
    window: Option<usize>,
    scale: Option<f64>,
) -> bool {
    window.is_none_or(|w| w >= t) && scale.is_none_or(|s| s == 1.0 / (d as f64).sqrt())
}

/// q `(B, H, T, D)`, k and v `(B, Hkv, T, D)` of a fused `(B, T, (H + 2 Hkv) D)` projection,
/// each contiguous.
pub(super) fn split_qkv(
    qkv: &Tensor,
    n_head: usize,
    n_kv_head: usize,
    d: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, _) = qkv.dims3()?;
    let part = |first: usize, heads: usize| {
        qkv.narrow(2, first * d, heads * d)?
            .reshape((b, t, heads, d))?
            .transpose(1, 2)?
            .contiguous()
    };
    Ok((
        part(0, n_head)?,
        part(n_head, n_kv_head)?,
        part(n_head + n_kv_head, n_kv_head)?,
    ))
}

/// Causal self-attention of a fused projection `qkv: (B, T, (H + 2 Hkv) D)` (columns
/// `[q heads | k heads | v heads]`, as [`super::grouped_causal_attention`] takes it; q and k
/// already normed and rotated) with an optional sliding `window` (W keys including the
/// query's own) and `scale` (`None`: `1 / sqrt(D)`; Gemma 3: `query_pre_attn_scalar^-0.5`).
/// Returns `(B, T, H D)` in qkv's dtype.
///
/// Where the scale is the default (`None` or exactly `1 / sqrt(D)`) this is the fused
/// [`super::grouped_causal_attention`] (the window does not bind: `None` or `W >= T`) or its
/// windowed form `ops::attention::grouped_window_attention` (the flash kernels on CUDA with
/// `D == 64` and the CPU reference, keys outside the window skipped); otherwise
/// [`grouped_attention`] of the split heads with `start = 0` (the mask as documented there;
/// scores materialised). Differentiable either way.
///
/// Errors (no panics): as [`super::grouped_causal_attention`] and [`grouped_attention`].
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
        return super::attention::grouped_window_attention(qkv, n_head, n_kv_head, window);
    }
    check_float(op, "qkv", qkv.dtype())?;
    let (q, k, v) = split_qkv(qkv, n_head, n_kv_head, d)?;
    let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
    grouped_attention(&q, &k, &v, 0, window, scale)
}

/// Per-head RMSNorm of the q and k parts of a fused `(B, T, (H + 2 Hkv) D)` projection (Qwen3's
/// and Gemma 3's `q_norm` / `k_norm`: `RMSNorm(head_dim)` applied to `(B, T, heads, D)` before
/// the rotary embedding), the v part unchanged. `q_w` and `k_w` are gains `(D,)` shared by
/// every head (used in f32); statistics in f32 ([`super::rms_norm_with_dtype`] on the
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
        super::rms_norm_with_dtype(&x, w, eps, qkv.dtype())?.reshape((b, t, heads * d))
    };
    let q = norm(0, n_head, q_w)?;
    let k = norm(n_head, n_kv_head, k_w)?;
    let v = qkv.narrow(2, (n_head + n_kv_head) * d, n_kv_head * d)?;
    Tensor::cat(&[q, k, v], 2)
}

/// GeGLU with the tanh GELU (Gemma 3's MLP, `hidden_activation = "gelu_pytorch_tanh"`):
/// `x: (.., 2F) = [gate | up]` (the gate the first F columns, as [`super::swiglu`] takes them)
/// → `gelu_tanh(gate) * up`, `(.., F)`, with `gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g +
/// 0.044715 g^3)))` (wick's fused [`super::gelu_tanh`]; candle's `Tensor::gelu` is the same
/// approximation). Computed in f32, the result in x's dtype. Differentiable.
///
/// Errors (no panics): a scalar, an odd last dimension, a dtype other than f32/bf16/f16. An
/// empty x gives an empty `(.., F)` result.
pub fn geglu_tanh(x: &Tensor) -> Result<Tensor> {
    let f = super::swiglu::gated_width("geglu_tanh", x)?;
    if x.elem_count() == 0 {
        return x.narrow(D::Minus1, 0, f);
    }
    let gate = x.narrow(D::Minus1, 0, f)?.to_dtype(DType::F32)?;
    let up = x.narrow(D::Minus1, f, f)?.to_dtype(DType::F32)?;
    (super::gelu_tanh(&gate)? * up)?.to_dtype(x.dtype())
}

/// The attention of a KV-cached forward ([`super::Layer::CachedAttention`]): q, k, v split
/// from `qkv: (B, T, (H + 2 Hkv) D)` (normed and rotated), the queries at absolute positions
/// `start..start + T`, k and v appended along the positions to the cached ones, then
/// [`grouped_attention`] over the cached and new keys.
///
/// The cache holds the keys and values (detached) of the positions a future query can see:
/// every one, `0..start` (full attention, `window == None`), or, with `window = Some(W)`, the
/// last `min(start, W - 1)` (the next query, at `start + T`, sees `W - 1` earlier keys), so a
/// windowed layer's cache stays bounded however long the sequence. Within the call the new
/// queries see the kept keys plus the new ones; the cached keys are at positions
/// `start - kept..start`, which `grouped_attention` gets as the relative offset `kept` (its
/// mask is translation invariant). After the call the cache holds the kept positions of
/// `start + T`: [`cached_positions`].
///
/// Errors: a cache that does not hold [`cached_positions`]`(start, window)` positions of
/// `(B, Hkv, _, D)` (`None` is an empty cache: start 0); those of [`grouped_attention`].
pub(super) fn cached_attention(
    qkv: &Tensor,
    kv: &std::sync::Mutex<Option<(Tensor, Tensor)>>,
    start: usize,
    (n_head, n_kv_head): (usize, usize),
    window: Option<usize>,
    scale: Option<f64>,
) -> Result<Tensor> {
    let op = "cached attention";
    let d = qkv_head_dim(op, qkv, n_head, n_kv_head)?;
    if window == Some(0) {
        bail!("{op}: window Some(0) masks every key; use None (no window) or a window >= 1")
    }
    let (q, k, v) = split_qkv(qkv, n_head, n_kv_head, d)?;
    let t = q.dim(2)?;
    let kept = cached_positions(start, window);
    let mut cache = kv.lock().unwrap_or_else(|e| e.into_inner());
    let (k, v) = match cache.as_ref() {
        None if start == 0 => (k.detach(), v.detach()),
        None => bail!("{op}: start is {start} but the KV cache is empty; start at 0"),
        Some((k0, v0)) => {
            let (b, hkv, s0, d0) = k0.dims4()?;
            if s0 != kept || (b, hkv, d0) != (k.dim(0)?, n_kv_head, d) || k0.dims() != v0.dims() {
                bail!(
                    "{op}: the KV cache holds k {:?} and v {:?} but position {start} with window \
                     {window:?} needs {kept} cached positions of (B, Hkv, _, D) = {:?}; keep one \
                     cache per layer and pass start = the positions seen",
                    k0.dims(),
                    v0.dims(),
                    (k.dim(0)?, n_kv_head, d)
                )
            }
            match s0 {
                0 => (k.detach(), v.detach()),
                _ => (
                    Tensor::cat(&[k0, &k.detach()], 2)?,
                    Tensor::cat(&[v0, &v.detach()], 2)?,
                ),
            }
        }
    };
    let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
    let y = grouped_attention(&q, &k, &v, kept, window, scale)?;
    // keep what the next query can see; copy out of a long prefill's keys so that the
    // dropped positions are freed
    let keep = cached_positions(start + t, window);
    let held = kept + t;
    let trim = |x: &Tensor| -> Result<Tensor> {
        match held - keep {
            0 => Ok(x.clone()),
            dropped if dropped >= keep => x.narrow(2, dropped, keep)?.contiguous(),
            dropped => x.narrow(2, dropped, keep),
        }
    };
    *cache = Some((trim(&k)?, trim(&v)?));
    Ok(y)
}

/// The positions a layer's KV cache holds after `len` positions: `len` with full attention,
/// `min(len, W - 1)` with a sliding window of `W` keys (those the next query sees).
fn cached_positions(len: usize, window: Option<usize>) -> usize {
    match window {
        Some(w) => len.min(w.saturating_sub(1)),
        None => len,
    }
}
