//! [`CausalLm`]: what the fine-tuning example and the service ask of a causal language model,
//! whatever its family: the training loss, the cached forward, generation, snapshots for
//! serving, the LoRA adapters, and the merged weights. [`super::Decoder`] implements it for
//! every family of [`super::family`]; [`Source`] reads a model's config, weights and
//! tokenizer from a GGUF file or an HF folder, detecting the family.

use super::config::DecoderConfig;
use super::decoder::{Decoder, DecoderWeights, KvCache, PagedBatchEntry};
use super::paged::PagedKvCache;
#[cfg(feature = "tokenizers")]
use super::tokenizer::TextTokenizer;
use crate::data::packing::TrainBatch;
use crate::lora::LoraConfig;
use crate::params::ParamStore;
use anyhow::Result;
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A causal language model as training and serving use it. Shapes: ids `(B, T)` u32; the
/// loss an f32 scalar; logits `(B, T, V)` f32. Errors are `anyhow` errors naming what was
/// wrong (see [`Decoder`]'s methods, which these are).
pub trait CausalLm: Send + Sync + Sized {
    /// The model's configuration (sizes, family, RoPE, windows, special ids).
    fn config(&self) -> &DecoderConfig;
    /// The device its tensors live on.
    fn device(&self) -> &Device;
    /// Mean next-token cross-entropy of `ids` against `targets`, in training mode.
    fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor>;
    /// Mean cross-entropy over the trained targets of a packed or padded chat batch, in
    /// training mode.
    fn batch_loss(&self, batch: &TrainBatch) -> Result<Tensor>;
    /// The same in evaluation mode (no dropout, no gradients).
    fn eval_loss(&self, batch: &TrainBatch) -> Result<Tensor>;
    /// Logits of `ids` at positions `cache.len()..`, extending the cache (prefill or decode).
    fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor>;
    /// A paged KV cache for this model: `num_blocks` blocks of `block_size` positions.
    fn paged_cache(&self, block_size: usize, num_blocks: usize) -> Result<PagedKvCache>;
    /// Next-token logits `(B, V)` f32 of a batch of sequences at their own positions over a
    /// paged cache (continuous batching), extending it.
    fn forward_paged(&self, seqs: &[PagedBatchEntry<'_>], cache: &PagedKvCache) -> Result<Tensor>;
    /// Up to `max_new_tokens` ids after `prompt` (greedy at temperature 0), each handed to
    /// `on_token` as drawn; stops at an end-of-sequence id or when `on_token` returns false.
    fn generate_with(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        temperature: f64,
        seed: u64,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Vec<u32>>;
    /// An inference copy that later training steps do not change.
    fn snapshot(&self) -> Result<Self>;
    /// The LoRA configuration, in LoRA mode.
    fn lora(&self) -> Option<&LoraConfig>;
    /// The adapters as the forward reads them (compute dtype), by PEFT parameter name.
    fn adapter_tensors(&self) -> Vec<(String, Tensor)>;
    /// The adapters' fp32 masters from `store`, by PEFT parameter name.
    fn adapter_masters(&self, store: &ParamStore) -> Result<Vec<(String, Tensor)>>;
    /// An inference copy with other adapters (by PEFT parameter name); the base shared.
    fn with_adapters(&self, tensors: &HashMap<String, Tensor>) -> Result<Self>;
    /// The weights with every LoRA update merged, f32 on the CPU, by HF name.
    fn merged_weights(&self, store: &ParamStore) -> Result<DecoderWeights>;

    /// [`Self::generate_with`] without a callback.
    fn generate(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        temperature: f64,
        seed: u64,
    ) -> Result<Vec<u32>> {
        self.generate_with(prompt, max_new_tokens, temperature, seed, &mut |_| true)
    }
}

impl CausalLm for Decoder {
    fn config(&self) -> &DecoderConfig {
        Decoder::config(self)
    }
    fn device(&self) -> &Device {
        Decoder::device(self)
    }
    fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        Decoder::loss(self, ids, targets)
    }
    fn batch_loss(&self, batch: &TrainBatch) -> Result<Tensor> {
        Decoder::batch_loss(self, batch)
    }
    fn eval_loss(&self, batch: &TrainBatch) -> Result<Tensor> {
        Decoder::eval_loss(self, batch)
    }
    fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        Decoder::forward_cached(self, ids, cache)
    }
    fn paged_cache(&self, block_size: usize, num_blocks: usize) -> Result<PagedKvCache> {
        Decoder::paged_cache(self, block_size, num_blocks)
    }
    fn forward_paged(&self, seqs: &[PagedBatchEntry<'_>], cache: &PagedKvCache) -> Result<Tensor> {
        Decoder::forward_paged(self, seqs, cache)
    }
    fn generate_with(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        temperature: f64,
        seed: u64,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Vec<u32>> {
        Decoder::generate_with(self, prompt, max_new_tokens, temperature, seed, on_token)
    }
    fn snapshot(&self) -> Result<Self> {
        Decoder::snapshot(self)
    }
    fn lora(&self) -> Option<&LoraConfig> {
        Decoder::lora(self)
    }
    fn adapter_tensors(&self) -> Vec<(String, Tensor)> {
        Decoder::adapter_tensors(self)
    }
    fn adapter_masters(&self, store: &ParamStore) -> Result<Vec<(String, Tensor)>> {
        Decoder::adapter_masters(self, store)
    }
    fn with_adapters(&self, tensors: &HashMap<String, Tensor>) -> Result<Self> {
        Decoder::with_adapters(self, tensors)
    }
    fn merged_weights(&self, store: &ParamStore) -> Result<DecoderWeights> {
        Decoder::merged_weights(self, store)
    }
}

/// Where a pretrained model is read from: a GGUF file or an HF folder (`config.json`, one or
/// sharded `*.safetensors`, `tokenizer.json`, `tokenizer_config.json`).
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// A llama.cpp GGUF file (any family of [`super::family`]).
    Gguf(PathBuf),
    /// A transformers folder.
    HfDir(PathBuf),
}

impl Source {
    /// `--gguf FILE` or `--hf DIR`, exactly one of them.
    ///
    /// Errors: both or neither given.
    pub fn from_args(gguf: Option<&Path>, hf: Option<&Path>) -> Result<Self> {
        match (gguf, hf) {
            (Some(g), None) => Ok(Source::Gguf(g.to_path_buf())),
            (None, Some(h)) => Ok(Source::HfDir(h.to_path_buf())),
            (Some(_), Some(_)) => anyhow::bail!("give --gguf FILE or --hf DIR, not both"),
            (None, None) => anyhow::bail!("give the model: --gguf FILE or --hf DIR"),
        }
    }

    /// The file or folder.
    pub fn path(&self) -> &Path {
        match self {
            Source::Gguf(p) | Source::HfDir(p) => p,
        }
    }

    /// The model's configuration (the GGUF's metadata or `config.json`), family detected.
    ///
    /// Errors: an unreadable file, an architecture or key wick does not implement (named).
    pub fn config(&self) -> Result<DecoderConfig> {
        match self {
            Source::Gguf(p) => super::files::Gguf::open(p)?.config(),
            Source::HfDir(d) => DecoderConfig::from_json_file(&d.join("config.json")),
        }
    }

    /// The model's tokenizer and chat template (feature `tokenizers`).
    ///
    /// Errors: as [`TextTokenizer::from_gguf`] / [`TextTokenizer::from_hf_dir`].
    #[cfg(feature = "tokenizers")]
    pub fn tokenizer(&self) -> Result<TextTokenizer> {
        use anyhow::Context;
        match self {
            Source::Gguf(p) => TextTokenizer::from_gguf(&super::files::Gguf::open(p)?),
            Source::HfDir(d) => TextTokenizer::from_hf_dir(d),
        }
        .with_context(|| format!("the tokenizer of {}", self.path().display()))
    }

    /// The weights, f32 on the CPU, by HF name.
    ///
    /// Errors: as [`super::files::read_gguf`] / [`super::files::read_safetensors`].
    pub fn weights(&self) -> Result<DecoderWeights> {
        match self {
            Source::Gguf(p) => super::files::read_gguf(p),
            Source::HfDir(d) => super::files::read_safetensors(d),
        }
    }
}
