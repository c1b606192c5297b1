//! Failure paths of the boundary (issue 14, items 1-6 and 8): each test reproduces a wrong
//! result found by trying published bug reports against an earlier wick, with the semantics of
//! PyTorch's GradScaler / torch.optim and DeepSpeed's DynamicLossScaler.

use candle_core::{DType, Device, Tensor};
use candle_nn::Init;
use std::collections::HashMap;
use wick::optim::{GradStats, OptimPath, Optimizer, Sgd, SgdConfig, StepInputs};
use wick::params::Role;
use wick::scaler::{ScalerConfig, ScalerKind};
use wick::{Engine, EngineConfig, LossScaler, ParamStore, Precision};

fn scalar(store: &ParamStore, name: &str) -> f32 {
    store
        .get(name)
        .unwrap()
        .master
        .as_tensor()
        .to_vec1::<f32>()
        .unwrap()[0]
}

/// Item 1: `clip_value` must not hide an overflow: fp32, SGD lr 0.1, a finite loss whose gradient
/// is +inf (d/dp sqrt(p - 0.5) at p = 0.5). Before: clamped to 1 and applied (p 0.5 -> 0.4).
#[test]
fn clip_value_does_not_hide_an_inf_gradient() -> anyhow::Result<()> {
    for path in [OptimPath::Reference, OptimPath::Fused] {
        let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
        let p = store.get_or_init("p", 1, Init::Const(0.5), Role::Fp32)?;
        let mut cfg = EngineConfig::sgd(0.1, 0.0);
        cfg.clip_value = Some(1.0);
        cfg.path = path;
        let mut engine = Engine::new(store.clone(), cfg)?;
        let r = engine.step(|_| (&p - 0.5)?.sqrt()?.sum_all())?;
        assert_eq!(r.loss()?, 0.0, "the loss itself is finite");
        assert!(r.skipped()?, "{path:?}: an inf gradient must skip the step");
        assert_eq!(scalar(&store, "p"), 0.5, "{path:?}");
        assert_eq!(engine.optimizer_steps()?, 0);
    }
    Ok(())
}

/// Item 1: Under 16-mixed an f16 gradient overflow must back the scale off even with
/// `clip_value` (before: clamped, applied, scale stayed 65536).
#[test]
fn clip_value_keeps_the_f16_overflow_backoff() -> anyhow::Result<()> {
    let store = ParamStore::new(Precision::F16Mixed, Device::Cpu, 0);
    let w = store.get_or_init("w", 4, Init::Const(0.5), Role::Matmul)?;
    assert_eq!(w.dtype(), DType::F16);
    let mut cfg = EngineConfig::sgd(0.1, 0.0);
    cfg.clip_value = Some(1.0);
    cfg.accumulation_steps = 2; // f32 accumulation buffers, where a clamp makes inf finite
    let mut engine = Engine::new(store.clone(), cfg)?;
    // d loss / d w = 1000 per element; times the scale 65536 = 6.6e7 > f16's 65504: inf in f16
    engine.step(|_| (w.to_dtype(DType::F32)? * 1000.0)?.sum_all())?;
    let r = engine.step(|_| (w.to_dtype(DType::F32)? * 1000.0)?.sum_all())?;
    assert!(r.boundary);
    assert!(r.skipped()?);
    assert_eq!(engine.loss_scale()?, 32768.0);
    assert_eq!(scalar(&store, "w"), 0.5);
    Ok(())
}

/// Item 2: A loss that is NaN on every step: the scale stops at a positive floor and every step is
/// skipped and counted as skipped (before: the scale reached exactly 0 after ~166 steps and
/// 34 of 200 steps were reported as applied).
#[test]
fn a_nan_loss_never_drives_the_scale_to_zero() -> anyhow::Result<()> {
    let store = ParamStore::new(Precision::F16Mixed, Device::Cpu, 0);
    let w = store.get_or_init("w", 4, Init::Const(0.5), Role::Matmul)?;
    let mut engine = Engine::new(store.clone(), EngineConfig::adamw(1e-3))?;
    let mut skipped = 0;
    for _ in 0..200 {
        let r = engine.step(|_| w.to_dtype(DType::F32)?.sum_all()? * f64::NAN)?;
        skipped += usize::from(r.skipped()?);
    }
    assert_eq!(skipped, 200);
    assert_eq!(engine.optimizer_steps()?, 0);
    let floor = ScalerConfig::default().min_scale;
    assert!(floor > 0.0);
    assert_eq!(engine.loss_scale()?, floor);
    assert_eq!(scalar(&store, "w"), 0.5);
    // 4. what the engine reports at the floor, a new engine restores
    let state = engine.state()?;
    let optim: HashMap<String, Tensor> = engine.optimizer_state()?.into_iter().collect();
    let mut other = Engine::new(store, EngineConfig::adamw(1e-3))?;
    other.load_state(&state, &optim)?;
    assert_eq!(other.loss_scale()?, floor);
    Ok(())
}

