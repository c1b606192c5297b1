//! `wick finetune --config run.toml`: chat fine-tuning as TRL's `SFTTrainer`, torchtune or
//! Axolotl users expect it, driven by one TOML file ([`config::FinetuneConfig`];
//! docs/finetune.md lists every key, examples/configs/ has examples).
//!
//! A run ([`run`]):
//! 1. reads and checks the config (an unknown key, a missing table or a bad value is an error
//!    naming the key and the file), and with `resume` the checkpoint's record of its run
//!    ([`resume`]), before anything is loaded;
//! 2. reads the model's config, tokenizer and chat template ([`model`]), then the
//!    conversations: JSONL files or the Shakespeare dialogues, the held-out split, the chat
//!    template with labels on the assistant's tokens, the length policy ([`data`]);
//! 3. plans every optimizer step: each epoch's seeded order, packed into micro-batches of a
//!    token budget (or padded batches), `accumulation_steps` per step ([`plan`],
//!    [`batches`]);
//! 4. trains ([`train`]): AdamW with a warmup and a linear, cosine or constant schedule,
//!    gradient clipping, mixed precision, micro-batches weighted by their trained tokens; a
//!    progress bar, `metrics.csv`/`metrics.jsonl` as the [`crate::trainer`] writes them
//!    ([`crate::trainer::MetricsFiles`]), the evaluation loss on the held-out conversations
//!    ([`eval`]), checkpoints every N steps and on Ctrl-C (a resumed run's steps equal an
//!    uninterrupted run's bit for bit on the CPU, LoRA dropout 0);
//! 5. writes `loss.png`, `phases.csv` and `phases.png` (as the Trainer does), the LoRA
//!    adapter as PEFT's folder and the merged model as an HF folder ([`save`]), and prints a
//!    `RESULT {json}` line.
//!
//! [`model`], [`save`] and [`resume`] are shared with `examples/finetune.rs` (raw-text
//! fine-tuning).

pub mod batches;
pub mod config;
pub mod data;
pub mod eval;
pub mod model;
pub mod plan;
pub mod resume;
pub mod save;
pub mod train;

use crate::checkpoint::{self, Checkpointer};
use crate::models::{Decoder, FineTune, Source};
use crate::optim::LrSchedule;
use crate::{Engine, EngineConfig, ParamStore};
use anyhow::{bail, ensure, Context, Result};
use batches::Grouping;
use config::{FinetuneConfig, LrScheduler, Method, Resume};
use model::{ModelSpec, Weights};
use std::path::{Path, PathBuf};

/// Command-line settings that override the file's.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// `--device`: the file's `device`.
    pub device: Option<String>,
    /// `--resume`: `resume = true`.
    pub resume: bool,
}

/// How [`run`] ended.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// Trained every step and saved what the config asked for; the `RESULT` JSON.
    Finished(serde_json::Value),
    /// Stopped by Ctrl-C (or SIGTERM) after saving this checkpoint: exit with
    /// [`checkpoint::INTERRUPTED_EXIT_CODE`].
    Interrupted(PathBuf),
}

/// The model a config names.
pub fn model_spec(c: &FinetuneConfig) -> Result<ModelSpec> {
    let source =
        Source::from_args(c.model.gguf.as_deref(), c.model.hf.as_deref()).context("[model]")?;
    let weights = match (c.model.tiny, c.model.random_weights) {
        (true, _) => Weights::Tiny,
        (_, true) => Weights::Random,
        _ => Weights::Pretrained,
    };
    Ok(ModelSpec { source, weights })
}

/// How the config groups examples into micro-batches (after
/// [`FinetuneConfig::fit_to_model`]).
pub fn grouping(c: &FinetuneConfig) -> Grouping {
    if c.batch.packing {
        Grouping::Packed {
            budget: c.batch.tokens_per_batch.unwrap_or(8 * c.max_length()),
        }
    } else {
        Grouping::Padded {
            batch_size: c.batch.batch_size.unwrap_or(8),
        }
    }
}

