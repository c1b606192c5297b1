//! Muon and parameter groups on the CPU, against references written here: the Newton–Schulz
//! iteration in f64 candle ops and in closed form (a matrix whose SVD is known maps each
//! singular value through the quintic), one Muon step written out by hand (momentum, Nesterov,
//! weight decay, the shape-based rate), the AdamW group bit for bit against AdamW alone,
//! refusals, a bitwise checkpoint resume, and ZeRO-1 with whole matrices per rank.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::Init;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;
use wick::checkpoint::Checkpointer;
use wick::dist::{Collective, DdpConfig, LocalCollective, Zero1Layout};
use wick::engine::OptimizerConfig;
use wick::optim::groups::EMBEDDINGS_AND_HEAD;
use wick::optim::muon::newton_schulz;
use wick::optim::{
    AdamWConfig, AdjustLr, LrSchedule, MuonConfig, ParamGroup, ParamGroups, RuleConfig, Select,
};
use wick::params::Role;
use wick::{Engine, EngineConfig, ParamStore, Precision};

const COEFFS: (f64, f64, f64) = (3.4445, -4.7750, 2.0315);

/// Newton–Schulz in f64 candle ops (no bf16): the transpose, the Frobenius normalisation and
/// `X = a X + b (X X^T) X + c (X X^T)^2 X`.
fn ns_f64(g: &Tensor, steps: usize) -> Result<Tensor> {
    let (a, b, c) = COEFFS;
    let (r, k) = g.dims2()?;
    let mut x = g.to_dtype(DType::F64)?;
    if r > k {
        x = x.t()?.contiguous()?;
    }
    let n = x.sqr()?.sum_all()?.sqrt()?.to_scalar::<f64>()?.max(1e-7);
    x = (x / n)?;
    for _ in 0..steps {
        let xxt = x.matmul(&x.t()?)?;
        let xxt2 = xxt.matmul(&xxt)?;
        x = (((&x * a)? + (xxt.matmul(&x)? * b)?)? + (xxt2.matmul(&x)? * c)?)?;
    }
    if r > k {
        x = x.t()?.contiguous()?;
    }
    Ok(x)
}

/// A random `n x n` orthogonal matrix (Gram–Schmidt of a seeded Gaussian-ish matrix), f64.
fn orthogonal(n: usize, seed: u64) -> Vec<Vec<f64>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut q: Vec<Vec<f64>> = Vec::new();
    while q.len() < n {
        let mut v: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        for u in &q {
            let d: f64 = v.iter().zip(u).map(|(a, b)| a * b).sum();
            v.iter_mut().zip(u).for_each(|(a, b)| *a -= d * b);
        }
        let norm = v.iter().map(|a| a * a).sum::<f64>().sqrt();
        if norm > 1e-3 {
            q.push(v.into_iter().map(|a| a / norm).collect());
        }
    }
    q
}

