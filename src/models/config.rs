//! The configuration of the shared decoder, by transformers' field names (what an HF
//! `config.json` of a Llama, Mistral, Qwen2, Qwen3 or Gemma 3 text model holds), and the names
//! of its tensors.
//!
//! Nothing in a `config.json` that changes the computation is ignored: RoPE scaling of type
//! `linear` and `llama3` is implemented ([`RopeScaling`]), and so are the families' switches
//! ([`super::family`]: sliding windows, head widths, Gemma's local RoPE base and
//! `query_pre_attn_scalar`); every other key is either on a list of keys known not to change
//! the math ([`HARMLESS_KEYS`]), checked to hold the value the family implements
//! (`hidden_act`, `attention_bias`, soft-capping null, ...), or refused with an error naming
//! it.

use super::family::{Family, LayerType, NormWidth, LINEARS};
use anyhow::{bail, Context, Result};
use std::path::Path;

/// The fields of a `config.json` the decoder uses (transformers' names);
/// the file's other fields are kept in `other`, so that a saved config says what the loaded
/// one said.
///
/// Deserializing (from any source, not only [`Self::from_json_file`]) reads transformers 5's
/// `rope_parameters` object into [`Self::rope_theta`] and [`Self::rope_scaling`], refusing one
/// that contradicts them; serializing writes them as `rope_theta` and `rope_scaling`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(remote = "Self")]
pub struct DecoderConfig {
    /// The family (`model_type`; absent: `llama`): the switches of the shared block.
    #[serde(default)]
    pub model_type: Family,
    /// Vocabulary size (rows of `model.embed_tokens.weight`).
    pub vocab_size: usize,
    /// Width of the residual stream, `C`.
    pub hidden_size: usize,
    /// Width of the SwiGLU hidden layer, `F`.
    pub intermediate_size: usize,
    /// Number of decoder blocks.
    pub num_hidden_layers: usize,
    /// Query heads `H`; `hidden_size` must be a multiple.
    pub num_attention_heads: usize,
    /// Key/value heads `Hkv` (grouped-query attention); `H` must be a multiple.
    pub num_key_value_heads: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base θ (10000 for Llama 2, 100000 for SmolLM2).
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// RoPE frequency scaling (transformers' `rope_scaling`; `None`: the default RoPE).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "deserialize_rope_scaling"
    )]
    pub rope_scaling: Option<RopeScaling>,
    /// The longest sequence the model was trained for, in tokens.
    pub max_position_embeddings: usize,
    /// Width of one head, when not `hidden_size / num_attention_heads` (Qwen3: 128 at hidden
    /// 1024 and 16 heads; Gemma 3 270M: 256 at hidden 640 and 4 heads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// The sliding window in tokens: a query at position `p` sees keys `j` with
    /// `p - W < j <= p` (transformers' mask) in the layers [`Self::layer_window`] names.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "deserialize_sliding_window"
    )]
    pub sliding_window: Option<usize>,
    /// Per layer, sliding or full attention (Gemma 3, transformers 5's Qwen): overrides the
    /// family's default pattern.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_types: Option<Vec<LayerType>>,
    /// Gemma 3: the RoPE base of the sliding layers (10000); the full layers use
    /// [`Self::rope_theta`] and [`Self::rope_scaling`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_local_base_freq: Option<f64>,
    /// Gemma 3: attention scores are scaled by `query_pre_attn_scalar^-1/2` instead of
    /// `head_dim^-1/2`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query_pre_attn_scalar: Option<f64>,
    /// The head reuses the token embedding (`lm_head.weight` absent).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token id.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token id, or several (Llama 3.1 / 3.2 Instruct list
    /// `[128001, 128008, 128009]`); generation stops at any of them.
    #[serde(default, deserialize_with = "deserialize_eos_token_id")]
    pub eos_token_id: Option<TokenIds>,
    /// The file's other fields.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

fn default_rope_theta() -> f64 {
    10000.0
}

impl serde::Serialize for DecoderConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        DecoderConfig::serialize(self, s)
    }
}

