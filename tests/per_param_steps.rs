//! Per-parameter optimizer step counts (torch.optim semantics: a parameter's `t` counts the
//! applied steps in which it had a gradient) on every path. The case is the one of issue 13:
//! fp32, AdamW lr 0.1, no weight decay, two parameters of 4 elements at 0.5, the loss
//! `sum(a^2)` in every step plus `sum(b^2)` in steps 1 and 5-8 only (a branch not taken in
//! steps 2-4). The expected values come from an f64 AdamW written here; the issue measured
//! b = 0.0849073 on the H200 before the fix (the global step count) and 0.0278145 with
//! per-parameter counts.

use candle_core::{DType, Device, Tensor};
use candle_nn::Init;
use wick::optim::OptimPath;
use wick::params::Role;
use wick::{Engine, EngineConfig, ParamStore, Precision};

const LR: f64 = 0.1;

/// b takes part in these steps (1-based).
fn b_active(step: usize) -> bool {
    step == 1 || step >= 5
}

/// f64 AdamW (betas 0.9/0.999, eps 1e-8, no decay) of one scalar parameter with gradient
/// `2 p` in the steps where `active` holds; `t` advances only in those.
fn adamw_f64(active: impl Fn(usize) -> bool, steps: usize) -> f64 {
    let (mut p, mut m, mut v, mut t) = (0.5f64, 0.0f64, 0.0f64, 0i32);
    for s in 1..=steps {
        if !active(s) {
            continue;
        }
        t += 1;
        let g = 2.0 * p;
        m = 0.9 * m + 0.1 * g;
        v = 0.999 * v + 0.001 * g * g;
        let (bc1, bc2) = (1.0 - 0.9f64.powi(t), 1.0 - 0.999f64.powi(t));
        p -= LR / bc1 * m / (v.sqrt() / bc2.sqrt() + 1e-8);
    }
    p
}

fn run(dev: &Device, path: OptimPath) -> anyhow::Result<(ParamStore, Engine)> {
    let store = ParamStore::new(Precision::Fp32, dev.clone(), 0);
    let a = store.get_or_init("a", 4, Init::Const(0.5), Role::Fp32)?;
    let b = store.get_or_init("b", 4, Init::Const(0.5), Role::Fp32)?;
    let mut cfg = EngineConfig::adamw(LR);
    cfg.path = path;
    if let wick::engine::OptimizerConfig::AdamW(c) = &mut cfg.optimizer {
        c.weight_decay = 0.0;
    }
    let mut engine = Engine::new(store.clone(), cfg)?;
    for step in 1..=8 {
        engine.step(|_| {
            let loss = a.sqr()?.sum_all()?;
            if b_active(step) {
                loss + b.sqr()?.sum_all()?
            } else {
                Ok(loss)
            }
        })?;
    }
    Ok((store, engine))
}

fn values(store: &ParamStore, name: &str) -> Vec<f32> {
    let p = store.get(name).unwrap();
    p.master
        .as_tensor()
        .to_device(&Device::Cpu)
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn steps_of(engine: &Engine) -> anyhow::Result<Vec<(String, i64)>> {
    let mut v: Vec<(String, i64)> = engine
        .optimizer_state()?
        .into_iter()
        .filter(|(n, _)| n.ends_with(".step"))
        .map(|(n, t)| {
            assert_eq!(t.dtype(), DType::I64, "{n}");
            (
                n,
                t.to_device(&Device::Cpu).unwrap().to_vec1::<i64>().unwrap()[0],
            )
        })
        .collect();
    v.sort();
    Ok(v)
}

#[test]
fn a_parameter_that_misses_steps_counts_its_own_steps() -> anyhow::Result<()> {
    let want_a = adamw_f64(|_| true, 8);
    let want_b = adamw_f64(b_active, 8);
    assert!((want_b - 0.0278145).abs() < 5e-7, "f64 reference {want_b}");
    for path in [OptimPath::Reference, OptimPath::Fused] {
        let (store, engine) = run(&Device::Cpu, path)?;
        for (name, want) in [("a", want_a), ("b", want_b)] {
            for got in values(&store, name) {
                assert!(
                    (got as f64 - want).abs() < 1e-6,
                    "{path:?} {name}: {got} vs f64 AdamW {want}"
                );
            }
        }
        assert_eq!(
            steps_of(&engine)?,
            vec![("a.step".to_string(), 8), ("b.step".to_string(), 5)],
            "{path:?}"
        );
    }
    Ok(())
}

#[test]
fn step_counts_survive_a_checkpoint_exactly_past_f32_precision() -> anyhow::Result<()> {
    // 2^24 + 1 is not an f32: the count must come back as it was saved
    let (store, engine) = run(&Device::Cpu, OptimPath::Fused)?;
    let mut saved: std::collections::HashMap<String, Tensor> =
        engine.optimizer_state()?.into_iter().collect();
    let big = (1i64 << 24) + 1;
    saved.insert("b.step".into(), Tensor::new(&[big], &Device::Cpu)?);
    let mut cfg = EngineConfig::adamw(LR);
    if let wick::engine::OptimizerConfig::AdamW(c) = &mut cfg.optimizer {
        c.weight_decay = 0.0;
    }
    let mut resumed = Engine::new(store, cfg)?;
    resumed.load_state(&engine.state()?, &saved)?;
    let steps = steps_of(&resumed)?;
    assert_eq!(steps[1], ("b.step".to_string(), big));
    // a non-integer count is refused, naming the tensor, and changes nothing
    saved.insert("b.step".into(), Tensor::new(&[2.5f32], &Device::Cpu)?);
    let err = resumed.load_state(&engine.state()?, &saved).unwrap_err();
    assert!(err.to_string().contains("b.step"), "{err}");
    assert_eq!(steps_of(&resumed)?[1], ("b.step".to_string(), big));
    Ok(())
}

/// On the H200: the fused CUDA path gives the CPU reference's values bit for bit.
#[cfg(feature = "cuda")]
#[test]
fn fused_cuda_counts_per_parameter_like_the_cpu() -> anyhow::Result<()> {
    let gpu = Device::new_cuda(0).expect("this test needs a CUDA device");
    let (sg, eg) = run(&gpu, OptimPath::Fused)?;
    assert_eq!(eg.implementation(), wick::optim::Impl::FusedCuda);
    let (sc, ec) = run(&Device::Cpu, OptimPath::Reference)?;
    let want_b = adamw_f64(b_active, 8);
    for name in ["a", "b"] {
        assert_eq!(
            values(&sg, name),
            values(&sc, name),
            "{name}: CUDA vs CPU reference"
        );
    }
    for got in values(&sg, "b") {
        assert!(
            (got as f64 - want_b).abs() < 1e-6,
            "b on CUDA: {got} vs {want_b}"
        );
    }
    assert_eq!(steps_of(&eg)?, steps_of(&ec)?);
    assert_eq!(eg.optimizer_steps()?, 8);
    Ok(())
}
