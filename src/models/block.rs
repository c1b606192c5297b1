//! The shared decoder block: one description of a block as the two halves of a pre-norm
//! residual stack ([`ops::Half`] of [`ops::Layer`]s), run by [`ops::pre_norm_stack`] for
//! training (one graph node with its own backward where every layer allows it, the per-op
//! composition otherwise) and by the same function for cached inference (the attention layer
//! then reads and extends a KV cache). Every family is this block with switches
//! ([`super::family::Switches`]):
//!
//! ```text
//! a   = rms_norm(x) · (offset + g_attn)
//! qkv = [Wq; Wk; Wv] a (+ [bq; bk; bv])                       Qwen2's biases
//! qkv = qk_rms_norm(qkv)                                       Qwen3, Gemma 3
//! qkv = rotary(qkv)                                            the layer's RoPE table
//! y   = Wo · attention(qkv)                                    causal, or a sliding window; scale
//! x   = x + y  (Gemma: x + rms_norm(y) · (1 + g_post_attn))
//! m   = Wdown · act([Wgate; Wup] rms_norm(x) · (offset + g_mlp))   SwiGLU or tanh-GeGLU
//! x   = x + m  (Gemma: x + rms_norm(m) · (1 + g_post_mlp))
//! ```

use super::family::{Activation, Switches};
use crate::lora::LoraAdapter;
use crate::ops::{self, Half, Layer, NormParams};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use std::sync::Mutex;

/// A linear layer of one or more HF modules stacked along the output (`[Wq; Wk; Wv]`,
/// `[Wgate; Wup]`): one GEMM for all of them, plus the LoRA updates of the adapted parts.
#[derive(Clone)]
pub(super) struct Proj {
    /// The parts' base weights `(out_i, in)`, trainable or frozen.
    pub parts: Vec<Tensor>,
    /// The stacked weight, made once when the parts are frozen constants.
    pub stacked: Option<Tensor>,
    /// The parts' biases `(out_i,)` (Qwen2's q/k/v), or none.
    pub bias: Vec<Tensor>,
    /// Per part, its adapter (LoRA mode, targeted modules): views of `lora`'s stacks.
    pub adapters: Vec<Option<LoraAdapter>>,
    /// The adapted parts' adapters stacked (`A (P r, in)`, `B (sum out_i, r)`) under their
    /// brace-list name: one store parameter each, read by the forward as they are.
    pub lora: Option<(String, LoraAdapter)>,
    pub scaling: f64,
    pub dropout: f64,
    /// `(out_i, r_i)` per part (rank 0 without an adapter), as `ops::lora_linear_grouped` takes.
    pub ranks: Vec<(usize, usize)>,
}

impl Proj {
    /// `adapted[i]`: whether part i has an adapter in `lora`'s stacks (in order).
    pub fn new(
        parts: Vec<Tensor>,
        bias: Vec<Tensor>,
        frozen: bool,
        lora: Option<(String, LoraAdapter)>,
        adapted: &[bool],
    ) -> Result<Self> {
        let stacked = if frozen && parts.len() > 1 {
            Some(Tensor::cat(&parts, 0)?)
        } else {
            None
        };
        let outs = adapted_outs(&parts, adapted.iter().copied());
        let mut adapters = Vec::with_capacity(parts.len());
        let mut j = 0;
        for &on in adapted {
            adapters.push(match (&lora, on) {
                (Some((_, stack)), true) => {
                    j += 1;
                    Some(stack.part(&outs, j - 1)?)
                }
                _ => None,
            });
        }
        let ranks = parts
            .iter()
            .zip(&adapters)
            .map(|(w, ad)| (w.dims()[0], ad.as_ref().map_or(0, |ad| ad.a.dims()[0])))
            .collect();
        Ok(Self {
            parts,
            stacked,
            bias,
            adapters,
            lora,
            scaling: 1.0,
            dropout: 0.0,
            ranks,
        })
    }

