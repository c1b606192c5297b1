//! What the Trainer writes: metrics rows that a resumed run appends to (the whole run in one
//! file), the step-0 evaluation, plots drawn after `fit` (not inside it), only on rank 0 under
//! data parallelism; the report's ms/step; config errors in the user's words.

use candle_core::{DType, Device, Module, Tensor};
use std::path::{Path, PathBuf};
use wick::checkpoint::Checkpointer;
use wick::data::{DataLoader, LoaderConfig, LoaderState, TensorDataset};
#[cfg(feature = "plot")] // only_rank_0_writes_files
use wick::dist::{DdpConfig, LocalCollective};
use wick::trainer::{FitSummary, Hooks, Metrics, Trainer, TrainerConfig};
use wick::{loss, nn, Engine, EngineConfig, ParamStore, Precision};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wick-trainer-files-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

struct Run {
    engine: Engine,
    loader: DataLoader<TensorDataset>,
    l1: nn::Linear,
    l2: nn::Linear,
}

fn run_setup() -> anyhow::Result<Run> {
    let n = 128;
    let x = Tensor::arange(0u32, (n * 4) as u32, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .reshape((n, 4))?
        .sin()?;
    let y = Tensor::from_vec((0..n as u32).map(|i| i % 3).collect(), n, &Device::Cpu)?;
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 1);
    let l1 = nn::Linear::new(&store, "l1", 4, 8, true)?;
    let l2 = nn::Linear::new(&store, "l2", 8, 3, true)?;
    let engine = Engine::new(store, EngineConfig::adamw(1e-2))?;
    let loader = DataLoader::new(
        TensorDataset::new(vec![x, y])?,
        LoaderConfig::new(16).with_shuffle(3),
    )?;
    Ok(Run {
        engine,
        loader,
        l1,
        l2,
    })
}

fn config(out: &Path, max_steps: u64) -> TrainerConfig {
    TrainerConfig {
        max_epochs: None,
        max_steps: Some(max_steps),
        log_every: 1,
        eval_every: Some(2),
        eval_at_start: true,
        out_dir: Some(out.to_path_buf()),
        progress: false,
        ..TrainerConfig::default()
    }
}

fn fit(run: &mut Run, trainer: &mut Trainer, hooks: Hooks) -> anyhow::Result<FitSummary> {
    let (l1, l2) = (&run.l1, &run.l2);
    trainer.fit(
        &mut run.engine,
        &mut run.loader,
        |_, b| {
            let (x, y) = b
                .pair()
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            loss::cross_entropy(&l2.forward(&l1.forward(&x)?.relu()?)?, &y)
        },
        |e| {
            Ok(Metrics::from([(
                "val_loss".to_string(),
                1.0 / (1.0 + e.boundaries() as f64),
            )]))
        },
        hooks,
    )
}

