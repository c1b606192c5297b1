//! The MLP sub-block of a pre-LayerNorm transformer, `x + fc2(act(fc(layer_norm(x))))`, as
//! one graph node with its own backward.
//!
//! candle 0.11's backward stores the gradient it passes along each edge of its graph into a
//! buffer it first fills with zeros (`GradStore::or_insert`, then `add`). Inside this
//! sub-block, as separate ops, that is four edges: the LayerNorm output `(B, T, C)`, fc's
//! output `h` `(B, T, 4C)` and the branch output, all in the compute dtype, and the two uses of
//! the f32 stream `x`. At GPT-2-124M's shapes that is ~0.75 GB of fills and adds per block and
//! step. Here the node keeps the inner ops' inputs and outputs, and its backward calls their
//! backwards in reverse order, each gradient handed straight to the next; the parameter
//! gradients go to [`crate::grad_sink`] as the per-op path's do.
//!
//! Only a sink can take those parameter gradients (a candle custom op returns gradients for
//! its tensor arguments, here `x` and the branch). So the node is built only for a graph that
//! [`crate::grad_sink::backward`] will differentiate: inside [`crate::Engine::step`]'s forward
//! closure, or [`crate::grad_sink::forward_for_sink`]. Elsewhere [`mlp_block`] builds the
//! per-op composition, with the same values.

use super::act_linear::{ActLinear, Activation};
use super::layer_norm::{prepare, prepare_param, Kind, NormFwd};
use super::linear::{self, Linear, Operands};
use super::residual::{residual_add, ResidualAdd};
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

/// The parameters of an MLP sub-block: LayerNorm gain and bias `(C,)` (f32), fc `(4C, C)` and
/// fc2 `(C, 4C)` weights in the compute dtype with their biases, and the activation between
/// them. Any hidden width works; 4C is GPT-2's.
#[derive(Clone, Copy, Debug)]
pub struct MlpParams<'a> {
    /// LayerNorm gain `(C,)`, f32.
    pub ln_w: &'a Tensor,
    /// LayerNorm bias `(C,)`, f32.
    pub ln_b: &'a Tensor,
    /// LayerNorm's epsilon (PyTorch's default: 1e-5).
    pub eps: f64,
    /// fc's weight `(hidden, C)`, as [`crate::ops::linear`] takes it.
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

/// `x + act_linear(linear(layer_norm_with_dtype(x, ln_w, ln_b, eps, compute), fc_w, fc_b),
/// fc2_w, fc2_b, act)` with `x: (.., C)` f32 (the residual stream) → f32 of x's shape: the MLP
/// half of a pre-LayerNorm transformer block (GPT-2's with [`Activation::GeluTanh`]).
///
/// Under [`crate::grad_sink::forward_for_sink`] (and so inside [`crate::Engine::step`]) one
/// graph node whose backward runs the inner ops' backwards directly (module docs); elsewhere,
/// or when a parameter is not a variable (a frozen constant, or a tensor computed from one)
/// or x is not tracked, the composition of those four ops. Both give the same values and
/// gradients, bit for bit: the same kernels run in the same order.
///
/// Errors (no panics): those of [`crate::ops::layer_norm_with_dtype`], [`crate::ops::linear`],
/// [`crate::ops::act_linear`] and [`crate::ops::residual_add`] for these arguments; from the
/// one-node backward, a parameter gradient that no sink took (the graph was differentiated with
/// candle's `backward` despite the promise).
pub fn mlp_block(x: &Tensor, p: &MlpParams<'_>, compute: DType) -> Result<Tensor> {
    if !one_node_applies(x, p) {
        return composed(x, p, compute);
    }
    // the inner ops on a detached x: candle's backward never walks into them
    let xd = x.detach();
    let norm = || NormFwd {
        kind: Kind::Layer,
        eps: p.eps as f32,
        out: compute,
    };
    let (xn, ln_w, d) = prepare(Kind::Layer, &xd, p.ln_w, p.eps, compute)?;
    let ln_b = prepare_param(Kind::Layer.name(), "b", &xn, p.ln_b, d)?;
    let a = xn.apply_op3(&ln_w, &ln_b, norm())?;
    let Some([a, fc_w, fc_b]) = ready(linear::operands(linear::OP, &a, p.fc_w, Some(p.fc_b))?)
    else {
        return composed(x, p, compute);
    };
    let h = a.apply_op3(&fc_w, &fc_b, Linear)?;
    let Some([h, fc2_w, fc2_b]) =
        ready(linear::operands(p.act.name(), &h, p.fc2_w, Some(p.fc2_b))?)
    else {
        return composed(x, p, compute);
    };
    let h = h.contiguous()?;
    let m = h.apply_op3(&fc2_w, &fc2_b, ActLinear(p.act))?;
    // the prepared parameters must still be the variables (no cast in between), or the sink
    // could not take their gradients
    let params = [&ln_w, &ln_b, &fc_w, &fc_b, &fc2_w, &fc2_b];
    if params.iter().any(|t| t.track_op() && !t.is_variable()) {
        return composed(x, p, compute);
    }
    let saved = Saved {
        norm: norm(),
        act: p.act,
        ln: [xn, ln_w, ln_b, a.clone()],
        fc: [a, fc_w, fc_b, h.clone()],
        fc2: [h, fc2_w, fc2_b, m.clone()],
    };
    x.contiguous()?.apply_op2(&m.detach(), MlpBlock(saved))
}

