//! The SentencePiece-style vocabulary of a GGUF with `tokenizer.ggml.model = "llama"`, as
//! Gemma's files carry it, built into a `tokenizers` BPE the way transformers' GGUF loader
//! does (`gemma_tokenizer` in `transformers/integrations/gguf/gguf_tokenizer_mapping.py`,
//! handing the vocabulary to `GemmaTokenizer`).
//!
//! The file holds tokens (`"▁"` for a space, `<0xNN>` byte-fallback tokens), scores and token
//! types, but no merges. transformers rebuilds them from the vocabulary: every split of a
//! token into two tokens of the vocabulary is a merge, ranked by the merged token's position
//! in the file (Gemma's scores do not follow its merge order), longer left piece first. A
//! token made only of spaces is stored with real spaces and respelled with `"▁"` first. The
//! text is normalised by replacing `" "` with `"▁"` (no space prefix: Gemma's
//! `tokenizer.ggml.add_space_prefix` is false), unknown characters fall back to their UTF-8
//! bytes, and decoding maps `"▁"` back to spaces and fuses the byte tokens.
//!
//! [`super::tokenizer::TextTokenizer::from_gguf`] calls [`build`] and then adds the
//! control and user-defined tokens, the BOS/EOS post-processor and the chat template as for
//! byte-level files.

use super::files::Gguf;
use anyhow::{anyhow, bail, Context, Result};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::split::Split;
use tokenizers::{DecoderWrapper, SplitDelimiterBehavior, Tokenizer};

/// The `general.architecture` values whose `"llama"` (SentencePiece) vocabulary wick builds:
/// Gemma's, whose merges follow the token order. Other SentencePiece files (Llama 2, Mistral
/// v0.1, Phi-3) rank merges by score or prefix a space, which wick does not implement, so
/// they are refused.
pub const SPM_ARCHITECTURES: &[&str] = &["gemma", "gemma2", "gemma3"];

/// The BPE tokenizer (model, normaliser, pre-tokenizer, decoder; no added tokens yet) of the
/// SentencePiece vocabulary `tokens` read from `gguf`.
///
/// Errors: an architecture outside [`SPM_ARCHITECTURES`], `tokenizer.ggml.add_space_prefix`
/// true, no `<unk>` token named by `tokenizer.ggml.unknown_token_id`, a BPE build failure; each
/// names the key and the file.
pub fn build(gguf: &Gguf, tokens: &[String]) -> Result<Tokenizer> {
    let file = gguf.path().display();
    let arch = gguf
        .meta("general.architecture")?
        .to_string()
        .with_context(|| format!("{file}: general.architecture must be a string"))?;
    if !SPM_ARCHITECTURES.contains(&arch.as_str()) {
        bail!(
            "{file}: tokenizer.ggml.model = \"llama\" (SentencePiece) is implemented for the \
             architectures {SPM_ARCHITECTURES:?}, not general.architecture = {arch:?}: its \
             merges are ranked by score and a space is prefixed, which wick does not implement; \
             use a Gemma GGUF or a byte-level (\"gpt2\") one"
        );
    }
    let key = "tokenizer.ggml.add_space_prefix";
    if let Some(v) = gguf.content.metadata.get(key) {
        if v.to_bool()
            .with_context(|| format!("{file}: {key} must be a boolean"))?
        {
            bail!(
                "{file}: {key} = true is not implemented for a SentencePiece vocabulary (Gemma's \
                 files say false); the ids would differ from the model's by a leading \"▁\""
            );
        }
    }
    let unk = gguf
        .content
        .metadata
        .get("tokenizer.ggml.unknown_token_id")
        .and_then(|v| v.to_u32().ok())
        .and_then(|id| tokens.get(id as usize))
        .with_context(|| {
            format!("{file}: tokenizer.ggml.unknown_token_id must name a token of the vocabulary")
        })?
        .clone();
    // tokens made only of spaces are looked up as "▁" runs (transformers' respelling)
    let tokens: Vec<String> = tokens
        .iter()
        .map(|t| {
            if !t.is_empty() && t.chars().all(|c| c == ' ') {
                "▁".repeat(t.chars().count())
            } else {
                t.clone()
            }
        })
        .collect();
    // a token spelled twice keeps its last id, as a Python dict built from the list does
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges = merges_by_position(&vocab);
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .unk_token(unk)
        .fuse_unk(true)
        .byte_fallback(true)
        .build()
        .map_err(|e| anyhow!("{file}: building the SentencePiece BPE model: {e}"))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer
        .with_normalizer(Some(
            Replace::new(" ", "▁").map_err(|e| anyhow!("the space normaliser: {e}"))?,
        ))
        .map_err(|e| anyhow!("the space normaliser: {e}"))?;
    tokenizer.with_pre_tokenizer(Some(
        Split::new(" ", SplitDelimiterBehavior::MergedWithPrevious, false)
            .map_err(|e| anyhow!("the pre-tokenizer: {e}"))?,
    ));
    tokenizer.with_decoder(Some(DecoderSequence::new(vec![
        DecoderWrapper::Replace(
            Replace::new("▁", " ").map_err(|e| anyhow!("the space decoder: {e}"))?,
        ),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ])));
    Ok(tokenizer)
}

/// The merges a vocabulary without merges implies (transformers' `generate_merges` with the
/// negated position as the score): for each token in id order, every split into two tokens of
/// the vocabulary, the longer left piece first.
fn merges_by_position(vocab: &Vocab) -> Vec<(String, String)> {
    let mut by_id: Vec<(&String, u32)> = vocab.iter().map(|(t, &i)| (t, i)).collect();
    by_id.sort_unstable_by_key(|&(_, i)| i);
    let mut merges = Vec::new();
    for (token, _) in by_id {
        let cuts: Vec<usize> = token.char_indices().map(|(i, _)| i).skip(1).collect();
        for &cut in cuts.iter().rev() {
            let (l, r) = token.split_at(cut);
            if vocab.contains_key(l) && vocab.contains_key(r) {
                merges.push((l.to_string(), r.to_string()));
            }
        }
    }
    merges
}
