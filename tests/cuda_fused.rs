//! Fused CUDA kernels against the CPU reference path (run on a GPU machine:
//! `cargo test --release --features cuda --test cuda_fused`).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use candle_nn::Init;
use rand::{Rng, SeedableRng};
use std::time::Instant;
use wick::optim::OptimPath;
use wick::params::Role;
use wick::scaler::{ScalerConfig, ScalerKind};
use wick::{Engine, EngineConfig, ParamStore, Precision};

fn gpu() -> Device {
    Device::new_cuda(0).expect("these tests need a CUDA device")
}

/// Parameter shapes: empty tensors, 1-D, odd sizes, one larger than a chunk (65536), and
/// `tiny` tensors of 1..7 elements.
fn shapes(tiny: usize) -> Vec<Vec<usize>> {
    let mut s = vec![
        vec![0],
        vec![7],
        vec![13, 17],
        vec![0, 5],
        vec![3, 5, 11],
        vec![300, 701],
        vec![65536 * 2 + 3],
    ];
    s.extend((0..tiny).map(|i| vec![1 + i % 7]));
    s
}

fn build(precision: Precision, dev: &Device, shapes: &[Vec<usize>]) -> ParamStore {
    let store = ParamStore::new(precision, dev.clone(), 17);
    for (i, sh) in shapes.iter().enumerate() {
        if sh.iter().product::<usize>() == 0 {
            // candle cannot allocate empty CUDA tensors (cuMemAlloc rejects 0 bytes); the
            // planner's unit test covers empty entries (multi_tensor::tests). Both sides skip them.
            continue;
        }
        // the 2-D tensors feed f32 ops (master differentiated) for every third one
        let role = if sh.len() == 2 && i % 3 == 0 {
            Role::Fp32
        } else {
            Role::Matmul
        };
        store
            .get_or_init(
                &format!("p{i}"),
                sh.clone(),
                Init::Uniform { lo: -1.0, up: 1.0 },
                role,
            )
            .unwrap();
    }
    store
}

/// Loss = sum_i sum(p_i * c_i) (2-D parameters through a transpose, so their gradient is a
/// non-contiguous view): the gradient of p_i is exactly c_i.
fn linear_loss(store: &ParamStore, coeffs: &[Tensor]) -> candle_core::Result<Tensor> {
    let mut terms = Vec::new();
    let nonempty = coeffs.iter().filter(|c| c.elem_count() > 0);
    for (p, c) in store.params().iter().zip(nonempty) {
        let x = p.differentiated();
        let t = if x.rank() == 2 {
            x.t()?.to_dtype(DType::F32)?.mul(&c.t()?)?
        } else {
            x.to_dtype(DType::F32)?.mul(c)?
        };
        terms.push(t.sum_all()?);
    }
    Tensor::stack(&terms, 0)?.sum_all()
}

fn coeffs(
    shapes: &[Vec<usize>],
    rng: &mut rand::rngs::StdRng,
    dev: &Device,
    scale: f32,
) -> Vec<Tensor> {
    shapes
        .iter()
        .filter(|sh| sh.iter().product::<usize>() > 0)
        .map(|sh| {
            let n: usize = sh.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|_| rng.random_range(-1.0f32..1.0) * scale)
                .collect();
            Tensor::from_vec(v, sh.clone(), dev).unwrap()
        })
        .collect()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64 / (y.abs() as f64).max(1e-2))
        .fold(0.0, f64::max)
}

fn run(
    precision: Precision,
    dev: &Device,
    path: OptimPath,
    steps: usize,
    accum: usize,
    clip: Option<f64>,
) -> anyhow::Result<(ParamStore, Engine, Vec<f64>)> {
    let sh = shapes(2000);
    let store = build(precision, dev, &sh);
    let mut cfg = EngineConfig::adamw(1e-2);
    cfg.path = path;
    cfg.accumulation_steps = accum;
    cfg.max_grad_norm = clip;
    #[allow(irrefutable_let_patterns)]
    if let wick::engine::OptimizerConfig::AdamW(c) = &mut cfg.optimizer {
        c.weight_decay = 0.1;
    }
    let mut engine = Engine::new(store.clone(), cfg)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let mut norms = Vec::new();
    for s in 0..steps * accum {
        let c = coeffs(&sh, &mut rng, dev, 1.0 + (s % 3) as f32);
        let r = engine.step_weighted(1.0 + (s % accum) as f64, |_| linear_loss(&store, &c))?;
        if r.boundary {
            norms.push(r.grad_norm()?.unwrap());
        }
    }
    Ok((store, engine, norms))
}

