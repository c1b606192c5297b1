//! The two halves of a pre-LayerNorm transformer block, `x + branch(layer_norm(x))`, each as
//! one graph node with its own backward: the attention half (qkv linear, causal attention,
//! proj linear) and the MLP half (fc linear, activation and fc2 in [`super::act_linear`]).
//!
//! candle 0.11's backward stores the gradient it passes along each edge of its graph into a
//! buffer it first fills with zeros (`GradStore::or_insert`, then `add`). As separate ops each
//! half has four or five such edges: the LayerNorm output, the inner activations (fc's output
//! `(B, T, 4C)`; qkv `(B, T, 3C)` and the attention output), the branch output, and the two
//! uses of the f32 stream `x`; at GPT-2-124M's shapes about 0.75 GB of fills and adds per half
//! and step. Here the node keeps the inner ops' inputs and outputs, and its backward calls their
//! backwards in reverse order, each gradient handed straight to the next; the parameter
//! gradients go to [`crate::grad_sink`] as the per-op path's do.
//!
//! Only a sink can take those parameter gradients (a candle custom op returns gradients for its
//! tensor arguments only, here `x` and the branch). So the node is built only for a graph that
//! [`crate::grad_sink::backward`] will differentiate: inside [`crate::Engine::step`]'s forward
//! closure, or [`crate::grad_sink::forward_for_sink`]. Elsewhere the functions build the per-op
//! composition. Both give the same values and gradients, bit for bit: the same kernels run in
//! the same order (`tests/block_ops.rs`).

use super::act_linear::{ActLinear, Activation};
use super::attention::{fused_attention, AttentionOp};
use super::layer_norm::{prepare, prepare_param, Kind, NormFwd};
use super::linear::{self, Linear, Operands};
use super::residual::{residual_add, ResidualAdd};
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

/// A pre-LayerNorm's gain and bias `(C,)` (f32) and epsilon (PyTorch's default: 1e-5).
#[derive(Clone, Copy, Debug)]
pub struct PreNorm<'a> {
    /// Gain `(C,)`.
    pub w: &'a Tensor,
    /// Bias `(C,)`.
    pub b: &'a Tensor,
    /// Added to the variance.
    pub eps: f64,
}

/// The parameters of an MLP half-block: fc `(hidden, C)` and fc2 `(C, hidden)` weights in the
/// compute dtype (as [`crate::ops::linear`] takes them) with their biases, and the activation
/// between them. Any hidden width works; 4C is GPT-2's.
#[derive(Clone, Copy, Debug)]
pub struct MlpParams<'a> {
    /// The LayerNorm before fc.
    pub norm: PreNorm<'a>,
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

/// The parameters of an attention half-block: the fused q/k/v projection `((H + 2 Hkv) * 64, C)`
/// and the output projection `(C, H * 64)` with their biases, and the head counts.
#[derive(Clone, Copy, Debug)]
pub struct AttentionParams<'a> {
    /// The LayerNorm before the projection.
    pub norm: PreNorm<'a>,
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

/// `x + act_linear(linear(layer_norm_with_dtype(x, ..), fc_w, fc_b), fc2_w, fc2_b, act)` with
/// `x: (.., C)` f32 (the residual stream) → f32 of x's shape: the MLP half of a pre-LayerNorm
/// transformer block (GPT-2's with [`Activation::GeluTanh`]), the LayerNorm writing the
/// `compute` dtype.
///
/// One node under [`crate::grad_sink::forward_for_sink`] (module docs); the composition of
/// those four ops elsewhere, or when x is not tracked or a parameter is neither a variable nor
/// untracked (a tensor computed from one). The same values and gradients either way.
///
/// Errors (no panics): those of [`crate::ops::layer_norm_with_dtype`], [`crate::ops::linear`],
/// [`crate::ops::act_linear`] and [`crate::ops::residual_add`] for these arguments; from the
/// one-node backward, a parameter gradient that no sink took (the graph was differentiated with
/// candle's `backward` despite the promise).
pub fn mlp_block(x: &Tensor, p: &MlpParams<'_>, compute: DType) -> Result<Tensor> {
    let params = [p.fc_w, p.fc_b, p.fc2_w, p.fc2_b];
    let node = one_node(x, &p.norm, &params, compute, |a| {
        let Some([a, w, b]) = ready(linear::operands(linear::OP, a, p.fc_w, Some(p.fc_b))?) else {
            return Ok(None);
        };
        let h = a.apply_op3(&w, &b, Linear)?;
        let fc = Step::Linear([a, w, b, h.clone()]);
        let Some([h, w, b]) = ready(linear::operands(p.act.name(), &h, p.fc2_w, Some(p.fc2_b))?)
        else {
            return Ok(None);
        };
        let h = h.contiguous()?;
        let m = h.apply_op3(&w, &b, ActLinear(p.act))?;
        Ok(Some(vec![fc, Step::ActLinear(p.act, [h, w, b, m])]))
    })?;
    match node {
        Some(y) => Ok(y),
        None => {
            let a = super::layer_norm_with_dtype(x, p.norm.w, p.norm.b, p.norm.eps, compute)?;
            let h = super::linear(&a, p.fc_w, Some(p.fc_b))?;
            residual_add(x, &super::act_linear(&h, p.fc2_w, p.fc2_b, p.act)?)
        }
    }
}

