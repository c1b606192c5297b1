//! An output projection and the cross-entropy on its logits as one graph node (the "fused
//! linear cross-entropy" of language-model heads, as in Liger-Kernel's
//! `FusedLinearCrossEntropy`): `loss_i = lse(h_i W^T) - (h_i W^T)[t_i]`.
//!
//! The logits `(N, V)` are the largest tensor of a GPT step (16384 x 50304 bf16, 1.6 GB, for
//! gpt2_124m). As a graph tensor between a matmul node and a cross-entropy node they cost, in
//! candle's backward, a zero-filled gradient buffer and an add of their full size, on top of the
//! gradient itself. Here they are computed without a graph, kept by the op, turned into
//! `dlogits` by the cross-entropy backward kernel and freed as soon as the two GEMMs
//! `dh = dlogits W` and `dW = dlogits^T h` have consumed them. Same values as
//! `cross_entropy_rows(h.matmul(w.t()), t)`: the same GEMM and the same kernels.

use super::cross_entropy::{cross_entropy_rows_no_bwd, CrossEntropyBwd};
use crate::ops::common::{check_device, check_float, index_u32, SideOutput};
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor};

/// Per-row cross-entropy `(N,)` f32 of the logits `h @ w^T` against `targets`, one graph node.
///
/// - `h`: `(N, C)` hidden states, `w`: `(V, C)` output weights (e.g. a tied embedding's working
///   copy); both in the same float dtype (f32, bf16, f16), any layout. The logits are computed
///   in that dtype with candle's GEMM (f32 accumulation), the loss in f32 as
///   [`crate::ops::cross_entropy_rows`] does.
/// - `targets`: `(N,)` class indices (u32, i64 or u8).
///
/// Differentiable with respect to `h` and `w` (gradients in their dtype); `targets` get none.
/// The logits are freed by the first backward: a second backward through the same graph is an
/// error (run the forward again). Memory: the logits and, during the backward, their gradient.
///
/// With `N == 0` the result is an empty tensor outside the graph (no gradients).
///
/// Errors (no panics): shapes other than `(N, C)`, `(V, C)`, `(N,)`; dtypes that differ or are
/// not float; devices that differ; `V == 0`. A target `>= V` is an error on the CPU; on CUDA
/// that row's loss is NaN (as [`crate::ops::cross_entropy_rows`]).
pub fn linear_cross_entropy_rows(h: &Tensor, w: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let op = "linear_cross_entropy";
    let (n, _, _) = check_head(op, h, w)?;
    // contiguous operands for candle's CUDA GEMM (a no-op for the usual contiguous inputs)
    let (hc, wc) = (h.detach().contiguous()?, w.detach().contiguous()?);
    let logits = hc.matmul(&wc.t()?)?; // (N, V), no graph
    let targets = index_u32(op, "targets", targets)?;
    let (loss, ce_bwd) = cross_entropy_rows_no_bwd(&logits, &targets)?; // checks the targets' shape
    if n == 0 {
        return Ok(loss);
    }
    h.apply_op2(
        w,
        HeadLoss {
            loss,
            targets,
            logits: SideOutput::holding(logits),
            ce_bwd,
        },
    )
}

/// Checks a head's operands `h: (N, C)` and `w: (V, C)`: the same float dtype, the same
/// device, `V > 0`. Returns `(N, C, V)`.
pub(in crate::ops) fn check_head(
    op: &str,
    h: &Tensor,
    w: &Tensor,
) -> Result<(usize, usize, usize)> {
    check_float(op, "h", h.dtype())?;
    let ((n, c), (v, cw)) = match (h.dims(), w.dims()) {
        (&[n, c], &[v, cw]) => ((n, c), (v, cw)),
        (dh, dw) => bail!("{op}: h must be (N, C) and w (V, C), found {dh:?} and {dw:?}"),
    };
    if c != cw || v == 0 {
        bail!("{op}: h is ({n}, {c}) and w ({v}, {cw}); w must be (V, C) with V > 0 and C = {c}")
    }
    if h.dtype() != w.dtype() {
        bail!(
            "{op}: h is {:?} but w is {:?}; cast both to the compute dtype",
            h.dtype(),
            w.dtype()
        )
    }
    check_device(op, "w", h, w)?;
    Ok((n, c, v))
}

/// A copy of the CPU storage of `t` and its shape: a result computed before a graph node's
/// forward (`op`), which that forward hands out as its output.
pub(in crate::ops) fn stored_cpu(op: &str, t: &Tensor) -> Result<(CpuStorage, Shape)> {
    let (s, l) = t.storage_and_layout();
    match s.try_clone(l)? {
        Storage::Cpu(c) => Ok((c, t.shape().clone())),
        _ => bail!("{op}: the loss is not on the CPU (internal error)"),
    }
}

/// [`stored_cpu`] on the GPU.
#[cfg(feature = "cuda")]
pub(in crate::ops) fn stored_cuda(
    op: &str,
    t: &Tensor,
) -> Result<(candle_core::CudaStorage, Shape)> {
    let (s, l) = t.storage_and_layout();
    match s.try_clone(l)? {
        Storage::Cuda(c) => Ok((c, t.shape().clone())),
        _ => bail!("{op}: the loss is not on the GPU (internal error)"),
    }
}

/// The graph node: its forward hands out the loss computed above (an `N`-float copy), its
/// backward the gradients of `h` and `w`.
struct HeadLoss {
    loss: Tensor,
    targets: Tensor,
    /// Taken (and freed) by the backward.
    logits: SideOutput,
    /// The cross-entropy's backward, with its forward's per-row lse.
    ce_bwd: CrossEntropyBwd,
}

impl CustomOp2 for HeadLoss {
    fn name(&self) -> &'static str {
        "linear_cross_entropy"
    }

    fn cpu_fwd(
        &self,
        _h: &CpuStorage,
        _lh: &Layout,
        _w: &CpuStorage,
        _lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        stored_cpu("linear_cross_entropy", &self.loss)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _h: &candle_core::CudaStorage,
        _lh: &Layout,
        _w: &candle_core::CudaStorage,
        _lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        stored_cuda("linear_cross_entropy", &self.loss)
    }

    fn bwd(
        &self,
        h: &Tensor,
        w: &Tensor,
        _loss: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let Some(logits) = self.logits.take() else {
            bail!(
                "linear_cross_entropy: the backward already ran for this graph (the logits are \
                 freed by the first one); run the forward again"
            )
        };
        let g = g.detach().to_dtype(DType::F32)?.contiguous()?;
        let dlogits = logits.apply_op3_no_bwd(&self.targets, &g, &self.ce_bwd)?;
        drop(logits);
        let dh = dlogits.matmul(&w.detach().contiguous()?)?; // (N, V) @ (V, C)
                                                             // a frozen head (LoRA's tied table, a constant) costs no dW GEMM
        let dw = match w.track_op() {
            true => Some(dlogits.t()?.matmul(&h.detach().contiguous()?)?), // (V, N) @ (N, C)
            false => None,
        };
        Ok((Some(dh), crate::grad_sink::offer(w, dw)?))
    }
}
