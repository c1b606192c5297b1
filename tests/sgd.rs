//! SGD: fused CPU path vs the candle-op reference path, both against an independent scalar f64
//! implementation of torch.optim.SGD's update; found_inf skips; state round trip; the Engine
//! trains with `EngineConfig::sgd`.

mod common;
use candle_core::{Device, Module, Tensor};

use common::{flat, max_rel_err, random_grads};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use wick::engine::OptimizerConfig;
use wick::optim::{
    GradStats, HostStats, Impl, LrSchedule, OptimPath, Optimizer, Sgd, SgdConfig, StepInputs,
};
use wick::params::ParamStore;
use wick::{loss, nn, Engine, EngineConfig, Precision};

/// Shapes with empty tensors, a 1-D tensor, odd sizes and tensors larger than one rayon chunk
/// (16384 elements).
const SHAPES: &[&[usize]] = &[
    &[0],
    &[7],
    &[13, 17],
    &[0, 5],
    &[3, 5, 11],
    &[40_001],
    &[131, 257],
];

fn store(seed: u64) -> anyhow::Result<ParamStore> {
    common::store(seed, SHAPES)
}

/// The three configurations of the brief, each with weight decay.
fn configs() -> Vec<(&'static str, SgdConfig)> {
    vec![
        (
            "momentum 0",
            SgdConfig {
                weight_decay: 0.1,
                ..SgdConfig::new(0.05, 0.0)
            },
        ),
        (
            "momentum 0.9, dampening 0.1",
            SgdConfig {
                dampening: 0.1,
                weight_decay: 0.1,
                ..SgdConfig::new(0.05, 0.9)
            },
        ),
        (
            "nesterov 0.9",
            SgdConfig {
                nesterov: true,
                weight_decay: 0.1,
                ..SgdConfig::new(0.05, 0.9)
            },
        ),
    ]
}

fn imp(fused: bool) -> Impl {
    if fused {
        Impl::FusedCpu
    } else {
        Impl::Reference
    }
}

#[test]
fn fused_matches_reference_over_200_steps() -> anyhow::Result<()> {
    for (label, config) in configs() {
        let (sr, sf) = (store(3)?, store(3)?);
        let mut reference = Sgd::new(config.clone(), Impl::Reference)?;
        let mut fused = Sgd::new(config.clone(), Impl::FusedCpu)?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for step in 0..200 {
            let grads = random_grads(&sr.params(), &mut rng, 1.0)?;
            let lr = config.lr * (1.0 - step as f64 / 400.0);
            let stats = GradStats::clean(0.5 + (step % 3) as f64 * 0.25);
            assert_eq!(
                reference.step(&sr.params(), &grads, StepInputs::host(&stats, lr))?,
                Some(true)
            );
            assert_eq!(
                fused.step(&sf.params(), &grads, StepInputs::host(&stats, lr))?,
                Some(true)
            );
        }
        let mut worst = 0f64;
        let mut identical = true;
        for (a, b) in sf.params().iter().zip(sr.params().iter()) {
            let (x, y) = (flat(a.master.as_tensor()), flat(b.master.as_tensor()));
            identical &= x == y;
            worst = worst.max(max_rel_err(&x, &y));
            assert!(
                x.iter().all(|v| v.is_finite()),
                "{label}: {} diverged",
                a.name
            );
        }
        let (st_f, st_r) = (
            fused.state_tensors(&sf.params())?,
            reference.state_tensors(&sr.params())?,
        );
        let names = |st: &[(String, Tensor)]| st.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(&st_f), names(&st_r), "{label}");
        let buffers = st_f
            .iter()
            .filter(|(n, _)| n.ends_with(".momentum_buffer"))
            .count();
        let want_buffers = if config.momentum != 0.0 {
            SHAPES.len()
        } else {
            0
        };
        assert_eq!(buffers, want_buffers, "{label}: momentum buffers");
        for ((n, tf), (_, tr)) in st_f.iter().zip(&st_r) {
            let (x, y) = (flat(tf), flat(tr));
            identical &= x == y;
            worst = worst.max(max_rel_err(&x, &y));
            if n.ends_with(".step") {
                assert_eq!(x, vec![200.0], "{label}: {n}");
            }
        }
        eprintln!(
            "{label}: fused vs reference after 200 steps: identical={identical}, max rel {worst:e}"
        );
        assert!(
            worst <= 1e-6,
            "{label}: max relative error {worst:e} > 1e-6"
        );
        assert!(
            identical,
            "{label}: fused and reference are expected to be bit-identical"
        );
    }
    Ok(())
}

