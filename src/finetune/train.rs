//! The training loop of `wick finetune` ([`train`]): the planned steps from the engine's
//! position on, each a window of micro-batches weighted by their trained targets; a metrics
//! row (and a line on stdout) every `log.every_steps`, evaluations on the held-out examples,
//! checkpoints every `save.every_steps` and on Ctrl-C, an indicatif progress bar on a
//! terminal, the per-phase times for `phases.png`.

use super::batches::{micro_batch, Grouping};
use super::eval::EvalSet;
use super::plan::Step;
use crate::checkpoint::{self, Checkpointer};
use crate::data::chat::Tokenized;
use crate::models::Decoder;
use crate::profile::PhaseTimes;
use crate::throughput::{Throughput, Unit};
use crate::timing::PendingPhases;
use crate::trainer::progress::{progress_bar, ProgressBar};
use crate::trainer::{MetricsFiles, MetricsRow};
use crate::Engine;
use anyhow::{ensure, Result};
use candle_core::{Device, Tensor};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// What the throughput leaves out of the wall clock.
const EXCLUDED: &str = "evaluations and checkpoint saves";

/// Everything the loop needs.
pub struct Loop<'a> {
    /// The model the engine trains.
    pub model: &'a Decoder,
    /// The engine, at the step the run starts from.
    pub engine: &'a mut Engine,
    /// Where checkpoints go.
    pub ckpt: &'a Checkpointer,
    /// The `extra` JSON of every checkpoint.
    pub extra: &'a serde_json::Value,
    /// The training examples the plan indexes.
    pub train: &'a [Tokenized],
    /// Every step of the run.
    pub plan: &'a [Step],
    /// How micro-batches are laid out.
    pub grouping: Grouping,
    /// The held-out examples (possibly none).
    pub eval: &'a EvalSet<'a>,
    /// The metrics files.
    pub metrics: &'a mut MetricsFiles,
    /// The device.
    pub device: &'a Device,
    /// Settings of the loop.
    pub every: Every,
}

/// How often the loop logs, evaluates and saves.
#[derive(Debug, Clone, Copy)]
pub struct Every {
    /// Log row every N steps (and at the last).
    pub log: u64,
    /// Evaluate every N steps; `None`: at the end of each epoch (and always at the last step).
    pub eval: Option<u64>,
    /// Evaluate step 0 of a fresh run.
    pub eval_at_start: bool,
    /// Checkpoint every N steps (0: none in between); always after the last and on Ctrl-C.
    pub save: u64,
    /// Show the progress bar (on a terminal).
    pub progress: bool,
}

/// What the loop did.
#[derive(Debug, Clone)]
pub struct Trained {
    /// `(step, mean training loss since the previous row)` of the log rows.
    pub losses: Vec<(u64, f64)>,
    /// `(step, evaluation loss)` of the evaluations.
    pub evals: Vec<(u64, f64)>,
    /// Real (non-padding) tokens over the seconds of the steps this process ran; `None` when
    /// none ran.
    pub throughput: Option<Throughput>,
    /// Summed phase times of the steps.
    pub phases: PhaseTimes,
    /// Steps this process ran.
    pub steps: u64,
    /// The checkpoint saved after the last step.
    pub final_checkpoint: Option<PathBuf>,
}

/// How the loop ended.
#[derive(Debug, Clone)]
pub enum Ended {
    /// Every planned step ran.
    Done(Trained),
    /// Ctrl-C (or SIGTERM): a checkpoint was saved here.
    Interrupted(PathBuf),
}

/// Figures since the last log row: the weighted loss stays on the device until the row.
struct Window {
    loss: Option<Tensor>,
    targets: usize,
    examples: usize,
    tokens: usize,
    started: Instant,
    paused: Duration,
}

impl Window {
    fn new() -> Self {
        Self {
            loss: None,
            targets: 0,
            examples: 0,
            tokens: 0,
            started: Instant::now(),
            paused: Duration::ZERO,
        }
    }

    fn secs(&self) -> f64 {
        self.started
            .elapsed()
            .saturating_sub(self.paused)
            .as_secs_f64()
    }
}

