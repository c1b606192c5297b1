//! The fused q/k/v projection `(B, T, (H + 2 Hkv) D)`, columns `[q heads | k heads | v
//! heads]`, that the decoder families' attention takes: its head width, checked, and its split
//! into per-head q, k and v.

use candle_core::{bail, Result, Tensor};

/// The head width `D` of a fused `(B, T, (H + 2 Hkv) D)` projection, checked.
pub(in crate::ops) fn qkv_head_dim(
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

/// q `(B, H, T, D)`, k and v `(B, Hkv, T, D)` of a fused `(B, T, (H + 2 Hkv) D)` projection,
/// each contiguous.
pub(in crate::ops) fn split_qkv(
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
