//! Checkpoints: bitwise resume, corrupt files, kill -9 during save, pruning, candle-nn
//! compatibility, Ctrl-C. CPU only, real values.

#![cfg(feature = "cli")]

#[path = "../examples/ckpt_crash.rs"]
mod ckpt_crash;

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use wick::checkpoint::{self, Checkpointer};
use wick::engine::OptimizerConfig;
use wick::optim::{LrSchedule, SgdConfig};
use wick::{loss, nn, Engine, EngineConfig, ParamStore, Precision, ScalerConfig};

// ---------------------------------------------------------------------------------------------
// a small MLP and deterministic synthetic data

struct Mlp {
    layers: Vec<nn::Linear>,
}

impl Mlp {
    fn new(store: &ParamStore, dims: &[usize]) -> Result<Self> {
        let layers = dims
            .windows(2)
            .enumerate()
            .map(|(i, w)| nn::Linear::new(store, &format!("l{}", i + 1), w[0], w[1], true))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self { layers })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for (i, l) in self.layers.iter().enumerate() {
            h = l.forward(&h)?;
            if i + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

const DIMS: [usize; 4] = [32, 64, 64, 10];

/// Micro-batch `k`: 16 samples, x ~ N(0, 1), y = argmax of a fixed projection (learnable).
fn batch(k: u64) -> Result<(Tensor, Tensor)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1000 + k);
    let x: Vec<f32> = (0..16 * 32)
        .map(|_| StandardNormal.sample(&mut rng))
        .collect();
    let y: Vec<u32> = x
        .chunks(32)
        .map(|r| {
            (0..10)
                .max_by(|&a, &b| {
                    let s = |c: usize| r[c] + r[c + 10] - r[c + 20];
                    s(a).total_cmp(&s(b))
                })
                .unwrap_or(0) as u32
        })
        .collect();
    Ok((
        Tensor::from_vec(x, (16, 32), &Device::Cpu)?,
        Tensor::from_vec(y, 16, &Device::Cpu)?,
    ))
}

#[derive(Clone, Copy, Debug)]
enum Variant {
    /// fp32, constant lr.
    Fp32,
    /// bf16-mixed, 2 micro-batches per step, clipping, warmup + cosine schedule.
    Bf16AccumClip,
    /// f16-mixed with a dynamic scaler that overflows and grows within the run.
    F16Dynamic,
    /// bf16-mixed SGD with Nesterov momentum and weight decay.
    SgdNesterov,
}

fn config(v: Variant) -> EngineConfig {
    let mut c = EngineConfig::adamw(3e-3);
    match v {
        Variant::Fp32 => {}
        Variant::Bf16AccumClip => {
            c.accumulation_steps = 2;
            c.max_grad_norm = Some(0.5);
            c.schedule = LrSchedule::WarmupCosine {
                lr: 3e-3,
                min_lr: 1e-4,
                warmup: 10,
                total: 100,
            };
        }
        Variant::SgdNesterov => {
            c = EngineConfig::sgd(0.05, 0.9);
            c.optimizer = OptimizerConfig::Sgd(SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                nesterov: true,
                weight_decay: 1e-3,
                ..SgdConfig::default()
            });
        }
        Variant::F16Dynamic => {
            c.scaler = Some(ScalerConfig {
                init_scale: 2f32.powi(30),
                growth_interval: 7,
                ..ScalerConfig::default()
            });
        }
    }
    c
}

fn precision(v: Variant) -> Precision {
    match v {
        Variant::Fp32 => Precision::Fp32,
        Variant::Bf16AccumClip | Variant::SgdNesterov => Precision::Bf16Mixed,
        Variant::F16Dynamic => Precision::F16Mixed,
    }
}

fn make(v: Variant, seed: u64, dims: &[usize]) -> Result<(Mlp, Engine)> {
    let store = ParamStore::new(precision(v), Device::Cpu, seed);
    let model = Mlp::new(&store, dims)?;
    let engine = Engine::new(store, config(v))?;
    Ok((model, engine))
}

