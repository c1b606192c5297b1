//! Fused CUDA SGD (kernels/sgd.cu) against the CPU paths (run on a GPU machine:
//! `cargo test --release --features cuda --test cuda_sgd`).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor};
use candle_nn::Init;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use wick::engine::OptimizerConfig;
use wick::grads::GradStats;
use wick::optim::{Impl, LrSchedule, OptimPath, Optimizer, Sgd, SgdConfig, StepInputs};
use wick::params::{Param, Role};
use wick::scaler::ScalerConfig;
use wick::{Engine, EngineConfig, ParamStore, Precision};

fn gpu() -> Device {
    Device::new_cuda(0).expect("these tests need a CUDA device")
}

/// The brief's three configurations, each with weight decay.
fn configs() -> Vec<(&'static str, SgdConfig)> {
    vec![
        (
            "momentum 0",
            SgdConfig {
                weight_decay: 0.1,
                ..SgdConfig::new(1e-2, 0.0)
            },
        ),
        (
            "momentum 0.9, dampening 0.1",
            SgdConfig {
                dampening: 0.1,
                weight_decay: 0.1,
                ..SgdConfig::new(1e-2, 0.9)
            },
        ),
        (
            "nesterov 0.9",
            SgdConfig {
                nesterov: true,
                weight_decay: 0.1,
                ..SgdConfig::new(1e-2, 0.9)
            },
        ),
    ]
}