fn compare(a: &ParamStore, b: &ParamStore, ea: &Engine, eb: &Engine) -> anyhow::Result<f64> {
    let mut worst = 0f64;
    let mut note = |name: &str, x: &[f32], y: &[f32]| {
        let e = max_rel(x, y);
        if e > 1e-5 && !name.ends_with(".step") {
            let i = (0..x.len()).max_by(|&i, &j| {
                let r = |k: usize| (x[k] - y[k]).abs() / y[k].abs().max(1e-2);
                r(i).total_cmp(&r(j))
            });
            let i = i.unwrap_or(0);
            eprintln!(
                "{name} ({} elements): rel error {e:.3e} at {i}: gpu {} cpu {}",
                x.len(),
                x[i],
                y[i]
            );
        }
        worst = worst.max(e);
    };
    for (pa, pb) in a.params().iter().zip(b.params().iter()) {
        note(
            &pa.name,
            &flat(pa.master.as_tensor()),
            &flat(pb.master.as_tensor()),
        );
        if let Some(w) = &pa.working {
            // the working copy is exactly the rounded master
            let rounded = flat(&pa.master.as_tensor().to_dtype(w.dtype())?);
            assert_eq!(
                flat(w.as_tensor()),
                rounded,
                "{}: working copy != rounded master",
                pa.name
            );
        }
    }
    let sa = ea.optimizer().state_tensors(&a.params())?;
    let sb = eb.optimizer().state_tensors(&b.params())?;
    for (na, ta) in &sa {
        let (_, tb) = sb
            .iter()
            .find(|(nb, _)| nb == na)
            .expect("same state names");
        note(na, &flat(ta), &flat(tb));
    }
    Ok(worst)
}

#[test]
fn fused_adamw_matches_the_reference_over_100_steps() -> anyhow::Result<()> {
    for precision in [Precision::Fp32, Precision::Bf16Mixed, Precision::F16Mixed] {
        let (sg, eg, ng) = run(precision, &gpu(), OptimPath::Fused, 100, 1, Some(50.0))?;
        let (sc, ec, nc) = run(
            precision,
            &Device::Cpu,
            OptimPath::Reference,
            100,
            1,
            Some(50.0),
        )?;
        let worst = compare(&sg, &sc, &eg, &ec)?;
        let norm_err = ng
            .iter()
            .zip(&nc)
            .map(|(a, b)| (a - b).abs() / b)
            .fold(0.0, f64::max);
        eprintln!("{precision}: max rel error after 100 steps {worst:.3e}, grad norm rel error {norm_err:.3e}");
        assert!(worst <= 1e-5, "{precision}: {worst:e}");
        assert!(norm_err <= 1e-5, "{precision}: grad norm {norm_err:e}");
        assert_eq!(
            eg.optimizer_steps()?,
            ec.optimizer_steps()?,
            "the same steps were skipped"
        );
    }
    Ok(())
}

#[test]
fn fused_accumulation_matches_the_reference() -> anyhow::Result<()> {
    let (sg, eg, ng) = run(Precision::Bf16Mixed, &gpu(), OptimPath::Fused, 20, 3, None)?;
    let (sc, ec, nc) = run(
        Precision::Bf16Mixed,
        &Device::Cpu,
        OptimPath::Reference,
        20,
        3,
        None,
    )?;
    let worst = compare(&sg, &sc, &eg, &ec)?;
    let norm_err = ng
        .iter()
        .zip(&nc)
        .map(|(a, b)| (a - b).abs() / b)
        .fold(0.0, f64::max);
    eprintln!("accumulation x3: max rel error {worst:.3e}, grad norm rel error {norm_err:.3e}");
    assert!(worst <= 1e-5 && norm_err <= 1e-5);
    Ok(())
}

#[test]
fn grad_norm_is_deterministic() -> anyhow::Result<()> {
    let (_, _, a) = run(Precision::Bf16Mixed, &gpu(), OptimPath::Fused, 5, 1, None)?;
    let (_, _, b) = run(Precision::Bf16Mixed, &gpu(), OptimPath::Fused, 5, 1, None)?;
    assert_eq!(a, b, "bitwise identical norms across runs");
    Ok(())
}