/// Optimizer steps `from..to` (each `accumulation_steps` micro-batches); returns the f32 bits
/// of every micro-batch loss and the number of skipped steps.
fn train(model: &Mlp, engine: &mut Engine, from: u64, to: u64) -> Result<(Vec<u32>, usize)> {
    let accum = engine.config().accumulation_steps as u64;
    let (mut losses, mut skipped) = (Vec::new(), 0);
    for step in from..to {
        for m in 0..accum {
            let (x, y) = batch(step * accum + m)?;
            let r = engine.step(|_| loss::cross_entropy(&model.forward(&x)?, &y))?;
            losses.push(r.loss()?.to_bits());
            if r.boundary && r.skipped()? {
                skipped += 1;
            }
        }
    }
    Ok((losses, skipped))
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

/// Everything a load may change, as bits: masters, working copies, optimizer state, counters.
#[derive(Debug, PartialEq)]
struct Snapshot {
    masters: Vec<(String, Vec<u32>)>,
    working: Vec<Option<Vec<u32>>>,
    optimizer: Vec<(String, Vec<u32>)>,
    state: wick::engine::EngineState,
}

fn snapshot(engine: &Engine) -> Result<Snapshot> {
    let params = engine.store().params();
    Ok(Snapshot {
        masters: engine
            .store()
            .masters()
            .iter()
            .map(|(n, t)| Ok((n.clone(), bits(t)?)))
            .collect::<Result<_>>()?,
        working: params
            .iter()
            .map(|p| p.working.as_ref().map(|w| bits(w.as_tensor())).transpose())
            .collect::<Result<_>>()?,
        optimizer: engine
            .optimizer()
            .state_tensors(&params)?
            .iter()
            .map(|(n, t)| Ok((n.clone(), bits(t)?)))
            .collect::<Result<_>>()?,
        state: engine.state()?,
    })
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wick-ckpt-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn dir_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|r| {
            r.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

// ---------------------------------------------------------------------------------------------
// (1) resume is bitwise

fn resume_bitwise(v: Variant) -> Result<()> {
    let dir = tmpdir(&format!("resume-{v:?}"));
    // straight run: 100 optimizer steps
    let (model, mut engine) = make(v, 1, &DIMS)?;
    let (straight, skipped) = train(&model, &mut engine, 0, 100)?;
    let final_straight = snapshot(&engine)?;

    // interrupted run: 50 steps, save
    let (model, mut engine) = make(v, 1, &DIMS)?;
    let (first, skipped_first) = train(&model, &mut engine, 0, 50)?;
    let ckpt = Checkpointer::new(&dir, 2);
    let path = ckpt.save(
        &engine,
        serde_json::json!({ "next_step": 50, "note": "resume test" }),
    )?;
    assert!(path.ends_with("step-000050"), "{}", path.display());
    let at_save = snapshot(&engine)?;
    drop((model, engine));

    // a fresh process would build the model from another seed, then load
    let (model, mut engine) = make(v, 12345, &DIMS)?;
    assert_ne!(
        snapshot(&engine)?.masters,
        at_save.masters,
        "different init"
    );
    let extra = checkpoint::load(
        checkpoint::latest(&dir)?.expect("a checkpoint"),
        &mut engine,
    )?
    .extra;
    assert_eq!(extra["note"], "resume test");
    let next = extra["next_step"].as_u64().expect("next_step");
    assert_eq!(snapshot(&engine)?, at_save, "loaded state == saved state");
    let (second, skipped_second) = train(&model, &mut engine, next, 100)?;

    let resumed: Vec<u32> = first.into_iter().chain(second).collect();
    assert_eq!(resumed.len(), straight.len());
    for (i, (a, b)) in straight.iter().zip(&resumed).enumerate() {
        assert_eq!(
            a,
            b,
            "{v:?}: micro-batch {i}: straight {} vs resumed {}",
            f32::from_bits(*a),
            f32::from_bits(*b)
        );
    }
    assert_eq!(snapshot(&engine)?, final_straight, "{v:?}: final state");
    assert_eq!(skipped, skipped_first + skipped_second);
    let first_loss = f32::from_bits(straight[0]);
    let last_loss = f32::from_bits(*straight.last().unwrap_or(&0));
    println!(
        "{v:?}: {} micro-batch losses bit-identical; loss {first_loss:.4} -> {last_loss:.4}; \
         {skipped} skipped steps ({skipped_second} after the resume); final scale {}",
        straight.len(),
        engine.loss_scale()?
    );
    assert!(last_loss < first_loss, "it trains");
    if let Variant::F16Dynamic = v {
        assert!(
            skipped_first > 0,
            "the f16 run overflows early (scale 2^30)"
        );
        assert!(
            skipped_second > 0,
            "growth every 7 steps makes it overflow after the resume too"
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn resume_is_bitwise_fp32() -> Result<()> {
    resume_bitwise(Variant::Fp32)
}

#[test]
fn resume_is_bitwise_bf16_accumulation_clipping_schedule() -> Result<()> {
    resume_bitwise(Variant::Bf16AccumClip)
}

#[test]
fn resume_is_bitwise_f16_dynamic_scaler() -> Result<()> {
    resume_bitwise(Variant::F16Dynamic)
}

#[test]
fn resume_is_bitwise_sgd_nesterov() -> Result<()> {
    resume_bitwise(Variant::SgdNesterov)
}

// ---------------------------------------------------------------------------------------------
// (2) bad checkpoints are clear errors and change nothing

fn expect_err(path: &Path, engine: &mut Engine, needles: &[&str]) -> Result<String> {
    let before = snapshot(engine)?;
    let err = match checkpoint::load(path, engine) {
        Ok(_) => panic!(
            "loading {} should fail (expected {needles:?})",
            path.display()
        ),
        Err(e) => format!("{e:#}"),
    };
    for n in needles {
        assert!(err.contains(n), "error should mention {n:?}: {err}");
    }
    assert_eq!(
        snapshot(engine)?,
        before,
        "a failed load changed the engine: {err}"
    );
    Ok(err)
}

fn copy_dir(src: &Path, dst: &Path) -> Result<()> {
    std::fs::create_dir_all(dst)?;
    for e in std::fs::read_dir(src)? {
        let e = e?;
        std::fs::copy(e.path(), dst.join(e.file_name()))?;
    }
    Ok(())
}

fn file_hashes(dir: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    let mut v = Vec::new();
    for n in dir_names(dir) {
        v.push((n.clone(), std::fs::read(dir.join(&n))?));
    }
    Ok(v)
}

#[test]
fn corrupt_checkpoints_are_clear_errors_and_leave_the_engine_unchanged() -> Result<()> {
    let dir = tmpdir("corrupt");
    let (model, mut engine) = make(Variant::Bf16AccumClip, 3, &DIMS)?;
    train(&model, &mut engine, 0, 3)?;
    let good = Checkpointer::new(dir.join("good"), 0).save(&engine, serde_json::Value::Null)?;
    let good_files = file_hashes(&good)?;

    // the engine that will be asked to load the bad copies: trained differently
    let (model_b, mut b) = make(Variant::Bf16AccumClip, 4, &DIMS)?;
    train(&model_b, &mut b, 0, 2)?;

    let variant = |name: &str, edit: &dyn Fn(&Path) -> Result<()>| -> Result<PathBuf> {
        let p = dir.join(name).join("step-000003");
        copy_dir(&good, &p)?;
        edit(&p)?;
        Ok(p)
    };
    let mut errors = Vec::new();

    // truncated model.safetensors
    let p = variant("truncated", &|p| {
        let f = p.join("model.safetensors");
        let len = std::fs::metadata(&f)?.len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f)?
            .set_len(len / 2)?;
        Ok(())
    })?;
    errors.push(expect_err(&p, &mut b, &["model.safetensors", "truncated"])?);

    // one tampered byte in the data of model.safetensors
    let p = variant("tampered-model", &|p| {
        let f = p.join("model.safetensors");
        let mut bytes = std::fs::read(&f)?;
        let i = bytes.len() - 100;
        bytes[i] ^= 0x10;
        std::fs::write(&f, bytes)?;
        Ok(())
    })?;
    errors.push(expect_err(
        &p,
        &mut b,
        &["model.safetensors", "checksum mismatch"],
    )?);

    // one tampered byte in optimizer.safetensors
    let p = variant("tampered-optim", &|p| {
        let f = p.join("optimizer.safetensors");
        let mut bytes = std::fs::read(&f)?;
        bytes[20] ^= 0x01;
        std::fs::write(&f, bytes)?;
        Ok(())
    })?;
    errors.push(expect_err(
        &p,
        &mut b,
        &["optimizer.safetensors", "checksum mismatch"],
    )?);

    // garbage whose recorded checksum matches: the safetensors parser reports it
    let p = variant("garbage", &|p| {
        let garbage = vec![0xABu8; 4096];
        std::fs::write(p.join("model.safetensors"), &garbage)?;
        let f = p.join("trainer_state.json");
        let mut s: serde_json::Value = serde_json::from_slice(&std::fs::read(&f)?)?;
        use sha2::Digest;
        let hex: String = sha2::Sha256::digest(&garbage)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        s["files"]["model.safetensors"] = serde_json::json!({ "bytes": 4096, "sha256": hex });
        std::fs::write(&f, serde_json::to_vec(&s)?)?;
        Ok(())
    })?;
    errors.push(expect_err(
        &p,
        &mut b,
        &["model.safetensors", "not a valid safetensors"],
    )?);

    // wrong format version
    let p = variant("version", &|p| {
        let f = p.join("trainer_state.json");
        let mut s: serde_json::Value = serde_json::from_slice(&std::fs::read(&f)?)?;
        s["format_version"] = serde_json::json!(99);
        std::fs::write(&f, serde_json::to_vec(&s)?)?;
        Ok(())
    })?;
    errors.push(expect_err(
        &p,
        &mut b,
        &["trainer_state.json", "wrong version", "99"],
    )?);

    // truncated trainer_state.json
    let p = variant("json", &|p| {
        let f = p.join("trainer_state.json");
        let bytes = std::fs::read(&f)?;
        std::fs::write(&f, &bytes[..bytes.len() / 2])?;
        Ok(())
    })?;
    errors.push(expect_err(
        &p,
        &mut b,
        &["trainer_state.json", "not valid JSON"],
    )?);

    // a missing file
    let p = variant("missing", &|p| {
        Ok(std::fs::remove_file(p.join("optimizer.safetensors"))?)
    })?;
    errors.push(expect_err(
        &p,
        &mut b,
        &["optimizer.safetensors", "cannot read"],
    )?);

    // the checkpoint root instead of a step directory
    errors.push(expect_err(&dir.join("good"), &mut b, &["latest"])?);

    // a different model: a wider hidden layer (shape mismatch), an extra layer (missing
    // tensor), a smaller model (unexpected tensors)
    let (_, mut wide) = make(Variant::Bf16AccumClip, 5, &[32, 65, 64, 10])?;
    errors.push(expect_err(
        &good,
        &mut wide,
        &["model.safetensors", "shape mismatch", "l1.weight"],
    )?);
    let (_, mut deeper) = make(Variant::Bf16AccumClip, 5, &[32, 64, 64, 64, 10])?;
    errors.push(expect_err(
        &good,
        &mut deeper,
        &["model.safetensors", "missing tensor", "l4.weight"],
    )?);
    let (_, mut shallow) = make(Variant::Bf16AccumClip, 5, &[32, 64, 10])?;
    errors.push(expect_err(
        &good,
        &mut shallow,
        &["model.safetensors", "unexpected tensor", "l3.bias"],
    )?);

    // another optimizer: AdamW moments are no SGD momentum buffers
    let (_, mut sgd) = make(Variant::SgdNesterov, 5, &DIMS)?;
    errors.push(expect_err(
        &good,
        &mut sgd,
        &["trainer_state.json", "AdamW", "Sgd"],
    )?);

    for e in &errors {
        println!("error: {e}");
    }
    // loading never touched the good checkpoint, and it still loads
    assert_eq!(file_hashes(&good)?, good_files);
    let (_, mut c) = make(Variant::Bf16AccumClip, 6, &DIMS)?;
    checkpoint::load(&good, &mut c)?;
    assert_eq!(snapshot(&c)?, snapshot(&engine)?);
    checkpoint::load(&good, &mut b)?;
    assert_eq!(snapshot(&b)?, snapshot(&engine)?);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn save_in_the_middle_of_an_accumulation_window_is_an_error_and_writes_nothing() -> Result<()> {
    let dir = tmpdir("midwindow");
    let (model, mut engine) = make(Variant::Bf16AccumClip, 1, &DIMS)?;
    let (x, y) = batch(0)?;
    engine.step(|_| loss::cross_entropy(&model.forward(&x)?, &y))?;
    let err = Checkpointer::new(&dir, 2)
        .save(&engine, serde_json::Value::Null)
        .expect_err("mid-window save");
    assert!(
        format!("{err:#}").contains("accumulation boundary"),
        "{err:#}"
    );
    assert!(checkpoint::latest(&dir)?.is_none());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// (3) kill -9 during save

/// Entry point of the child process of the kill tests (ignored in normal runs).
#[test]
#[ignore = "run as a child process by the kill -9 and Ctrl-C tests"]
fn child_process_entry() -> Result<()> {
    let dir = std::env::var("WICK_CKPT_CHILD_DIR").expect("WICK_CKPT_CHILD_DIR");
    ckpt_crash::run(Path::new(&dir), 2, None)
}

/// Spawns the save loop in a child process (this test binary, running `child_process_entry`);
/// returns the child and a channel of its `ready/saved/interrupted step=N` lines.
fn spawn_child(dir: &Path) -> Result<(std::process::Child, mpsc::Receiver<(String, u64)>)> {
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "child_process_entry",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("WICK_CKPT_CHILD_DIR", dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            // libtest may print "test child_process_entry ... " before the first line
            if let Some((what, step)) = line.split_once(" step=") {
                let what = what.rsplit(' ').next().unwrap_or(what);
                if let Ok(step) = step.trim().parse::<u64>() {
                    let _ = tx.send((what.to_string(), step));
                }
            }
        }
    });
    Ok((child, rx))
}

fn wait_for(rx: &mpsc::Receiver<(String, u64)>, what: &str) -> Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let (w, s) = rx
            .recv_timeout(left)
            .map_err(|e| anyhow::anyhow!("child: no {what:?} line: {e}"))?;
        if w == what {
            return Ok(s);
        }
    }
}

/// The child's own temporary directories (`.tmp-...-<pid>`): a save it had started.
fn tmp_dirs_of(dir: &Path, pid: u32) -> Vec<String> {
    let suffix = format!("-{pid}");
    dir_names(dir)
        .into_iter()
        .filter(|n| n.starts_with(".tmp-step-") && n.ends_with(&suffix))
        .collect()
}

#[test]
fn kill_9_during_save_always_leaves_a_loadable_checkpoint() -> Result<()> {
    let dir = tmpdir("kill9");
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let (mut mid_save, mut targeted_mid_save, mut last_saved, mut total_saves) = (0, 0, 0u64, 0);
    let started = Instant::now();
    for round in 0..20 {
        let (mut child, rx) = spawn_child(&dir)?;
        let pid = child.id();
        let ready = wait_for(&rx, "ready")?;
        assert!(
            ready >= last_saved,
            "round {round}: resumed at {ready} < {last_saved}"
        );
        // even rounds: a random moment of the train/save loop; odd rounds: a random moment
        // shortly after a save started writing its files (the window that matters)
        let targeted = round % 2 == 1;
        if targeted {
            let deadline = Instant::now() + Duration::from_secs(60);
            while tmp_dirs_of(&dir, pid).is_empty() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_micros(200));
            }
            std::thread::sleep(Duration::from_micros(rng.random_range(0..30_000)));
        } else {
            std::thread::sleep(Duration::from_millis(rng.random_range(0..1200)));
        }
        child.kill()?; // SIGKILL on Unix
        child.wait()?;
        // the lines printed before the kill: each "saved" was durable when printed
        for (w, s) in rx.try_iter() {
            if w == "saved" {
                last_saved = s;
                total_saves += 1;
            }
        }
        if !tmp_dirs_of(&dir, pid).is_empty() {
            mid_save += 1;
            targeted_mid_save += usize::from(targeted);
        }

        let Some(path) = checkpoint::latest(&dir)? else {
            // killed before the first save completed: nothing was promised yet
            assert_eq!(
                last_saved, 0,
                "round {round}: no checkpoint after a reported save"
            );
            continue;
        };
        let (_, mut engine) = ckpt_crash::build(7)?;
        let extra = checkpoint::load(&path, &mut engine)
            .map_err(|e| e.context(format!("round {round}: latest checkpoint does not load")))?
            .extra;
        let step = engine.boundaries();
        assert_eq!(extra["next_step"].as_u64(), Some(step));
        assert!(
            step >= last_saved,
            "round {round}: latest is step {step} but step {last_saved} was reported saved"
        );
        let complete = checkpoint::list_checkpoints(&dir)?.len();
        assert!(
            complete <= 3,
            "keep_last 2 (+1 while the next save prunes): {complete}"
        );
    }
    println!(
        "20 SIGKILLs in {:.1} s: {total_saves} saves completed; {mid_save} kills landed while a \
         save was writing its files ({targeted_mid_save} of the 10 targeted ones); latest loaded \
         after every kill; last step {last_saved}; dir now {:?}",
        started.elapsed().as_secs_f64(),
        dir_names(&dir)
    );
    assert!(
        targeted_mid_save >= 5,
        "the targeted kills should land inside a save: {targeted_mid_save} of 10"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[cfg(unix)]
#[test]
fn ctrl_c_saves_and_exits_with_status_130() -> Result<()> {
    let dir = tmpdir("sigint");
    let (mut child, rx) = spawn_child(&dir)?;
    wait_for(&rx, "saved")?;
    // SAFETY: kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    assert_eq!(rc, 0);
    let step = wait_for(&rx, "interrupted")?;
    let status = child.wait()?;
    assert_eq!(
        status.code(),
        Some(checkpoint::INTERRUPTED_EXIT_CODE),
        "saved, then exit 130 as after Ctrl-C: {status:?}"
    );
    assert_eq!(checkpoint::INTERRUPTED_EXIT_CODE, 130);
    let path = checkpoint::latest(&dir)?.expect("a checkpoint");
    assert_eq!(checkpoint::read_state(&path)?.step, step);
    assert!(
        !dir_names(&dir).iter().any(|n| n.starts_with(".tmp-")),
        "no partial save left: {:?}",
        dir_names(&dir)
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// (4) keep_last, same-step saves, stale temporary directories

#[test]
fn keep_last_prunes_and_same_step_save_replaces() -> Result<()> {
    let dir = tmpdir("prune");
    let (model, mut engine) = make(Variant::Fp32, 1, &DIMS)?;
    let ckpt = Checkpointer::new(&dir, 2);
    // a stale temporary directory of a dead process is removed by the next save
    std::fs::create_dir_all(dir.join(".tmp-step-000009-4000000000"))?;
    for step in 1..=5u64 {
        train(&model, &mut engine, step - 1, step)?;
        ckpt.save(&engine, serde_json::json!({ "step": step }))?;
    }
    assert_eq!(dir_names(&dir), ["step-000004", "step-000005"]);
    assert_eq!(ckpt.latest()?, Some(dir.join("step-000005")));

    // saving step 5 again replaces it atomically
    ckpt.save(&engine, serde_json::json!({ "step": 5, "again": true }))?;
    assert_eq!(dir_names(&dir), ["step-000004", "step-000005"]);
    assert_eq!(
        checkpoint::read_state(dir.join("step-000005"))?.extra["again"],
        true
    );

    // keep_last 0 keeps everything
    let all = Checkpointer::new(&dir, 0);
    train(&model, &mut engine, 5, 6)?;
    all.save(&engine, serde_json::Value::Null)?;
    assert_eq!(checkpoint::list_checkpoints(&dir)?.len(), 3);
    // keep_last 1
    train(&model, &mut engine, 6, 7)?;
    Checkpointer::new(&dir, 1).save(&engine, serde_json::Value::Null)?;
    assert_eq!(dir_names(&dir), ["step-000007"]);

    // an incomplete step directory (e.g. copied by hand) is not "latest"
    std::fs::create_dir_all(dir.join("step-000099"))?;
    std::fs::write(dir.join("step-000099/trainer_state.json"), b"{}")?;
    assert_eq!(checkpoint::latest(&dir)?, Some(dir.join("step-000007")));
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// (5) model.safetensors is a plain candle-nn checkpoint

#[test]
fn model_safetensors_loads_with_candle_nn_var_builder() -> Result<()> {
    let dir = tmpdir("varbuilder");
    let (model, mut engine) = make(Variant::Bf16AccumClip, 2, &DIMS)?;
    train(&model, &mut engine, 0, 4)?;
    let path = Checkpointer::new(&dir, 1).save(&engine, serde_json::Value::Null)?;
    let file = path.join("model.safetensors");

    // the names are exactly the model's
    let st = candle_core::safetensors::load(&file, &Device::Cpu)?;
    let mut names: Vec<&String> = st.keys().collect();
    names.sort();
    let mut expected: Vec<String> = engine
        .store()
        .params()
        .into_iter()
        .map(|p| p.name)
        .collect();
    expected.sort();
    assert_eq!(names, expected.iter().collect::<Vec<_>>());

    // SAFETY: the file is not modified while mapped.
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(&[&file], DType::F32, &Device::Cpu)?
    };
    let masters: HashMap<String, Tensor> = engine.store().masters().into_iter().collect();
    for (name, master) in &masters {
        let t = vb.get(master.dims(), name)?;
        assert_eq!(bits(&t)?, bits(master)?, "{name}");
    }
    // an inference model built with plain candle-nn gives the training model's outputs
    let l1 = candle_nn::linear(32, 64, vb.pp("l1"))?;
    let l2 = candle_nn::linear(64, 64, vb.pp("l2"))?;
    let l3 = candle_nn::linear(64, 10, vb.pp("l3"))?;
    let (x, _) = batch(77)?;
    let y = l3.forward(&l2.forward(&l1.forward(&x)?.relu()?)?.relu()?)?;
    let (_, mut fp32) = make(Variant::Fp32, 9, &DIMS)?;
    checkpoint::load(&path, &mut fp32)?;
    let fp32_model = Mlp::new(fp32.store(), &DIMS)?;
    let y_ref = fp32_model.forward(&x)?;
    assert_eq!(bits(&y)?, bits(&y_ref)?);
    // and in bf16 for serving
    let vb16 = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(&[&file], DType::BF16, &Device::Cpu)?
    };
    assert_eq!(vb16.get((64, 32), "l1.weight")?.dtype(), DType::BF16);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// figures: save / load time of the MNIST MLP (784-1024-1024-10, 1.86M parameters)

#[test]
fn mnist_mlp_save_load_time() -> Result<()> {
    let dir = tmpdir("mnist-timing");
    let dims = [784, 1024, 1024, 10];
    let (model, mut engine) = make(Variant::Bf16AccumClip, 0, &dims)?;
    assert_eq!(engine.store().num_elements(), 1_863_690);
    let x = Tensor::zeros((8, 784), DType::F32, &Device::Cpu)?;
    let y = Tensor::zeros(8, DType::U32, &Device::Cpu)?;
    for _ in 0..2 {
        engine.step(|_| loss::cross_entropy(&model.forward(&x)?, &y))?;
    }
    let ckpt = Checkpointer::new(&dir, 2);
    let (mut save, mut load) = (Vec::new(), Vec::new());
    let mut path = PathBuf::new();
    for _ in 0..5 {
        let t = Instant::now();
        path = ckpt.save(&engine, serde_json::Value::Null)?;
        save.push(t.elapsed().as_secs_f64() * 1e3);
        let (_, mut fresh) = make(Variant::Bf16AccumClip, 1, &dims)?;
        let t = Instant::now();
        checkpoint::load(&path, &mut fresh)?;
        load.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let size = |f: &str| {
        std::fs::metadata(path.join(f))
            .map(|m| m.len())
            .unwrap_or(0)
    };
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "MNIST MLP (1,863,690 params, bf16-mixed, AdamW): model.safetensors {} B, \
         optimizer.safetensors {} B; save median {:.1} ms, load median {:.1} ms (5 runs, with fsync)",
        size("model.safetensors"),
        size("optimizer.safetensors"),
        med(&mut save),
        med(&mut load)
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn resume_with_loader_restores_the_data_position_or_changes_nothing() -> anyhow::Result<()> {
    use candle_core::{DType, Device, Module, Tensor};
    use wick::checkpoint::Checkpointer;
    use wick::data::{DataLoader, LoaderConfig, TensorDataset};
    use wick::{loss, nn, Engine, EngineConfig, ParamStore, Precision};
    let dir = std::env::temp_dir().join(format!("wick-ckpt-loader-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let data = || -> anyhow::Result<TensorDataset> {
        let x = Tensor::arange(0f32, 64.0, &Device::Cpu)?.reshape((32, 2))?;
        let y = Tensor::zeros(32, DType::U32, &Device::Cpu)?;
        TensorDataset::new(vec![x, y])
    };
    let build = |seed| -> anyhow::Result<(Engine, nn::Linear)> {
        let store = ParamStore::new(Precision::Fp32, Device::Cpu, seed);
        let l = nn::Linear::new(&store, "l", 2, 3, true)?;
        Ok((Engine::new(store, EngineConfig::adamw(1e-2))?, l))
    };
    let (mut engine, l) = build(1)?;
    let mut loader = DataLoader::new(data()?, LoaderConfig::new(4).with_shuffle(9))?;
    for _ in 0..3 {
        let b = loader.next_batch()?.unwrap();
        let (x, y) = b.pair()?;
        engine.step(|_| loss::cross_entropy(&l.forward(&x)?, &y))?;
    }
    let ck = Checkpointer::new(&dir, 2);
    ck.save_with_loader(&engine, &loader.state(), serde_json::json!({ "note": "x" }))?;
    let next = loader.next_batch()?.unwrap().indices;

    let (mut fresh, _) = build(2)?;
    let mut fresh_loader = DataLoader::new(data()?, LoaderConfig::new(4).with_shuffle(9))?;
    let extra = ck
        .resume_with_loader(&mut fresh, &mut fresh_loader)?
        .expect("a checkpoint")
        .extra;
    assert_eq!(extra["note"], "x");
    assert_eq!(fresh.boundaries(), 3);
    assert_eq!(fresh_loader.next_batch()?.unwrap().indices, next);

    // a loader with another batch size does not fit: nothing changes
    let (mut other, _) = build(3)?;
    let mut wrong = DataLoader::new(data()?, LoaderConfig::new(8).with_shuffle(9))?;
    let before = wrong.state();
    assert!(ck.resume_with_loader(&mut other, &mut wrong).is_err());
    assert_eq!((other.boundaries(), wrong.state()), (0, before));
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
