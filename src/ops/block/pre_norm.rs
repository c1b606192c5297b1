//! Pre-norm transformer blocks as one graph node with its own backward: the two halves of a
//! block, `x ← x + branch(norm(x))` with a LayerNorm or an RMSNorm and any branch of wick's ops
//! ([`Layer`]): GPT-2's attention (qkv linear, causal attention, proj linear) and MLP (fc
//! linear, activation and fc2 in [`crate::ops::act_linear`]), Llama's (rotary embedding, grouped
//! attention, SwiGLU, no biases, LoRA adapters), and any row of them ([`pre_norm_stack`]: a
//! model's L blocks).
//!
//! candle 0.11's backward stores the gradient it passes along each edge of its graph into a
//! buffer it first fills with zeros (`GradStore::or_insert`, then `add`). As separate ops each
//! half has four or five such edges: the LayerNorm output, the inner activations (fc's output
//! `(B, T, 4C)`; qkv `(B, T, 3C)` and the attention output), the branch output, and the two
//! uses of the f32 stream `x`; at GPT-2-124M's shapes about 0.75 GB of fills and adds per half
//! and step, and between two halves of a stack the f32 stream's edge. Here the node keeps the
//! inner ops' inputs and outputs, and its backward calls their backwards in reverse order, each
//! gradient handed straight to the next; the parameter gradients go to [`crate::grad_sink`] as
//! the per-op path's do.
//!
//! Only a sink can take those parameter gradients (a candle custom op returns gradients for its
//! tensor arguments only, here the stack's input). So the node is built only for a graph that
//! [`crate::grad_sink::backward`] will differentiate: inside [`crate::Engine::step`]'s forward
//! closure, or [`crate::grad_sink::forward_for_sink`]. Elsewhere the functions build the per-op
//! composition. Both give the same values and gradients, bit for bit when the stack's input has
//! no other consumer: the same kernels run in the same order (`tests/block_ops.rs`), and each
//! op is asked for the gradients the composition's autograd asks for ([`crate::ops::block::step`]).

use super::layer::{tensors, Layer, NormParams};
use super::step::{anchor, sinkable, Chain, Step};
use crate::ops::elementwise::residual::{residual_add, ResidualAdd};
use crate::ops::linear::act_linear::Activation;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

/// The parameters of an MLP half-block: fc `(hidden, C)` and fc2 `(C, hidden)` weights in the
/// compute dtype (as [`crate::ops::linear`] takes them) with their biases, and the activation
/// between them. Any hidden width works; 4C is GPT-2's.
#[derive(Clone, Copy, Debug)]
pub struct MlpParams<'a> {
    /// The norm before fc.
    pub norm: NormParams<'a>,
    /// fc's weight `(hidden, C)`.
    pub fc_w: &'a Tensor,
    /// fc's bias `(hidden,)`.
    pub fc_b: &'a Tensor,
    /// fc2's weight `(C, hidden)`.
    pub fc2_w: &'a Tensor,
    /// fc2's bias `(C,)`.
    pub fc2_b: &'a Tensor,
    /// The activation between fc and fc2.
    pub act: Activation,
}

/// The parameters of an attention half-block: the fused q/k/v projection `((H + 2 Hkv) * Dh,
/// C)` and the output projection `(C, H * Dh)` with their biases, and the head counts (the
/// CUDA flash kernels take `Dh = 64`).
#[derive(Clone, Copy, Debug)]
pub struct AttentionParams<'a> {
    /// The norm before the projection.
    pub norm: NormParams<'a>,
    /// The q/k/v projection's weight, rows `[q heads | k heads | v heads]`.
    pub qkv_w: &'a Tensor,
    /// Its bias.
    pub qkv_b: &'a Tensor,
    /// The output projection's weight.
    pub proj_w: &'a Tensor,
    /// Its bias.
    pub proj_b: &'a Tensor,
    /// Query heads H.
    pub n_head: usize,
    /// Key/value heads Hkv (H for multi-head attention).
    pub n_kv_head: usize,
}

