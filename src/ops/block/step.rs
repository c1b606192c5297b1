//! The inner ops of a block node ([`crate::ops::pre_norm_stack`], [`crate::ops::post_norm_block`]) as
//! they ran, and their backward.
//!
//! Each step runs the same op, on the same laid-out operands, as the public function the
//! per-op composition calls ([`crate::ops::linear`], [`crate::ops::act_linear`],
//! [`crate::ops::lora_linear_grouped`], [`crate::ops::rotary_qkv`], [`crate::ops::swiglu`],
//! [`crate::ops::grouped_causal_attention`], the norms), so both forms give the same bits. The
//! backward asks each op for the gradients that the composition's autograd would ask for: an
//! input's gradient when some earlier op of the stack (or the stack's input) is tracked
//! (`want_x`, fixed when the step is built), a parameter's when it is tracked. Parameter
//! gradients go to [`crate::grad_sink`]; a tracked parameter whose gradient no sink took is an
//! error.

use super::layer::{stacked, Layer, NormParams};
use crate::grad_sink::offer;
use crate::ops::attention::causal::{fused_attention, AttentionOp};
use crate::ops::attention::padded::PaddedAttention;
use crate::ops::attention::qkv::qkv_head_dim;
use crate::ops::attention::rotary;
use crate::ops::attention::rotary::Rotary;
use crate::ops::attention::varlen::fused_varlen_attention;
use crate::ops::attention::window::is_plain_causal;
use crate::ops::elementwise::swiglu::{swiglu, SwiGlu};
use crate::ops::linear::act_linear::ActLinear;
use crate::ops::linear::dense::{Linear, Operands};
use crate::ops::linear::lora::LoraLinear;
use crate::ops::linear::{dense, lora};
use crate::ops::norm::layer_norm;
use crate::ops::norm::layer_norm::{prepare, prepare_param, Kind, NormFwd};
use candle_core::{bail, CustomOp1, CustomOp3, DType, Result, Tensor};

/// One inner op as it ran: its input `x` (laid out as the op took it), its output `y`, the op
/// with its other operands, and whether the backward must return x's gradient.
pub(in crate::ops) struct Step {
    op: Op,
    x: Tensor,
    y: Tensor,
    want_x: bool,
}

/// The op and the operands other than x, as the op took them.
enum Op {
    Norm {
        op: NormFwd,
        w: Tensor,
        b: Option<Tensor>,
    },
    /// `w` and `b` are the stacked `parts` and `b_parts` (the single part itself when there is
    /// one); the gradients go to the parts.
    Linear {
        w: Tensor,
        parts: Vec<Tensor>,
        b: Option<Tensor>,
        b_parts: Vec<Tensor>,
    },
    ActLinear {
        op: ActLinear,
        w: Tensor,
        b: Tensor,
    },
    Lora {
        op: LoraLinear,
        a: Tensor,
        b: Tensor,
    },
    Rotary {
        op: Rotary,
        cos: Tensor,
        sin: Tensor,
    },
    SwiGlu,
    Attention(AttentionOp),
    PaddedAttention(PaddedAttention),
}

impl Step {
    /// The norm of f32 `x` (contiguous, detached) writing `compute`: LayerNorm with a bias,
    /// RMSNorm without (a half's pre-norm, or a post-norm block's norm).
    pub(in crate::ops) fn norm(
        x: &Tensor,
        n: &NormParams<'_>,
        compute: DType,
        want_x: bool,
    ) -> Result<Self> {
        let kind = if n.b.is_some() {
            Kind::Layer
        } else {
            Kind::Rms
        };
        let (x, w, d) = prepare(kind, x, n.w, n.eps, compute)?;
        let op = NormFwd {
            kind,
            eps: n.eps as f32,
            out: compute,
        };
        let (y, b) = match n.b {
            Some(b) => {
                let b = prepare_param(kind.name(), "b", &x, b, d)?;
                (x.apply_op3(&w, &b, op)?, Some(b))
            }
            None => (x.apply_op2(&w, op)?, None),
        };
        Ok(Self {
            op: Op::Norm { op, w, b },
            x,
            y,
            want_x,
        })
    }

