//! The continuous-batching scheduler and its paged KV cache (issue 40), in f32 on the CPU
//! with tiny random models: the paged forward of a mixed batch equals each sequence's own
//! cached forward (every family: grouped KV, sliding windows, Gemma's scale); reused blocks
//! hold no stale keys; 64 concurrent requests over three adapters give the tokens of
//! single-request greedy generation; seeded sampling does not depend on batch neighbours;
//! stop strings, admission control and version pinning; the BGMV batched-LoRA reference
//! gathers each row's adapter.

use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;
use wick::lora::LoraConfig;
use wick::models::family::Family;
use wick::models::{
    BlockTable, Decoder, DecoderConfig, DecoderWeights, FineTune, KvCache, PagedBatchEntry,
    PagedKvCache,
};
use wick::params::ParamStore;
use wick::serve::{
    Event, FinishReason, Request, SamplingParams, Scheduler, SchedulerConfig, SubmitError,
};
use wick::Precision;

const VOCAB: usize = 96;

/// Random weights of `config`, the matrices scaled up (std 0.4) so that attention is far
/// from uniform and a wrong key shows in the logits.
fn weights(config: DecoderConfig, seed: u64) -> DecoderWeights {
    let mut w = DecoderWeights::random(config, seed).unwrap();
    for t in w.tensors.values_mut() {
        if t.rank() == 2 {
            *t = t.affine(20.0, 0.0).unwrap();
        }
    }
    w
}

fn full(config: DecoderConfig, seed: u64) -> Decoder {
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, seed);
    Decoder::new(&store, &weights(config, seed), &FineTune::Full).unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Logits of the last of `ids` after `prefix`, by the plain KV-cached forward of one sequence.
fn cached_last(m: &Decoder, tokens: &[u32]) -> Vec<f32> {
    let x = Tensor::from_slice(tokens, (1, tokens.len()), &Device::Cpu).unwrap();
    let logits = m.forward_cached(&x, &mut KvCache::default()).unwrap();
    logits
        .narrow(1, tokens.len() - 1, 1)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + seed * 11 + 5) % VOCAB as u32)
        .collect()
}

/// Runs `seqs` (full token lists) through the paged cache in chunks, several sequences per
/// batch at different positions, and checks every row against the sequence's own forward.
fn check_paged_against_cached(m: &Decoder, cache: &mut PagedKvCache, seqs: &[Vec<u32>]) {
    let chunks = [5usize, 1, 3, 1, 7, 1, 1, 2];
    let mut tables: Vec<BlockTable> = seqs
        .iter()
        .map(|s| cache.allocate(s.len()).unwrap())
        .collect();
    let mut fed = vec![0usize; seqs.len()];
    let mut round = 0;
    while fed.iter().zip(seqs).any(|(f, s)| *f < s.len()) {
        let mut plan = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            // every sequence takes its own chunk size this round; some sit a round out
            if fed[i] < s.len() && (round + i) % 4 != 3 {
                let n = chunks[(round + i) % chunks.len()].min(s.len() - fed[i]);
                plan.push((i, n));
            }
        }
        if plan.is_empty() {
            round += 1;
            continue;
        }
        let entries: Vec<PagedBatchEntry> = plan
            .iter()
            .map(|&(i, n)| PagedBatchEntry {
                ids: &seqs[i][fed[i]..fed[i] + n],
                start: fed[i],
                table: &tables[i],
            })
            .collect();
        let logits: Vec<Vec<f32>> = m.forward_paged(&entries, cache).unwrap().to_vec2().unwrap();
        for (&(i, n), row) in plan.iter().zip(&logits) {
            fed[i] += n;
            let want = cached_last(m, &seqs[i][..fed[i]]);
            let d = max_diff(row, &want);
            assert!(
                d < 1e-4,
                "sequence {i} at {} tokens: paged vs cached differ by {d}",
                fed[i]
            );
        }
        round += 1;
    }
    for t in tables.drain(..) {
        cache.release(t);
    }
}

#[test]
fn paged_batches_equal_each_sequences_cached_forward_in_every_family() {
    for family in [
        Family::Llama,
        Family::Qwen2,
        Family::Qwen3,
        Family::Mistral,
        Family::Gemma3,
    ] {
        let m = full(DecoderConfig::tiny_family(family, VOCAB), 3);
        // blocks of 4: sequences cross several blocks, taken from an interleaved free list
        let mut cache = m.paged_cache(4, 40).unwrap();
        let seqs: Vec<Vec<u32>> = [11usize, 3, 17, 8, 1]
            .iter()
            .enumerate()
            .map(|(i, &n)| tokens(i as u32, n))
            .collect();
        check_paged_against_cached(&m, &mut cache, &seqs);
        assert_eq!(cache.free_blocks(), 40, "{family:?}: blocks not given back");
    }
}