/// torch.optim.SGD's update (`_single_tensor_sgd`) written out in f64 for one element.
fn sgd_scalar(p: &mut f64, buf: &mut Option<f64>, g: f64, c: &SgdConfig, lr: f64, decay: bool) {
    let mut d = g;
    if decay && c.weight_decay != 0.0 {
        d += c.weight_decay * *p;
    }
    if c.momentum != 0.0 {
        let b = match *buf {
            None => d,
            Some(b) => c.momentum * b + (1.0 - c.dampening) * d,
        };
        *buf = Some(b);
        d = if c.nesterov { d + c.momentum * b } else { b };
    }
    *p -= lr * d;
}

#[test]
fn both_paths_match_scalar_f64_sgd_and_skip_decay_for_rank1() -> anyhow::Result<()> {
    for (label, base) in configs() {
        // a strong decay, so that decaying a 1-D tensor would show
        let c = SgdConfig {
            lr: 0.01,
            weight_decay: 0.5,
            ..base
        };
        let mut worst = 0f64;
        for fused in [false, true] {
            let s = store(5)?;
            let params = s.params();
            let init: Vec<Vec<f32>> = params.iter().map(|p| flat(p.master.as_tensor())).collect();
            let mut opt = Sgd::new(c.clone(), imp(fused))?;
            let mut rng = rand::rngs::StdRng::seed_from_u64(2);
            let mut history = Vec::new();
            for step in 0..30 {
                let g = random_grads(&params, &mut rng, 3.0)?;
                let lr = c.lr * (1.0 + (step % 4) as f64 * 0.5);
                opt.step(&params, &g, StepInputs::host(&GradStats::clean(0.25), lr))?;
                history.push((g, lr));
            }
            // replay elements of p1 and p5 (rank 1, not decayed), p2 and p6 (rank 2, decayed;
            // p5 and p6 span several rayon chunks)
            assert!(!params[1].options.weight_decay && !params[5].options.weight_decay);
            assert!(params[2].options.weight_decay && params[6].options.weight_decay);
            for idx in [1usize, 2, 5, 6] {
                let decay = params[idx].options.weight_decay;
                let got = flat(params[idx].master.as_tensor());
                for e in [0usize, 3, got.len() / 2, got.len() - 1] {
                    let (mut p, mut buf) = (init[idx][e] as f64, None);
                    for (g, lr) in &history {
                        let gi = flat(g[idx].as_ref().unwrap())[e] as f64 * 0.25;
                        sgd_scalar(&mut p, &mut buf, gi, &c, *lr, decay);
                    }
                    let err = (got[e] as f64 - p).abs();
                    worst = worst.max(err);
                    assert!(
                        err <= 1e-5,
                        "{label}, fused={fused}: p{idx}[{e}]: got {} want {p} (abs err {err:e})",
                        got[e]
                    );
                    // the same replay with decay on the 1-D tensor lands elsewhere
                    if idx == 1 {
                        let (mut q, mut qb) = (init[idx][e] as f64, None);
                        for (g, lr) in &history {
                            let gi = flat(g[idx].as_ref().unwrap())[e] as f64 * 0.25;
                            sgd_scalar(&mut q, &mut qb, gi, &c, *lr, true);
                        }
                        assert!(
                            (q - p).abs() > 1e-4,
                            "{label}: the decay test must discriminate"
                        );
                    }
                }
            }
        }
        eprintln!("{label}: max abs error against f64 torch.optim.SGD after 30 steps {worst:e}");
    }
    Ok(())
}

