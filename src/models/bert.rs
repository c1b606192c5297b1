//! A BERT encoder (Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers")
//! built from wick's fused, differentiable ops, with the parameter names of transformers'
//! `BertModel` (no `bert.` prefix: `embeddings.word_embeddings.weight`,
//! `encoder.layer.{i}.attention.self.query.weight`, ...), so that a pretrained
//! `model.safetensors` loads as is ([`super::bert_io`]).
//!
//! Per layer (post-LayerNorm, as BERT):
//! ```text
//! a = LayerNorm(x + Wo · attention(Wq x, Wk x, Wv x; key padding))     attention.output.LayerNorm
//! y = LayerNorm(a + W2 · gelu_erf(W1 a))                                 output.LayerNorm
//! ```
//! Each sub-block is one node under the engine's backward, [`crate::ops::post_norm_block`]:
//! the attention one with [`crate::ops::key_padding_attention`] inside (scores materialised:
//! the key-padding, non-causal attention at MiniLM's head width 32 has no flash kernel), the
//! feed-forward one with [`crate::ops::gelu_linear`], which keeps `W1 a` but not its GELU
//! (recomputed in the backward).
//! The embeddings are `word[ids] + position[0..T] + token_type[0]`, then LayerNorm. The
//! residual stream is f32; the matmuls run in the compute dtype (bf16 under bf16-mixed), the
//! norms and the softmax in f32 ([`crate::precision`]). Attention is the masked composition
//! `softmax(q kᵀ / sqrt(Dh) + mask) v`, with the key-padding mask fused into the softmax
//! ([`crate::ops::key_padding_softmax_last_dim`]): no mask tensor, exact zeros on padded keys.
//! No dropout (the fine-tuning here runs without it; transformers' defaults are 0.1).
//!
//! Every op here has its own backward, so every parameter gets a gradient; candle-transformers'
//! `BertModel` on [`ParamStore::var_builder`] gets none (candle-nn's fused LayerNorm is
//! forward-only; `tests/bert.rs` pins that list).

use crate::nn::{LayerNorm, Linear};
use crate::ops;
use crate::params::{ParamStore, Role};
use crate::precision::to_f32;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Module, Tensor, D};
use candle_nn::Init;
use std::path::Path;
use std::sync::Arc;

/// The fields of a BERT `config.json` that the encoder uses (transformers' `BertConfig`
/// names); unknown fields are ignored.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BertConfig {
    /// Vocabulary size (rows of `embeddings.word_embeddings.weight`).
    pub vocab_size: usize,
    /// Width of the hidden states, `C`.
    pub hidden_size: usize,
    /// Number of encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer; `hidden_size` must be a multiple.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Rows of the position table: the longest input, in tokens.
    pub max_position_embeddings: usize,
    /// Rows of the token-type table (2 for BERT; only type 0 is used).
    pub type_vocab_size: usize,
    /// LayerNorm epsilon (1e-12 for BERT).
    pub layer_norm_eps: f64,
    /// Activation; only `"gelu"` (the exact, erf form) is supported.
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Id of the padding token.
    #[serde(default)]
    pub pad_token_id: u32,
    /// The file's other fields (dropout rates, `initializer_range`, ...), kept so that a saved
    /// `config.json` says what the loaded one said.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

fn default_act() -> String {
    "gelu".to_string()
}

impl BertConfig {
    /// Reads `config.json` (transformers' format).
    ///
    /// Errors: an unreadable file, malformed JSON or a missing field (named), or a config that
    /// fails [`Self::validate`].
    pub fn from_json_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the BERT config {}", path.display()))?;
        let c: Self = serde_json::from_str(&text)
            .with_context(|| format!("parsing the BERT config {}", path.display()))?;
        c.validate()
            .with_context(|| format!("the BERT config {}", path.display()))?;
        Ok(c)
    }

    /// A 2-layer, 32-wide config (4 heads, vocabulary 64, 16 positions) for tests.
    pub fn tiny() -> Self {
        Self {
            vocab_size: 64,
            hidden_size: 32,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            intermediate_size: 64,
            max_position_embeddings: 16,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            hidden_act: default_act(),
            pad_token_id: 0,
            other: serde_json::Map::new(),
        }
    }

    /// Checks that the sizes are positive and consistent.
    ///
    /// Errors: a zero size, `hidden_size % num_attention_heads != 0`, an activation other than
    /// `"gelu"`, or a non-positive epsilon.
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("type_vocab_size", self.type_vocab_size),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            bail!("BertConfig: {name} is 0; it must be positive");
        }
        if self.hidden_size % self.num_attention_heads != 0 {
            bail!(
                "BertConfig: hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size,
                self.num_attention_heads
            );
        }
        if self.hidden_act != "gelu" {
            bail!(
                "BertConfig: hidden_act {:?} is not supported; wick's BERT implements \"gelu\" \
                 (the exact erf form)",
                self.hidden_act
            );
        }
        if self.layer_norm_eps.is_nan() || self.layer_norm_eps <= 0.0 {
            bail!(
                "BertConfig: layer_norm_eps {} must be > 0",
                self.layer_norm_eps
            );
        }
        Ok(())
    }
}

