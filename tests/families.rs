//! Every decoder family on tiny random weights (f32, CPU), against independent references:
//! candle-transformers 0.11.1's own `mistral`, `qwen2`, `qwen3` and `gemma3` on the same
//! tensors (logits), the model written out in plain candle ops (`common::decoder_reference`:
//! loss and every gradient, full fine-tuning and LoRA), and the full forward (KV-cache greedy
//! decoding). The tiny configs make every switch bind: windows shorter than the sequence,
//! head widths other than hidden / heads, Gemma's sliding/global pattern with two RoPE bases
//! and `query_pre_attn_scalar`; norm gains and biases are drawn away from their initial values.

mod common;

use candle_core::{Device, Tensor, Var};
use common::{decoder_reference as reference, max_abs};
use std::collections::HashMap;
use wick::lora::LoraConfig;
use wick::models::family::Family;
use wick::models::{Decoder, DecoderConfig, DecoderWeights, FineTune, KvCache};
use wick::params::ParamStore;
use wick::Precision;

const FAMILIES: [Family; 4] = [
    Family::Mistral,
    Family::Qwen2,
    Family::Qwen3,
    Family::Gemma3,
];
const VOCAB: usize = 96;

/// Random weights of `family`'s tiny config, every 1-D tensor (norm gains, biases) drawn
/// from `U(-0.5, 0.5)` around its initial value so that a dropped or misplaced one shows.
fn weights(family: Family, tied: bool) -> DecoderWeights {
    let mut config = DecoderConfig::tiny_family(family, VOCAB);
    config.tie_word_embeddings = tied;
    reference::drawn_weights(config, 11)
}

fn ids(b: usize, t: usize, seed: u64) -> (Tensor, Tensor) {
    let all: Vec<u32> = (0..(b * (t + 1)) as u64)
        .map(|i| ((i * 37 + seed * 13 + i * i * 5) % VOCAB as u64) as u32)
        .collect();
    let all = Tensor::from_vec(all, (b, t + 1), &Device::Cpu).unwrap();
    (
        all.narrow(1, 0, t).unwrap().contiguous().unwrap(),
        all.narrow(1, 1, t).unwrap().contiguous().unwrap(),
    )
}

fn build(w: &DecoderWeights, ft: &FineTune) -> (ParamStore, Decoder) {
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 5);
    let m = Decoder::new(&store, w, ft).expect("model");
    (store, m)
}

fn relative(a: &Tensor, b: &Tensor) -> f32 {
    max_abs(a, b) / max_abs(b, &b.zeros_like().unwrap()).max(1e-6)
}

#[test]
fn logits_match_candle_transformers_and_the_plain_composition() {
    for family in FAMILIES {
        // candle-transformers' Mistral always has an lm_head
        let w = weights(family, family != Family::Mistral);
        let (_s, m) = build(&w, &FineTune::Full);
        let (x, _) = ids(1, 11, 1);
        let ours = m.forward_cached(&x, &mut KvCache::default()).unwrap();
        let plain = reference::logits(&w.config, &w.tensors, &HashMap::new(), 1.0, &x);
        let d = relative(&ours, &plain);
        assert!(
            d < 1e-4,
            "{family:?}: logits differ from the plain composition by {d}"
        );
        // candle-transformers' Gemma 3 scales by head_dim^-1/2: compare it with that scale
        let mut c = w.clone();
        if family == Family::Gemma3 {
            c.config.query_pre_attn_scalar = Some(c.config.head_dim() as f64);
        }
        let (_s, m) = build(&c, &FineTune::Full);
        let ours = m.forward_cached(&x, &mut KvCache::default()).unwrap();
        let last = ours.narrow(1, 10, 1).unwrap().flatten_all().unwrap();
        let theirs = reference::candle_transformers_last_logits(&c.config, &c.tensors, &x)
            .unwrap_or_else(|e| panic!("{family:?}: candle-transformers: {e:#}"));
        let d = relative(&last, &theirs);
        assert!(
            d < 1e-4,
            "{family:?}: logits differ from candle-transformers by {d}"
        );
    }
}