impl<'de> serde::Deserialize<'de> for DecoderConfig {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error;
        let mut map = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
        take_rope_parameters(&mut map).map_err(|e| D::Error::custom(format!("{e:#}")))?;
        // Gemma3TextConfig defaults tie_word_embeddings to true (and saved configs omit it);
        // the other families' default is false
        if map.get("model_type").and_then(|v| v.as_str()) == Some("gemma3_text") {
            map.entry("tie_word_embeddings").or_insert(true.into());
        }
        DecoderConfig::deserialize(serde_json::Value::Object(map)).map_err(D::Error::custom)
    }
}

/// transformers 5 writes `rope_theta` and `rope_scaling` as one `rope_parameters` object:
/// moves it into the `rope_theta` and `rope_scaling` keys of a `config.json` object.
///
/// Errors: a `rope_parameters` that is not an object, a RoPE type wick does not implement
/// ([`RopeScaling::from_json`]), a `rope_theta` or `rope_scaling` beside it that differs.
fn take_rope_parameters(map: &mut serde_json::Map<String, serde_json::Value>) -> Result<()> {
    let Some(v) = map.remove("rope_parameters") else {
        return Ok(());
    };
    if v.is_null() {
        return Ok(());
    }
    // Gemma 3 under transformers 5: one object per layer type; the sliding layers' is a plain
    // base (`rope_local_base_freq`), the full layers' the model's RoPE
    let v = match v.get("full_attention") {
        Some(full) => {
            if let Some(local) = v.get("sliding_attention") {
                if RopeScaling::from_json(local)
                    .context("rope_parameters.sliding_attention")?
                    .is_some()
                {
                    bail!(
                        "rope_parameters.sliding_attention {local} scales the sliding layers' \
                         RoPE; wick implements the default RoPE there (Gemma 3's)"
                    );
                }
                if let Some(theta) = local.get("rope_theta") {
                    map.insert("rope_local_base_freq".into(), theta.clone());
                }
            }
            if let Some(k) = v.as_object().and_then(|o| {
                o.keys()
                    .find(|k| *k != "full_attention" && *k != "sliding_attention")
            }) {
                bail!("rope_parameters: layer type {k:?} is not implemented");
            }
            full.clone()
        }
        None => v,
    };
    let scaling = RopeScaling::from_json(&v).context("rope_parameters")?;
    let given = match map.get("rope_scaling") {
        None | Some(serde_json::Value::Null) => None,
        Some(r) => Some(RopeScaling::from_json(r).context("rope_scaling")?),
    };
    if given.as_ref().is_some_and(|g| *g != scaling) {
        bail!(
            "rope_parameters {v} contradicts rope_scaling {}; keep one of them",
            map["rope_scaling"]
        );
    }
    if let Some(theta) = v.get("rope_theta") {
        let t = theta
            .as_f64()
            .with_context(|| format!("rope_parameters {v}: rope_theta is not a number"))?;
        if let Some(top) = map.get("rope_theta") {
            if top.as_f64() != Some(t) {
                bail!(
                    "rope_theta {top} contradicts rope_parameters.rope_theta {theta}; keep one \
                     of them"
                );
            }
        }
        map.insert("rope_theta".into(), theta.clone());
    }
    map.insert(
        "rope_scaling".into(),
        scaling.map_or(serde_json::Value::Null, |s| s.to_json()),
    );
    Ok(())
}

/// One token id or several, written back in the form read (`config.json`'s `eos_token_id`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// A single id (`"eos_token_id": 2`).
    One(u32),
    /// A list (`"eos_token_id": [128001, 128008, 128009]`).
    Many(Vec<u32>),
}

impl TokenIds {
    /// The ids, in the file's order.
    pub fn ids(&self) -> &[u32] {
        match self {
            Self::One(id) => std::slice::from_ref(id),
            Self::Many(ids) => ids,
        }
    }

    /// Whether `id` is one of them.
    pub fn contains(&self, id: u32) -> bool {
        self.ids().contains(&id)
    }
}

fn deserialize_sliding_window<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<usize>, D::Error> {
    use serde::Deserialize;
    match Option::<serde_json::Value>::deserialize(d)? {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(w) => Ok(Some(w as usize)),
            None => Err(serde::de::Error::custom(format!(
                "sliding_window = {v} is neither null nor a number of tokens; write null (no \
                 window) or the window's length"
            ))),
        },
    }
}

