//! Training steps captured as CUDA graphs (`Engine::capture_step`, `Engine::replay`) against
//! ordinary steps of an identical engine (run on a GPU machine:
//! `cargo test --release --features cuda --test cuda_graph`).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use wick::models::{Gpt, GptConfig};
use wick::optim::LrSchedule;
use wick::{Engine, EngineConfig, ParamStore, Precision};

const CFG: GptConfig = GptConfig {
    vocab_size: 64,
    context_len: 32,
    n_layer: 2,
    n_head: 2,
    d_model: 128,
};

/// The GPU, deterministic (the embedding backward adds in order instead of with atomics):
/// Adam turns the last-bit differences of atomics into whole updates of weights whose
/// gradient is nearly zero, so only deterministic runs can be compared weight for weight.
fn gpu() -> Device {
    let dev = wick::cuda::new_device(0).expect("these tests need a CUDA device");
    let perf = wick::perf::PerfSettings {
        deterministic: true,
        ..Default::default()
    };
    perf.apply(&dev).expect("deterministic settings");
    dev
}

fn model(dev: &Device, config: EngineConfig) -> (Engine, Gpt) {
    let store = ParamStore::new(Precision::Bf16Mixed, dev.clone(), 5);
    let gpt = Gpt::new(&store, CFG).unwrap();
    (Engine::new(store, config).unwrap(), gpt)
}

/// Random token batches `(4, T)`, targets = inputs shifted by one token.
fn batches(dev: &Device, n: usize) -> Vec<(Tensor, Tensor)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    (0..n)
        .map(|_| {
            let ids: Vec<u32> = (0..4 * (CFG.context_len + 1))
                .map(|_| rng.random_range(0..CFG.vocab_size as u32))
                .collect();
            let t = Tensor::from_vec(ids, (4, CFG.context_len + 1), dev).unwrap();
            let x = t
                .narrow(1, 0, CFG.context_len)
                .unwrap()
                .contiguous()
                .unwrap();
            let y = t
                .narrow(1, 1, CFG.context_len)
                .unwrap()
                .contiguous()
                .unwrap();
            (x, y)
        })
        .collect()
}

/// Two engines of the same model and seed: one for ordinary steps, one for the graph.
fn twins(dev: &Device) -> ((Engine, Gpt), (Engine, Gpt)) {
    (
        model(dev, EngineConfig::adamw(3e-3)),
        model(dev, EngineConfig::adamw(3e-3)),
    )
}

fn max_master_diff(a: &Engine, b: &Engine) -> f32 {
    let (ma, mb) = (a.store().masters(), b.store().masters());
    assert_eq!(ma.len(), mb.len());
    ma.iter()
        .zip(&mb)
        .map(|((n, x), (_, y))| {
            let d = (x - y).unwrap().abs().unwrap().max_all().unwrap();
            let d = d.to_dtype(DType::F32).unwrap().to_scalar::<f32>().unwrap();
            assert!(d.is_finite(), "{n}");
            d
        })
        .fold(0.0, f32::max)
}

fn same(a: f32, b: f32, what: &str) {
    assert_eq!(a, b, "{what}: ordinary vs graph");
}

/// Six steps on alternating batches: engine A steps normally; engine B runs one ordinary step
/// and captures the next, then replays it five times, refilling its static input in place.
/// Losses agree step by step, bit for bit (they fall as the model trains on two batches, so a
/// replay that ran nothing or read stale inputs would not match), and so do the master
/// weights: a replay runs the kernels of an ordinary step.
#[test]
fn replays_match_ordinary_steps() {
    let dev = gpu();
    let data = batches(&dev, 2);
    let ((mut a, gpt_a), (mut b, gpt_b)) = twins(&dev);
    let (x, y) = (data[0].0.copy().unwrap(), data[0].1.copy().unwrap());

    let mut losses_a = Vec::new();
    for i in 0..6 {
        let (xi, yi) = &data[i % 2];
        losses_a.push(a.step(|_| gpt_a.loss(xi, yi)).unwrap().loss().unwrap());
    }

    let (first, captured) = b.capture_step(|_| gpt_b.loss(&x, &y)).unwrap();
    let graph = captured.expect("the GPT step captures");
    let mut losses_b = vec![first.loss().unwrap()];
    assert_eq!(b.boundaries(), 1, "the capture itself runs nothing");
    for i in 1..6 {
        let (xi, yi) = &data[i % 2];
        x.slice_set(xi, 0, 0).unwrap();
        y.slice_set(yi, 0, 0).unwrap();
        let r = b.replay(&graph).unwrap();
        assert!(r.boundary && !r.skipped().unwrap());
        losses_b.push(r.loss().unwrap());
    }
    for (i, (la, lb)) in losses_a.iter().zip(&losses_b).enumerate() {
        same(*la, *lb, &format!("loss of step {i}"));
    }
    assert!(
        losses_a[4] < losses_a[0] - 0.01,
        "the model trains: {losses_a:?}"
    );
    assert_eq!(b.boundaries(), 6);
    assert_eq!(b.optimizer_steps().unwrap(), 6);
    let d = max_master_diff(&a, &b);
    assert_eq!(d, 0.0, "master weights differ");
}

