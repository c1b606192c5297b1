//! A byte-level GPT on Shakespeare with wick: the "gptmini" model of
//! `scripts/reference/torch_reference.py` (`wick::models::gpt`), trained exactly as the
//! reference's `train-char` — AdamW (lr 1e-3, betas 0.9/0.99, eps 1e-8, weight decay 0.1 on
//! rank >= 2), 100 warmup steps then cosine to 1e-4, clip 1.0, batch 64 of 256-byte windows,
//! 90/10 train/validation split by position — through the DataLoader, the Trainer and
//! Engine::step, with checkpoints that resume exactly and text generation from a checkpoint.
//!
//! `--optimizer muon` trains the blocks' matrices with Muon instead (`torch.optim.Muon`'s
//! algorithm; AdamW for the rest), beside `scripts/reference/torch_muon_char.py`
//! (`scripts/muon_timing.sh` runs both on a GPU).
//!
//! ```text
//! scripts/fetch_shakespeare.sh         # once: data/shakespeare/input.txt (5.0 MB, verified)
//! cargo run --release --features cuda --example char_gpt -- --device cuda --steps 3000
//! cargo run --release --example char_gpt -- --layers 2 --d-model 64 --context 64 --steps 50 \
//!     --batch-size 16 --warmup 10 --eval-interval 10 --eval-batches 4       # a CPU smoke run
//! cargo run --release --example char_gpt -- --save-dir runs/gpt --resume  # continue (same flags)
//! cargo run --release --example char_gpt -- --save-dir runs/gpt --sample --prompt "ROMEO:"
//! ```
//! Prints the train and validation loss at every evaluation (both on fixed batches, as
//! nanoGPT's `estimate_loss`; step 0 included), the Trainer's end report (phases, tokens/s, MFU
//! on a known GPU, peak memory) and, on its last line, one JSON object shaped like
//! `train-char`'s: its `ms_per_step` and `tokens_per_s` share one basis, the wall clock of the
//! training steps (evaluations and checkpoint saves excluded; `tokens_per_s_basis` says so),
//! `phase_ms_per_step` is the report's `step` row (the summed training phases), and
//! `wall_ms_per_step` the loop's wall clock per step with evaluations included.

use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Tensor};
use clap::Parser;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::path::PathBuf;
use std::time::Instant;
use wick::checkpoint::{self, Checkpointer};
use wick::data::{DataLoader, Dataset, LoaderConfig, LoaderState, TextWindows};
use wick::engine::OptimizerConfig;
use wick::models::gpt::{reference_adamw, reference_schedule};
use wick::models::{Gpt, GptConfig};
use wick::optim::groups::EMBEDDINGS_AND_HEAD;
use wick::optim::{MuonConfig, ParamGroups};
use wick::perf::PerfSettings;
use wick::trainer::{Hooks, Metrics, Trainer, TrainerConfig};
use wick::{Engine, EngineConfig, ParamStore, Precision};

