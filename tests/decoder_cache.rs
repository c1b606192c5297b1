//! The decoder's KV cache (issue 37 review): a sliding-window layer keeps only the positions a
//! later query sees (bounded memory) and generation past several windows equals the full
//! recompute; a forward that fails mid-way leaves the cache as it was (all or nothing).

use candle_core::{Device, Tensor};
use wick::models::family::{Family, LayerType};
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