    /// The projection as block-op layers: a linear (with its bias), or a LoRA linear (LoRA
    /// dropout on in training) followed by the bias.
    fn layers<'a>(&'a self, train: bool, out: &mut Vec<Layer<'a>>) {
        let parts = match &self.stacked {
            Some(w) => std::slice::from_ref(w),
            None => self.parts.as_slice(),
        };
        match (&self.lora, parts) {
            (Some((_, LoraAdapter { a, b })), [w]) => {
                out.push(Layer::LoraLinear {
                    w,
                    a,
                    b,
                    parts: &self.ranks,
                    scale: self.scaling,
                    dropout: if train { self.dropout } else { 0.0 },
                });
                if !self.bias.is_empty() {
                    out.push(Layer::Bias { b: &self.bias });
                }
            }
            // adapted parts are frozen, hence stacked: a LoRA projection has one part
            _ => out.push(Layer::Linear {
                parts,
                b: &self.bias,
            }),
        }
    }

    /// Every tensor the projection reads.
    fn tensors(&self, out: &mut Vec<Tensor>) {
        out.extend(self.parts.iter().chain(&self.bias).cloned());
        if let Some((_, stack)) = &self.lora {
            out.extend([stack.a.clone(), stack.b.clone()]);
        }
    }
}

/// The output rows of the adapted parts, in order: the `outs` of their adapter stack.
pub(super) fn adapted_outs(parts: &[Tensor], adapted: impl Iterator<Item = bool>) -> Vec<usize> {
    parts
        .iter()
        .zip(adapted)
        .filter(|(_, on)| *on)
        .map(|(w, _)| w.dims()[0])
        .collect()
}

/// The norm gains of a block as stored (HF's `weight`s): fp32 masters or frozen constants.
#[derive(Clone)]
pub(super) struct Norms {
    /// `input_layernorm` `(C,)`.
    pub attn: Tensor,
    /// `self_attn.q_norm` / `k_norm` `(D,)` (Qwen3, Gemma 3).
    pub qk: Option<(Tensor, Tensor)>,
    /// Gemma's `post_attention_layernorm` `(C,)`: the attention output's norm.
    pub post_attn: Option<Tensor>,
    /// The MLP's pre-norm `(C,)`: `post_attention_layernorm` (Llama's name) or Gemma's
    /// `pre_feedforward_layernorm`.
    pub mlp: Tensor,
    /// Gemma's `post_feedforward_layernorm` `(C,)`.
    pub post_mlp: Option<Tensor>,
}

impl Norms {
    fn tensors(&self, out: &mut Vec<Tensor>) {
        out.extend([self.attn.clone(), self.mlp.clone()]);
        out.extend(self.qk.iter().flat_map(|(q, k)| [q.clone(), k.clone()]));
        out.extend(self.post_attn.iter().chain(&self.post_mlp).cloned());
    }

    /// The gains in the order of [`super::family::Family::block_norms`] (HF's
    /// `input_layernorm`, q/k norms, `post_attention_layernorm`, `pre_feedforward_layernorm`,
    /// `post_feedforward_layernorm`, as the family has them), placed by `switches`.
    ///
    /// Errors: another number of gains than the switches place.
    pub fn from_block_order(gains: Vec<Tensor>, switches: &Switches) -> Result<Norms> {
        let n = gains.len();
        let want = 2 + 2 * (switches.qk_norm as usize) + 2 * (switches.sandwich_norms as usize);
        if n != want {
            bail!("the block has {n} norm gain(s); the family's switches place {want}");
        }
        let mut it = gains.into_iter();
        let mut next = || it.next().context("norm gains out of step");
        let attn = next()?;
        let qk = match switches.qk_norm {
            true => Some((next()?, next()?)),
            false => None,
        };
        let post_attn = switches.sandwich_norms.then(&mut next).transpose()?;
        let mlp = next()?;
        let post_mlp = switches.sandwich_norms.then(&mut next).transpose()?;
        Ok(Norms {
            attn,
            qk,
            post_attn,
            mlp,
            post_mlp,
        })
    }

