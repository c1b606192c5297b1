//! Packed and padded chat batches (issue 38 item 2) on every family's tiny config (f32, CPU):
//! the packed loss and every gradient equal those of each example run alone through the model
//! written out in plain candle ops (`common::decoder_reference`, its cross-entropy read only at
//! the trained targets), and the padded batch gives the same. The examples are longer than
//! Mistral's and Gemma 3's windows, so windows and document boundaries both bind.

#![cfg(feature = "tokenizers")]

mod common;

use candle_core::{Device, Tensor};
use common::{decoder_reference as reference, max_abs};
use std::collections::HashMap;
use wick::data::chat::{Tokenized, IGNORE_INDEX};
use wick::data::packing::{pack, TrainBatch};
use wick::models::family::Family;
use wick::models::{Decoder, DecoderConfig, FineTune};
use wick::params::ParamStore;
use wick::Precision;

const VOCAB: usize = 96;
const FAMILIES: [Family; 5] = [
    Family::Llama,
    Family::Mistral,
    Family::Qwen2,
    Family::Qwen3,
    Family::Gemma3,
];

/// An example of `n` tokens whose labels are trained on positions `from..` except every
/// fourth (an assistant turn with a masked token inside).
fn example(n: usize, from: usize, seed: u64) -> Tokenized {
    let ids: Vec<u32> = (0..n as u64)
        .map(|i| ((i * 31 + seed * 17 + i * i * 3) % VOCAB as u64) as u32)
        .collect();
    let labels = ids
        .iter()
        .enumerate()
        .map(|(k, &id)| match k >= from && k % 4 != 3 {
            true => id as i64,
            false => IGNORE_INDEX,
        })
        .collect();
    Tokenized {
        ids,
        labels,
        merged_boundaries: 0,
    }
}

/// Sum over the trained targets of one example's cross-entropy by the plain reference.
fn reference_sum(cfg: &DecoderConfig, w: &HashMap<String, Tensor>, ex: &Tokenized) -> Tensor {
    let n = ex.ids.len();
    let ids = Tensor::from_vec(ex.ids.clone(), (1, n), &Device::Cpu).unwrap();
    let logits = reference::logits(cfg, w, &HashMap::new(), 1.0, &ids)
        .squeeze(0)
        .unwrap();
    let logp = candle_nn::ops::log_softmax(&logits, 1).unwrap();
    let mut terms = Vec::new();
    for k in 1..n {
        if ex.labels[k] != IGNORE_INDEX {
            let row = logp.get(k - 1).unwrap();
            terms.push(row.get(ex.labels[k] as usize).unwrap().neg().unwrap());
        }
    }
    Tensor::stack(&terms, 0).unwrap().sum_all().unwrap()
}

fn relative(a: &Tensor, b: &Tensor) -> f32 {
    max_abs(a, b) / max_abs(b, &b.zeros_like().unwrap()).max(1e-6)
}

#[test]
fn pack_groups_in_order_by_the_budget() {
    let lengths = [5, 3, 4, 8, 1, 2];
    let steps = pack(&lengths, &[0, 1, 2, 3, 4, 5], 8).unwrap();
    assert_eq!(steps, vec![vec![0, 1], vec![2], vec![3], vec![4, 5]]);
    let steps = pack(&lengths, &[5, 4, 3, 2, 1, 0], 9).unwrap();
    assert_eq!(steps, vec![vec![5, 4], vec![3], vec![2, 1], vec![0]]);
    let e = pack(&lengths, &[3], 7).unwrap_err().to_string();
    assert!(
        e.contains("example 3 has 8 tokens") && e.contains("budget of 7"),
        "{e}"
    );
    assert!(pack(&lengths, &[6], 8).is_err());
    assert!(pack(&lengths, &[0], 0).is_err());
    assert!(pack(&[0], &[0], 8).is_err());
}

#[test]
fn batches_gather_the_trained_rows() {
    let a = example(6, 2, 1); // trained labels at 2, 4, 5 (3 is masked)
    let b = example(3, 0, 2); // trained labels at 1, 2 (0 has no predecessor)
    let packed = TrainBatch::packed(&[&a, &b], &Device::Cpu).unwrap();
    assert_eq!(packed.ids().dims(), &[1, 9]);
    assert_eq!(packed.segments().unwrap().cu_seqlens(), &[0, 6, 9]);
    let rows: Vec<u32> = packed.rows().to_vec1().unwrap();
    assert_eq!(rows, vec![1, 3, 4, 6, 7]);
    let targets: Vec<u32> = packed.targets().to_vec1().unwrap();
    let want = [a.ids[2], a.ids[4], a.ids[5], b.ids[1], b.ids[2]];
    assert_eq!(targets, want);
    assert_eq!((packed.trained_targets(), packed.tokens()), (5, 9));
    let padded = TrainBatch::padded(&[&a, &b], &Device::Cpu).unwrap();
    assert_eq!(padded.ids().dims(), &[2, 6]);
    let rows: Vec<u32> = padded.rows().to_vec1().unwrap();
    assert_eq!(rows, vec![1, 3, 4, 6, 7]);
    assert!(padded.segments().is_none());
    let mut bad = a.clone();
    bad.labels.pop();
    assert!(TrainBatch::packed(&[&bad], &Device::Cpu).is_err());
    assert!(TrainBatch::padded(&[], &Device::Cpu).is_err());
}

