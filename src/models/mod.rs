//! Reference models built on wick's layers, shared by the examples, the `wick bench` command
//! and the tests.
//!
//! - [`gpt`]: a GPT-2-style decoder ([`Gpt`], configurations [`GptConfig::gptmini`] and
//!   [`GptConfig::gpt2_124m`]), matching `../shared/reference/torch_reference.py`.

pub mod gpt;

pub use gpt::{Gpt, GptConfig};
