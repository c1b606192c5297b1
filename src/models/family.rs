//! The decoder families wick implements, each a name plus the switches it sets on the one
//! shared block ([`super::decoder`]): Llama 1/2/3.x (SmolLM2), Mistral, Qwen2/2.5, Qwen3 and
//! Gemma 3 (text). The semantics are transformers' `modeling_llama`, `modeling_mistral`,
//! `modeling_qwen2`, `modeling_qwen3` and `modeling_gemma3` (`Gemma3ForCausalLM`); the tests
//! check each against candle-transformers 0.11.1's own implementation.
//!
//! | family | q/k/v bias | q/k RMSNorm | norm gain | norms per block | MLP | embeddings | sliding window |
//! |---|---|---|---|---|---|---|---|
//! | Llama | no | no | `w` | 2 | SwiGLU | as is | no |
//! | Mistral | no | no | `w` | 2 | SwiGLU | as is | every layer (`sliding_window`) |
//! | Qwen2 | yes | no | `w` | 2 | SwiGLU | as is | layers ≥ `max_window_layers` when `use_sliding_window` |
//! | Qwen3 | no | yes | `w` | 2 | SwiGLU | as is | as Qwen2 |
//! | Gemma 3 | no | yes | `1 + w` | 4 (sandwich) | GeGLU (tanh GELU) | × √hidden | `layer_types` (5 of 6), own RoPE base |

use anyhow::{bail, Result};

/// A decoder family: `config.json`'s `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum Family {
    /// `llama` (Llama 1/2/3.x, SmolLM2).
    #[default]
    #[serde(rename = "llama")]
    Llama,
    /// `mistral`.
    #[serde(rename = "mistral")]
    Mistral,
    /// `qwen2` (Qwen2, Qwen2.5).
    #[serde(rename = "qwen2")]
    Qwen2,
    /// `qwen3` (dense Qwen3).
    #[serde(rename = "qwen3")]
    Qwen3,
    /// `gemma3_text` (Gemma 3's text decoder, `Gemma3ForCausalLM`).
    #[serde(rename = "gemma3_text")]
    Gemma3,
}

impl<'de> serde::Deserialize<'de> for Family {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Family::from_model_type(&name).map_err(|e| serde::de::Error::custom(format!("{e:#}")))
    }
}

/// The MLP's gated activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) * up` (transformers' `hidden_act: "silu"`).
    SwiGlu,
    /// `gelu_tanh(gate) * up` (`hidden_activation: "gelu_pytorch_tanh"`).
    GeGluTanh,
}

/// What a family switches on in the shared block.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Switches {
    /// Biases on the q, k and v projections (not on o).
    pub qkv_bias: bool,
    /// A per-head RMSNorm of q and of k (gains `(D,)`) before RoPE.
    pub qk_norm: bool,
    /// Every RMSNorm scales by `norm_offset + w` (Gemma: 1; the others: 0).
    pub norm_offset: f64,
    /// Gemma's sandwich: each branch's output is normed again before the residual add, and
    /// the MLP's pre-norm is `pre_feedforward_layernorm`.
    pub sandwich_norms: bool,
    /// The MLP's activation.
    pub activation: Activation,
    /// The embeddings are multiplied by `√hidden_size` (rounded to the table's dtype).
    pub embed_scale: bool,
    /// llama.cpp's converter permuted the q/k rows of the GGUF (its `LlamaModel.permute`).
    pub gguf_permuted_qk: bool,
    /// llama.cpp's converter stored the RMSNorm gains as `1 + w` (its Gemma converters).
    pub gguf_norm_plus_one: bool,
}

/// Whether a layer attends over a sliding window or the whole prefix (transformers'
/// `layer_types` entries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LayerType {
    /// `"full_attention"`.
    #[serde(rename = "full_attention")]
    Full,
    /// `"sliding_attention"`.
    #[serde(rename = "sliding_attention")]
    Sliding,
}

impl Family {
    /// Every family, in the order of the module table.
    pub const ALL: [Family; 5] = [
        Family::Llama,
        Family::Mistral,
        Family::Qwen2,
        Family::Qwen3,
        Family::Gemma3,
    ];

    /// The switches of the family (the module table).
    pub fn switches(self) -> Switches {
        let llama = Switches {
            qkv_bias: false,
            qk_norm: false,
            norm_offset: 0.0,
            sandwich_norms: false,
            activation: Activation::SwiGlu,
            embed_scale: false,
            gguf_permuted_qk: true,
            gguf_norm_plus_one: false,
        };
        match self {
            Family::Llama | Family::Mistral => llama,
            Family::Qwen2 => Switches {
                qkv_bias: true,
                gguf_permuted_qk: false,
                ..llama
            },
            Family::Qwen3 => Switches {
                qk_norm: true,
                gguf_permuted_qk: false,
                ..llama
            },
            Family::Gemma3 => Switches {
                qkv_bias: false,
                qk_norm: true,
                norm_offset: 1.0,
                sandwich_norms: true,
                activation: Activation::GeGluTanh,
                embed_scale: true,
                gguf_permuted_qk: false,
                gguf_norm_plus_one: true,
            },
        }
    }

