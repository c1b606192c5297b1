//! The tokenizer and chat template stored in a Llama GGUF file, as a `tokenizers` crate
//! tokenizer (byte-level BPE, or Gemma's SentencePiece vocabulary through
//! [`super::spm_tokenizer`]) and a `minijinja` template.
//!
//! GGUF keeps the vocabulary (`tokenizer.ggml.tokens`, in GPT-2's byte-to-unicode alphabet),
//! the merges (`tokenizer.ggml.merges`, `"a b"` strings in rank order), the token types
//! (`tokenizer.ggml.token_type`: 3 marks control tokens such as `<|im_start|>`, 4 user-defined
//! tokens such as Qwen3's `<think>`; both are matched whole before pre-tokenization, and only
//! control tokens are special), the name of the pre-tokenizer (`tokenizer.ggml.pre`), and
//! whether encoding adds a BOS or EOS token (`tokenizer.ggml.add_bos_token` /
//! `add_eos_token`: Llama 3 and Gemma 3 add BOS).
//!
//! Byte-level pre-tokenizers (`tokenizer.ggml.pre`, see [`PRE_TOKENIZERS`]): `gpt2` and
//! `smollm` below; Llama 3's `llama-bpe` and Qwen2/2.5/3's `qwen2` are a regex `Split`
//! ([`LLAMA3_SPLIT`], [`QWEN2_SPLIT`], behaviour `Isolated`) then `ByteLevel` without its own
//! regex, in both [`Pretokenizer`] modes (llama.cpp, the models' tokenizer.json files and
//! transformers 5's GGUF loader agree on them; see the constants for the sources).
//!
//! An HF folder's tokenizer ([`TextTokenizer::from_hf_dir`]) is its `tokenizer.json` as is,
//! with `tokenizer_config.json`'s special tokens, BOS/EOS flags and chat template.
//!
//! Two pre-tokenizations exist for SmolLM2's `"smollm"`, and they disagree on whitespace runs
//! before digits (2 of the 1.56M tokens of the Shakespeare text):
//! - [`Pretokenizer::Transformers`] (the default): GPT-2's regex split and byte-level mapping
//!   alone, as transformers' GGUF loader (`GGUFLlamaConverter`) builds it; ids equal to the
//!   tokenizer `scripts/reference/torch_llama.py` uses (tests/fixtures/smollm2_reference.json).
//! - [`Pretokenizer::LlamaCpp`]: every digit split apart first, then the same ByteLevel step:
//!   llama.cpp's `LLAMA_VOCAB_PRE_TYPE_SMOLLM` and SmolLM2's own `tokenizer.json`
//!   (`Digits(individual_digits=True)` + `ByteLevel`).

use super::files::Gguf;
use anyhow::{anyhow, bail, Context, Result};
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::Split;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer,
    PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer,
};

/// A chat message for [`TextTokenizer::apply_chat_template`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct ChatMessage {
    /// `"system"`, `"user"` or `"assistant"`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// Which pre-tokenization [`TextTokenizer::from_gguf_with`] builds (see the module docs).
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
pub struct TextTokenizer {
    /// The byte-level BPE tokenizer (control tokens are special added tokens).
    pub tokenizer: Tokenizer,
    /// The Jinja chat template (`tokenizer.chat_template`), if the file has one.
    pub chat_template: Option<String>,
    /// Beginning- and end-of-sequence tokens as text (for the template).
    pub bos_token: Option<String>,
    /// End-of-sequence token text.
    pub eos_token: Option<String>,
    /// Unknown-token text (`tokenizer.ggml.unknown_token_id`), if the file names one.
    pub unk_token: Option<String>,
    /// Padding-token text (`tokenizer.ggml.padding_token_id`), if the file names one.
    pub pad_token: Option<String>,
    /// [`TextTokenizer::encode`] starts with the BOS token (`tokenizer.ggml.add_bos_token`).
    pub add_bos_token: bool,
    /// [`TextTokenizer::encode`] ends with the EOS token (`tokenizer.ggml.add_eos_token`).
    pub add_eos_token: bool,
}

