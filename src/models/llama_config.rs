//! The configuration of a Llama-family decoder, by transformers' `LlamaConfig` field names
//! (what an HF `config.json` holds), and the names of its tensors.

use anyhow::{bail, Context, Result};
use std::path::Path;

/// The fields of a Llama `config.json` the decoder uses (transformers' `LlamaConfig` names);
/// the file's other fields are kept in `other`, so that a saved config says what the loaded
/// one said.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LlamaConfig {
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
    /// The longest sequence the model was trained for, in tokens.
    pub max_position_embeddings: usize,
    /// The head reuses the token embedding (`lm_head.weight` absent).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token id.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token id (generation stops there).
    #[serde(default)]
    pub eos_token_id: Option<u32>,
    /// The file's other fields.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

fn default_rope_theta() -> f64 {
    10000.0
}

impl LlamaConfig {
    /// Reads an HF `config.json`.
    ///
    /// Errors: an unreadable file, malformed JSON, a missing field (named), or a config that
    /// fails [`Self::validate`].
    pub fn from_json_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the Llama config {}", path.display()))?;
        let c: Self = serde_json::from_str(&text)
            .with_context(|| format!("parsing the Llama config {}", path.display()))?;
        c.validate()
            .with_context(|| format!("the Llama config {}", path.display()))?;
        Ok(c)
    }

    /// A 2-block, 64-wide config (4 query heads, 2 KV heads of width 16, FFN 96, vocabulary
    /// 96, 64 positions, tied head) for tests and CPU smoke runs.
    pub fn tiny(vocab_size: usize) -> Self {
        Self {
            vocab_size,
            hidden_size: 64,
            intermediate_size: 96,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            max_position_embeddings: 64,
            tie_word_embeddings: true,
            bos_token_id: None,
            eos_token_id: None,
            other: serde_json::Map::new(),
        }
    }

    /// Width of one head, `D = C / H`.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Columns of the fused query/key/value projection, `(H + 2 Hkv) D`.
    pub fn qkv_dim(&self) -> usize {
        (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim()
    }

    /// Checks sizes and their consistency.
    ///
    /// Errors: a zero size; `hidden_size % num_attention_heads != 0`; `num_attention_heads %
    /// num_key_value_heads != 0`; an odd head width (RoPE rotates pairs); a non-positive eps
    /// or RoPE base.
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            bail!("LlamaConfig: {name} is 0; it must be positive");
        }
        if self.hidden_size % self.num_attention_heads != 0 {
            bail!(
                "LlamaConfig: hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size,
                self.num_attention_heads
            );
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            bail!(
                "LlamaConfig: num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        if self.head_dim() % 2 != 0 {
            bail!(
                "LlamaConfig: head width {} is odd; rotary embeddings rotate pairs of columns",
                self.head_dim()
            );
        }
        if !(self.rms_norm_eps > 0.0 && self.rope_theta > 0.0) {
            bail!(
                "LlamaConfig: rms_norm_eps {} and rope_theta {} must be > 0",
                self.rms_norm_eps,
                self.rope_theta
            );
        }
        Ok(())
    }

    /// Every tensor the decoder has, by HF name, with its shape: the token table, per block
    /// the two norms and seven linears, the final norm, and `lm_head.weight` unless tied.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (c, f, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let kv = self.num_key_value_heads * self.head_dim();
        let mut out = vec![(EMBED.to_string(), vec![v, c])];
        for i in 0..self.num_hidden_layers {
            let p = format!("model.layers.{i}");
            for (name, shape) in [
                ("input_layernorm.weight", vec![c]),
                ("self_attn.q_proj.weight", vec![c, c]),
                ("self_attn.k_proj.weight", vec![kv, c]),
                ("self_attn.v_proj.weight", vec![kv, c]),
                ("self_attn.o_proj.weight", vec![c, c]),
                ("post_attention_layernorm.weight", vec![c]),
                ("mlp.gate_proj.weight", vec![f, c]),
                ("mlp.up_proj.weight", vec![f, c]),
                ("mlp.down_proj.weight", vec![c, f]),
            ] {
                out.push((format!("{p}.{name}"), shape));
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