    /// The gains passed through `f`, the structure kept.
    pub fn map(&self, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Norms> {
        let opt = |w: &Option<Tensor>| w.as_ref().map(&f).transpose();
        Ok(Norms {
            attn: f(&self.attn)?,
            qk: match &self.qk {
                Some((q, k)) => Some((f(q)?, f(k)?)),
                None => None,
            },
            post_attn: opt(&self.post_attn)?,
            mlp: f(&self.mlp)?,
            post_mlp: opt(&self.post_mlp)?,
        })
    }

    /// The gains as the forward multiplies by them ([`applied_gain`]).
    fn applied(&self, offset: f64) -> Result<Norms> {
        self.map(|w| applied_gain(w, offset))
    }
}

/// A norm gain as the forward multiplies by it: `offset + w` in f32 (Gemma's `1 + w`), or the
/// stored tensor itself for offset 0 (so the one-node form sees the variable).
pub(super) fn applied_gain(w: &Tensor, offset: f64) -> Result<Tensor> {
    Ok(match offset {
        0.0 => w.clone(),
        _ => w.to_dtype(DType::F32)?.affine(1.0, offset)?,
    })
}

/// What a block's forward needs of the config.
#[derive(Debug, Clone, Copy)]
pub(super) struct Spec {
    pub heads: usize,
    pub kv_heads: usize,
    pub eps: f64,
    pub switches: Switches,
    /// The layer's sliding window, `None` for full causal attention.
    pub window: Option<usize>,
    /// The attention scale when not `1/√D` (Gemma 3's `query_pre_attn_scalar`).
    pub scale: Option<f64>,
    /// Whether the layer takes the sliding layers' RoPE table (Gemma 3's local base).
    pub local_rope: bool,
}

/// One decoder block.
#[derive(Clone)]
pub(super) struct Block {
    pub norms: Norms,
    pub qkv: Proj,
    pub o: Proj,
    pub gate_up: Proj,
    pub down: Proj,
    pub spec: Spec,
}

/// How the attention layer of a forward reads its keys and values.
#[derive(Clone, Copy)]
pub(super) enum Attend<'a> {
    /// Self-attention over the sequence itself (training, full recompute).
    Sequence,
    /// Self-attention inside each document of a packed row (training).
    Packed(&'a ops::Segments),
    /// Attention over a KV cache holding positions `0..start`, which the layer extends.
    Cached {
        /// The block's cached `(K, V)`, each `(B, Hkv, start, D)`.
        kv: &'a Mutex<Option<(Tensor, Tensor)>>,
        /// Positions already cached.
        start: usize,
    },
    /// A packed row of several sequences at their own positions over a paged KV cache
    /// (serving), which the layer extends.
    Paged {
        /// The layer's `(key pool, value pool)`, `(S, Hkv D)` each.
        pools: &'a (Tensor, Tensor),
        /// The sequences of the row.
        seqs: &'a [ops::PagedSeq],
    },
}

impl<'a> Attend<'a> {
    /// Self-attention over the sequence, or inside the documents of a packed row.
    pub fn over(segments: Option<&'a ops::Segments>) -> Self {
        segments.map_or(Attend::Sequence, Attend::Packed)
    }
}

/// A block's layers and applied gains, owned so that the halves can borrow them.
pub(super) struct Prepared<'a> {
    gains: Norms,
    block: &'a Block,
    rope: &'a (Tensor, Tensor),
    attend: Attend<'a>,
    train: bool,
}

impl Block {
    /// Every tensor the block's forward reads (for [`crate::recompute::checkpoint`]).
    pub fn tensors(&self) -> Vec<Tensor> {
        let mut out = Vec::new();
        self.norms.tensors(&mut out);
        for p in self.projs() {
            p.tensors(&mut out);
        }
        out
    }

    /// The four projections, in forward order.
    pub fn projs(&self) -> [&Proj; 4] {
        [&self.qkv, &self.o, &self.gate_up, &self.down]
    }

    /// The block ready to describe itself: gains applied, its RoPE table (`(cos, sin)` of the
    /// positions run, `(T, D/2)` f32) and attention mode chosen; `train` turns LoRA dropout on.
    pub fn prepare<'a>(
        &'a self,
        rope: &'a (Tensor, Tensor),
        attend: Attend<'a>,
        train: bool,
    ) -> Result<Prepared<'a>> {
        Ok(Prepared {
            gains: self.norms.applied(self.spec.switches.norm_offset)?,
            block: self,
            rope,
            attend,
            train,
        })
    }
}

