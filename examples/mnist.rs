//! MNIST with wick: an MLP 784-1024-1024-10 trained through `Engine::step`.
//!
//! ```text
//! scripts/fetch_mnist.sh            # once: fetches and verifies the data into data/mnist
//! cargo run --release --example mnist -- --precision bf16-mixed --epochs 3
//! ```
//! Prints per-epoch train loss, test accuracy, samples/s and where the time went.

use anyhow::{Context, Result};
use candle_core::{DType, Device, IndexOp, Module, Tensor};
use clap::Parser;
use rand::{seq::SliceRandom, SeedableRng};
use std::time::Instant;
use wick::profile::PhaseTimes;
use wick::{loss, nn, Engine, EngineConfig, ParamStore, Precision};

#[derive(Parser, Debug)]
#[command(about = "Train an MLP on MNIST with wick")]
struct Args {
    /// Precision: "32", "bf16-mixed" or "16-mixed".
    #[arg(long, default_value = "bf16-mixed")]
    precision: Precision,
    /// Passes over the 60,000 training images.
    #[arg(long, default_value_t = 3)]
    epochs: usize,
    /// Samples per optimizer step (split into --accum micro-batches).
    #[arg(long, default_value_t = 128)]
    batch_size: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Micro-batches per optimizer step (gradient accumulation).
    #[arg(long, default_value_t = 1)]
    accum: usize,
    /// cpu or cuda (cuda needs a build with --features cuda).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Folder with the four MNIST idx files (scripts/fetch_mnist.sh fills data/mnist).
    #[arg(long, default_value = "data/mnist")]
    data_dir: String,
    /// Seed for initialisation and shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

struct Mlp {
    l1: nn::Linear,
    l2: nn::Linear,
    l3: nn::Linear,
}

impl Mlp {
    fn new(store: &ParamStore) -> Result<Self> {
        Ok(Self {
            l1: nn::Linear::new(store, "l1", 784, 1024, true)?,
            l2: nn::Linear::new(store, "l2", 1024, 1024, true)?,
            l3: nn::Linear::new(store, "l3", 1024, 10, true)?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.l1.forward(x)?.relu()?;
        let h = self.l2.forward(&h)?.relu()?;
        self.l3.forward(&h)
    }
}

fn device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Device::new_cuda(0)
            .context("--device cuda: no CUDA device (build with --features cuda on a GPU machine)"),
        other => anyhow::bail!("--device must be cpu or cuda, got {other:?}"),
    }
}

fn accuracy(model: &Mlp, images: &Tensor, labels: &Tensor, dev: &Device) -> Result<f64> {
    let n = images.dim(0)?;
    let mut correct = 0u64;
    for start in (0..n).step_by(1000) {
        let len = 1000.min(n - start);
        let x = images.narrow(0, start, len)?.to_device(dev)?;
        let y = labels.narrow(0, start, len)?.to_device(dev)?;
        let pred = model.forward(&x)?.detach().argmax(1)?;
        correct += pred
            .eq(&y)?
            .to_dtype(DType::U32)?
            .sum_all()?
            .to_scalar::<u32>()? as u64;
    }
    Ok(correct as f64 / n as f64)
}

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.accum >= 1 && args.batch_size >= args.accum,
        "--batch-size must be >= --accum >= 1"
    );
    let dev = device(&args.device)?;
    let data = wick::data::mnist::load_dir(&args.data_dir)?;
    let n_train = data.train_images.dim(0)?;

    let store = ParamStore::new(args.precision, dev.clone(), args.seed);
    let model = Mlp::new(&store)?;
    let mut config = EngineConfig::adamw(args.lr);
    config.accumulation_steps = args.accum;
    let mut engine = Engine::new(store.clone(), config)?;
    println!(
        "MLP 784-1024-1024-10 ({} parameters), {} on {:?}, batch {} = {} x {}, AdamW lr {}",
        store.num_elements(),
        args.precision,
        dev,
        args.batch_size,
        args.accum,
        args.batch_size / args.accum,
        args.lr
    );

    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let mut order: Vec<u32> = (0..n_train as u32).collect();
    let micro = args.batch_size / args.accum;
    let mut total_times = PhaseTimes::default();
    let mut total_steps = 0u64;
    for epoch in 1..=args.epochs {
        order.shuffle(&mut rng);
        let started = Instant::now();
        let mut times = PhaseTimes::default();
        let (mut loss_sum, mut loss_n, mut steps) = (0f64, 0usize, 0u64);
        for batch in order.chunks_exact(args.batch_size) {
            for mb in batch.chunks(micro) {
                let t = Instant::now();
                let idx = Tensor::new(mb, &Device::Cpu)?;
                let x = data.train_images.index_select(&idx, 0)?;
                let y = data.train_labels.index_select(&idx, 0)?;
                times.data += t.elapsed();
                let t = Instant::now();
                let (x, y) = (x.to_device(&dev)?, y.to_device(&dev)?);
                times.h2d += t.elapsed();
                let report = engine.step_weighted(mb.len() as f64, |_| {
                    loss::cross_entropy(&model.forward(&x)?, &y)
                })?;
                times.add(&report.times);
                loss_sum += report.loss()? as f64;
                loss_n += 1;
            }
            steps += 1;
        }
        let secs = started.elapsed().as_secs_f64();
        let acc = accuracy(&model, &data.test_images, &data.test_labels, &dev)?;
        let samples = steps as usize * args.batch_size;
        println!(
            "epoch {epoch}: train loss {:.4}  test accuracy {:.2}%  {:.0} samples/s  ({:.1} s)",
            loss_sum / loss_n as f64,
            100.0 * acc,
            samples as f64 / secs,
            secs
        );
        total_times.add(&times);
        total_steps += steps;
    }
    println!(
        "\nwhere the time went (per optimizer step, {} steps):",
        total_steps
    );
    print!("{}", total_times.table(total_steps));
    let _ = data.train_images.i(0)?; // data stays alive to the end
    Ok(())
}
