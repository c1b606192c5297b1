//! Engine::step: weighted accumulation, forced overflow, gradient coverage, bad input.

use candle_core::{DType, Device, Module, Tensor};
use rand::{Rng, SeedableRng};
use wick::grads::GradBuffers;
use wick::scaler::ScalerKind;
use wick::{loss, nn, Engine, EngineConfig, ParamStore, Precision, ScalerConfig};

struct Mlp {
    l1: nn::Linear,
    ln: nn::LayerNorm,
    l2: nn::Linear,
}

impl Mlp {
    fn new(s: &ParamStore) -> candle_core::Result<Self> {
        Ok(Self {
            l1: nn::Linear::new(s, "l1", 6, 16, true)?,
            ln: nn::LayerNorm::new(s, "ln", 16, 1e-5)?,
            l2: nn::Linear::new(s, "l2", 16, 3, true)?,
        })
    }
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l2
            .forward(&self.ln.forward(&self.l1.forward(x)?.tanh()?)?)
    }
}

fn batch(n: usize, seed: u64) -> (Tensor, Tensor) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let x: Vec<f32> = (0..n * 6).map(|_| rng.random_range(-1.0..1.0)).collect();
    let y: Vec<u32> = (0..n).map(|_| rng.random_range(0..3)).collect();
    (
        Tensor::from_vec(x, (n, 6), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, n, &Device::Cpu).unwrap(),
    )
}

fn snapshot(s: &ParamStore) -> Vec<Vec<f32>> {
    s.params()
        .iter()
        .flat_map(|p| {
            let mut v = vec![p.master.flatten_all().unwrap().to_vec1::<f32>().unwrap()];
            if let Some(w) = &p.working {
                v.push(
                    w.to_dtype(DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap(),
                );
            }
            v
        })
        .collect()
}

#[test]
fn weighted_micro_batches_equal_the_full_batch_gradient() -> anyhow::Result<()> {
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 1);
    let model = Mlp::new(&store)?;
    let (x, y) = batch(23, 4);
    let params = store.params();
    // the full batch, one backward
    let full = loss::cross_entropy(&model.forward(&x)?, &y)?.backward()?;
    // micro-batches of 5, 11 and 7 samples weighted by their sizes
    let mut bufs = GradBuffers::new(params.len());
    let mut start = 0;
    for n in [5usize, 11, 7] {
        let l = loss::cross_entropy(
            &model.forward(&x.narrow(0, start, n)?)?,
            &y.narrow(0, start, n)?,
        )?;
        bufs.accumulate(&params, &l.backward()?, n as f64, false)?;
        start += n;
    }
    let stats = bufs.unscale_and_check(1.0, None, true, None)?.read()?;
    let mut sumsq = 0f64;
    for (p, b) in params.iter().zip(bufs.buffers()) {
        let want: Vec<f32> = full
            .get(p.differentiated())
            .unwrap()
            .flatten_all()?
            .to_vec1()?;
        let got: Vec<f32> = (b.as_ref().unwrap() * stats.multiplier)?
            .flatten_all()?
            .to_vec1()?;
        // relative to the tensor's largest gradient: f32 sums in another order differ by a few ulp
        let scale = want.iter().fold(0f32, |a, w| a.max(w.abs()));
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-6 * scale,
                "{}: {g} vs {w} (max |g| {scale})",
                p.name
            );
            sumsq += (*w as f64).powi(2);
        }
    }
    assert!(
        (stats.norm - sumsq.sqrt()).abs() <= 1e-6 * sumsq.sqrt(),
        "norm {} vs {}",
        stats.norm,
        sumsq.sqrt()
    );

    // the same through the engine: the reported norm is the full-batch one
    let mut engine = Engine::new(
        store.clone(),
        EngineConfig {
            accumulation_steps: 3,
            ..EngineConfig::adamw(1e-3)
        },
    )?;
    let mut start = 0;
    let mut reports = Vec::new();
    for n in [5usize, 11, 7] {
        let (xb, yb) = (x.narrow(0, start, n)?, y.narrow(0, start, n)?);
        reports.push(
            engine.step_weighted(n as f64, |_| loss::cross_entropy(&model.forward(&xb)?, &yb))?,
        );
        start += n;
    }
    assert!(!reports[0].boundary && !reports[1].boundary && reports[2].boundary);
    let norm = reports[2].grad_norm()?.unwrap();
    assert!(
        (norm - sumsq.sqrt()).abs() <= 1e-6 * sumsq.sqrt(),
        "engine norm {norm} vs {}",
        sumsq.sqrt()
    );
    assert_eq!(engine.optimizer_steps()?, 1);
    Ok(())
}

