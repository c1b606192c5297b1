//! `Trainer`: the fit loop on top of [`Engine`] — epochs or a step budget, validation every N
//! optimizer steps or per epoch, early stopping on a monitored metric, an indicatif progress
//! bar (feature `cli`), metrics to CSV and JSONL, and at the end the per-phase breakdown and throughput.
//!
//! Each batch the [`DataLoader`] yields is one micro-batch, weighted by its sample count; the
//! engine runs the optimizer step every `accumulation_steps` batches, and on the epoch's last
//! batch whatever the window holds (10 batches with `accumulation_steps = 4`: 3 steps, the
//! last over 2 micro-batches, as Lightning does), so no micro-batch is left pending at the end
//! of an epoch and every epoch ends at a checkpointable step. "Step" below always means
//! an optimizer step (an accumulation boundary), as in Lightning's `global_step`.
//!
//! The configuration can come from a TOML file ([`TrainerConfig::from_toml_file`]); the
//! examples let command-line flags override it.

mod metrics;
pub(crate) mod progress;

pub use metrics::{MetricsFiles, MetricsRow, CSV_HEADER};

use crate::data::{Batch, Collate, DataLoader, Dataset, LoaderState};
use crate::engine::{Engine, StepCtx, StepReport};
use crate::profile::{PhaseTimes, RunProfile};
use crate::throughput::{Throughput, Unit};
use crate::timing::PendingPhases;
use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use progress::progress_bar;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Whether a smaller or a larger monitored value is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Smaller is better (losses).
    Min,
    /// Larger is better (accuracies).
    Max,
}

/// Early stopping (Lightning's `EarlyStopping`): stop when `monitor` has not improved by more
/// than `min_delta` for `patience` consecutive evaluations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EarlyStopping {
    /// Name of the metric returned by the evaluation closure, e.g. `"val_loss"`.
    pub monitor: String,
    /// Evaluations without improvement before stopping (≥ 1).
    pub patience: usize,
    /// Minimum change that counts as an improvement.
    #[serde(default)]
    pub min_delta: f64,
    /// Direction of improvement.
    pub mode: Mode,
}

/// Trainer settings. Every field has a default, so a TOML file only lists what it changes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainerConfig {
    /// Stop after this many epochs (passes over the loader).
    pub max_epochs: Option<u64>,
    /// Stop after this many optimizer steps (counted from the engine's state, so a resumed run
    /// stops where the uninterrupted one would).
    pub max_steps: Option<u64>,
    /// Evaluate every N optimizer steps; `None`: at the end of every epoch.
    pub eval_every: Option<u64>,
    /// Also evaluate before the first step of a fresh run (step 0, the untrained model), with
    /// its row in the metrics files and the plot; skipped when resuming.
    pub eval_at_start: bool,
    /// Log (read the summed loss back, write a metrics row, update the bar) every N optimizer
    /// steps; losses are summed on the device in between.
    pub log_every: u64,
    /// Early stopping on a metric of the evaluation closure.
    pub early_stopping: Option<EarlyStopping>,
    /// Where `metrics.csv` and `metrics.jsonl` go (created if missing; a resumed run appends),
    /// and the plots of [`Trainer::write_plots`]; `None`: no files. Under data parallelism
    /// only rank 0 writes.
    pub out_dir: Option<PathBuf>,
    /// Show a progress bar (off when stderr is not a terminal, as indicatif does).
    pub progress: bool,
    /// Tokens per sample, to report tokens/s instead of samples/s.
    pub tokens_per_sample: Option<usize>,
    /// Model FLOPs per optimizer step, for MFU in the final report (e.g. 6 × params × tokens).
    pub flops_per_step: Option<f64>,
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            max_epochs: Some(1),
            max_steps: None,
            eval_every: None,
            eval_at_start: false,
            log_every: 50,
            early_stopping: None,
            out_dir: None,
            progress: true,
            tokens_per_sample: None,
            flops_per_step: None,
        }
    }
}