impl TextTokenizer {
    /// Builds the tokenizer from the metadata of `gguf`, pre-tokenizing as transformers does
    /// ([`Pretokenizer::Transformers`]).
    ///
    /// A `tokenizer.ggml.model` of `gpt2` is byte-level BPE; `llama` is Gemma's SentencePiece
    /// vocabulary ([`super::spm_tokenizer`]: no merges in the file, `tokenizer.ggml.pre`
    /// unused, a BOS added when the file has no `add_bos_token`).
    ///
    /// Errors: a tokenizer model other than `gpt2` or `llama`, a `llama` vocabulary of an
    /// architecture other than Gemma's (see [`super::spm_tokenizer::build`]), a byte-level
    /// pre-tokenizer (`tokenizer.ggml.pre`) wick does not implement (see [`PRE_TOKENIZERS`]), missing or
    /// mistyped vocabulary, merges or token types (named), a merge that is not two tokens.
    pub fn from_gguf(gguf: &Gguf) -> Result<Self> {
        Self::from_gguf_with(gguf, Pretokenizer::Transformers)
    }

    /// [`Self::from_gguf`] with the pre-tokenization chosen. With
    /// [`Pretokenizer::LlamaCpp`] a file without `tokenizer.ggml.pre` is refused too (llama.cpp
    /// then uses its `default` regexes, which wick does not implement).
    ///
    /// Errors: those of [`Self::from_gguf`].
    pub fn from_gguf_with(gguf: &Gguf, pretokenizer: Pretokenizer) -> Result<Self> {
        let file = gguf.path().display();
        let model = gguf
            .meta("tokenizer.ggml.model")?
            .to_string()
            .with_context(|| format!("{file}: tokenizer.ggml.model must be a string"))?;
        if model != "gpt2" && model != "llama" {
            bail!(
                "{file}: tokenizer.ggml.model = {model:?} is not supported; wick reads byte-level \
                 BPE (\"gpt2\") and Gemma's SentencePiece (\"llama\") GGUF tokenizers"
            );
        }
        let spm = model == "llama";
        if spm && pretokenizer == Pretokenizer::LlamaCpp {
            bail!(
                "{file}: Pretokenizer::LlamaCpp is not implemented for a SentencePiece \
                 (tokenizer.ggml.model = \"llama\") vocabulary: llama.cpp merges by score, \
                 wick builds transformers' merges; use TextTokenizer::from_gguf"
            );
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
        let types: Vec<i32> = match gguf.content.metadata.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()?
                .iter()
                .map(|t| t.to_i32())
                .collect::<candle_core::Result<_>>()
                .with_context(|| {
                    format!("{file}: tokenizer.ggml.token_type must be a list of i32")
                })?,
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            bail!(
                "{file}: tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has \
                 {}; there must be one type per token",
                types.len(),
                tokens.len()
            );
        }
        let mut tokenizer = if spm {
            super::spm_tokenizer::build(gguf, &tokens)?
        } else {
            byte_level(
                gguf,
                &tokens,
                strings("tokenizer.ggml.merges")?,
                pretokenizer,
            )?
        };
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == 3)
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        tokenizer
            .add_special_tokens(special)
            .map_err(|e| anyhow!("adding the control tokens: {e}"))?;
        // user-defined tokens (llama.cpp's LLAMA_TOKEN_TYPE_USER_DEFINED): one id each,
        // matched in the raw text before pre-tokenization, not special (kept when decoding
        // skips special tokens), as transformers' added tokens with special=False
        let user: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(s, &t)| t == 4 && (!spm || tokenizer.token_to_id(s).is_some()))
            .map(|(s, _)| AddedToken::from(s.clone(), false).normalized(false))
            .collect();
        tokenizer
            .add_tokens(user)
            .map_err(|e| anyhow!("adding the user-defined tokens: {e}"))?;
        let flag = |key: &str, default: bool| -> Result<bool> {
            match gguf.content.metadata.get(key) {
                Some(v) => v
                    .to_bool()
                    .with_context(|| format!("{key} must be a boolean")),
                None => Ok(default),
            }
        };
        // a SentencePiece file without the flag gets a BOS, as llama.cpp and transformers add
        let (add_bos_token, add_eos_token) = (
            flag("tokenizer.ggml.add_bos_token", spm)?,
            flag("tokenizer.ggml.add_eos_token", false)?,
        );
        let token_text = |key: &str| {
            gguf.content
                .metadata
                .get(key)
                .and_then(|v| v.to_u32().ok())
                .and_then(|id| tokens.get(id as usize).cloned())
        };
        Self {
            tokenizer,
            chat_template: gguf
                .content
                .metadata
                .get("tokenizer.chat_template")
                .and_then(|v| v.to_string().ok().cloned()),
            bos_token: token_text("tokenizer.ggml.bos_token_id"),
            eos_token: token_text("tokenizer.ggml.eos_token_id"),
            unk_token: token_text("tokenizer.ggml.unknown_token_id"),
            pad_token: token_text("tokenizer.ggml.padding_token_id"),
            add_bos_token,
            add_eos_token,
        }
        .with_post_processor()
    }

    /// The tokenizer of a Hugging Face folder: `dir/tokenizer.json` as it is (normaliser,
    /// pre-tokenizer, added tokens and post-processor), with `dir/tokenizer_config.json`
    /// (optional) naming the special tokens and the chat template, as transformers'
    /// `AutoTokenizer.from_pretrained(dir)` reads them.
    ///
    /// - `chat_template`: a string, or a list of `{"name", "template"}` objects, of which the
    ///   one named `"default"` is taken; without the key, `dir/chat_template.jinja` (where
    ///   transformers >= 4.47 saves it) if present.
    /// - `bos_token` / `eos_token` / `unk_token` / `pad_token`: a string, an AddedToken object
    ///   (its `"content"`) or null.
    /// - `add_bos_token` / `add_eos_token`: what tokenizer.json's post-processor adds is what
    ///   [`Self::encode`] adds (Llama 3's `TemplateProcessing` adds `<|begin_of_text|>`), and
    ///   the flags say so. A flag that is true where the post-processor does not add the token
    ///   installs a post-processor that does (as transformers' Llama and Gemma tokenizers
    ///   rebuild theirs from the flags), so the token is never added twice; a flag that is
    ///   false where the post-processor adds the token is refused (transformers' classes
    ///   disagree on which wins).
    ///
    /// Errors: a missing or unreadable tokenizer.json; tokenizer_config.json that is not a
    /// JSON object, a key of the wrong type, a chat template list without `"default"`, a flag
    /// that contradicts the post-processor, a flagged token not in the vocabulary: each
    /// naming the file and the key.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            bail!(
                "{}: no such file; an HF folder's tokenizer is its tokenizer.json",
                path.display()
            );
        }
        let tokenizer =
            Tokenizer::from_file(&path).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let config_path = dir.join("tokenizer_config.json");
        let cfile = config_path.display().to_string();
        let config: serde_json::Map<String, serde_json::Value> = if config_path.is_file() {
            let text = std::fs::read_to_string(&config_path)
                .with_context(|| format!("reading {cfile}"))?;
            match serde_json::from_str(&text).with_context(|| format!("{cfile}: not JSON"))? {
                serde_json::Value::Object(m) => m,
                _ => bail!("{cfile}: not a JSON object"),
            }
        } else {
            serde_json::Map::new()
        };
        let token = |key: &str| -> Result<Option<String>> {
            match config.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                Some(serde_json::Value::Object(o)) => match o.get("content") {
                    Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                    _ => bail!("{cfile}: {key} is an object without a string \"content\""),
                },
                Some(v) => {
                    bail!("{cfile}: {key} must be a string or an AddedToken object, not {v}")
                }
            }
        };
        let flag = |key: &str| -> Result<Option<bool>> {
            match config.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::Bool(b)) => Ok(Some(*b)),
                Some(v) => bail!("{cfile}: {key} must be true or false, not {v}"),
            }
        };
        let chat_template = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => {
                let jinja = dir.join("chat_template.jinja");
                if jinja.is_file() {
                    Some(
                        std::fs::read_to_string(&jinja)
                            .with_context(|| format!("reading {}", jinja.display()))?,
                    )
                } else {
                    None
                }
            }
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(list)) => {
                let named = |t: &serde_json::Value| -> Result<(String, String)> {
                    match (t.get("name"), t.get("template")) {
                        (
                            Some(serde_json::Value::String(n)),
                            Some(serde_json::Value::String(t)),
                        ) => Ok((n.clone(), t.clone())),
                        _ => bail!(
                            "{cfile}: chat_template is a list whose items must be \
                             {{\"name\": string, \"template\": string}} objects"
                        ),
                    }
                };
                let list = list.iter().map(named).collect::<Result<Vec<_>>>()?;
                let names: Vec<&str> = list.iter().map(|(n, _)| n.as_str()).collect();
                match list.iter().find(|(n, _)| n == "default") {
                    Some((_, t)) => Some(t.clone()),
                    None => bail!(
                        "{cfile}: chat_template is a list of named templates {names:?} \
                         without one named \"default\"; wick renders the default template"
                    ),
                }
            }
            Some(v) => bail!(
                "{cfile}: chat_template must be a string or a list of named templates, not {}",
                match v {
                    serde_json::Value::Bool(_) => "a boolean",
                    serde_json::Value::Number(_) => "a number",
                    _ => "an object",
                }
            ),
        };
        let mut this = Self {
            tokenizer,
            chat_template,
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
            unk_token: token("unk_token")?,
            pad_token: token("pad_token")?,
            add_bos_token: false,
            add_eos_token: false,
        };
        // what the post-processor adds around an empty text
        let added = this
            .tokenizer
            .encode("", true)
            .map_err(|e| anyhow!("{}: encoding an empty text: {e}", path.display()))?
            .get_ids()
            .to_vec();
        let id = |t: &Option<String>| t.as_ref().and_then(|t| this.tokenizer.token_to_id(t));
        let (bos_id, eos_id) = (id(&this.bos_token), id(&this.eos_token));
        let adds_bos = bos_id.is_some() && added.first().copied() == bos_id;
        let adds_eos =
            eos_id.is_some() && added.last().copied() == eos_id && (added.len() > 1 || !adds_bos);
        let mut rebuild = false;
        for (key, adds, slot) in [
            ("add_bos_token", adds_bos, &mut this.add_bos_token),
            ("add_eos_token", adds_eos, &mut this.add_eos_token),
        ] {
            *slot = match flag(key)? {
                None => adds,
                Some(true) => {
                    rebuild |= !adds;
                    true
                }
                Some(false) if adds => bail!(
                    "{cfile}: {key} is false but {}'s post-processor adds the token; \
                     remove the key or the token from the post-processor",
                    path.display()
                ),
                Some(false) => false,
            };
        }
        if rebuild {
            this = this
                .with_post_processor()
                .with_context(|| format!("{cfile}: add_bos_token / add_eos_token"))?;
        }
        Ok(this)
    }

    /// Installs the post-processor that adds the BOS / EOS token as the flags say (a
    /// `TemplateProcessing`, which tokenizer.json then carries for transformers).
    fn with_post_processor(mut self) -> Result<Self> {
        let mut single = Vec::new();
        let mut special = Vec::new();
        for (on, text, key) in [
            (self.add_bos_token, &self.bos_token, "bos"),
            (self.add_eos_token, &self.eos_token, "eos"),
        ] {
            if !on {
                continue;
            }
            let text = text.clone().with_context(|| {
                format!(
                    "add_{key}_token is true but no {key} token is named \
                     (tokenizer.ggml.{key}_token_id / tokenizer_config.json {key}_token)"
                )
            })?;
            let id = self
                .tokenizer
                .token_to_id(&text)
                .with_context(|| format!("the {key} token {text:?} is not in the vocabulary"))?;
            single.push(text.clone());
            special.push((text, id));
        }
        if special.is_empty() {
            return Ok(self);
        }
        let mut pieces = single.clone();
        pieces.insert(usize::from(self.add_bos_token), "$A".to_string());
        let mut pair = pieces.clone();
        let mut b = single;
        b.insert(usize::from(self.add_bos_token), "$B:1".to_string());
        pair.extend(b.iter().map(|p| {
            if p == "$B:1" {
                p.clone()
            } else {
                format!("{p}:1")
            }
        }));
        let template = TemplateProcessing::builder()
            .try_single(pieces)
            .map_err(|e| anyhow!("the BOS/EOS template: {e}"))?
            .try_pair(pair)
            .map_err(|e| anyhow!("the BOS/EOS pair template: {e}"))?
            .special_tokens(special)
            .build()
            .map_err(|e| anyhow!("the BOS/EOS template: {e}"))?;
        self.tokenizer.with_post_processor(Some(template));
        Ok(self)
    }

    /// Token ids of `text`, with the BOS / EOS token when the file's `add_bos_token` /
    /// `add_eos_token` say so (transformers' `tokenizer(text)`, llama.cpp's
    /// `llama_tokenize(..., add_special = true)`); control and user-defined token strings
    /// such as `<|im_start|>` or `<think>` become their ids.
    ///
    /// Errors: a tokenizer failure.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    /// [`Self::encode`], adding the BOS / EOS token only when `add_special_tokens` (as
    /// transformers' argument: `false` for a text that already holds them, e.g. a rendered
    /// chat template that starts with `bos_token`, or a continuation).
    ///
    /// Errors: a tokenizer failure.
    pub fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, add_special_tokens)
            .map_err(|e| anyhow!("tokenizing: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of a training example made of `prompt` then `completion` (the serving
    /// feedback, a prompt-completion dataset row): the BOS token when the file's
    /// `add_bos_token` says so, the prompt's ids and the completion's ids, each text tokenized
    /// on its own without special tokens (the prompt's ids are those generation starts from,
    /// [`Self::encode`]`(prompt)` less the BOS), then the EOS token when `add_eos_token` says
    /// so. One BOS at the start and at most one EOS at the end, never between the two parts.
    /// (TRL's `SFTTrainer` appends `eos_token` to every completion whatever the flag; here the
    /// file's flag decides, as for [`Self::encode`].)
    ///
    /// Errors: a tokenizer failure (naming the part).
    pub fn encode_prompt_completion(&self, prompt: &str, completion: &str) -> Result<Vec<u32>> {
        Ok(self.encode_prompt_completion_parts(prompt, completion)?.0)
    }

    /// [`Self::encode_prompt_completion`] and how many of its ids are the prompt's (the BOS
    /// included): the labels of the first ones are masked when training on the completion
    /// only.
    ///
    /// Errors: a tokenizer failure (naming the part).
    pub fn encode_prompt_completion_parts(
        &self,
        prompt: &str,
        completion: &str,
    ) -> Result<(Vec<u32>, usize)> {
        let special = self.encode_with("", true)?; // the BOS / EOS the flags add
        let mut ids = Vec::new();
        if self.add_bos_token {
            ids.extend(special.first());
        }
        ids.extend(self.encode_with(prompt, false).context("the prompt")?);
        let prompt_len = ids.len();
        ids.extend(
            self.encode_with(completion, false)
                .context("the completion")?,
        );
        if self.add_eos_token {
            ids.extend(special.last());
        }
        Ok((ids, prompt_len))
    }

    /// Token ids of the start of `text`: at least `min_tokens` of them (or all of `text`),
    /// tokenizing only as much as that needs. Returns the ids and how many bytes of `text`
    /// they cover. The text is cut only where [`safe_cut`] says (before a line break that
    /// follows an ASCII letter or digit, where no pre-tokenizer match or control token can
    /// span the cut), so the ids are exactly the first ids of [`Self::encode`]`(text)`.
    ///
    /// Errors: a tokenizer failure.
    pub fn encode_prefix(&self, text: &str, min_tokens: usize) -> Result<(Vec<u32>, usize)> {
        let bos = self.encode_with("", true)?; // the BOS / EOS the flags add
        let mut ids = Vec::new();
        if self.add_bos_token {
            ids.extend(bos.first());
        }
        let (mut start, mut chunk) = (0, 1 << 16);
        while start < text.len() && ids.len() < min_tokens {
            let end = safe_cut(text, start + chunk);
            ids.extend(self.encode_with(&text[start..end], false)?);
            start = end;
            chunk = chunk.saturating_mul(2);
        }
        if self.add_eos_token && start == text.len() {
            ids.extend(bos.last());
        }
        Ok((ids, start))
    }

    /// Writes `dir/tokenizer.json` (this tokenizer, in the `tokenizers` format) and
    /// `dir/tokenizer_config.json` (`PreTrainedTokenizerFast`, the special tokens, the chat
    /// template and `model_max_length`), so that transformers' `AutoTokenizer.from_pretrained`
    /// loads an HF folder written by [`super::files::save_pretrained`] as is. Each file is
    /// written atomically.
    ///
    /// Errors: the folder cannot be created or a file written (named).
    pub fn save_pretrained(&self, dir: &std::path::Path, model_max_length: usize) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let json = self
            .tokenizer
            .to_string(true)
            .map_err(|e| anyhow!("serialising the tokenizer: {e}"))?;
        crate::checkpoint::write_file_atomic(&dir.join("tokenizer.json"), json.as_bytes())?;
        let mut config = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model_max_length,
            "add_prefix_space": false,
            "clean_up_tokenization_spaces": false,
            // what tokenizer.json's post-processor does, written out for readers of the config
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
        });
        let m = config.as_object_mut().context("a JSON object")?;
        for (key, value) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
            ("unk_token", &self.unk_token),
            ("pad_token", &self.pad_token),
            ("chat_template", &self.chat_template),
        ] {
            if let Some(v) = value {
                m.insert(key.into(), v.clone().into());
            }
        }
        crate::checkpoint::write_file_atomic(
            &dir.join("tokenizer_config.json"),
            serde_json::to_string_pretty(&config)?.as_bytes(),
        )
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
            bail!(
                "this tokenizer has no chat template (a GGUF's tokenizer.chat_template, an HF \
                 folder's tokenizer_config.json chat_template or chat_template.jinja)"
            );
        };
        let mut env = minijinja::Environment::new();
        // HF templates (Llama 3, Qwen2.5, Mistral) call raise_exception on bad input
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
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

