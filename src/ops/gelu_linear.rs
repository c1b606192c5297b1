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
//! Forward and backward run [`super::gelu_erf`]'s and [`super::linear`]'s kernels (the
//! forward on the storages, its GELU output a temporary buffer), so the results are those of
//! the composition, bit for bit.

use super::linear::{self, Operands};
use super::{bias, gelu};
use crate::grad_sink::offer;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

const OP: &str = "gelu_linear";

/// `gelu_erf(h) @ w^T + b` as one graph node that keeps only `h` (module docs).
///
/// - `h: (.., in)`, f32, bf16 or f16 (the output of the layer's first linear, in the compute
///   dtype; another dtype is cast after the GELU, as [`super::linear`] casts its x);
/// - `w: (out, in)` and `b: (out,)`, as for [`super::linear`].
///
/// Returns `(.., out)` in w's dtype. Differentiable with respect to `h`, `w` and `b`; not
/// twice differentiable.
///
/// Errors (no panics): those of [`super::linear`] (dtypes, shapes, devices that differ), named
/// `gelu_linear(h, w, b)`, with h in the role of linear's x.
pub fn gelu_linear(h: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    match linear::operands("gelu_linear(h, w, b)", h, w, Some(b))? {
        // empty shapes: the composition's special cases
        Operands::Empty { rows } => linear::composed(&gelu::gelu_erf(h)?, w, Some(b), rows),
        Operands::Ready { x, w, b } => {
            let Some(b) = b else {
                candle_core::bail!("{OP}: the bias went missing (internal error)")
            };
            // the GELU kernel reads h contiguous (operands leaves an h of another dtype as is)
            x.contiguous()?.apply_op3(&w, &b, GeluLinear)
        }
    }
}

struct GeluLinear;

impl CustomOp3 for GeluLinear {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        h: &CpuStorage,
        lh: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, shape) = gelu::gelu_erf_cpu(h, lh)?;
        let lg = Layout::contiguous(shape);
        linear::forward((&g, &lg), (w, lw), Some((b, lb)), bias::add_cpu)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        h: &candle_core::CudaStorage,
        lh: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (g, shape) = gelu::gelu_erf_cuda(h, lh)?;
        let lg = Layout::contiguous(shape);
        linear::forward((&g, &lg), (w, lw), Some((b, lb)), bias::add_cuda)
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