fn deserialize_eos_token_id<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<TokenIds>, D::Error> {
    use serde::Deserialize;
    match Option::<serde_json::Value>::deserialize(d)? {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => TokenIds::deserialize(&v).map(Some).map_err(|_| {
            serde::de::Error::custom(format!(
                "eos_token_id {v} is neither a token id nor a list of token ids (u32)"
            ))
        }),
    }
}

/// RoPE frequency scaling, as transformers' `modeling_rope_utils` computes it (the inverse
/// frequencies `inv_freq[i] = rope_theta^(-2i / D)` rescaled; the attention factor stays 1).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `rope_type: "linear"` (position interpolation): every inverse frequency divided by
    /// `factor`, i.e. positions divided by it (`_compute_linear_scaling_rope_parameters`).
    Linear {
        /// The divisor (`>= 1` in practice; must be `> 0`).
        factor: f64,
    },
    /// `rope_type: "llama3"` (Llama 3.1 / 3.2 / 3.3), transformers'
    /// `_compute_llama3_parameters` and candle-transformers 0.11.1's `llama::Cache::new`:
    /// with `wavelen = 2π / inv_freq`, `low = original / low_freq_factor` and
    /// `high = original / high_freq_factor`, a frequency is kept when `wavelen < high`,
    /// divided by `factor` when `wavelen > low`, and in between interpolated:
    /// `(1 - s) inv_freq / factor + s inv_freq` with
    /// `s = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)`.
    /// llama.cpp stores the same scaling in a GGUF as the `rope_freqs.weight` tensor of
    /// per-frequency divisors (`convert_hf_to_gguf.py`, `LlamaModel.generate_extra_tensors`).
    Llama3 {
        /// Divisor of the low frequencies (8 for Llama 3.1, 32 for Llama 3.2).
        factor: f64,
        /// Wavelengths above `original / low_freq_factor` are divided by `factor` (1).
        low_freq_factor: f64,
        /// Wavelengths below `original / high_freq_factor` are kept (4).
        high_freq_factor: f64,
        /// The context length the model was pretrained with (8192).
        original_max_position_embeddings: usize,
    },
}

impl RopeScaling {
    /// Reads a `rope_scaling` (or transformers 5's `rope_parameters`) object: `None` for
    /// `rope_type` `"default"`, an error naming the type for any type wick does not implement
    /// (`yarn`, `dynamic`, `longrope`, `su`, ...), and for a missing, mistyped or unknown
    /// field. `rope_theta` inside the object is skipped (the caller reads it).
    pub fn from_json(v: &serde_json::Value) -> Result<Option<Self>> {
        let map = v
            .as_object()
            .with_context(|| format!("rope_scaling {v} is not an object"))?;
        let kind = map
            .get("rope_type")
            .or_else(|| map.get("type"))
            .and_then(|t| t.as_str())
            .with_context(|| format!("rope_scaling {v} has no \"rope_type\" string"))?;
        let num = |k: &str| -> Result<f64> {
            let x = map
                .get(k)
                .and_then(|x| x.as_f64())
                .with_context(|| format!("rope_scaling {v}: {k:?} is missing or not a number"))?;
            if !(x.is_finite() && x > 0.0) {
                bail!("rope_scaling {v}: {k:?} is {x}; it must be a finite number > 0");
            }
            Ok(x)
        };
        let (scaling, fields): (Option<Self>, &[&str]) = match kind {
            "default" => (None, &[]),
            "linear" => (
                Some(Self::Linear {
                    factor: num("factor")?,
                }),
                &["factor"],
            ),
            "llama3" => {
                let (low, high) = (num("low_freq_factor")?, num("high_freq_factor")?);
                if high <= low {
                    bail!(
                        "rope_scaling {v}: high_freq_factor {high} must exceed low_freq_factor {low}"
                    );
                }
                let original = num("original_max_position_embeddings")?;
                if original.fract() != 0.0 {
                    bail!("rope_scaling {v}: original_max_position_embeddings must be an integer");
                }
                let fields: &[&str] = &[
                    "factor",
                    "low_freq_factor",
                    "high_freq_factor",
                    "original_max_position_embeddings",
                ];
                (
                    Some(Self::Llama3 {
                        factor: num("factor")?,
                        low_freq_factor: low,
                        high_freq_factor: high,
                        original_max_position_embeddings: original as usize,
                    }),
                    fields,
                )
            }
            other => bail!(
                "rope_scaling type {other:?} ({v}) is not implemented: wick implements \"linear\" \
                 and \"llama3\" RoPE scaling and refuses the others (yarn, dynamic, longrope, su, \
                 ...) rather than computing another model's positions"
            ),
        };
        let known =
            |k: &str| ["rope_type", "type", "rope_theta"].contains(&k) || fields.contains(&k);
        if let Some(k) = map.keys().find(|k| !known(k)) {
            bail!(
                "rope_scaling {v}: field {k:?} is not part of {kind:?} scaling as wick implements \
                 it; remove it if it does not change the frequencies"
            );
        }
        Ok(scaling)
    }