/// The byte-level BPE (`tokenizer.ggml.model = "gpt2"`) of `tokens` and `merges` (`"a b"`
/// strings in rank order), pre-tokenized as `pretokenizer` says; no added tokens yet.
fn byte_level(
    gguf: &Gguf,
    tokens: &[String],
    merges: Vec<String>,
    pretokenizer: Pretokenizer,
) -> Result<Tokenizer> {
    let merges = merges
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| anyhow!("merge {i} ({m:?}) is not two tokens"))
        })
        .collect::<Result<Vec<_>>>()?;
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
    let pre = check_pre(gguf, pretokenizer)?;
    let pre = if let Some(split) = pre.and_then(split_regex) {
        // Llama 3 / Qwen2: the regex split, then the byte mapping without GPT-2's regex
        PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Split(regex_split(split)?),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)),
        ]))
    } else if pretokenizer == Pretokenizer::LlamaCpp && pre == Some("smollm") {
        PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            PreTokenizerWrapper::ByteLevel(byte_level),
        ]))
    } else {
        PreTokenizerWrapper::ByteLevel(byte_level)
    };
    tokenizer.with_pre_tokenizer(Some(pre));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tokenizer)
}

/// The `tokenizer.ggml.pre` values wick implements exactly: `gpt2` (GPT-2's regex, the
/// `ByteLevel` pre-tokenizer), `smollm` ([`Pretokenizer::Transformers`]: GPT-2's regex as
/// transformers' GGUF loader builds it; [`Pretokenizer::LlamaCpp`]: digits split apart first,
/// as llama.cpp and SmolLM2's tokenizer.json do), `llama-bpe` (Llama 3, [`LLAMA3_SPLIT`]) and
/// `qwen2` (Qwen2 / 2.5 / 3, [`QWEN2_SPLIT`]). Others (llama.cpp's `default`, `deepseek-llm`,
/// `tekken`, ...) split text differently, so their files are refused rather than tokenized
/// into ids the model was not trained on.
pub const PRE_TOKENIZERS: &[&str] = &["gpt2", "smollm", "llama-bpe", "qwen2"];