/// `x + linear(grouped_causal_attention(linear(layer_norm_with_dtype(x, ..), qkv_w, qkv_b), H,
/// Hkv), proj_w, proj_b)` with `x: (B, T, C)` f32 → `(B, T, C)` f32: the attention half of a
/// pre-LayerNorm transformer block (GPT-2's with Hkv = H), the LayerNorm writing the `compute`
/// dtype.
///
/// One node under [`crate::grad_sink::forward_for_sink`] where the attention itself is one
/// (the CPU reference, or the flash kernels on CUDA: see
/// [`crate::ops::grouped_causal_attention`]); the composition of those five ops elsewhere, or
/// when x is not tracked or a parameter is neither a variable nor untracked. The same values
/// and gradients either way.
///
/// Errors (no panics): those of the ops it is made of for these arguments; from the one-node
/// backward, a parameter gradient that no sink took.
pub fn attention_block(x: &Tensor, p: &AttentionParams<'_>, compute: DType) -> Result<Tensor> {
    let params = [p.qkv_w, p.qkv_b, p.proj_w, p.proj_b];
    let node = one_node(x, &p.norm, &params, compute, |a| {
        let Some([a, w, b]) = ready(linear::operands(linear::OP, a, p.qkv_w, Some(p.qkv_b))?)
        else {
            return Ok(None);
        };
        let qkv = a.apply_op3(&w, &b, Linear)?;
        let proj_in = Step::Linear([a, w, b, qkv.clone()]);
        let Some((y, op)) = fused_attention(&qkv, p.n_head, p.n_kv_head)? else {
            return Ok(None);
        };
        let att = Step::Attention(op, [qkv.contiguous()?, y.clone()]);
        let Some([y, w, b]) = ready(linear::operands(linear::OP, &y, p.proj_w, Some(p.proj_b))?)
        else {
            return Ok(None);
        };
        let o = y.apply_op3(&w, &b, Linear)?;
        Ok(Some(vec![proj_in, att, Step::Linear([y, w, b, o])]))
    })?;
    match node {
        Some(y) => Ok(y),
        None => {
            let a = super::layer_norm_with_dtype(x, p.norm.w, p.norm.b, p.norm.eps, compute)?;
            let qkv = super::linear(&a, p.qkv_w, Some(p.qkv_b))?;
            let y = super::grouped_causal_attention(&qkv, p.n_head, p.n_kv_head)?;
            residual_add(x, &super::linear(&y, p.proj_w, Some(p.proj_b))?)
        }
    }
}

/// One inner op of a branch as it ran (inputs and output), for the backward.
enum Step {
    /// [`crate::ops::linear`]: `[x, w, b, y]`.
    Linear([Tensor; 4]),
    /// [`crate::ops::act_linear`]: `[h, w, b, y]`.
    ActLinear(Activation, [Tensor; 4]),
    /// The fused attention: the op (holding its log-sum-exp), `[qkv, y]`.
    Attention(AttentionOp, [Tensor; 2]),
}

impl Step {
    /// The step's output.
    fn output(&self) -> &Tensor {
        match self {
            Step::Linear([.., y]) | Step::ActLinear(_, [.., y]) | Step::Attention(_, [_, y]) => y,
        }
    }

    /// The parameters as the op took them (after any layout change).
    fn params(&self) -> &[Tensor] {
        match self {
            Step::Linear(t) | Step::ActLinear(_, t) => &t[1..3],
            Step::Attention(..) => &[],
        }
    }

    /// The gradient of the step's activation input from that of its output; the parameter
    /// gradients go to the sink.
    fn backward(&self, dy: &Tensor) -> Result<Tensor> {
        let (dx, params) = match self {
            Step::Linear([x, w, b, y]) => {
                let (dx, dw, db) = CustomOp3::bwd(&Linear, x, w, b, y, dy)?;
                (dx, [dw, db])
            }
            Step::ActLinear(act, [h, w, b, y]) => {
                let (dh, dw, db) = ActLinear(*act).bwd(h, w, b, y, dy)?;
                (dh, [dw, db])
            }
            Step::Attention(op, [qkv, y]) => (op.bwd(qkv, y, dy)?, [None, None]),
        };
        params.into_iter().try_for_each(sunk)?;
        match dx {
            Some(dx) => Ok(dx),
            None => bail!("residual block: an inner op gave no input gradient (internal error)"),
        }
    }
}