/// Parameter shapes: 1-D, odd sizes, one larger than a chunk (65536) and `tiny` tensors of
/// 1..7 elements. (Empty tensors cannot be allocated on CUDA; the planner's unit test covers
/// them.)
fn shapes(tiny: usize) -> Vec<Vec<usize>> {
    let mut s = vec![
        vec![7],
        vec![13, 17],
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
        // every third 2-D tensor feeds f32 ops (master differentiated, no working copy)
        let role = if sh.len() == 2 && i % 3 == 1 {
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
    for (p, c) in store.params().iter().zip(coeffs) {
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

fn random(shape: &[usize], rng: &mut rand::rngs::StdRng, dev: &Device, scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect();
    Tensor::from_vec(v, shape.to_vec(), dev).unwrap()
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
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64 / (y.abs() as f64).max(1e-2))
        .fold(0.0, f64::max)
}

fn run(
    precision: Precision,
    dev: &Device,
    path: OptimPath,
    config: &SgdConfig,
    steps: usize,
) -> anyhow::Result<(ParamStore, Engine)> {
    let sh = shapes(2000);
    let store = build(precision, dev, &sh);
    let cfg = EngineConfig {
        optimizer: OptimizerConfig::Sgd(config.clone()),
        schedule: LrSchedule::parse("linear:warmup=10,total=100,end_lr=1e-3", config.lr)?,
        path,
        max_grad_norm: Some(50.0),
        ..EngineConfig::sgd(config.lr, config.momentum)
    };
    let mut engine = Engine::new(store.clone(), cfg)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for s in 0..steps {
        let c: Vec<Tensor> = sh
            .iter()
            .map(|sh| random(sh, &mut rng, dev, 1.0 + (s % 3) as f32))
            .collect();
        engine.step(|_| linear_loss(&store, &c))?;
    }
    Ok((store, engine))
}

/// Worst relative difference of masters and optimizer state; checks that every working copy is
/// exactly its rounded master.
fn compare(a: &ParamStore, b: &ParamStore, ea: &Engine, eb: &Engine) -> anyhow::Result<f64> {
    let mut worst = 0f64;
    for (pa, pb) in a.params().iter().zip(b.params().iter()) {
        worst = worst.max(max_rel(
            &flat(pa.master.as_tensor()),
            &flat(pb.master.as_tensor()),
        ));
        if let Some(w) = &pa.working {
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
    let sb: HashMap<String, Tensor> = eb
        .optimizer()
        .state_tensors(&b.params())?
        .into_iter()
        .collect();
    for (name, ta) in &sa {
        let tb = sb
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing on the CPU side"));
        worst = worst.max(max_rel(&flat(ta), &flat(tb)));
    }
    Ok(worst)
}

#[test]
fn fused_sgd_matches_the_reference_over_100_steps() -> anyhow::Result<()> {
    for (label, config) in configs() {
        for precision in [Precision::Fp32, Precision::Bf16Mixed, Precision::F16Mixed] {
            let (sg, eg) = run(precision, &gpu(), OptimPath::Fused, &config, 100)?;
            assert_eq!(eg.implementation(), Impl::FusedCuda);
            let (sc, ec) = run(precision, &Device::Cpu, OptimPath::Reference, &config, 100)?;
            let worst = compare(&sg, &sc, &eg, &ec)?;
            eprintln!("{label}, {precision}: max rel error after 100 steps {worst:.3e}");
            assert!(worst <= 1e-5, "{label}, {precision}: {worst:e}");
            assert_eq!(eg.optimizer_steps()?, ec.optimizer_steps()?);
            let buffers = eg
                .optimizer()
                .state_tensors(&sg.params())?
                .iter()
                .filter(|(n, _)| n.ends_with(".momentum_buffer"))
                .count();
            let want = if config.momentum != 0.0 { sg.len() } else { 0 };
            assert_eq!(buffers, want, "{label}: one momentum buffer per parameter");
        }
    }
    Ok(())
}

/// Direct optimizer calls with an exactly representable multiplier, so the kernel and the CPU
/// paths see the same f32 inputs: a skipped first step, a parameter that receives its first
/// gradient late (its buffer must start as the gradient, not as a dampened one), bf16 and
/// non-contiguous gradients. The results must be bit-identical.
#[test]
fn fused_cuda_sgd_is_bitwise_the_cpu_update_with_late_parameters_and_skips() -> anyhow::Result<()> {
    let dev = gpu();
    let sh = vec![vec![7], vec![13, 17], vec![65536 + 5], vec![40, 30]];
    for (label, base) in configs() {
        let config = SgdConfig {
            dampening: if base.nesterov { 0.0 } else { 0.5 },
            ..base
        };
        let (sg, sc) = (
            build(Precision::Fp32, &dev, &sh),
            build(Precision::Fp32, &Device::Cpu, &sh),
        );
        let mut gpu_opt = Sgd::new(config.clone(), Impl::FusedCuda)?;
        let mut cpu_opt = Sgd::new(config.clone(), Impl::Reference)?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for step in 0..30 {
            let skip = step == 0 || step == 11;
            let late = step < 5; // p3 gets no gradient before step 5
            let lr = 1e-2 * (1.0 + (step % 4) as f64);
            let grads: Vec<(Option<Tensor>, Option<Tensor>)> = sh
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    if i == 3 && late {
                        return (None, None);
                    }
                    if s.len() == 2 {
                        // a non-contiguous gradient: the transpose of a (cols, rows) tensor
                        let t = random(&[s[1], s[0]], &mut rng, &Device::Cpu, 2.0);
                        (
                            Some(t.to_device(&dev).unwrap().t().unwrap()),
                            Some(t.t().unwrap()),
                        )
                    } else if i == 0 {
                        // a bf16 gradient (exact in f32 on both sides)
                        let t = random(s, &mut rng, &Device::Cpu, 2.0)
                            .to_dtype(DType::BF16)
                            .unwrap();
                        (Some(t.to_device(&dev).unwrap()), Some(t))
                    } else {
                        let t = random(s, &mut rng, &Device::Cpu, 2.0);
                        (Some(t.to_device(&dev).unwrap()), Some(t))
                    }
                })
                .collect();
            let (gg, gc): (Vec<_>, Vec<_>) = grads.into_iter().unzip();
            let stats = GradStats::device(Tensor::new(
                &[if skip { 1f32 } else { 0.0 }, 0.0, 0.5],
                &dev,
            )?);
            let inputs = StepInputs {
                stats: &stats,
                lr,
                seed: step,
                stochastic_rounding: false,
            };
            assert_eq!(gpu_opt.step(&sg.params(), &gg, inputs)?, None);
            let host = if skip {
                GradStats::host(wick::grads::HostStats {
                    found_inf: true,
                    norm: f64::INFINITY,
                    multiplier: 0.5,
                })
            } else {
                GradStats::clean(0.5)
            };
            cpu_opt.step(&sc.params(), &gc, StepInputs::host(&host, lr))?;
        }
        let gpu_state: HashMap<String, Tensor> =
            gpu_opt.state_tensors(&sg.params())?.into_iter().collect();
        assert_eq!(flat(&gpu_state["p0.step"]), vec![28.0], "two skipped steps");
        for (pg, pc) in sg.params().iter().zip(sc.params().iter()) {
            assert_eq!(
                flat(pg.master.as_tensor()),
                flat(pc.master.as_tensor()),
                "{label}: {} differs",
                pg.name
            );
        }
        let sgs: HashMap<String, Tensor> =
            cpu_opt.state_tensors(&sc.params())?.into_iter().collect();
        for (name, t) in gpu_opt.state_tensors(&sg.params())? {
            assert_eq!(flat(&t), flat(&sgs[&name]), "{label}: {name} differs");
        }
    }
    Ok(())
}

/// State saved on the CPU (fused) and loaded on the GPU continues exactly like the CPU run.
#[test]
fn state_loaded_on_the_gpu_continues_the_cpu_run() -> anyhow::Result<()> {
    let dev = gpu();
    let sh = vec![vec![7], vec![13, 17], vec![65536 + 5]];
    let (_, config) = configs().swap_remove(1);
    let (sg, sc) = (
        build(Precision::Fp32, &dev, &sh),
        build(Precision::Fp32, &Device::Cpu, &sh),
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let mut grads = || -> Vec<Tensor> {
        sh.iter()
            .map(|s| random(s, &mut rng, &Device::Cpu, 1.0))
            .collect()
    };
    let mut cpu_opt = Sgd::new(config.clone(), Impl::FusedCpu)?;
    let step_cpu = |opt: &mut Sgd, params: &[Param], g: &[Tensor]| -> anyhow::Result<()> {
        let g: Vec<Option<Tensor>> = g.iter().cloned().map(Some).collect();
        opt.step(params, &g, StepInputs::host(&GradStats::clean(0.5), 1e-2))?;
        Ok(())
    };
    for _ in 0..10 {
        step_cpu(&mut cpu_opt, &sc.params(), &grads())?;
    }
    // copy the CPU masters and state to the GPU run
    for (pg, pc) in sg.params().iter().zip(sc.params().iter()) {
        pg.master.set(&pc.master.as_tensor().to_device(&dev)?)?;
    }
    let saved: HashMap<String, Tensor> = cpu_opt.state_tensors(&sc.params())?.into_iter().collect();
    let mut gpu_opt = Sgd::new(config, Impl::FusedCuda)?;
    gpu_opt.load_state_tensors(&sg.params(), &saved, 10)?;
    let stats = GradStats::device(Tensor::new(&[0f32, 0.0, 0.5], &dev)?);
    for step in 0..10 {
        let g = grads();
        step_cpu(&mut cpu_opt, &sc.params(), &g)?;
        let gg: Vec<Option<Tensor>> = g.iter().map(|t| Some(t.to_device(&dev).unwrap())).collect();
        let inputs = StepInputs {
            stats: &stats,
            lr: 1e-2,
            seed: step,
            stochastic_rounding: false,
        };
        gpu_opt.step(&sg.params(), &gg, inputs)?;
    }
    for (pg, pc) in sg.params().iter().zip(sc.params().iter()) {
        assert_eq!(
            flat(pg.master.as_tensor()),
            flat(pc.master.as_tensor()),
            "{}",
            pg.name
        );
    }
    Ok(())
}

#[test]
fn forced_overflow_changes_nothing() -> anyhow::Result<()> {
    let dev = gpu();
    let sh = shapes(10);
    let store = build(Precision::F16Mixed, &dev, &sh);
    let mut engine = Engine::new(
        store.clone(),
        EngineConfig {
            scaler: Some(ScalerConfig {
                init_scale: 2f32.powi(120),
                ..ScalerConfig::default()
            }),
            optimizer: OptimizerConfig::Sgd(SgdConfig {
                dampening: 0.5,
                weight_decay: 0.1,
                ..SgdConfig::new(1e-2, 0.9)
            }),
            ..EngineConfig::sgd(1e-2, 0.9)
        },
    )?;
    let snap = |s: &ParamStore| -> Vec<Vec<f32>> {
        s.params()
            .iter()
            .flat_map(|p| [Some(&p.master), p.working.as_ref()])
            .flatten()
            .map(|v| flat(v.as_tensor()))
            .collect()
    };
    let before = snap(&store);
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let c: Vec<Tensor> = sh.iter().map(|s| random(s, &mut rng, &dev, 1.0)).collect();
    let r = engine.step(|_| linear_loss(&store, &c))?;
    assert!(r.skipped()?);
    assert_eq!(before, snap(&store));
    for (_, t) in engine.optimizer().state_tensors(&store.params())? {
        assert!(
            flat(&t).iter().all(|&x| x == 0.0),
            "momentum buffers untouched"
        );
    }
    assert_eq!(engine.optimizer_steps()?, 0);
    Ok(())
}