/// A batch of token ids padded on the right: `ids: (B, T)` u32 on the model's device and the
/// number of real tokens of each row (`1..=T`, `[CLS]` and `[SEP]` included).
#[derive(Debug, Clone)]
pub struct PaddedBatch {
    /// `(B, T)` u32 token ids; positions at or after a row's length hold padding.
    pub ids: Tensor,
    /// Real tokens per row.
    pub lengths: Vec<usize>,
}

impl PaddedBatch {
    /// Pads `rows` (token ids) with `pad` to the longest row rounded up to a multiple of
    /// `multiple` (8 keeps the set of shapes small for cuBLAS and torch.compile alike) and
    /// puts them on `device`.
    ///
    /// Errors: no rows, an empty row, or `multiple == 0`.
    pub fn new(
        rows: &[Vec<u32>],
        pad: u32,
        multiple: usize,
        device: &candle_core::Device,
    ) -> Result<Self> {
        if rows.is_empty() || multiple == 0 {
            bail!("PaddedBatch: need at least one row and multiple >= 1");
        }
        if let Some(i) = rows.iter().position(Vec::is_empty) {
            bail!("PaddedBatch: row {i} has no tokens");
        }
        let longest = rows.iter().map(Vec::len).max().unwrap_or(1);
        let t = longest.div_ceil(multiple) * multiple;
        let mut flat = Vec::with_capacity(rows.len() * t);
        for r in rows {
            flat.extend_from_slice(r);
            flat.resize(flat.len() + t - r.len(), pad);
        }
        Ok(Self {
            ids: Tensor::from_vec(flat, (rows.len(), t), device)?,
            lengths: rows.iter().map(Vec::len).collect(),
        })
    }
}

struct Layer {
    /// attention heads
    heads: usize,
    /// query, key, value weights `(C, C)` and biases `(C,)`: three parameters each (the
    /// checkpoint's names), concatenated in the forward into one `(3C, C)` GEMM
    qkv_weights: Vec<Tensor>,
    qkv_biases: Vec<Tensor>,
    attn_out: Linear,
    attn_norm: LayerNorm,
    ffn_in: Linear,
    ffn_out: Linear,
    ffn_norm: LayerNorm,
}

/// The encoder. Build it with [`Bert::new`] (embeddings and query/key/value drawn from
/// BERT's `N(0, 0.02)`, the other linears from [`crate::nn::Linear`]'s PyTorch default, norms
/// at 1 and 0) and load pretrained weights into its store with
/// [`super::bert_io::load_pretrained`].
pub struct Bert {
    config: BertConfig,
    /// the tables are fp32 masters differentiated directly (as PyTorch's autocast, which
    /// leaves `embedding` in fp32): no bf16 working copy, and their gradients are f32 as
    /// computed (the word table is half the model)
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    embed_norm: LayerNorm,
    /// shared with the recomputed segments' closures ([`Bert::set_recompute`])
    layers: Vec<Arc<Layer>>,
    recompute: Recompute,
}

