//! Attention over a paged KV cache (vLLM's PagedAttention, Kwon et al. 2023, "Efficient
//! Memory Management for Large Language Model Serving with PagedAttention"): the keys and
//! values of every sequence live in one preallocated pool of fixed-size blocks, and each
//! sequence reaches its own through a table of slots. A batch is the new tokens of several
//! sequences packed into one row (each at its own positions: a prefill chunk or one decode
//! token), as FlashAttention's varlen layout packs documents.
//!
//! This is the CPU reference in candle ops (and the fallback on any device): the new keys
//! and values are written into their slots, then each sequence's keys are gathered through
//! its slot table and [`crate::ops::grouped_attention`] runs on them. A CUDA paged decode kernel
//! takes the same arguments ([`paged_attention`] is the seam): `qkv`, the two pools and the
//! per-sequence `(start, len, offset, slots)`.

use super::composed::grouped_attention;
use super::qkv::{qkv_head_dim, split_qkv};
use candle_core::{bail, Result, Tensor};

/// One sequence's part of a paged batch.
#[derive(Debug, Clone)]
pub struct PagedSeq {
    /// Positions already cached: the absolute position of its first new token.
    pub start: usize,
    /// Its new tokens this step (>= 1): rows `offset..offset + len` of the packed batch.
    pub len: usize,
    /// The packed row of its first new token.
    pub offset: usize,
    /// The pool slots of its positions `0..start + len`: `(start + len,)` u32 on the pools'
    /// device (slot = block id × block size + offset in the block).
    pub slots: Tensor,
    /// The same slots of the new positions `start..start + len`, on the host (the writes).
    pub new_slots: Vec<u32>,
}

/// Attention of a packed batch of sequences over a paged KV cache. `qkv: (1, N, (H + 2 Hkv)
/// D)` (normed and rotated, `N` the sum of the sequences' `len`); `k_pool`, `v_pool`:
/// `(S, Hkv D)` each, contiguous, qkv's dtype, `S` slots. For each sequence, the k and v rows
/// of its new tokens are written into `new_slots` of the pools (in place: the pools are the
/// cache), then its queries at positions `start..start + len` attend over the keys of
/// positions `0..start + len` gathered from `slots`, causally, with an optional sliding
/// `window` (keys seen per query, its own included) and `scale` (`None`: `1 / sqrt(D)`), as
/// [`grouped_attention`] does. Returns `(1, N, H D)` in qkv's dtype. Inference only (no
/// gradient reaches the pools).
///
/// A failed call may have written some new slots; they belong to positions the caller has
/// not committed (it advances a sequence only after a successful forward), so they are
/// overwritten by the retry and never read before.
///
/// Errors (no panics): qkv not `(1, N, (H + 2 Hkv) D)`; pools of another shape or dtype;
/// sequences whose rows do not tile `0..N` in order, with `len == 0`, or whose slot tables do
/// not hold `start + len` / `len` entries; a slot outside the pool; `window == Some(0)`.
pub fn paged_attention(
    qkv: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    seqs: &[PagedSeq],
    (n_head, n_kv_head): (usize, usize),
    window: Option<usize>,
    scale: Option<f64>,
) -> Result<Tensor> {
    let op = "paged_attention";
    let d = qkv_head_dim(op, qkv, n_head, n_kv_head)?;
    let (b, n, _) = qkv.dims3()?;
    let width = n_kv_head * d;
    if b != 1 {
        bail!("{op}: qkv must be one packed row (1, N, _); found batch {b}")
    }
    let slots = match k_pool.dims() {
        &[s, w] if w == width && v_pool.dims() == k_pool.dims() => s,
        _ => bail!(
            "{op}: the pools must be (S, Hkv D) = (S, {width}) each; found k {:?}, v {:?}",
            k_pool.dims(),
            v_pool.dims()
        ),
    };
    if k_pool.dtype() != qkv.dtype() || v_pool.dtype() != qkv.dtype() {
        bail!(
            "{op}: the pools hold {:?} / {:?} but qkv is {:?}; make the cache in the model's \
             compute dtype",
            k_pool.dtype(),
            v_pool.dtype(),
            qkv.dtype()
        )
    }
    if window == Some(0) {
        bail!("{op}: window Some(0) masks every key; use None (no window) or a window >= 1")
    }
    let mut row = 0;
    for (i, s) in seqs.iter().enumerate() {
        if s.len == 0 || s.offset != row || s.new_slots.len() != s.len {
            bail!(
                "{op}: sequence {i} has offset {} and len {} with {} new slots; sequences must \
                 tile the packed rows in order (expected offset {row}), each with len >= 1 \
                 and one new slot per new token",
                s.offset,
                s.len,
                s.new_slots.len()
            )
        }
        if s.slots.dims() != [s.start + s.len] {
            bail!(
                "{op}: sequence {i}'s slot table is {:?}; it must be (start + len,) = ({},)",
                s.slots.dims(),
                s.start + s.len
            )
        }
        if let Some(bad) = s.new_slots.iter().find(|&&x| x as usize >= slots) {
            bail!("{op}: sequence {i} writes slot {bad}, outside the pool of {slots}")
        }
        row += s.len;
    }
    if row != n {
        bail!("{op}: the sequences cover {row} rows but qkv has {n}")
    }
    let (q, k, v) = split_qkv(qkv, n_head, n_kv_head, d)?;
    // (1, Hkv, N, D) -> (N, Hkv D): one row per new token, as the pools hold them
    let rows = |x: &Tensor| x.squeeze(0)?.transpose(0, 1)?.reshape((n, width));
    let (k_rows, v_rows) = (rows(&k)?, rows(&v)?);
    for s in seqs {
        write_rows(k_pool, &k_rows, s)?;
        write_rows(v_pool, &v_rows, s)?;
    }
    let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
    let mut out = Vec::with_capacity(seqs.len());
    for s in seqs {
        let total = s.start + s.len;
        let gather = |pool: &Tensor| {
            pool.index_select(&s.slots, 0)?
                .reshape((1, total, n_kv_head, d))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q_s = q.narrow(2, s.offset, s.len)?;
        out.push(grouped_attention(
            &q_s,
            &gather(k_pool)?,
            &gather(v_pool)?,
            s.start,
            window,
            scale,
        )?);
    }
    Tensor::cat(&out, 1)
}

/// Writes rows `offset..offset + len` of `rows: (N, W)` into `pool: (S, W)` at `new_slots`,
/// one copy per run of consecutive slots (a block's worth at most).
fn write_rows(pool: &Tensor, rows: &Tensor, s: &PagedSeq) -> Result<()> {
    let mut i = 0;
    while i < s.len {
        let mut j = i + 1;
        while j < s.len && s.new_slots[j] == s.new_slots[j - 1] + 1 {
            j += 1;
        }
        let src = rows.narrow(0, s.offset + i, j - i)?.contiguous()?;
        pool.slice_set(&src, 0, s.new_slots[i] as usize)?;
        i = j;
    }
    Ok(())
}