/// `sum_i s_i u_i v_i^T` for the first `s.len()` columns of `u` (rows x rows) and `v`.
fn from_svd(u: &[Vec<f64>], s: &[f64], v: &[Vec<f64>]) -> Vec<f64> {
    let (rows, cols) = (u.len(), v.len());
    let mut m = vec![0.0; rows * cols];
    for (k, sk) in s.iter().enumerate() {
        for i in 0..rows {
            for j in 0..cols {
                m[i * cols + j] += sk * u[k][i] * v[k][j];
            }
        }
    }
    m
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    let d = (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?;
    Ok(d.abs()?.flatten_all()?.max(0)?.to_scalar::<f64>()?)
}

/// A matrix with known singular vectors and values comes out with the same singular vectors
/// and each value `s` mapped to `phi(s / ||S||)`, phi being the quintic
/// `a x + b x^3 + c x^5` applied five times (closed form); the values land in the band the
/// coefficients are chosen for, about [0.7, 1.2], so the result is nearly orthogonal.
#[test]
fn newton_schulz_maps_singular_values_through_the_quintic() -> Result<()> {
    let s = [3.0, 2.5, 2.0, 1.6, 1.3, 1.1, 1.0, 0.9];
    let frob = s.iter().map(|x| x * x).sum::<f64>().sqrt();
    let (a, b, c) = COEFFS;
    let phi: Vec<f64> = s
        .iter()
        .map(|&x| (0..5).fold(x / frob, |y, _| a * y + b * y.powi(3) + c * y.powi(5)))
        .collect();
    for &y in &phi {
        assert!(
            (0.6..1.3).contains(&y),
            "singular value {y} outside the NS band"
        );
    }
    for (rows, cols) in [(8, 16), (16, 8), (8, 8)] {
        let (u, v) = (orthogonal(rows, 1), orthogonal(cols, 2));
        let k = rows.min(cols);
        let g = Tensor::from_vec(from_svd(&u, &s[..k], &v), (rows, cols), &Device::Cpu)?;
        let want = Tensor::from_vec(from_svd(&u, &phi[..k], &v), (rows, cols), &Device::Cpu)?;
        let g32 = g.to_dtype(DType::F32)?;
        let got = newton_schulz(&g32, COEFFS, 5, 1e-7, DType::F32)?;
        assert_eq!(got.dims(), &[rows, cols]);
        let err = max_abs_diff(&got, &want)?;
        assert!(
            err < 2e-5,
            "{rows}x{cols}: f32 max |NS - U phi(S) V^T| = {err}"
        );
        // in bf16 (8 significant bits, five iterations whose slope near 0 is a = 3.4) as
        // torch.optim.Muon runs it: entries up to about 0.6 are off by a few hundredths
        let bf16 = newton_schulz(&g32, COEFFS, 5, 1e-7, DType::BF16)?;
        assert_eq!(bf16.dtype(), DType::BF16);
        let err = max_abs_diff(&bf16, &want)?;
        println!("{rows}x{cols}: bf16 vs closed form: {err}");
        assert!(
            err < 0.1,
            "{rows}x{cols}: bf16 max |NS - U phi(S) V^T| = {err}"
        );
        // and the same matrix through the f64 reference: only the bf16 rounding differs
        let f64_err = max_abs_diff(&ns_f64(&g, 5)?, &want)?;
        assert!(
            f64_err < 1e-9,
            "{rows}x{cols}: f64 reference off by {f64_err}"
        );
    }
    Ok(())
}

/// Random matrices, wide and tall, against the f64 reference.
#[test]
fn newton_schulz_matches_a_reference_in_candle_ops() -> Result<()> {
    for (rows, cols, seed) in [(24, 40, 3), (40, 24, 4), (1, 7, 5), (33, 1, 6)] {
        let mut rng = StdRng::seed_from_u64(seed);
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let g = Tensor::from_vec(v, (rows, cols), &Device::Cpu)?;
        let want = ns_f64(&g, 5)?;
        let err = max_abs_diff(&newton_schulz(&g, COEFFS, 5, 1e-7, DType::F32)?, &want)?;
        assert!(err < 2e-5, "{rows}x{cols}: f32 {err}");
        let err = max_abs_diff(&newton_schulz(&g, COEFFS, 5, 1e-7, DType::BF16)?, &want)?;
        println!("{rows}x{cols}: NS bf16 vs f64: {err}");
        assert!(err < 0.1, "{rows}x{cols}: bf16 {err}");
    }
    let zeros = Tensor::zeros(4, DType::F32, &Device::Cpu)?;
    let bad = newton_schulz(&zeros, COEFFS, 5, 1e-7, DType::BF16);
    assert!(format!("{:#}", bad.unwrap_err()).contains("2-D"));
    Ok(())
}

/// The parameters of the step tests: two hidden matrices (tall, wide), an embedding, a bias.
const SHAPES: &[(&str, &[usize])] = &[
    ("blocks.0.fc.weight", &[12, 4]),
    ("blocks.0.proj.weight", &[4, 12]),
    ("wte.weight", &[10, 4]),
    ("blocks.0.fc.bias", &[12]),
];

fn model(seed: u64) -> Result<ParamStore> {
    model_on(seed, &Device::Cpu)
}

fn model_on(seed: u64, dev: &Device) -> Result<ParamStore> {
    let s = ParamStore::new(Precision::Fp32, dev.clone(), seed);
    for (name, shape) in SHAPES {
        let role = if shape.len() == 2 {
            Role::Matmul
        } else {
            Role::Fp32
        };
        s.get_or_init(
            name,
            shape.to_vec(),
            Init::Uniform { lo: -1.0, up: 1.0 },
            role,
        )?;
    }
    Ok(s)
}

/// The coefficient tensors of step `step`: the loss `sum_p sum(C_p * p) + 0.1 * sum(p^2)`, so
/// the gradient of `p` is `C_p + 0.2 p`, in a new direction at every step (so that momentum
/// and Nesterov change the direction Muon orthogonalises, not only its scale).
fn coefficients(step: u64) -> Result<Vec<Tensor>> {
    let mut rng = StdRng::seed_from_u64(11 + step);
    SHAPES
        .iter()
        .map(|(_, shape)| {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            Ok(Tensor::from_vec(v, shape.to_vec(), &Device::Cpu)?)
        })
        .collect()
}

/// Steps `first..first + n` of the loss of [`coefficients`].
fn steps(engine: &mut Engine, store: &ParamStore, first: u64, n: u64) -> Result<()> {
    steps_scaled(engine, store, first, n, 1.0)
}

/// [`steps`] with the loss multiplied by `scale` (infinity: a step to skip).
fn steps_scaled(
    engine: &mut Engine,
    store: &ParamStore,
    first: u64,
    n: u64,
    scale: f64,
) -> Result<()> {
    let dev = store.device().clone();
    for step in first..first + n {
        let cs = coefficients(step)?
            .into_iter()
            .map(|c| c.to_device(&dev))
            .collect::<candle_core::Result<Vec<_>>>()?;
        engine.step(|_| {
            let mut loss = Tensor::zeros((), DType::F32, &dev)?;
            for ((name, _), c) in SHAPES.iter().zip(&cs) {
                let p = store.get(name).expect("created").differentiated().clone();
                loss = (loss + (p.mul(c)?.sum_all()? + (p.sqr()?.sum_all()? * 0.1)?)?)?;
            }
            loss * scale
        })?;
    }
    Ok(())
}

fn muon_config(adjust: AdjustLr, ns_dtype: DType) -> MuonConfig {
    MuonConfig {
        lr: 0.02,
        weight_decay: 0.1,
        adjust_lr: adjust,
        ns_dtype,
        ..MuonConfig::default()
    }
}

const ADAMW: AdamWConfig = AdamWConfig {
    lr: 0.02,
    beta1: 0.9,
    beta2: 0.99,
    eps: 1e-8,
    weight_decay: 0.1,
};

fn engine(store: &ParamStore, groups: ParamGroups, lr: f64) -> Result<Engine> {
    let cfg = EngineConfig {
        optimizer: OptimizerConfig::Groups(groups),
        schedule: LrSchedule::Constant { lr },
        ..EngineConfig::adamw(lr)
    };
    Engine::new(store.clone(), cfg)
}

fn values(store: &ParamStore, name: &str) -> Result<Tensor> {
    Ok(store
        .get(name)
        .expect("created")
        .master
        .as_detached_tensor())
}

/// Three steps of the Muon group against the step written out here in f64 (momentum,
/// Nesterov, decoupled decay at the group's rate, the shape-based rate, the Newton–Schulz of
/// [`ns_f64`]) for both rate adjustments and a group scale of 2: with the iterations in f32 to
/// a few ulps of f32, in bf16 (PyTorch's) within bf16's rounding. The AdamW group's
/// parameters move bit for bit as AdamW alone moves them.
#[test]
fn muon_steps_match_a_hand_written_step_and_adamw_keeps_its_bits() -> Result<()> {
    let (lr, scale, n) = (0.02, 2.0, 3u64);
    for (adjust, ns_dtype) in [
        (AdjustLr::Original, DType::F32),
        (AdjustLr::MatchRmsAdamW, DType::F32),
        (AdjustLr::Original, DType::BF16),
    ] {
        let store = model(5)?;
        let init: HashMap<&str, Tensor> = SHAPES
            .iter()
            .map(|(n, _)| Ok((*n, values(&store, n)?.to_dtype(DType::F64)?)))
            .collect::<Result<_>>()?;
        let muon = muon_config(adjust, ns_dtype);
        let groups = ParamGroups::muon_with_adamw(muon, ADAMW, EMBEDDINGS_AND_HEAD)
            .with_lr_scale("muon", scale)?;
        let mut e = engine(&store, groups, lr)?;
        steps(&mut e, &store, 0, n)?;

        for (k, (name, shape)) in SHAPES.iter().enumerate().take(2) {
            let (rows, cols) = (shape[0] as f64, shape[1] as f64);
            let group_lr = lr * scale;
            let step_lr = match adjust {
                AdjustLr::Original => group_lr * (rows / cols).max(1.0).sqrt(),
                AdjustLr::MatchRmsAdamW => group_lr * 0.2 * rows.max(cols).sqrt(),
            };
            let mut p = init[name].clone();
            let mut buf = p.zeros_like()?;
            for step in 0..n {
                let c = coefficients(step)?[k].to_dtype(DType::F64)?;
                let g = (&c + (&p * 0.2)?)?;
                buf = ((&buf * 0.95)? + (&g * 0.05)?)?;
                let u = ((&g * 0.05)? + (&buf * 0.95)?)?;
                let o = ns_f64(&u, 5)?;
                p = ((&p * (1.0 - group_lr * 0.1))? - (o * step_lr)?)?;
            }
            let moved = max_abs_diff(&p, &init[name])?;
            let err = max_abs_diff(&values(&store, name)?, &p)?;
            println!("{adjust:?} {ns_dtype:?} {name}: off by {err}, moved up to {moved}");
            let tol = if ns_dtype == DType::F32 { 1e-5 } else { 0.1 };
            assert!(
                err < tol * moved,
                "{adjust:?} {ns_dtype:?} {name}: off by {err}, moved up to {moved}"
            );
        }

        // AdamW alone over the same store: the embedding and the bias move the same bits
        let alone = model(5)?;
        let cfg = EngineConfig {
            optimizer: OptimizerConfig::AdamW(ADAMW),
            schedule: LrSchedule::Constant { lr },
            ..EngineConfig::adamw(lr)
        };
        let mut a = Engine::new(alone.clone(), cfg)?;
        steps(&mut a, &alone, 0, n)?;
        for name in ["wte.weight", "blocks.0.fc.bias"] {
            let (x, y) = (values(&store, name)?, values(&alone, name)?);
            assert_eq!(common::flat(&x), common::flat(&y), "{name}");
        }
    }
    Ok(())
}

/// A group that hands Muon a 1-D parameter is refused by name and the step changes nothing;
/// so is a parameter no group selects.
#[test]
fn muon_refuses_non_matrices_and_unselected_parameters() -> Result<()> {
    let everything_muon = ParamGroups(vec![ParamGroup {
        name: "all".into(),
        select: Select::default(),
        rule: RuleConfig::Muon(MuonConfig::default()),
        lr_scale: 1.0,
    }]);
    let store = model(5)?;
    let before = store.masters();
    let mut e = engine(&store, everything_muon, 0.01)?;
    let err = format!("{:#}", steps(&mut e, &store, 0, 1).unwrap_err());
    assert!(
        err.contains("blocks.0.fc.bias") && err.contains("2-D"),
        "{err}"
    );
    for ((_, a), (_, b)) in before.iter().zip(store.masters()) {
        assert_eq!(common::flat(a), common::flat(&b));
    }
    assert!(e.optimizer_state()?.is_empty());

    let only_matrices = ParamGroups(vec![ParamGroup {
        name: "matrices".into(),
        select: Select {
            rank: Some(2),
            ..Select::default()
        },
        rule: RuleConfig::Muon(MuonConfig::default()),
        lr_scale: 1.0,
    }]);
    let mut e = engine(&store, only_matrices, 0.01)?;
    let err = format!("{:#}", steps(&mut e, &store, 0, 1).unwrap_err());
    assert!(
        err.contains("blocks.0.fc.bias") && err.contains("no parameter group"),
        "{err}"
    );

    let bad = MuonConfig {
        ns_steps: 100,
        ..MuonConfig::default()
    };
    let groups = ParamGroups::muon_with_adamw(bad, ADAMW, EMBEDDINGS_AND_HEAD);
    let err = format!("{:#}", engine(&store, groups, 0.01).err().expect("refused"));
    assert!(err.contains("ns_steps"), "{err}");
    let err = "newton".parse::<AdjustLr>().unwrap_err().to_string();
    assert!(
        err.contains("newton") && err.contains("match_rms_adamw"),
        "{err}"
    );
    Ok(())
}

/// Four steps straight, and two steps, a checkpoint, a fresh engine resumed from it and two
/// more: the same bits. The checkpoint holds Muon's momentum for the matrices and AdamW's
/// moments and counts for the rest.
#[test]
fn checkpoint_resume_with_muon_is_bitwise() -> Result<()> {
    let groups = || {
        ParamGroups::muon_with_adamw(
            muon_config(AdjustLr::Original, DType::BF16),
            ADAMW,
            EMBEDDINGS_AND_HEAD,
        )
    };
    let straight = model(5)?;
    let mut e = engine(&straight, groups(), 0.02)?;
    steps(&mut e, &straight, 0, 4)?;

    let dir = common::tmp("muon-resume");
    let first = model(5)?;
    let mut e1 = engine(&first, groups(), 0.02)?;
    steps(&mut e1, &first, 0, 2)?;
    let names: Vec<String> = e1.optimizer_state()?.into_iter().map(|(n, _)| n).collect();
    for want in [
        "blocks.0.fc.weight.momentum_buffer",
        "blocks.0.proj.weight.momentum_buffer",
        "wte.weight.exp_avg",
        "wte.weight.exp_avg_sq",
        "wte.weight.step",
        "blocks.0.fc.bias.exp_avg",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "{want} missing from {names:?}"
        );
    }
    assert!(
        !names.iter().any(|n| n == "blocks.0.fc.weight.exp_avg"),
        "{names:?}"
    );
    Checkpointer::new(&dir, 0).save(&e1, serde_json::Value::Null)?;

    let resumed = model(77)?; // other initial values: the checkpoint restores them
    let mut e2 = engine(&resumed, groups(), 0.02)?;
    Checkpointer::new(&dir, 0)
        .resume(&mut e2)?
        .expect("a checkpoint");
    steps(&mut e2, &resumed, 2, 2)?;
    for ((n, a), (_, b)) in straight.masters().iter().zip(resumed.masters()) {
        assert_eq!(common::flat(a), common::flat(&b), "{n}");
    }
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

/// Runs `f(rank, collective)` on `world` threads; results in rank order.
fn run_ranks<R: Send + 'static>(
    world: usize,
    f: impl Fn(usize, Box<dyn Collective>) -> Result<R> + Send + Sync + 'static,
) -> Vec<Result<R>> {
    let f = Arc::new(f);
    let hs: Vec<_> = LocalCollective::group(world)
        .expect("a local group")
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let f = f.clone();
            std::thread::spawn(move || f(r, Box::new(c)))
        })
        .collect();
    hs.into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

