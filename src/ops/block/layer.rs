//! The vocabulary of the block ops: a branch's [`Layer`]s and the norm before it
//! ([`NormParams`]), with what each reads and its composition from the public ops. The
//! pre-norm stack ([`super::pre_norm`]), the post-norm block ([`super::post_norm`]) and the
//! one-node steps ([`super::step`]) all speak it; it depends on the lower op kinds only.

use crate::ops::attention::cached::cached_attention;
use crate::ops::attention::causal::grouped_causal_attention;
use crate::ops::attention::padded::key_padding_attention;
use crate::ops::attention::paged::{paged_attention, PagedSeq};
use crate::ops::attention::rotary::rotary_qkv;
use crate::ops::attention::segments::Segments;
use crate::ops::attention::varlen::grouped_varlen_attention;
use crate::ops::attention::window::{is_plain_causal, window_causal_attention};
use crate::ops::elementwise::bias::bias_add;
use crate::ops::elementwise::geglu::geglu_tanh;
use crate::ops::elementwise::swiglu::swiglu;
use crate::ops::linear::act_linear::{act_linear, Activation};
use crate::ops::linear::dense::linear;
use crate::ops::linear::lora::{lora_linear_dropout, lora_linear_grouped};
use crate::ops::norm::layer_norm::layer_norm_with_dtype;
use crate::ops::norm::qk_norm::qk_rms_norm;
use crate::ops::norm::rms_norm::rms_norm_with_dtype;
use candle_core::{bail, DType, Result, Tensor};

/// A pre-norm's gain `(C,)`, optional bias `(C,)` and epsilon: a LayerNorm with a bias
/// (PyTorch's default eps: 1e-5), an RMSNorm without (Llama's: the config's `rms_norm_eps`).
/// The one-node form needs the gain and bias f32 variables (wick's masters) or untracked
/// constants (frozen, as in LoRA); others take the composition.
#[derive(Clone, Copy, Debug)]
pub struct NormParams<'a> {
    /// Gain `(C,)`.
    pub w: &'a Tensor,
    /// Bias `(C,)`: `Some` for a LayerNorm, `None` for an RMSNorm.
    pub b: Option<&'a Tensor>,
    /// Added to the variance (LayerNorm) or the mean square (RMSNorm).
    pub eps: f64,
}