#[test]
fn a_forced_overflow_changes_nothing_but_the_scale() -> anyhow::Result<()> {
    let store = ParamStore::new(Precision::F16Mixed, Device::Cpu, 2);
    let model = Mlp::new(&store)?;
    // a scale of 2^120 overflows f16 gradients on the first backward
    let scaler = ScalerConfig {
        init_scale: 2f32.powi(120),
        ..ScalerConfig::default()
    };
    let mut engine = Engine::new(
        store.clone(),
        EngineConfig {
            scaler: Some(scaler),
            ..EngineConfig::adamw(1e-2)
        },
    )?;
    let (x, y) = batch(8, 9);
    let before = snapshot(&store);
    let r = engine.step(|_| loss::cross_entropy(&model.forward(&x)?, &y))?;
    assert!(r.boundary && r.skipped()?);
    assert!(
        r.loss()?.is_finite(),
        "the reported loss is the unscaled one"
    );
    assert_eq!(
        snapshot(&store),
        before,
        "masters and working copies unchanged"
    );
    assert_eq!(engine.optimizer_steps()?, 0);
    assert!(
        engine
            .optimizer()
            .state_tensors(&store.params())?
            .is_empty(),
        "no moments created"
    );
    assert_eq!(engine.loss_scale()?, 2f32.powi(119));
    // the scale keeps backing off until the step goes through
    let mut applied = false;
    for _ in 0..200 {
        let r = engine.step(|_| loss::cross_entropy(&model.forward(&x)?, &y))?;
        if !r.skipped()? {
            applied = true;
            break;
        }
    }
    assert!(applied && engine.optimizer_steps()? == 1);
    assert_ne!(snapshot(&store), before);
    Ok(())
}

#[test]
fn f16_with_the_dynamic_scaler_reports_the_unscaled_loss() -> anyhow::Result<()> {
    let store = ParamStore::new(Precision::F16Mixed, Device::Cpu, 3);
    let model = Mlp::new(&store)?;
    let mut engine = Engine::new(store.clone(), EngineConfig::adamw(1e-2))?;
    assert_eq!(engine.scaler().config().kind, ScalerKind::Dynamic);
    let (x, y) = batch(16, 1);
    let direct = loss::cross_entropy(&model.forward(&x)?, &y)?.to_scalar::<f32>()?;
    let r = engine.step(|_| loss::cross_entropy(&model.forward(&x)?, &y))?;
    assert_eq!(r.loss_scale()?, 65536.0);
    assert_eq!(r.loss()?, direct);
    assert!(!r.skipped()?);
    Ok(())
}

#[test]
fn candle_nn_layer_norm_is_reported_and_wick_layer_norm_trains_everything() -> anyhow::Result<()> {
    let (x, y) = batch(8, 5);
    // Linear -> candle_nn::LayerNorm -> Linear, built through the VarBuilder backend
    let store = ParamStore::new(Precision::Bf16Mixed, Device::Cpu, 0);
    let vb = store.var_builder();
    let l1 = candle_nn::linear(6, 16, vb.pp("first"))?;
    let ln = candle_nn::layer_norm(16, 1e-5, vb.pp("norm"))?;
    let l2 = candle_nn::linear(16, 3, vb.pp("head"))?;
    let mut engine = Engine::new(store.clone(), EngineConfig::adamw(1e-2))?;
    let before = snapshot(&store);
    let err = engine
        .step(|ctx| {
            let h = l1.forward(&ctx.precision().to_compute(&x)?)?;
            loss::cross_entropy(&l2.forward(&ln.forward(&h)?)?, &y)
        })
        .unwrap_err();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("first.weight") && msg.contains("first.bias"),
        "{msg}"
    );
    assert!(!msg.contains("head.weight"), "{msg}");
    assert!(
        msg.contains("wick::nn::LayerNorm"),
        "the message says what to do: {msg}"
    );
    assert_eq!(snapshot(&store), before, "the failed step changed nothing");

    // the same model with wick's LayerNorm: every parameter gets a gradient and moves
    let store = ParamStore::new(Precision::Bf16Mixed, Device::Cpu, 0);
    let model = Mlp::new(&store)?;
    let mut engine = Engine::new(store.clone(), EngineConfig::adamw(1e-2))?;
    let before = snapshot(&store);
    engine.step(|_| loss::cross_entropy(&model.forward(&x)?, &y))?;
    let after = snapshot(&store);
    for (i, (a, b)) in after.iter().zip(&before).enumerate() {
        assert_ne!(a, b, "tensor {i} did not change");
    }
    Ok(())
}