impl TrainerConfig {
    /// Reads a TOML file with any subset of the fields (unknown keys are an error).
    pub fn from_toml_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading trainer config {}", path.display()))?;
        let c: Self = toml::from_str(&text)
            .with_context(|| format!("parsing trainer config {}", path.display()))?;
        c.validate()?;
        Ok(c)
    }

    /// Checks the settings: a stopping rule exists, counts are ≥ 1.
    pub fn validate(&self) -> Result<()> {
        if self.max_epochs.is_none() && self.max_steps.is_none() {
            bail!("trainer config: set max_epochs or max_steps");
        }
        if self.max_epochs == Some(0) {
            bail!("trainer config: max_epochs is 0, so nothing would train; set the number of passes over the data to 1 or more");
        }
        if self.max_steps == Some(0) {
            bail!("trainer config: max_steps is 0, so nothing would train; set it to 1 or more");
        }
        if self.log_every == 0 {
            bail!("trainer config: log_every is 0; log every 1 or more optimizer steps");
        }
        if self.eval_every == Some(0) {
            bail!("trainer config: eval_every is 0; evaluate every 1 or more optimizer steps, or leave it unset to evaluate at the end of every epoch");
        }
        if let Some(e) = &self.early_stopping {
            if e.patience == 0 {
                bail!("trainer config: early_stopping.patience must be >= 1");
            }
        }
        Ok(())
    }
}

/// Metrics of one evaluation, by name (e.g. `val_loss`, `val_accuracy`).
pub type Metrics = BTreeMap<String, f64>;

/// Steps whose CUDA-event spans may wait unresolved between log rows (bounds the events held).
const MAX_PENDING_STEPS: usize = 512;

/// Why `fit` returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// `max_epochs` reached.
    MaxEpochs,
    /// `max_steps` reached.
    MaxSteps,
    /// Early stopping triggered.
    EarlyStopping,
    /// The `should_stop` hook asked to stop (e.g. Ctrl-C).
    Interrupted,
}

/// What `fit` did.
#[derive(Debug, Clone)]
pub struct FitSummary {
    /// Why the loop ended.
    pub stop: StopReason,
    /// Optimizer steps done by this call.
    pub steps: u64,
    /// Samples consumed by this call.
    pub samples: u64,
    /// Wall time of this call.
    pub elapsed: Duration,
    /// Wall-clock time of the training steps: [`FitSummary::elapsed`] less the evaluations and
    /// the `after_step` hooks (checkpoint saves). The basis of every throughput the trainer
    /// prints, and of the report's MFU ([`FitSummary::throughput`]).
    pub train_time: Duration,
    /// Summed per-phase times (data measured around `next_batch`).
    pub phases: PhaseTimes,
    /// The last evaluation.
    pub last_eval: Option<Metrics>,
    /// Best value of the early-stopping metric, if configured.
    pub best: Option<f64>,
    /// Figures for the report and the bottleneck hints.
    pub profile: RunProfile,
    /// This process's data-parallel rank (0 without a collective): only rank 0 writes files.
    pub rank: usize,
}

impl FitSummary {
    /// The report's throughput: trained tokens (samples x
    /// [`TrainerConfig::tokens_per_sample`]; samples without it) over
    /// [`FitSummary::train_time`], with its basis ([`Throughput::basis`], e.g. for
    /// `tokens_per_s_basis` in a JSON line: [`Throughput::json`]). `None` when no step ran.
    pub fn throughput(&self) -> Option<Throughput> {
        self.profile.throughput.clone()
    }

    /// Samples trained on per second of [`FitSummary::train_time`]; `None` when no step ran.
    pub fn samples_per_s(&self) -> Option<f64> {
        let secs = self.train_time.as_secs_f64();
        (self.samples > 0 && secs > 0.0).then(|| self.samples as f64 / secs)
    }

    /// Tokens trained on per second of [`FitSummary::train_time`] (samples x
    /// [`TrainerConfig::tokens_per_sample`]); `None` without tokens per sample or steps.
    pub fn tokens_per_s(&self) -> Option<f64> {
        let t = self.profile.tokens_per_sample?;
        self.samples_per_s().map(|r| r * t as f64)
    }

    /// The end-of-run report: steps and wall time, then the phase table, throughput, MFU (when
    /// `flops_per_step` is set on a GPU in the peak table) and bottleneck hints.
    pub fn report(&self) -> String {
        let wall = match self.wall_ms_per_step() {
            Some(ms) => format!(" ({ms:.1} ms/step wall clock, evaluation and logging included)"),
            None => String::new(),
        };
        format!(
            "{} optimizer steps, {} samples in {:.1} s{wall}\n{}",
            self.steps,
            self.samples,
            self.elapsed.as_secs_f64(),
            self.profile.report()
        )
    }