fn csv_rows(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("metrics.csv"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn steps_of(rows: &[String]) -> Vec<u64> {
    rows[1..]
        .iter()
        .map(|r| r.split(',').next().unwrap().parse().unwrap())
        .collect()
}

/// A run to step 6 that checkpoints at step 4; a second process resumes at 4 and goes on to
/// 8. metrics.csv (and .jsonl) then hold steps 0..=8 once each: the first run's rows up to
/// step 4 unchanged, its abandoned rows 5 and 6 replaced by the resumed run's.
#[test]
fn a_resumed_run_appends_to_the_metrics_files() -> anyhow::Result<()> {
    let (out, ck) = (tmp("resume-out"), tmp("resume-ckpt"));
    let ckpt = Checkpointer::new(&ck, 0);
    let mut first = run_setup()?;
    let saver = ckpt.clone();
    let hooks = Hooks {
        after_step: Some(Box::new(move |e: &mut Engine, _r, pos: &LoaderState| {
            if e.boundaries() == 4 {
                saver.save_with_loader(e, pos, serde_json::Value::Null)?;
            }
            Ok(false)
        })),
    };
    fit(&mut first, &mut Trainer::new(config(&out, 6))?, hooks)?;
    let before = csv_rows(&out);
    assert_eq!(steps_of(&before), [0, 1, 2, 3, 4, 5, 6]);
    assert_eq!(before[0], wick::trainer::CSV_HEADER);

    let mut second = run_setup()?;
    ckpt.resume_existing_with_loader(&mut second.engine, &mut second.loader)?;
    assert_eq!(second.engine.boundaries(), 4);
    fit(
        &mut second,
        &mut Trainer::new(config(&out, 8))?,
        Hooks::default(),
    )?;
    let after = csv_rows(&out);
    assert_eq!(steps_of(&after), [0, 1, 2, 3, 4, 5, 6, 7, 8], "{after:#?}");
    assert_eq!(
        after[..6],
        before[..6],
        "the rows up to the resumed step stay as written"
    );
    let jsonl = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    let json_steps: Vec<u64> = jsonl
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(json_steps, [0, 1, 2, 3, 4, 5, 6, 7, 8]);
    // the resumed run's losses at steps 5 and 6 are the first run's (exact resume)
    let loss = |rows: &[String], i: usize| rows[i].split(',').nth(2).unwrap().to_string();
    assert_eq!(loss(&after, 6), loss(&before, 6));
    assert_eq!(loss(&after, 7), loss(&before, 7));
    std::fs::remove_dir_all(&out)?;
    std::fs::remove_dir_all(&ck)?;
    Ok(())
}

/// Step 0 (the untrained model) is evaluated and written; plots appear only when asked for,
/// after `fit`.
#[test]
#[cfg(feature = "plot")]
fn step_zero_evaluation_is_a_metrics_row_and_plots_come_after_fit() -> anyhow::Result<()> {
    let out = tmp("plots");
    let mut run = run_setup()?;
    let mut trainer = Trainer::new(config(&out, 4))?;
    let summary = fit(&mut run, &mut trainer, Hooks::default())?;
    let rows = csv_rows(&out);
    assert_eq!(rows[1], "0,0,,1,,,,,", "step 0: val_loss 1/(1+0) = 1");
    assert!(!out.join("loss.png").exists(), "fit draws no plots");
    let written = trainer.write_plots(&summary)?;
    assert_eq!(
        written,
        [
            out.join("phases.csv"),
            out.join("loss.png"),
            out.join("phases.png")
        ]
    );
    assert!(written.iter().all(|p| p.is_file()));
    std::fs::remove_dir_all(&out)?;
    Ok(())
}

/// Two data-parallel ranks with their own out_dir: only rank 0 writes metrics and plots.
#[test]
#[cfg(feature = "plot")]
fn only_rank_0_writes_files() -> anyhow::Result<()> {
    let root = tmp("ranks");
    let handles: Vec<_> = LocalCollective::group(2)?
        .into_iter()
        .enumerate()
        .map(|(rank, c)| {
            let out = root.join(format!("rank{rank}"));
            std::thread::spawn(move || -> anyhow::Result<(usize, Vec<PathBuf>)> {
                let mut run = run_setup()?;
                run.engine = run
                    .engine
                    .with_collective(Box::new(c), DdpConfig::default())?;
                let mut trainer = Trainer::new(config(&out, 2))?;
                let summary = fit(&mut run, &mut trainer, Hooks::default())?;
                Ok((summary.rank, trainer.write_plots(&summary)?))
            })
        })
        .collect();
    let results: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect::<anyhow::Result<_>>()?;
    assert_eq!(results[0].0, 0);
    assert_eq!(results[1].0, 1);
    assert_eq!(results[0].1.len(), 3);
    assert!(results[1].1.is_empty());
    assert!(root.join("rank0/metrics.csv").is_file());
    assert!(!root.join("rank1").exists(), "rank 1 wrote nothing");
    std::fs::remove_dir_all(&root)?;
    Ok(())
}

/// The report's `step` row is `FitSummary::step_ms`, the sum of the phases per step.
#[test]
fn step_ms_is_the_report_tables_step_row() -> anyhow::Result<()> {
    let mut run = run_setup()?;
    let mut c = config(Path::new("unused"), 5);
    c.out_dir = None;
    let summary = fit(&mut run, &mut Trainer::new(c)?, Hooks::default())?;
    let report = summary.report();
    let row: f64 = report
        .lines()
        .find_map(|l| l.strip_prefix("step "))
        .and_then(|r| r.split_whitespace().next())
        .expect("a step row")
        .parse()?;
    let ms = summary.step_ms().expect("steps ran");
    let by_hand = summary.phases.total().as_secs_f64() * 1e3 / 5.0;
    assert!((ms - by_hand).abs() < 1e-9);
    assert!(
        (row - ms).abs() <= 0.0005 + 1e-9,
        "table {row} vs step_ms {ms}"
    );
    let wall = summary.wall_ms_per_step().expect("steps ran");
    assert!(wall >= ms, "wall {wall} includes the phases {ms}");
    assert!(report.contains("ms/step wall clock, evaluation and logging included"));
    Ok(())
}

#[test]
fn config_errors_name_the_setting_in_plain_words() {
    let err = |c: TrainerConfig| format!("{:#}", Trainer::new(c).err().expect("an error"));
    let e = err(TrainerConfig {
        max_epochs: Some(0),
        ..TrainerConfig::default()
    });
    assert!(
        e.contains("max_epochs is 0") && e.contains("1 or more"),
        "{e}"
    );
    assert!(!e.contains("log_every"), "{e}");
    let e = err(TrainerConfig {
        eval_every: Some(0),
        ..TrainerConfig::default()
    });
    assert!(e.contains("eval_every is 0"), "{e}");
}