/// The optimizer steps of a run over training examples of `lengths` tokens (after
/// [`FinetuneConfig::fit_to_model`]): [`plan::plan`] with the config's grouping, accumulation
/// and seed, for `schedule.max_steps` steps or else `schedule.epochs` epochs.
///
/// Errors: as [`plan::plan`] (an example longer than the packing budget).
pub fn steps(c: &FinetuneConfig, lengths: &[usize]) -> Result<Vec<plan::Step>> {
    let length = match c.schedule.max_steps {
        Some(s) => plan::Length::Steps(s),
        None => plan::Length::Epochs(c.schedule.epochs.unwrap_or(1)),
    };
    let accumulation = c.batch.accumulation_steps;
    plan::plan(lengths, grouping(c), accumulation, c.schedule.seed, length)
}

/// The learning-rate schedule of a run of `total` steps.
///
/// Errors: `schedule.warmup_steps` beyond `total`.
pub fn lr_schedule(c: &FinetuneConfig, total: u64) -> Result<LrSchedule> {
    let (lr, warmup) = (c.learning_rate(), c.schedule.warmup_steps);
    ensure!(
        warmup <= total,
        "schedule.warmup_steps ({warmup}) exceeds the run's {total} steps"
    );
    Ok(match c.schedule.lr_scheduler {
        LrScheduler::Linear => LrSchedule::LinearDecay {
            lr,
            end_lr: 0.0,
            warmup,
            total,
        },
        LrScheduler::Cosine => LrSchedule::WarmupCosine {
            lr,
            min_lr: 0.0,
            warmup,
            total,
        },
        LrScheduler::Constant if warmup == 0 => LrSchedule::Constant { lr },
        LrScheduler::Constant => LrSchedule::LinearDecay {
            lr,
            end_lr: lr,
            warmup,
            total,
        },
    })
}

/// The checkpoint a config's `resume` names, checked against the run before anything is
/// loaded; `None` for a fresh run.
///
/// Errors: `resume = true` without a checkpoint; a checkpoint of a different run (each key
/// named with both values).
fn prior(c: &FinetuneConfig, ckpt: &Checkpointer) -> Result<Option<resume::Prior>> {
    let path = match &c.resume {
        Resume::Flag(false) => return Ok(None),
        Resume::Flag(true) => match ckpt.latest()? {
            Some(p) => p,
            None => bail!(
                "resume: nothing to resume, no checkpoint in {} (set resume = false to start \
                 fresh, or save.dir to the run's folder)",
                ckpt.dir().display()
            ),
        },
        Resume::Path(p) => p.clone(),
    };
    let fix = "resume with the original run's config (a larger schedule.epochs or \
               schedule.max_steps may train further), or start fresh in another save.dir";
    resume::check_prior(&path, &c.fingerprint(), None, fix)
        .context("resume")
        .map(Some)
}