/// The per-op composition (the reference the one-node form matches).
fn composed(x: &Tensor, p: &MlpParams<'_>, compute: DType) -> Result<Tensor> {
    let a = super::layer_norm_with_dtype(x, p.ln_w, p.ln_b, p.eps, compute)?;
    let h = super::linear(&a, p.fc_w, Some(p.fc_b))?;
    let m = super::act_linear(&h, p.fc2_w, p.fc2_b, p.act)?;
    residual_add(x, &m)
}

/// Whether the one-node form can carry every gradient: a sink ahead, x tracked (else candle
/// would never call the node's backward), an f32 stream, and each parameter either a variable
/// or untracked (a frozen constant gets no gradient, as in the composition).
fn one_node_applies(x: &Tensor, p: &MlpParams<'_>) -> bool {
    let params = [p.ln_w, p.ln_b, p.fc_w, p.fc_b, p.fc2_w, p.fc2_b];
    crate::grad_sink::sink_ahead()
        && x.track_op()
        && x.dtype() == DType::F32
        && x.elem_count() > 0
        && p.ln_w.is_variable()
        && params.iter().all(|t| t.is_variable() || !t.track_op())
}

/// A linear layer's laid-out `[x, w, b]`, or `None` for shapes the composition special-cases.
fn ready(o: Operands) -> Option<[Tensor; 3]> {
    match o {
        Operands::Ready { x, w, b: Some(b) } => Some([x, w, b]),
        _ => None,
    }
}

/// What the backward needs: each inner op's `[inputs.., output]` as it ran.
struct Saved {
    norm: NormFwd,
    act: Activation,
    ln: [Tensor; 4],
    fc: [Tensor; 4],
    fc2: [Tensor; 4],
}

/// The node: `x + m` (the residual add's kernels), the inner ops kept for the backward.
struct MlpBlock(Saved);

/// Errors unless a parameter gradient went to the sink (or there was none to give).
fn sunk(what: &str, g: Option<Tensor>) -> Result<()> {
    if g.is_some() {
        bail!(
            "mlp_block: the gradient of {what} was not taken by a sink: a graph built under \
             grad_sink::forward_for_sink (or Engine::step) must be differentiated with \
             wick::grad_sink::backward, not candle's backward"
        )
    }
    Ok(())
}

impl CustomOp2 for MlpBlock {
    fn name(&self) -> &'static str {
        "mlp_block"
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
        let s = &self.0;
        let (Some(dx), Some(dm)) = ResidualAdd.bwd(x, m, out, dout)? else {
            bail!("mlp_block: the residual add gave no gradient (internal error)")
        };
        let [h, w2, b2, m] = &s.fc2;
        let (dh, dw2, db2) = ActLinear(s.act).bwd(h, w2, b2, m, &dm)?;
        sunk("fc2's weight", dw2)?;
        sunk("fc2's bias", db2)?;
        let Some(dh) = dh else {
            bail!("mlp_block: no gradient for fc's output (internal error)")
        };
        let [a, w1, b1, h] = &s.fc;
        let (da, dw1, db1) = CustomOp3::bwd(&Linear, a, w1, b1, h, &dh)?;
        sunk("fc's weight", dw1)?;
        sunk("fc's bias", db1)?;
        let Some(da) = da else {
            bail!("mlp_block: no gradient for the LayerNorm output (internal error)")
        };
        let [xn, lw, lb, a] = &s.ln;
        let (dxn, dlw, dlb) = CustomOp3::bwd(&s.norm, xn, lw, lb, a, &da)?;
        sunk("the LayerNorm gain", dlw)?;
        sunk("the LayerNorm bias", dlb)?;
        let dx = match dxn {
            Some(dxn) => (dx + dxn)?,
            None => dx,
        };
        Ok((Some(dx), None))
    }
}
