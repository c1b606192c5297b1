//! MNIST with wick: an MLP 784-1024-1024-10 (or a small CNN) trained through the DataLoader,
//! the Trainer and Engine::step, with checkpoints that resume exactly.
//!
//! ```text
//! scripts/fetch_mnist.sh            # once: fetches and verifies the data into data/mnist
//! cargo run --release --example mnist -- --precision bf16-mixed --epochs 3
//! cargo run --release --example mnist -- --model cnn --epochs 2 --workers 2 --clip 1.0 \
//!     --schedule cosine:warmup=100,total=936,min_lr=1e-4 --save-dir runs/mnist-cnn \
//!     --metrics-dir runs/mnist-cnn/metrics
//! cargo run --release --example mnist -- --model cnn --epochs 3 --workers 2 --clip 1.0 \
//!     --schedule cosine:warmup=100,total=936,min_lr=1e-4 --save-dir runs/mnist-cnn \
//!     --metrics-dir runs/mnist-cnn/metrics --resume          # one more epoch from the latest
//! ```
//! Prints per-epoch train loss, test accuracy, samples/s and where the time went.

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, D};
use clap::Parser;
#[path = "common/mnist_net.rs"]
mod mnist_net;
use mnist_net::{Arch, Net};
use std::path::PathBuf;
use wick::checkpoint::{self, Checkpointer};
use wick::data::{DataLoader, LoaderConfig, LoaderState, TensorDataset};
use wick::optim::LrSchedule;
use wick::trainer::{Hooks, Metrics, Trainer, TrainerConfig};
use wick::{loss, Engine, EngineConfig, ParamStore, Precision};

#[derive(Parser, Debug)]
#[command(about = "Train an MLP or a CNN on MNIST with wick")]
struct Args {
    /// Precision: "32", "bf16-mixed" or "16-mixed".
    #[arg(long, default_value = "bf16-mixed")]
    precision: Precision,
    /// Model.
    #[arg(long, value_enum, default_value = "mlp")]
    model: Arch,
    /// Passes over the 60,000 training images (>= 1; a resumed run counts the epochs it already
    /// did).
    #[arg(long, default_value_t = 3, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    epochs: usize,
    /// Samples per optimizer step (>= 1, split into --accum micro-batches).
    #[arg(long, default_value_t = 128, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    batch_size: usize,
    /// AdamW base learning rate (> 0).
    #[arg(long, default_value_t = 1e-3, allow_negative_numbers = true, value_parser = wick::cli::positive_f64)]
    lr: f64,
    /// Micro-batches per optimizer step (>= 1, gradient accumulation).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    accum: usize,
    /// Learning-rate schedule: "constant", "cosine:warmup=N,total=N,min_lr=X",
    /// "step:size=N,gamma=X" or "linear:warmup=N,total=N,end_lr=X".
    #[arg(long, default_value = "constant")]
    schedule: String,
    /// Clip the global gradient L2 norm to this value (> 0; leave out to train without
    /// clipping).
    #[arg(long, allow_negative_numbers = true, value_parser = wick::cli::positive_f64)]
    clip: Option<f64>,
    /// DataLoader worker threads (0: load in the training thread).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = wick::cli::non_negative_usize)]
    workers: usize,
    /// cpu or cuda (cuda needs a build with --features cuda).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Folder with the four MNIST idx files (scripts/fetch_mnist.sh fills data/mnist).
    #[arg(long, default_value = "data/mnist")]
    data_dir: PathBuf,
    /// Save a checkpoint here at the end of every epoch and on Ctrl-C (e.g. runs/mnist, under
    /// the git-ignored runs/).
    #[arg(long)]
    save_dir: Option<PathBuf>,
    /// Resume from the latest checkpoint in --save-dir (an error when there is none: drop
    /// --resume to start fresh). Pass the model and precision flags of the original run.
    #[arg(long, requires = "save_dir")]
    resume: bool,
    /// Keep the newest N checkpoints in --save-dir and delete older ones (0: keep all).
    #[arg(long, default_value_t = 3, allow_negative_numbers = true, value_parser = wick::cli::non_negative_usize)]
    keep_last: usize,
    /// Write metrics.csv / metrics.jsonl (appended to when resuming), phases.csv, loss.png and
    /// phases.png here.
    #[arg(long)]
    metrics_dir: Option<PathBuf>,
    /// A TOML file with Trainer settings; the flags above override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Seed for initialisation and shuffling.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    seed: u64,
}