#[test]
fn forced_overflow_changes_nothing_but_the_scale() -> anyhow::Result<()> {
    let dev = gpu();
    let sh = shapes(10);
    let store = build(Precision::F16Mixed, &dev, &sh);
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
    let before: Vec<Vec<f32>> = store
        .params()
        .iter()
        .flat_map(|p| [Some(&p.master), p.working.as_ref()])
        .flatten()
        .map(|v| flat(v.as_tensor()))
        .collect();
    let c = coeffs(&sh, &mut rand::rngs::StdRng::seed_from_u64(1), &dev, 1.0);
    let r = engine.step(|_| linear_loss(&store, &c))?;
    assert!(r.skipped()?);
    let after: Vec<Vec<f32>> = store
        .params()
        .iter()
        .flat_map(|p| [Some(&p.master), p.working.as_ref()])
        .flatten()
        .map(|v| flat(v.as_tensor()))
        .collect();
    assert_eq!(before, after);
    for (_, t) in engine.optimizer().state_tensors(&store.params())? {
        assert!(flat(&t).iter().all(|&x| x == 0.0), "moments untouched");
    }
    assert_eq!(engine.optimizer_steps()?, 0);
    assert_eq!(engine.loss_scale()?, 2f32.powi(119));
    Ok(())
}

#[test]
fn device_scaler_matches_the_host_state_machine() -> anyhow::Result<()> {
    let dev = gpu();
    let cfg = ScalerConfig {
        growth_interval: 3,
        hysteresis: 2,
        init_scale: 1024.0,
        ..ScalerConfig::default()
    };
    assert_eq!(cfg.kind, ScalerKind::Dynamic);
    let mut host = wick::LossScaler::new(cfg.clone())?;
    let scaler = Tensor::new(&[1024f32, 0.0, 2.0], &dev)?;
    let applied = Tensor::new(&[0i64], &dev)?;
    let pattern = [
        true, false, false, true, true, false, false, false, false, false, false, true, false,
    ];
    for (i, &inf) in pattern.iter().cycle().take(200).enumerate() {
        let stats = Tensor::new(&[if inf { 1f32 } else { 0.0 }, 0.0, 1.0], &dev)?;
        wick::cuda::scaler::update_scale(&scaler, &applied, &stats, &cfg)?;
        host.update(inf);
        let v: Vec<f32> = scaler.to_vec1()?;
        let h = host.state();
        assert_eq!(
            (v[0], v[1] as u32, v[2] as u32),
            (h.scale, h.growth_tracker, h.hysteresis_left),
            "step {i}"
        );
    }
    Ok(())
}

/// A loss whose forward and backward use only contiguous ops and cuBLAS products: candle
/// uploads the layout of strided/broadcast operands from pageable host memory, which blocks
/// the host behind the stream, so a model with broadcasts would wait inside candle itself.
/// loss = ones(1, k) @ cat_i(p_i(1, n) @ c_i(n, 1)).
fn matmul_loss(
    store: &ParamStore,
    coeffs: &[Tensor],
    _ones: &Tensor,
) -> candle_core::Result<Tensor> {
    let mut terms = Vec::new();
    for (p, c) in store.params().iter().zip(coeffs) {
        let x = p.differentiated();
        let n = x.elem_count();
        terms.push(
            x.reshape((1, n))?
                .matmul(&c.to_dtype(x.dtype())?.reshape((n, 1))?)?
                .to_dtype(DType::F32)?,
        );
    }
    let mut total = terms[0].clone();
    for t in &terms[1..] {
        total = (total + t)?;
    }
    total.reshape(())
}

#[test]
fn the_fused_step_never_waits_for_the_device() -> anyhow::Result<()> {
    let dev = gpu();
    // few tensors: the launch queue behind the busy stream is finite (about a thousand
    // launches), so the test keeps what it enqueues well below that
    let sh = shapes(0);
    let store = build(Precision::Bf16Mixed, &dev, &sh);
    let mut engine = Engine::new(
        store.clone(),
        EngineConfig {
            accumulation_steps: 2,
            max_grad_norm: Some(1.0),
            ..EngineConfig::adamw(1e-3)
        },
    )?;
    let c = coeffs(&sh, &mut rand::rngs::StdRng::seed_from_u64(1), &dev, 1.0);
    let ones = Tensor::ones((1, store.len()), DType::F32, &dev)?;
    engine.step(|_| matmul_loss(&store, &c, &ones))?; // warm-up: module loading, allocations
    engine.step(|_| matmul_loss(&store, &c, &ones))?;
    dev.synchronize()?;
    let cuda = match &dev {
        Device::Cuda(d) => d.clone(),
        _ => unreachable!(),
    };
    // keep the stream busy for ~2 s (H200 clocks ~2 GHz), then enqueue 4 micro-steps (2 optimizer steps)
    wick::cuda::debug::spin(&cuda, 4_000_000_000)?;
    let t = Instant::now();
    let mut reports = Vec::new();
    for _ in 0..2 {
        reports.push(engine.step(|_| matmul_loss(&store, &c, &ones))?);
    }
    let host = t.elapsed();
    dev.synchronize()?;
    let total = t.elapsed();
    eprintln!("2 micro-steps (one optimizer step) queued in {host:?} while the device was busy for {total:?}");
    for r in &reports {
        eprintln!(
            "  host times: forward {:?} backward {:?} optimizer {:?}",
            r.times().forward,
            r.times().backward,
            r.times().optimizer
        );
    }
    assert!(
        total.as_millis() >= 1000,
        "the spin kernel did not run long enough: {total:?}"
    );
    assert!(
        host * 4 < total,
        "Engine::step waited for the device: {host:?} of {total:?}"
    );
    assert!(reports[1].boundary && !reports[1].skipped()?);
    Ok(())
}