/// Runs the fine-tuning the file at `config_path` describes (see the module docs), printing
/// its progress on stdout.
///
/// Errors: a bad config (naming the key and the file), a model or data file that cannot be
/// read (naming it), a checkpoint of another run, a failing step, a file that cannot be
/// written.
pub fn run(config_path: &Path, overrides: &Overrides) -> Result<Outcome> {
    let mut c = FinetuneConfig::from_toml_file(config_path)?;
    if let Some(d) = &overrides.device {
        c.device = d.clone();
        c.validate().context("--device")?;
    }
    if overrides.resume && c.resume == Resume::Flag(false) {
        c.resume = Resume::Flag(true);
    }
    let file = || format!("the config file {}", config_path.display());
    let fingerprint = c.fingerprint();
    let ckpt = Checkpointer::new(c.checkpoint_dir(), c.save.keep_last);
    let prior = prior(&c, &ckpt).with_context(file)?;
    let spec = model_spec(&c).with_context(file)?;
    let shape = spec.shape().context("[model]").with_context(file)?;
    c.fit_to_model(shape.positions).with_context(file)?;
    let fine_tune = c.fine_tune().with_context(file)?;
    let tok = spec.source.tokenizer()?;
    let chat = data::load(&c, &tok).with_context(file)?;
    let lengths: Vec<usize> = chat.train.iter().map(|t| t.ids.len()).collect();
    let grouping = grouping(&c);
    let seed = c.schedule.seed;
    let plan = steps(&c, &lengths).with_context(file)?;
    let total = plan.len() as u64;
    let counts = serde_json::json!({
        "train_examples": chat.train.len(),
        "train_tokens": chat.train_report.tokens,
        "train_targets": chat.train_report.targets,
    });
    if let Some(p) = &prior {
        ensure!(
            p.step < total,
            "resume: {} is at step {}, which already reaches this run's {total} steps; raise \
             schedule.max_steps or schedule.epochs to train further",
            p.path.display(),
            p.step
        );
        let differ = resume::differences(&counts, &p.extra);
        ensure!(
            differ.is_empty(),
            "resume: the training conversations changed since {} was saved: {}; resume with \
             the same data files",
            p.path.display(),
            differ.join(", ")
        );
    }
    let schedule = lr_schedule(&c, total).with_context(file)?;

    let dev = crate::device_from_flag(&c.device)?;
    let precision = c.tuning.precision.precision();
    let weights = spec.weights(&shape, seed)?;
    let store = ParamStore::new(precision, dev.clone(), seed);
    let mut model = Decoder::new(&store, &weights, &fine_tune)?;
    drop(weights);
    model.set_checkpointing(c.tuning.gradient_checkpointing)?;
    let trainable = store.num_elements();
    let mut ec = EngineConfig::adamw(c.learning_rate());
    if let crate::engine::OptimizerConfig::AdamW(o) = &mut ec.optimizer {
        o.weight_decay = c.schedule.weight_decay;
    }
    ec.schedule = schedule;
    ec.max_grad_norm = (c.schedule.max_grad_norm > 0.0).then_some(c.schedule.max_grad_norm);
    ec.accumulation_steps = c.batch.accumulation_steps;
    let mut engine = Engine::new(store.clone(), ec)?;

    print_header(&c, &spec, &shape, &model, trainable, &dev, &chat, total);
    if let Some(p) = &prior {
        let r = checkpoint::load(&p.path, &mut engine).context("resume")?;
        for n in &r.notices {
            println!("note: {n}");
        }
        ensure!(
            engine.boundaries() == p.step,
            "resume: {} changed while this run started (another run writing to {}?)",
            p.path.display(),
            ckpt.dir().display()
        );
        println!("resumed from {} at step {}", p.path.display(), p.step);
    }
    let start = engine.boundaries();
    let mut extra = counts;
    extra["run"] = fingerprint;

    let out_dir = c.save.dir.clone();
    let resumed_at = (start > 0).then_some(start);
    let mut metrics = crate::trainer::MetricsFiles::open(&out_dir, resumed_at)?;
    let eval = eval::EvalSet::new(&chat.eval, grouping).context("the held-out conversations")?;
    checkpoint::install_interrupt_handler()?;
    let ended = train::train(train::Loop {
        model: &model,
        engine: &mut engine,
        ckpt: &ckpt,
        extra: &extra,
        train: &chat.train,
        plan: &plan,
        grouping,
        eval: &eval,
        metrics: &mut metrics,
        device: &dev,
        every: train::Every {
            log: c.log.every_steps,
            eval: c.eval.every_steps,
            eval_at_start: c.eval.at_start,
            save: c.save.every_steps,
            progress: c.log.progress,
        },
    })?;
    drop(metrics);
    let trained = match ended {
        train::Ended::Done(t) => t,
        train::Ended::Interrupted(p) => return Ok(Outcome::Interrupted(p)),
    };
    // Ctrl-C from here on (plots, saves): the trained state is kept in a checkpoint
    let interrupted = |engine: &Engine| -> Result<Option<PathBuf>> {
        if !checkpoint::interrupted() {
            return Ok(None);
        }
        Ok(Some(match &trained.final_checkpoint {
            Some(p) => p.clone(),
            None => ckpt.save(engine, extra.clone())?,
        }))
    };
    let peak = crate::cuda::peak_memory_gb(&dev);
    if let Some(t) = &trained.throughput {
        println!(
            "{t}, peak memory {}",
            peak.map_or("n/a (CPU)".into(), |g| format!("{g:.2} GB"))
        );
    }
    #[cfg(feature = "plot")]
    let pictures = crate::trainer::write_plots(&out_dir, &trained.phases, trained.steps)?;
    #[cfg(not(feature = "plot"))]
    let pictures: Vec<PathBuf> = Vec::new(); // no pictures without the `plot` feature
    let (mut adapter, mut merged) = (None, None);
    if c.save.adapter == Some(true) {
        let dir = out_dir.join("adapter");
        save::save_adapter(&model, &store, &tok, &spec.name(), &dir, shape.positions)?;
        println!("saved the LoRA adapter (PEFT) to {}", dir.display());
        adapter = Some(dir);
        if let Some(p) = interrupted(&engine)? {
            return Ok(Outcome::Interrupted(p));
        }
    }
    if c.save.merged == Some(true) {
        let dir = out_dir.join("merged");
        save::save_merged(&model, &store, &tok, &dir, shape.positions)?;
        let what = match c.tuning.method {
            Method::Lora => "the merged model",
            Method::Full => "the model",
        };
        println!("saved {what} (HF folder) to {}", dir.display());
        merged = Some(dir);
        if let Some(p) = interrupted(&engine)? {
            return Ok(Outcome::Interrupted(p));
        }
    }
    let mut result = serde_json::json!({
        "steps": total,
        "resumed_at": start,
        "method": match &fine_tune { FineTune::Full => "full".to_string(),
                                     FineTune::Lora(l) => format!("lora{}", l.r) },
        "precision": precision.name(),
        "trainable": trainable,
        "frozen_bytes": model.frozen_bytes(),
        "train_examples": chat.train.len(),
        "eval_examples": chat.eval.len(),
        "train_tokens": chat.train_report.tokens,
        "train_losses": trained.losses,
        "eval_losses": trained.evals,
        "peak_GB": peak,
        "metrics": out_dir.join("metrics.csv"),
        "pictures": pictures,
        "checkpoint": trained.final_checkpoint,
        "adapter": adapter,
        "merged": merged,
    });
    if let (Some(r), Some(serde_json::Value::Object(t))) = (
        result.as_object_mut(),
        trained.throughput.as_ref().map(|t| t.json()),
    ) {
        r.extend(t);
    }
    println!("RESULT {result}");
    Ok(Outcome::Finished(result))
}

