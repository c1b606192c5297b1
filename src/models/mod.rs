//! Reference models built on wick's layers, shared by the examples, the `wick bench` command
//! and the tests.
//!
//! - [`gpt`]: a GPT-2-style decoder ([`Gpt`], configurations [`GptConfig::gptmini`] and
//!   [`GptConfig::gpt2_124m`]), matching `../shared/reference/torch_reference.py`.
//! - [`bert`]: a BERT encoder ([`Bert`]) with transformers' parameter names, a mean-pooling
//!   classification head; [`bert_io`] loads and saves pretrained safetensors
//!   (all-MiniLM-L6-v2 in `examples/finetune_bert.rs`).

pub mod bert;
pub mod bert_io;
pub mod gpt;

pub use bert::{Bert, BertConfig};
pub use gpt::{Gpt, GptConfig};