#[test]
fn full_loss_and_gradients_match_the_plain_composition() {
    for family in FAMILIES {
        let w = weights(family, false);
        let (store, m) = build(&w, &FineTune::Full);
        let (x, y) = ids(2, 9, 2);
        let loss = m.loss(&x, &y).unwrap();
        let grads = loss.backward().unwrap();
        let (vars, plain) = reference::vars(&w);
        let ref_loss = reference::loss(&w.config, &plain, &HashMap::new(), 1.0, &x, &y);
        let ref_grads = ref_loss.backward().unwrap();
        let dl = (loss.to_scalar::<f32>().unwrap() - ref_loss.to_scalar::<f32>().unwrap()).abs();
        assert!(dl < 1e-5, "{family:?}: loss differs by {dl}");
        assert_eq!(store.len(), w.tensors.len());
        for p in store.params() {
            let ours = grads.get(p.differentiated()).expect("gradient");
            let theirs = ref_grads.get(vars[&p.name].as_tensor()).expect("reference");
            let d = relative(ours, theirs);
            assert!(
                d < 1e-4,
                "{family:?} {}: relative gradient error {d}",
                p.name
            );
        }
    }
}

#[test]
fn lora_on_every_linear_matches_the_plain_composition() {
    // Qwen2's biased q/k/v take their adapters beside the bias; B drawn non-zero
    for family in FAMILIES {
        let w = weights(family, true);
        let lora = LoraConfig::all_linear(4, 8.0);
        let (store, m) = build(&w, &FineTune::Lora(lora.clone()));
        for p in store.params() {
            let n = p.master.elem_count();
            let v: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 / 101.0 - 0.5) * 0.1)
                .collect();
            p.master
                .set(&Tensor::from_vec(v, p.master.shape(), &Device::Cpu).unwrap())
                .unwrap();
        }
        store.refresh_working_copies().unwrap();
        let (x, y) = ids(2, 9, 3);
        let loss = m.loss(&x, &y).unwrap();
        let grads = loss.backward().unwrap();
        let mut adapters = HashMap::new();
        let mut vars = HashMap::new();
        let masters = m.adapter_masters(&store).unwrap();
        for (name, t) in &masters {
            let var = Var::from_tensor(&t.contiguous().unwrap()).unwrap();
            vars.insert(name.clone(), var);
        }
        for name in masters.iter().map(|(n, _)| n) {
            if let Some(module) = name.strip_suffix(".lora_A.weight") {
                let a = vars[name].as_tensor().clone();
                let b = vars[&format!("{module}.lora_B.weight")].as_tensor().clone();
                adapters.insert(module.to_string(), (a, b));
            }
        }
        assert_eq!(adapters.len(), 7 * w.config.num_hidden_layers, "{family:?}");
        let ref_loss = reference::loss(&w.config, &w.tensors, &adapters, lora.scaling(), &x, &y);
        let ref_grads = ref_loss.backward().unwrap();
        let dl = (loss.to_scalar::<f32>().unwrap() - ref_loss.to_scalar::<f32>().unwrap()).abs();
        assert!(dl < 1e-5, "{family:?}: LoRA loss differs by {dl}");
        // each stacked store parameter's gradient: its modules' reference gradients stacked
        for p in store.params() {
            let ours = grads.get(p.differentiated()).expect("gradient");
            let (stack, kind) = p.name.rsplit_once(".lora_").expect("an adapter");
            let parts: Vec<Tensor> = wick::lora::stacked_modules(stack)
                .iter()
                .map(|module| {
                    let var = &vars[&format!("{module}.lora_{kind}")];
                    ref_grads
                        .get(var.as_tensor())
                        .expect("reference gradient")
                        .clone()
                })
                .collect();
            let theirs = Tensor::cat(&parts, 0).unwrap();
            let d = relative(ours, &theirs);
            assert!(
                d < 1e-4,
                "{family:?} {}: relative gradient error {d}",
                p.name
            );
        }
    }
}

#[test]
fn kv_cache_greedy_equals_full_recompute() {
    for family in FAMILIES {
        let w = weights(family, true);
        let (_s, m) = build(&w, &FineTune::Full);
        let prompt = [3u32, 17, 40, 5];
        let cached = m.generate(&prompt, 9, 0.0, 0).unwrap();
        let mut seq = prompt.to_vec();
        for _ in 0..9 {
            let x = Tensor::from_slice(&seq, (1, seq.len()), &Device::Cpu).unwrap();
            let l = m.forward_cached(&x, &mut KvCache::default()).unwrap();
            let last: Vec<f32> = l
                .narrow(1, seq.len() - 1, 1)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let id = (0..last.len())
                .max_by(|&a, &b| last[a].total_cmp(&last[b]))
                .unwrap() as u32;
            seq.push(id);
        }
        assert_eq!(cached, seq[prompt.len()..], "{family:?}");
        // past the window: the cache holds more positions than a sliding layer attends to
        assert!(
            seq.len() > w.config.sliding_window.unwrap_or(0),
            "{family:?}"
        );
    }
}
