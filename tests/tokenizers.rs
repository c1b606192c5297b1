//! Llama 3's and Qwen2's byte-level pre-tokenizers (`tokenizer.ggml.pre` = `llama-bpe` /
//! `qwen2`) against Python's `regex` module (tests/fixtures/pretokenizer_splits.json, made by
//! scripts/pretokenizer_fixture.py), tiny GGUF vocabularies that show their digit groupings,
//! and HF folders (`TextTokenizer::from_hf_dir`): `save_pretrained` then `from_hf_dir` gives
//! the GGUF tokenizer back (SmolLM2 and Gemma 3, on the files scripts/fetch_smollm2.sh and
//! scripts/fetch_gemma3.sh fetch), and tokenizer_config.json's keys are read or refused.

#![cfg(feature = "tokenizers")]

mod common;
use anyhow::Result;
use candle_core::quantized::gguf_file;
use common::tmp;
use std::path::{Path, PathBuf};
use wick::models::files::Gguf;
use wick::models::tokenizer::{
    split_pieces, split_regex, ChatMessage, Pretokenizer, TextTokenizer, LLAMA3_SPLIT,
    PRE_TOKENIZERS, QWEN2_SPLIT,
};

fn fixture() -> serde_json::Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pretokenizer_splits.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("fixture")).expect("fixture json")
}

/// Our `Split` (fancy-regex) cuts every fixture text into the pieces Python's `regex` found,
/// for both patterns; the fixture's patterns are ours, character for character.
#[test]
fn split_pieces_equal_python_regex() -> Result<()> {
    let fx = fixture();
    let texts: Vec<&str> = fx["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert!(texts.len() >= 12);
    for (pre, ours) in [("llama-bpe", LLAMA3_SPLIT), ("qwen2", QWEN2_SPLIT)] {
        assert_eq!(fx["patterns"][pre].as_str(), Some(ours), "{pre}");
        assert_eq!(split_regex(pre), Some(ours));
        assert!(PRE_TOKENIZERS.contains(&pre));
        for (text, want) in texts.iter().zip(fx["splits"][pre].as_array().unwrap()) {
            let want: Vec<&str> = want
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p.as_str().unwrap())
                .collect();
            assert_eq!(split_pieces(ours, text)?, want, "{pre}: {text:?}");
        }
    }
    // the groupings the fixture pins, spelled out
    assert_eq!(
        split_pieces(LLAMA3_SPLIT, "x 1234567")?,
        ["x", " ", "123", "456", "7"]
    );
    assert_eq!(
        split_pieces(QWEN2_SPLIT, "I'LL 42")?,
        ["I", "'LL", " ", "4", "2"]
    );
    assert_eq!(
        split_pieces(LLAMA3_SPLIT, "end.\nNext")?,
        ["end", ".\n", "Next"]
    );
    Ok(())
}

/// GPT-2's byte-to-unicode alphabet (the spelling of byte-level vocabularies).
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&c| !printable(c)).count() as u32;
    char::from_u32(256 + n).unwrap()
}

fn spell(s: &str) -> String {
    s.bytes().map(byte_char).collect()
}