impl<'a> Prepared<'a> {
    /// The block's branches: `[norm, qkv, (qk norm), rotary, attention, o, (post norm)]` and
    /// `[norm, gate_up, activation, down, (post norm)]`.
    pub fn layers(&'a self) -> [(NormParams<'a>, Vec<Layer<'a>>); 2] {
        let (b, g) = (self.block, &self.gains);
        let s = b.spec;
        let (n_head, n_kv_head) = (s.heads, s.kv_heads);
        let norm = |w: &'a Tensor| NormParams {
            w,
            b: None,
            eps: s.eps,
        };
        let mut attention = Vec::with_capacity(7);
        b.qkv.layers(self.train, &mut attention);
        if let Some((q_w, k_w)) = &g.qk {
            attention.push(Layer::QkNorm {
                q_w,
                k_w,
                eps: s.eps,
                n_head,
                n_kv_head,
            });
        }
        attention.push(Layer::Rotary {
            cos: &self.rope.0,
            sin: &self.rope.1,
            n_head,
            n_kv_head,
        });
        attention.push(match self.attend {
            Attend::Sequence if s.window.is_none() && s.scale.is_none() => {
                Layer::Attention { n_head, n_kv_head }
            }
            Attend::Sequence => Layer::WindowAttention {
                n_head,
                n_kv_head,
                window: s.window,
                scale: s.scale,
                segments: None,
            },
            Attend::Packed(docs) => Layer::WindowAttention {
                n_head,
                n_kv_head,
                window: s.window,
                scale: s.scale,
                segments: Some(docs),
            },
            Attend::Cached { kv, start } => Layer::CachedAttention {
                kv,
                start,
                n_head,
                n_kv_head,
                window: s.window,
                scale: s.scale,
            },
            Attend::Paged { pools, seqs } => Layer::PagedAttention {
                k_pool: &pools.0,
                v_pool: &pools.1,
                seqs,
                n_head,
                n_kv_head,
                window: s.window,
                scale: s.scale,
            },
        });
        b.o.layers(self.train, &mut attention);
        if let Some(w) = &g.post_attn {
            attention.push(Layer::Norm(norm(w)));
        }
        let mut mlp = Vec::with_capacity(5);
        b.gate_up.layers(self.train, &mut mlp);
        mlp.push(match s.switches.activation {
            Activation::SwiGlu => Layer::SwiGlu,
            Activation::GeGluTanh => Layer::GeGlu,
        });
        b.down.layers(self.train, &mut mlp);
        if let Some(w) = &g.post_mlp {
            mlp.push(Layer::Norm(norm(w)));
        }
        [(norm(&g.attn), attention), (norm(&g.mlp), mlp)]
    }
}

/// The halves of prepared blocks' layers, for [`ops::pre_norm_stack`].
pub(super) fn halves<'a>(layers: &'a [[(NormParams<'a>, Vec<Layer<'a>>); 2]]) -> Vec<Half<'a>> {
    layers
        .iter()
        .flat_map(|pair| pair.iter().map(|(n, l)| Half::Branch(*n, l)))
        .collect()
}

/// Runs `blocks` on the f32 stream `x: (B, T, C)` as one residual stack: `rope(i)` is block
/// i's table, `attend(i)` its attention mode. Training (`train`) may build one graph node
/// ([`ops::pre_norm_stack`]); `composed` forces the per-op composition (inside an activation
/// checkpoint, whose recomputation must see every op).
pub(super) fn run<'a>(
    x: &Tensor,
    blocks: impl Iterator<Item = (&'a Block, &'a (Tensor, Tensor), Attend<'a>)>,
    train: bool,
    composed: bool,
    compute: DType,
) -> Result<Tensor> {
    let prepared: Vec<Prepared<'a>> = blocks
        .map(|(b, rope, attend)| b.prepare(rope, attend, train))
        .collect::<Result<_>>()?;
    let layers: Vec<_> = prepared.iter().map(Prepared::layers).collect();
    let halves = halves(&layers);
    Ok(match composed {
        true => ops::pre_norm_composed(x, &halves, compute)?,
        false => ops::pre_norm_stack(x, &halves, compute)?,
    })
}