    /// Milliseconds per optimizer step of the training phases (data, host-to-device, forward,
    /// backward, optimizer): the `step` row of the report's phase table. Evaluation and logging
    /// are not in it. `None` when no step ran.
    pub fn step_ms(&self) -> Option<f64> {
        (self.steps > 0).then(|| self.phases.total().as_secs_f64() * 1e3 / self.steps as f64)
    }

    /// Milliseconds of wall clock per optimizer step over the whole `fit` call, evaluation and
    /// logging included. `None` when no step ran.
    pub fn wall_ms_per_step(&self) -> Option<f64> {
        (self.steps > 0).then(|| self.elapsed.as_secs_f64() * 1e3 / self.steps as f64)
    }
}

/// What the trainer's throughput leaves out of the wall clock ([`Throughput::excluded`]).
const EXCLUDED: &str = "evaluation and after_step hooks (checkpoint saves)";

/// Hooks the loop calls; all optional.
#[derive(Default)]
pub struct Hooks<'a> {
    /// Called after every optimizer step with the engine, the step's report and the loader's
    /// position (the next batch: what a checkpoint stores to resume exactly); return `true` to
    /// stop (e.g. a Ctrl-C flag). Checkpointing every N steps goes here.
    #[allow(clippy::type_complexity)]
    pub after_step:
        Option<Box<dyn FnMut(&mut Engine, &StepReport, &LoaderState) -> Result<bool> + 'a>>,
}

/// The fit loop (Lightning's `Trainer.fit`, for an [`Engine`]): pulls micro-batches from a
/// [`DataLoader`], runs [`Engine::step_weighted`] on each (weighted by its sample count, the
/// epoch's last partial window closed with [`Engine::step_weighted_closing`]), logs, evaluates,
/// stops on `max_epochs`, `max_steps`, early stopping or a hook, and returns a [`FitSummary`]
/// with the phase report. [`Trainer::write_plots`] then draws the run's pictures.
///
/// Under data parallelism every rank runs `fit` with its own shard of the data; only rank 0
/// writes files and prints. Resuming: restore the engine and the loader from a checkpoint
/// (e.g. [`crate::checkpoint::Checkpointer::resume_existing_with_loader`]) and call `fit`
/// again; it continues at the next batch and appends to the metrics files.
///
/// ```no_run
/// use candle_core::{Device, Module, Tensor};
/// use wick::data::{DataLoader, LoaderConfig, TensorDataset};
/// use wick::trainer::{Hooks, Metrics, Trainer, TrainerConfig};
/// use wick::{loss, nn, Engine, EngineConfig, ParamStore, Precision};
/// # fn main() -> anyhow::Result<()> {
/// let dev = Device::Cpu;
/// let store = ParamStore::new(Precision::Bf16Mixed, dev.clone(), 0);
/// let fc = nn::Linear::new(&store, "fc", 784, 10, true)?;
/// let mut engine = Engine::new(store, EngineConfig::adamw(1e-3))?;
///
/// let x = Tensor::randn(0f32, 1.0, (1024, 784), &dev)?;
/// let y = Tensor::zeros(1024, candle_core::DType::U32, &dev)?;
/// let data = TensorDataset::new(vec![x.clone(), y.clone()])?;
/// let mut loader = DataLoader::new(data, LoaderConfig::new(64).with_shuffle(0))?;
///
/// let mut trainer = Trainer::new(TrainerConfig {
///     max_epochs: Some(3),
///     log_every: 4,
///     out_dir: Some("runs/demo".into()), // metrics.csv, metrics.jsonl, plots
///     ..TrainerConfig::default()
/// })?;
/// let summary = trainer.fit(
///     &mut engine,
///     &mut loader,
///     // one micro-batch: its mean loss
///     |_ctx, batch| {
///         let (x, y) = batch.pair().map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
///         loss::cross_entropy(&fc.forward(&x)?, &y)
///     },
///     // evaluation (end of every epoch here): metrics by name, val_loss goes to the CSV
///     |_engine| {
///         let val = loss::cross_entropy(&fc.forward(&x)?, &y)?.to_scalar::<f32>()?;
///         Ok(Metrics::from([("val_loss".to_string(), val as f64)]))
///     },
///     Hooks::default(), // e.g. checkpoint every N steps, stop on Ctrl-C
/// )?;
/// # #[cfg(feature = "plot")]
/// trainer.write_plots(&summary)?; // loss.png, phases.png
/// println!("{}", summary.report()); // phase table, throughput, hints
/// # Ok(()) }
/// ```
pub struct Trainer {
    config: TrainerConfig,
}

