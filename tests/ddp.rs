//! Data parallelism on the CPU: bucketing, averaging, skip agreement, equivalence of 2
//! simulated ranks with 1 rank, ZeRO-1 shard arithmetic, `wick launch` supervision.
//!
//! Ranks are threads sharing a `LocalCollective` (exact, deterministic sums); each builds its
//! own `ParamStore` and `Engine` from the same seed, as separate processes would.

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use wick::data::{DistributedSampler, Sampler};
use wick::dist::ddp::assign_buckets;
use wick::dist::{BucketConfig, Collective, DdpConfig, LocalCollective, Zero1Layout};
use wick::{loss, nn, Engine, EngineConfig, ParamStore, Precision, ScalerConfig};

const IN: usize = 6;
const OUT: usize = 3;

struct Mlp {
    l1: nn::Linear,
    l2: nn::Linear,
    l3: nn::Linear,
}

impl Mlp {
    fn new(s: &ParamStore, hidden: usize) -> candle_core::Result<Self> {
        Ok(Self {
            l1: nn::Linear::new(s, "l1", IN, hidden, true)?,
            l2: nn::Linear::new(s, "l2", hidden, hidden, true)?,
            l3: nn::Linear::new(s, "l3", hidden, OUT, true)?,
        })
    }
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l3
            .forward(&self.l2.forward(&self.l1.forward(x)?.tanh()?)?.tanh()?)
    }
}

/// The global batch of step `step`: `n` samples.
fn global_batch(n: usize, step: u64) -> (Tensor, Tensor) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1000 + step);
    let x: Vec<f32> = (0..n * IN).map(|_| rng.random_range(-1.0..1.0)).collect();
    let y: Vec<u32> = (0..n).map(|_| rng.random_range(0..OUT as u32)).collect();
    (
        Tensor::from_vec(x, (n, IN), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, n, &Device::Cpu).unwrap(),
    )
}

fn rows(x: &Tensor, y: &Tensor, idx: &[usize]) -> Result<(Tensor, Tensor)> {
    let i = Tensor::from_vec(
        idx.iter().map(|&v| v as u32).collect::<Vec<_>>(),
        idx.len(),
        &Device::Cpu,
    )?;
    Ok((x.index_select(&i, 0)?, y.index_select(&i, 0)?))
}

fn masters(s: &ParamStore) -> Vec<Vec<f32>> {
    s.params()
        .iter()
        .map(|p| p.master.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

/// Runs `f(rank, collective)` on `world` threads; results in rank order.
fn run_ranks<R: Send + 'static>(
    world: usize,
    f: impl Fn(usize, Box<dyn Collective>) -> Result<R> + Send + Sync + 'static,
) -> Vec<Result<R>> {
    let f = Arc::new(f);
    let hs: Vec<_> = LocalCollective::group(world)
        .unwrap()
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

/// Max over tensors of `max_i |a_i - b_i| / max_i |b_i|`: the error relative to each
/// tensor's scale. (Element by element, parameters that pass near zero show the few-ulp
/// differences of a different summation order as large ratios: 2.5e-5 at an element of 3e-4
/// whose tensor reaches 0.42, a difference of 7.5e-9.)
fn max_rel(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let mut m = 0f64;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len());
        let scale = y.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
        let diff = x
            .iter()
            .zip(y)
            .fold(0f64, |m, (&p, &q)| m.max((p as f64 - q as f64).abs()));
        if scale > 0.0 {
            m = m.max(diff / scale);
        } else {
            m = m.max(diff);
        }
    }
    m
}

#[test]
fn bucketing_covers_every_parameter_once_and_respects_the_cap() -> Result<()> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for trial in 0..50 {
        let n = rng.random_range(0..40);
        let numels: Vec<usize> = (0..n)
            .map(|_| {
                if rng.random_bool(0.1) {
                    0
                } else {
                    rng.random_range(1..300_000)
                }
            })
            .collect();
        let cfg = BucketConfig {
            bucket_cap_mb: [0.05, 0.5, 1.0, 25.0][trial % 4],
            first_bucket_cap_mb: if trial % 3 == 0 { Some(0.1) } else { None },
        };
        let buckets = assign_buckets(&numels, 4, &cfg)?;
        let mut seen = vec![0usize; n];
        let mut order = Vec::new();
        for (bi, b) in buckets.iter().enumerate() {
            assert!(!b.members.is_empty());
            let cap = cfg.cap_bytes(bi);
            assert!(
                b.bytes(4) <= cap || b.members.len() == 1,
                "bucket {bi} of {} bytes over the cap {cap}",
                b.bytes(4)
            );
            let mut off = 0;
            for (&m, &o) in b.members.iter().zip(&b.offsets) {
                assert_eq!(o, off);
                off += numels[m];
                seen[m] += 1;
                order.push(m);
            }
            assert_eq!(off, b.numel);
        }
        assert!(seen.iter().all(|&s| s == 1), "{seen:?}");
        // consecutive, in reverse registration order (PyTorch DDP)
        assert_eq!(order, (0..n).rev().collect::<Vec<_>>());
        // greedy: a bucket closes only when the next member does not fit
        for w in buckets.windows(2) {
            let next = numels[w[1].members[0]];
            assert!(
                w[0].bytes(4) + next * 4
                    > cfg.cap_bytes(buckets.iter().position(|b| b == &w[0]).unwrap())
            );
        }
    }
    // on a real model: 6 parameters, a 0.001 MiB cap splits them
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
    let _m = Mlp::new(&store, 16)?;
    let group = LocalCollective::group(1)?.pop().unwrap();
    let cfg = DdpConfig {
        buckets: BucketConfig {
            bucket_cap_mb: 0.001,
            first_bucket_cap_mb: None,
        },
        ..DdpConfig::default()
    };
    let ddp = wick::dist::ddp::Ddp::new(Box::new(group), cfg)?;
    let b = ddp.buckets(&store.params())?;
    assert!(b.len() > 1);
    assert_eq!(b.iter().map(|b| b.members.len()).sum::<usize>(), 6);
    Ok(())
}

/// One rank's training run: `steps` AdamW steps on its shard of each global batch.
#[derive(Clone, Copy)]
struct Run {
    world: usize,
    global: usize,
    steps: u64,
    accumulation: usize,
    max_grad_norm: Option<f64>,
    /// `(rank 0 share, rank 1 share)` of the global batch, when not the sampler's even split.
    uneven: Option<usize>,
}

/// What a rank ends with: masters, boundary norms, the moment elements this rank holds, and
/// the full state as a checkpoint sees it (`Engine::optimizer_state`).
struct Outcome {
    masters: Vec<Vec<f32>>,
    norms: Vec<f64>,
    local_state_elems: usize,
    full_state: Vec<(String, Vec<f32>)>,
}