/// Test-set loss and accuracy, in batches of 1000.
fn evaluate(net: &Net, images: &Tensor, labels: &Tensor, dev: &Device) -> Result<Metrics> {
    let n = images.dim(0)?;
    let (mut correct, mut loss_sum) = (0u64, 0f64);
    for start in (0..n).step_by(1000) {
        let len = 1000.min(n - start);
        let x = images.narrow(0, start, len)?.to_device(dev)?;
        let y = labels.narrow(0, start, len)?.to_device(dev)?;
        let logits = net.forward(&x)?.detach();
        loss_sum += loss::cross_entropy(&logits, &y)?.to_scalar::<f32>()? as f64 * len as f64;
        let pred = logits.argmax(D::Minus1)?;
        correct += pred
            .eq(&y)?
            .to_dtype(DType::U32)?
            .sum_all()?
            .to_scalar::<u32>()? as u64;
    }
    Ok(Metrics::from([
        ("val_loss".to_string(), loss_sum / n as f64),
        ("test_accuracy".to_string(), correct as f64 / n as f64),
    ]))
}

fn main() -> Result<()> {
    // wick reports through `tracing` (checkpoint warnings, e.g. a precision that differs from
    // the checkpoint's): show warnings and errors on stderr
    wick::cli::init_logging();
    let args = Args::parse();
    anyhow::ensure!(
        args.batch_size % args.accum == 0,
        "--batch-size ({}) must be a multiple of --accum ({})",
        args.batch_size,
        args.accum
    );
    let dev = wick::device_from_flag(&args.device)?;
    let data = wick::data::mnist::load_dir(&args.data_dir)?;

    let store = ParamStore::new(args.precision, dev.clone(), args.seed);
    let net = Net::new(args.model, 1024, &store)?;
    let mut config = EngineConfig::adamw(args.lr);
    config.accumulation_steps = args.accum;
    config.max_grad_norm = args.clip;
    config.schedule = LrSchedule::parse(&args.schedule, args.lr)?;
    let mut engine = Engine::new(store.clone(), config)?;

    let micro = args.batch_size / args.accum;
    let loader_cfg = LoaderConfig::new(micro)
        .with_shuffle(args.seed)
        .with_drop_last(true)
        .with_workers(args.workers)
        .with_device(dev.clone());
    let train = TensorDataset::new(vec![data.train_images.clone(), data.train_labels.clone()])?;
    let mut loader = DataLoader::new(train, loader_cfg)?;

    let ckpt = args
        .save_dir
        .as_ref()
        .map(|d| Checkpointer::new(d, args.keep_last));
    if let (true, Some(c)) = (args.resume, &ckpt) {
        let resumed = c
            .resume_existing_with_loader(&mut engine, &mut loader)
            .context("--resume")?;
        println!("resumed from {resumed} at step {}", engine.boundaries());
    }
    if ckpt.is_some() {
        checkpoint::install_interrupt_handler()?;
    }

    let mut tc = match &args.config {
        Some(p) => TrainerConfig::from_toml_file(p)?,
        None => TrainerConfig::default(),
    };
    tc.max_epochs = Some(args.epochs as u64);
    tc.out_dir = args.metrics_dir.clone().or(tc.out_dir);
    let mut trainer = Trainer::new(tc)?;
    println!(
        "{:?} ({} parameters), {}, batch {} = {} x {}, AdamW lr {} ({}), clip {}, {} workers",
        args.model,
        store.num_elements(),
        wick::perf::precision_on_device(args.precision, &dev),
        args.batch_size,
        args.accum,
        micro,
        args.lr,
        args.schedule,
        args.clip.map_or("off".to_string(), |c| c.to_string()),
        args.workers
    );

    let num_batches = loader.num_batches();
    let hooks = Hooks {
        after_step: Some(Box::new(|engine: &mut Engine, _r, pos: &LoaderState| {
            let Some(c) = &ckpt else { return Ok(false) };
            // the loader's position after the epoch's last batch (the trainer steps on an
            // epoch's last window even when it is partial, so this is always a boundary)
            let end_of_epoch = pos.batch >= num_batches;
            if end_of_epoch || checkpoint::interrupted() {
                let path = c.save_with_loader(engine, pos, serde_json::Value::Null)?;
                if checkpoint::interrupted() {
                    println!("interrupted: saved {}", path.display());
                    return Ok(true);
                }
            }
            Ok(false)
        })),
    };
    let (images, labels) = (data.test_images.clone(), data.test_labels.clone());
    let summary = trainer.fit(
        &mut engine,
        &mut loader,
        |_, batch| {
            let (x, y) = batch
                .pair()
                .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
            loss::cross_entropy(&net.forward(&x)?, &y)
        },
        |_| evaluate(&net, &images, &labels, &dev),
        hooks,
    )?;
    trainer.write_plots(&summary)?;
    println!("\n{}", summary.report());
    if let Some(code) = checkpoint::interrupted_exit_code() {
        std::process::exit(code); // saved above; 130 as after any Ctrl-C
    }
    Ok(())
}