/// Runs the planned steps from `engine.boundaries()` to the end (see the module docs).
///
/// Errors: a micro-batch or step that fails (the engine's and the model's errors), a metrics
/// file or checkpoint that cannot be written.
pub fn train(l: Loop) -> Result<Ended> {
    let total = l.plan.len() as u64;
    let start = l.engine.boundaries();
    ensure!(
        start < total,
        "the engine is at step {start}, at or past the run's {total} steps"
    );
    let bar = progress_bar(total - start, l.every.progress);
    crate::cuda::reset_peak_memory(l.device)?;
    let mut out = Trained {
        losses: Vec::new(),
        evals: Vec::new(),
        throughput: None,
        phases: PhaseTimes::default(),
        steps: 0,
        final_checkpoint: None,
    };
    let say = |bar: &ProgressBar, line: String| bar.suspend(|| println!("{line}"));
    if l.every.eval_at_start && start == 0 && !l.eval.is_empty() {
        let e = l.eval.loss(l.model, l.device)?;
        out.evals.push((0, e));
        say(&bar, format!("eval loss at step 0: {e:.4}"));
        l.metrics.write(&MetricsRow {
            step: 0,
            val_loss: Some(e),
            ..Default::default()
        })?;
    }
    let mut pending = PendingPhases::default();
    let mut window = Window::new();
    let (mut timed, mut timed_tokens) = (Duration::ZERO, 0u64);
    for s in start..total {
        let step = &l.plan[s as usize];
        let n = s + 1;
        let mut report = None;
        for (k, indices) in step.micro.iter().enumerate() {
            let t = Instant::now();
            let mb = micro_batch(l.train, indices, l.grouping, l.device)?;
            out.phases.data += t.elapsed();
            let w = mb.trained_targets() as f64;
            let forward = |_: &crate::StepCtx| l.model.batch_loss(&mb);
            let r = if k + 1 == step.micro.len() {
                l.engine.step_weighted_closing(w, forward)?
            } else {
                l.engine.step_weighted(w, forward)?
            };
            let weighted = (r.loss_tensor().detach() * w)?;
            window.loss = Some(match window.loss.take() {
                None => weighted,
                Some(sum) => (sum + weighted)?,
            });
            window.targets += mb.trained_targets();
            window.examples += mb.examples();
            window.tokens += mb.tokens();
            pending.push(None, r.spans.clone());
            report = Some(r);
        }
        let Some(report) = report else {
            anyhow::bail!("step {n} of the plan has no micro-batch");
        };
        ensure!(
            report.boundary && l.engine.boundaries() == n,
            "step {n}: the engine did not close its window (at step {})",
            l.engine.boundaries()
        );
        out.steps += 1;
        bar.inc(1);
        let mut row = None;
        if n % l.every.log == 0 || n == total {
            let loss = match &window.loss {
                Some(t) => t.to_scalar::<f32>()? as f64 / window.targets.max(1) as f64,
                None => f64::NAN,
            };
            let secs = window.secs();
            let rate = |x: usize| (secs > 0.0).then(|| x as f64 / secs);
            timed += Duration::from_secs_f64(secs);
            timed_tokens += window.tokens as u64;
            out.phases.add(&pending.drain()?);
            out.losses.push((n, loss));
            let tokens_per_s = rate(window.tokens);
            bar.set_message(format!(
                "loss {loss:.4}  lr {:.2e}  {:.0} tokens/s",
                report.lr,
                tokens_per_s.unwrap_or(0.0)
            ));
            say(
                &bar,
                format!(
                    "step {n:>5}/{total}  epoch {}  loss {loss:.4}  lr {:.3e}  {:.0} tokens/s",
                    step.epoch,
                    report.lr,
                    tokens_per_s.unwrap_or(0.0)
                ),
            );
            row = Some(MetricsRow {
                step: n,
                epoch: step.epoch,
                loss: Some(loss),
                lr: Some(report.lr),
                grad_norm: report.grad_norm()?,
                loss_scale: Some(report.loss_scale()? as f64),
                samples_per_s: rate(window.examples),
                tokens_per_s,
                ..Default::default()
            });
            window = Window::new();
        }
        let end_of_epoch = n == total || l.plan[n as usize].epoch != step.epoch;
        let evaluate = !l.eval.is_empty()
            && (n == total
                || match l.every.eval {
                    Some(e) => n % e == 0,
                    None => end_of_epoch,
                });
        if evaluate {
            let t = Instant::now();
            let e = l.eval.loss(l.model, l.device)?;
            window.paused += t.elapsed();
            out.evals.push((n, e));
            say(&bar, format!("eval loss at step {n}: {e:.4}"));
            let r = row.get_or_insert_with(|| MetricsRow {
                step: n,
                epoch: step.epoch,
                ..Default::default()
            });
            r.val_loss = Some(e);
        }
        if let Some(r) = &row {
            l.metrics.write(r)?;
        }
        let interrupted = checkpoint::interrupted();
        // every N steps, and always after the last one so that a longer run can resume it
        let periodic = n == total || (l.every.save > 0 && n % l.every.save == 0);
        if periodic || interrupted {
            let t = Instant::now();
            let path = l.ckpt.save(l.engine, l.extra.clone())?;
            window.paused += t.elapsed();
            say(&bar, format!("saved checkpoint {}", path.display()));
            if interrupted {
                bar.finish_and_clear();
                return Ok(Ended::Interrupted(path));
            }
            if n == total {
                out.final_checkpoint = Some(path);
            }
        }
    }
    bar.finish_and_clear();
    out.phases.add(&pending.drain()?);
    out.throughput = (out.steps > 0).then(|| Throughput {
        items: timed_tokens,
        unit: Unit::Tokens,
        secs: timed.as_secs_f64(),
        steps: (start + 1, total),
        excluded: EXCLUDED,
    });
    Ok(Ended::Done(out))
}
