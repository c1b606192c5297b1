//! The attention of a KV-cached forward (inference): the new queries against the cached and
//! new keys, the cache kept to the positions a later query can see.

use super::composed::grouped_attention;
use super::qkv::{qkv_head_dim, split_qkv};
use candle_core::{bail, Result, Tensor};

/// The attention of a KV-cached forward ([`crate::ops::Layer::CachedAttention`]): q, k, v split
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
pub(in crate::ops) fn cached_attention(
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