/// A tensor-less GGUF of a tiny byte-level vocabulary (the 256 byte tokens, then merges that
/// build "123", "45", "12345" and " apples") with `tokenizer.ggml.pre = pre`.
fn tiny_gguf(dir: &Path, pre: &str) -> Gguf {
    use gguf_file::Value as V;
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    let mut merges = Vec::new();
    for (a, b) in [
        ("1", "2"),
        ("12", "3"),
        ("4", "5"),
        ("123", "45"),
        (" ", "a"),
        (" a", "p"),
        (" ap", "p"),
        (" app", "l"),
        (" appl", "e"),
        (" apple", "s"),
    ] {
        merges.push(V::String(format!("{} {}", spell(a), spell(b))));
        tokens.push(spell(&format!("{a}{b}")));
    }
    tokens.push("<|begin_of_text|>".into());
    let n = tokens.len();
    let mut types = vec![V::I32(1); n];
    types[n - 1] = V::I32(3);
    let meta: Vec<(&str, V)> = vec![
        ("general.architecture", V::String("llama".into())),
        ("tokenizer.ggml.model", V::String("gpt2".into())),
        ("tokenizer.ggml.pre", V::String(pre.into())),
        (
            "tokenizer.ggml.tokens",
            V::Array(tokens.into_iter().map(V::String).collect()),
        ),
        ("tokenizer.ggml.merges", V::Array(merges)),
        ("tokenizer.ggml.token_type", V::Array(types)),
        ("tokenizer.ggml.bos_token_id", V::U32(n as u32 - 1)),
        ("tokenizer.ggml.add_bos_token", V::Bool(true)),
    ];
    let path = dir.join(format!("{pre}.gguf"));
    let refs: Vec<(&str, &V)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    gguf_file::write(&mut std::fs::File::create(&path).unwrap(), &refs, &[]).unwrap();
    Gguf::open(&path).unwrap()
}

fn pieces(tok: &TextTokenizer, text: &str) -> Result<Vec<String>> {
    tok.encode_with(text, false)?
        .iter()
        .map(|&i| tok.decode(&[i]))
        .collect()
}