/// One op of a half-block's branch, applied in order from the norm's output `(B, T, C)` in the
/// compute dtype; each takes its predecessor's output as its activation input.
#[derive(Clone, Copy, Debug)]
pub enum Layer<'a> {
    /// [`crate::ops::linear`] by the weight that `parts` stack along the output rows (each
    /// `(out_i, in)`, in the compute dtype; one part is the weight itself), with the bias that
    /// `b` stacks the same way (`(out_i,)` per part; empty: no bias). Each part gets its own
    /// rows of the gradients.
    Linear {
        /// The weight's parts, in row order.
        parts: &'a [Tensor],
        /// The bias's parts, one per weight part, or none.
        b: &'a [Tensor],
    },
    /// [`crate::ops::act_linear`]: `act(h) @ w^T + b`.
    ActLinear {
        /// `(out, in)`.
        w: &'a Tensor,
        /// `(out,)`.
        b: &'a Tensor,
        /// The activation.
        act: Activation,
    },
    /// [`crate::ops::lora_linear_grouped`]: a frozen base weight with LoRA adapters.
    LoraLinear {
        /// The frozen base `(N, K)`.
        w: &'a Tensor,
        /// The stacked down projections `(sum r_i, K)`.
        a: &'a Tensor,
        /// The stacked up projections `(adapted rows, r)`.
        b: &'a Tensor,
        /// `(N_i, r_i)` per stacked module.
        parts: &'a [(usize, usize)],
        /// LoRA's `alpha / r`.
        scale: f64,
        /// PEFT's LoRA dropout on the adapters' input (training): `0.0` is
        /// [`crate::ops::lora_linear_grouped`], one op; above, the composition
        /// [`crate::ops::lora_linear_dropout`].
        dropout: f64,
    },
    /// [`crate::ops::rotary_qkv`] with RoPE tables `(T, Dh/2)` f32.
    Rotary {
        /// cos of the angles.
        cos: &'a Tensor,
        /// sin of the angles.
        sin: &'a Tensor,
        /// Query heads H.
        n_head: usize,
        /// Key/value heads Hkv.
        n_kv_head: usize,
    },
    /// [`crate::ops::grouped_causal_attention`] of a `(B, T, (H + 2 Hkv) Dh)` qkv.
    Attention {
        /// Query heads H.
        n_head: usize,
        /// Key/value heads Hkv.
        n_kv_head: usize,
    },
    /// [`crate::ops::swiglu`] of a `(.., 2F)` gate|up.
    SwiGlu,
    /// [`crate::ops::key_padding_attention`] of a `(B, T, 3C)` qkv: bidirectional, batch
    /// entry b attending to its first `key_lengths[b]` positions.
    PaddedAttention {
        /// Heads H.
        n_head: usize,
        /// Valid positions per batch entry.
        key_lengths: &'a [usize],
    },
    /// [`crate::ops::qk_rms_norm`]: per-head RMSNorm of the q and k parts of a `(B, T, (H +
    /// 2 Hkv) Dh)` qkv (Qwen3's and Gemma 3's `q_norm` / `k_norm`; Gemma passes `w + 1`).
    /// Composition only (the block falls back to the per-op composition).
    QkNorm {
        /// q's gain `(Dh,)`.
        q_w: &'a Tensor,
        /// k's gain `(Dh,)`.
        k_w: &'a Tensor,
        /// Added to the mean square.
        eps: f64,
        /// Query heads H.
        n_head: usize,
        /// Key/value heads Hkv.
        n_kv_head: usize,
    },
    /// A norm inside the branch, output in its input's dtype (Gemma 3's post-attention and
    /// post-feedforward norms on the branch output before the residual add): a LayerNorm with
    /// a bias, an RMSNorm without. Composition only.
    Norm(NormParams<'a>),
    /// [`crate::ops::geglu_tanh`] of a `(.., 2F)` gate|up (Gemma 3's MLP activation).
    /// Composition only.
    GeGlu,
    /// [`crate::ops::window_causal_attention`] of a `(B, T, (H + 2 Hkv) Dh)` qkv: a sliding
    /// window and a scale. With the default scale (`None` or exactly `1 / sqrt(Dh)`) it is one
    /// node under a sink: [`Layer::Attention`] where the window does not bind, the fused
    /// windowed op ([`crate::ops::grouped_window_attention`]) where it does; another scale is
    /// composition only. With `segments` (packed documents, `B == 1`) it is
    /// [`crate::ops::grouped_varlen_attention`], one node under a sink at any scale.
    WindowAttention {
        /// Query heads H.
        n_head: usize,
        /// Key/value heads Hkv.
        n_kv_head: usize,
        /// Keys seen per query, its own included; `None`: all earlier ones.
        window: Option<usize>,
        /// The score scale; `None`: `1 / sqrt(Dh)`.
        scale: Option<f64>,
        /// The documents packed in the row (FlashAttention's varlen `cu_seqlens`): queries
        /// see keys of their own document only; `None`: one sequence per batch row.
        segments: Option<&'a Segments>,
    },
    /// [`crate::ops::bias_add`] of the stacked parts `b` (a bias after a LoRA linear, whose op
    /// has none: Qwen2's q/k/v biases). The bias is cast to x's dtype. Composition only.
    Bias {
        /// The bias's parts, stacked in order.
        b: &'a [Tensor],
    },
    /// Inference only: attention of a KV-cached forward. From a `(B, T, (H + 2 Hkv) Dh)` qkv
    /// (normed and rotated), k and v are appended to the cached ones in `kv` (`(B, Hkv, S,
    /// Dh)` each: `S = start`, or with a window the last `min(start, W - 1)` positions, all a
    /// later query can see; `None` when `start == 0`), stored back detached, and the queries of
    /// positions `start..start + T` attend as [`crate::ops::grouped_attention`] does, `(B, T, H
    /// Dh)`. Errors when the cache does not hold that many positions. Composition only.
    CachedAttention {
        /// The layer's cache: k and v of positions `0..start`.
        kv: &'a std::sync::Mutex<Option<(Tensor, Tensor)>>,
        /// Positions already in the cache.
        start: usize,
        /// Query heads H.
        n_head: usize,
        /// Key/value heads Hkv.
        n_kv_head: usize,
        /// Keys seen per query, its own included; `None`: all earlier ones.
        window: Option<usize>,
        /// The score scale; `None`: `1 / sqrt(Dh)`.
        scale: Option<f64>,
    },
    /// Inference only: [`crate::ops::paged_attention`] of a packed `(1, N, (H + 2 Hkv) Dh)`
    /// qkv of several sequences (normed and rotated), writing their new keys and values into
    /// the layer's pools and reading each sequence's through its slot table. Composition only.
    PagedAttention {
        /// The layer's key pool `(S, Hkv Dh)`.
        k_pool: &'a Tensor,
        /// The layer's value pool `(S, Hkv Dh)`.
        v_pool: &'a Tensor,
        /// The sequences of the packed row.
        seqs: &'a [PagedSeq],
        /// Query heads H.
        n_head: usize,
        /// Key/value heads Hkv.
        n_kv_head: usize,
        /// Keys seen per query, its own included; `None`: all earlier ones.
        window: Option<usize>,
        /// The score scale; `None`: `1 / sqrt(Dh)`.
        scale: Option<f64>,
    },
}