#[test]
fn frozen_parameters_are_a_warning_not_an_error() -> anyhow::Result<()> {
    let (x, y) = batch(8, 5);
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
    let vb = store.var_builder();
    let l1 = candle_nn::linear(6, 16, vb.pp("first"))?;
    let l2 = candle_nn::linear(16, 3, vb.pp("head"))?;
    assert_eq!(store.freeze("first.*")?, 2, "first.weight and first.bias");
    assert_eq!(
        store.freeze("frist.*")?,
        0,
        "a typo matches nothing, and says so"
    );
    let mut engine = Engine::new(store.clone(), EngineConfig::adamw(1e-2))?;
    assert!(engine.coverage().is_none(), "no backward yet");
    let first_before = store
        .get("first.weight")
        .unwrap()
        .master
        .flatten_all()?
        .to_vec1::<f32>()?;
    engine.step(|_| loss::cross_entropy(&l2.forward(&l1.forward(&x)?.detach())?, &y))?;
    let mut frozen = engine.coverage().expect("checked").missing_frozen.clone();
    frozen.sort();
    assert_eq!(
        frozen,
        ["first.bias", "first.weight"],
        "returned, not only logged"
    );
    assert_eq!(
        store
            .get("first.weight")
            .unwrap()
            .master
            .flatten_all()?
            .to_vec1::<f32>()?,
        first_before
    );
    Ok(())
}

#[test]
fn bad_input_is_a_clear_error() -> anyhow::Result<()> {
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
    let model = Mlp::new(&store)?;
    let mut engine = Engine::new(store.clone(), EngineConfig::adamw(1e-2))?;
    let (x, y) = batch(8, 5);
    let before = snapshot(&store);
    // a loss that was not reduced
    let err = engine.step(|_| model.forward(&x)).unwrap_err();
    assert!(
        format!("{err:#}").contains("[8, 3]") && format!("{err:#}").contains("mean_all"),
        "{err:#}"
    );
    // targets that do not match the logits
    let err = engine
        .step(|_| loss::cross_entropy(&model.forward(&x)?, &y.narrow(0, 0, 4)?))
        .unwrap_err();
    assert!(
        format!("{err:#}").contains("targets must be (N,)"),
        "{err:#}"
    );
    // a bad weight
    assert!(engine
        .step_weighted(f64::NAN, |_| loss::cross_entropy(&model.forward(&x)?, &y))
        .is_err());
    // bad configuration
    assert!(Engine::new(
        store.clone(),
        EngineConfig {
            accumulation_steps: 0,
            ..EngineConfig::adamw(1e-3)
        }
    )
    .is_err());
    assert!(Engine::new(
        store.clone(),
        EngineConfig {
            max_grad_norm: Some(-1.0),
            ..EngineConfig::adamw(1e-3)
        }
    )
    .is_err());
    assert_eq!(snapshot(&store), before, "nothing changed");
    Ok(())
}

#[test]
fn clipping_bounds_the_applied_gradient() -> anyhow::Result<()> {
    // with clip c and one SGD-like AdamW step, the norm is reported before clipping
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
    let model = Mlp::new(&store)?;
    let mut engine = Engine::new(
        store.clone(),
        EngineConfig {
            max_grad_norm: Some(1e-3),
            ..EngineConfig::adamw(1e-2)
        },
    )?;
    let (x, y) = batch(8, 5);
    let r = engine.step(|_| loss::cross_entropy(&model.forward(&x)?, &y))?;
    let norm = r.grad_norm()?.unwrap();
    assert!(norm > 1e-3);
    // the first moment after one step is (1 - beta1) * clipped gradient: its norm is 0.1 * 1e-3
    let m_sq: f64 = engine
        .optimizer()
        .state_tensors(&store.params())?
        .iter()
        .filter(|(n, _)| n.ends_with(".exp_avg"))
        .map(|(_, t)| {
            t.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64
        })
        .sum();
    let want = 0.1 * 1e-3 * norm / (norm + 1e-6);
    assert!(
        (m_sq.sqrt() - want).abs() < 1e-6 * want + 1e-12,
        "{} vs {want}",
        m_sq.sqrt()
    );
    Ok(())
}

