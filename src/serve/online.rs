//! The online trainer: a thread that takes feedback in micro-batches, steps the [`Engine`],
//! publishes inference snapshots every N steps and checkpoints periodically and on stop.

use super::published::Published;
use super::queue::FeedbackReceiver;
use crate::checkpoint::Checkpointer;
use crate::engine::Engine;
use anyhow::{ensure, Context, Result};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the trainer thread does with a model: one step on a batch of examples, and a deep
/// copy of the weights for inference. Implemented by the service for its model.
pub trait OnlineLearner: Send + 'static {
    /// One feedback example (e.g. a labelled image, a prompt with its preferred completion).
    type Example: Send + 'static;
    /// What inference runs on: a model over a copy of the weights, independent of the engine.
    type Snapshot: Send + Sync + 'static;

    /// One optimizer step of `engine` on `batch` (1 to [`OnlineConfig::batch_size`] examples):
    /// forward, loss, [`Engine::step`] (or its weighted forms). Returns the batch's mean loss.
    ///
    /// Errors: the step failed; the trainer logs it, counts it and goes on with the next batch.
    fn train_step(&mut self, engine: &mut Engine, batch: &[Self::Example]) -> Result<f32>;

    /// A snapshot of the engine's current weights, deep-copied (later steps must not change
    /// it). Called on the trainer thread between steps.
    ///
    /// Errors: the copy failed (out of memory); the trainer stops with this error.
    fn snapshot(&self, engine: &Engine) -> Result<Self::Snapshot>;
}

/// How the trainer thread batches, publishes, checkpoints and shares the device.
#[derive(Debug, Clone)]
pub struct OnlineConfig {
    /// Most examples per step (>= 1): the step takes what is queued, up to this many.
    pub batch_size: usize,
    /// Publish a new snapshot every this many steps (>= 1).
    pub publish_every: u64,
    /// Save a checkpoint every this many steps (0: only when stopping).
    pub checkpoint_every: u64,
    /// The fraction of wall time training may use, in `(0, 1]`: after a step of `d` seconds
    /// the trainer rests `d (1 - share) / share`, leaving the device (GPU or CPU cores) to
    /// inference. 1.0: back-to-back steps whenever feedback is queued.
    pub train_share: f64,
    /// How long the trainer waits for feedback before it checks the stop flag again.
    pub poll: Duration,
}

impl Default for OnlineConfig {
    fn default() -> Self {
        Self {
            batch_size: 32,
            publish_every: 1,
            checkpoint_every: 0,
            train_share: 1.0,
            poll: Duration::from_millis(50),
        }
    }
}

impl OnlineConfig {
    /// Checks the fields.
    ///
    /// Errors: `batch_size` or `publish_every` 0; `train_share` outside `(0, 1]`.
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.batch_size >= 1,
            "OnlineConfig::batch_size must be >= 1"
        );
        ensure!(
            self.publish_every >= 1,
            "OnlineConfig::publish_every must be >= 1"
        );
        ensure!(
            self.train_share > 0.0 && self.train_share <= 1.0,
            "OnlineConfig::train_share must be in (0, 1], got {}",
            self.train_share
        );
        Ok(())
    }
}

/// Counters the trainer thread updates and a service reads (e.g. for `/metrics`).
#[derive(Debug, Default)]
pub struct OnlineStats {
    steps: AtomicU64,
    failed_steps: AtomicU64,
    examples: AtomicU64,
    loss_bits: AtomicU32,
    train_micros: AtomicU64,
    publishes: AtomicU64,
    publish_micros_last: AtomicU64,
    publish_micros_total: AtomicU64,
    checkpoints: AtomicU64,
    running: AtomicBool,
}

impl OnlineStats {
    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.steps.load(Ordering::Relaxed)
    }
    /// Steps that returned an error (skipped batches).
    pub fn failed_steps(&self) -> u64 {
        self.failed_steps.load(Ordering::Relaxed)
    }
    /// Examples trained on.
    pub fn examples(&self) -> u64 {
        self.examples.load(Ordering::Relaxed)
    }
    /// The last step's mean loss (NaN before the first step).
    pub fn last_loss(&self) -> f32 {
        match self.steps() {
            0 => f32::NAN,
            _ => f32::from_bits(self.loss_bits.load(Ordering::Relaxed)),
        }
    }
    /// Seconds spent in steps (wall time of `train_step`).
    pub fn train_seconds(&self) -> f64 {
        self.train_micros.load(Ordering::Relaxed) as f64 * 1e-6
    }
    /// Snapshots published by the trainer.
    pub fn publishes(&self) -> u64 {
        self.publishes.load(Ordering::Relaxed)
    }
    /// Seconds the last publication took: from the start of the snapshot's copy to the swap.
    pub fn last_publish_seconds(&self) -> f64 {
        self.publish_micros_last.load(Ordering::Relaxed) as f64 * 1e-6
    }
    /// Seconds all publications took together (mean: divide by [`Self::publishes`]).
    pub fn publish_seconds_total(&self) -> f64 {
        self.publish_micros_total.load(Ordering::Relaxed) as f64 * 1e-6
    }
    /// Checkpoints written.
    pub fn checkpoints(&self) -> u64 {
        self.checkpoints.load(Ordering::Relaxed)
    }
    /// True while the trainer thread runs.
    pub fn running(&self) -> bool {
        self.running.load(Ordering::Relaxed)
    }
}

/// What the trainer thread returns when it stops.
#[derive(Debug, Clone)]
pub struct OnlineSummary {
    /// Steps taken.
    pub steps: u64,
    /// The last published version.
    pub version: u64,
    /// The checkpoint written when stopping (`None` without a checkpointer).
    pub checkpoint: Option<PathBuf>,
}