type RankOutcome = (Vec<(String, Tensor)>, Vec<String>, Vec<String>);

/// ZeRO-1 over two ranks (threads): each rank keeps Muon momentum for whole matrices it owns
/// only (the two ranks' sets are disjoint and cover every matrix), the masters match one rank
/// bit for bit (every rank sees the same gradient), and the gathered state is the full state.
/// The flat layout, which splits matrices, is refused.
#[test]
fn zero1_owns_whole_matrices_and_matches_one_rank() -> Result<()> {
    let groups = || {
        ParamGroups::muon_with_adamw(
            muon_config(AdjustLr::Original, DType::BF16),
            ADAMW,
            EMBEDDINGS_AND_HEAD,
        )
    };
    let solo = model(5)?;
    let mut e = engine(&solo, groups(), 0.02)?;
    steps(&mut e, &solo, 0, 3)?;

    let out = run_ranks(2, move |_, c| -> Result<RankOutcome> {
        let store = model(5)?;
        let zero1 = DdpConfig {
            zero1: true,
            zero1_layout: Zero1Layout::Parameters,
            ..DdpConfig::default()
        };
        let mut e = engine(&store, groups(), 0.02)?.with_collective(c, zero1)?;
        steps(&mut e, &store, 0, 3)?;
        let local: Vec<String> = e
            .optimizer()
            .state_tensors(&store.params())?
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| n.ends_with("momentum_buffer"))
            .collect();
        let gathered: Vec<String> = e.optimizer_state()?.into_iter().map(|(n, _)| n).collect();
        Ok((store.masters(), local, gathered))
    });
    let out: Vec<RankOutcome> = out.into_iter().collect::<Result<_>>()?;
    let mut owned: Vec<String> = Vec::new();
    for (masters, local, gathered) in &out {
        for ((n, a), (_, b)) in solo.masters().iter().zip(masters) {
            assert_eq!(common::flat(a), common::flat(b), "{n}");
        }
        for n in local {
            assert!(!owned.contains(n), "{n} owned by both ranks");
            owned.push(n.clone());
        }
        for m in ["blocks.0.fc.weight", "blocks.0.proj.weight"] {
            assert!(
                gathered.contains(&format!("{m}.momentum_buffer")),
                "{gathered:?}"
            );
        }
    }
    owned.sort();
    assert_eq!(
        owned,
        [
            "blocks.0.fc.weight.momentum_buffer",
            "blocks.0.proj.weight.momentum_buffer"
        ]
    );
    assert!(
        out.iter().all(|(_, l, _)| l.len() == 1),
        "one matrix per rank"
    );

    let flat = run_ranks(2, move |_, c| -> Result<()> {
        let store = model(5)?;
        let cfg = DdpConfig {
            zero1: true,
            zero1_layout: Zero1Layout::Flat,
            ..DdpConfig::default()
        };
        engine(&store, groups(), 0.02)?
            .with_collective(c, cfg)
            .map(|_| ())
    });
    for r in flat {
        let err = format!("{:#}", r.unwrap_err());
        assert!(err.contains("flat ZeRO-1") && err.contains("Muon"), "{err}");
    }
    Ok(())
}

