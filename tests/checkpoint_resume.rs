//! Resuming safely: a missing checkpoint is an error when a resume was asked for; an
//! incomplete newest checkpoint is skipped loudly (a warning naming it and the one used) and
//! is never overwritten by the resumed run; a precision change is warned about; an exact
//! resume (`Checkpointer::exact`) refuses either before changing the engine or the loader.

use candle_core::{DType, Device, Module, Tensor};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use wick::checkpoint::{self, Checkpointer, ResumeNotice};
use wick::data::{DataLoader, LoaderConfig, TensorDataset};
use wick::{loss, nn, Engine, EngineConfig, ParamStore, Precision};

/// A `tracing` writer into a shared buffer: what a user would see on stderr.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// Runs `f` with `tracing` warnings captured; returns its result and the log.
fn with_log<R>(f: impl FnOnce() -> R) -> (R, String) {
    let buf = Captured::default();
    let b = buf.clone();
    let sub = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(move || b.clone())
        .finish();
    let r = tracing::subscriber::with_default(sub, f);
    (r, buf.text())
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wick-resume-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

struct Run {
    engine: Engine,
    loader: DataLoader<TensorDataset>,
    l1: nn::Linear,
}

fn setup(precision: Precision) -> anyhow::Result<Run> {
    let x = Tensor::arange(0u32, 64 * 4, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .reshape((64, 4))?
        .sin()?;
    let y = Tensor::from_vec((0..64u32).map(|i| i % 3).collect(), 64, &Device::Cpu)?;
    let store = ParamStore::new(precision, Device::Cpu, 2);
    let l1 = nn::Linear::new(&store, "l1", 4, 3, true)?;
    let engine = Engine::new(store, EngineConfig::adamw(1e-2))?;
    let loader = DataLoader::new(TensorDataset::new(vec![x, y])?, LoaderConfig::new(8))?;
    Ok(Run { engine, loader, l1 })
}

/// One optimizer step on the loader's next batch.
fn step(run: &mut Run) -> anyhow::Result<()> {
    let b = run.loader.next_batch()?.expect("a batch");
    let (x, y) = b.pair()?;
    let l1 = &run.l1;
    run.engine
        .step(|_| loss::cross_entropy(&l1.forward(&x)?, &y))?;
    Ok(())
}

/// What a refused resume must leave as it was: step count, masters and loader position.
fn snapshot(run: &Run) -> (u64, Vec<(String, Vec<f32>)>, wick::data::LoaderState) {
    let masters = run
        .engine
        .store()
        .masters()
        .into_iter()
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    (run.engine.boundaries(), masters, run.loader.state())
}

/// An exact resume of `dir` into `run` is refused with a message containing `want`, and
/// changes nothing.
fn refused_exact(dir: &Path, run: &mut Run, want: &str) {
    let before = snapshot(run);
    let err = Checkpointer::new(dir, 0)
        .exact()
        .resume_existing_with_loader(&mut run.engine, &mut run.loader)
        .expect_err("not an exact continuation");
    let msg = format!("{err:#}");
    assert!(
        msg.contains(want) && msg.contains("not an exact continuation"),
        "{msg}"
    );
    assert!(snapshot(run) == before, "a refused resume changed the run");
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn resuming_without_a_checkpoint_is_an_error_that_says_how_to_start_fresh() -> anyhow::Result<()> {
    let dir = tmp("none");
    let mut run = setup(Precision::Fp32)?;
    let err = Checkpointer::new(&dir, 3)
        .resume_existing_with_loader(&mut run.engine, &mut run.loader)
        .expect_err("no checkpoint to resume");
    let msg = format!("{err:#}");
    assert!(
        msg.contains(&format!("no checkpoint in {}", dir.display())) && msg.contains("fresh"),
        "{msg}"
    );
    assert_eq!(run.engine.boundaries(), 0);
    Ok(())
}

/// Steps 1..3 saved; step 3 loses its model file. The resume returns a notice naming step 3
/// and what it lacks, and warns, naming step 3 and the step-2 checkpoint it falls back to; when the run reaches step 3 again its save keeps the
/// damaged folder (renamed), byte for byte, instead of overwriting it.
#[test]
fn an_incomplete_newest_checkpoint_is_skipped_loudly_and_never_overwritten() -> anyhow::Result<()> {
    let dir = tmp("incomplete");
    let ckpt = Checkpointer::new(&dir, 0);
    let mut run = setup(Precision::Fp32)?;
    for _ in 0..3 {
        step(&mut run)?;
        ckpt.save_with_loader(&run.engine, &run.loader.state(), serde_json::Value::Null)?;
    }
    let step3 = dir.join("step-000003");
    std::fs::remove_file(step3.join(checkpoint::MODEL_FILE))?;
    let state3 = std::fs::read(step3.join(checkpoint::STATE_FILE))?;

    let mut resumed = setup(Precision::Fp32)?;
    refused_exact(&dir, &mut resumed, "step-000003");
    let again = Checkpointer::new(&dir, 0);
    let (r, log) =
        with_log(|| again.resume_existing_with_loader(&mut resumed.engine, &mut resumed.loader));
    let r = r?;
    assert_eq!(r.path, dir.join("step-000002"));
    assert_eq!(
        r.notices,
        vec![ResumeNotice::SkippedIncomplete {
            path: step3.clone(),
            missing: vec![checkpoint::MODEL_FILE.to_string()],
        }],
        "the caller is told, not only the log"
    );
    assert!(
        log.contains(&step3.display().to_string())
            && log.contains(&dir.join("step-000002").display().to_string())
            && log.contains("missing model.safetensors"),
        "the warning names both checkpoints and what is missing: {log:?}"
    );

    step(&mut resumed)?;
    let (saved, log) = with_log(|| {
        again.save_with_loader(
            &resumed.engine,
            &resumed.loader.state(),
            serde_json::Value::Null,
        )
    });
    assert_eq!(saved?, step3);
    let aside: Vec<String> = names(&dir)
        .into_iter()
        .filter(|n| n.starts_with("step-000003.set-aside-"))
        .collect();
    assert_eq!(aside.len(), 1, "{:?}", names(&dir));
    let kept = dir.join(&aside[0]);
    assert_eq!(std::fs::read(kept.join(checkpoint::STATE_FILE))?, state3);
    assert!(log.contains(&kept.display().to_string()), "{log:?}");
    // the new step 3 is complete and is the latest; the set-aside folder is not a checkpoint
    assert_eq!(checkpoint::latest(&dir)?, Some(step3.clone()));
    assert_eq!(checkpoint::list_checkpoints(&dir)?.len(), 3);
    // saving the same step again from the same checkpointer replaces its own save in place
    again.save_with_loader(
        &resumed.engine,
        &resumed.loader.state(),
        serde_json::Value::Null,
    )?;
    assert_eq!(
        names(&dir)
            .iter()
            .filter(|n| n.contains("set-aside"))
            .count(),
        1
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn resuming_a_bf16_checkpoint_in_fp32_returns_a_notice_and_warns() -> anyhow::Result<()> {
    let dir = tmp("precision");
    let ckpt = Checkpointer::new(&dir, 1);
    let mut run = setup(Precision::Bf16Mixed)?;
    step(&mut run)?;
    ckpt.save_with_loader(&run.engine, &run.loader.state(), serde_json::Value::Null)?;
    let mut other = setup(Precision::Fp32)?;
    // a run that has moved: the refusal must keep its step, masters and loader position
    step(&mut other)?;
    step(&mut other)?;
    refused_exact(&dir, &mut other, "saved in bf16-mixed and loaded into 32");
    let mut other = setup(Precision::Fp32)?;
    let (r, log) =
        with_log(|| ckpt.resume_existing_with_loader(&mut other.engine, &mut other.loader));
    assert_eq!(
        r?.notices,
        vec![ResumeNotice::PrecisionChanged {
            saved: "bf16-mixed".into(),
            running: "32".into(),
        }]
    );
    assert!(
        log.contains("saved in bf16-mixed and loaded into 32"),
        "{log:?}"
    );
    // an exact continuation has no notice
    let mut same = setup(Precision::Bf16Mixed)?;
    let exact = ckpt
        .clone()
        .exact()
        .resume_existing_with_loader(&mut same.engine, &mut same.loader)?;
    assert!(exact.notices.is_empty(), "{exact}");
    assert_eq!(same.engine.boundaries(), 1);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
