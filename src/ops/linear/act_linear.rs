//! `y = act(h) @ w^T + b`, the second half of a feed-forward layer, keeping only `h` for the
//! backward. `act` is GELU (tanh approximation: GPT-2; exact: BERT) or ReLU.
//!
//! The two-op composition `linear(act(h), w, b)` keeps both `h` (the activation's input) and
//! `act(h)` (the GEMM's input) alive until the end of the backward: `2 x (B, T, 4C)` elements
//! per layer, the largest activations of a transformer layer at short sequences, and it is two
//! graph nodes, so candle's backward also fills a zeroed `(B, T, 4C)` gradient buffer and adds
//! into it once more. Here the activation's output is a temporary of the forward and is
//! recomputed in the backward (one elementwise pass; no GEMM is repeated), so the node keeps
//! `h` only. PyTorch eager keeps both; recomputing a cheap elementwise activation before the
//! GEMM that consumes it is what fusing compilers do (torch.compile's min-cut
//! rematerialisation, `torch._functorch.partitioners.min_cut_rematerialization_partition`).
//!
//! Forward and backward run [`crate::ops::gelu_tanh`]'s, [`crate::ops::gelu_erf`]'s or candle's ReLU
//! kernel and [`crate::ops::linear`]'s kernels (the forward on the storages, the activation's output
//! a temporary buffer), so the results are those of the composition, bit for bit.

use super::dense;
use super::dense::Operands;
use crate::grad_sink::offer;
use crate::ops::elementwise::{gelu, relu};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

/// The elementwise activation that [`act_linear`] applies before its GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// GELU, tanh approximation (GPT-2's `gelu_new`): [`crate::ops::gelu_tanh`].
    GeluTanh,
    /// Exact GELU `0.5 h (1 + erf(h / sqrt(2)))` (BERT's): [`crate::ops::gelu_erf`].
    GeluErf,
    /// `max(h, 0)` (candle's `relu`). Its gradient passes where `h > 0` and is 0 elsewhere,
    /// `h = 0` included, as PyTorch's `threshold_backward(dy, h, 0)` does (candle's own
    /// `relu` backward lets it pass at 0).
    Relu,
}

impl Activation {
    pub(in crate::ops) fn name(self) -> &'static str {
        match self {
            Activation::GeluTanh => "act_linear(h, w, b; gelu_tanh)",
            Activation::GeluErf => "gelu_linear(h, w, b)",
            Activation::Relu => "act_linear(h, w, b; relu)",
        }
    }

    fn gelu(self) -> Option<gelu::Kind> {
        match self {
            Activation::GeluTanh => Some(gelu::Kind::Tanh),
            Activation::GeluErf => Some(gelu::Kind::Erf),
            Activation::Relu => None,
        }
    }

    /// `act(h)` through the activation's own op: the composition for the empty shapes, and
    /// the backward's recomputation (on a detached h, so no graph is recorded).
    fn apply(self, h: &Tensor) -> Result<Tensor> {
        match self.gelu() {
            Some(kind) => gelu::gelu(h, kind),
            None => h.relu(),
        }
    }

    /// `dh` for the upstream `dg` (in h's dtype), no graph. ReLU's is `dg * (h > 0)` in one
    /// launch ([`crate::ops::elementwise::relu`]), the values of `dg * sign(relu(h))` bit for bit.
    fn backward(self, h: &Tensor, dg: &Tensor) -> Result<Tensor> {
        match self.gelu() {
            Some(kind) => gelu::backward(kind, h, dg),
            None => relu::backward(h, dg),
        }
    }

    fn cpu(self, s: &CpuStorage, l: &Layout) -> Result<CpuStorage> {
        match self.gelu() {
            Some(kind) => gelu::forward_cpu(kind, s, l),
            None => s.unary_impl::<candle_core::op::Relu>(l),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda(self, s: &candle_core::CudaStorage, l: &Layout) -> Result<candle_core::CudaStorage> {
        match self.gelu() {
            Some(kind) => gelu::forward_cuda(kind, s, l),
            None => s.unary_impl::<candle_core::op::Relu>(l),
        }
    }
}

/// `act(h) @ w^T + b` as one graph node that keeps only `h` (module docs).
///
/// - `h: (.., in)`, f32, bf16 or f16 (the output of the layer's first linear, in the compute
///   dtype; another dtype is cast after the activation, as [`crate::ops::linear`] casts its x);
/// - `w: (out, in)` and `b: (out,)`, as for [`crate::ops::linear`];
/// - `act`: the [`Activation`].
///
/// Returns `(.., out)` in w's dtype. Differentiable with respect to `h`, `w` and `b`; not
/// twice differentiable.
///
/// Errors (no panics): those of [`crate::ops::linear`] (dtypes, shapes, devices that differ), named
/// after the op (`act_linear(h, w, b; relu)`, `act_linear(h, w, b; gelu_tanh)`, and
/// `gelu_linear(h, w, b)` for the exact GELU), with h in the role of linear's x.
pub fn act_linear(h: &Tensor, w: &Tensor, b: &Tensor, act: Activation) -> Result<Tensor> {
    match dense::operands(act.name(), h, w, Some(b))? {
        // empty shapes: the composition's special cases
        Operands::Empty { rows } => dense::composed(&act.apply(h)?, w, Some(b), rows),
        Operands::Ready { x, w, b } => {
            let Some(b) = b else {
                candle_core::bail!("{}: the bias went missing (internal error)", act.name())
            };
            // the activation kernels read h contiguous (operands leaves an h of another dtype
            // as is)
            x.contiguous()?.apply_op3(&w, &b, ActLinear(act))
        }
    }
}

/// `gelu_erf(h) @ w^T + b` in one node that keeps only `h`: [`act_linear`] with
/// [`Activation::GeluErf`] (BERT's feed-forward output). Errors are named
/// `gelu_linear(h, w, b)`.
pub fn gelu_linear(h: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    act_linear(h, w, b, Activation::GeluErf)
}

pub(in crate::ops) struct ActLinear(pub(in crate::ops) Activation);

impl CustomOp3 for ActLinear {
    fn name(&self) -> &'static str {
        self.0.name()
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
        let g = self.0.cpu(h, lh)?;
        let lg = Layout::contiguous(lh.shape());
        dense::forward_cpu_bias((&g, &lg), (w, lw), (b, lb))
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
        let g = self.0.cuda(h, lh)?;
        let lg = Layout::contiguous(lh.shape());
        dense::forward_cuda_bias((&g, &lg), (w, lw), (b, lb))
    }

    fn bwd(
        &self,
        h: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dh, dw, db) = self.grads(h, w, b, dy, h.track_op())?;
        Ok((dh, offer(w, dw)?, offer(b, db)?))
    }
}

impl ActLinear {
    /// `(dh, dw, db)` as computed (not offered to a sink): dh when `want_h`, dw and db when
    /// autograd tracks w and b.
    pub(in crate::ops) fn grads(
        &self,
        h: &Tensor,
        w: &Tensor,
        b: &Tensor,
        dy: &Tensor,
        want_h: bool,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // the activation's output again (no graph); its gradient only when h wants one
        let h = h.detach();
        let g = self.0.apply(&h)?;
        let (dg, dw, db) =
            dense::grads_wanted(&g, w, Some(b), dy, want_h, w.track_op(), b.track_op())?;
        let dh = match dg {
            Some(dg) => Some(self.0.backward(&h, &dg)?),
            None => None,
        };
        Ok((dh, dw, db))
    }
}