#[test]
fn reused_blocks_hold_no_stale_keys() {
    let m = full(DecoderConfig::tiny(VOCAB), 4);
    let mut cache = m.paged_cache(8, 3).unwrap();
    // fill all three blocks with one long sequence, free them, then run a shorter, different
    // sequence in the same blocks: its last block holds stale keys past its own positions
    let long = tokens(7, 24);
    let t = cache.allocate(long.len()).unwrap();
    let first_blocks = t.blocks().to_vec();
    let entry = PagedBatchEntry {
        ids: &long,
        start: 0,
        table: &t,
    };
    m.forward_paged(&[entry], &cache).unwrap();
    cache.release(t);
    let short = tokens(2, 13);
    let reused = cache.allocate(short.len()).unwrap();
    assert!(
        reused.blocks().iter().all(|b| first_blocks.contains(b)),
        "the second sequence should reuse the first one's blocks"
    );
    let mut fresh = m.paged_cache(8, 3).unwrap();
    let fresh_t = fresh.allocate(short.len()).unwrap();
    // prefill 9, then decode the rest one token at a time, on both caches
    let mut at = 0;
    for n in [9, 1, 1, 1, 1] {
        let run = |cache: &PagedKvCache, table: &BlockTable| -> Vec<f32> {
            let e = PagedBatchEntry {
                ids: &short[at..at + n],
                start: at,
                table,
            };
            let l = m.forward_paged(&[e], cache).unwrap();
            l.flatten_all().unwrap().to_vec1().unwrap()
        };
        let (a, b) = (run(&cache, &reused), run(&fresh, &fresh_t));
        at += n;
        assert_eq!(a, b, "reused blocks changed the logits at {at} tokens");
        let want = cached_last(&m, &short[..at]);
        assert!(max_diff(&a, &want) < 1e-4);
    }
}

/// What one request received.
#[derive(Debug, Default, Clone)]
struct Answer {
    ids: Vec<u32>,
    text: String,
    reason: Option<FinishReason>,
    failed: Option<String>,
}

/// The request's callback, sending its events to a channel, and the channel's end.
fn listener() -> (wick::serve::OnEvent, mpsc::Receiver<Event>) {
    let (tx, rx) = mpsc::channel();
    (Box::new(move |e| tx.send(e).is_ok()), rx)
}

fn gather(rx: &mpsc::Receiver<Event>) -> Answer {
    let mut a = Answer::default();
    loop {
        match rx.recv_timeout(Duration::from_secs(120)).expect("an event") {
            Event::Token { id, text } => {
                a.ids.push(id);
                a.text.push_str(&text);
            }
            Event::Done { reason, text, .. } => {
                a.text.push_str(&text);
                a.reason = Some(reason);
                return a;
            }
            Event::Failed(m) => {
                a.failed = Some(m);
                return a;
            }
        }
    }
}

fn submit(
    s: &Scheduler<Decoder>,
    model: &Arc<Decoder>,
    prompt: Vec<u32>,
    params: SamplingParams,
) -> mpsc::Receiver<Event> {
    let (on_event, rx) = listener();
    let r = Request {
        model: model.clone(),
        prompt,
        params,
        on_event,
    };
    s.submit(r).unwrap();
    rx
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ..Default::default()
    }
}

/// A LoRA model and two more over the same base with other random adapters.
fn three_adapters() -> Vec<Arc<Decoder>> {
    let mut config = DecoderConfig::tiny(VOCAB);
    config.max_position_embeddings = 128;
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 9);
    let lora = FineTune::Lora(LoraConfig::all_linear(4, 8.0));
    let base = Decoder::new(&store, &weights(config, 9), &lora).unwrap();
    let mut models = vec![];
    for k in 0..3u64 {
        let adapters: HashMap<String, Tensor> = base
            .adapter_tensors()
            .into_iter()
            .enumerate()
            .map(|(i, (name, t))| {
                let r = Tensor::randn(0f32, 0.3, t.dims(), &Device::Cpu).unwrap();
                let r = r
                    .affine(1.0, (k as f64 - 1.0) * 0.01 * (i % 3) as f64)
                    .unwrap();
                (name, r)
            })
            .collect();
        models.push(Arc::new(base.with_adapters(&adapters).unwrap()));
    }
    models
}