    /// `layer` on `x`, or `None` for shapes where the composition takes another path (empty
    /// operands, attention without the fused kernels, a window attention whose window binds
    /// or whose scale is not the default) and for the composition-only layers
    /// ([`Layer::QkNorm`], [`Layer::Norm`], [`Layer::GeGlu`], [`Layer::Bias`],
    /// [`Layer::CachedAttention`]).
    pub(in crate::ops) fn layer(
        layer: &Layer<'_>,
        x: &Tensor,
        want_x: bool,
    ) -> Result<Option<Self>> {
        let (x, y, op) = match *layer {
            Layer::Linear { parts, b: b_parts } => {
                let Some(w) = joined(parts)? else {
                    bail!("block op: a linear layer without weight parts")
                };
                let b = joined(b_parts)?;
                let Operands::Ready { x, w, b } = dense::operands(dense::OP, x, &w, b.as_ref())?
                else {
                    return Ok(None);
                };
                let y = match &b {
                    Some(b) => x.apply_op3(&w, b, Linear)?,
                    None => x.apply_op2(&w, Linear)?,
                };
                let (parts, b_parts) = (parts.to_vec(), b_parts.to_vec());
                (
                    x,
                    y,
                    Op::Linear {
                        w,
                        parts,
                        b,
                        b_parts,
                    },
                )
            }
            Layer::ActLinear { w, b, act } => {
                let Operands::Ready { x, w, b: Some(b) } =
                    dense::operands(act.name(), x, w, Some(b))?
                else {
                    return Ok(None);
                };
                let x = x.contiguous()?;
                let y = x.apply_op3(&w, &b, ActLinear(act))?;
                (
                    x,
                    y,
                    Op::ActLinear {
                        op: ActLinear(act),
                        w,
                        b,
                    },
                )
            }
            Layer::LoraLinear {
                w,
                a,
                b,
                parts,
                scale,
                dropout,
            } => {
                if dropout != 0.0 {
                    return Ok(None);
                }
                let ([x, a, b], op) = lora::operands(x, w, a, b, parts, scale)?;
                let y = x.apply_op3(&a, &b, op.clone())?;
                (x, y, Op::Lora { op, a, b })
            }
            Layer::Rotary {
                cos,
                sin,
                n_head,
                n_kv_head,
            } => {
                let Some(([x, cos, sin], op)) = rotary::operands(x, cos, sin, n_head, n_kv_head)?
                else {
                    return Ok(None);
                };
                let y = x.apply_op3(&cos, &sin, op)?;
                (x, y, Op::Rotary { op, cos, sin })
            }
            Layer::SwiGlu => {
                if x.elem_count() == 0 {
                    return Ok(None);
                }
                let x = x.contiguous()?;
                (x.clone(), swiglu(&x)?, Op::SwiGlu)
            }
            Layer::Attention { n_head, n_kv_head } => {
                // contiguous once: the op runs on (and its backward reads) this very tensor
                let x = x.contiguous()?;
                let Some((y, op)) = fused_attention(&x, n_head, n_kv_head, None)? else {
                    return Ok(None);
                };
                (x, y, Op::Attention(op))
            }
            Layer::PaddedAttention {
                n_head,
                key_lengths,
            } => {
                if x.elem_count() == 0 {
                    return Ok(None);
                }
                let x = x.contiguous()?;
                let (y, op) = PaddedAttention::forward(&x, n_head, key_lengths)?;
                (x, y, Op::PaddedAttention(op))
            }
            Layer::WindowAttention {
                n_head,
                n_kv_head,
                window,
                scale,
                segments: Some(seg),
            } => {
                // packed documents: the fused varlen op (what grouped_varlen_attention runs)
                let x = x.contiguous()?;
                if x.elem_count() == 0 {
                    return Ok(None);
                }
                let fused = fused_varlen_attention(&x, n_head, n_kv_head, window, scale, seg)?;
                let Some((y, op)) = fused else {
                    return Ok(None);
                };
                (x, y, Op::Attention(op))
            }
            Layer::WindowAttention {
                n_head,
                n_kv_head,
                window,
                scale,
                segments: None,
            } => {
                // the fused attention, windowed where the window binds, where the scale is
                // the default (what window_causal_attention runs then), else the composition
                let d = qkv_head_dim("window_causal_attention", x, n_head, n_kv_head)?;
                if !is_plain_causal(x.dim(1)?, d, None, scale) || window == Some(0) {
                    return Ok(None);
                }
                let x = x.contiguous()?;
                let Some((y, op)) = fused_attention(&x, n_head, n_kv_head, window)? else {
                    return Ok(None);
                };
                (x, y, Op::Attention(op))
            }
            // composition only
            Layer::QkNorm { .. }
            | Layer::Norm(_)
            | Layer::GeGlu
            | Layer::Bias { .. }
            | Layer::CachedAttention { .. }
            | Layer::PagedAttention { .. } => return Ok(None),
        };
        Ok(Some(Self { op, x, y, want_x }))
    }