#[derive(Parser, Debug)]
#[command(about = "Train a byte-level GPT on Shakespeare with wick, or sample from a checkpoint")]
struct Args {
    /// Model: "gptmini" (the reference's char model) or "gpt2_124m" (same code, GPT-2 small).
    #[arg(long, default_value = "gptmini")]
    model: GptConfig,
    /// Override the number of layers (for small smoke runs).
    #[arg(long, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    layers: Option<usize>,
    /// Override the number of attention heads.
    #[arg(long, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    heads: Option<usize>,
    /// Override d_model (with --heads, or the model's heads when they divide it, else 1 head
    /// per 64 dimensions).
    #[arg(long, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    d_model: Option<usize>,
    /// Override the context length (window size in bytes).
    #[arg(long, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    context: Option<usize>,
    /// Precision: "32", "bf16-mixed" or "16-mixed".
    #[arg(long, default_value = "bf16-mixed")]
    precision: Precision,
    /// Optimizer steps (>= 1; the cosine schedule ends here).
    #[arg(long, default_value_t = 3000, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    steps: usize,
    /// Sequences per optimizer step (split into --accum micro-batches); default: the
    /// reference's (64 for gptmini, 16 for gpt2_124m).
    #[arg(long, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    batch_size: Option<usize>,
    /// Micro-batches per optimizer step (gradient accumulation).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    accum: usize,
    /// Evaluate every N optimizer steps (and at step 0 and at the end).
    #[arg(long, default_value_t = 250, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    eval_interval: usize,
    /// Batches per evaluation, for each of train and validation (fixed, seeded windows).
    #[arg(long, default_value_t = 20, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    eval_batches: usize,
    /// Peak learning rate (> 0).
    #[arg(long, default_value_t = 1e-3, allow_negative_numbers = true, value_parser = wick::cli::positive_f64)]
    lr: f64,
    /// "adamw" (the reference's) or "muon": torch.optim.Muon's algorithm for the hidden
    /// layers' 2-D weights (momentum 0.95, Nesterov, 5 Newton–Schulz steps, weight decay 0.1)
    /// and the reference's AdamW for the embeddings (the tied head), LayerNorms and biases
    /// (`scripts/reference/torch_muon_char.py` is the PyTorch side).
    #[arg(long, default_value = "adamw", value_parser = ["adamw", "muon"])]
    optimizer: String,
    /// --optimizer muon: the Muon group's rate as a multiple of the schedule's.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = wick::cli::positive_f64)]
    muon_lr_scale: f64,
    /// --optimizer muon: the shape-based rate adjustment, "original" (lr sqrt(max(1, A/B)))
    /// (PyTorch's default; with --muon-lr-scale 20, Muon's usual peak rate 0.02) or
    /// "match_rms_adamw" (lr 0.2 sqrt(max(A, B)), which lets Muon share AdamW's rate).
    #[arg(long, default_value = "original")]
    muon_adjust_lr: wick::optim::AdjustLr,
    /// Final learning rate of the cosine (>= 0, at most --lr).
    #[arg(long, default_value_t = 1e-4, allow_negative_numbers = true, value_parser = wick::cli::non_negative_f64)]
    min_lr: f64,
    /// Linear warmup steps (at most --steps).
    #[arg(long, default_value_t = 100, allow_negative_numbers = true, value_parser = wick::cli::non_negative_usize)]
    warmup: usize,
    /// Clip the global gradient L2 norm to this value (0: no clipping).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = wick::cli::non_negative_f64)]
    clip: f64,
    /// The text file (scripts/fetch_shakespeare.sh writes data/shakespeare/input.txt).
    #[arg(long, default_value = "data/shakespeare/input.txt")]
    text: PathBuf,
    /// cpu or cuda (cuda needs a build with --features cuda).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// DataLoader worker threads (0: build batches in the training thread).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = wick::cli::non_negative_usize)]
    workers: usize,
    /// Allow TF32 tensor-core math for f32 matmuls on CUDA (precision "32").
    #[arg(long)]
    tf32: bool,
    /// Save checkpoints here (every --save-interval steps, at the end, and on Ctrl-C), e.g.
    /// runs/gpt under the git-ignored runs/.
    #[arg(long)]
    save_dir: Option<PathBuf>,
    /// Save every N steps (default: --eval-interval).
    #[arg(long, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    save_interval: Option<usize>,
    /// Keep the newest N checkpoints in --save-dir and delete older ones (0: keep all).
    #[arg(long, default_value_t = 3, allow_negative_numbers = true, value_parser = wick::cli::non_negative_usize)]
    keep_last: usize,
    /// Resume from the latest checkpoint in --save-dir (an error when there is none: drop
    /// --resume to start fresh). Pass the model and precision flags of the original run.
    #[arg(long, requires = "save_dir")]
    resume: bool,
    /// Write metrics.csv / metrics.jsonl (appended to when resuming) and the Trainer's plots
    /// here.
    #[arg(long)]
    metrics_dir: Option<PathBuf>,
    /// Log (read the loss back, update the progress bar) every N steps.
    #[arg(long, default_value_t = 10, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    log_interval: usize,
    /// Generate text from the latest checkpoint in --save-dir instead of training.
    #[arg(long, requires = "save_dir")]
    sample: bool,
    /// The prompt for --sample (and for the sample printed after training).
    #[arg(long, default_value = "ROMEO:")]
    prompt: String,
    /// Sampling temperature (>= 0; 0: greedy).
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true, value_parser = wick::cli::non_negative_f64)]
    temperature: f64,
    /// Bytes to generate with --sample (>= 1).
    #[arg(long, default_value_t = 500, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    max_new_tokens: usize,
    /// Bytes to generate after training (0: none).
    #[arg(long, default_value_t = 300, allow_negative_numbers = true, value_parser = wick::cli::non_negative_usize)]
    final_sample: usize,
    /// Seed for initialisation, shuffling, evaluation windows and sampling.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    seed: u64,
}