/// On a GPU (the fused CUDA path: statistics stay on the device): the Newton–Schulz in bf16
/// close to the f64 reference; three Muon + AdamW steps close to the same steps on the CPU
/// (bf16 GEMMs of cuBLAS and of the CPU round differently: each is a few % of the update off
/// the f64 step, `muon_steps_match_a_hand_written_step_and_adamw_keeps_its_bits`); a step whose loss is infinite
/// skipped, masters and Muon's momentum untouched, without a host read deciding it.
#[cfg(feature = "cuda")]
#[test]
fn muon_on_the_gpu_matches_the_cpu_and_skips_an_inf_step() -> Result<()> {
    let Ok(dev) = Device::new_cuda(0) else {
        eprintln!("no CUDA device: skipped");
        return Ok(());
    };
    let mut rng = StdRng::seed_from_u64(3);
    let v: Vec<f32> = (0..40 * 24).map(|_| rng.random_range(-1.0..1.0)).collect();
    let g = Tensor::from_vec(v, (40, 24), &Device::Cpu)?;
    let got = newton_schulz(&g.to_device(&dev)?, COEFFS, 5, 1e-7, DType::BF16)?;
    assert!(got.device().is_cuda() && got.dtype() == DType::BF16);
    let err = max_abs_diff(&got.to_device(&Device::Cpu)?, &ns_f64(&g, 5)?)?;
    assert!(err < 0.1, "GPU bf16 NS vs f64: {err}");

    let groups = || {
        ParamGroups::muon_with_adamw(
            muon_config(AdjustLr::Original, DType::BF16),
            ADAMW,
            EMBEDDINGS_AND_HEAD,
        )
    };
    let cpu = model(5)?;
    let gpu = model_on(5, &dev)?;
    let masters: HashMap<String, Tensor> = cpu.masters().into_iter().collect();
    gpu.load_masters(&masters)?;
    let mut e_cpu = engine(&cpu, groups(), 0.02)?;
    let mut e_gpu = engine(&gpu, groups(), 0.02)?;
    assert_eq!(e_gpu.implementation(), wick::optim::Impl::FusedCuda);
    steps(&mut e_cpu, &cpu, 0, 3)?;
    steps(&mut e_gpu, &gpu, 0, 3)?;
    for ((n, a), (_, b)) in cpu.masters().iter().zip(gpu.masters()) {
        let moved = max_abs_diff(a, &masters[n])?;
        let err = max_abs_diff(a, &b.to_device(&Device::Cpu)?)?;
        println!("{n}: GPU vs CPU {err}, moved up to {moved}");
        assert!(
            err < 0.25 * moved + 1e-6,
            "{n}: GPU vs CPU {err}, moved {moved}"
        );
    }

    // copies: masters are written in place, and the fused AdamW kernel updates its moments so
    let before: Vec<(String, Tensor)> = gpu
        .masters()
        .into_iter()
        .map(|(n, t)| Ok((n, t.copy()?)))
        .collect::<Result<_>>()?;
    let momentum: Vec<(String, Tensor)> = e_gpu
        .optimizer_state()?
        .into_iter()
        .map(|(n, t)| Ok((n, t.copy()?)))
        .collect::<Result<_>>()?;
    steps_scaled(&mut e_gpu, &gpu, 3, 1, f64::INFINITY)?;
    for ((n, a), (_, b)) in before.iter().zip(gpu.masters()) {
        assert_eq!(
            common::flat(a),
            common::flat(&b),
            "{n} changed in a skipped step"
        );
    }
    for ((n, a), (_, b)) in momentum.iter().zip(e_gpu.optimizer_state()?) {
        assert_eq!(
            common::flat(a),
            common::flat(&b),
            "{n} changed in a skipped step"
        );
    }
    assert_eq!(e_gpu.optimizer_steps()?, 3);
    Ok(())
}