    /// The step's output.
    pub(in crate::ops) fn output(&self) -> &Tensor {
        &self.y
    }

    /// The parameters whose gradients the step hands to the sink.
    fn params(&self) -> Vec<&Tensor> {
        match &self.op {
            Op::Norm { w, b, .. } => std::iter::once(w).chain(b).collect(),
            Op::Linear { parts, b_parts, .. } => parts.iter().chain(b_parts).collect(),
            Op::ActLinear { w, b, .. } | Op::Lora { a: w, b, .. } => vec![w, b],
            Op::Rotary { .. } | Op::SwiGlu | Op::Attention(_) | Op::PaddedAttention(_) => vec![],
        }
    }

    /// Whether autograd tracks one of the step's parameters.
    pub(in crate::ops) fn tracks_params(&self) -> bool {
        self.params().iter().any(|p| p.track_op())
    }

    /// Whether a sink can take every gradient of the step's parameters: each tracked one is a
    /// variable (not a cast or copy of one made on the way into the op).
    pub(in crate::ops) fn params_sinkable(&self) -> bool {
        self.params().into_iter().all(sinkable)
    }

    /// `layers` in order from `input`, each step's `want_x` from `tracked` (whether the
    /// composition's autograd would track that op's input), which the steps' parameters
    /// update. `None` where a layer takes another path, or where a parameter as an op took it
    /// is no longer a variable (cast or copied on the way in), whose gradient no sink could
    /// take: the caller builds the composition.
    pub(in crate::ops) fn layers(
        input: &Tensor,
        layers: &[Layer<'_>],
        tracked: &mut bool,
    ) -> Result<Option<Vec<Step>>> {
        // composition-only layers, known before any op runs
        let t = input.dims().iter().rev().nth(1).copied().unwrap_or(0);
        if !layers.iter().all(|l| l.one_node_capable(t)) {
            return Ok(None);
        }
        let mut steps: Vec<Step> = Vec::with_capacity(layers.len());
        for layer in layers {
            let x = steps.last().map_or(input, Step::output);
            let Some(step) = Step::layer(layer, x, *tracked)? else {
                return Ok(None);
            };
            *tracked |= step.tracks_params();
            steps.push(step);
        }
        Ok(steps.iter().all(Step::params_sinkable).then_some(steps))
    }

    /// Whether the backward has anything to compute: x's gradient or a parameter's.
    pub(in crate::ops) fn needed(&self) -> bool {
        self.want_x || self.tracks_params()
    }

    /// `residual + ` x's gradient from the output's `dy` (`None` where x is not tracked, or
    /// where [`Step::backward`] gives none), and that sum in `low` where a norm's kernel wrote
    /// it in the same pass.
    fn backward_adding(
        &self,
        dy: &Tensor,
        residual: Tensor,
        low: Option<DType>,
    ) -> Result<Option<(Tensor, Option<Tensor>)>> {
        if let Op::Norm { op, w, b } = &self.op {
            let (dx, p, dx_low) =
                layer_norm::backward_with_residual(op, &self.x, w, dy, Some(&residual), low)?;
            give_norm(w, b.as_ref(), &p)?;
            return Ok(self.want_x.then_some((dx, dx_low)));
        }
        Ok(match self.backward(dy)? {
            Some(dx) => Some(((residual + dx)?, None)),
            None => None,
        })
    }

    /// x's gradient from the output's (`None` unless `want_x`); the parameter gradients go to
    /// the sink.
    pub(in crate::ops) fn backward(&self, dy: &Tensor) -> Result<Option<Tensor>> {
        let (x, y, want_x) = (&self.x, &self.y, self.want_x);
        let dx = match &self.op {
            Op::Norm { op, w, b } => {
                // dx, and the gain's (and bias's) gradient as rows of one f32 buffer
                let (dx, p) = layer_norm::backward(op, x, w, dy)?;
                give_norm(w, b.as_ref(), &p)?;
                Some(dx)
            }
            Op::Linear {
                w,
                parts,
                b,
                b_parts,
            } => {
                let want_w = parts.iter().any(Tensor::track_op);
                let want_b = b_parts.iter().any(Tensor::track_op);
                let (dx, dw, db) =
                    dense::grads_wanted(x, w, b.as_ref(), dy, want_x, want_w, want_b)?;
                give_rows(b_parts, db)?;
                give_rows(parts, dw)?;
                dx
            }
            Op::ActLinear { op, w, b } => {
                let (dx, dw, db) = op.grads(x, w, b, dy, want_x)?;
                give(w, dw)?;
                give(b, db)?;
                dx
            }
            Op::Lora { op, a, b } => {
                let (dx, da, db) = op.grads(x, a, b, dy, want_x)?;
                give(a, Some(da))?;
                give(b, Some(db))?;
                dx
            }
            Op::Rotary { op, cos, sin } => CustomOp3::bwd(op, x, cos, sin, y, dy)?.0,
            Op::SwiGlu => CustomOp1::bwd(&SwiGlu, x, y, dy)?,
            Op::Attention(op) => op.bwd(x, y, dy)?,
            Op::PaddedAttention(op) => Some(op.backward(dy)?),
        };
        match (want_x, dx) {
            (false, _) => Ok(None),
            (true, Some(dx)) => Ok(Some(dx)),
            (true, None) => {
                bail!("block op: an inner op gave no input gradient (internal error)")
            }
        }
    }
}

/// Whether a sink can take `t`'s gradient, or it needs none: a variable, or untracked.
pub(in crate::ops) fn sinkable(t: &Tensor) -> bool {
    t.is_variable() || !t.track_op()
}

/// What a block node hangs on: x when tracked, else the first tracked parameter (the node
/// must be tracked to be differentiated); `None` when nothing is tracked.
pub(in crate::ops) fn anchor<'a>(
    x: &'a Tensor,
    mut params: impl Iterator<Item = &'a Tensor>,
) -> Option<&'a Tensor> {
    match x.track_op() {
        true => Some(x),
        false => params.find(|t| t.track_op()),
    }
}