    /// The `config.json` form (transformers' field names).
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Self::Linear { factor } => {
                serde_json::json!({ "rope_type": "linear", "factor": factor })
            }
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => serde_json::json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
        }
    }

    /// Rescales the default inverse frequencies `inv_freq` (see the variants).
    pub fn apply(&self, inv_freq: &[f64]) -> Vec<f64> {
        match *self {
            Self::Linear { factor } => inv_freq.iter().map(|f| f / factor).collect(),
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let original = original_max_position_embeddings as f64;
                let (low_wavelen, high_wavelen) =
                    (original / low_freq_factor, original / high_freq_factor);
                inv_freq
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let s = (original / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - s) * f / factor + s * f
                        }
                    })
                    .collect()
            }
        }
    }
}

impl serde::Serialize for RopeScaling {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

fn deserialize_rope_scaling<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<RopeScaling>, D::Error> {
    use serde::Deserialize;
    match Option::<serde_json::Value>::deserialize(d)? {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => {
            RopeScaling::from_json(&v).map_err(|e| serde::de::Error::custom(format!("{e:#}")))
        }
    }
}

/// `config.json` keys that do not change the decoder's computation (bookkeeping, generation
/// and serialisation settings, initialisation): accepted and kept in [`DecoderConfig::other`].
/// SmolLM2's, Llama 3.x's and Mistral's `config.json` hold only these, the fields of
/// [`DecoderConfig`] and the keys [`DecoderConfig::validate`] checks by value.
pub const HARMLESS_KEYS: &[&str] = &[
    "_name_or_path",
    "architectures",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "initializer_range",
    "pad_token_id",
    // transformers ignores it since 4.36 except to split the matmuls into equal slices
    "pretraining_tp",
    // SmolLM2: nanotron's marker
    "is_llama_config",
    "transformers.js_config",
    "tokenizer_class",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "unsloth_fixed",
    // transformers' generate(): which KV cache class to build (Gemma 3: "hybrid")
    "cache_implementation",
    "unsloth_version",
];

impl DecoderConfig {
    /// Reads an HF `config.json`.
    ///
    /// Errors: an unreadable file, malformed JSON, a missing field (named), or a config that
    /// fails [`Self::validate`] (the key and the file named).
    pub fn from_json_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the model config {}", path.display()))?;
        let c: Self = serde_json::from_str(&text)
            .with_context(|| format!("parsing the model config {}", path.display()))?;
        c.validate()
            .with_context(|| format!("the model config {}", path.display()))?;
        Ok(c)
    }

    /// A 2-block, 64-wide Llama config (4 query heads, 2 KV heads of width 16, FFN 96,
    /// vocabulary `vocab_size`, 64 positions, tied head) for tests and CPU smoke runs;
    /// [`Self::tiny_family`] for the other families.
    pub fn tiny(vocab_size: usize) -> Self {
        Self {
            model_type: Family::Llama,
            vocab_size,
            hidden_size: 64,
            intermediate_size: 96,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            max_position_embeddings: 64,
            head_dim: None,
            sliding_window: None,
            layer_types: None,
            rope_local_base_freq: None,
            query_pre_attn_scalar: None,
            tie_word_embeddings: true,
            bos_token_id: None,
            eos_token_id: None,
            other: serde_json::Map::new(),
        }
    }

