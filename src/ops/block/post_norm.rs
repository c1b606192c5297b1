//! Post-norm transformer sub-blocks as one graph node with its own backward: `y = norm(x +
//! branch(x))`, the residual sum normalised after the add, as in the original Transformer and
//! BERT (whose feed-forward sub-block is `LayerNorm(a + W2 gelu(W1 a + b1) + b2)`).
//!
//! The node runs the same ops as the composition ([`crate::ops::block::step`]) and is built under the
//! same promise as [`crate::ops::pre_norm_stack`]'s (a graph that [`crate::grad_sink::backward`]
//! differentiates); its backward hands the norm's gradient of the residual sum straight to the
//! branch, so candle's zero-filled buffers and adds for the sum, the branch's output and its
//! inner activations are not made.

use super::layer::{tensors, Layer, NormParams};
use super::step::{anchor, sinkable, Chain, Step};
use crate::ops::elementwise::residual::{residual_add, ResidualAdd};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// `norm(x + branch(x))` with `x: (.., C)` f32 (the residual stream) → f32 of x's shape: the
/// branch's `layers` in order from x (the first linear casts x to its weight's dtype, as
/// [`crate::ops::linear`] does), the residual add widening the branch's output into f32, the
/// norm ([`NormParams`]: a LayerNorm with a bias, an RMSNorm without) writing f32. BERT's
/// feed-forward sub-block is `[Linear { W1, b1 }, ActLinear { W2, b2, GeluErf }]` with its
/// `output.LayerNorm`.
///
/// Under [`crate::grad_sink::forward_for_sink`] this is one graph node (module docs) when x is
/// f32, x or a parameter is tracked, every parameter is a variable or untracked, each tracked
/// norm parameter is f32, and every layer runs as one op; elsewhere the composition of the
/// layers' ops, [`crate::ops::residual_add`] and the norm. The same values and gradients either
/// way, bit for bit when the block is x's only consumer.
///
/// Errors (no panics): an empty `layers`; those of the ops it is made of for these arguments;
/// from the one-node backward, a parameter gradient that no sink took (the graph was
/// differentiated with candle's `backward` despite the promise).
pub fn post_norm_block(x: &Tensor, layers: &[Layer<'_>], norm: &NormParams<'_>) -> Result<Tensor> {
    if layers.is_empty() {
        bail!("post_norm_block: no layers; the branch needs at least one op")
    }
    if let Some(y) = one_node(x, layers, norm)? {
        return Ok(y);
    }
    let m = layers.iter().try_fold(x.clone(), |h, l| l.composed(&h))?;
    norm.composed(&residual_add(x, &m)?, x.dtype())
}

/// The one-node form when it applies (see [`post_norm_block`]); `None`: take the composition.
fn one_node(x: &Tensor, layers: &[Layer<'_>], norm: &NormParams<'_>) -> Result<Option<Tensor>> {
    let params = tensors(norm, layers);
    let free = params.iter().all(|t| sinkable(t));
    let applies = crate::grad_sink::sink_ahead()
        && x.dtype() == DType::F32
        && x.elem_count() > 0
        && free
        && norm.one_node_ok();
    let Some(anchor) = anchor(x, params.into_iter()).filter(|_| applies) else {
        return Ok(None);
    };
    let x_in = x.detach().contiguous()?;
    // whether the composition's autograd would track the next op's input
    let mut tracked = x.track_op();
    let Some(steps) = Step::layers(&x_in, layers, &mut tracked)? else {
        return Ok(None);
    };
    let branch = Chain(steps);
    let sum = x_in.apply_op2_no_bwd(branch.output()?, &ResidualAdd)?;
    let norm = Step::norm(&sum, norm, DType::F32, tracked)?;
    if !norm.params_sinkable() {
        return Ok(None);
    }
    let y = norm.output().detach();
    let node = PostNorm {
        branch,
        norm,
        x_grad: x.track_op(),
    };
    Ok(Some(anchor.apply_op2(&y, node)?))
}

/// The node over `(anchor, y)`: a copy of the norm's output y (the node must output a tensor
/// of its own), the ops kept for the backward; `x_grad`: whether the anchor is x.
struct PostNorm {
    branch: Chain,
    norm: Step,
    x_grad: bool,
}

/// `y`'s storage copied, for the node's output (y is a fresh contiguous tensor).
fn copy<S: BackendStorage>(y: &S, l: &Layout) -> Result<(S, Shape)> {
    if !l.is_contiguous() || l.start_offset() != 0 {
        bail!(
            "post_norm_block: the norm's output is not a plain contiguous tensor (internal error)"
        )
    }
    Ok((y.try_clone(l)?, l.shape().clone()))
}

impl CustomOp2 for PostNorm {
    fn name(&self) -> &'static str {
        "post_norm_block"
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        _lx: &Layout,
        y: &CpuStorage,
        ly: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        copy(y, ly)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _x: &candle_core::CudaStorage,
        _lx: &Layout,
        y: &candle_core::CudaStorage,
        ly: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        copy(y, ly)
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _y: &Tensor,
        _out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let Some(dsum) = self.norm.backward(&dout.detach())? else {
            return Ok((None, None));
        };
        let dx = self.branch.backward(dsum)?;
        Ok((dx.filter(|_| self.x_grad), None))
    }
}