/// Builds the one-node form when it applies (a sink ahead, x tracked and f32, each parameter a
/// variable or untracked): the LayerNorm on a detached x (candle's backward never walks into
/// the branch), then `branch` on its output, returning its steps (the last one's output is the
/// branch's) or `None` for shapes the composition special-cases. `None`: take the composition.
fn one_node(
    x: &Tensor,
    norm: &PreNorm<'_>,
    params: &[&Tensor],
    compute: DType,
    branch: impl FnOnce(&Tensor) -> Result<Option<Vec<Step>>>,
) -> Result<Option<Tensor>> {
    let free = |t: &&Tensor| t.is_variable() || !t.track_op();
    let applies = crate::grad_sink::sink_ahead()
        && x.track_op()
        && x.dtype() == DType::F32
        && x.elem_count() > 0
        && norm.w.is_variable()
        && [norm.w, norm.b].iter().chain(params).all(free);
    if !applies {
        return Ok(None);
    }
    let kind = Kind::Layer;
    let (xn, w, d) = prepare(kind, &x.detach(), norm.w, norm.eps, compute)?;
    let b = prepare_param(kind.name(), "b", &xn, norm.b, d)?;
    let norm_op = || NormFwd {
        kind,
        eps: norm.eps as f32,
        out: compute,
    };
    let a = xn.apply_op3(&w, &b, norm_op())?;
    let Some(steps) = branch(&a)? else {
        return Ok(None);
    };
    // the parameters as the ops took them must still be the variables (no cast in between),
    // or the sink could not take their gradients
    let taken = [&w, &b]
        .into_iter()
        .chain(steps.iter().flat_map(Step::params));
    if taken.into_iter().any(|t| t.track_op() && !t.is_variable()) {
        return Ok(None);
    }
    let Some(m) = steps.last().map(Step::output) else {
        bail!("residual block: an empty branch (internal error)")
    };
    let m = m.detach();
    let node = ResidualBlock {
        norm: norm_op(),
        ln: [xn, w, b, a],
        steps,
    };
    Ok(Some(x.contiguous()?.apply_op2(&m, node)?))
}

/// A linear layer's laid-out `[x, w, b]`, or `None` for shapes the composition special-cases.
fn ready(o: Operands) -> Option<[Tensor; 3]> {
    match o {
        Operands::Ready { x, w, b: Some(b) } => Some([x, w, b]),
        _ => None,
    }
}

/// Errors unless a parameter gradient went to the sink (or there was none to give).
fn sunk(g: Option<Tensor>) -> Result<()> {
    if g.is_some() {
        bail!(
            "residual block: a parameter gradient was not taken by a sink: a graph built under \
             grad_sink::forward_for_sink (or Engine::step) must be differentiated with \
             wick::grad_sink::backward, not candle's backward"
        )
    }
    Ok(())
}

/// The node: `x + m` (the residual add's kernels) with the branch kept for the backward.
struct ResidualBlock {
    norm: NormFwd,
    /// The LayerNorm's `[x, w, b, out]` as it ran.
    ln: [Tensor; 4],
    steps: Vec<Step>,
}

impl CustomOp2 for ResidualBlock {
    fn name(&self) -> &'static str {
        "residual_block"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        m: &CpuStorage,
        lm: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        ResidualAdd.cpu_fwd(x, lx, m, lm)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        m: &candle_core::CudaStorage,
        lm: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        ResidualAdd.cuda_fwd(x, lx, m, lm)
    }

    fn bwd(
        &self,
        x: &Tensor,
        m: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (Some(dx), Some(dm)) = ResidualAdd.bwd(x, m, out, dout)? else {
            bail!("residual block: the residual add gave no gradient (internal error)")
        };
        let mut d = dm;
        for step in self.steps.iter().rev() {
            d = step.backward(&d)?;
        }
        let [xn, w, b, a] = &self.ln;
        let (dxn, dw, db) = CustomOp3::bwd(&self.norm, xn, w, b, a, &d)?;
        sunk(dw)?;
        sunk(db)?;
        let dx = match dxn {
            Some(dxn) => (dx + dxn)?,
            None => dx,
        };
        Ok((Some(dx), None))
    }
}