/// The packed and padded losses and gradients of three examples equal the reference's sum
/// over each example alone divided by the trained targets (full fine-tuning; LoRA shares
/// the path after the linears, checked in tests/families.rs).
#[test]
fn packed_and_padded_losses_and_gradients_match_each_example_alone() {
    let examples = [example(11, 3, 1), example(4, 1, 2), example(9, 0, 3)];
    let refs: Vec<&Tokenized> = examples.iter().collect();
    let trained: usize = examples.iter().map(Tokenized::trained_targets).sum();
    for family in FAMILIES {
        let mut config = DecoderConfig::tiny_family(family, VOCAB);
        config.tie_word_embeddings = family == Family::Gemma3;
        let w = reference::drawn_weights(config, 5);
        // activation checkpointing runs each block as its composition, recomputed
        for checkpointing in [false, true] {
            let store = ParamStore::new(Precision::Fp32, Device::Cpu, 3);
            let mut m = Decoder::new(&store, &w, &FineTune::Full).unwrap();
            m.set_checkpointing(checkpointing).unwrap();
            // the reference on Vars of the same tensors
            let (vars, plain) = reference::vars(&w);
            let sums: Vec<Tensor> = examples
                .iter()
                .map(|e| reference_sum(&w.config, &plain, e))
                .collect();
            let want =
                (Tensor::stack(&sums, 0).unwrap().sum_all().unwrap() / trained as f64).unwrap();
            let want_grads = want.backward().unwrap();
            for (layout, batch) in [
                ("packed", TrainBatch::packed(&refs, &Device::Cpu).unwrap()),
                ("padded", TrainBatch::padded(&refs, &Device::Cpu).unwrap()),
            ] {
                let what = format!("{family:?} {layout} checkpointing={checkpointing}");
                let loss = m.batch_loss(&batch).unwrap();
                let grads = loss.backward().unwrap();
                let dl =
                    (loss.to_scalar::<f32>().unwrap() - want.to_scalar::<f32>().unwrap()).abs();
                assert!(dl < 1e-5, "{what}: loss differs by {dl}");
                for p in store.params() {
                    let ours = grads.get(p.differentiated()).expect("gradient");
                    let theirs = want_grads
                        .get(vars[&p.name].as_tensor())
                        .unwrap_or_else(|| panic!("{what}: no reference gradient of {}", p.name));
                    let d = relative(ours, theirs);
                    assert!(d < 1e-4, "{what} {}: relative gradient error {d}", p.name);
                }
            }
        }
    }
}

#[test]
fn steps_file_holds_each_steps_examples() {
    let ex = [example(5, 1, 1), example(3, 0, 2), example(4, 2, 3)];
    let dir = common::tmp("packing_steps");
    let path = dir.join("steps.jsonl");
    let steps = vec![vec![2, 0], vec![1]];
    wick::data::packing::write_steps_jsonl(&path, &steps, &ex).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for (line, step) in lines.iter().zip(&steps) {
        for (k, &i) in step.iter().enumerate() {
            let ids: Vec<u32> = serde_json::from_value(line["ids"][k].clone()).unwrap();
            let labels: Vec<i64> = serde_json::from_value(line["labels"][k].clone()).unwrap();
            assert_eq!((ids, labels), (ex[i].ids.clone(), ex[i].labels.clone()));
        }
    }
    assert!(wick::data::packing::write_steps_jsonl(&path, &[vec![3]], &ex).is_err());
}

/// The evaluation loss runs without LoRA dropout: the same every time, and equal to the
/// training loss of the same adapters with dropout 0; the training loss with dropout differs.
#[test]
fn eval_loss_has_no_dropout() {
    let w = reference::drawn_weights(DecoderConfig::tiny_family(Family::Qwen2, VOCAB), 9);
    let ex = [example(11, 3, 1), example(6, 1, 2)];
    let batch = TrainBatch::packed(&[&ex[0], &ex[1]], &Device::Cpu).unwrap();
    let model = |dropout: f64| {
        let mut lora = wick::lora::LoraConfig::all_linear(4, 8.0);
        lora.dropout = dropout;
        let store = ParamStore::new(Precision::Fp32, Device::Cpu, 3);
        let m = Decoder::new(&store, &w, &FineTune::Lora(lora)).unwrap();
        // B drawn non-zero so that the adapters (and their dropout) change the loss
        for p in store.params() {
            let v: Vec<f32> = (0..p.master.elem_count())
                .map(|i| ((i * 37 % 101) as f32 / 101.0 - 0.5) * 0.2)
                .collect();
            let t = Tensor::from_vec(v, p.master.shape(), &Device::Cpu).unwrap();
            p.master.set(&t).unwrap();
        }
        store.refresh_working_copies().unwrap();
        (store, m)
    };
    let scalar = |t: Tensor| t.to_scalar::<f32>().unwrap();
    let (_s, with) = model(0.5);
    let (_t, without) = model(0.0);
    let eval = scalar(with.eval_loss(&batch).unwrap());
    assert_eq!(eval, scalar(with.eval_loss(&batch).unwrap()));
    let plain = scalar(without.batch_loss(&batch).unwrap());
    assert!(
        (eval - plain).abs() < 1e-6,
        "eval {eval} vs dropout-free {plain}"
    );
    let trained = scalar(with.batch_loss(&batch).unwrap());
    assert!(
        (trained - plain).abs() > 1e-4,
        "dropout changed nothing: {trained}"
    );
}