/// Everything the trainer thread owns besides the engine and the learner.
pub struct OnlineParts<S> {
    /// Where feedback arrives.
    pub feedback: FeedbackReceiver<S>,
    /// Checkpoints go here (every [`OnlineConfig::checkpoint_every`] steps and on stop).
    pub checkpointer: Option<Checkpointer>,
    /// Set it to stop: the trainer finishes its step, publishes, saves and returns.
    pub stop: Arc<AtomicBool>,
    /// Counters for the service.
    pub stats: Arc<OnlineStats>,
}

/// Starts the trainer thread (named `wick-online-trainer`). It owns `engine` and `learner`;
/// inference reads `published`. Each step is one accumulation boundary: configure the engine
/// with `accumulation_steps = 1`, or close the window in [`OnlineLearner::train_step`].
///
/// Errors (before starting): an invalid config, or the thread could not be spawned. The
/// thread's own result: the summary, or the error that stopped it (a failed snapshot or
/// checkpoint).
pub fn spawn<L: OnlineLearner>(
    engine: Engine,
    learner: L,
    published: Arc<Published<L::Snapshot>>,
    parts: OnlineParts<L::Example>,
    config: OnlineConfig,
) -> Result<JoinHandle<Result<OnlineSummary>>> {
    config.validate()?;
    let stats = parts.stats.clone();
    // running from now on: a health check right after spawn must not see a stopped trainer
    stats.running.store(true, Ordering::Relaxed);
    let spawned = std::thread::Builder::new()
        .name("wick-online-trainer".into())
        .spawn(move || {
            let out = run(engine, learner, &published, &parts, &config);
            parts.stats.running.store(false, Ordering::Relaxed);
            if let Err(e) = &out {
                tracing::error!("online trainer stopped: {e:#}");
            }
            out
        });
    if spawned.is_err() {
        stats.running.store(false, Ordering::Relaxed);
    }
    spawned.context("spawning the online trainer thread")
}

fn publish<L: OnlineLearner>(
    engine: &Engine,
    learner: &L,
    published: &Published<L::Snapshot>,
    stats: &OnlineStats,
) -> Result<u64> {
    let t = Instant::now();
    let snap = learner.snapshot(engine).context("taking a snapshot")?;
    // On CUDA each thread launches on its own per-thread default stream (candle's
    // `Device::new_cuda`): the copies are queued on this thread's, and the request threads
    // that read the snapshot are not ordered with it. Wait for them before publishing.
    engine
        .store()
        .device()
        .synchronize()
        .context("waiting for the snapshot's copies")?;
    let version = published.publish(snap);
    let micros = t.elapsed().as_micros() as u64;
    stats.publish_micros_last.store(micros, Ordering::Relaxed);
    stats
        .publish_micros_total
        .fetch_add(micros, Ordering::Relaxed);
    stats.publishes.fetch_add(1, Ordering::Relaxed);
    tracing::info!(
        "published version {version} in {:.3} ms",
        micros as f64 * 1e-3
    );
    Ok(version)
}

fn save(
    engine: &Engine,
    checkpointer: &Option<Checkpointer>,
    version: u64,
    stats: &OnlineStats,
) -> Result<Option<PathBuf>> {
    let Some(c) = checkpointer else {
        return Ok(None);
    };
    let path = c
        .save(engine, serde_json::json!({ "published_version": version }))
        .context("saving a checkpoint")?;
    stats.checkpoints.fetch_add(1, Ordering::Relaxed);
    Ok(Some(path))
}

fn run<L: OnlineLearner>(
    mut engine: Engine,
    mut learner: L,
    published: &Published<L::Snapshot>,
    parts: &OnlineParts<L::Example>,
    config: &OnlineConfig,
) -> Result<OnlineSummary> {
    let stats = &parts.stats;
    let mut unpublished = 0u64;
    let mut unsaved = false;
    while !parts.stop.load(Ordering::SeqCst) {
        let batch = parts.feedback.next_batch(config.batch_size, config.poll);
        if batch.is_empty() {
            continue;
        }
        let t = Instant::now();
        let result = learner.train_step(&mut engine, &batch);
        let took = t.elapsed();
        stats
            .train_micros
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
        match result {
            Ok(loss) => {
                stats.loss_bits.store(loss.to_bits(), Ordering::Relaxed);
                stats
                    .examples
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
                let steps = stats.steps.fetch_add(1, Ordering::Relaxed) + 1;
                unpublished += 1;
                unsaved = true;
                if unpublished >= config.publish_every {
                    publish(&engine, &learner, published, stats)?;
                    unpublished = 0;
                }
                if config.checkpoint_every > 0 && steps % config.checkpoint_every == 0 {
                    save(&engine, &parts.checkpointer, published.version(), stats)?;
                    unsaved = false;
                }
            }
            Err(e) => {
                stats.failed_steps.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("online trainer: a step failed, batch skipped: {e:#}");
            }
        }
        if config.train_share < 1.0 {
            let rest = took.mul_f64((1.0 - config.train_share) / config.train_share);
            let until = Instant::now() + rest;
            while !parts.stop.load(Ordering::SeqCst) && Instant::now() < until {
                std::thread::sleep(
                    until
                        .saturating_duration_since(Instant::now())
                        .min(config.poll),
                );
            }
        }
    }
    if unpublished > 0 {
        publish(&engine, &learner, published, stats)?;
    }
    // on stop: always leave a checkpoint of the final weights (the newest one when unchanged)
    let checkpoint = match (&parts.checkpointer, unsaved) {
        (Some(c), false) if stats.checkpoints() > 0 => c.latest()?,
        _ => save(&engine, &parts.checkpointer, published.version(), stats)?,
    };
    Ok(OnlineSummary {
        steps: stats.steps(),
        version: published.version(),
        checkpoint,
    })
}