#[test]
fn value_clipping_clamps_the_unscaled_gradient_once_per_step() -> anyhow::Result<()> {
    use wick::params::Role;
    // loss = sum(p * c): the gradient is c; with f16 and a dynamic scale the buffers hold
    // 1024 * c, and clipping must act on the unscaled values. (At the default 65536 the f16
    // gradient 3 * 65536 overflows, and the step is skipped: issue 14, item 1.)
    for precision in [Precision::Fp32, Precision::F16Mixed] {
        let store = ParamStore::new(precision, Device::Cpu, 0);
        let p = store.get_or_init("p", 4, candle_nn::Init::Const(0.5), Role::Matmul)?;
        let c = Tensor::new(&[3f32, -0.5, 0.05, -2.0], &Device::Cpu)?;
        let cfg = EngineConfig {
            clip_value: Some(1.0),
            accumulation_steps: 2,
            scaler: (precision == Precision::F16Mixed).then(|| ScalerConfig {
                init_scale: 1024.0,
                ..ScalerConfig::default()
            }),
            ..EngineConfig::adamw(1e-3)
        };
        let mut engine = Engine::new(store.clone(), cfg)?;
        for _ in 0..2 {
            engine.step(|_| p.to_dtype(DType::F32)?.mul(&c)?.sum_all())?;
        }
        let state = engine.optimizer().state_tensors(&store.params())?;
        let m: Vec<f32> = state
            .iter()
            .find(|(n, _)| n == "p.exp_avg")
            .unwrap()
            .1
            .to_vec1()?;
        // exp_avg after one step = (1 - beta1) * clamp(c, -1, 1), c as the f16 backward sees it
        let c16 = |v: f32| {
            if precision == Precision::F16Mixed {
                half::f16::from_f32(v).to_f32()
            } else {
                v
            }
        };
        let want = [0.1f32, -0.05, 0.1 * c16(0.05), -0.1];
        for (a, b) in m.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{precision}: {m:?} vs {want:?}");
        }
    }
    Ok(())
}

/// CUDA graphs need a CUDA device: on the CPU `capture_step` says so and runs nothing (the
/// replays themselves are tested on the GPU, tests/cuda_graph.rs).
#[test]
fn capture_step_on_the_cpu_is_a_clear_error_that_changes_nothing() -> anyhow::Result<()> {
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
    let lin = wick::nn::Linear::new(&store, "l", 3, 2, true)?;
    let before = store.masters();
    let mut engine = Engine::new(store, EngineConfig::adamw(1e-2))?;
    let x = Tensor::ones((4, 3), DType::F32, &Device::Cpu)?;
    let err = engine
        .capture_step(|_| lin.forward(&x)?.sqr()?.mean_all())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("CUDA") && err.contains("Engine::step"),
        "{err}"
    );
    assert_eq!(engine.boundaries(), 0);
    for ((n, a), (_, b)) in before.iter().zip(engine.store().masters()) {
        assert_eq!(
            a.flatten_all()?.to_vec1::<f32>()?,
            b.flatten_all()?.to_vec1::<f32>()?,
            "{n}"
        );
    }
    Ok(())
}

/// What a candle-nn user writes first in bf16-mixed: an f32 input into a `candle_nn::linear`
/// built on the store's VarBuilder (a dtype error: the error names the fix), and
/// `candle_nn::loss::cross_entropy` on bf16 logits (a bf16 loss: refused, naming the fix).
/// Neither changes a parameter; the fixed closure then trains.
#[test]
fn candle_nn_autocast_mistakes_are_refused_with_the_fix_named() -> anyhow::Result<()> {
    let (x, y) = batch(8, 6);
    let store = ParamStore::new(Precision::Bf16Mixed, Device::Cpu, 0);
    let lin = candle_nn::linear(6, 3, store.var_builder().pp("head"))?;
    let mut engine = Engine::new(store.clone(), EngineConfig::adamw(1e-2))?;
    let before = snapshot(&store);

    let err = engine
        .step(|_| candle_nn::loss::cross_entropy(&lin.forward(&x)?, &y))
        .expect_err("an f32 input meets a bf16 weight");
    let msg = format!("{err:#}");
    assert!(msg.contains("dtype mismatch"), "{msg}");
    assert!(msg.contains("to_compute(&x)"), "the fix is named: {msg}");
    assert!(msg.contains("bf16-mixed"), "{msg}");

    let err = engine
        .step(|ctx| {
            let logits = lin.forward(&ctx.precision().to_compute(&x)?)?;
            candle_nn::loss::cross_entropy(&logits, &y)
        })
        .expect_err("a bf16 loss");
    let msg = format!("{err:#}");
    assert!(msg.contains("BF16 loss"), "{msg}");
    assert!(
        msg.contains("to_dtype(DType::F32)"),
        "the fix is named: {msg}"
    );
    assert_eq!(snapshot(&store), before, "a refused step changes nothing");
    assert_eq!(engine.boundaries(), 0);

    let report = engine.step(|ctx| {
        let logits = lin.forward(&ctx.precision().to_compute(&x)?)?;
        candle_nn::loss::cross_entropy(&logits.to_dtype(DType::F32)?, &y)
    })?;
    assert!(report.boundary && report.loss()?.is_finite());
    assert_ne!(snapshot(&store), before, "the fixed closure trains");
    Ok(())
}
