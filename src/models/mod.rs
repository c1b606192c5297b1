//! Reference models built on wick's layers, shared by the examples, the `wick bench` command
//! and the tests.
//!
//! - [`gpt`]: a GPT-2-style decoder ([`Gpt`], configurations [`GptConfig::gptmini`] and
//!   [`GptConfig::gpt2_124m`]), matching `scripts/reference/torch_reference.py`.
//! - [`bert`]: a BERT encoder ([`Bert`]) with transformers' parameter names, a mean-pooling
//!   classification head; [`bert_io`] loads and saves pretrained safetensors
//!   (all-MiniLM-L6-v2 in `examples/finetune_bert.rs`).
//! - [`decoder`]: the shared decoder ([`Decoder`]) of the Llama, Mistral, Qwen2, Qwen3 and
//!   Gemma 3 families ([`family`]: each a config plus switches over one block), with
//!   transformers' names, full or LoRA fine-tuning and a KV cache; [`config`] its
//!   `config.json`, [`files`] reads GGUF and HF safetensors and writes HF folders,
//!   [`tokenizer`] the GGUF's byte-level BPE tokenizer and chat template (SmolLM2-135M in
//!   `examples/finetune.rs`), [`spm_tokenizer`] Gemma's SentencePiece vocabulary from
//!   GGUF (Gemma 3 270M, scripts/fetch_gemma3.sh).

pub mod bert;
pub mod bert_io;
mod block;
pub mod causal_lm;
pub mod config;
pub mod decoder;
pub mod family;
pub mod files;
pub mod gpt;
pub mod paged;
pub(crate) mod sampling;
#[cfg(feature = "tokenizers")]
pub mod spm_tokenizer;
#[cfg(feature = "tokenizers")]
pub mod tokenizer;

pub use bert::{Bert, BertConfig};
pub use causal_lm::{CausalLm, Source};
pub use config::DecoderConfig;
pub use decoder::{Decoder, DecoderWeights, FineTune, KvCache, PagedBatchEntry};
pub use gpt::{Gpt, GptConfig};
pub use paged::{BlockTable, OutOfBlocks, PagedKvCache};