/// Item 2: A non-finite scaled loss skips the step whatever the gradients: here the loss is NaN
/// but carries no gradient to the parameter (its NaN factor is a constant).
#[test]
fn a_non_finite_loss_skips_the_step_even_with_finite_gradients() -> anyhow::Result<()> {
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
    let p = store.get_or_init("p", 1, Init::Const(0.5), Role::Fp32)?;
    let mut engine = Engine::new(store.clone(), EngineConfig::sgd(0.1, 0.0))?;
    let nan = Tensor::new(f32::NAN, &Device::Cpu)?;
    // loss = p + (NaN - NaN stays constant): d/dp = 1, the loss is NaN
    let r = engine.step(|_| p.sum_all()?.broadcast_add(&nan))?;
    assert!(r.loss()?.is_nan());
    assert!(r.skipped()?);
    assert_eq!(scalar(&store, "p"), 0.5);
    Ok(())
}

/// Item 3: A clean step at a scale whose reciprocal overflows f32 must be skipped, not write
/// `0 * inf = NaN` into the weights (GradScaler checks the reciprocal of its scale).
#[test]
fn an_underflowed_scale_counts_as_found_inf() -> anyhow::Result<()> {
    let store = ParamStore::new(Precision::F16Mixed, Device::Cpu, 0);
    let w = store.get_or_init("w", 4, Init::Const(0.5), Role::Matmul)?;
    let mut cfg = EngineConfig::adamw(1e-3);
    cfg.scaler = Some(ScalerConfig {
        init_scale: 1e-40, // subnormal: 1 / 1e-40 is inf in f32
        min_scale: 1e-40,
        ..ScalerConfig::default()
    });
    let mut engine = Engine::new(store.clone(), cfg)?;
    let r = engine.step(|_| w.to_dtype(DType::F32)?.sum_all())?;
    assert!(r.skipped()?);
    assert_eq!(scalar(&store, "w"), 0.5);
    Ok(())
}

/// Item 4: A checkpoint state that `load` refuses is refused by `Engine::state` for the same
/// reason, and a refused load changes nothing.
#[test]
fn save_and_load_share_the_scaler_check() -> anyhow::Result<()> {
    let store = ParamStore::new(Precision::F16Mixed, Device::Cpu, 0);
    store.get_or_init("w", 4, Init::Const(0.5), Role::Matmul)?;
    let mut engine = Engine::new(store, EngineConfig::adamw(1e-3))?;
    let mut state = engine.state()?;
    state.scaler.scale = 0.0;
    let err = engine.load_state(&state, &HashMap::new()).unwrap_err();
    assert!(err.to_string().contains("invalid loss scale 0"), "{err}");
    assert_eq!(
        engine.loss_scale()?,
        65536.0,
        "a refused load changes nothing"
    );
    assert!(state.scaler.validate().is_err());
    assert!(ScalerConfig {
        min_scale: 0.0,
        ..ScalerConfig::default()
    }
    .validate()
    .is_err());
    Ok(())
}

fn shapes() -> Vec<Vec<usize>> {
    let mut s: Vec<Vec<usize>> = (0..24).map(|i| vec![1 + i % 5, 3]).collect();
    s.insert(7, vec![3, 0]);
    s.insert(15, vec![2, 0, 4]);
    s
}

fn store_of(shapes: &[Vec<usize>]) -> anyhow::Result<ParamStore> {
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 3);
    for (i, sh) in shapes.iter().enumerate() {
        store.get_or_init(
            &format!("p{i}"),
            sh.as_slice(),
            Init::Const(1.0),
            Role::Fp32,
        )?;
    }
    Ok(store)
}