/// Hands a norm's parameter gradients, rows of one `(np, D)` f32 buffer (dw, then db), to
/// the sink, as [`give`].
fn give_norm(w: &Tensor, b: Option<&Tensor>, p: &Tensor) -> Result<()> {
    give(w, Some(p.get(0)?))?;
    match b {
        Some(b) => give(b, Some(p.get(1)?)),
        None => Ok(()),
    }
}

/// Hands parameter `p`'s gradient `g` to the sink. Dropped when `p` is untracked (a frozen
/// constant, whose gradient the composition would leave unused too); an error when `p` is
/// tracked and no sink took it (no sink was open).
fn give(p: &Tensor, g: Option<Tensor>) -> Result<()> {
    if offer(p, g)?.is_some() && p.track_op() {
        bail!(
            "block op: a parameter gradient was not taken by a sink: a graph built under \
             grad_sink::forward_for_sink (or Engine::step) must be differentiated with \
             wick::grad_sink::backward, not candle's backward"
        )
    }
    Ok(())
}

/// `parts` stacked along their first dimension for an op (detached when several: the
/// concatenation is the op's operand, the parts get the gradient's rows).
fn joined(parts: &[Tensor]) -> Result<Option<Tensor>> {
    match parts {
        [_] | [] => stacked(parts),
        parts => stacked(&parts.iter().map(Tensor::detach).collect::<Vec<_>>()),
    }
}