/// Figures accumulated since a mark (the last log row, or the start of the epoch). The summed
/// micro-batch losses stay on the device: one scalar add per micro-batch, read back only when
/// the figures are reported, so logging every N steps costs one synchronisation per N steps.
struct Tally {
    loss_sum: Option<Tensor>,
    losses: u64,
    samples: u64,
    started: Instant,
    /// Time since `started` spent outside the steps (evaluations, hooks): not in the rate.
    paused: Duration,
}

impl Tally {
    fn new() -> Self {
        Self {
            loss_sum: None,
            losses: 0,
            samples: 0,
            started: Instant::now(),
            paused: Duration::ZERO,
        }
    }

    fn add(&mut self, loss: &Tensor, samples: u64) -> Result<()> {
        self.loss_sum = Some(match self.loss_sum.take() {
            None => loss.detach(),
            Some(sum) => (sum + loss.detach())?,
        });
        self.losses += 1;
        self.samples += samples;
        Ok(())
    }

    /// Mean micro-batch loss since the mark (a device read).
    fn mean_loss(&self) -> Result<Option<f64>> {
        match &self.loss_sum {
            None => Ok(None),
            Some(sum) => Ok(Some(sum.to_scalar::<f32>()? as f64 / self.losses as f64)),
        }
    }

    /// Wall-clock seconds of the steps since the mark (evaluations and hooks excluded).
    fn secs(&self) -> f64 {
        self.started
            .elapsed()
            .saturating_sub(self.paused)
            .as_secs_f64()
    }

    /// Samples since the mark per second of the steps' wall clock (the basis of
    /// [`FitSummary::throughput`]).
    fn rate(&self) -> f64 {
        self.samples as f64 / self.secs().max(1e-9)
    }
}

struct Stopper {
    rule: Option<EarlyStopping>,
    best: Option<f64>,
    bad: usize,
}

impl Stopper {
    /// Records an evaluation; true when training should stop.
    fn update(&mut self, metrics: &Metrics) -> Result<bool> {
        let Some(rule) = &self.rule else {
            return Ok(false);
        };
        let Some(&v) = metrics.get(&rule.monitor) else {
            bail!(
                "early stopping monitors {:?} but the evaluation returned {:?}",
                rule.monitor,
                metrics.keys().collect::<Vec<_>>()
            );
        };
        let improved = match (self.best, rule.mode) {
            (None, _) => true,
            (Some(b), Mode::Min) => v < b - rule.min_delta,
            (Some(b), Mode::Max) => v > b + rule.min_delta,
        };
        if improved {
            self.best = Some(v);
            self.bad = 0;
        } else {
            self.bad += 1;
        }
        Ok(self.bad >= rule.patience)
    }
}