    /// [`Self::tiny`] as `family`, with what makes the family's switches bind at small
    /// sizes: Mistral a window of 5 tokens; Qwen3 and Gemma 3 a head width of 32 (not
    /// hidden / heads); Gemma 3 3 layers (sliding, sliding, full: a pattern of 3), windows of
    /// 5, local RoPE base 10000 and global 1000000, `query_pre_attn_scalar` 24.
    pub fn tiny_family(family: Family, vocab_size: usize) -> Self {
        let mut c = Self {
            model_type: family,
            ..Self::tiny(vocab_size)
        };
        match family {
            Family::Llama | Family::Qwen2 => {}
            Family::Mistral => c.sliding_window = Some(5),
            Family::Qwen3 => c.head_dim = Some(32),
            Family::Gemma3 => {
                c.head_dim = Some(32);
                c.num_hidden_layers = 3;
                c.sliding_window = Some(5);
                c.layer_types = Some(vec![
                    LayerType::Sliding,
                    LayerType::Sliding,
                    LayerType::Full,
                ]);
                c.rope_theta = 1_000_000.0;
                c.rope_local_base_freq = Some(10000.0);
                c.query_pre_attn_scalar = Some(24.0);
                c.rms_norm_eps = 1e-6;
            }
        }
        c
    }

