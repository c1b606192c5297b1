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
//! Two pre-tokenizations exist for SmolLM2's `"smollm"`, and they disagree on whitespace runs
//! before digits (2 of the 1.56M tokens of the Shakespeare text):
//! - [`Pretokenizer::Transformers`] (the default): GPT-2's regex split and byte-level mapping
//!   alone, as transformers' GGUF loader (`GGUFLlamaConverter`) builds it; ids equal to the
//!   tokenizer `../shared/reference/torch_llama.py` uses (tests/fixtures/smollm2_reference.json).
//! - [`Pretokenizer::LlamaCpp`]: every digit split apart first, then the same ByteLevel step:
//!   llama.cpp's `LLAMA_VOCAB_PRE_TYPE_SMOLLM` and SmolLM2's own `tokenizer.json`
//!   (`Digits(individual_digits=True)` + `ByteLevel`).

use super::files::Gguf;
use anyhow::{anyhow, bail, Context, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

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
                .collect::<candle_core::Result<_>>()?,
            None => vec![1; tokens.len()],
        };
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
        Ok(Self {
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
        .with_post_processor()?)
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
                format!("tokenizer.ggml.add_{key}_token is true but tokenizer.ggml.{key}_token_id names no token")
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
        let special = self.encode_with("", true)?; // the BOS / EOS the flags add
        let mut ids = Vec::new();
        if self.add_bos_token {
            ids.extend(special.first());
        }
        ids.extend(self.encode_with(prompt, false).context("the prompt")?);
        ids.extend(
            self.encode_with(completion, false)
                .context("the completion")?,
        );
        if self.add_eos_token {
            ids.extend(special.last());
        }
        Ok(ids)
    }

    /// Token ids of the start of `text`: at least `min_tokens` of them (or all of `text`),
    /// tokenizing only as much as that needs. Returns the ids and how many bytes of `text`
    /// they cover. The text is cut only before a line break that follows a non-space
    /// character (where no pre-tokenizer match of GPT-2's regex, digit split or control token
    /// can span the cut), so the ids are exactly the first ids of [`Self::encode`]`(text)`.
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
    let smollm = check_pre(gguf, pretokenizer)? == Some("smollm");
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
    Ok(tokenizer)
}

/// The `tokenizer.ggml.pre` values wick implements exactly: `gpt2` (GPT-2's regex, the
/// `ByteLevel` pre-tokenizer) and `smollm` ([`Pretokenizer::Transformers`]: GPT-2's regex as
/// transformers' GGUF loader builds it; [`Pretokenizer::LlamaCpp`]: digits split apart first,
/// as llama.cpp and SmolLM2's tokenizer.json do). Others (Llama 3's `llama-bpe`, Qwen2's
/// `qwen2`, ...) split text differently, so their files are refused rather than tokenized
/// into ids the model was not trained on.
pub const PRE_TOKENIZERS: &[&str] = &["gpt2", "smollm"];

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
             exactly, and {pre:?} splits text differently (Llama 3's \"llama-bpe\" groups \
             digits by three, Qwen2's \"qwen2\" splits digits apart), so its ids would not be \
             the ones the model was trained on; use a model with one of those pre-tokenizers \
             (SmolLM2)"
        );
    }
    Ok(Some(pre.as_str()))
}

/// The first byte offset at or after `at` where `text` may be cut and each part tokenized on
/// its own with the same ids as the whole (see [`TextTokenizer::encode_prefix`]): before a
/// `\n` that follows an ASCII character other than whitespace; `text.len()` if there is none.
pub fn safe_cut(text: &str, at: usize) -> usize {
    let b = text.as_bytes();
    (at.max(1)..b.len())
        .find(|&i| b[i] == b'\n' && b[i - 1] < 0x80 && !b[i - 1].is_ascii_whitespace())
        .unwrap_or(b.len())
}