fn train(
    run: Run,
    rank: usize,
    coll: Option<Box<dyn Collective>>,
    dev: &Device,
) -> Result<(Vec<Vec<f32>>, Vec<f64>)> {
    let o = train_full(run, rank, coll.map(|c| (c, None)), dev)?;
    Ok((o.masters, o.norms))
}

fn train_full(
    run: Run,
    rank: usize,
    coll: Option<(Box<dyn Collective>, Option<Zero1Layout>)>,
    dev: &Device,
) -> Result<Outcome> {
    // every rank builds the model from the same seed; rank 1 from another seed to show the
    // broadcast from rank 0 makes them equal
    let seed = if coll.is_some() && rank == 1 { 99 } else { 7 };
    let store = ParamStore::new(Precision::Fp32, dev.clone(), seed);
    let model = Mlp::new(&store, 24)?;
    let mut cfg = EngineConfig::adamw(3e-3);
    cfg.accumulation_steps = run.accumulation;
    cfg.max_grad_norm = run.max_grad_norm;
    let mut engine = Engine::new(store.clone(), cfg)?;
    if let Some((c, zero1)) = coll {
        let small = DdpConfig {
            buckets: BucketConfig {
                bucket_cap_mb: 0.002,
                first_bucket_cap_mb: Some(0.0005),
            },
            zero1: zero1.is_some(),
            zero1_layout: zero1.unwrap_or_default(),
            ..DdpConfig::default()
        };
        engine = engine.with_collective(c, small)?;
    }
    let mut norms = Vec::new();
    for step in 0..run.steps {
        let (x, y) = global_batch(run.global, step);
        let order = Sampler {
            shuffle: true,
            seed: 5,
        }
        .epoch_order(run.global, step);
        let mine: Vec<usize> = match (run.world, run.uneven) {
            (1, _) => order,
            (_, Some(k)) => {
                if rank == 0 {
                    order[..k].to_vec()
                } else {
                    order[k..].to_vec()
                }
            }
            (w, None) => DistributedSampler::new(rank, w)?.shard(&order),
        };
        // split this rank's samples into `accumulation` micro-batches of unequal sizes
        let mut cuts = vec![0];
        for a in 1..run.accumulation {
            cuts.push((mine.len() * a / run.accumulation + a).min(mine.len()));
        }
        cuts.push(mine.len());
        for w in cuts.windows(2) {
            let (xb, yb) = rows(&x, &y, &mine[w[0]..w[1]])?;
            let (xb, yb) = (xb.to_device(dev)?, yb.to_device(dev)?);
            let n = w[1] - w[0];
            let r = engine
                .step_weighted(n as f64, |_| loss::cross_entropy(&model.forward(&xb)?, &yb))?;
            if r.boundary {
                norms.push(r.grad_norm()?.unwrap_or(f64::NAN));
            }
        }
    }
    let local_state_elems = engine
        .optimizer()
        .state_tensors(&engine.optimizer_params())?
        .iter()
        .filter(|(k, _)| k.ends_with(".exp_avg") || k.ends_with(".exp_avg_sq"))
        .map(|(_, t)| t.elem_count())
        .sum();
    let full_state = engine
        .optimizer_state()?
        .into_iter()
        .map(|(k, t)| Ok((k, t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(Outcome {
        masters: masters(&store),
        norms,
        local_state_elems,
        full_state,
    })
}

/// ZeRO-1 against DDP on 2 and 3 ranks, both layouts: the same parameters, bit for bit (each
/// element gets the same update from the same summed gradient; the flat layout's global norm,
/// summed from the ranks' parts, differs from DDP's in the last f64 bits only, too little to
/// change the f32 update here); each rank holds its share of
/// the optimizer state (whole parameters: as even as whole parameters allow; flat: exactly its range of
/// `ceil(N / W)` elements, parameters split across ranks); the gathered state a checkpoint
/// saves is DDP's full state.
#[test]
fn zero1_matches_ddp_and_divides_the_optimizer_state() -> Result<()> {
    for world in [2, 3] {
        let run = Run {
            world,
            global: 24,
            steps: 12,
            accumulation: 2,
            max_grad_norm: Some(0.5),
            uneven: None,
        };
        let go = move |zero1: Option<Zero1Layout>| -> Result<Vec<Outcome>> {
            run_ranks(world, move |r, c| {
                train_full(run, r, Some((c, zero1)), &Device::Cpu)
            })
            .into_iter()
            .collect()
        };
        let ddp = go(None)?;
        let full: usize = ddp[0].local_state_elems;
        let params: usize = ddp[0].masters.iter().map(|m| m.len()).sum();
        assert_eq!(full, 2 * params, "AdamW keeps exp_avg and exp_avg_sq");
        for layout in [Zero1Layout::Parameters, Zero1Layout::Flat] {
            let zero = go(Some(layout))?;
            for r in 0..world {
                let what = format!("{layout:?}, rank {r} of {world}");
                assert_eq!(zero[r].masters, ddp[r].masters, "{what}: ZeRO-1 != DDP");
                // flat: the ranks' f64 sums of squares are added in another order
                for (a, b) in zero[r].norms.iter().zip(&ddp[r].norms) {
                    assert!((a - b).abs() <= 1e-12 * b, "{what}: norm {a} vs {b}");
                }
                assert_eq!(
                    zero[r].full_state, ddp[r].full_state,
                    "{what}: gathered state differs"
                );
                let share = zero[r].local_state_elems as f64 / full as f64;
                eprintln!("{what}: holds {:.1}% of the optimizer state", 100.0 * share);
                // whole parameters cannot split l2.weight (68% of the elements) for balance
                if layout == Zero1Layout::Flat {
                    let range = params.div_ceil(world);
                    let mine = range.min(params.saturating_sub(r * range));
                    assert_eq!(zero[r].local_state_elems, 2 * mine, "{what}");
                }
            }
            let held: usize = zero.iter().map(|o| o.local_state_elems).sum();
            assert_eq!(held, full, "{layout:?}: every element's state once");
        }
    }
    Ok(())
}

fn check_equivalence(run: Run) -> Result<()> {
    let (single, single_norms) = train(
        Run {
            world: 1,
            accumulation: 1,
            uneven: None,
            ..run
        },
        0,
        None,
        &Device::Cpu,
    )?;
    let out = run_ranks(run.world, move |rank, c| {
        train(run, rank, Some(c), &Device::Cpu)
    });
    let out: Vec<(Vec<Vec<f32>>, Vec<f64>)> = out.into_iter().collect::<Result<_>>()?;
    for (rank, (p, norms)) in out.iter().enumerate() {
        // the replicas are bitwise identical
        assert_eq!(p, &out[0].0, "rank {rank} differs from rank 0");
        assert_eq!(norms.len(), run.steps as usize);
        for (a, b) in norms.iter().zip(&single_norms) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs(),
                "global norm {a} vs single-rank {b}"
            );
        }
        let rel = max_rel(p, &single);
        eprintln!("rank {rank}: max rel error {rel:e} against 1 rank with the full batch");
        assert!(
            rel <= 1e-5,
            "rank {rank}: max rel error {rel:e} against 1 rank with the full batch"
        );
    }
    // and the parameters moved
    let (init, _) = train(
        Run {
            steps: 0,
            world: 1,
            accumulation: 1,
            uneven: None,
            ..run
        },
        0,
        None,
        &Device::Cpu,
    )?;
    assert!(max_rel(&single, &init) > 1e-3);
    Ok(())
}

#[test]
fn two_ranks_with_half_batches_match_one_rank_with_the_full_batch() -> Result<()> {
    check_equivalence(Run {
        world: 2,
        global: 16,
        steps: 20,
        accumulation: 1,
        max_grad_norm: None,
        uneven: None,
    })
}

#[test]
fn accumulation_uneven_shards_and_global_clipping_match_one_rank() -> Result<()> {
    // 2 micro-batches per rank, 11 + 5 samples per rank, a clip that binds: the weighted
    // all-reduce gives the full-batch gradient and the global norm
    check_equivalence(Run {
        world: 2,
        global: 16,
        steps: 20,
        accumulation: 2,
        max_grad_norm: Some(0.05),
        uneven: Some(11),
    })
}

/// Per step: (skipped, parameters unchanged, loss scale after, applied steps after).
type SkipLog = Vec<(bool, bool, f32, u64)>;

/// 4 steps with a dynamic scaler; at step 2 rank 1's batch holds an inf.
fn skip_run(rank: usize, c: Box<dyn Collective>, dev: &Device) -> Result<(SkipLog, Vec<Vec<f32>>)> {
    let store = ParamStore::new(Precision::Fp32, dev.clone(), 7);
    let model = Mlp::new(&store, 8)?;
    let mut cfg = EngineConfig::adamw(1e-2);
    cfg.scaler = Some(ScalerConfig {
        init_scale: 1024.0,
        ..ScalerConfig::default()
    });
    let mut engine = Engine::new(store.clone(), cfg)?.with_collective(c, DdpConfig::default())?;
    let mut log = Vec::new();
    for step in 0..4u64 {
        let (mut x, y) = global_batch(8, step);
        if step == 2 && rank == 1 {
            // overflow on rank 1 only
            let mut v = x.flatten_all()?.to_vec1::<f32>()?;
            v[3] = f32::INFINITY;
            x = Tensor::from_vec(v, (8, IN), &Device::Cpu)?;
        }
        let (x, y) = (x.to_device(dev)?, y.to_device(dev)?);
        let before = masters(&store);
        let r = engine.step_weighted(8.0, |_| loss::cross_entropy(&model.forward(&x)?, &y))?;
        let unchanged = masters(&store) == before;
        log.push((
            r.skipped()?,
            unchanged,
            engine.loss_scale()?,
            engine.optimizer_steps()?,
        ));
    }
    Ok((log, masters(&store)))
}

fn check_skip_log(rank: usize, log: &SkipLog) {
    for (step, &(skipped, unchanged, scale, applied)) in log.iter().enumerate() {
        assert_eq!(skipped, step == 2, "rank {rank} step {step}");
        assert_eq!(unchanged, step == 2, "rank {rank} step {step}");
        let want_scale = if step >= 2 { 512.0 } else { 1024.0 };
        assert_eq!(scale, want_scale, "rank {rank} step {step}");
        assert_eq!(applied, [1, 2, 2, 3][step], "rank {rank} step {step}");
    }
}

#[test]
fn an_inf_on_rank_one_makes_every_rank_skip() -> Result<()> {
    let out = run_ranks(2, |rank, c| skip_run(rank, c, &Device::Cpu));
    let out: Vec<_> = out.into_iter().collect::<Result<Vec<_>>>()?;
    for (rank, (log, p)) in out.iter().enumerate() {
        assert_eq!(p, &out[0].1, "rank {rank}'s parameters differ");
        check_skip_log(rank, log);
    }
    Ok(())
}

#[test]
fn world_size_one_is_bitwise_the_engine_without_a_collective() -> Result<()> {
    let run = |coll: Option<Box<dyn Collective>>| -> Result<Vec<Vec<f32>>> {
        let store = ParamStore::new(Precision::Bf16Mixed, Device::Cpu, 11);
        let model = Mlp::new(&store, 16)?;
        let mut cfg = EngineConfig::adamw(1e-2);
        cfg.accumulation_steps = 2;
        cfg.max_grad_norm = Some(0.5);
        let mut e = Engine::new(store.clone(), cfg)?;
        if let Some(c) = coll {
            e = e.with_collective(c, DdpConfig::default())?;
            assert_eq!(e.collective().map(|c| c.world_size()), Some(1));
        }
        for step in 0..6 {
            let (x, y) = global_batch(5 + step as usize, step);
            e.step_weighted(1.0 + step as f64, |_| {
                loss::cross_entropy(&model.forward(&x)?, &y)
            })?;
        }
        Ok(masters(&store))
    };
    let plain = run(None)?;
    let solo = run(Some(Box::new(LocalCollective::group(1)?.pop().unwrap())))?;
    let solo2 = run(Some(Box::new(wick::dist::Solo)))?;
    assert_eq!(plain, solo);
    assert_eq!(plain, solo2);
    Ok(())
}

#[test]
fn different_models_on_two_ranks_are_refused_on_both() {
    let out = run_ranks(2, |rank, c| {
        let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
        let _m = Mlp::new(&store, if rank == 0 { 8 } else { 9 })?;
        Engine::new(store, EngineConfig::adamw(1e-3))?.with_collective(c, DdpConfig::default())?;
        Ok(())
    });
    for o in out {
        let e = format!("{:#}", o.unwrap_err());
        assert!(e.contains("parameter layout differs across ranks"), "{e}");
    }
}

#[test]
#[cfg(feature = "cli")] // the wick binary
fn wick_launch_stops_the_job_when_a_rank_fails() {
    let exe = env!("CARGO_BIN_EXE_wick");
    let t = std::time::Instant::now();
    let out = std::process::Command::new(exe)
        .args(["launch", "--nproc-per-node", "3", "--master-port", "29622", "--", "sh", "-c"])
        .arg("echo \"hello from $RANK of $WORLD_SIZE\"; if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 600")
        .output()
        .expect("run wick launch");
    // the survivors would sleep 600 s: far under that means the launcher stopped them (a wide
    // margin, so that a loaded machine cannot fail the test)
    assert!(t.elapsed().as_secs() < 300, "launch took {:?}", t.elapsed());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(3),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    assert!(stdout.contains("[rank 1] hello from 1 of 3"), "{stdout}");
    assert!(
        stderr.contains("rank 1 (local rank 1, pid") && stderr.contains("exited with status 3"),
        "{stderr}"
    );

    let ok = std::process::Command::new(exe)
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            "sh",
            "-c",
            "test \"$LOCAL_RANK\" -lt 2",
        ])
        .output()
        .expect("run wick launch");
    assert_eq!(ok.status.code(), Some(0));
    let bad = std::process::Command::new(exe)
        .args(["launch", "--nproc-per-node", "2"])
        .output()
        .expect("run wick launch");
    assert_ne!(bad.status.code(), Some(0));
}