#[test]
fn rank1_parameters_are_not_decayed_with_zero_gradient() -> anyhow::Result<()> {
    for fused in [false, true] {
        let c = SgdConfig {
            weight_decay: 0.5,
            ..SgdConfig::new(0.1, 0.9)
        };
        let s = store(1)?;
        let params = s.params();
        let before: Vec<Vec<f32>> = params.iter().map(|p| flat(p.master.as_tensor())).collect();
        let zeros: Vec<Option<Tensor>> = params
            .iter()
            .map(|p| Some(p.master.zeros_like().unwrap()))
            .collect();
        let mut opt = Sgd::new(c, imp(fused))?;
        opt.step(
            &params,
            &zeros,
            StepInputs::host(&GradStats::clean(1.0), 0.1),
        )?;
        assert_eq!(
            flat(params[1].master.as_tensor()),
            before[1],
            "1-D tensor must not decay"
        );
        assert_eq!(
            flat(params[5].master.as_tensor()),
            before[5],
            "1-D tensor must not decay"
        );
        for idx in [2usize, 4, 6] {
            let after = flat(params[idx].master.as_tensor());
            for (a, b) in after.iter().zip(&before[idx]) {
                // d = 0.5 p, buffer = d (first step), p - 0.1 d = 0.95 p
                assert!(
                    (a - b * 0.95).abs() <= 1e-7,
                    "rank >= 2 decays by (1 - lr*wd) = 0.95"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn found_inf_skips_everything() -> anyhow::Result<()> {
    let inf = GradStats::host(HostStats {
        found_inf: true,
        norm: f64::INFINITY,
        multiplier: 1.0,
    });
    for (label, c) in configs() {
        for fused in [false, true] {
            let s = store(9)?;
            let params = s.params();
            let mut opt = Sgd::new(c.clone(), imp(fused))?;
            let mut rng = rand::rngs::StdRng::seed_from_u64(4);
            // a skip before any step creates no state
            let g = random_grads(&params, &mut rng, 1.0)?;
            let before: Vec<Vec<f32>> = params.iter().map(|p| flat(p.master.as_tensor())).collect();
            assert_eq!(
                opt.step(&params, &g, StepInputs::host(&inf, 0.1))?,
                Some(false)
            );
            let after: Vec<Vec<f32>> = params.iter().map(|p| flat(p.master.as_tensor())).collect();
            assert_eq!(before, after, "{label}");
            assert!(
                opt.state_tensors(&params)?.is_empty(),
                "{label}: no state after a skip"
            );
            // three steps, then a skip: params, buffers and step counts unchanged
            for _ in 0..3 {
                let g = random_grads(&params, &mut rng, 1.0)?;
                opt.step(&params, &g, StepInputs::host(&GradStats::clean(1.0), 0.1))?;
            }
            let snap = |opt: &Sgd| -> anyhow::Result<Vec<(String, Vec<f32>)>> {
                let mut v: Vec<(String, Vec<f32>)> = params
                    .iter()
                    .map(|p| (p.name.clone(), flat(p.master.as_tensor())))
                    .collect();
                for (n, t) in opt.state_tensors(&params)? {
                    v.push((n, flat(&t)));
                }
                Ok(v)
            };
            let before = snap(&opt)?;
            let g = random_grads(&params, &mut rng, 1.0)?;
            assert_eq!(
                opt.step(&params, &g, StepInputs::host(&inf, 0.1))?,
                Some(false)
            );
            assert_eq!(before, snap(&opt)?, "{label}, fused={fused}");
        }
    }
    Ok(())
}

#[test]
fn state_round_trip_resumes_exactly_across_implementations() -> anyhow::Result<()> {
    let (_, c) = configs().swap_remove(1);
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    let shapes = store(0)?.params();
    let grads: Vec<_> = (0..20)
        .map(|_| random_grads(&shapes, &mut rng, 1.0).unwrap())
        .collect();
    // straight: 20 fused steps
    let straight = store(7)?;
    let mut opt = Sgd::new(c.clone(), Impl::FusedCpu)?;
    for g in &grads {
        opt.step(
            &straight.params(),
            g,
            StepInputs::host(&GradStats::clean(1.0), 0.05),
        )?;
    }
    // 10 fused steps, save, load into a fresh reference optimizer, 10 more
    for resume_imp in [Impl::Reference, Impl::FusedCpu] {
        let resumed = store(7)?;
        let mut first = Sgd::new(c.clone(), Impl::FusedCpu)?;
        for g in &grads[..10] {
            first.step(
                &resumed.params(),
                g,
                StepInputs::host(&GradStats::clean(1.0), 0.05),
            )?;
        }
        let saved: HashMap<String, Tensor> = first
            .state_tensors(&resumed.params())?
            .into_iter()
            .collect();
        assert!(saved.contains_key("p2.momentum_buffer") && saved.contains_key("p2.step"));
        let mut second = Sgd::new(c.clone(), resume_imp)?;
        second.load_state_tensors(&resumed.params(), &saved, 10)?;
        for g in &grads[10..] {
            second.step(
                &resumed.params(),
                g,
                StepInputs::host(&GradStats::clean(1.0), 0.05),
            )?;
        }
        for (a, b) in resumed.params().iter().zip(straight.params().iter()) {
            assert_eq!(
                flat(a.master.as_tensor()),
                flat(b.master.as_tensor()),
                "{resume_imp:?}: {}",
                a.name
            );
        }
    }
    // a shape mismatch is a clear error
    let mut bad = HashMap::new();
    bad.insert(
        "p2.momentum_buffer".to_string(),
        Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu)?,
    );
    let err = Sgd::new(c, Impl::FusedCpu)?
        .load_state_tensors(&store(7)?.params(), &bad, 0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("p2.momentum_buffer") && err.contains("shape"),
        "{err}"
    );
    Ok(())
}

#[test]
fn invalid_configs_are_rejected() {
    let nesterov = SgdConfig {
        nesterov: true,
        ..SgdConfig::new(0.1, 0.0)
    };
    let err = Sgd::new(nesterov.clone(), Impl::FusedCpu)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("nesterov requires momentum > 0"), "{err}");
    let cfg = EngineConfig {
        optimizer: OptimizerConfig::Sgd(nesterov),
        ..EngineConfig::sgd(0.1, 0.0)
    };
    assert!(Engine::new(ParamStore::new(Precision::Fp32, Device::Cpu, 0), cfg).is_err());
}

/// y = x A^T + b for a fixed A, b; a linear layer learns it.
fn regression_losses(cfg: EngineConfig, steps: usize) -> anyhow::Result<Vec<f32>> {
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 3);
    let model = nn::Linear::new(&store, "lin", 8, 4, true)?;
    let mut engine = Engine::new(store.clone(), cfg)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    let a: Vec<f32> = (0..32).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let a = Tensor::from_vec(a, (4, 8), &Device::Cpu)?;
    let bias = Tensor::new(&[0.5f32, -0.25, 0.1, 0.0], &Device::Cpu)?;
    let mut losses = Vec::new();
    for _ in 0..steps {
        let x: Vec<f32> = (0..32 * 8)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let x = Tensor::from_vec(x, (32, 8), &Device::Cpu)?;
        let y = x.matmul(&a.t()?)?.broadcast_add(&bias)?;
        let r = engine.step(|_| loss::mse(&model.forward(&x)?, &y))?;
        losses.push(r.loss()?);
    }
    Ok(losses)
}

#[test]
fn engine_trains_a_tiny_problem_with_sgd() -> anyhow::Result<()> {
    let plain = regression_losses(EngineConfig::sgd(0.1, 0.9), 150)?;
    let first: f32 = plain[..5].iter().sum::<f32>() / 5.0;
    let last: f32 = plain[plain.len() - 5..].iter().sum::<f32>() / 5.0;
    eprintln!("SGD(0.1, 0.9): loss {first:.4} -> {last:.5}");
    assert!(last < 0.01 * first, "loss must decrease: {first} -> {last}");

    // Nesterov with decay and a step schedule, on the reference and the fused path: the same
    // losses bit for bit
    let mk = |path| EngineConfig {
        optimizer: OptimizerConfig::Sgd(SgdConfig {
            nesterov: true,
            weight_decay: 1e-4,
            ..SgdConfig::new(0.1, 0.9)
        }),
        schedule: LrSchedule::parse("step:size=50,gamma=0.5", 0.1).unwrap(),
        path,
        ..EngineConfig::sgd(0.1, 0.9)
    };
    let fused = regression_losses(mk(OptimPath::Fused), 100)?;
    let reference = regression_losses(mk(OptimPath::Reference), 100)?;
    assert_eq!(
        fused, reference,
        "fused and reference engines give the same losses"
    );
    assert!(
        fused[95..].iter().all(|&l| l < 0.01 * fused[0]),
        "{} -> {:?}",
        fused[0],
        &fused[95..]
    );
    Ok(())
}
