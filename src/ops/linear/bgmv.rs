//! Batched gather matrix-vector multiplication (BGMV, Punica: Chen et al. 2023, "Punica:
//! Multi-Tenant LoRA Serving"): the LoRA updates of a batch whose rows use different
//! adapters, each row gathering its own adapter's A and B from stacks. The CPU reference in
//! candle ops, and the seam for a CUDA kernel (Punica's `bgmv_shrink` / `bgmv_expand`).

use candle_core::{bail, DType, Result, Tensor};

/// `y[n] = scale · B[i] (A[i] x[n])` with `i = indices[n]`, for a batch `x: (N, in)` whose
/// rows use different LoRA adapters: `a: (L, r, in)` and `b: (L, out, r)` stack the `L`
/// adapters (one rank `r` for all: pad smaller ranks with zero rows of A and zero columns of
/// B, which adds nothing), `indices: (N,)` u32 on x's device, a row with index `L` (one past
/// the last adapter) using none (its update is zero: the base model's row). Returns `(N,
/// out)` in x's dtype; the base projection's output is the caller's, to which this is added.
/// Inference only: A and B are gathered per row (`(N, r, in)` and `(N, out, r)`, materialised
/// here; a kernel reads them in place).
///
/// Errors (no panics): shapes that disagree, an index above `L`, dtypes that differ, a
/// non-finite scale.
pub fn bgmv(x: &Tensor, a: &Tensor, b: &Tensor, indices: &Tensor, scale: f64) -> Result<Tensor> {
    let op = "bgmv";
    let (n, d_in) = x.dims2()?;
    let (l, r, a_in) = a.dims3()?;
    let (lb, d_out, rb) = b.dims3()?;
    if a_in != d_in || lb != l || rb != r {
        bail!(
            "{op}: x (N, in) = {:?}, a (L, r, in) = {:?} and b (L, out, r) = {:?} disagree",
            x.dims(),
            a.dims(),
            b.dims()
        )
    }
    if indices.dims() != [n] || indices.dtype() != DType::U32 {
        bail!(
            "{op}: indices must be (N,) = ({n},) u32, one adapter per row; found {:?} {:?}",
            indices.dims(),
            indices.dtype()
        )
    }
    if a.dtype() != x.dtype() || b.dtype() != x.dtype() {
        bail!(
            "{op}: x, a and b must share a dtype; found {:?}, {:?}, {:?}",
            x.dtype(),
            a.dtype(),
            b.dtype()
        )
    }
    if !scale.is_finite() {
        bail!("{op}: scale {scale} is not finite")
    }
    if let Some(bad) = indices
        .to_vec1::<u32>()?
        .into_iter()
        .find(|&i| i as usize > l)
    {
        bail!("{op}: index {bad} is past the {l} adapters (use {l} for a row without one)")
    }
    // one zero adapter after the stacks: the rows without one gather it
    let a = Tensor::cat(
        &[a, &Tensor::zeros((1, r, d_in), a.dtype(), a.device())?],
        0,
    )?;
    let b = Tensor::cat(
        &[b, &Tensor::zeros((1, d_out, r), b.dtype(), b.device())?],
        0,
    )?;
    let shrunk = a
        .index_select(indices, 0)?
        .matmul(&x.reshape((n, d_in, 1))?)?; // (N, r, 1)
    let expanded = b.index_select(indices, 0)?.matmul(&shrunk)?; // (N, out, 1)
    expanded.reshape((n, d_out))?.affine(scale, 0.0)
}