#[test]
fn dtype_of_reduced_gradients_is_f32_in_mixed_precision() -> Result<()> {
    // bf16 working copies: the raw gradients are bf16, the all-reduced buffers f32; both
    // replicas stay identical
    let out = run_ranks(2, |rank, c| {
        let store = ParamStore::new(Precision::Bf16Mixed, Device::Cpu, 3);
        let model = Mlp::new(&store, 16)?;
        let mut e = Engine::new(store.clone(), EngineConfig::adamw(1e-2))?
            .with_collective(c, DdpConfig::default())?;
        for step in 0..5u64 {
            let (x, y) = global_batch(8, step);
            let (xb, yb) = (x.narrow(0, rank * 4, 4)?, y.narrow(0, rank * 4, 4)?);
            let r = e.step_weighted(4.0, |_| loss::cross_entropy(&model.forward(&xb)?, &yb))?;
            assert!(!r.skipped()?);
        }
        let w = store.get("l1.weight").unwrap();
        assert_eq!(w.working.as_ref().unwrap().dtype(), DType::BF16);
        Ok(masters(&store))
    });
    let out: Vec<_> = out.into_iter().collect::<Result<Vec<_>>>()?;
    assert_eq!(out[0], out[1]);
    Ok(())
}

/// The same checks over NCCL on 2 GPUs (feature `nccl`, a machine with >= 2 GPUs, e.g.
/// nvidia-h200-x2): the parent test starts 2 ranks of this test binary with `wick launch`,
/// filtered to `nccl_2gpu::rank_body`; without 2 GPUs it says so and passes.
#[cfg(all(feature = "nccl", feature = "cli"))]
mod nccl_2gpu {
    use super::*;
    use candle_core::cuda::cudarc::driver::CudaContext;