impl Trainer {
    /// A trainer with validated settings.
    pub fn new(config: TrainerConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self { config })
    }

    /// The settings.
    pub fn config(&self) -> &TrainerConfig {
        &self.config
    }

    /// Trains until a stopping rule fires. `train_step(ctx, batch)` returns the mean loss of the
    /// batch (a scalar); `evaluate(engine)` returns validation metrics (include `val_loss` to
    /// get it into the CSV). The loader's position and the engine's step count carry over
    /// between calls and from checkpoints, so a resumed run continues where it stopped.
    ///
    /// Errors: any error of the loader, the step, the evaluation or the metrics files; the
    /// engine is left at its last completed step.
    pub fn fit<D, C, F, E>(
        &mut self,
        engine: &mut Engine,
        loader: &mut DataLoader<D, C>,
        mut train_step: F,
        mut evaluate: E,
        mut hooks: Hooks,
    ) -> Result<FitSummary>
    where
        D: Dataset,
        C: Collate<D::Sample>,
        F: FnMut(&StepCtx, &Batch) -> candle_core::Result<Tensor>,
        E: FnMut(&mut Engine) -> Result<Metrics>,
    {
        let c = self.config.clone();
        let rank = engine.collective().map_or(0, |c| c.rank());
        if c.max_steps.is_some_and(|m| engine.boundaries() >= m) {
            // a run resumed at its last step: nothing to train, and the metrics files of the
            // run stay as they are
            return Ok(FitSummary {
                stop: StopReason::MaxSteps,
                steps: 0,
                samples: 0,
                elapsed: Duration::ZERO,
                train_time: Duration::ZERO,
                phases: PhaseTimes::default(),
                last_eval: None,
                best: None,
                profile: RunProfile::default(),
                rank,
            });
        }
        let start_step = engine.boundaries();
        let resumed_at = (start_step > 0).then_some(start_step);
        let mut files = match c.out_dir.as_deref() {
            Some(dir) if rank == 0 => Some(MetricsFiles::open(dir, resumed_at)?),
            _ => None,
        };
        let accum = engine.config().accumulation_steps as u64;
        let per_epoch = steps_per_epoch(loader.num_batches(), accum);
        let total = match (c.max_steps, c.max_epochs) {
            (Some(s), _) => s.saturating_sub(start_step),
            (None, Some(e)) => e.saturating_sub(loader.epoch()) * per_epoch,
            (None, None) => 0,
        };
        let bar = progress_bar(total, c.progress && rank == 0);
        let started = Instant::now();
        // time outside the steps (evaluations, hooks): not in the throughput
        let mut outside = Duration::ZERO;
        let mut phases = PhaseTimes::default();
        // CUDA-event spans, resolved at log rows (where the loss is read anyway)
        let mut pending = PendingPhases::default();
        let mut device_timed = false;
        let mut staged_h2d = false;
        let mut window = Tally::new();
        let mut stopper = Stopper {
            rule: c.early_stopping.clone(),
            best: None,
            bad: 0,
        };
        let (mut samples, mut last_eval) = (0u64, None);
        let unit = if c.tokens_per_sample.is_some() {
            Unit::Tokens
        } else {
            Unit::Samples
        };
        let per_sample = c.tokens_per_sample.unwrap_or(1) as u64;
        let throughput = |items: u64, secs: f64, steps: (u64, u64)| Throughput {
            items: items * per_sample,
            unit,
            secs,
            steps,
            excluded: EXCLUDED,
        };
        if c.eval_at_start && start_step == 0 {
            let t = Instant::now();
            let m = evaluate(engine)?;
            outside += t.elapsed();
            window.paused += t.elapsed();
            let row = MetricsRow {
                step: 0,
                epoch: loader.epoch(),
                val_loss: m.get("val_loss").copied(),
                eval: m.clone(),
                ..Default::default()
            };
            if let Some(f) = files.as_mut() {
                f.write(&row)?;
            }
            last_eval = Some(m);
        }
        let stop = 'outer: loop {
            if c.max_epochs.is_some_and(|e| loader.epoch() >= e) {
                break StopReason::MaxEpochs;
            }
            // a run resumed at (or past) its last step trains nothing more
            if c.max_steps.is_some_and(|m| engine.boundaries() >= m) {
                break StopReason::MaxSteps;
            }
            let mut epoch_stats = Tally::new();
            let epoch_first_step = engine.boundaries() + 1;
            loop {
                let t = Instant::now();
                let Some(batch) = loader.next_batch()? else {
                    break;
                };
                phases.data += t.elapsed();
                let n = batch.len() as u64;
                // the epoch's last batch closes its window even when the window is partial
                // (Lightning steps on it too): no micro-batch stays pending past an epoch
                let last_of_epoch = batch.index + 1 >= loader.num_batches();
                let report = if last_of_epoch {
                    engine.step_weighted_closing(n as f64, |ctx| train_step(ctx, &batch))?
                } else {
                    engine.step_weighted(n as f64, |ctx| train_step(ctx, &batch))?
                };
                device_timed |= report.spans.forward.is_device();
                staged_h2d |= batch.h2d.is_some();
                pending.push(batch.h2d.clone(), report.spans.clone());
                samples += n;
                window.add(report.loss_tensor(), n)?;
                epoch_stats.add(report.loss_tensor(), n)?;
                if pending.len() >= MAX_PENDING_STEPS {
                    phases.add(&pending.drain()?);
                }
                if !report.boundary {
                    continue;
                }
                let step = engine.boundaries();
                bar.inc(1);
                let mut row = None;
                if step % c.log_every == 0 {
                    let loss = window.mean_loss()?;
                    phases.add(&pending.drain()?);
                    let rate = window.rate();
                    bar.set_message(format!(
                        "loss {:.4}  lr {:.2e}  {:.0} {}/s",
                        loss.unwrap_or(f64::NAN),
                        report.lr,
                        rate * per_sample as f64,
                        unit.name()
                    ));
                    row = Some(MetricsRow {
                        step,
                        epoch: batch.epoch,
                        loss,
                        lr: Some(report.lr),
                        grad_norm: report.grad_norm()?,
                        loss_scale: Some(report.loss_scale()? as f64),
                        samples_per_s: Some(rate),
                        tokens_per_s: c.tokens_per_sample.map(|t| rate * t as f64),
                        ..Default::default()
                    });
                    window = Tally::new();
                }
                let mut stop_now = false;
                if c.eval_every.is_some_and(|e| step % e == 0) {
                    let t = Instant::now();
                    let m = evaluate(engine)?;
                    let d = t.elapsed();
                    (outside, window.paused, epoch_stats.paused) =
                        (outside + d, window.paused + d, epoch_stats.paused + d);
                    let r = row.get_or_insert_with(|| MetricsRow {
                        step,
                        epoch: batch.epoch,
                        ..Default::default()
                    });
                    r.val_loss = m.get("val_loss").copied();
                    r.eval = m.clone();
                    stop_now = stopper.update(&m)?;
                    last_eval = Some(m);
                }
                if let (Some(f), Some(r)) = (files.as_mut(), row.as_ref()) {
                    f.write(r)?;
                }
                if let Some(h) = hooks.after_step.as_mut() {
                    let t = Instant::now();
                    let stop = h(engine, &report, &loader.state())?;
                    let d = t.elapsed();
                    (outside, window.paused, epoch_stats.paused) =
                        (outside + d, window.paused + d, epoch_stats.paused + d);
                    if stop {
                        break 'outer StopReason::Interrupted;
                    }
                }
                if stop_now {
                    break 'outer StopReason::EarlyStopping;
                }
                if c.max_steps.is_some_and(|m| step >= m) {
                    break 'outer StopReason::MaxSteps;
                }
            }
            // end of an epoch (none ran when a resumed loader stood at the end of one)
            if c.eval_every.is_none() && epoch_stats.samples > 0 {
                // the epoch's rate before its evaluation, which is not a training step
                let rate = throughput(
                    epoch_stats.samples,
                    epoch_stats.secs(),
                    (epoch_first_step, engine.boundaries()),
                );
                let t = Instant::now();
                let m = evaluate(engine)?;
                outside += t.elapsed();
                window.paused += t.elapsed();
                let step = engine.boundaries();
                let row = MetricsRow {
                    step,
                    epoch: loader.epoch().saturating_sub(1),
                    val_loss: m.get("val_loss").copied(),
                    eval: m.clone(),
                    ..Default::default()
                };
                let train_loss = match epoch_stats.mean_loss()? {
                    None => String::new(),
                    Some(l) => format!("train loss {l:.4}  "),
                };
                let line = format!(
                    "epoch {}: {train_loss}{}  {rate}, {:.1} s",
                    row.epoch,
                    fmt_metrics(&m),
                    rate.secs
                );
                if rank == 0 {
                    bar.suspend(|| println!("{line}"));
                }
                if let Some(f) = files.as_mut() {
                    f.write(&row)?;
                }
                let stop_now = stopper.update(&m)?;
                last_eval = Some(m);
                if stop_now {
                    break StopReason::EarlyStopping;
                }
            }
        };
        bar.finish_and_clear();
        phases.add(&pending.drain()?);
        let steps = engine.boundaries() - start_step;
        // one reading for the summary and its report, so both print the same throughput
        let elapsed = started.elapsed();
        let train_time = elapsed.saturating_sub(outside);
        let profile = RunProfile {
            phases,
            steps,
            samples,
            tokens_per_sample: c.tokens_per_sample.map(|t| t as u64),
            flops_per_step: c.flops_per_step,
            gpu_name: gpu_name(engine.store().device()),
            compute_capability: compute_capability(engine.store().device()),
            compute_dtype: Some(engine.store().precision().compute_dtype()),
            fused_optimizer: engine.implementation().is_fused(),
            num_workers: loader.config().num_workers,
            peak_memory: peak_memory(engine.store().device()),
            device_timed,
            staged_h2d,
            throughput: (steps > 0).then(|| {
                throughput(
                    samples,
                    train_time.as_secs_f64(),
                    (start_step + 1, start_step + steps),
                )
            }),
        };
        drop(files);
        Ok(FitSummary {
            profile,
            stop,
            steps: engine.boundaries() - start_step,
            samples,
            elapsed,
            train_time,
            phases,
            last_eval,
            best: stopper.best,
            rank,
        })
    }

    /// Draws the run's pictures into [`TrainerConfig::out_dir`] after [`Trainer::fit`]:
    /// `phases.csv` and `phases.png` (the summary's phase breakdown) and `loss.png` (train and
    /// validation loss and the learning rate against step, from the whole `metrics.csv`, so a
    /// resumed run's plot shows the run from its start). Returns the paths written; nothing
    /// without an `out_dir`, or on a data-parallel rank other than 0. Feature `plot`.
    ///
    /// Errors: `metrics.csv` cannot be read, or a picture cannot be written (the message names
    /// the file).
    #[cfg(feature = "plot")]
    pub fn write_plots(&self, summary: &FitSummary) -> Result<Vec<PathBuf>> {
        match self.config.out_dir.as_deref() {
            Some(dir) if summary.rank == 0 => {
                write_plots(dir, &summary.profile.phases, summary.steps)
            }
            _ => Ok(Vec::new()),
        }
    }
}

