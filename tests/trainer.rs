//! The fit loop: stopping rules, early stopping, accumulation, metrics files.

use candle_core::{DType, Device, Module, Tensor};
use std::cell::RefCell;
use wick::data::{DataLoader, LoaderConfig, TensorDataset};
use wick::trainer::{EarlyStopping, Hooks, Metrics, Mode, StopReason, Trainer, TrainerConfig};
use wick::{loss, nn, Engine, EngineConfig, ParamStore, Precision};

/// y = argmax of a fixed linear map of x: learnable, deterministic.
fn dataset(n: usize) -> anyhow::Result<TensorDataset> {
    let x = Tensor::arange(0u32, (n * 4) as u32, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .reshape((n, 4))?;
    let x = (x.sin()? * 2.0)?;
    let w = Tensor::new(
        &[
            [1f32, -1., 0.5],
            [0.3, 1., -1.],
            [-0.7, 0.2, 1.],
            [1., 1., 1.],
        ],
        &Device::Cpu,
    )?;
    let y = x.matmul(&w)?.argmax(1)?;
    TensorDataset::new(vec![x, y])
}

fn setup(accum: usize) -> anyhow::Result<(Engine, nn::Linear, nn::Linear)> {
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 3);
    let l1 = nn::Linear::new(&store, "l1", 4, 16, true)?;
    let l2 = nn::Linear::new(&store, "l2", 16, 3, true)?;
    let engine = Engine::new(
        store,
        EngineConfig {
            accumulation_steps: accum,
            ..EngineConfig::adamw(1e-2)
        },
    )?;
    Ok((engine, l1, l2))
}