#[test]
fn sixty_four_concurrent_requests_over_three_adapters_equal_single_request_greedy() {
    let models = three_adapters();
    let config = SchedulerConfig {
        block_size: 8,
        num_blocks: 200,
        max_running: 64,
        max_waiting: 64,
        // a small budget: long prompts are prefilled in chunks beside running decodes
        step_tokens: 96,
    };
    let s = Scheduler::spawn(models[0].clone(), config, None).unwrap();
    let mut want = Vec::new();
    let mut pending = Vec::new();
    for r in 0..64usize {
        let model = &models[r % 3];
        let prompt = tokens(r as u32, 1 + (r * 7) % 40);
        let max = 1 + (r * 5) % 24;
        want.push(model.generate(&prompt, max, 0.0, 0).unwrap());
        pending.push(submit(&s, model, prompt, greedy(max)));
    }
    for (r, rx) in pending.iter().enumerate() {
        let a = gather(rx);
        assert_eq!(a.failed, None);
        assert_eq!(a.ids, want[r], "request {r} (adapter {})", r % 3);
        assert_eq!(a.reason, Some(FinishReason::Length));
    }
    assert!(
        s.stats().steps() < 64 * 12,
        "requests did not share steps: {} steps",
        s.stats().steps()
    );
    s.shutdown().unwrap();
}

#[test]
fn seeded_sampling_does_not_depend_on_batch_neighbours() {
    let models = three_adapters();
    let s = Scheduler::spawn(models[0].clone(), SchedulerConfig::default(), None).unwrap();
    let params = SamplingParams {
        max_tokens: 20,
        temperature: 0.9,
        top_p: 0.8,
        seed: 42,
        stop: vec![],
    };
    let prompt = tokens(3, 6);
    let alone = gather(&submit(&s, &models[1], prompt.clone(), params.clone()));
    let mut crowd = Vec::new();
    for r in 0..20u32 {
        let p = SamplingParams {
            seed: r as u64,
            ..params.clone()
        };
        crowd.push(submit(
            &s,
            &models[r as usize % 3],
            tokens(r, 4 + r as usize),
            p,
        ));
        if r == 10 {
            crowd.push(submit(&s, &models[1], prompt.clone(), params.clone()));
        }
    }
    let answers: Vec<Answer> = crowd.iter().map(gather).collect();
    assert_eq!(answers[11].ids, alone.ids);
    // and the sampling does sample: another seed gives another answer
    let other = SamplingParams {
        seed: 7,
        ..params.clone()
    };
    assert_ne!(
        gather(&submit(&s, &models[1], prompt, other)).ids,
        alone.ids
    );
    s.shutdown().unwrap();
}

#[test]
fn stop_strings_end_the_answer_before_them() {
    let models = three_adapters();
    // a toy detokenizer: id i is the letter of i mod 26
    let detok: wick::serve::Detokenize = Arc::new(|ids: &[u32]| {
        Ok(ids
            .iter()
            .map(|&i| (b'a' + (i % 26) as u8) as char)
            .collect())
    });
    let s = Scheduler::spawn(models[0].clone(), SchedulerConfig::default(), Some(detok)).unwrap();
    let prompt = tokens(5, 9);
    let plain = gather(&submit(&s, &models[0], prompt.clone(), greedy(12)));
    let letters: String = plain
        .ids
        .iter()
        .map(|&i| (b'a' + (i % 26) as u8) as char)
        .collect();
    assert_eq!(plain.text, letters);
    // stop at the two letters of tokens 5 and 6 (their first occurrence)
    let stop = letters[5..7].to_string();
    let at = letters.find(&stop).unwrap();
    let p = SamplingParams {
        stop: vec![stop.clone(), "zzzz".into()],
        ..greedy(12)
    };
    let a = gather(&submit(&s, &models[0], prompt, p));
    assert_eq!(a.reason, Some(FinishReason::Stop));
    assert_eq!(a.text, letters[..at]);
    assert_eq!(a.ids, plain.ids[..at + 2]);
    s.shutdown().unwrap();
}