/// A forward that reads a device value on the host cannot be captured: capture_step says so,
/// and the engine goes on with ordinary steps exactly as an engine that never tried.
#[test]
fn failed_capture_leaves_ordinary_steps_unchanged() {
    let dev = gpu();
    let data = batches(&dev, 1);
    let (x, y) = &data[0];
    let ((mut a, gpt_a), (mut b, gpt_b)) = twins(&dev);
    for _ in 0..3 {
        a.step(|_| gpt_a.loss(x, y)).unwrap();
    }
    let reads_host = |_: &wick::engine::StepCtx| {
        let loss = gpt_b.loss(x, y)?;
        loss.to_scalar::<f32>()?; // a device-to-host copy: not allowed under capture
        Ok::<_, candle_core::Error>(loss)
    };
    let (_, captured) = b.capture_step(reads_host).unwrap();
    let err = format!(
        "{:#}",
        captured.expect_err("a host read cannot be captured")
    );
    assert!(err.contains("capture"), "{err}");
    assert_eq!(b.boundaries(), 1);
    for _ in 0..2 {
        b.step(|_| gpt_b.loss(x, y)).unwrap();
    }
    let (la, lb) = (
        a.step(|_| gpt_a.loss(x, y)).unwrap().loss().unwrap(),
        b.step(|_| gpt_b.loss(x, y)).unwrap().loss().unwrap(),
    );
    same(la, lb, "loss after the failed capture");
    let d = max_master_diff(&a, &b);
    assert_eq!(d, 0.0, "master weights differ");
}

/// What capture and replay refuse: accumulation windows (nothing runs), a learning rate that
/// changed since the capture, and a graph of another engine.
#[test]
fn capture_and_replay_refuse_what_a_graph_cannot_hold() {
    let dev = gpu();
    let data = batches(&dev, 1);
    let (x, y) = &data[0];

    let mut accum = EngineConfig::adamw(1e-3);
    accum.accumulation_steps = 2;
    let (mut e, gpt) = model(&dev, accum);
    let err = e.capture_step(|_| gpt.loss(x, y)).unwrap_err().to_string();
    assert!(err.contains("accumulation_steps"), "{err}");
    assert_eq!(e.boundaries(), 0);

    let mut warm = EngineConfig::adamw(1e-3);
    warm.schedule = LrSchedule::WarmupCosine {
        lr: 1e-3,
        min_lr: 1e-4,
        warmup: 10,
        total: 100,
    };
    let (mut e, gpt) = model(&dev, warm);
    let (_, g) = e.capture_step(|_| gpt.loss(x, y)).unwrap();
    let g = g.unwrap();
    // captured at boundary 1 (lr 2e-4 in the warmup); its replay there is that step
    assert_eq!(e.replay(&g).unwrap().lr, 2e-4);
    let err = e.replay(&g).unwrap_err().to_string();
    assert!(err.contains("learning rate"), "{err}");
    assert_eq!(e.boundaries(), 2);

    let (mut other, _) = model(&dev, EngineConfig::adamw(1e-3));
    let err = other.replay(&g).unwrap_err().to_string();
    assert!(err.contains("another engine"), "{err}");
}
