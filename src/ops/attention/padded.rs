//! Bidirectional self-attention over right-padded sequences (BERT's encoder), from the fused
//! projection to the merged heads:
//!
//! ```text
//! qkv: (B, T, 3C) = [q | k | v], head h at columns h*Dh..(h+1)*Dh of each part, C = H * Dh
//! S_h = (q_h / sqrt(Dh)) k_h^T,  keys j < len[b] only      P_h = softmax(S_h)      y_h = P_h v_h
//! y: (B, T, C), head h at columns h*Dh..(h+1)*Dh
//! ```
//! transformers' `BertSelfAttention` with the key-padding mask of the attention mask, except
//! that masked keys get exactly zero probability ([`crate::ops::key_padding_softmax_last_dim`])
//! rather than the tiny ones a large negative additive mask leaves. The scores `(B, H, T, T)`
//! are materialised: at BERT's short sequences they are small, and the head width (32 for
//! MiniLM) is not one the flash kernels take.
//!
//! [`key_padding_attention`] is the composition of candle ops (its autograd is the reference);
//! [`PaddedAttention`] runs the same forward without a graph and the backward that autograd
//! would run, op for op (candle-core 0.11's `backprop.rs`: a matmul's gradients
//! `dA = dC B^T`, `dB = A^T dC`; an affine map's `dX = mul * dY`; a transpose's, a narrow's and
//! the head permutations' are the inverse data movements), so the two give the same bits, and
//! the block nodes ([`crate::ops::post_norm_block`]) take it as an inner op.

use super::heads::{merge_heads, split_heads};
use super::softmax::{key_padding_softmax_last_dim, softmax_backward};
use candle_core::{bail, Result, Tensor};

/// Bidirectional multi-head attention of `qkv: (B, T, 3C)` (f32, bf16 or f16) with `n_head`
/// heads, where batch entry `b` has `key_lengths[b]` valid positions (keys at or after it are
/// masked for every query); returns `(B, T, C)` in qkv's dtype, heads merged. Rows of padded
/// queries are computed like the others (they attend to the valid keys). Differentiable: the
/// composition of [`split_heads`], an affine scale, two batched matmuls,
/// [`key_padding_softmax_last_dim`] and [`merge_heads`].
///
/// Errors (no panics): qkv not `(B, T, 3 n_head Dh)`, `n_head == 0`, `key_lengths.len() != B`,
/// a length outside `1..=T`, a non-float dtype.
pub fn key_padding_attention(qkv: &Tensor, n_head: usize, key_lengths: &[usize]) -> Result<Tensor> {
    Ok(forward(qkv, n_head, key_lengths)?.0)
}

/// What the backward reads besides qkv: the scaled queries, the keys, the values and the
/// probabilities, `(B, H, T, Dh)` and `(B, H, T, T)`, views and tensors as the forward made
/// them.
struct Saved {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    p: Tensor,
}

fn forward(qkv: &Tensor, n_head: usize, key_lengths: &[usize]) -> Result<(Tensor, Saved)> {
    let (_, _, c3) = qkv.dims3()?;
    if n_head == 0 || c3 % (3 * n_head) != 0 {
        bail!(
            "key_padding_attention: qkv's last dimension {c3} is not 3 * n_head * head_dim \
             with n_head = {n_head}"
        )
    }
    let dh = c3 / 3 / n_head;
    let heads = split_heads(qkv, n_head)?; // (3, B, H, T, Dh)
    let q = heads.get(0)?.affine(1.0 / (dh as f64).sqrt(), 0.0)?;
    let (k, v) = (heads.get(1)?, heads.get(2)?);
    let scores = q.matmul(&k.t()?)?; // (B, H, T, T)
    let p = key_padding_softmax_last_dim(&scores, key_lengths)?;
    let y = merge_heads(&p.matmul(&v)?)?;
    Ok((y, Saved { q, k, v, p }))
}

/// [`key_padding_attention`] as an inner op of a block node: the forward on an untracked qkv,
/// and its backward.
pub(in crate::ops) struct PaddedAttention {
    n_head: usize,
    saved: Saved,
}

impl PaddedAttention {
    /// Runs the forward of `qkv` (untracked: no graph is recorded); returns y and the op.
    pub(in crate::ops) fn forward(
        qkv: &Tensor,
        n_head: usize,
        key_lengths: &[usize],
    ) -> Result<(Tensor, Self)> {
        let (y, saved) = forward(qkv, n_head, key_lengths)?;
        Ok((y, Self { n_head, saved }))
    }

    /// qkv's gradient `(B, T, 3C)` from y's `dy: (B, T, C)`, as candle's autograd gives it for
    /// the composition.
    pub(in crate::ops) fn backward(&self, dy: &Tensor) -> Result<Tensor> {
        let Saved { q, k, v, p } = &self.saved;
        let (b, t, c) = dy.dims3()?;
        let (h, dh) = (self.n_head, c / self.n_head);
        // merge_heads' backward: back to (B, H, T, Dh), contiguous
        let dout = dy.reshape((b, t, h, dh))?.transpose(1, 2)?.contiguous()?;
        // y = P v
        let dp = dout.matmul(&v.t()?)?;
        let dv = p.t()?.matmul(&dout)?;
        let ds = softmax_backward(p, &dp)?;
        // S = q k^T: dq = dS (k^T)^T, whose layout is k's; dk = (q^T dS)^T
        let dq = ds.matmul(k)?;
        let dk = q.t()?.matmul(&ds)?.t()?;
        // q = scale * q0
        let dq = dq.affine(1.0 / (dh as f64).sqrt(), 0.0)?;
        // split_heads' backward: (3, B, H, T, Dh) back to (B, T, 3C)
        let dheads = Tensor::stack(&[dq, dk, dv], 0)?;
        dheads.permute((1, 3, 0, 2, 4))?.reshape((b, t, 3 * c))
    }
}
