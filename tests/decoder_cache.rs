//! The decoder's KV cache (issue 37 review): a sliding-window layer keeps only the positions a
//! later query sees (bounded memory) and generation past several windows equals the full
//! recompute; a forward that fails mid-way leaves the cache as it was (all or nothing). And
//! the GGUF reader's errors name the file and key.

#![cfg(feature = "tokenizers")]

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use wick::models::family::{Family, LayerType};
use wick::models::files::Gguf;
use wick::models::tokenizer::TextTokenizer;
use wick::models::{Decoder, DecoderConfig, DecoderWeights, FineTune, KvCache};
use wick::params::ParamStore;
use wick::Precision;

const VOCAB: usize = 96;

/// Random weights of `config`, the linears and the table scaled up (std 0.4) so that the
/// attention is far from uniform and a wrong key set shows in the logits.
fn weights(config: DecoderConfig) -> DecoderWeights {
    let mut w = DecoderWeights::random(config, 5).unwrap();
    for t in w.tensors.values_mut() {
        if t.rank() == 2 {
            *t = t.affine(20.0, 0.0).unwrap();
        }
    }
    w
}

fn build(w: &DecoderWeights) -> (ParamStore, Decoder) {
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 5);
    let m = Decoder::new(&store, w, &FineTune::Full).expect("model");
    (store, m)
}