/// The model shape: the named configuration with the overrides applied.
fn model_config(args: &Args) -> Result<GptConfig> {
    let mut c = args.model;
    if let Some(l) = args.layers {
        c.n_layer = l;
    }
    if let Some(t) = args.context {
        c.context_len = t;
    }
    if let Some(d) = args.d_model {
        c.d_model = d;
        if args.heads.is_none() && d % c.n_head != 0 {
            c.n_head = (d / 64).max(1);
        }
    }
    if let Some(h) = args.heads {
        c.n_head = h;
    }
    c.validate()?;
    Ok(c)
}

/// Fixed evaluation batches: `n` batches of `batch` windows drawn with a seeded generator
/// (the same windows at every evaluation), moved to `dev`.
fn eval_batches(
    w: &TextWindows,
    n: usize,
    batch: usize,
    seed: u64,
    dev: &Device,
) -> Result<Vec<(Tensor, Tensor)>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let t = w.context_len();
    (0..n)
        .map(|_| {
            let (mut xs, mut ys) = (Vec::with_capacity(batch * t), Vec::with_capacity(batch * t));
            for _ in 0..batch {
                let (x, y) = w.window(rng.random_range(0..w.len()))?;
                xs.extend(x);
                ys.extend(y);
            }
            Ok((
                Tensor::from_vec(xs, (batch, t), dev)?,
                Tensor::from_vec(ys, (batch, t), dev)?,
            ))
        })
        .collect()
}

/// Mean loss over `batches`.
fn mean_loss(gpt: &Gpt, batches: &[(Tensor, Tensor)]) -> Result<f64> {
    let mut sum = 0.0;
    for (x, y) in batches {
        sum += gpt.loss(x, y)?.to_scalar::<f32>()? as f64;
    }
    Ok(sum / batches.len().max(1) as f64)
}

/// `--sample`: generate from the latest checkpoint in `dir`.
fn sample(args: &Args, dir: &PathBuf, dev: &Device) -> Result<()> {
    let Some(path) = checkpoint::latest(dir)? else {
        bail!(
            "no checkpoint in {}: train first with --save-dir {}",
            dir.display(),
            dir.display()
        );
    };
    let state = checkpoint::read_state(&path)?;
    let config: GptConfig = match state.extra.get("model") {
        Some(m) => serde_json::from_value(m.clone()).with_context(|| {
            format!("{}: the \"model\" entry is not a GptConfig", path.display())
        })?,
        None => model_config(args)?,
    };
    let store = ParamStore::new(args.precision, dev.clone(), args.seed);
    let gpt = Gpt::new(&store, config)?;
    let file = path.join(checkpoint::MODEL_FILE);
    let tensors = candle_core::safetensors::load(&file, dev)
        .with_context(|| format!("reading {}", file.display()))?;
    store.load_masters(&tensors)?;
    println!(
        "{} (step {}, {config}), {}, temperature {}:\n",
        path.display(),
        state.step,
        args.precision,
        args.temperature
    );
    print_sample(
        &gpt,
        &args.prompt,
        args.max_new_tokens,
        args.temperature,
        args.seed,
    )
}

fn print_sample(gpt: &Gpt, prompt: &str, n: usize, temperature: f64, seed: u64) -> Result<()> {
    let ids: Vec<u32> = prompt.bytes().map(u32::from).collect();
    let out = gpt.generate(&ids, n, temperature, seed)?;
    let mut bytes = prompt.as_bytes().to_vec();
    // ids are bytes when the vocabulary is 256; larger ids cannot be printed as text
    bytes.extend(out.iter().map(|&id| u8::try_from(id).unwrap_or(b'?')));
    println!("{}", String::from_utf8_lossy(&bytes));
    Ok(())
}

