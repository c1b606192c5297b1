//! Where the adapted parts of a grouped LoRA linear sit: a stack of modules (q/k/v, gate/up)
//! sharing one frozen weight, part i with `rows_i` output rows and rank `r_i` (0: not
//! adapted). The CPU path ([`super::lora`]) and the CUDA path ([`super::lora_cuda`]) both
//! read the layout from here.

use candle_core::{bail, Result, Tensor};

/// The block-diagonal `(N, R)` up projection of stacked parts: part `i`'s rows of `b` at its
/// rank columns, zeros elsewhere (and zero rows for a part without an adapter). Built from
/// differentiable ops, so a tracked `b` gets its gradient through it.
///
/// Errors: `b` does not hold the adapted parts' rows (`(sum of N_i over adapted parts, r)`).
pub(crate) fn block_diagonal(b: &Tensor, parts: &[(usize, usize)]) -> Result<Tensor> {
    let r_sum: usize = parts.iter().map(|p| p.1).sum();
    let mut blocks = offsets(parts).into_iter();
    let mut rows = Vec::with_capacity(parts.len());
    for &(n_i, r_i) in parts {
        if r_i > 0 {
            let Some(Block { q, b_row: row, .. }) = blocks.next() else {
                bail!("lora_linear: parts {parts:?} do not match their blocks (internal error)")
            };
            rows.push(
                b.narrow(0, row, n_i)?
                    .pad_with_zeros(1, q, r_sum - q - r_i)?,
            );
        } else {
            rows.push(Tensor::zeros((n_i, r_sum), b.dtype(), b.device())?);
        }
    }
    Tensor::cat(&rows, 0)
}

/// Where an adapted part's blocks sit: its output columns `col..col + rows`, its rank
/// columns of `u` from `q`, its rows of `b` from `b_row`.
#[derive(Debug, Clone, Copy)]
pub(in crate::ops) struct Block {
    pub col: usize,
    pub rows: usize,
    pub q: usize,
    pub b_row: usize,
}

/// The adapted parts' blocks, in order.
pub(in crate::ops) fn offsets(parts: &[(usize, usize)]) -> Vec<Block> {
    let (mut col, mut q, mut b_row) = (0, 0, 0);
    let mut out = Vec::new();
    for &(rows, r_i) in parts {
        if r_i > 0 {
            out.push(Block {
                col,
                rows,
                q,
                b_row,
            });
            q += r_i;
            b_row += rows;
        }
        col += rows;
    }
    out
}