fn row(logits: &Tensor, i: usize) -> Vec<f32> {
    logits
        .narrow(1, i, 1)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap() as u32
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn forward(m: &Decoder, ids: &[u32], cache: &mut KvCache) -> anyhow::Result<Tensor> {
    let x = Tensor::from_slice(ids, (1, ids.len()), &Device::Cpu)?;
    m.forward_cached(&x, cache)
}

#[test]
fn windowed_cache_is_bounded_and_equals_full_recompute() {
    for family in [Family::Mistral, Family::Gemma3] {
        let config = DecoderConfig::tiny_family(family, VOCAB);
        let window = config.sliding_window.unwrap();
        let windowed: Vec<bool> = (0..config.num_hidden_layers)
            .map(|i| config.layer_window(i).is_some())
            .collect();
        let (_s, m) = build(&weights(config));
        let prompt = [3u32, 17, 40, 5, 61, 9, 22];
        let mut cache = KvCache::default();
        let mut seq = prompt.to_vec();
        let mut logits = forward(&m, &prompt, &mut cache).unwrap();
        let mut last = row(&logits, prompt.len() - 1);
        for step in 0..40 {
            // the full recompute of the whole sequence, with a fresh cache
            let full = forward(&m, &seq, &mut KvCache::default()).unwrap();
            let want = row(&full, seq.len() - 1);
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = max_diff(&last, &want);
            assert!(
                d <= 1e-4 * scale.max(1.0),
                "{family:?} step {step} (position {}): cached logits differ by {d} (max {scale})",
                seq.len() - 1
            );
            let lens = cache.block_positions();
            assert_eq!(cache.len(), seq.len(), "{family:?}");
            for (i, (&n, &w)) in lens.iter().zip(&windowed).enumerate() {
                let want_n = if w {
                    seq.len().min(window - 1)
                } else {
                    seq.len()
                };
                assert_eq!(
                    n,
                    want_n,
                    "{family:?} block {i} after {} positions",
                    seq.len()
                );
                assert!(
                    !w || n < window,
                    "{family:?} block {i}: {n} cached positions"
                );
            }
            let id = argmax(&last);
            seq.push(id);
            logits = forward(&m, &[id], &mut cache).unwrap();
            last = row(&logits, 0);
        }
        assert!(seq.len() > 5 * window, "{family:?}: past several windows");
        // several tokens at once over a trimmed cache: the rows of the full recompute
        let more = [11u32, 2, 73, 30, 8, 45, 19];
        let start = seq.len();
        let got = forward(&m, &more, &mut cache).unwrap();
        seq.extend(more);
        let full = forward(&m, &seq, &mut KvCache::default()).unwrap();
        for i in 0..more.len() {
            let (a, b) = (row(&got, i), row(&full, start + i));
            let d = max_diff(&a, &b);
            assert!(
                d <= 1e-4 * b.iter().fold(1f32, |a, v| a.max(v.abs())),
                "{family:?} row {i}: {d}"
            );
        }
        assert_eq!(
            m.generate(&prompt, 40, 0.0, 0).unwrap(),
            {
                let mut s = prompt.to_vec();
                for _ in 0..40 {
                    let l = forward(&m, &s, &mut KvCache::default()).unwrap();
                    s.push(argmax(&row(&l, s.len() - 1)));
                }
                s[prompt.len()..].to_vec()
            },
            "{family:?}: generate"
        );
    }
}

#[test]
fn a_failed_forward_leaves_the_cache_as_it_was() {
    // model a: Gemma 3 tiny (sliding, sliding, full); model b: its shapes with (sliding, full,
    // full), so that a's cache passes b's first block and fails in its second (a's holds
    // W - 1 positions there, b's full layer expects every one)
    let config = DecoderConfig::tiny_family(Family::Gemma3, VOCAB);
    let window = config.sliding_window.unwrap();
    let mut other = config.clone();
    other.layer_types = Some(vec![LayerType::Sliding, LayerType::Full, LayerType::Full]);
    let (_sa, a) = build(&weights(config));
    let (_sb, b) = build(&weights(other));
    let prompt: Vec<u32> = (0..2 * window as u32)
        .map(|i| (i * 7 + 3) % VOCAB as u32)
        .collect();
    let mut cache = KvCache::default();
    forward(&a, &prompt, &mut cache).unwrap();
    let before = cache.clone();
    let positions = cache.block_positions();
    assert_eq!(positions, [window - 1, window - 1, prompt.len()]);

    let err = forward(&b, &[4], &mut cache).unwrap_err();
    let msg = format!("{err:#}");
    assert!(msg.contains("cached positions"), "{msg}");
    assert_eq!(cache.len(), prompt.len());
    assert_eq!(cache.block_positions(), positions);

    // the next call works and equals the call on the untouched copy (block 0's cache was
    // not extended by the failed forward)
    let mut untouched = before;
    let want = row(&forward(&a, &[4], &mut untouched).unwrap(), 0);
    let got = row(&forward(&a, &[4], &mut cache).unwrap(), 0);
    assert_eq!(got, want);
    assert_eq!(cache.len(), prompt.len() + 1);

    // a failure before any block (an id outside the vocabulary) changes nothing either
    let ids = Tensor::from_slice(&[VOCAB as u32 + 5], (1, 1), &Device::Cpu).unwrap();
    let len = cache.len();
    assert!(a.forward_cached(&ids, &mut cache).is_err());
    assert_eq!(cache.len(), len);
    forward(&a, &[6], &mut cache).unwrap();
    assert_eq!(cache.len(), len + 1);
}

/// A tensor-less GGUF of `meta` in a fresh temp folder.
fn gguf_of(name: &str, meta: &[(&str, gguf_file::Value)]) -> std::path::PathBuf {
    let dir =
        std::env::temp_dir().join(format!("wick-decoder-cache-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{name}.gguf"));
    let refs: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    gguf_file::write(&mut std::fs::File::create(&path).unwrap(), &refs, &[]).unwrap();
    path
}

#[test]
fn gguf_errors_name_the_file_and_key() {
    use gguf_file::Value as V;
    let base = || {
        vec![
            ("general.architecture", V::String("llama".into())),
            ("llama.attention.head_count", V::U32(4)),
            ("llama.embedding_length", V::U32(64)),
            ("llama.context_length", V::U32(64)),
            ("llama.block_count", V::U32(2)),
            ("llama.feed_forward_length", V::U32(96)),
            ("llama.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
            ("llama.vocab_size", V::U32(96)),
        ]
    };
    for (key, bad) in [
        ("llama.vocab_size", V::String("96".into())),
        ("llama.attention.head_count_kv", V::String("2".into())),
        (
            "llama.attention.layer_norm_rms_epsilon",
            V::String("eps".into()),
        ),
        ("llama.rope.freq_base", V::String("1e4".into())),
        ("llama.block_count", V::String("2".into())),
    ] {
        let mut meta: Vec<(&str, V)> = base().into_iter().filter(|(k, _)| *k != key).collect();
        meta.push((key, bad));
        let path = gguf_of(&key.replace('.', "_"), &meta);
        let err = Gguf::open(&path).unwrap().config().unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains(key) && msg.contains(&path.display().to_string()),
            "{key}: {msg}"
        );
    }
    // a token_type list of another length than the tokens is refused, naming the key
    let meta = vec![
        ("general.architecture", V::String("llama".into())),
        ("tokenizer.ggml.model", V::String("gpt2".into())),
        (
            "tokenizer.ggml.tokens",
            V::Array(["a", "b", "c"].map(|s| V::String(s.into())).to_vec()),
        ),
        (
            "tokenizer.ggml.token_type",
            V::Array(vec![V::I32(1), V::I32(3)]),
        ),
    ];
    let path = gguf_of("token_type", &meta);
    let Err(err) = TextTokenizer::from_gguf(&Gguf::open(&path).unwrap()) else {
        panic!("a token_type of 2 entries for 3 tokens was accepted")
    };
    let msg = format!("{err:#}");
    assert!(
        msg.contains("tokenizer.ggml.token_type has 2 entries"),
        "{msg}"
    );
}
