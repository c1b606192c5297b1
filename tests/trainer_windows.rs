//! The Trainer steps on an epoch's last, partial accumulation window (as Lightning does):
//! nothing stays pending at the end of an epoch or leaks into the next one.

use candle_core::{DType, Device, Module, Tensor};
use wick::checkpoint::Checkpointer;
use wick::data::{DataLoader, LoaderConfig, TensorDataset};
use wick::trainer::{steps_per_epoch, Hooks, Metrics, Trainer, TrainerConfig};
use wick::{loss, nn, Engine, EngineConfig, ParamStore, Precision};

const N: usize = 160; // 10 batches of 16
const BATCH: usize = 16;

fn data() -> anyhow::Result<(Tensor, Tensor)> {
    let x = Tensor::arange(0u32, (N * 4) as u32, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .reshape((N, 4))?
        .sin()?;
    let y = Tensor::from_vec((0..N as u32).map(|i| i % 3).collect(), N, &Device::Cpu)?;
    Ok((x, y))
}

fn model(accum: usize) -> anyhow::Result<(Engine, nn::Linear, nn::Linear)> {
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 7);
    let l1 = nn::Linear::new(&store, "l1", 4, 8, true)?;
    let l2 = nn::Linear::new(&store, "l2", 8, 3, true)?;
    let config = EngineConfig {
        accumulation_steps: accum,
        ..EngineConfig::sgd(0.1, 0.9)
    };
    Ok((Engine::new(store, config)?, l1, l2))
}

fn forward(
    l1: &nn::Linear,
    l2: &nn::Linear,
    x: &Tensor,
    y: &Tensor,
) -> candle_core::Result<Tensor> {
    loss::cross_entropy(&l2.forward(&l1.forward(x)?.relu()?)?, y)
}

#[test]
fn steps_per_epoch_counts_the_partial_window() {
    assert_eq!(steps_per_epoch(10, 4), 3);
    assert_eq!(steps_per_epoch(8, 4), 2);
    assert_eq!(steps_per_epoch(1, 4), 1);
    assert_eq!(steps_per_epoch(10, 1), 10);
}

/// 10 batches with accumulation 4, two epochs: 3 steps per epoch (4 + 4 + 2 micro-batches),
/// the same parameters as an independent run with one step per window on the concatenated
/// window (equal batch sizes: the mean over the window is the mean of the batch means), and
/// the engine at a boundary at the end, so a checkpoint can be written.
#[test]
fn the_last_partial_window_of_each_epoch_is_stepped_on() -> anyhow::Result<()> {
    let (x, y) = data()?;
    let (mut engine, l1, l2) = model(4)?;
    let mut loader = DataLoader::new(
        TensorDataset::new(vec![x.clone(), y.clone()])?,
        LoaderConfig::new(BATCH),
    )?;
    assert_eq!(loader.num_batches(), 10);
    let config = TrainerConfig {
        max_epochs: Some(2),
        log_every: 1,
        progress: false,
        ..TrainerConfig::default()
    };
    let summary = Trainer::new(config)?.fit(
        &mut engine,
        &mut loader,
        |_, b| {
            let (bx, by) = b
                .pair()
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            forward(&l1, &l2, &bx, &by)
        },
        |_| Ok(Metrics::new()),
        Hooks::default(),
    )?;
    assert_eq!(
        summary.steps, 6,
        "3 optimizer steps per epoch of 10 batches"
    );
    assert_eq!(engine.boundaries(), 6);
    let state = engine.state()?; // errors while micro-batches are pending
    assert_eq!(state.boundaries, 6);
    let dir = std::env::temp_dir().join(format!("wick-windows-{}", std::process::id()));
    let saved = Checkpointer::new(&dir, 1).save(&engine, serde_json::Value::Null)?;
    assert!(saved.ends_with("step-000006"));
    let _ = std::fs::remove_dir_all(&dir);

    // reference: accumulation 1, one step per window on the window's samples
    let (mut reference, r1, r2) = model(1)?;
    for _epoch in 0..2 {
        for (start, len) in [(0, 64), (64, 64), (128, 32)] {
            let (wx, wy) = (x.narrow(0, start, len)?, y.narrow(0, start, len)?);
            reference.step(|_| forward(&r1, &r2, &wx, &wy))?;
        }
    }
    assert_eq!(reference.boundaries(), 6);
    for (name, p) in engine.store().masters() {
        let q = reference
            .store()
            .masters()
            .into_iter()
            .find(|(n, _)| *n == name)
            .expect("same parameters")
            .1;
        let diff = (p - &q)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{name}: max |trainer - reference| = {diff}");
    }
    Ok(())
}