impl<'a> NormParams<'a> {
    /// The gain, and the bias when there is one.
    pub(in crate::ops) fn tensors(&self) -> Vec<&'a Tensor> {
        std::iter::once(self.w).chain(self.b).collect()
    }

    /// Whether the one-node form can take the norm: each tracked parameter f32 (and checked by
    /// the caller to be a variable), which the norm's prepare keeps as it is.
    pub(in crate::ops) fn one_node_ok(&self) -> bool {
        self.tensors()
            .iter()
            .all(|p| !p.track_op() || p.dtype() == DType::F32)
    }

    /// The norm as its public op (the composition's), output in `out`.
    pub(in crate::ops) fn composed(&self, x: &Tensor, out: DType) -> Result<Tensor> {
        match self.b {
            Some(b) => layer_norm_with_dtype(x, self.w, b, self.eps, out),
            None => rms_norm_with_dtype(x, self.w, self.eps, out),
        }
    }
}

impl<'a> Layer<'a> {
    /// Appends the parameters and constants the layer reads to `out`.
    pub(in crate::ops) fn tensors(&self, out: &mut Vec<&'a Tensor>) {
        match *self {
            Layer::Linear { parts, b } => out.extend(parts.iter().chain(b)),
            Layer::ActLinear { w, b, .. } => out.extend([w, b]),
            Layer::LoraLinear { w, a, b, .. } => out.extend([w, a, b]),
            Layer::Rotary { cos, sin, .. } => out.extend([cos, sin]),
            Layer::QkNorm { q_w, k_w, .. } => out.extend([q_w, k_w]),
            Layer::Norm(n) => out.extend(n.tensors()),
            Layer::Bias { b } => out.extend(b),
            Layer::Attention { .. }
            | Layer::SwiGlu
            | Layer::PaddedAttention { .. }
            | Layer::GeGlu
            | Layer::WindowAttention { .. }
            | Layer::CachedAttention { .. }
            | Layer::PagedAttention { .. } => {}
        }
    }