/// What the encoder recomputes in the backward instead of keeping from the forward
/// (activation checkpointing, [`crate::recompute`]). Either way the loss and every gradient are
/// the same: the recomputation runs the same ops on the same inputs (the encoder has no
/// dropout). A step's peak memory per mode for all-MiniLM-L6-v2 (batch 64 x 32 tokens,
/// bf16-mixed, measured on the CPU by `examples/bert_memory.rs`): off 647 MB, attention 534,
/// layer 469.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompute {
    /// Keep every activation (no recomputation).
    #[default]
    Off,
    /// Keep only each layer's attention sub-block input `(B, T, C)` f32 and output; recompute
    /// the sub-block (the q/k/v projection, the scores and probabilities `(B, H, T, T)`, the
    /// output projection, the residual add and its LayerNorm) in the backward. A selective
    /// recomputation in the sense of Korthikanti et al. 2022 ("Reducing Activation
    /// Recomputation in Large Transformer Models", arXiv:2205.05198), who recompute only the
    /// attention core; here the projections are recomputed too, because at BERT's short
    /// sequences their outputs are most of the sub-block's memory. Cost: a third of the
    /// encoder's forward GEMMs once more.
    Attention,
    /// Keep only each layer's input; recompute the whole layer (Chen et al. 2016, "Training
    /// Deep Nets with Sublinear Memory Cost", arXiv:1604.06174; PyTorch's
    /// `gradient_checkpointing_enable`). Cost: one more forward of every layer.
    Layer,
}

impl std::str::FromStr for Recompute {
    type Err = anyhow::Error;

    /// `off`, `attention` or `layer`.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "off" => Ok(Self::Off),
            "attention" => Ok(Self::Attention),
            "layer" => Ok(Self::Layer),
            _ => bail!("unknown recomputation {s:?}: use off, attention or layer"),
        }
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::Attention => "attention",
            Self::Layer => "layer",
        })
    }
}

/// A parameter drawn from BERT's initialisation, `N(0, 0.02)`.
fn normal(store: &ParamStore, name: &str, shape: (usize, usize), role: Role) -> Result<Tensor> {
    let init = Init::Randn {
        mean: 0.0,
        stdev: 0.02,
    };
    store.get_or_init(name, shape, init, role)
}

fn bias(store: &ParamStore, name: String, n: usize) -> Result<Tensor> {
    store.get_or_init(&name, n, Init::Const(0.0), Role::Matmul)
}