/// Llama 3's pre-tokenization regex (`tokenizer.ggml.pre = "llama-bpe"`), applied as a
/// `Split` (behaviour `Isolated`, not inverted) before `ByteLevel` (`add_prefix_space` false,
/// `use_regex` false). The same text in:
/// - llama.cpp `src/llama-vocab.cpp`, `LLAMA_VOCAB_PRE_TYPE_LLAMA3` ("original regex from
///   tokenizer.json"; llama.cpp runs it with the contractions spelled `'[sS]|'[tT]|...` instead
///   of `(?i:...)`, equal on ASCII);
/// - transformers 5 `integrations/gguf/gguf_tokenizer_mapping.py`, `_LLAMA3_SPLIT`, mapped from
///   `llama-bpe` (and `llama3`, `llama-v3`, `dbrx`, ...) in `GGUF_PRE_TOKENIZER_SPLITS` and
///   installed by `set_split_regex` as `Sequence([Split(Regex(..), "isolated"),
///   ByteLevel(add_prefix_space=False, use_regex=False)])`;
/// - Meta-Llama-3's own tokenizer.json (the same `Split` + `ByteLevel` sequence).
///
/// transformers 4.x's GGUF loader (`GGUFLlamaConverter` in `integrations/ggml.py`) built
/// Llama 3's byte-level files with GPT-2's regex (`ByteLevel(use_regex=True)`) instead: digits
/// not grouped by three, so its ids differ from the model's own tokenizer; wick follows the
/// model's tokenizer.json (and transformers 5) in both [`Pretokenizer`] modes.
pub const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2's pre-tokenization regex (`tokenizer.ggml.pre = "qwen2"`: Qwen2, Qwen2.5, Qwen3):
/// [`LLAMA3_SPLIT`] with single digits (`\p{N}`) instead of runs of up to three, applied the
/// same way. The same text in llama.cpp `src/llama-vocab.cpp` (`LLAMA_VOCAB_PRE_TYPE_QWEN2`,
/// "original regex from tokenizer.json", contractions respelled as for Llama 3), transformers'
/// `models/qwen2/tokenization_qwen2.py` (`PRETOKENIZE_REGEX`, which the GGUF loader maps from
/// `qwen2`) and `convert_slow_tokenizer.py` (`Qwen2Converter`).
///
/// Qwen2's own tokenizer.json (and transformers' `Qwen2Tokenizer` / `Qwen2Converter`) also
/// normalise the text to NFC first; llama.cpp and transformers' GGUF loader (a
/// `GPT2Tokenizer` with this split) do not, and neither does wick's GGUF tokenizer: the ids
/// differ only on text that is not already NFC (e.g. a decomposed `"e\u{301}"`). An HF
/// folder ([`TextTokenizer::from_hf_dir`]) keeps its tokenizer.json's normaliser.
pub const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The split regex of a `tokenizer.ggml.pre` value that pre-tokenizes with one
/// ([`LLAMA3_SPLIT`] for `llama-bpe`, [`QWEN2_SPLIT`] for `qwen2`), `None` for the others.
pub fn split_regex(pre: &str) -> Option<&'static str> {
    match pre {
        "llama-bpe" => Some(LLAMA3_SPLIT),
        "qwen2" => Some(QWEN2_SPLIT),
        _ => None,
    }
}