/// The run's header: model, trainable parameters, precision and device, data, batches.
#[allow(clippy::too_many_arguments)]
fn print_header(
    c: &FinetuneConfig,
    spec: &ModelSpec,
    shape: &model::ModelShape,
    model: &Decoder,
    trainable: usize,
    dev: &candle_core::Device,
    chat: &data::ChatData,
    total: u64,
) {
    let mode = match model.lora() {
        Some(l) => format!("LoRA r{}", l.r),
        None => "full fine-tune".into(),
    };
    println!(
        "model: {}, {mode}: {} blocks, {trainable} trainable parameters, frozen base {:.1} MB, {}",
        spec.describe(shape),
        shape.config.num_hidden_layers,
        model.frozen_bytes() as f64 / 1e6,
        crate::perf::precision_on_device(c.tuning.precision.precision(), dev),
    );
    println!("data: {}", chat.sources);
    println!("train: {}", chat.train_report);
    match &chat.eval_report {
        Some(r) => println!("eval: {r}"),
        None => println!("eval: none (set data.eval or data.eval_fraction)"),
    }
    let batches = match grouping(c) {
        Grouping::Packed { budget } => format!("packed into {budget} tokens"),
        Grouping::Padded { batch_size } => format!("padded batches of {batch_size}"),
    };
    println!(
        "batches: {batches}, {} per step; {total} steps, max length {}",
        c.batch.accumulation_steps,
        c.max_length()
    );
}
