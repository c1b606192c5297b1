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

use super::{gelu, linear};
use crate::grad_sink::offer;
#[cfg(feature = "cuda")]
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor, Var};
use std::sync::Mutex;

/// `gelu_erf(h) @ w^T + b` as one graph node that keeps only `h` (module docs).
///
/// - `h: (.., in)` in w's dtype (the output of the layer's first linear, e.g. bf16);
/// - `w: (out, in)` and `b: (out,)`, as for [`super::linear`].
///
/// Returns `(.., out)` in w's dtype. Differentiable with respect to `h`, `w` and `b`; not
/// twice differentiable.
///
/// Errors (no panics): those of [`super::gelu_erf`] and [`super::linear`] (dtypes, shapes,
/// devices that differ).
pub fn gelu_linear(h: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    // the forward without a graph: the GELU output is freed when the GEMM has read it
    let y = linear::linear(
        &gelu::gelu_erf(&h.detach())?,
        &w.detach(),
        Some(&b.detach()),
    )?;
    if !(h.track_op() || w.track_op() || b.track_op()) {
        return Ok(y);
    }
    h.apply_op3(
        w,
        b,
        GeluLinear {
            output: Mutex::new(Some(y)),
        },
    )
}

struct GeluLinear {
    /// The forward's result, moved into the op's output storage by `cpu_fwd` / `cuda_fwd`.
    output: Mutex<Option<Tensor>>,
}

impl GeluLinear {
    fn take_output(&self) -> Result<Tensor> {
        let taken = self.output.lock().unwrap_or_else(|e| e.into_inner()).take();
        match taken {
            Some(y) => y.contiguous(),
            None => bail!("gelu_linear: the output was already consumed (internal error)"),
        }
    }
}

impl CustomOp3 for GeluLinear {
    fn name(&self) -> &'static str {
        "gelu_linear"
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
        let y = self.take_output()?;
        let (st, _) = y.storage_and_layout();
        match &*st {
            Storage::Cpu(c) => Ok((c.clone(), y.shape().clone())),
            _ => bail!("gelu_linear: the output is not on the CPU like the inputs"),
        }
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
        let y = self.take_output()?;
        let (st, layout) = y.storage_and_layout();
        match &*st {
            Storage::Cuda(c) => Ok((c.try_clone(layout)?, y.shape().clone())),
            _ => bail!("gelu_linear: the output is not on CUDA like the inputs"),
        }
    }

    fn bwd(
        &self,
        h: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // the GELU output again, as a tracked leaf so that linear's backward gives its dx
        let g = Var::from_tensor(&gelu::gelu_erf(&h.detach())?)?;
        let (dg, dw, db) = linear::grads(g.as_tensor(), w, Some(b), dy)?;
        let dh = match (dg, h.track_op()) {
            (Some(dg), true) => Some(gelu::gelu_erf_backward(h, &dg)?),
            _ => None,
        };
        Ok((dh, offer(w, dw)?, offer(b, db)?))
    }
}