/// Optimizer steps in an epoch of `batches` micro-batches with `accumulation_steps` per
/// window: the last, partial window counts as a step (the trainer closes it at the epoch's
/// last batch), so this is `ceil(batches / accumulation_steps)`, and at least 1.
pub fn steps_per_epoch(batches: usize, accumulation_steps: u64) -> u64 {
    (batches as u64).div_ceil(accumulation_steps.max(1)).max(1)
}

fn fmt_metrics(m: &Metrics) -> String {
    m.iter()
        .map(|(k, v)| format!("{k} {v:.4}"))
        .collect::<Vec<_>>()
        .join("  ")
}

/// The GPU's name for the peak-rate table (`None` on the CPU).
fn gpu_name(device: &candle_core::Device) -> Option<String> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return d.cuda_stream().context().name().ok();
    }
    let _ = device;
    None
}

/// The GPU's compute capability (`None` on the CPU), for the bf16 hint.
fn compute_capability(device: &candle_core::Device) -> Option<(u32, u32)> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        let (major, minor) = d.cuda_stream().context().compute_capability().ok()?;
        return Some((major as u32, minor as u32));
    }
    let _ = device;
    None
}

/// Peak device memory in use (the allocator's high-water mark) on CUDA; `None` elsewhere.
fn peak_memory(device: &candle_core::Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return crate::cuda::memory::memory_stats(d)
            .ok()
            .map(|s| s.peak_allocated);
    }
    let _ = device;
    None
}

/// `phases.csv`, `loss.png` (train/val loss and lr against step) and `phases.png` (the phase
/// bar chart) next to the metrics files; returns the files written (the [`Trainer`]'s and
/// `wick finetune`'s).
#[cfg(feature = "plot")]
pub(crate) fn write_plots(dir: &Path, phases: &PhaseTimes, steps: u64) -> Result<Vec<PathBuf>> {
    use crate::plot::{
        plot_metrics, plot_phases, read_metrics, write_phases_csv, PhaseBreakdown, PlotOptions,
    };
    let breakdown = PhaseBreakdown::from_times(phases, steps);
    let mut written = vec![dir.join("phases.csv")];
    write_phases_csv(&written[0], &breakdown)?;
    let opts = PlotOptions::default();
    let rows = read_metrics(&dir.join("metrics.csv"))?;
    if !rows.is_empty() {
        written.push(plot_metrics(&rows, &dir.join("loss.png"), &opts)?.path);
    }
    if steps > 0 {
        written.push(plot_phases(&breakdown, &dir.join("phases.png"), &opts)?.path);
    }
    Ok(written)
}