#[test]
fn max_steps_with_accumulation_and_metrics_files() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("wick-trainer-{}", std::process::id()));
    let (mut engine, l1, l2) = setup(2)?;
    let mut loader = DataLoader::new(dataset(256)?, LoaderConfig::new(16).with_shuffle(1))?;
    let config = TrainerConfig {
        max_epochs: None,
        max_steps: Some(20),
        log_every: 5,
        eval_every: Some(10),
        out_dir: Some(dir.clone()),
        progress: false,
        ..TrainerConfig::default()
    };
    let mut trainer = Trainer::new(config)?;
    let batches = RefCell::new(0u32);
    let losses = RefCell::new(Vec::new());
    let evals = RefCell::new(Vec::new());
    let summary = trainer.fit(
        &mut engine,
        &mut loader,
        |_, b| {
            *batches.borrow_mut() += 1;
            let (x, y) = b
                .pair()
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            let l = loss::cross_entropy(&l2.forward(&l1.forward(&x)?.relu()?)?, &y)?;
            losses.borrow_mut().push(l.to_scalar::<f32>()? as f64);
            Ok(l)
        },
        |e| {
            evals.borrow_mut().push(e.boundaries());
            Ok(Metrics::from([(
                "val_loss".to_string(),
                1.0 / (1.0 + e.boundaries() as f64),
            )]))
        },
        Hooks::default(),
    )?;
    assert_eq!(summary.stop, StopReason::MaxSteps);
    assert_eq!((summary.steps, engine.boundaries()), (20, 20));
    // fitting again (a run resumed at its last step) trains nothing more
    let again = Trainer::new(TrainerConfig {
        max_epochs: None,
        max_steps: Some(20),
        progress: false,
        ..TrainerConfig::default()
    })?
    .fit(
        &mut engine,
        &mut loader,
        |_, _| -> candle_core::Result<Tensor> { panic!("no step may run") },
        |_| Ok(Metrics::new()),
        Hooks::default(),
    )?;
    assert_eq!((again.stop, again.steps), (StopReason::MaxSteps, 0));
    assert_eq!(engine.boundaries(), 20);
    assert_eq!(
        *batches.borrow(),
        40,
        "two micro-batches per optimizer step"
    );
    assert_eq!(summary.samples, 40 * 16);
    assert_eq!(*evals.borrow(), vec![10, 20]);
    let csv = std::fs::read_to_string(dir.join("metrics.csv"))?;
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(
        lines[0],
        "step,epoch,loss,val_loss,lr,grad_norm,loss_scale,samples_per_s,tokens_per_s"
    );
    let steps: Vec<&str> = lines[1..]
        .iter()
        .map(|l| l.split(',').next().unwrap())
        .collect();
    assert_eq!(steps, ["5", "10", "15", "20"]);
    // samples/s in samples_per_s; no tokens_per_sample, so tokens_per_s stays empty
    for l in &lines[1..] {
        let cells: Vec<&str> = l.split(',').collect();
        assert!(cells[7].parse::<f64>().is_ok_and(|r| r > 0.0), "{l}");
        assert_eq!(cells[8], "", "{l}");
    }
    // the loss column is the mean over every micro-batch since the previous row
    let logged: Vec<f64> = lines[1..]
        .iter()
        .map(|l| l.split(',').nth(2).unwrap().parse().unwrap())
        .collect();
    let losses = losses.borrow();
    for (row, chunk) in logged.iter().zip(losses.chunks(10)) {
        let mean = chunk.iter().sum::<f64>() / chunk.len() as f64;
        assert!(
            (row - mean).abs() <= 1e-6 * mean,
            "logged {row}, micro-batch mean {mean}"
        );
    }
    let row10: Vec<&str> = lines[2].split(',').collect();
    assert_eq!(
        row10[3],
        format!("{}", 1.0 / 11.0),
        "val_loss of the step-10 evaluation"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("metrics.jsonl"))?
            .lines()
            .count(),
        4
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn early_stopping_after_patience_evaluations_without_improvement() -> anyhow::Result<()> {
    let (mut engine, l1, l2) = setup(1)?;
    let mut loader = DataLoader::new(dataset(64)?, LoaderConfig::new(16))?;
    let rule = EarlyStopping {
        monitor: "val_loss".into(),
        patience: 2,
        min_delta: 0.0,
        mode: Mode::Min,
    };
    let config = TrainerConfig {
        max_epochs: Some(100),
        early_stopping: Some(rule),
        progress: false,
        ..TrainerConfig::default()
    };
    let values = [1.0, 0.9, 0.95, 0.96, 0.5];
    let calls = RefCell::new(0usize);
    let summary = Trainer::new(config)?.fit(
        &mut engine,
        &mut loader,
        |_, b| {
            let (x, y) = b
                .pair()
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            loss::cross_entropy(&l2.forward(&l1.forward(&x)?)?, &y)
        },
        |_| {
            let i = *calls.borrow();
            *calls.borrow_mut() += 1;
            Ok(Metrics::from([("val_loss".to_string(), values[i])]))
        },
        Hooks::default(),
    )?;
    assert_eq!(summary.stop, StopReason::EarlyStopping);
    assert_eq!(
        *calls.borrow(),
        4,
        "best 0.9 at eval 2, then two evaluations without improvement"
    );
    assert_eq!(summary.best, Some(0.9));
    assert_eq!(summary.steps, 4 * 4, "4 epochs of 4 batches");
    Ok(())
}

#[test]
fn bad_configs_and_missing_metrics_are_errors() -> anyhow::Result<()> {
    assert!(Trainer::new(TrainerConfig {
        max_epochs: None,
        max_steps: None,
        ..TrainerConfig::default()
    })
    .is_err());
    assert!(Trainer::new(TrainerConfig {
        log_every: 0,
        ..TrainerConfig::default()
    })
    .is_err());
    let path = std::env::temp_dir().join(format!("wick-trainer-{}.toml", std::process::id()));
    std::fs::write(&path, "max_steps = 10\nmax_epochs = 3\nbogus = 1\n")?;
    let err = format!("{:#}", TrainerConfig::from_toml_file(&path).unwrap_err());
    assert!(err.contains("bogus"), "{err}");
    std::fs::write(&path, "max_steps = 10\nlog_every = 2\n[early_stopping]\nmonitor = \"val_acc\"\npatience = 3\nmode = \"max\"\n")?;
    let c = TrainerConfig::from_toml_file(&path)?;
    assert_eq!(
        (c.max_steps, c.log_every, c.early_stopping.unwrap().mode),
        (Some(10), 2, Mode::Max)
    );
    std::fs::remove_file(&path)?;
    // the monitored metric must exist
    let (mut engine, l1, l2) = setup(1)?;
    let mut loader = DataLoader::new(dataset(32)?, LoaderConfig::new(16))?;
    let rule = EarlyStopping {
        monitor: "val_acc".into(),
        patience: 1,
        min_delta: 0.0,
        mode: Mode::Max,
    };
    let config = TrainerConfig {
        early_stopping: Some(rule),
        progress: false,
        ..TrainerConfig::default()
    };
    let err = Trainer::new(config)?
        .fit(
            &mut engine,
            &mut loader,
            |_, b| {
                let (x, _) = b
                    .pair()
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                l2.forward(&l1.forward(&x)?)?.sqr()?.mean_all()
            },
            |_| Ok(Metrics::from([("val_loss".to_string(), 1.0)])),
            Hooks::default(),
        )
        .unwrap_err();
    assert!(format!("{err:#}").contains("val_acc"), "{err:#}");
    Ok(())
}

