//! wick's GGUF tokenizer on Gemma 3 270M's SentencePiece vocabulary (`tokenizer.ggml.model =
//! "llama"`) against transformers' (tests/fixtures/gemma3_270m_reference.json, made by
//! scripts/gemma3_fixture.py), on the file scripts/fetch_gemma3.sh assembles (`.ci/run` calls
//! it); without data/gemma3 they fail, naming the script, as the other tests on fetched data do.

#![cfg(feature = "tokenizers")]

mod common;
use anyhow::Result;
use candle_core::quantized::gguf_file;
use common::tmp;
use std::path::PathBuf;
use std::sync::OnceLock;
use wick::models::files::Gguf;
use wick::models::tokenizer::{Pretokenizer, TextTokenizer};

/// The GGUF (scripts/fetch_gemma3.sh).
fn gguf_path() -> PathBuf {
    common::data_file("gemma3/gemma-3-270m-q4_k_m.gguf", "scripts/fetch_gemma3.sh")
}

/// The tokenizer, built once per test binary.
fn tokenizer() -> &'static TextTokenizer {
    static T: OnceLock<TextTokenizer> = OnceLock::new();
    T.get_or_init(|| {
        TextTokenizer::from_gguf(&Gguf::open(&gguf_path()).expect("opening the GGUF"))
            .expect("tokenizer")
    })
}

#[test]
fn ids_and_decoding_equal_transformers() -> Result<()> {
    let tok = tokenizer();
    let fx = common::fixture("gemma3_270m_reference.json");
    assert_eq!(fx["add_bos_token"], true);
    assert!(tok.add_bos_token && !tok.add_eos_token);
    assert_eq!(tok.bos_token.as_deref(), Some("<bos>"));
    assert_eq!(tok.eos_token.as_deref(), Some("<eos>"));
    // the file carries no chat template, and transformers' tokenizer has none either
    assert!(fx["chat_template"].is_null() && tok.chat_template.is_none());
    let texts = fx["texts"].as_array().expect("texts");
    assert_eq!(texts.len(), 5);
    for ((text, want), decoded) in texts
        .iter()
        .zip(fx["ids"].as_array().unwrap())
        .zip(fx["decoded"].as_array().unwrap())
    {
        let text = text.as_str().unwrap();
        let want = common::ids_of(want);
        assert_eq!(want[0], 2, "the fixture starts with <bos>");
        assert_eq!(tok.encode(text)?, want, "ids of {text:?}");
        assert_eq!(
            tok.encode_with(text, false)?,
            want[1..],
            "{text:?} without BOS"
        );
        assert_eq!(
            tok.decode(&want)?,
            decoded.as_str().unwrap(),
            "decoding {text:?}"
        );
        assert_eq!(tok.decode(&want[1..])?, text, "round trip of {text:?}");
    }
    Ok(())
}

/// Pieces whose ids are read from the file's own vocabulary: spaces are "▁", control tokens
/// (type 3) and the user-defined "\n" runs (type 4) are one id each, an unknown character
/// falls back to its UTF-8 bytes.
#[test]
fn pieces_are_atomic_and_bytes_fall_back() -> Result<()> {
    let tok = tokenizer();
    let t = &tok.tokenizer;
    let id = |s: &str| {
        t.token_to_id(s)
            .unwrap_or_else(|| panic!("{s:?} not in vocab"))
    };
    assert_eq!(id("<start_of_turn>"), 105);
    assert_eq!(id("\n\n\n"), 109);
    assert_eq!(
        tok.encode_with("<start_of_turn>\n\n\n<end_of_turn>", false)?,
        [105, 109, 106]
    );
    // a plane-15 private-use character the vocabulary lacks: its four UTF-8 bytes (F3 B0 80
    // 80; transformers gives [481, 414, 366, 366])
    let bytes = ["<0xF3>", "<0xB0>", "<0x80>", "<0x80>"].map(id);
    assert_eq!(bytes, [481, 414, 366, 366]);
    assert_eq!(tok.encode_with("\u{f0000}", false)?, bytes);
    assert_eq!(tok.decode(&bytes)?, "\u{f0000}");
    // a space is "▁" and comes before the word that follows it (no space prefix at the start)
    let ids = tok.encode_with("hello world", false)?;
    let pieces: Vec<String> = ids.iter().map(|&i| t.id_to_token(i).unwrap()).collect();
    assert_eq!(pieces, ["hello", "▁world"]);
    assert_eq!(ids, [23391, 1902]); // transformers' ids
    Ok(())
}

/// Gemma's tokenizer metadata written as a tensor-less GGUF, with `edit` applied.
fn edited(name: &str, edit: impl FnOnce(&mut Vec<(String, gguf_file::Value)>)) -> Gguf {
    let src = Gguf::open(&gguf_path()).unwrap();
    let mut meta: Vec<(String, gguf_file::Value)> = src
        .content
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer.") || k.starts_with("general."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    edit(&mut meta);
    // one folder per file: the tests run in parallel and tmp() empties its folder
    let path = tmp(&format!("gemma3-{name}")).join(name);
    let refs: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::fs::File::create(&path).unwrap(), &refs, &[]).unwrap();
    Gguf::open(&path).unwrap()
}

fn set(meta: &mut Vec<(String, gguf_file::Value)>, key: &str, v: gguf_file::Value) {
    meta.retain(|(k, _)| k != key);
    meta.push((key.to_string(), v));
}

#[test]
fn add_bos_token_is_read_and_defaults_to_true() -> Result<()> {
    use gguf_file::Value as V;
    let off = edited("nobos.gguf", |m| {
        set(m, "tokenizer.ggml.add_bos_token", V::Bool(false))
    });
    let tok = TextTokenizer::from_gguf(&off)?;
    assert!(!tok.add_bos_token);
    assert_eq!(tok.encode("To be")?, [2021, 577]);
    let absent = edited("nokey.gguf", |m| {
        m.retain(|(k, _)| k != "tokenizer.ggml.add_bos_token")
    });
    assert_eq!(
        TextTokenizer::from_gguf(&absent)?.encode("To be")?,
        [2, 2021, 577]
    );
    Ok(())
}

#[test]
fn unimplemented_sentencepiece_variants_are_refused() {
    use gguf_file::Value as V;
    let cases: [(&str, &str, V, &str); 3] = [
        (
            "arch.gguf",
            "general.architecture",
            V::String("llama".into()),
            "general.architecture = \"llama\"",
        ),
        (
            "prefix.gguf",
            "tokenizer.ggml.add_space_prefix",
            V::Bool(true),
            "tokenizer.ggml.add_space_prefix = true",
        ),
        (
            "model.gguf",
            "tokenizer.ggml.model",
            V::String("t5".into()),
            "tokenizer.ggml.model = \"t5\"",
        ),
    ];
    for (name, key, value, says) in cases {
        let g = edited(name, |m| set(m, key, value));
        let err = TextTokenizer::from_gguf(&g).err().expect("refused");
        let msg = format!("{err:#}");
        assert!(msg.contains(says) && msg.contains(name), "{msg}");
    }
    let g = edited("plain.gguf", |_| {});
    let err = TextTokenizer::from_gguf_with(&g, Pretokenizer::LlamaCpp)
        .err()
        .expect("refused");
    assert!(
        format!("{err:#}").contains("Pretokenizer::LlamaCpp"),
        "{err:#}"
    );
}