    #[test]
    fn two_gpus_over_nccl() {
        if std::env::var_os("RANK").is_some() {
            return; // inside a rank: rank_body does the work
        }
        let gpus = CudaContext::device_count().unwrap_or(0);
        if gpus < 2 {
            eprintln!("skipped: {gpus} GPU(s), 2 needed");
            return;
        }
        let exe = std::env::current_exe().expect("test binary path");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or(29631);
        // WICK_BIN: the wick binary when the test binary runs on another machine than it was
        // built on (the build path baked in by cargo does not exist there)
        let wick = std::env::var("WICK_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_wick").into());
        let status = std::process::Command::new(wick)
            .args([
                "launch",
                "--nproc-per-node",
                "2",
                "--master-port",
                &port.to_string(),
                "--",
            ])
            .arg(exe)
            .args([
                "--exact",
                "nccl_2gpu::rank_body",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("NCCL_NVLS_ENABLE", "0")
            .status()
            .expect("run wick launch");
        assert!(status.success(), "a rank failed: {status}");
    }

    #[test]
    fn rank_body() -> Result<()> {
        let Some(env) = wick::dist::DistEnv::from_env()? else {
            return Ok(()); // not under wick launch
        };
        let dev = Device::new_cuda(env.local_rank)?;
        let rank = env.rank;
        // 1) 2 ranks with half batches = 1 GPU with the full batch (computed here too)
        let run = Run {
            world: 2,
            global: 16,
            steps: 20,
            accumulation: 1,
            max_grad_norm: None,
            uneven: None,
        };
        let single = train(Run { world: 1, ..run }, 0, None, &dev)?.0;
        let (p, _) = train(run, rank, Some(wick::dist::init(&dev)?), &dev)?;
        let rel = max_rel(&p, &single);
        eprintln!("rank {rank}: max rel error {rel:e} (NCCL, 20 steps) against 1 GPU");
        assert!(rel <= 1e-5, "rank {rank}: max rel error {rel:e}");
        // 2) ZeRO-1 over NCCL: the DDP parameters bit for bit, about half the optimizer state
        let over_nccl = |zero1| train_full(run, rank, Some((wick::dist::init(&dev)?, zero1)), &dev);
        let ddp = over_nccl(None)?;
        let zero = over_nccl(Some(Zero1Layout::Parameters))?;
        let flat = over_nccl(Some(Zero1Layout::Flat))?;
        let rel = max_rel(&flat.masters, &ddp.masters);
        eprintln!("rank {rank}: flat ZeRO-1 against DDP after 20 steps: max rel error {rel:e}");
        assert!(
            rel <= 1e-5,
            "rank {rank}: flat ZeRO-1 differs from DDP: {rel:e}"
        );
        assert!(
            flat.full_state.len() == ddp.full_state.len(),
            "rank {rank}: flat ZeRO-1's gathered state has other tensors"
        );
        assert!(
            zero.masters == ddp.masters,
            "rank {rank}: ZeRO-1 differs from DDP"
        );
        assert!(
            zero.full_state == ddp.full_state,
            "rank {rank}: gathered state differs"
        );
        eprintln!(
            "rank {rank}: ZeRO-1 == DDP after 20 steps; this rank holds {} of {} moment elements",
            zero.local_state_elems, ddp.local_state_elems
        );
        // 3) an inf on rank 1 only: both ranks skip step 2, same scale, same parameters
        let (log, _) = skip_run(rank, wick::dist::init(&dev)?, &dev)?;
        check_skip_log(rank, &log);
        eprintln!("rank {rank}: skip agreement ok");
        // 4) buckets all-reduced during the backward on the communication stream == after it
        for precision in [Precision::Fp32, Precision::Bf16Mixed] {
            let go = |overlap: bool| {
                let ddp = DdpConfig {
                    overlap,
                    ..DdpConfig::default()
                };
                train_overlap(rank, wick::dist::init(&dev)?, ddp, precision, 2, &dev)
            };
            let (after, during) = (go(false)?, go(true)?);
            assert!(
                during.0 == after.0,
                "rank {rank}, {precision:?}: overlap differs"
            );
            eprintln!(
                "rank {rank}, {precision:?}: overlapped == after the backward; started {:?}",
                during.2.last()
            );
        }
        Ok(())
    }

    /// One GPU: a communicator of one rank runs every collective on its own stream, ordered
    /// with candle's by events: results equal the inputs (a sum over one rank), in f32 and
    /// bf16, blocking and started ([`Collective::all_reduce_sum_start`]), reduce-scatter,
    /// all-gather and barrier.
    #[test]
    fn one_gpu_communicator_on_its_own_stream() -> Result<()> {
        if std::env::var_os("RANK").is_some() || CudaContext::device_count().unwrap_or(0) < 1 {
            eprintln!("skipped: no GPU, or inside a rank");
            return Ok(());
        }
        let dev = wick::cuda::new_device(0)?;
        let id = wick::dist::nccl::unique_id()?;
        let c = wick::dist::nccl::NcclCollective::from_id(&dev, 0, 1, &id, &Default::default())?;
        let n = 1 << 22;
        let x = Tensor::arange(0f32, n as f32, &dev)?;
        let y = ((x.sqr()? * 0.5)? - 3.0)?; // queued on candle's stream just before
        let started = c.all_reduce_sum_start(&y)?;
        let want: Vec<f32> = y.to_vec1()?;
        let got = (started.wait()? + 1.0)?.to_vec1::<f32>()?;
        assert!(got.iter().zip(&want).all(|(a, b)| *a == b + 1.0));
        assert_eq!(c.all_reduce_sum(&y)?.to_vec1::<f32>()?, want);
        let b = y.to_dtype(DType::BF16)?;
        let rb = c.all_reduce_sum(&b)?;
        assert_eq!(rb.dtype(), DType::BF16);
        assert_eq!(
            rb.to_dtype(DType::F32)?.to_vec1::<f32>()?,
            b.to_dtype(DType::F32)?.to_vec1::<f32>()?
        );
        assert_eq!(c.reduce_scatter_sum(&y)?.to_vec1::<f32>()?, want);
        assert_eq!(c.all_gather(&y)?.to_vec1::<f32>()?, want);
        c.barrier()?;
        c.shutdown()
    }
}

/// A ZeRO-1 checkpoint holds the full optimizer state, whatever the layout: 2 ranks train 6
/// steps and save at the same step (rank 0 writes, once), then one rank (world size 1) resumes
/// from it, trains 4 more steps on the full batch, and ends where one rank that trained all 10
/// steps on the full batch ends (within 1e-5: only the summation order differs); 3 ranks of
/// flat ZeRO-1 (other ranges, parameters split elsewhere) resume from it and end there too.
#[test]
fn zero1_checkpoint_resumes_on_other_world_sizes() -> Result<()> {
    for layout in [Zero1Layout::Parameters, Zero1Layout::Flat] {
        zero1_checkpoint_resumes(layout)?;
    }
    Ok(())
}

fn zero1_checkpoint_resumes(layout: Zero1Layout) -> Result<()> {
    use wick::checkpoint::Checkpointer;
    let dir =
        std::env::temp_dir().join(format!("wick-zero1-ckpt-{layout:?}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = DdpConfig {
        zero1: true,
        zero1_layout: layout,
        ..DdpConfig::default()
    };
    let step_on =
        |e: &mut Engine, m: &Mlp, step: u64, rows_of: Option<(usize, usize)>| -> Result<()> {
            let (x, y) = global_batch(24, step);
            let (x, y) = match rows_of {
                Some((rank, world)) => {
                    let n = 24 / world;
                    (x.narrow(0, rank * n, n)?, y.narrow(0, rank * n, n)?)
                }
                None => (x, y),
            };
            let n = x.dim(0)? as f64;
            e.step_weighted(n, |_| loss::cross_entropy(&m.forward(&x)?, &y))?;
            Ok(())
        };
    let (d2, c2) = (dir.clone(), cfg.clone());
    let saved = run_ranks(2, move |rank, c| {
        let store = ParamStore::new(Precision::Fp32, Device::Cpu, 7);
        let m = Mlp::new(&store, 24)?;
        let mut e = Engine::new(store.clone(), EngineConfig::adamw(3e-3))?
            .with_collective(c, c2.clone())?;
        for step in 0..6 {
            step_on(&mut e, &m, step, Some((rank, 2)))?;
        }
        let path = Checkpointer::new(&d2, 0).save(&e, serde_json::json!({}))?;
        Ok((path, e.optimizer_state()?.len()))
    });
    let saved: Vec<_> = saved.into_iter().collect::<Result<_>>()?;
    assert_eq!(
        saved[0].0, saved[1].0,
        "both ranks name the same checkpoint"
    );
    let dirs = std::fs::read_dir(&dir)?.filter_map(|e| e.ok()).count();
    assert_eq!(dirs, 1, "rank 0 wrote one checkpoint, rank 1 nothing");

    // two single-rank runs from the checkpoint: resumed twice, they agree; and the resumed
    // optimizer holds every parameter's state
    let resume = || -> Result<(Vec<Vec<f32>>, usize)> {
        let store = ParamStore::new(Precision::Fp32, Device::Cpu, 1);
        let m = Mlp::new(&store, 24)?;
        let mut e = Engine::new(store.clone(), EngineConfig::adamw(3e-3))?;
        let got = Checkpointer::new(&dir, 0).resume(&mut e)?;
        assert!(got.is_some(), "a checkpoint to resume from");
        let n_state = e.optimizer_state()?.len();
        for step in 6..10 {
            step_on(&mut e, &m, step, None)?;
        }
        Ok((masters(&store), n_state))
    };
    let (a, n_state) = resume()?;
    let (b, _) = resume()?;
    assert_eq!(a, b);
    // and it matches one rank that trained all 10 steps on the full batch
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 7);
    let m = Mlp::new(&store, 24)?;
    let mut e = Engine::new(store.clone(), EngineConfig::adamw(3e-3))?;
    for step in 0..10 {
        step_on(&mut e, &m, step, None)?;
    }
    let single = masters(&store);
    let rel = max_rel(&a, &single);
    eprintln!(
        "{layout:?} ZeRO-1 x2 for 6 steps, resumed on 1 rank for 4: max rel error {rel:e} \
         against 1 rank"
    );
    assert!(rel <= 1e-5, "max rel error {rel:e}");
    assert_eq!(
        n_state, saved[0].1,
        "the resumed state is the full gathered state"
    );
    assert_eq!(
        n_state,
        6 * 3,
        "exp_avg, exp_avg_sq and step for each of the 6 parameters"
    );
    if layout == Zero1Layout::Flat {
        let d3 = dir.clone();
        let out = run_ranks(3, move |rank, c| {
            let store = ParamStore::new(Precision::Fp32, Device::Cpu, 1);
            let m = Mlp::new(&store, 24)?;
            let mut e = Engine::new(store.clone(), EngineConfig::adamw(3e-3))?
                .with_collective(c, cfg.clone())?;
            assert!(Checkpointer::new(&d3, 0).resume(&mut e)?.is_some());
            for step in 6..10 {
                step_on(&mut e, &m, step, Some((rank, 3)))?;
            }
            Ok(masters(&store))
        });
        for (rank, m) in out.into_iter().enumerate() {
            let rel = max_rel(&m?, &single);
            eprintln!("flat ZeRO-1 resumed on rank {rank} of 3: max rel error {rel:e}");
            assert!(rel <= 1e-5, "rank {rank} of 3: max rel error {rel:e}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Data-parallel checkpoints with a loader: 2 ranks (DDP, each with its DistributedSampler
/// shard of an MNIST-like tensor dataset) train 3 batches and save with `save_with_loader`
/// (rank 0 writes once, both ranks wait for it); two fresh ranks resume with
/// `resume_with_loader`, each at its own rank's position, and their next 3 steps give the
/// same parameters as the uninterrupted run's steps 4-6. ZeRO-1 with stochastic rounding is
/// refused.
#[test]
fn data_parallel_checkpoint_with_loader_resumes_on_every_rank() -> Result<()> {
    use wick::checkpoint::Checkpointer;
    use wick::data::{DataLoader, LoaderConfig, TensorDataset};
    let dir = std::env::temp_dir().join(format!("wick-ddp-loader-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dataset = || -> Result<TensorDataset> {
        let (x, y) = global_batch(128, 0); // 64 samples per rank: 8 batches of 8
        TensorDataset::new(vec![x, y])
    };
    // phase: 0 = uninterrupted 6 steps, 1 = 3 steps then save, 2 = resume then 3 steps
    let run = |phase: u8, dir: std::path::PathBuf| {
        run_ranks(2, move |rank, c| -> Result<Vec<Vec<f32>>> {
            let store = ParamStore::new(Precision::Fp32, Device::Cpu, 7);
            let m = Mlp::new(&store, 24)?;
            let mut e = Engine::new(store.clone(), EngineConfig::adamw(3e-3))?
                .with_collective(c, DdpConfig::default())?;
            let cfg = LoaderConfig::new(8)
                .with_shuffle(3)
                .with_distributed(DistributedSampler::new(rank, 2)?);
            let mut loader = DataLoader::new(dataset()?, cfg)?;
            let ck = Checkpointer::new(&dir, 0);
            if phase == 2 {
                let got = ck.resume_with_loader(&mut e, &mut loader)?;
                assert!(got.is_some(), "rank {rank}: nothing to resume");
                assert_eq!(loader.state().rank, rank);
            }
            let steps = if phase == 0 { 6 } else { 3 };
            for _ in 0..steps {
                let b = loader.next_batch()?.expect("a batch");
                let (x, y) = b.pair()?;
                e.step_weighted(b.len() as f64, |_| loss::cross_entropy(&m.forward(&x)?, &y))?;
            }
            if phase == 1 {
                let p = ck.save_with_loader(&e, &loader.state(), serde_json::json!({}))?;
                assert!(
                    p.exists(),
                    "rank {rank}: {} exists once save returns",
                    p.display()
                );
            }
            Ok(masters(&store))
        })
        .into_iter()
        .collect::<Result<Vec<_>>>()
    };
    let straight = run(0, dir.clone())?;
    run(1, dir.clone())?;
    assert_eq!(
        std::fs::read_dir(&dir)?.count(),
        1,
        "one checkpoint, written by rank 0"
    );
    let resumed = run(2, dir.clone())?;
    assert_eq!(
        resumed, straight,
        "resumed ranks end where the uninterrupted run ends"
    );
    let _ = std::fs::remove_dir_all(&dir);

    // ZeRO-1 with stochastic rounding would desynchronise the working copies: refused
    let refused = run_ranks(2, |_, c| -> Result<()> {
        let store = ParamStore::new(Precision::Bf16Mixed, Device::Cpu, 7);
        let _m = Mlp::new(&store, 8)?;
        let mut cfg = EngineConfig::adamw(1e-3);
        cfg.stochastic_rounding = true;
        let zero = DdpConfig {
            zero1: true,
            ..DdpConfig::default()
        };
        match Engine::new(store, cfg)?.with_collective(c, zero) {
            Ok(_) => anyhow::bail!("ZeRO-1 with stochastic rounding was accepted"),
            Err(e) => {
                assert!(e.to_string().contains("stochastic rounding"), "{e}");
                Ok(())
            }
        }
    });
    refused.into_iter().collect::<Result<Vec<_>>>()?;
    Ok(())
}

/// Ranks that see different newest checkpoints (rank 0 one at step 2, rank 1 none: e.g.
/// node-local disks) all get an error from `resume`, instead of one rank loading while the
/// other starts fresh and the two waiting on each other's collectives.
#[test]
fn ranks_that_see_different_checkpoints_all_refuse_to_resume() -> Result<()> {
    use wick::checkpoint::Checkpointer;
    let base = std::env::temp_dir().join(format!("wick-split-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    {
        let store = ParamStore::new(Precision::Fp32, Device::Cpu, 7);
        let m = Mlp::new(&store, 8)?;
        let mut e = Engine::new(store, EngineConfig::adamw(1e-3))?;
        let (x, y) = global_batch(8, 0);
        for _ in 0..2 {
            e.step(|_| loss::cross_entropy(&m.forward(&x)?, &y))?;
        }
        Checkpointer::new(base.join("rank0"), 0).save(&e, serde_json::json!({}))?;
    }
    let b2 = base.clone();
    let out = run_ranks(2, move |rank, c| -> Result<String> {
        let store = ParamStore::new(Precision::Fp32, Device::Cpu, 7);
        let _m = Mlp::new(&store, 8)?;
        let mut e = Engine::new(store, EngineConfig::adamw(1e-3))?
            .with_collective(c, DdpConfig::default())?;
        let ck = Checkpointer::new(b2.join(format!("rank{rank}")), 0);
        match ck.resume(&mut e) {
            Ok(_) => anyhow::bail!("rank {rank} resumed"),
            Err(err) => Ok(format!("{err:#}")),
        }
    });
    for (rank, r) in out.into_iter().enumerate() {
        let msg = r?;
        assert!(
            msg.contains("different newest checkpoints")
                && msg.contains("none")
                && msg.contains("step 2"),
            "rank {rank}: {msg}"
        );
    }
    let _ = std::fs::remove_dir_all(&base);
    Ok(())
}

/// One rank of the overlap runs: the MLP (wick's linear layers, whose gradients reach the
/// engine through the sink while the backward runs) behind a per-class gain applied with
/// candle's own `broadcast_mul` (its gradient is known only at the end of the backward).
/// Returns the masters, the boundary norms and `Engine::buckets_started_in_backward` after
/// each boundary.
#[allow(clippy::type_complexity)]
fn train_overlap(
    rank: usize,
    coll: Box<dyn Collective>,
    ddp: DdpConfig,
    precision: Precision,
    accumulation: usize,
    dev: &Device,
) -> Result<(Vec<Vec<f32>>, Vec<f64>, Vec<Option<(usize, usize)>>)> {
    let store = ParamStore::new(precision, dev.clone(), 7);
    // registered first: the last bucket (buckets run in reverse registration order)
    let gain = store.get_or_init(
        "gain",
        OUT,
        candle_nn::Init::Const(1.0),
        wick::params::Role::Fp32,
    )?;
    let model = Mlp::new(&store, 24)?;
    let mut cfg = EngineConfig::adamw(3e-3);
    cfg.accumulation_steps = accumulation;
    cfg.max_grad_norm = Some(1.0);
    let small = DdpConfig {
        buckets: BucketConfig {
            bucket_cap_mb: 0.002,
            first_bucket_cap_mb: Some(0.0005),
        },
        ..ddp
    };
    let mut engine = Engine::new(store.clone(), cfg)?.with_collective(coll, small)?;
    let (mut norms, mut started) = (Vec::new(), Vec::new());
    for step in 0..6 {
        let (x, y) = global_batch(16, step);
        let order: Vec<usize> = (0..16).collect();
        let mine = DistributedSampler::new(rank, 2)?.shard(&order);
        for part in mine.chunks(mine.len().div_ceil(accumulation)) {
            let (xb, yb) = rows(&x, &y, part)?;
            let (xb, yb) = (xb.to_device(dev)?, yb.to_device(dev)?);
            let r = engine.step_weighted(part.len() as f64, |_| {
                let logits = model
                    .forward(&xb)?
                    .to_dtype(DType::F32)?
                    .broadcast_mul(&gain)?;
                loss::cross_entropy(&logits, &yb)
            })?;
            if r.boundary {
                norms.push(r.grad_norm()?.unwrap_or(f64::NAN));
                started.push(engine.buckets_started_in_backward());
            }
        }
    }
    Ok((masters(&store), norms, started))
}

/// Buckets started during the backward give the same replicas, bit for bit, as buckets reduced
/// after it, in fp32 and bf16-mixed, with one micro-batch per step and with accumulation; from
/// the second boundary on, every bucket before the one that holds the candle-differentiated
/// gain starts during the backward.
#[test]
fn buckets_started_during_the_backward_match_the_reduction_after_it_bit_for_bit() -> Result<()> {
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        for accumulation in [1, 2] {
            let go = move |overlap: bool| -> Result<Vec<_>> {
                run_ranks(2, move |r, c| {
                    let ddp = DdpConfig {
                        overlap,
                        ..DdpConfig::default()
                    };
                    train_overlap(r, c, ddp, precision, accumulation, &Device::Cpu)
                })
                .into_iter()
                .collect()
            };
            let (after, during) = (go(false)?, go(true)?);
            let what = format!("{precision:?}, accumulation {accumulation}");
            for r in 0..2 {
                assert_eq!(during[r].0, after[r].0, "{what}: rank {r}'s masters differ");
                assert_eq!(during[r].1, after[r].1, "{what}: rank {r}'s norms differ");
                assert!(
                    after[r].2.iter().all(Option::is_none),
                    "{what}: overlap off"
                );
                let started = &during[r].2;
                assert_eq!(started.len(), 6);
                let (first, total) = started[0].expect("a boundary backward with overlap");
                assert_eq!(first, 0, "{what}: the first boundary only learns");
                assert!(total >= 3, "{what}: {total} buckets");
                for s in &started[1..] {
                    // every bucket but the gain's (the last) starts during the backward
                    assert_eq!(*s, Some((total - 1, total)), "{what}");
                }
            }
            assert_eq!(during[0].0, during[1].0, "{what}: the replicas differ");
        }
    }
    Ok(())
}

/// bf16 reduction: the replicas agree with each other; the first step's global norm (same
/// parameters on both runs) is within bf16's rounding of the f32 reduction's (each rank's
/// contribution and the sum rounded to 8 significant bits: at most about 2^-8 relative); after
/// six AdamW steps the parameters are within 3% of each tensor's scale of the f32 run's (AdamW
/// turns a near-zero gradient element's rounding into a whole `lr` step: 6 x 3e-3 against
/// weights of scale ~0.5).
#[test]
fn bf16_reduction_agrees_across_ranks_and_with_f32() -> Result<()> {
    let go = move |dtype: DType| -> Result<Vec<_>> {
        run_ranks(2, move |r, c| {
            let ddp = DdpConfig {
                reduce_dtype: dtype,
                ..DdpConfig::default()
            };
            train_overlap(r, c, ddp, Precision::Fp32, 2, &Device::Cpu)
        })
        .into_iter()
        .collect()
    };
    let (f32s, bf16s) = (go(DType::F32)?, go(DType::BF16)?);
    assert_eq!(bf16s[0].0, bf16s[1].0, "the replicas differ");
    let rel = max_rel(&bf16s[0].0, &f32s[0].0);
    eprintln!("bf16 reduction: max rel error {rel:e} against f32 after 6 steps");
    assert!(rel > 0.0, "bf16 rounding should show");
    assert!(rel < 3e-2, "max rel error {rel:e}");
    let (a, b) = (bf16s[0].1[0], f32s[0].1[0]);
    eprintln!("first global norm: bf16 {a}, f32 {b}");
    assert!(
        a != b && (a - b).abs() <= b.abs() / 256.0,
        "norm {a} vs {b}"
    );
    let bad = DdpConfig {
        reduce_dtype: DType::F16,
        ..DdpConfig::default()
    };
    let e = run_ranks(1, move |_, c| {
        let s = ParamStore::new(Precision::Fp32, Device::Cpu, 1);
        Mlp::new(&s, 4)?;
        Engine::new(s, EngineConfig::adamw(1e-3))?
            .with_collective(c, bad.clone())
            .map(|_| ())
    });
    let e = e.into_iter().next().unwrap().unwrap_err();
    assert!(e.to_string().contains("reduce_dtype"), "{e}");
    Ok(())
}

/// A graph that changes between steps (here l2 applied twice at step 2, on every rank or on
/// rank 0 only): the gradient of l2 grows after its bucket's all-reduce started, so that
/// window's sum is wrong. Every rank still issues the same collectives (no desynchronised
/// group), skips that step (nothing applied) and goes on; the steps after it are applied and
/// the replicas stay equal.
#[test]
fn a_graph_that_changes_between_steps_skips_that_step_on_every_rank() -> Result<()> {
    for only_rank0 in [false, true] {
        let out = run_ranks(2, move |rank, c| {
            let store = ParamStore::new(Precision::Fp32, Device::Cpu, 7);
            let m = Mlp::new(&store, 24)?;
            let small = DdpConfig {
                buckets: BucketConfig {
                    bucket_cap_mb: 0.002,
                    first_bucket_cap_mb: Some(0.0005),
                },
                ..DdpConfig::default()
            };
            let mut e =
                Engine::new(store.clone(), EngineConfig::adamw(3e-3))?.with_collective(c, small)?;
            let mut skipped = Vec::new();
            for step in 0..5u64 {
                let (x, y) = global_batch(8, step);
                let (x, y) = (x.narrow(0, rank * 4, 4)?, y.narrow(0, rank * 4, 4)?);
                let before = masters(&store);
                let twice = step == 2 && (rank == 0 || !only_rank0);
                let r = e.step_weighted(4.0, |_| {
                    let mut h = m.l1.forward(&x)?.tanh()?;
                    for _ in 0..if twice { 2 } else { 1 } {
                        h = m.l2.forward(&h)?.tanh()?;
                    }
                    loss::cross_entropy(&m.l3.forward(&h)?, &y)
                })?;
                if r.skipped()? {
                    assert_eq!(masters(&store), before, "a skipped step changed parameters");
                    skipped.push(step);
                }
            }
            Ok((skipped, masters(&store)))
        });
        let out: Vec<_> = out.into_iter().collect::<Result<_>>()?;
        for (skipped, _) in &out {
            assert_eq!(skipped, &vec![2], "only rank 0: {only_rank0}");
        }
        assert_eq!(
            out[0].1, out[1].1,
            "the replicas differ (only rank 0: {only_rank0})"
        );
    }
    Ok(())
}

/// Flat ZeRO-1 follows the store: on one rank it is plain training; options changed after
/// attaching apply (a learning-rate scale of 0 leaves the parameters where they are); a
/// parameter frozen after attaching changes the ranges, which is a clear error on every rank
/// before anything runs.
#[test]
fn flat_zero1_follows_options_and_refuses_a_changed_layout() -> Result<()> {
    let flat = DdpConfig {
        zero1: true,
        zero1_layout: Zero1Layout::Flat,
        ..DdpConfig::default()
    };
    let one_step = |e: &mut Engine, m: &Mlp, rank: usize| -> Result<()> {
        let (x, y) = global_batch(8, 0);
        let (x, y) = (x.narrow(0, rank * 4, 4)?, y.narrow(0, rank * 4, 4)?);
        e.step_weighted(4.0, |_| loss::cross_entropy(&m.forward(&x)?, &y))?;
        Ok(())
    };
    let f1 = flat.clone();
    let single = run_ranks(1, move |_, c| {
        let store = ParamStore::new(Precision::Fp32, Device::Cpu, 7);
        let m = Mlp::new(&store, 8)?;
        let mut e = Engine::new(store.clone(), EngineConfig::adamw(3e-3))?
            .with_collective(c, f1.clone())?;
        let before = masters(&store);
        one_step(&mut e, &m, 0)?;
        assert_ne!(masters(&store), before, "one rank of flat ZeRO-1 trains");
        Ok(())
    });
    single.into_iter().collect::<Result<Vec<_>>>()?;
    let out = run_ranks(2, move |rank, c| {
        let store = ParamStore::new(Precision::Fp32, Device::Cpu, 7);
        let m = Mlp::new(&store, 8)?;
        let mut e = Engine::new(store.clone(), EngineConfig::adamw(3e-3))?
            .with_collective(c, flat.clone())?;
        store.set_lr_scale("*", 0.0)?;
        let before = masters(&store);
        one_step(&mut e, &m, rank)?;
        assert_eq!(
            masters(&store),
            before,
            "rank {rank}: lr scale 0 moved parameters"
        );
        store.freeze("l1.*")?;
        let err = one_step(&mut e, &m, rank).unwrap_err();
        assert!(
            format!("{err:#}").contains("changed after Engine::with_collective"),
            "{err:#}"
        );
        Ok(())
    });
    out.into_iter().collect::<Result<Vec<_>>>()?;
    Ok(())
}

/// The same data-parallel logic on the GPU, with 2 ranks as threads on one CUDA device and the
/// in-process collective (what one GPU can check of the NCCL runs): the CUDA bucket packing
/// (the accumulate kernel writing into views of the flat bucket, priors included), the device
/// statistics summed over flat ZeRO-1's ranks and the fused update of segment parameters.
#[cfg(feature = "cuda")]
mod cuda_ranks {
    use super::*;

    fn gpu() -> Option<Device> {
        wick::cuda::new_device(0).ok()
    }

    #[test]
    fn cuda_overlap_matches_the_reduction_after_the_backward() -> Result<()> {
        let Some(_) = gpu() else {
            eprintln!("skipped: no GPU");
            return Ok(());
        };
        for precision in [Precision::Fp32, Precision::Bf16Mixed] {
            let go = move |overlap: bool| -> Result<Vec<_>> {
                run_ranks(2, move |r, c| {
                    let ddp = DdpConfig {
                        overlap,
                        ..DdpConfig::default()
                    };
                    train_overlap(r, c, ddp, precision, 2, &gpu().expect("a GPU"))
                })
                .into_iter()
                .collect()
            };
            let (after, during) = (go(false)?, go(true)?);
            for r in 0..2 {
                assert!(
                    during[r].0 == after[r].0,
                    "{precision:?} rank {r}: overlap differs"
                );
                eprintln!("{precision:?} rank {r}: started {:?}", during[r].2.last());
                let (started, total) = during[r].2.last().copied().flatten().unwrap();
                assert_eq!(started, total - 1, "{precision:?}");
            }
        }
        Ok(())
    }

    #[test]
    fn cuda_flat_zero1_matches_ddp() -> Result<()> {
        let Some(_) = gpu() else {
            eprintln!("skipped: no GPU");
            return Ok(());
        };
        let run = Run {
            world: 2,
            global: 24,
            steps: 8,
            accumulation: 2,
            max_grad_norm: Some(0.5),
            uneven: None,
        };
        let go = move |zero1: Option<Zero1Layout>| -> Result<Vec<Outcome>> {
            run_ranks(2, move |r, c| {
                train_full(run, r, Some((c, zero1)), &gpu().expect("a GPU"))
            })
            .into_iter()
            .collect()
        };
        let (ddp, flat) = (go(None)?, go(Some(Zero1Layout::Flat))?);
        for r in 0..2 {
            let rel = max_rel(&flat[r].masters, &ddp[r].masters);
            eprintln!("rank {r}: flat ZeRO-1 on CUDA against DDP: max rel error {rel:e}");
            assert!(rel <= 1e-6, "rank {r}: {rel:e}");
            assert_eq!(flat[r].full_state.len(), ddp[r].full_state.len());
            assert!(flat[r].local_state_elems * 2 <= ddp[r].local_state_elems + 2);
        }
        Ok(())
    }
}