    /// `config.json`'s `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3_text",
        }
    }

    /// The family of a `config.json`'s `model_type`.
    ///
    /// Errors: another model type, named with the ones wick implements (Gemma 3's
    /// multimodal `gemma3` points at its `text_config`).
    pub fn from_model_type(name: &str) -> Result<Self> {
        if let Some(f) = Self::ALL.into_iter().find(|f| f.model_type() == name) {
            return Ok(f);
        }
        let hint = match name {
            "gemma3" => {
                " (Gemma 3's multimodal config: its text decoder is the \
                         \"text_config\" object, model_type \"gemma3_text\")"
            }
            _ => "",
        };
        bail!(
            "model_type {name:?} is not implemented{hint}; wick's decoder implements {:?}",
            Self::ALL.map(Self::model_type)
        )
    }

    /// transformers' class, `config.json`'s `architectures`.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Gemma3 => "Gemma3ForCausalLM",
        }
    }

    /// The family of a GGUF's `general.architecture` (llama.cpp writes Mistral's dense models
    /// as `llama`, which they are but for the window: see [`super::files::Gguf::config`]).
    ///
    /// Errors: another architecture, named with the ones wick reads.
    pub fn from_gguf_architecture(arch: &str) -> Result<Self> {
        Ok(match arch {
            "llama" => Family::Llama,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "gemma3" => Family::Gemma3,
            other => bail!(
                "GGUF architecture {other:?} is not implemented; wick's decoder reads \"llama\" \
                 (Llama, SmolLM2, Mistral), \"qwen2\", \"qwen3\" and \"gemma3\""
            ),
        })
    }

    /// The GGUF `general.architecture` (and metadata key prefix) of the family.
    pub fn gguf_architecture(self) -> &'static str {
        match self {
            Family::Llama | Family::Mistral => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Gemma3 => "gemma3",
        }
    }

    /// The block's tensors beyond the seven linears, as `(HF suffix, GGUF suffix, width)`
    /// with width `Hidden` (`(C,)`) or `Head` (`(D,)`), in the block's order.
    pub fn block_norms(self) -> &'static [(&'static str, &'static str, NormWidth)] {
        use NormWidth::{Head, Hidden};
        let s = self.switches();
        match (s.sandwich_norms, s.qk_norm) {
            (false, false) => &[
                ("input_layernorm.weight", "attn_norm.weight", Hidden),
                ("post_attention_layernorm.weight", "ffn_norm.weight", Hidden),
            ],
            (false, true) => &[
                ("input_layernorm.weight", "attn_norm.weight", Hidden),
                ("self_attn.q_norm.weight", "attn_q_norm.weight", Head),
                ("self_attn.k_norm.weight", "attn_k_norm.weight", Head),
                ("post_attention_layernorm.weight", "ffn_norm.weight", Hidden),
            ],
            (true, _) => &[
                ("input_layernorm.weight", "attn_norm.weight", Hidden),
                ("self_attn.q_norm.weight", "attn_q_norm.weight", Head),
                ("self_attn.k_norm.weight", "attn_k_norm.weight", Head),
                (
                    "post_attention_layernorm.weight",
                    "post_attention_norm.weight",
                    Hidden,
                ),
                (
                    "pre_feedforward_layernorm.weight",
                    "ffn_norm.weight",
                    Hidden,
                ),
                (
                    "post_feedforward_layernorm.weight",
                    "post_ffw_norm.weight",
                    Hidden,
                ),
            ],
        }
    }
}

/// The width of a norm gain: the residual stream's or one head's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormWidth {
    /// `(hidden_size,)`.
    Hidden,
    /// `(head_dim,)`.
    Head,
}

/// The block's linears: `(HF module, GGUF name)`, in their stacking order (q, k, v, o, gate,
/// up, down).
pub const LINEARS: [(&str, &str); 7] = [
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

/// The HF name of a GGUF block tensor's suffix (`attn_q.weight`, `attn_q.bias`,
/// `post_ffw_norm.weight`, ...) in `family`, `None` for one the family does not have.
pub fn hf_block_suffix(family: Family, gguf: &str) -> Option<String> {
    let (stem, kind) = gguf.rsplit_once('.')?;
    if let Some((hf, _)) = LINEARS.iter().find(|(_, g)| *g == stem) {
        let biased = family.switches().qkv_bias && ["attn_q", "attn_k", "attn_v"].contains(&stem);
        return match kind {
            "weight" => Some(format!("{hf}.weight")),
            "bias" if biased => Some(format!("{hf}.bias")),
            _ => None,
        };
    }
    family
        .block_norms()
        .iter()
        .find(|(_, g, _)| *g == gguf)
        .map(|(hf, _, _)| hf.to_string())
}