/// Hands each of the stacked `parts` its rows of `g` (the gradient of their concatenation).
fn give_rows(parts: &[Tensor], g: Option<Tensor>) -> Result<()> {
    match (parts, g) {
        ([part], g) => give(part, g),
        (parts, Some(g)) => {
            let mut row = 0;
            for part in parts {
                let n = part.dim(0)?;
                give(
                    part,
                    part.track_op().then(|| g.narrow(0, row, n)).transpose()?,
                )?;
                row += n;
            }
            Ok(())
        }
        (_, None) => Ok(()),
    }
}

/// Ops in a row as they ran (a pre-norm half: its norm, then its branch; a post-norm block:
/// its branch), the first one's input being a residual stream `x` and the last one's output
/// the branch's `m`.
pub(in crate::ops) struct Chain(pub(in crate::ops) Vec<Step>);

impl Chain {
    /// The last op's output.
    pub(in crate::ops) fn output(&self) -> Result<&Tensor> {
        match self.0.last() {
            Some(step) => Ok(step.output()),
            None => bail!("block op: an empty chain of ops (internal error)"),
        }
    }

    /// The gradient of `x` from that of `x + m`, as the residual add and the ops of the
    /// composition give it: `d + chain'(d in m's dtype)`; `None` where nothing before the
    /// chain is tracked.
    pub(in crate::ops) fn backward(&self, d: Tensor) -> Result<Option<Tensor>> {
        Ok(self.backward_low(d, None, false)?.map(|(dx, _)| dx))
    }

    /// [`Chain::backward`] given `d` also in m's dtype where the chain after this one made it
    /// (`d_low`: no cast), returning x's gradient and, with `want_low` (a chain before this one
    /// will cast it) where the first op is a norm whose kernel adds `d` (a pre-norm half:
    /// [`layer_norm::backward_with_residual`]), that gradient in m's dtype too. Values as
    /// [`Chain::backward`]'s, bit for bit.
    pub(in crate::ops) fn backward_low(
        &self,
        d: Tensor,
        d_low: Option<Tensor>,
        want_low: bool,
    ) -> Result<Option<(Tensor, Option<Tensor>)>> {
        let out = self.output()?.dtype();
        // a copy in m's dtype only where it differs from d's (f32 compute: none)
        let low = (want_low && out != d.dtype()).then_some(out);
        let mut g = match d_low {
            Some(low) if low.dtype() == out => low,
            _ => d.to_dtype(out)?,
        };
        for (i, step) in self.0.iter().enumerate().rev() {
            if !step.needed() {
                // nothing earlier is tracked either
                return Ok(None);
            }
            if i == 0 {
                return step.backward_adding(&g, d, low);
            }
            match step.backward(&g)? {
                Some(dx) => g = dx,
                None => return Ok(None),
            }
        }
        bail!("block op: an empty chain of ops (internal error)")
    }
}