/// Throughput excludes evaluations and `after_step` hooks: with each evaluation and hook
/// sleeping, `train_time` is at most the wall time less the sleeps, and `tokens_per_s` is the
/// trained tokens (samples x `tokens_per_sample`) over `train_time`, the figure of the report.
#[test]
fn throughput_is_trained_tokens_over_the_steps_wall_clock() -> anyhow::Result<()> {
    use std::time::Duration;
    let (mut engine, l1, l2) = setup(1)?;
    let mut loader = DataLoader::new(dataset(64)?, LoaderConfig::new(8))?;
    let dir = std::env::temp_dir().join(format!("wick-trainer-tok-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut trainer = Trainer::new(TrainerConfig {
        max_epochs: None,
        max_steps: Some(4),
        eval_every: Some(2),
        log_every: 1,
        progress: false,
        tokens_per_sample: Some(5),
        out_dir: Some(dir.clone()),
        ..TrainerConfig::default()
    })?;
    let pause = Duration::from_millis(150);
    let (evals, hooks) = (RefCell::new(0u32), RefCell::new(0u32));
    let summary = trainer.fit(
        &mut engine,
        &mut loader,
        |_, b| {
            let (x, y) = b
                .pair()
                .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
            loss::cross_entropy(&l2.forward(&l1.forward(&x)?.relu()?)?, &y)
        },
        |_| {
            *evals.borrow_mut() += 1;
            std::thread::sleep(pause);
            Ok(Metrics::from([("val_loss".to_string(), 1.0)]))
        },
        Hooks {
            after_step: Some(Box::new(|_, _, _| {
                *hooks.borrow_mut() += 1;
                std::thread::sleep(pause);
                Ok(false)
            })),
        },
    )?;
    let (evals, hooks) = (*evals.borrow(), *hooks.borrow());
    assert_eq!(
        (summary.steps, summary.samples, evals, hooks),
        (4, 32, 2, 4)
    );
    let paused = pause * (evals + hooks);
    assert!(
        summary.train_time + paused <= summary.elapsed,
        "train {:?} + paused {paused:?} > elapsed {:?}",
        summary.train_time,
        summary.elapsed
    );
    let secs = summary.train_time.as_secs_f64();
    let want = 32.0 * 5.0 / secs;
    let got = summary.tokens_per_s().expect("tokens per sample set");
    assert!((got - want).abs() <= 1e-9 * want, "{got} vs {want}");
    assert!((summary.samples_per_s().unwrap() - 32.0 / secs).abs() <= 1e-9 * want);
    let report = summary.report();
    assert!(
        report.contains(&format!(
            "throughput: {want:.0} tokens/s (trained tokens / wall-clock s of steps 1-4; "
        )),
        "{report}"
    );
    // each metrics row: samples/s in samples_per_s, 5 tokens a sample in tokens_per_s
    let csv = std::fs::read_to_string(dir.join("metrics.csv"))?;
    for l in csv.lines().skip(1) {
        let cells: Vec<f64> = l.split(',').skip(7).map(|c| c.parse().unwrap()).collect();
        assert!(
            cells[0] > 0.0 && (cells[1] - 5.0 * cells[0]).abs() <= 1e-9 * cells[1],
            "{l}"
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