#[test]
fn admission_waits_for_blocks_and_bounds_the_queue() {
    let models = three_adapters();
    let config = SchedulerConfig {
        block_size: 4,
        num_blocks: 4,
        max_running: 8,
        max_waiting: 2,
        step_tokens: 64,
    };
    let s = Scheduler::spawn(models[0].clone(), config, None).unwrap();
    // each request takes 10 + 5 - 1 = 14 positions, 4 blocks: one at a time
    let (prompt, max) = (tokens(1, 10), 5);
    let (hold_tx, hold_rx) = mpsc::channel::<()>();
    let (tx0, rx0) = mpsc::channel();
    let mut held = Some(hold_rx);
    let first = Request {
        model: models[0].clone(),
        prompt: prompt.clone(),
        params: greedy(max),
        // blocks the engine thread at its first token until the test has queued the rest
        on_event: Box::new(move |e| {
            if let Some(h) = held.take() {
                h.recv().unwrap();
            }
            tx0.send(e).is_ok()
        }),
    };
    s.submit(first).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while s.stats().running() == 0 {
        assert!(std::time::Instant::now() < deadline, "never admitted");
        std::thread::sleep(Duration::from_millis(5));
    }
    let second = submit(&s, &models[1], prompt.clone(), greedy(max));
    let third = submit(&s, &models[2], prompt.clone(), greedy(max));
    let (on_event, _rx) = listener();
    let busy = s.submit(Request {
        model: models[0].clone(),
        prompt: prompt.clone(),
        params: greedy(max),
        on_event,
    });
    assert_eq!(busy, Err(SubmitError::Busy { waiting: 2 }));
    let (on_event, _rx) = listener();
    let long = s.submit(Request {
        model: models[0].clone(),
        prompt: tokens(2, 14),
        params: greedy(4),
        on_event,
    });
    assert_eq!(
        long,
        Err(SubmitError::TooLong {
            tokens: 17,
            capacity: 16
        })
    );
    hold_tx.send(()).unwrap();
    let answers = [gather(&rx0), gather(&second), gather(&third)];
    for (k, a) in answers.iter().enumerate() {
        assert_eq!(a.ids, models[k].generate(&prompt, max, 0.0, 0).unwrap());
    }
    s.shutdown().unwrap();
    assert_eq!(s.stats().free_blocks(), 4);
    assert_eq!(s.stats().waiting(), 0);
    let (on_event, _rx) = listener();
    let closed = s.submit(Request {
        model: models[0].clone(),
        prompt,
        params: greedy(max),
        on_event,
    });
    assert_eq!(closed, Err(SubmitError::Closed));
}

#[test]
fn a_request_finishes_on_the_version_it_started_with() {
    // version 0 and version 1 of the weights (as the trainer would publish them)
    let models = three_adapters();
    let (v0, v1) = (models[0].clone(), models[1].clone());
    let s = Scheduler::spawn(v0.clone(), SchedulerConfig::default(), None).unwrap();
    let prompt = tokens(4, 7);
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (tx, rx) = mpsc::channel();
    let mut wait = Some(go_rx);
    s.submit(Request {
        model: v0.clone(),
        prompt: prompt.clone(),
        params: greedy(16),
        on_event: Box::new(move |e| {
            if let Some(w) = wait.take() {
                w.recv().unwrap();
            }
            tx.send(e).is_ok()
        }),
    })
    .unwrap();
    while s.stats().running() == 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    // "published" meanwhile: a request that arrives now runs on version 1, beside the first
    let later = submit(&s, &v1, prompt.clone(), greedy(16));
    go_tx.send(()).unwrap();
    let (a, b) = (gather(&rx), gather(&later));
    assert_eq!(a.ids, v0.generate(&prompt, 16, 0.0, 0).unwrap());
    assert_eq!(b.ids, v1.generate(&prompt, 16, 0.0, 0).unwrap());
    assert_ne!(a.ids, b.ids, "the two versions should answer differently");
    s.shutdown().unwrap();
}

#[test]
fn bgmv_gives_each_row_its_own_adapters_update() {
    let (n, d_in, d_out, r, l) = (7usize, 6usize, 5usize, 3usize, 4usize);
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1.0, (n, d_in), &dev).unwrap();
    let a = Tensor::randn(0f32, 1.0, (l, r, d_in), &dev).unwrap();
    let b = Tensor::randn(0f32, 1.0, (l, d_out, r), &dev).unwrap();
    // rows 2 and 5 use no adapter (index L)
    let idx: Vec<u32> = vec![0, 3, 4, 1, 3, 4, 2];
    let indices = Tensor::new(idx.as_slice(), &dev).unwrap();
    let y: Vec<Vec<f32>> = wick::ops::bgmv(&x, &a, &b, &indices, 0.5)
        .unwrap()
        .to_vec2()
        .unwrap();
    let xs: Vec<Vec<f32>> = x.to_vec2().unwrap();
    let as_: Vec<Vec<Vec<f32>>> = a.to_vec3().unwrap();
    let bs: Vec<Vec<Vec<f32>>> = b.to_vec3().unwrap();
    for (row, &i) in idx.iter().enumerate() {
        let want: Vec<f32> = match (i as usize) < l {
            false => vec![0.0; d_out],
            true => {
                let (ai, bi) = (&as_[i as usize], &bs[i as usize]);
                let t: Vec<f32> = (0..r)
                    .map(|k| (0..d_in).map(|j| ai[k][j] * xs[row][j]).sum())
                    .collect();
                (0..d_out)
                    .map(|o| 0.5 * (0..r).map(|k| bi[o][k] * t[k]).sum::<f32>())
                    .collect()
            }
        };
        assert!(
            max_diff(&y[row], &want) < 1e-5,
            "row {row}: {:?} vs {want:?}",
            y[row]
        );
    }
    let past = Tensor::new(&[0u32, 5, 0, 0, 0, 0, 0], &dev).unwrap();
    let err = wick::ops::bgmv(&x, &a, &b, &past, 1.0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("index 5"), "{err}");
}