/// Item 5: Empty tensors of rank >= 2 among 24 others: the fused CPU AdamW and SGD steps skip them
/// (before: candle's "dst has repeated elements" error after 17-25 others were updated).
#[test]
fn empty_tensors_of_any_rank_are_skipped_by_every_path() -> anyhow::Result<()> {
    let sh = shapes();
    for path in [OptimPath::Reference, OptimPath::Fused] {
        for cfg in [EngineConfig::adamw(0.1), EngineConfig::sgd(0.1, 0.9)] {
            let store = store_of(&sh)?;
            let mut cfg = cfg.clone();
            cfg.path = path;
            let mut engine = Engine::new(store.clone(), cfg)?;
            let params = store.params();
            for _ in 0..2 {
                engine.step(|_| {
                    let mut loss = Tensor::new(0f32, &Device::Cpu)?;
                    for p in &params {
                        loss = (loss + p.master.as_tensor().sqr()?.sum_all()?)?;
                    }
                    Ok::<_, candle_core::Error>(loss)
                })?;
            }
            assert_eq!(engine.optimizer_steps()?, 2);
            for p in &params {
                if p.elem_count() > 0 {
                    let v = p.master.flatten_all()?.to_vec1::<f32>()?;
                    assert!(v.iter().all(|&x| x < 1.0), "{path:?} {}: {v:?}", p.name);
                }
            }
        }
    }
    Ok(())
}

/// Item 5: A step that fails on one parameter changes no parameter and no optimizer state, and
/// the error names the parameter.
#[test]
fn a_failed_step_is_all_or_nothing() -> anyhow::Result<()> {
    let sh = shapes();
    let store = store_of(&sh)?;
    let params = store.params();
    let before: Vec<Vec<f32>> = params
        .iter()
        .map(|p| p.master.flatten_all().unwrap().to_vec1().unwrap())
        .collect();
    let mut grads: Vec<Option<Tensor>> = params
        .iter()
        .map(|p| Some(p.master.ones_like().unwrap()))
        .collect();
    grads[20] = Some(Tensor::ones(7, DType::F32, &Device::Cpu)?); // wrong shape
    for imp in [wick::optim::Impl::Reference, wick::optim::Impl::FusedCpu] {
        let mut opt = Sgd::new(SgdConfig::new(0.1, 0.9), imp)?;
        let err = opt
            .step(
                &params,
                &grads,
                StepInputs::host(&GradStats::clean(1.0), 0.1),
            )
            .unwrap_err();
        assert!(err.to_string().contains(&params[20].name), "{err}");
        assert!(
            opt.state_tensors(&params)?.is_empty(),
            "no state was created"
        );
        let after: Vec<Vec<f32>> = params
            .iter()
            .map(|p| p.master.flatten_all().unwrap().to_vec1().unwrap())
            .collect();
        assert_eq!(after, before, "{imp:?}: nothing changed");
    }
    Ok(())
}

/// Item 6: The coverage check stays armed until a backward passes it: retrying a step whose loss
/// does not reach the model fails again instead of counting an optimizer step.
#[test]
fn the_coverage_check_stays_armed_after_a_failure() -> anyhow::Result<()> {
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
    let p = store.get_or_init("p", 2, Init::Const(0.5), Role::Fp32)?;
    let mut engine = Engine::new(store.clone(), EngineConfig::sgd(0.1, 0.0))?;
    for attempt in 0..2 {
        let err = engine
            .step(|_| p.detach().sum_all())
            .map(|_| ())
            .unwrap_err();
        assert!(
            err.to_string().contains("coverage"),
            "attempt {attempt}: {err}"
        );
    }
    assert_eq!(engine.optimizer_steps()?, 0);
    assert_eq!(engine.boundaries(), 0);
    // a backward that reaches p passes and disarms it
    engine.step(|_| p.sum_all())?;
    assert_eq!(engine.optimizer_steps()?, 1);
    Ok(())
}

/// Item 8: Hysteresis with DeepSpeed's semantics: hysteresis 2, overflows T T T T F T T from
/// 65536 give DeepSpeed's scales (it refills hysteresis only when the scale grows).
#[test]
fn hysteresis_follows_deepspeed() -> anyhow::Result<()> {
    let mut s = LossScaler::new(ScalerConfig {
        kind: ScalerKind::Dynamic,
        hysteresis: 2,
        ..ScalerConfig::default()
    })?;
    let mut got = Vec::new();
    for inf in [true, true, true, true, false, true, true] {
        s.update(inf);
        got.push(s.scale());
    }
    assert_eq!(
        got,
        vec![65536.0, 32768.0, 16384.0, 8192.0, 8192.0, 4096.0, 2048.0]
    );
    Ok(())
}
