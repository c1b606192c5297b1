//! `y = gelu_erf(h) @ w^T + b`, the second half of a BERT feed-forward layer, keeping only `h`
//! for the backward.
//!
//! The two-op composition `linear(gelu_erf(h), w, b)` keeps both `h` (the GELU's input) and
//! `gelu_erf(h)` (the GEMM's input) alive until the end of the backward: `2 x (B, T, 4C)`
//! elements per layer, the largest activations of a BERT layer at short sequences. Here the
//! GELU output is a temporary of the forward and is recomputed in the backward (one elementwise
//! pass; no GEMM is repeated), so the node keeps `h` only. PyTorch eager keeps both; the
//! recomputation of a cheap elementwise activation before the GEMM that consumes it is what
//! fusing compilers do (e.g. torch.compile's min-cut rematerialisation, Inductor's
//! `partitioners.min_cut_rematerialization_partition`).
//!
//! Forward and backward run [`super::gelu_erf`], [`super::linear`] and their backward kernels,
//! so the results are those of the composition, bit for bit.

use super::precomputed::PrecomputedOutput;
use super::{gelu, linear};
use crate::grad_sink::offer;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

const OP: &str = "gelu_linear";

/// `gelu_erf(h) @ w^T + b` as one graph node that keeps only `h` (module docs).
///
/// - `h: (.., in)` in w's dtype (the output of the layer's first linear, e.g. bf16);
/// - `w: (out, in)` and `b: (out,)`, as for [`super::linear`].
///
/// Returns `(.., out)` in w's dtype. Differentiable with respect to `h`, `w` and `b`; not
/// twice differentiable.
///
/// Errors (no panics): those of [`super::gelu_erf`] and [`super::linear`] (dtypes, shapes,
/// devices that differ), with `gelu_linear(h, w, b)` as their context.
pub fn gelu_linear(h: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let two_ops = || linear::linear(&gelu::gelu_erf(h)?, w, Some(b));
    if h.elem_count() == 0 || w.elem_count() == 0 {
        // empty shapes: the composition's special cases (no GEMM, no node of ours)
        return two_ops().map_err(|e| e.context("gelu_linear(h, w, b)"));
    }
    // the forward without a graph: the GELU output is freed when the GEMM has read it
    let y = linear::linear(
        &gelu::gelu_erf(&h.detach())?,
        &w.detach(),
        Some(&b.detach()),
    )
    .map_err(|e| e.context("gelu_linear(h, w, b)"))?;
    if !(h.track_op() || w.track_op() || b.track_op()) {
        return Ok(y);
    }
    h.apply_op3(
        w,
        b,
        GeluLinear {
            output: PrecomputedOutput::new(OP, y),
        },
    )
}

struct GeluLinear {
    /// The forward's result, handed to candle by `cpu_fwd` / `cuda_fwd`.
    output: PrecomputedOutput,
}

impl CustomOp3 for GeluLinear {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        _h: &CpuStorage,
        _lh: &Layout,
        _w: &CpuStorage,
        _lw: &Layout,
        _b: &CpuStorage,
        _lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.output.cpu()
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _h: &candle_core::CudaStorage,
        _lh: &Layout,
        _w: &candle_core::CudaStorage,
        _lw: &Layout,
        _b: &candle_core::CudaStorage,
        _lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.output.cuda()
    }

    fn bwd(
        &self,
        h: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // the GELU output again (no graph); its gradient only when h wants one
        let g = gelu::gelu_erf(&h.detach())?;
        let (dg, dw, db) = linear::grads_wanted(&g, w, Some(b), dy, h.track_op())?;
        let dh = match dg {
            Some(dg) => Some(gelu::gelu_erf_backward(h, &dg)?),
            None => None,
        };
        Ok((dh, offer(w, dw)?, offer(b, db)?))
    }
}