impl Bert {
    /// Creates (or reuses) the parameters in `store` under transformers' names.
    ///
    /// Errors: an invalid config; a parameter of the same name with another shape.
    pub fn new(store: &ParamStore, config: BertConfig) -> Result<Self> {
        config.validate()?;
        let c = config.hidden_size;
        let emb = |name: &str, rows: usize| {
            normal(
                store,
                &format!("embeddings.{name}.weight"),
                (rows, c),
                Role::Fp32,
            )
        };
        let word = emb("word_embeddings", config.vocab_size)?;
        let position = emb("position_embeddings", config.max_position_embeddings)?;
        let token_type = emb("token_type_embeddings", config.type_vocab_size)?;
        let eps = config.layer_norm_eps;
        let embed_norm = LayerNorm::new(store, "embeddings.LayerNorm", c, eps)?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("encoder.layer.{i}");
            let lin = |name: &str, i: usize, o: usize| {
                Linear::new(store, &format!("{p}.{name}"), i, o, true)
            };
            let mut qkv_weights = Vec::new();
            let mut qkv_biases = Vec::new();
            for n in ["query", "key", "value"] {
                let name = format!("{p}.attention.self.{n}.weight");
                qkv_weights.push(normal(store, &name, (c, c), Role::Matmul)?);
                qkv_biases.push(bias(store, format!("{p}.attention.self.{n}.bias"), c)?);
            }
            layers.push(Arc::new(Layer {
                heads: config.num_attention_heads,
                qkv_weights,
                qkv_biases,
                attn_out: lin("attention.output.dense", c, c)?,
                attn_norm: LayerNorm::new(
                    store,
                    &format!("{p}.attention.output.LayerNorm"),
                    c,
                    eps,
                )?,
                ffn_in: lin("intermediate.dense", c, config.intermediate_size)?,
                ffn_out: lin("output.dense", config.intermediate_size, c)?,
                ffn_norm: LayerNorm::new(store, &format!("{p}.output.LayerNorm"), c, eps)?,
            }));
        }
        Ok(Self {
            config,
            word,
            position,
            token_type,
            embed_norm,
            layers,
            recompute: Recompute::Off,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    /// Sets what the backward recomputes ([`Recompute`]; [`Recompute::Off`] by default).
    pub fn set_recompute(&mut self, recompute: Recompute) {
        self.recompute = recompute;
    }

    /// What the backward recomputes ([`Self::set_recompute`]).
    pub fn recompute(&self) -> Recompute {
        self.recompute
    }

    /// The last hidden states `(B, T, C)` f32 of `batch` (transformers' `last_hidden_state`).
    /// Rows at padded positions are computed but meaningless (their keys are masked for every
    /// query; pool with [`mean_pool`]).
    ///
    /// Errors: `T` above `max_position_embeddings`, ids not u32, lengths outside `1..=T`.
    pub fn forward(&self, batch: &PaddedBatch) -> Result<Tensor> {
        let (b, t) = batch.ids.dims2()?;
        if t > self.config.max_position_embeddings {
            bail!(
                "Bert::forward: {t} positions, the model has {}; truncate the inputs",
                self.config.max_position_embeddings
            );
        }
        let dev = batch.ids.device();
        let positions = Tensor::arange(0u32, t as u32, dev)?
            .unsqueeze(0)?
            .repeat((b, 1))?;
        let types = Tensor::zeros((b, t), DType::U32, dev)?;
        let mut x = ops::embedding(&batch.ids, &self.word)?;
        x = ops::residual_add(&x, &ops::embedding(&positions, &self.position)?)?;
        x = ops::residual_add(&x, &ops::embedding(&types, &self.token_type)?)?;
        x = self.embed_norm.forward(&x)?;
        for layer in &self.layers {
            x = match self.recompute {
                Recompute::Off => layer.forward(&x, &batch.lengths)?,
                Recompute::Attention => {
                    let a = recomputed(
                        layer,
                        &x,
                        &batch.lengths,
                        Layer::attention_block,
                        layer.attention_tensors(),
                    )?;
                    layer.feed_forward_block(&a)?
                }
                Recompute::Layer => {
                    recomputed(layer, &x, &batch.lengths, Layer::forward, layer.tensors())?
                }
            };
        }
        Ok(x)
    }
}

/// `block` of `layer` (its forward or its attention sub-block) on `x` under
/// [`crate::recompute::checkpoint`]: its intermediates are recomputed in the backward.
/// `tensors` are the parameters the block reads.
fn recomputed(
    layer: &Arc<Layer>,
    x: &Tensor,
    lengths: &[usize],
    block: fn(&Layer, &Tensor, &[usize]) -> Result<Tensor>,
    tensors: Vec<Tensor>,
) -> Result<Tensor> {
    let (l, lengths) = (layer.clone(), lengths.to_vec());
    let segment: crate::recompute::SegmentFn = Arc::new(move |x: &Tensor| {
        block(&l, x, &lengths).map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
    });
    Ok(crate::recompute::checkpoint(x, &tensors, segment)?)
}

impl Layer {
    /// Every tensor the layer's forward reads (for [`crate::recompute::checkpoint`]: one left
    /// out would get no gradient under checkpointing).
    fn tensors(&self) -> Vec<Tensor> {
        let mut out = self.attention_tensors();
        for lin in [&self.ffn_in, &self.ffn_out] {
            out.push(lin.weight().clone());
            out.extend(lin.bias().cloned());
        }
        out.extend([self.ffn_norm.weight().clone(), self.ffn_norm.bias().clone()]);
        out
    }

    /// `x: (B, T, C)` f32 → `(B, T, C)` f32, contiguous.
    fn forward(&self, x: &Tensor, lengths: &[usize]) -> Result<Tensor> {
        self.feed_forward_block(&self.attention_block(x, lengths)?)
    }

    /// Every tensor [`Self::attention_block`] reads.
    fn attention_tensors(&self) -> Vec<Tensor> {
        let mut out = self.qkv_weights.clone();
        out.extend(self.qkv_biases.iter().cloned());
        out.push(self.attn_out.weight().clone());
        out.extend(self.attn_out.bias().cloned());
        out.extend([
            self.attn_norm.weight().clone(),
            self.attn_norm.bias().clone(),
        ]);
        out
    }

    /// The attention sub-block, `a = LayerNorm(x + Wo · attention(..))`: `x: (B, T, C)` f32 →
    /// `(B, T, C)` f32, one graph node under the engine's backward ([`ops::post_norm_block`]:
    /// the q/k/v projection as one GEMM of the stacked weights, [`ops::key_padding_attention`],
    /// the output projection).
    fn attention_block(&self, x: &Tensor, lengths: &[usize]) -> Result<Tensor> {
        let layers = [
            ops::Layer::Linear {
                parts: &self.qkv_weights,
                b: &self.qkv_biases,
            },
            ops::Layer::PaddedAttention {
                n_head: self.heads,
                key_lengths: lengths,
            },
            ops::Layer::Linear {
                parts: std::slice::from_ref(self.attn_out.weight()),
                b: std::slice::from_ref(linear_bias(&self.attn_out)?),
            },
        ];
        Ok(ops::post_norm_block(
            x,
            &layers,
            &self.attn_norm.norm_params(),
        )?)
    }

    /// The feed-forward sub-block, `LayerNorm(a + W2 · gelu_erf(W1 a))`: `(B, T, C)` f32 →
    /// `(B, T, C)` f32, one graph node under the engine's backward ([`ops::post_norm_block`]).
    /// The GELU output is recomputed in the backward, not kept ([`ops::gelu_linear`]).
    fn feed_forward_block(&self, a: &Tensor) -> Result<Tensor> {
        let layers = [
            ops::Layer::Linear {
                parts: std::slice::from_ref(self.ffn_in.weight()),
                b: std::slice::from_ref(linear_bias(&self.ffn_in)?),
            },
            ops::Layer::ActLinear {
                w: self.ffn_out.weight(),
                b: linear_bias(&self.ffn_out)?,
                act: ops::Activation::GeluErf,
            },
        ];
        Ok(ops::post_norm_block(
            a,
            &layers,
            &self.ffn_norm.norm_params(),
        )?)
    }
}

/// The bias of a BERT linear layer (every one has one).
fn linear_bias(l: &Linear) -> Result<&Tensor> {
    l.bias()
        .context("BERT layer: a linear layer has no bias (internal error)")
}

/// Mean of `hidden: (B, T, C)` over each row's first `lengths[b]` positions, `(B, C)` f32
/// (sentence-transformers' mean pooling with the attention mask). Differentiable.
///
/// Errors: `lengths.len() != B` or a length outside `1..=T`.
pub fn mean_pool(hidden: &Tensor, lengths: &[usize]) -> Result<Tensor> {
    let (b, t, _) = hidden.dims3()?;
    if lengths.len() != b || lengths.iter().any(|&l| l == 0 || l > t) {
        bail!(
            "mean_pool: {} lengths for {b} rows of {t} positions; each must be in 1..={t}",
            lengths.len()
        );
    }
    let mut mask = Vec::with_capacity(b * t);
    for &l in lengths {
        mask.extend((0..t).map(|j| if j < l { 1f32 / l as f32 } else { 0.0 }));
    }
    let mask = Tensor::from_vec(mask, (b, t, 1), hidden.device())?;
    Ok(to_f32(hidden)?.broadcast_mul(&mask)?.sum(1)?)
}

/// L2-normalises the rows of `x: (B, C)` (sentence-transformers' `Normalize` module).
pub fn l2_normalize(x: &Tensor) -> Result<Tensor> {
    let norm = x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?;
    Ok(x.broadcast_div(&norm)?)
}

/// A classification head on the mean-pooled encoder output: `logits = pooled Wᵀ + b`,
/// `W: (classes, C)`, parameters `{name}.weight` and `{name}.bias`, both zero-initialised
/// (the first step's logits are uniform; the PyTorch reference starts the same way).
pub struct ClassifierHead {
    weight: Tensor,
    bias: Tensor,
}

impl ClassifierHead {
    /// Creates (or reuses) the head's parameters.
    pub fn new(store: &ParamStore, name: &str, hidden: usize, classes: usize) -> Result<Self> {
        let w = store.get_or_init(
            &format!("{name}.weight"),
            (classes, hidden),
            Init::Const(0.0),
            Role::Matmul,
        )?;
        let b = store.get_or_init(
            &format!("{name}.bias"),
            classes,
            Init::Const(0.0),
            Role::Matmul,
        )?;
        Ok(Self { weight: w, bias: b })
    }

    /// `pooled: (B, C)` → logits `(B, classes)` in the compute dtype.
    pub fn forward(&self, pooled: &Tensor) -> Result<Tensor> {
        Ok(ops::linear(pooled, &self.weight, Some(&self.bias))?)
    }
}

/// Mean cross-entropy of `logits: (B, classes)` against `labels` (host class indices).
pub fn classification_loss(logits: &Tensor, labels: &[u32]) -> Result<Tensor> {
    let y = Tensor::new(labels, logits.device())?;
    Ok(ops::cross_entropy_rows(logits, &y)?.mean_all()?)
}