fn main() -> Result<()> {
    // wick reports through `tracing` (checkpoint warnings, e.g. a precision that differs from
    // the checkpoint's): show warnings and errors on stderr
    wick::cli::init_logging();
    let args = Args::parse();
    let dev = wick::device_from_flag(&args.device)?;
    let perf = PerfSettings {
        seed: args.seed,
        tf32: args.tf32,
        ..PerfSettings::default()
    };
    perf.apply(&dev)?;
    if args.sample {
        let dir = args.save_dir.clone().context("--sample needs --save-dir")?;
        return sample(&args, &dir, &dev);
    }
    let config = model_config(&args)?;
    let batch = args
        .batch_size
        .unwrap_or_else(|| config.reference_batch_size());
    ensure!(
        batch % args.accum == 0,
        "--batch-size ({batch}) must be a multiple of --accum ({})",
        args.accum
    );
    ensure!(
        args.min_lr <= args.lr,
        "--min-lr ({}) must be at most --lr ({})",
        args.min_lr,
        args.lr
    );
    ensure!(
        args.warmup <= args.steps,
        "--warmup ({}) is longer than --steps ({}); lower --warmup",
        args.warmup,
        args.steps
    );
    let micro = batch / args.accum;
    let t = config.context_len;

    // data: 90/10 split by position, windows of T bytes at every offset
    if !args.text.exists() {
        bail!(
            "text file {} does not exist; scripts/fetch_shakespeare.sh writes \
             data/shakespeare/input.txt, or pass your own file with --text FILE",
            args.text.display()
        );
    }
    // the loader's own errors (e.g. a file shorter than one window) name the file and the fix
    let text = TextWindows::from_file(&args.text, t).with_context(|| {
        format!(
            "--text {} with --context {t}: every training window needs {} bytes",
            args.text.display(),
            t + 1
        )
    })?;
    let (train, val) = text.split(0.9)?;
    let train_eval = eval_batches(&train, args.eval_batches, micro, args.seed ^ 0x7472, &dev)?;
    let val_eval = eval_batches(&val, args.eval_batches, micro, 1234, &dev)?;

    // model and engine
    let store = ParamStore::new(args.precision, dev.clone(), args.seed);
    let gpt = Gpt::new(&store, config)?;
    let params = store.num_elements();
    let mut ec = EngineConfig::adamw(args.lr);
    let adamw = wick::optim::AdamWConfig {
        lr: args.lr,
        ..reference_adamw()
    };
    ec.optimizer = match args.optimizer.as_str() {
        "muon" => {
            let muon = MuonConfig {
                lr: args.lr,
                weight_decay: 0.1,
                adjust_lr: args.muon_adjust_lr,
                ..MuonConfig::default()
            };
            let groups = ParamGroups::muon_with_adamw(muon, adamw, EMBEDDINGS_AND_HEAD)
                .with_lr_scale("muon", args.muon_lr_scale)?;
            OptimizerConfig::Groups(groups)
        }
        _ => OptimizerConfig::AdamW(adamw),
    };
    let (steps, warmup) = (args.steps as u64, args.warmup as u64);
    ec.schedule = reference_schedule(args.lr, args.min_lr, warmup, steps);
    ec.max_grad_norm = (args.clip > 0.0).then_some(args.clip);
    ec.accumulation_steps = args.accum;
    let mut engine = Engine::new(store.clone(), ec)?;

    let loader_cfg = LoaderConfig::new(micro)
        .with_shuffle(args.seed)
        .with_drop_last(true)
        .with_workers(args.workers)
        .with_device(dev.clone());
    let mut loader = DataLoader::new(train.clone(), loader_cfg)?;

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

    println!(
        "GPT {config} ({params} parameters), {}; batch {batch} = {} x {micro} sequences of {t} bytes",
        wick::perf::precision_on_device(args.precision, &dev),
        args.accum
    );
    if args.optimizer == "muon" {
        println!(
            "Muon (momentum 0.95, Nesterov, 5 Newton–Schulz steps, wd 0.1, {:?} rate x {}) for \
             the blocks' matrices; AdamW below for the embeddings, LayerNorms and biases",
            args.muon_adjust_lr, args.muon_lr_scale
        );
    }
    println!(
        "AdamW lr {} (warmup {}, cosine to {} at step {}), betas 0.9/0.99, wd 0.1 on rank >= 2, clip {}; \
         {} train / {} val bytes of {}",
        args.lr,
        args.warmup,
        args.min_lr,
        args.steps,
        args.clip,
        train.bytes().len(),
        val.bytes().len(),
        args.text.display()
    );
    println!("{}", perf.header());

    let tokens_per_step = batch * t;
    let tc = TrainerConfig {
        max_epochs: None,
        max_steps: Some(steps),
        eval_every: Some(args.eval_interval as u64),
        // the untrained model's losses: the first point of the curve, in metrics.csv too
        eval_at_start: true,
        log_every: args.log_interval as u64,
        out_dir: args.metrics_dir.clone(),
        tokens_per_sample: Some(t),
        flops_per_step: Some(6.0 * params as f64 * tokens_per_step as f64),
        ..TrainerConfig::default()
    };
    let mut trainer = Trainer::new(tc)?;

    let started = Instant::now();
    let mut curve: Vec<(u64, f64)> = Vec::new();
    let evaluate = |step: u64, curve: &mut Vec<(u64, f64)>| -> Result<Metrics> {
        let (tr, va) = (mean_loss(&gpt, &train_eval)?, mean_loss(&gpt, &val_eval)?);
        println!(
            "step {step:>6}: train loss {tr:.4}  val loss {va:.4}  ({:.1} s)",
            started.elapsed().as_secs_f64()
        );
        curve.push((step, (va * 1e4).round() / 1e4));
        Ok(Metrics::from([
            ("train_loss".to_string(), tr),
            ("val_loss".to_string(), va),
        ]))
    };
    let save_every = args.save_interval.unwrap_or(args.eval_interval) as u64;
    let hooks = Hooks {
        after_step: Some(Box::new(|engine: &mut Engine, _r, pos: &LoaderState| {
            let Some(c) = &ckpt else { return Ok(false) };
            let step = engine.boundaries();
            if step % save_every == 0 || step >= steps || checkpoint::interrupted() {
                let extra = serde_json::json!({ "model": config });
                let path = c.save_with_loader(engine, pos, extra)?;
                if checkpoint::interrupted() {
                    println!("interrupted: saved {}", path.display());
                    return Ok(true);
                }
            }
            Ok(false)
        })),
    };
    let summary = trainer.fit(
        &mut engine,
        &mut loader,
        |_, b| {
            let (x, y) = b
                .pair()
                .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
            gpt.loss(&x, &y)
        },
        |e| evaluate(e.boundaries(), &mut curve),
        hooks,
    )?;
    let last = engine.boundaries();
    if curve.last().map(|c| c.0) != Some(last) {
        evaluate(last, &mut curve)?;
    }
    trainer.write_plots(&summary)?;
    println!("\n{}", summary.report());
    if args.final_sample > 0 {
        println!("\nsample (temperature {}):", args.temperature);
        print_sample(
            &gpt,
            &args.prompt,
            args.final_sample,
            args.temperature,
            args.seed,
        )?;
    }
    let throughput = summary.throughput();
    let mut json = serde_json::json!({
        "model": config,
        "precision": args.precision.to_string(),
        "optimizer": args.optimizer,
        "text_bytes": text.bytes().len(),
        "steps": last,
        "batch": batch,
        "val_curve": curve,
        "final_val_loss": curve.last().map(|c| c.1),
        "train_s": summary.elapsed.as_secs_f64(),
        // wall clock of the training steps per step: the basis of tokens_per_s
        "ms_per_step": throughput.as_ref().map(|t| t.secs * 1e3 / summary.steps as f64),
        // the phase table's `step` row (data + h2d + forward + backward + optimizer)
        "phase_ms_per_step": summary.step_ms(),
        // wall clock of the training loop per step, evaluations and logging included
        "wall_ms_per_step": summary.wall_ms_per_step(),
        "wick": env!("CARGO_PKG_VERSION"),
    });
    // tokens_per_s and tokens_per_s_basis: the report's throughput line
    if let (Some(t), Some(m)) = (throughput, json.as_object_mut()) {
        m.extend(t.json().as_object().cloned().unwrap_or_default());
    }
    println!("{json}");
    if let Some(code) = checkpoint::interrupted_exit_code() {
        std::process::exit(code); // saved in the hook; 130 as after any Ctrl-C
    }
    Ok(())
}