/// Diagnostic: which candle operations make the host wait for the device. Each candidate runs
/// right after a 0.3 s spin kernel; a host time near 300 ms means it synchronised. (None of
/// these does. Hundreds of launches queued behind a busy stream do block the host: the launch
/// queue is finite, which is back-pressure, not a synchronisation.)
#[test]
#[ignore]
fn sync_probe() -> anyhow::Result<()> {
    let dev = gpu();
    let cuda = match &dev {
        Device::Cuda(d) => d.clone(),
        _ => unreachable!(),
    };
    let v = candle_core::Var::randn(0f32, 1.0, (1, 64), &dev)?;
    let c = Tensor::randn(0f32, 1.0, (64, 1), &dev)?;
    let probe = |name: &str, f: &dyn Fn() -> anyhow::Result<()>| -> anyhow::Result<()> {
        f()?;
        dev.synchronize()?;
        wick::cuda::debug::spin(&cuda, 600_000_000)?;
        let t = Instant::now();
        f()?;
        let host = t.elapsed();
        dev.synchronize()?;
        eprintln!("{name:<32} host {:>10.3} ms", host.as_secs_f64() * 1e3);
        Ok(())
    };
    probe("zeros_like", &|| {
        v.zeros_like()?;
        Ok(())
    })?;
    probe("ones_like.contiguous", &|| {
        v.ones_like()?.contiguous()?;
        Ok(())
    })?;
    probe("matmul (1,64)@(64,1)", &|| {
        v.matmul(&c)?;
        Ok(())
    })?;
    probe("matmul backward", &|| {
        v.matmul(&c)?.reshape(())?.backward()?;
        Ok(())
    })?;
    probe("mul+sum_all backward", &|| {
        v.as_tensor().mul(&c.t()?)?.sum_all()?.backward()?;
        Ok(())
    })?;
    probe("broadcast_add", &|| {
        v.broadcast_add(&c)?;
        Ok(())
    })?;
    probe("to_dtype bf16", &|| {
        v.to_dtype(DType::BF16)?;
        Ok(())
    })?;
    probe("Tensor::new 4 floats", &|| {
        Tensor::new(&[1f32, 2., 3., 4.], &dev)?;
        Ok(())
    })?;
    probe("Tensor::zeros 1M", &|| {
        Tensor::zeros(1 << 20, DType::F32, &dev)?;
        Ok(())
    })?;
    probe("drop a fresh 1M tensor", &|| {
        let t = Tensor::zeros(1 << 20, DType::F32, &dev)?;
        drop(t);
        Ok(())
    })?;
    Ok(())
}

#[test]
fn in_place_unscale_and_check_matches_the_cpu() -> anyhow::Result<()> {
    let dev = gpu();
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let host: Vec<Vec<f32>> = [7usize, 65536 + 5, 300]
            .iter()
            .map(|&n| {
                (0..n)
                    .map(|_| rng.random_range(-1000.0f32..1000.0))
                    .collect()
            })
            .collect();
        let grads: Vec<Tensor> = host
            .iter()
            .map(|v| {
                Tensor::new(v.as_slice(), &dev)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap()
            })
            .collect();
        let refs: Vec<&Tensor> = grads.iter().collect();
        let found = wick::cuda::grad_norm::unscale_check(&refs, 1.0 / 512.0)?;
        assert_eq!(
            found.to_vec1::<f32>()?,
            vec![0.0],
            "{dt:?}: no inf in finite gradients"
        );
        for (g, v) in grads.iter().zip(&host) {
            // the CPU reference: round to the storage dtype, scale in f32, round back
            let want = Tensor::new(v.as_slice(), &Device::Cpu)?
                .to_dtype(dt)?
                .to_dtype(DType::F32)?
                .affine(1.0 / 512.0, 0.0)?
                .to_dtype(dt)?;
            assert_eq!(flat(g), flat(&want), "{dt:?}");
        }
        let with_inf = Tensor::new(&[1f32, f32::INFINITY, 2.0], &dev)?.to_dtype(dt)?;
        assert_eq!(
            wick::cuda::grad_norm::unscale_check(&[&with_inf], 0.5)?.to_vec1::<f32>()?,
            vec![1.0]
        );
    }
    Ok(())
}