    /// Whether `id` is one of the [`Self::eos_token_id`]s (generation stops after it).
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_id.as_ref().is_some_and(|e| e.contains(id))
    }

    /// Width of one head, `D`: [`Self::head_dim`] when set, else `C / H`.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Columns of the fused query/key/value projection, `(H + 2 Hkv) D`.
    pub fn qkv_dim(&self) -> usize {
        (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim()
    }

    /// Whether layer `i` attends over a sliding window: `layer_types` when given, else the
    /// family's rule (Mistral: every layer when `sliding_window` is set; Qwen2/3: layers
    /// from `max_window_layers` on when `use_sliding_window`; Gemma 3: all but every
    /// `sliding_window_pattern`-th (6), as transformers derives `layer_types`).
    pub fn layer_is_sliding(&self, i: usize) -> bool {
        if let Some(types) = &self.layer_types {
            return types.get(i) == Some(&LayerType::Sliding);
        }
        let num = |k: &str| self.other.get(k).and_then(|v| v.as_u64());
        match self.model_type {
            Family::Llama => false,
            Family::Mistral => self.sliding_window.is_some(),
            Family::Qwen2 | Family::Qwen3 => {
                self.other.get("use_sliding_window") == Some(&serde_json::Value::Bool(true))
                    // transformers' Qwen2Config / Qwen3Config default: 28
                    && i as u64 >= num("max_window_layers").unwrap_or(28)
            }
            Family::Gemma3 => {
                let pattern = num("sliding_window_pattern")
                    .or_else(|| num("_sliding_window_pattern"))
                    .unwrap_or(6)
                    .max(1);
                (i as u64 + 1) % pattern != 0
            }
        }
    }

    /// The window of layer `i` in tokens, `None` for full causal attention.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        self.sliding_window.filter(|_| self.layer_is_sliding(i))
    }

    /// The attention scores' scale when it is not `1/√D` (Gemma 3's
    /// `query_pre_attn_scalar^-1/2`), else `None`.
    pub fn attention_scale(&self) -> Option<f64> {
        self.query_pre_attn_scalar
            .filter(|&s| s != self.head_dim() as f64)
            .map(|s| 1.0 / s.sqrt())
    }

    /// Checks sizes and their consistency, and every key of [`Self::other`] against the
    /// family ([`Self::check_key`]).
    ///
    /// Errors: a zero size; `hidden_size % num_attention_heads != 0` without `head_dim`;
    /// `num_attention_heads % num_key_value_heads != 0`; an odd head width (RoPE rotates
    /// pairs); a non-positive eps or RoPE base; `layer_types` of another length than the
    /// layers or sliding layers without a `sliding_window`; a key that changes the
    /// computation and is not implemented (named).
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("max_position_embeddings", self.max_position_embeddings),
            ("head_dim", self.head_dim.unwrap_or(1)),
            ("sliding_window", self.sliding_window.unwrap_or(1)),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            bail!("DecoderConfig: {name} is 0; it must be positive");
        }
        if self.head_dim.is_none() && self.hidden_size % self.num_attention_heads != 0 {
            bail!(
                "DecoderConfig: hidden_size {} is not a multiple of num_attention_heads {} (and \
                 no head_dim is given)",
                self.hidden_size,
                self.num_attention_heads
            );
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            bail!(
                "DecoderConfig: num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        if self.head_dim() % 2 != 0 {
            bail!(
                "DecoderConfig: head width (head_dim) {} is odd; rotary embeddings rotate pairs of columns",
                self.head_dim()
            );
        }
        let positive = |x: Option<f64>| x.is_none_or(|x| x.is_finite() && x > 0.0);
        if !(self.rms_norm_eps > 0.0
            && positive(Some(self.rope_theta))
            && positive(self.rope_local_base_freq)
            && positive(self.query_pre_attn_scalar))
        {
            bail!(
                "DecoderConfig: rms_norm_eps {}, rope_theta {}, rope_local_base_freq {:?} and \
                 query_pre_attn_scalar {:?} must be finite and > 0",
                self.rms_norm_eps,
                self.rope_theta,
                self.rope_local_base_freq,
                self.query_pre_attn_scalar
            );
        }
        self.check_family_fields()?;
        for (key, value) in &self.other {
            self.check_key(key, value)?;
        }
        Ok(())
    }

    /// The typed fields a family does not implement: Gemma 3's RoPE base and scalar
    /// elsewhere, layer types of the wrong length, sliding layers without a window.
    fn check_family_fields(&self) -> Result<()> {
        let family = self.model_type.model_type();
        if self.model_type != Family::Gemma3 {
            for (key, set) in [
                ("rope_local_base_freq", self.rope_local_base_freq.is_some()),
                (
                    "query_pre_attn_scalar",
                    self.query_pre_attn_scalar.is_some(),
                ),
            ] {
                if set {
                    bail!(
                        "DecoderConfig: {key} is Gemma 3's; model_type {family:?} does not take it"
                    );
                }
            }
        }
        if let Some(types) = &self.layer_types {
            if types.len() != self.num_hidden_layers {
                bail!(
                    "DecoderConfig: layer_types lists {} layers, num_hidden_layers is {}",
                    types.len(),
                    self.num_hidden_layers
                );
            }
        }
        let sliding = (0..self.num_hidden_layers).any(|i| self.layer_is_sliding(i));
        if sliding && self.sliding_window.is_none() {
            bail!("DecoderConfig: layers attend over a sliding window but sliding_window is null");
        }
        if self.model_type == Family::Llama {
            if let Some(w) = self.sliding_window {
                if w < self.max_position_embeddings {
                    bail!(
                        "DecoderConfig: sliding_window {w} is below max_position_embeddings {} in \
                         a \"llama\" config: Llama has no sliding window; if the model was \
                         trained with one (Mistral 7B v0.1), say model_type \"mistral\"",
                        self.max_position_embeddings
                    );
                }
            }
        }
        Ok(())
    }

    /// Accepts a key of [`Self::other`] that is harmless or holds the value the family
    /// implements; refuses any other, naming it.
    fn check_key(&self, key: &str, value: &serde_json::Value) -> Result<()> {
        use serde_json::Value;
        if HARMLESS_KEYS.contains(&key) {
            return Ok(());
        }
        let family = self.model_type;
        let (gemma, qwen) = (
            family == Family::Gemma3,
            matches!(family, Family::Qwen2 | Family::Qwen3),
        );
        let is_false = || matches!(value, Value::Null | Value::Bool(false));
        let is_zero = || value.is_null() || value.as_f64() == Some(0.0);
        let ok = match key {
            "hidden_act" | "hidden_activation" => match family {
                Family::Gemma3 => value.as_str() == Some("gelu_pytorch_tanh"),
                _ => value.as_str() == Some("silu"),
            },
            "attention_bias" => {
                is_false() || (family == Family::Qwen2 && value == &Value::Bool(true))
            }
            "mlp_bias" | "rope_interleaved" | "use_bidirectional_attention" => is_false(),
            "attention_dropout" | "hidden_dropout" => is_zero(),
            "final_logit_softcapping" | "attn_logit_softcapping" => value.is_null(),
            "use_sliding_window" => qwen && value.is_boolean() || is_false(),
            "max_window_layers" => qwen && value.is_u64(),
            "sliding_window_pattern" | "_sliding_window_pattern" => gemma && value.is_u64(),
            _ => bail!(
                "DecoderConfig: unknown key {key:?} = {value}: wick does not know whether it \
                 changes the computation, so it refuses the config rather than ignore it; if \
                 it does not (bookkeeping or generation settings), delete it from config.json"
            ),
        };
        if !ok {
            bail!(
                "DecoderConfig: {key:?} = {value} changes the computation and wick's {} decoder \
                 does not implement it (see wick::models::family for what each family \
                 implements); this model needs another decoder",
                family.model_type()
            );
        }
        Ok(())
    }

    /// The RoPE inverse frequencies of the `D / 2` rotated pairs of layer kind `sliding`:
    /// `base^(-2i / D)` with Gemma 3's local base on its sliding layers (unscaled), else
    /// [`Self::rope_theta`] rescaled by [`Self::rope_scaling`] when set.
    pub fn rope_inv_freq_of(&self, sliding: bool) -> Vec<f64> {
        let d = self.head_dim();
        let local = self.rope_local_base_freq.filter(|_| sliding);
        let base = local.unwrap_or(self.rope_theta);
        let inv: Vec<f64> = (0..d / 2)
            .map(|i| base.powf(-((2 * i) as f64) / d as f64))
            .collect();
        match (&self.rope_scaling, local) {
            (Some(s), None) => s.apply(&inv),
            _ => inv,
        }
    }

    /// The inverse frequencies of the full-attention layers ([`Self::rope_inv_freq_of`]).
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        self.rope_inv_freq_of(false)
    }

    /// The rotary tables `(cos, sin)`, each `(seq_len, D / 2)` f32, of positions
    /// `start..start + seq_len` for the full-attention layers (angles in f64, rounded once):
    /// [`crate::ops::rotary_tables_from_inv_freq`], what [`crate::ops::rotary_qkv`] takes.
    /// Without scaling they equal [`crate::ops::rotary_tables`]'s.
    ///
    /// Errors: `start + seq_len` overflowing, inverse frequencies that are not finite and
    /// positive.
    pub fn rotary_tables(
        &self,
        seq_len: usize,
        start: usize,
        device: &candle_core::Device,
    ) -> Result<(candle_core::Tensor, candle_core::Tensor)> {
        self.rotary_tables_of(false, seq_len, start, device)
    }

    /// [`Self::rotary_tables`] of layer kind `sliding` ([`Self::rope_inv_freq_of`]: Gemma 3's
    /// sliding layers take the local base).
    ///
    /// Errors: as [`Self::rotary_tables`].
    pub fn rotary_tables_of(
        &self,
        sliding: bool,
        seq_len: usize,
        start: usize,
        device: &candle_core::Device,
    ) -> Result<(candle_core::Tensor, candle_core::Tensor)> {
        Ok(crate::ops::rotary_tables_from_inv_freq(
            &self.rope_inv_freq_of(sliding),
            seq_len,
            start,
            device,
        )?)
    }

    /// Every tensor the decoder has, by HF name, with its shape: the token table, per block
    /// the family's norms ([`Family::block_norms`]), the seven linears and Qwen2's q/k/v
    /// biases, the final norm, and `lm_head.weight` unless tied.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (c, f, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let d = self.head_dim();
        let (q, kv) = (self.num_attention_heads * d, self.num_key_value_heads * d);
        let rows = [q, kv, kv, c, f, f, c];
        let cols = [c, c, c, q, c, c, f];
        let family = self.model_type;
        let mut out = vec![(EMBED.to_string(), vec![v, c])];
        for i in 0..self.num_hidden_layers {
            let p = format!("model.layers.{i}");
            for (name, _, width) in family.block_norms() {
                let n = match width {
                    NormWidth::Hidden => c,
                    NormWidth::Head => d,
                };
                out.push((format!("{p}.{name}"), vec![n]));
            }
            for (j, (module, _)) in LINEARS.iter().enumerate() {
                out.push((format!("{p}.{module}.weight"), vec![rows[j], cols[j]]));
                if family.switches().qkv_bias && j < 3 {
                    out.push((format!("{p}.{module}.bias"), vec![rows[j]]));
                }
            }
        }
        out.push((FINAL_NORM.to_string(), vec![c]));
        if !self.tie_word_embeddings {
            out.push((HEAD.to_string(), vec![v, c]));
        }
        out
    }
}

/// HF name of the token table.
pub const EMBED: &str = "model.embed_tokens.weight";
/// HF name of the final RMSNorm gain.
pub const FINAL_NORM: &str = "model.norm.weight";
/// HF name of an untied output head.
pub const HEAD: &str = "lm_head.weight";