/// One half of a pre-norm transformer block, `x ← x + branch(norm(x))`.
#[derive(Clone, Copy, Debug)]
pub enum Half<'a> {
    /// Attention: see [`attention_block`].
    Attention(AttentionParams<'a>),
    /// MLP: see [`mlp_block`].
    Mlp(MlpParams<'a>),
    /// Any branch: the norm, then the layers in order (the last one's output is the branch's,
    /// `(B, T, C)`). Llama's attention half is `[Linear, Rotary, Attention, Linear]` (or
    /// [`Layer::LoraLinear`] for an adapted projection), its MLP half `[Linear, SwiGlu, Linear]`.
    Branch(NormParams<'a>, &'a [Layer<'a>]),
}

/// `x` through `halves` in order, each `x ← x + branch(norm_with_dtype(x, ..))` (the norm
/// writing the `compute` dtype, the branch's output widened into the f32 stream): `x: (B, T,
/// C)` f32 → `(B, T, C)` f32. A GPT-2 block is `[Attention, Mlp]`; a model's blocks in a row are
/// one stack.
///
/// Under [`crate::grad_sink::forward_for_sink`] the whole stack is one graph node (module
/// docs), which also saves the zero-filled buffer and the add of the f32 stream between halves;
/// elsewhere, or when neither x nor any parameter is tracked, a norm parameter is tracked but
/// not an f32 variable, a parameter is neither a variable nor untracked (a tensor computed
/// from one), an attention half would take the composed attention (CUDA with a head width
/// other than 64), or a branch has a composition-only layer ([`Layer::QkNorm`],
/// [`Layer::Norm`], [`Layer::GeGlu`], [`Layer::Bias`], [`Layer::CachedAttention`], [`Layer::PagedAttention`], a
/// [`Layer::WindowAttention`] whose scale is not the default: known before any op runs), each half is the composition of its ops. The same values and gradients
/// either way, bit for bit when the stack is x's only consumer (with another, candle sums x's
/// gradients in another order). An empty `halves` returns x.
///
/// Errors (no panics): those of the ops the halves are made of, for these arguments; from the
/// one-node backward, a parameter gradient that no sink took (the graph was differentiated with
/// candle's `backward` despite the promise).
pub fn pre_norm_stack(x: &Tensor, halves: &[Half<'_>], compute: DType) -> Result<Tensor> {
    match one_node(x, halves, compute)? {
        Some(y) => Ok(y),
        None => pre_norm_composed(x, halves, compute),
    }
}

/// `x + act_linear(linear(layer_norm_with_dtype(x, ..), fc_w, fc_b), fc2_w, fc2_b, act)` with
/// `x: (.., C)` f32 (the residual stream) → f32 of x's shape: the MLP half of a pre-LayerNorm
/// transformer block (GPT-2's with [`Activation::GeluTanh`]; an RMSNorm when the norm has no
/// bias), the norm writing the `compute` dtype. [`pre_norm_stack`] of this one half: one node under
/// [`crate::grad_sink::forward_for_sink`], the composition of those four ops elsewhere.
///
/// Errors (no panics): those of [`crate::ops::layer_norm_with_dtype`], [`crate::ops::linear`],
/// [`crate::ops::act_linear`] and [`crate::ops::residual_add`] for these arguments, and as
/// [`pre_norm_stack`].
pub fn mlp_block(x: &Tensor, p: &MlpParams<'_>, compute: DType) -> Result<Tensor> {
    pre_norm_stack(x, &[Half::Mlp(*p)], compute)
}

/// `x + linear(grouped_causal_attention(linear(layer_norm_with_dtype(x, ..), qkv_w, qkv_b), H,
/// Hkv), proj_w, proj_b)` with `x: (B, T, C)` f32 → `(B, T, C)` f32: the attention half of a
/// pre-LayerNorm transformer block (GPT-2's with Hkv = H; an RMSNorm when the norm has no
/// bias), the norm writing the `compute` dtype. [`pre_norm_stack`] of this one half: one node under
/// [`crate::grad_sink::forward_for_sink`] where the attention itself is one (the CPU reference,
/// or the flash kernels on CUDA: see [`crate::ops::grouped_causal_attention`]), the composition
/// of those five ops elsewhere.
///
/// Errors (no panics): those of the ops it is made of for these arguments, and as
/// [`pre_norm_stack`].
pub fn attention_block(x: &Tensor, p: &AttentionParams<'_>, compute: DType) -> Result<Tensor> {
    pre_norm_stack(x, &[Half::Attention(*p)], compute)
}

impl<'a> Half<'a> {
    fn norm(&self) -> &NormParams<'a> {
        match self {
            Half::Attention(p) => &p.norm,
            Half::Mlp(p) => &p.norm,
            Half::Branch(n, _) => n,
        }
    }

    /// The branch's layers in order.
    fn layers(&self) -> Vec<Layer<'a>> {
        match *self {
            Half::Attention(p) => vec![
                Layer::Linear {
                    parts: std::slice::from_ref(p.qkv_w),
                    b: std::slice::from_ref(p.qkv_b),
                },
                Layer::Attention {
                    n_head: p.n_head,
                    n_kv_head: p.n_kv_head,
                },
                Layer::Linear {
                    parts: std::slice::from_ref(p.proj_w),
                    b: std::slice::from_ref(p.proj_b),
                },
            ],
            Half::Mlp(p) => vec![
                Layer::Linear {
                    parts: std::slice::from_ref(p.fc_w),
                    b: std::slice::from_ref(p.fc_b),
                },
                Layer::ActLinear {
                    w: p.fc2_w,
                    b: p.fc2_b,
                    act: p.act,
                },
            ],
            Half::Branch(_, layers) => layers.to_vec(),
        }
    }
}

/// [`pre_norm_stack`] as separate ops always, never one node: what an activation
/// checkpoint's segment runs (its recomputation must see every op).
///
/// Errors: as [`pre_norm_stack`].
pub fn pre_norm_composed(x: &Tensor, halves: &[Half<'_>], compute: DType) -> Result<Tensor> {
    halves
        .iter()
        .try_fold(x.clone(), |x, half| composed(&x, half, compute))
}

/// One half as separate ops (the reference the one-node form matches).
fn composed(x: &Tensor, half: &Half<'_>, compute: DType) -> Result<Tensor> {
    let a = half.norm().composed(x, compute)?;
    let m = half
        .layers()
        .iter()
        .try_fold(a, |h, layer| layer.composed(&h))?;
    residual_add(x, &m)
}

/// Builds the whole stack as one node when it applies (a sink ahead, x f32, x or a parameter
/// tracked, each parameter a variable or untracked, each tracked norm parameter an f32
/// variable, attention that would be one op): every half on detached inputs (candle's backward
/// never walks into them), the node `x_last + m_last` over `(anchor, x_last, m_last)`, the
/// anchor x (or, for an untracked x, the first tracked parameter: the node must be tracked to
/// be differentiated). `None`: take the composition.
fn one_node(x: &Tensor, halves: &[Half<'_>], compute: DType) -> Result<Option<Tensor>> {
    let sink = crate::grad_sink::sink_ahead();
    if !sink || halves.is_empty() || x.dtype() != DType::F32 || x.elem_count() == 0 {
        return Ok(None);
    }
    let layers: Vec<Vec<Layer<'_>>> = halves.iter().map(Half::layers).collect();
    let read: Vec<&Tensor> = halves
        .iter()
        .zip(&layers)
        .flat_map(|(h, l)| tensors(h.norm(), l))
        .collect();
    // known before any work: norm parameters that prepare would cast (no longer the
    // variables); attention that takes the composition (head width other than 64) is only
    // known when its half is built
    // composition-only layers (and attention at another scale) are known before any work too
    let t = x.dims().iter().rev().nth(1).copied().unwrap_or(0);
    let applies = halves.iter().all(|h| h.norm().one_node_ok())
        && layers.iter().flatten().all(|l| l.one_node_capable(t))
        && read.iter().all(|t| sinkable(t));
    let Some(anchor) = anchor(x, read.into_iter()).filter(|_| applies) else {
        return Ok(None);
    };
    // whether the composition's autograd would track the next op's input
    let mut tracked = x.track_op();
    let mut built: Vec<Chain> = Vec::with_capacity(halves.len());
    let mut cur = x.detach().contiguous()?;
    for (half, layers) in halves.iter().zip(&layers) {
        if let Some(prev) = built.last() {
            // the next half's input: x + m of the previous one, outside any graph
            cur = cur.apply_op2_no_bwd(prev.output()?, &ResidualAdd)?;
        }
        let norm = Step::norm(&cur, half.norm(), compute, tracked)?;
        tracked |= norm.tracks_params();
        let a = norm.output().clone();
        let Some(branch) = Step::layers(&a, layers, &mut tracked)? else {
            return Ok(None);
        };
        if !norm.params_sinkable() {
            return Ok(None);
        }
        built.push(Chain(std::iter::once(norm).chain(branch).collect()));
    }
    let Some(last) = built.last() else {
        bail!("pre_norm_stack: no halves (internal error)")
    };
    let m = last.output()?.detach();
    let node = Stack {
        halves: built,
        x_grad: x.track_op(),
    };
    Ok(Some(anchor.apply_op3(&cur, &m, node)?))
}

/// The node over `(anchor, x_last, m_last)`: `x_last + m_last` (the residual add's kernels),
/// the halves kept for the backward; `x_grad`: whether the anchor is the stack's input (and
/// gets its gradient).
struct Stack {
    halves: Vec<Chain>,
    x_grad: bool,
}

impl CustomOp3 for Stack {
    fn name(&self) -> &'static str {
        "pre_norm_stack"
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        _lx: &Layout,
        base: &CpuStorage,
        lb: &Layout,
        m: &CpuStorage,
        lm: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        ResidualAdd.cpu_fwd(base, lb, m, lm)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _x: &candle_core::CudaStorage,
        _lx: &Layout,
        base: &candle_core::CudaStorage,
        lb: &Layout,
        m: &candle_core::CudaStorage,
        lm: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        ResidualAdd.cuda_fwd(base, lb, m, lm)
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _base: &Tensor,
        _m: &Tensor,
        _out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // the stream's gradient, and the same in the compute dtype where a norm's backward
        // wrote it (the next half's branch takes it without a cast)
        let (mut d, mut d_low) = (dout.detach(), None);
        for (i, half) in self.halves.iter().enumerate().rev() {
            // the first half's x is the stack's input: no half before it takes a low copy
            match half.backward_low(d, d_low, i > 0)? {
                Some((dx, low)) => (d, d_low) = (dx, low),
                None => return Ok((None, None, None)),
            }
        }
        Ok((self.x_grad.then_some(d), None, None))
    }
}