/// "12345 apples": Llama 3 groups digits by three ("123" "45"), Qwen2 splits them apart, and
/// GPT-2's regex (`gpt2`) keeps the run whole; in both pre-tokenization modes, with the BOS
/// the file's `add_bos_token` asks for, and decoding back to the text.
#[test]
fn tiny_gguf_digit_groupings() -> Result<()> {
    let dir = tmp("tokenizers-tiny");
    let text = "12345 apples";
    for (pre, want) in [
        ("llama-bpe", vec!["123", "45", " apples"]),
        ("qwen2", vec!["1", "2", "3", "4", "5", " apples"]),
        ("gpt2", vec!["12345", " apples"]),
    ] {
        let g = tiny_gguf(&dir, pre);
        for mode in [Pretokenizer::Transformers, Pretokenizer::LlamaCpp] {
            let tok = TextTokenizer::from_gguf_with(&g, mode)?;
            assert_eq!(pieces(&tok, text)?, want, "{pre} {mode:?}");
            let ids = tok.encode(text)?;
            assert_eq!(tok.decode(&ids)?, format!("<|begin_of_text|>{text}"));
            assert_eq!(ids.len(), want.len() + 1);
        }
    }
    // punctuation keeps its line break under Llama 3's regex, and encode_prefix cuts only
    // where the ids stay those of the whole text
    let tok = TextTokenizer::from_gguf(&tiny_gguf(&dir, "llama-bpe"))?;
    let long = "12345 apples.\n12 apples\n".repeat(5_000);
    let all = tok.encode(&long)?;
    let (ids, used) = tok.encode_prefix(&long, 10)?;
    assert!(used < long.len());
    assert_eq!(ids, all[..ids.len()]);
    let (ids, used) = tok.encode_prefix(&long, usize::MAX)?;
    assert_eq!((ids, used), (all, long.len()));
    // still refused: llama.cpp's "default" and others
    let g = tiny_gguf(&dir, "deepseek-llm");
    let err = format!("{:#}", TextTokenizer::from_gguf(&g).err().unwrap());
    assert!(
        err.contains("tokenizer.ggml.pre") && err.contains("\"deepseek-llm\""),
        "{err}"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

fn texts() -> Vec<String> {
    vec![
        "Hello, world! 12345 apples and 3.14159 pears.".into(),
        "  leading spaces\n\n\ttabs\r\nCRLF  trailing  ".into(),
        "中文, 日本語, 한국어 and emoji 🎉👍🏽".into(),
        "<|im_start|>user\nWhat's 2+2?<|im_end|>\n".into(),
        "<start_of_turn>user\nI'LL be there<end_of_turn>\n".into(),
    ]
}

/// `save_pretrained` then `from_hf_dir` gives the same ids, decodings, flags, special tokens
/// and chat template as the GGUF tokenizer it was written from.
fn round_trip(gguf: PathBuf, tag: &str) -> Result<()> {
    let a = TextTokenizer::from_gguf(&Gguf::open(&gguf)?)?;
    let dir = tmp(tag);
    a.save_pretrained(&dir, 2048)?;
    let b = TextTokenizer::from_hf_dir(&dir)?;
    assert_eq!(
        (a.add_bos_token, a.add_eos_token),
        (b.add_bos_token, b.add_eos_token)
    );
    assert_eq!(
        (&a.bos_token, &a.eos_token, &a.unk_token, &a.pad_token),
        (&b.bos_token, &b.eos_token, &b.unk_token, &b.pad_token)
    );
    assert_eq!(a.chat_template, b.chat_template);
    for text in texts() {
        let ids = a.encode(&text)?;
        assert_eq!(b.encode(&text)?, ids, "{tag}: {text:?}");
        assert_eq!(b.encode_with(&text, false)?, a.encode_with(&text, false)?);
        assert_eq!(b.decode(&ids)?, a.decode(&ids)?);
        assert_eq!(
            b.encode_prompt_completion(&text, " done")?,
            a.encode_prompt_completion(&text, " done")?
        );
    }
    if a.chat_template.is_some() {
        let msgs = [
            ChatMessage {
                role: "user".into(),
                content: "Hi there".into(),
            },
            ChatMessage {
                role: "assistant".into(),
                content: "Hello!".into(),
            },
        ];
        assert_eq!(
            b.apply_chat_template(&msgs, true)?,
            a.apply_chat_template(&msgs, true)?
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn hf_dir_round_trip_smollm2() -> Result<()> {
    round_trip(
        common::data_file(
            "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "scripts/fetch_smollm2.sh",
        ),
        "tokenizers-smollm2",
    )
}

/// Gemma 3's `add_bos_token` true: the BOS comes from the saved tokenizer.json's
/// post-processor, once.
#[test]
fn hf_dir_round_trip_gemma3() -> Result<()> {
    let gguf = common::data_file("gemma3/gemma-3-270m-q4_k_m.gguf", "scripts/fetch_gemma3.sh");
    round_trip(gguf.clone(), "tokenizers-gemma3")?;
    let a = TextTokenizer::from_gguf(&Gguf::open(&gguf)?)?;
    assert!(a.add_bos_token);
    let bos = a.tokenizer.token_to_id("<bos>").unwrap();
    let dir = tmp("tokenizers-gemma3-bos");
    a.save_pretrained(&dir, 2048)?;
    let b = TextTokenizer::from_hf_dir(&dir)?;
    let ids = b.encode("Hello")?;
    assert_eq!(ids.iter().filter(|&&i| i == bos).count(), 1);
    assert_eq!(ids[0], bos);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// A folder of the tiny Llama 3 vocabulary, its tokenizer.json written without the BOS
/// post-processor (as a Llama 2-style tokenizer.json that leaves the BOS to the flag) and
/// `config` as tokenizer_config.json.
fn hf_folder(tag: &str, config: serde_json::Value, with_post_processor: bool) -> PathBuf {
    let dir = tmp(tag);
    let mut tok = TextTokenizer::from_gguf(&tiny_gguf(&dir, "llama-bpe")).unwrap();
    if !with_post_processor {
        tok.tokenizer
            .with_post_processor(None::<tokenizers::PostProcessorWrapper>);
    }
    tok.save_pretrained(&dir, 128).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string(&config).unwrap(),
    )
    .unwrap();
    dir
}

/// tokenizer_config.json: AddedToken objects, `add_bos_token` (added once, whether the
/// post-processor or the flag asks), a list of named templates, `chat_template.jinja`; keys of
/// the wrong type or contradicting the post-processor are refused naming file and key.
#[test]
fn hf_tokenizer_config_keys_are_read_or_refused() -> Result<()> {
    use serde_json::json;
    let bos = "<|begin_of_text|>";
    let obj = json!({"content": bos, "lstrip": false, "normalized": false, "special": true});
    // the flag asks, the post-processor does not: added once
    let dir = hf_folder(
        "tokenizers-flag",
        json!({"bos_token": obj, "add_bos_token": true, "eos_token": null}),
        false,
    );
    let t = TextTokenizer::from_hf_dir(&dir)?;
    assert_eq!(t.bos_token.as_deref(), Some(bos));
    assert!(t.add_bos_token && !t.add_eos_token && t.eos_token.is_none());
    let ids = t.encode("12345 apples")?;
    assert_eq!(t.decode(&ids)?, format!("{bos}12345 apples"));
    assert_eq!(ids.len(), 4);
    // the post-processor adds it and the flag agrees (Llama 3): once
    let dir = hf_folder(
        "tokenizers-both",
        json!({"bos_token": bos, "add_bos_token": true}),
        true,
    );
    let t = TextTokenizer::from_hf_dir(&dir)?;
    assert_eq!(t.encode("12345 apples")?.len(), 4);
    // no flag: what the post-processor does
    let dir = hf_folder("tokenizers-noflag", json!({"bos_token": bos}), true);
    assert!(TextTokenizer::from_hf_dir(&dir)?.add_bos_token);
    let dir = hf_folder("tokenizers-none", json!({"bos_token": bos}), false);
    let t = TextTokenizer::from_hf_dir(&dir)?;
    assert!(!t.add_bos_token);
    assert_eq!(t.encode("12345 apples")?.len(), 3);

    // named templates: "default" taken; without it refused naming the key
    let named = json!([{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ bos_token }}"}]);
    let dir = hf_folder(
        "tokenizers-named",
        json!({"bos_token": bos, "chat_template": named}),
        true,
    );
    let t = TextTokenizer::from_hf_dir(&dir)?;
    assert_eq!(t.chat_template.as_deref(), Some("D{{ bos_token }}"));
    assert_eq!(t.apply_chat_template(&[], false)?, format!("D{bos}"));
    // chat_template.jinja when the config has none
    let dir = hf_folder("tokenizers-jinja", json!({}), true);
    std::fs::write(dir.join("chat_template.jinja"), "J")?;
    assert_eq!(
        TextTokenizer::from_hf_dir(&dir)?.chat_template.as_deref(),
        Some("J")
    );

    for (tag, config, post, key) in [
        (
            "no-default",
            json!({"chat_template": [{"name": "tool_use", "template": "T"}]}),
            true,
            "chat_template",
        ),
        (
            "tmpl-type",
            json!({"chat_template": 3}),
            true,
            "chat_template",
        ),
        ("bos-type", json!({"bos_token": 7}), true, "bos_token"),
        (
            "bos-obj",
            json!({"bos_token": {"text": bos}}),
            true,
            "bos_token",
        ),
        (
            "flag-type",
            json!({"add_eos_token": "yes"}),
            true,
            "add_eos_token",
        ),
        (
            "contradiction",
            json!({"bos_token": bos, "add_bos_token": false}),
            true,
            "add_bos_token",
        ),
        (
            "unnamed",
            json!({"add_bos_token": true}),
            false,
            "add_bos_token",
        ),
    ] {
        let dir = hf_folder(&format!("tokenizers-{tag}"), config, post);
        let err = format!("{:#}", TextTokenizer::from_hf_dir(&dir).err().unwrap());
        assert!(
            err.contains("tokenizer_config.json") && err.contains(key),
            "{tag}: {err}"
        );
        std::fs::remove_dir_all(&dir)?;
    }
    // no tokenizer.json: named
    let dir = tmp("tokenizers-empty");
    let err = format!("{:#}", TextTokenizer::from_hf_dir(&dir).err().unwrap());
    assert!(err.contains("tokenizer.json"), "{err}");
    Ok(())
}