/// The `Split` pre-tokenizer of `regex` as the GGUF tokenizers use it (behaviour `Isolated`:
/// every match and every gap between matches is a piece; not inverted). The `tokenizers`
/// crate is built with `fancy-regex`, which runs the lookahead `(?!\S)`.
///
/// Errors: a regex the engine does not compile.
pub fn regex_split(regex: &str) -> Result<Split> {
    Split::new(
        tokenizers::pre_tokenizers::split::SplitPattern::Regex(regex.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| anyhow!("compiling the pre-tokenizer regex {regex:?}: {e}"))
}

/// The pieces [`regex_split`]`(regex)` cuts `text` into (before any byte mapping).
///
/// Errors: the regex does not compile, or the split fails.
pub fn split_pieces(regex: &str, text: &str) -> Result<Vec<String>> {
    let split = regex_split(regex)?;
    let mut pts = PreTokenizedString::from(text);
    split
        .pre_tokenize(&mut pts)
        .map_err(|e| anyhow!("pre-tokenizing: {e}"))?;
    Ok(pts
        .get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(s, _, _)| s.to_string())
        .collect())
}

/// The file's `tokenizer.ggml.pre` (`None` when absent) if wick implements it for
/// `pretokenizer`; an error naming the key, its value, the file and what to do otherwise.
fn check_pre(gguf: &Gguf, pretokenizer: Pretokenizer) -> Result<Option<&str>> {
    let key = "tokenizer.ggml.pre";
    let file = gguf.path().display();
    let pre = match gguf.content.metadata.get(key) {
        None if pretokenizer == Pretokenizer::LlamaCpp => bail!(
            "{file}: no {key}; llama.cpp then pre-tokenizes with its \"default\" regexes, which \
             wick does not implement; use the transformers pre-tokenization (GPT-2's regex, \
             TextTokenizer::from_gguf) or a file converted with a {key} of {PRE_TOKENIZERS:?}"
        ),
        None => return Ok(None),
        Some(v) => v
            .to_string()
            .with_context(|| format!("{file}: {key} must be a string"))?,
    };
    if !PRE_TOKENIZERS.contains(&pre.as_str()) {
        bail!(
            "{file}: {key} = {pre:?} is not implemented: wick pre-tokenizes {PRE_TOKENIZERS:?} \
             exactly (GPT-2 / SmolLM2, Llama 3, Qwen2 / 2.5 / 3), and {pre:?} may split text \
             differently, so its ids would not be the ones the model was trained on; use a \
             model with one of those pre-tokenizers, or its HF folder (tokenizer.json, \
             TextTokenizer::from_hf_dir)"
        );
    }
    Ok(Some(pre.as_str()))
}

/// The first byte offset at or after `at` where `text` may be cut and each part tokenized on
/// its own with the same ids as the whole (see [`TextTokenizer::encode_prefix`]): before a
/// `\n` that follows an ASCII letter or digit; `text.len()` if there is none.
///
/// A letter or digit, not any non-space character: Llama 3's and Qwen2's regexes
/// ([`LLAMA3_SPLIT`], [`QWEN2_SPLIT`]) keep line breaks with the punctuation before them
/// (`" ?[^\s\p{L}\p{N}]+[\r\n]*"`: `".\n"` is one piece), so a cut between `.` and `\n`
/// would change their ids; no pattern of GPT-2's, SmolLM2's, Llama 3's or Qwen2's
/// pre-tokenization spans a letter or digit and a following `\n`.
pub fn safe_cut(text: &str, at: usize) -> usize {
    let b = text.as_bytes();
    (at.max(1)..b.len())
        .find(|&i| b[i] == b'\n' && b[i - 1].is_ascii_alphanumeric())
        .unwrap_or(b.len())
}
