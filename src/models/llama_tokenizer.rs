//! The tokenizer and chat template stored in a Llama GGUF file, as a `tokenizers` crate
//! tokenizer (byte-level BPE) and a `minijinja` template.
//!
//! GGUF keeps the vocabulary (`tokenizer.ggml.tokens`, in GPT-2's byte-to-unicode alphabet),
//! the merges (`tokenizer.ggml.merges`, `"a b"` strings in rank order), the token types
//! (`tokenizer.ggml.token_type`: 3 marks control tokens such as `<|im_start|>`) and the name of
//! the pre-tokenizer (`tokenizer.ggml.pre`).
//!
//! Two pre-tokenizations exist for SmolLM2's `"smollm"`, and they disagree on whitespace runs
//! before digits (2 of the 1.56M tokens of the Shakespeare text):
//! - [`Pretokenizer::Transformers`] (the default): GPT-2's regex split and byte-level mapping
//!   alone, as transformers' GGUF loader (`GGUFLlamaConverter`) builds it; ids equal to the
//!   tokenizer `../shared/reference/torch_llama.py` uses (tests/fixtures/smollm2_reference.json).
//! - [`Pretokenizer::LlamaCpp`]: every digit split apart first, then the same ByteLevel step:
//!   llama.cpp's `LLAMA_VOCAB_PRE_TYPE_SMOLLM` and SmolLM2's own `tokenizer.json`
//!   (`Digits(individual_digits=True)` + `ByteLevel`).

use super::llama_io::Gguf;
use anyhow::{anyhow, bail, Context, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

/// A chat message for [`LlamaTokenizer::apply_chat_template`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct ChatMessage {
    /// `"system"`, `"user"` or `"assistant"`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// Which pre-tokenization [`LlamaTokenizer::from_gguf_with`] builds (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pretokenizer {
    /// transformers' GGUF loader: ByteLevel (GPT-2 regex) only.
    #[default]
    Transformers,
    /// llama.cpp's `smollm` / SmolLM2's tokenizer.json: digits split apart, then ByteLevel
    /// (other `tokenizer.ggml.pre` values get ByteLevel alone).
    LlamaCpp,
}

/// A GGUF model's tokenizer and chat template.
pub struct LlamaTokenizer {
    /// The byte-level BPE tokenizer (control tokens are special added tokens).
    pub tokenizer: Tokenizer,
    /// The Jinja chat template (`tokenizer.chat_template`), if the file has one.
    pub chat_template: Option<String>,
    /// Beginning- and end-of-sequence tokens as text (for the template).
    pub bos_token: Option<String>,
    /// End-of-sequence token text.
    pub eos_token: Option<String>,
}

impl LlamaTokenizer {
    /// Builds the tokenizer from the metadata of `gguf`, pre-tokenizing as transformers does
    /// ([`Pretokenizer::Transformers`]).
    ///
    /// Errors: a tokenizer model other than `gpt2` (byte-level BPE), missing or mistyped
    /// vocabulary, merges or token types (named), a merge that is not two tokens.
    pub fn from_gguf(gguf: &Gguf) -> Result<Self> {
        Self::from_gguf_with(gguf, Pretokenizer::Transformers)
    }

    /// [`Self::from_gguf`] with the pre-tokenization chosen.
    pub fn from_gguf_with(gguf: &Gguf, pretokenizer: Pretokenizer) -> Result<Self> {
        let model = gguf.meta("tokenizer.ggml.model")?.to_string()?;
        if model != "gpt2" {
            bail!("tokenizer model {model:?} is not supported; wick reads byte-level BPE (\"gpt2\") GGUF tokenizers");
        }
        let strings = |key: &str| -> Result<Vec<String>> {
            gguf.meta(key)?
                .to_vec()?
                .iter()
                .map(|v| v.to_string().cloned())
                .collect::<candle_core::Result<Vec<_>>>()
                .with_context(|| format!("{key} must be a list of strings"))
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| anyhow!("merge {i} ({m:?}) is not two tokens"))
            })
            .collect::<Result<Vec<_>>>()?;
        let types: Vec<i32> = match gguf.content.metadata.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()?
                .iter()
                .map(|t| t.to_i32())
                .collect::<candle_core::Result<_>>()?,
            None => vec![1; tokens.len()],
        };
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| anyhow!("building the BPE model: {e}"))?;
        let mut tokenizer = Tokenizer::new(bpe);
        let byte_level = ByteLevel::new(false, false, true);
        let smollm = gguf
            .content
            .metadata
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.to_string().ok())
            .is_some_and(|p| p == "smollm");
        let pre = if pretokenizer == Pretokenizer::LlamaCpp && smollm {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                PreTokenizerWrapper::ByteLevel(byte_level),
            ]))
        } else {
            PreTokenizerWrapper::ByteLevel(byte_level)
        };
        tokenizer.with_pre_tokenizer(Some(pre));
        tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == 3)
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        tokenizer
            .add_special_tokens(special)
            .map_err(|e| anyhow!("adding the control tokens: {e}"))?;
        let token_text = |key: &str| {
            gguf.content
                .metadata
                .get(key)
                .and_then(|v| v.to_u32().ok())
                .and_then(|id| tokens.get(id as usize).cloned())
        };
        Ok(Self {
            tokenizer,
            chat_template: gguf
                .content
                .metadata
                .get("tokenizer.chat_template")
                .and_then(|v| v.to_string().ok().cloned()),
            bos_token: token_text("tokenizer.ggml.bos_token_id"),
            eos_token: token_text("tokenizer.ggml.eos_token_id"),
        })
    }

    /// Token ids of `text` (control-token strings such as `<|im_start|>` become their ids; no
    /// BOS is added, as the GGUF's `add_bos_token = false` says).
    ///
    /// Errors: a tokenizer failure.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| anyhow!("tokenizing: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids` (special tokens kept).
    ///
    /// Errors: an id outside the vocabulary.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| anyhow!("decoding: {e}"))
    }

    /// Renders the chat template over `messages` (transformers' `apply_chat_template(...,
    /// tokenize=False)`), with `add_generation_prompt` opening the assistant's turn.
    ///
    /// Errors: no template in the file, or a template that fails to render.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let Some(src) = &self.chat_template else {
            bail!("this GGUF file has no tokenizer.chat_template");
        };
        let mut env = minijinja::Environment::new();
        env.add_template("chat", src)
            .map_err(|e| anyhow!("parsing the chat template: {e}"))?;
        env.get_template("chat")
            .and_then(|t| {
                t.render(minijinja::context! {
                    messages => messages,
                    add_generation_prompt => add_generation_prompt,
                    bos_token => self.bos_token.clone().unwrap_or_default(),
                    eos_token => self.eos_token.clone().unwrap_or_default(),
                })
            })
            .map_err(|e| anyhow!("rendering the chat template: {e}"))
    }
}