    /// Whether a block node can run the layer, known before any work from the branch's
    /// sequence length `t`: false for the composition-only layers, and for a
    /// [`Layer::WindowAttention`] whose scale is not `1 / sqrt(D)` for any head width D (the
    /// step checks the actual one). A block whose branch has such a layer
    /// goes straight to the composition.
    pub(in crate::ops) fn one_node_capable(&self, t: usize) -> bool {
        match *self {
            Layer::Linear { .. }
            | Layer::ActLinear { .. }
            | Layer::Rotary { .. }
            | Layer::Attention { .. }
            | Layer::SwiGlu
            | Layer::PaddedAttention { .. } => true,
            Layer::LoraLinear { dropout, .. } => dropout == 0.0,
            // packed documents: the fused varlen op at any scale
            Layer::WindowAttention {
                segments: Some(_), ..
            } => true,
            Layer::WindowAttention { scale, .. } => {
                // the head width whose default scale `scale` would be
                let d = scale.map_or(1, |s| (1.0 / (s * s)).round().max(1.0) as usize);
                is_plain_causal(t, d, None, scale)
            }
            Layer::QkNorm { .. }
            | Layer::Norm(_)
            | Layer::GeGlu
            | Layer::Bias { .. }
            | Layer::CachedAttention { .. }
            | Layer::PagedAttention { .. } => false,
        }
    }

    /// The layer as its public op (the composition's).
    pub(in crate::ops) fn composed(&self, x: &Tensor) -> Result<Tensor> {
        match *self {
            Layer::Linear { parts, b } => {
                let Some(w) = stacked(parts)? else {
                    bail!("block op: a linear layer without weight parts")
                };
                linear(x, &w, stacked(b)?.as_ref())
            }
            Layer::ActLinear { w, b, act } => act_linear(x, w, b, act),
            Layer::LoraLinear {
                w,
                a,
                b,
                parts,
                scale,
                dropout,
            } => match dropout {
                0.0 => lora_linear_grouped(x, w, a, b, parts, scale),
                p => lora_linear_dropout(x, w, a, b, parts, scale, p),
            },
            Layer::Rotary {
                cos,
                sin,
                n_head,
                n_kv_head,
            } => rotary_qkv(x, cos, sin, n_head, n_kv_head),
            Layer::Attention { n_head, n_kv_head } => {
                grouped_causal_attention(x, n_head, n_kv_head)
            }
            Layer::SwiGlu => swiglu(x),
            Layer::PaddedAttention {
                n_head,
                key_lengths,
            } => key_padding_attention(x, n_head, key_lengths),
            Layer::QkNorm {
                q_w,
                k_w,
                eps,
                n_head,
                n_kv_head,
            } => qk_rms_norm(x, q_w, k_w, eps, n_head, n_kv_head),
            Layer::Norm(n) => n.composed(x, x.dtype()),
            Layer::GeGlu => geglu_tanh(x),
            Layer::WindowAttention {
                n_head,
                n_kv_head,
                window,
                scale,
                segments: None,
            } => window_causal_attention(x, n_head, n_kv_head, window, scale),
            Layer::WindowAttention {
                n_head,
                n_kv_head,
                window,
                scale,
                segments: Some(seg),
            } => grouped_varlen_attention(x, n_head, n_kv_head, window, scale, seg),
            Layer::Bias { b } => {
                let Some(b) = stacked(b)? else {
                    bail!("block op: a bias layer without parts; pass at least one (C,) bias")
                };
                bias_add(x, &b)
            }
            Layer::CachedAttention {
                kv,
                start,
                n_head,
                n_kv_head,
                window,
                scale,
            } => cached_attention(x, kv, start, (n_head, n_kv_head), window, scale),
            Layer::PagedAttention {
                k_pool,
                v_pool,
                seqs,
                n_head,
                n_kv_head,
                window,
                scale,
            } => paged_attention(x, k_pool, v_pool, seqs, (n_head, n_kv_head), window, scale),
        }
    }
}

/// Every parameter and constant that a norm and a branch's `layers` read.
pub(in crate::ops) fn tensors<'a>(norm: &NormParams<'a>, layers: &[Layer<'a>]) -> Vec<&'a Tensor> {
    let mut out = norm.tensors();
    for layer in layers {
        layer.tensors(&mut out);
    }
    out
}

/// `parts` stacked along their first dimension: the one part itself, a concatenation of
/// several, `None` for none.
pub(in crate::ops) fn stacked(parts: &[Tensor]) -> Result<Option<Tensor>> {
    Ok(match parts {
        [] => None,
        [p] => Some(p.clone()),
        parts => Some(Tensor::cat(parts, 0)?),
    })
}
