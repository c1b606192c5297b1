//! Checkpoints: save, load, resume — atomically, with checksums.
//!
//! ## Layout
//! A checkpoint is one directory per step under a root directory:
//! ```text
//! ROOT/
//!   step-000050/
//!     model.safetensors       fp32 master weights by the model's own names ("l1.weight", ...)
//!     optimizer.safetensors   optimizer state (Optimizer::state_tensors: "l1.weight.exp_avg", ...)
//!     trainer_state.json      TrainerState: format version, wick version, EngineState (counters,
//!                             loss-scaler state), the caller's "extra" JSON (data position, RNG,
//!                             config...), and the size + SHA-256 of both safetensors files
//!   step-000100/
//!   .tmp-step-000150-4242/    a save in progress (or killed): ignored, cleaned up later
//! ```
//! `model.safetensors` is a plain safetensors file of f32 tensors: an inference service loads it
//! with `candle_nn::VarBuilder::from_mmaped_safetensors` (or any safetensors reader).
//!
//! ## Atomicity
//! [`Checkpointer::save`] writes the three files into `ROOT/.tmp-step-N-<pid>/`, fsyncs each
//! file and the directory, renames the directory to `ROOT/step-N` and fsyncs `ROOT`. A
//! directory named `step-N` is therefore always complete: a crash (even `kill -9` or a power
//! cut, on a file system that honours fsync) at any moment leaves every earlier checkpoint
//! intact and [`latest`] still finds a loadable one. Saving a step that already exists
//! replaces it with an atomic exchange (Linux `renameat2(RENAME_EXCHANGE)`), so even then there
//! is no moment without a complete `step-N`. Pruning (`keep_last`) runs only after the new
//! checkpoint is durable, and renames a directory away before deleting it.
//!
//! ## Loading
//! [`load`] reads and checks everything — format version, file sizes, SHA-256 checksums,
//! safetensors structure, tensor names, dtypes and shapes against the model, optimizer-state
//! names — before it changes anything in the engine. Errors name the file and what is wrong
//! (missing tensor, shape mismatch, truncated or corrupt file, checksum mismatch, wrong
//! version). Loading never writes to the checkpoint directory.
//!
//! ## Exact resume
//! Masters, optimizer moments and step counts, the accumulation-boundary count (the LR
//! schedule's position and the stochastic-rounding seed) and the loss-scaler state are all
//! restored bit for bit; working copies are re-derived from the masters (round to nearest
//! even, which is how the engine derives them on the CPU and by default on CUDA). With the data
//! position in `extra` (e.g. [`crate::data::LoaderState`]), steps `N+1..` after a resume are
//! bit-identical to an uninterrupted run.
//!
//! ## Save on Ctrl-C
//! [`install_interrupt_handler`] makes SIGINT (and SIGTERM/SIGHUP, as sent by schedulers on
//! preemption) set a flag that the training loop polls with [`interrupted`]: save, then exit.
//! A second signal exits at once.
//!
//! ```no_run
//! use wick::checkpoint::{self, Checkpointer};
//! # fn demo(mut engine: wick::Engine) -> anyhow::Result<()> {
//! let ckpt = Checkpointer::new("runs/mnist", 3);
//! checkpoint::install_interrupt_handler()?;
//! let mut start = 0u64;
//! if let Some(resumed) = ckpt.resume(&mut engine)? {
//!     start = resumed.extra["next_step"].as_u64().unwrap_or(0);
//!     println!("resumed from {}", resumed.path.display());
//!     for notice in &resumed.notices {
//!         println!("note: {notice}"); // an older checkpoint, another precision
//!     }
//! }
//! for step in start..1000 {
//!     // engine.step(...)?;
//!     if (step + 1) % 100 == 0 || checkpoint::interrupted() {
//!         ckpt.save(&engine, serde_json::json!({ "next_step": step + 1 }))?;
//!         if checkpoint::interrupted() { break; }
//!     }
//! }
//! # Ok(()) }
//! ```

use crate::data::{Collate, DataLoader, Dataset, LoaderState};
use crate::engine::{Engine, EngineState};
use anyhow::{anyhow, bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Dtype as StDtype, View};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

mod files;
mod interrupt;
mod load;
mod resumed;

use files::*;
pub use interrupt::{
    clear_interrupt, install_interrupt_handler, interrupted, interrupted_exit_code,
    interrupted_on_any_rank, request_interrupt, INTERRUPTED_EXIT_CODE,
};
use load::agree_across_ranks;
pub use load::{load, read_state};
use resumed::newest_complete;
pub use resumed::{ResumeNotice, Resumed};

/// The checkpoint format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Value of [`TrainerState::format`]: marks a wick checkpoint.
pub const FORMAT_NAME: &str = "wick-checkpoint";
/// Master weights file inside a checkpoint directory.
pub const MODEL_FILE: &str = "model.safetensors";
/// Optimizer state file inside a checkpoint directory.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// Trainer state (JSON) file inside a checkpoint directory; written last.
pub const STATE_FILE: &str = "trainer_state.json";

const STEP_PREFIX: &str = "step-";
const TMP_PREFIX: &str = ".tmp-";

/// Size and SHA-256 of one file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    /// Length in bytes.
    pub bytes: u64,
    /// SHA-256 of the content, lowercase hex.
    pub sha256: String,
}

/// The content of `trainer_state.json`.
///
/// Format (version 1):
/// ```json
/// { "format": "wick-checkpoint", "format_version": 1, "wick_version": "0.1.0",
///   "step": 50, "precision": "bf16-mixed", "num_parameters": 1863690, "optimizer": "AdamW",
///   "engine": { "boundaries": 50, "applied_steps": 50,
///               "scaler": { "scale": 1.0, "growth_tracker": 0, "hysteresis_left": 1 } },
///   "files": { "model.safetensors": { "bytes": 7455024, "sha256": "…" },
///              "optimizer.safetensors": { "bytes": 14910996, "sha256": "…" } },
///   "extra": { … whatever the caller passed … } }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// The wick crate version that wrote the checkpoint.
    pub wick_version: String,
    /// The step in the directory name (the engine's accumulation-boundary count).
    pub step: u64,
    /// The precision the run trained in (informative: masters are f32 whatever it is).
    pub precision: String,
    /// Scalar parameters in the model (informative).
    pub num_parameters: u64,
    /// The optimizer that wrote `optimizer.safetensors` (`"AdamW"`, `"Sgd"`): loading into an
    /// engine running another optimizer is an error.
    #[serde(default)]
    pub optimizer: String,
    /// Engine counters and loss-scaler state.
    pub engine: EngineState,
    /// Size and checksum of [`MODEL_FILE`] and [`OPTIMIZER_FILE`].
    pub files: BTreeMap<String, FileDigest>,
    /// The caller's data: data-loader position, RNG state, config, metrics... (`null` if none).
    #[serde(default)]
    pub extra: serde_json::Value,
}

/// Writes checkpoints of an [`Engine`] under one root directory and prunes old ones.
#[derive(Debug, Clone)]
pub struct Checkpointer {
    dir: PathBuf,
    keep_last: usize,
    /// Resumes refuse anything but an exact continuation ([`Checkpointer::exact`]).
    exact: bool,
    /// Steps this checkpointer (or a clone) saved: only those may be replaced by a new save.
    saved: std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<u64>>>,
}

impl Checkpointer {
    /// Checkpoints under `dir` (created on the first save), keeping the `keep_last` newest
    /// `step-*` directories after each successful save (`0`: keep all).
    pub fn new(dir: impl Into<PathBuf>, keep_last: usize) -> Self {
        Self {
            dir: dir.into(),
            keep_last,
            exact: false,
            saved: Default::default(),
        }
    }

    /// This checkpointer, with resumes ([`Self::resume`] and the loader forms) that refuse
    /// anything but an exact continuation of the newest save: a newer incomplete checkpoint
    /// skipped, or a precision other than the saved one (what [`Resumed::notices`] would
    /// list), is an error naming each difference, returned before anything is applied: the
    /// engine and the loader are unchanged.
    pub fn exact(mut self) -> Self {
        self.exact = true;
        self
    }

    /// The root directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How many checkpoints are kept (`0`: all).
    pub fn keep_last(&self) -> usize {
        self.keep_last
    }

    /// Saves `engine` (masters, optimizer state, counters, scaler) plus the caller's `extra`
    /// JSON as `DIR/step-NNNNNN` where `N` is the engine's boundary count, atomically (see the
    /// module docs), then prunes to `keep_last`. Returns the checkpoint's path.
    ///
    /// Errors: the engine is in the middle of an accumulation window (save at a boundary);
    /// `extra` or a state value cannot be serialised; a tensor has a dtype safetensors cannot
    /// hold; any I/O error (the message names the path). On error the checkpoints that existed
    /// before are still complete; a partial `.tmp-*` directory may remain and is removed by a
    /// later save. A failure to prune old checkpoints is logged (`tracing::warn`), not returned.
    ///
    /// Data parallel ([`Engine::with_collective`]): call it on every rank at the same step;
    /// the state is gathered on every rank (with ZeRO-1 this is a collective), rank 0 writes,
    /// and every rank waits for rank 0's result: all return the path, or all return an error.
    ///
    /// Steps are ordered by number: after resuming from an older checkpoint than the newest in
    /// `DIR`, the newer ones (from the abandoned run) stay the [`latest`] until this run passes
    /// them; a warning is logged. Use a fresh directory, or delete them, to branch a run.
    ///
    /// Never overwrites another run's checkpoint: a `step-N` directory that this checkpointer
    /// did not write itself (e.g. an incomplete or damaged newer checkpoint that the resume
    /// fell back past, or an older run's) is first renamed to `step-N.set-aside-<unix time>`
    /// (no longer a checkpoint, never pruned; a warning names both). Saving a step this
    /// checkpointer already saved replaces it atomically.
    pub fn save(&self, engine: &Engine, extra: serde_json::Value) -> Result<PathBuf> {
        let started = Instant::now();
        let state = engine
            .state()
            .context("checkpoint save: reading the engine state")?;
        let step = state.boundaries;
        let store = engine.store();

        // serialise and hash both tensor files in memory first (in parallel): nothing touches
        // the disk on error
        let masters = store.masters();
        let opt_tensors = engine
            .optimizer_state()
            .context("checkpoint save: reading the optimizer state")?;
        // data parallel: every rank gathers (ZeRO-1's state is a collective), rank 0 writes,
        // then every rank learns whether the write succeeded
        let written = if engine.collective().is_some_and(|c| c.rank() != 0) {
            Ok(self.dir.join(step_dir_name(step)))
        } else {
            self.write(engine, state, masters, opt_tensors, extra, started)
        };
        agree_across_ranks(engine, written.is_ok(), "writing the checkpoint (rank 0)")?;
        written
    }

    /// Serialises, writes atomically and prunes (see [`Self::save`]).
    fn write(
        &self,
        engine: &Engine,
        state: EngineState,
        masters: Vec<(String, Tensor)>,
        opt_tensors: Vec<(String, Tensor)>,
        extra: serde_json::Value,
        started: Instant,
    ) -> Result<PathBuf> {
        let store = engine.store();
        let step = state.boundaries;
        let (model, optim) = rayon::join(
            || serialize_tensors(masters, MODEL_FILE),
            || serialize_tensors(opt_tensors, OPTIMIZER_FILE),
        );
        let ((model, model_digest), (optim, optim_digest)) = (model?, optim?);

        let mut files = BTreeMap::new();
        files.insert(MODEL_FILE.to_string(), model_digest);
        files.insert(OPTIMIZER_FILE.to_string(), optim_digest);
        let trainer_state = TrainerState {
            format: FORMAT_NAME.to_string(),
            format_version: FORMAT_VERSION,
            wick_version: env!("CARGO_PKG_VERSION").to_string(),
            step,
            precision: store.precision().to_string(),
            num_parameters: store.num_elements() as u64,
            optimizer: optimizer_name(engine),
            engine: state,
            files,
            extra,
        };
        let json = serde_json::to_vec_pretty(&trainer_state)
            .context("checkpoint save: serialising trainer_state.json (is `extra` valid JSON, without NaN/inf?)")?;

        fs::create_dir_all(&self.dir)
            .with_context(|| format!("checkpoint save: creating {}", self.dir.display()))?;
        self.remove_stale_tmp_dirs();
        let name = step_dir_name(step);
        let pid = std::process::id();
        let tmp = self.dir.join(format!("{TMP_PREFIX}{name}-{pid}"));
        if tmp.exists() {
            fs::remove_dir_all(&tmp)
                .with_context(|| format!("checkpoint save: removing {}", tmp.display()))?;
        }
        fs::create_dir(&tmp)
            .with_context(|| format!("checkpoint save: creating {}", tmp.display()))?;
        write_synced(&tmp.join(MODEL_FILE), &model)?;
        drop(model);
        write_synced(&tmp.join(OPTIMIZER_FILE), &optim)?;
        drop(optim);
        write_synced(&tmp.join(STATE_FILE), &json)?;
        sync_dir(&tmp)?;

        let final_path = self.dir.join(&name);
        let ours = self
            .saved
            .lock()
            .map(|s| s.contains(&step))
            .unwrap_or(false);
        if !ours && final_path.exists() {
            set_aside(&final_path)?;
        }
        install_dir(&tmp, &final_path, &self.dir, pid)?;
        if let Ok(mut s) = self.saved.lock() {
            s.insert(step);
        }
        sync_dir(&self.dir)?;
        tracing::info!(
            "checkpoint {} saved in {:.3} s",
            final_path.display(),
            started.elapsed().as_secs_f64()
        );
        if let Err(e) = self.prune(step) {
            tracing::warn!("checkpoint: pruning old checkpoints failed: {e:#}");
        }
        Ok(final_path)
    }

    /// The newest complete checkpoint under this root, if any (see [`latest`]).
    pub fn latest(&self) -> Result<Option<PathBuf>> {
        latest(&self.dir)
    }

    /// Loads the newest complete checkpoint into `engine` when there is one ([`latest`] then
    /// [`load`]); returns what was loaded. `Ok(None)`: no checkpoint yet (fresh start). Newer
    /// incomplete folders that were skipped, and a precision change, are in
    /// [`Resumed::notices`] (or an error, changing nothing, with [`Self::exact`]). Errors as
    /// [`load`]; the newest complete checkpoint failing to load is an error, never a silent
    /// fallback to an older one.
    pub fn resume(&self, engine: &mut Engine) -> Result<Option<Resumed>> {
        let (newest, skipped) = self.agreed_latest(engine)?;
        let Some(path) = newest else {
            return Ok(None);
        };
        Ok(Some(load::load_checked(
            &path, engine, skipped, self.exact,
        )?))
    }

    /// [`Self::latest`], checked across ranks under data parallelism: every rank must see the
    /// same newest step (or none), else every rank gets an error (ranks resuming from
    /// different steps, or some starting fresh, would diverge or wait on each other).
    fn agreed_latest(&self, engine: &Engine) -> Result<(Option<PathBuf>, Vec<ResumeNotice>)> {
        let found = newest_complete(&self.dir);
        agree_across_ranks(engine, found.is_ok(), "finding the latest checkpoint")?;
        let (found, skipped) = found?;
        warn_skipped(&skipped, found.as_deref());
        let Some(c) = engine.collective().filter(|c| c.world_size() > 1) else {
            return Ok((found, skipped));
        };
        // step + 1 (0: none); exact in f32 below 2^24 steps
        let step = found
            .as_deref()
            .and_then(|p| {
                p.file_name()?
                    .to_str()?
                    .strip_prefix(STEP_PREFIX)?
                    .parse::<u64>()
                    .ok()
            })
            .map_or(0.0, |s| s as f32 + 1.0);
        let t = Tensor::new(&[step, -step], engine.store().device())?;
        let m = c.all_reduce_max(&t)?.to_vec1::<f32>()?;
        let (max, min) = (m[0], -m[1]);
        let show = |v: f32| {
            if v == 0.0 {
                "none".to_string()
            } else {
                format!("step {}", v as u64 - 1)
            }
        };
        ensure!(
            max == min,
            "checkpoint resume: the ranks see different newest checkpoints in {} (rank {}: {};              across ranks from {} to {}); put the checkpoint directory on storage every rank              reads",
            self.dir.display(),
            c.rank(),
            show(step),
            show(min),
            show(max)
        );
        Ok((found, skipped))
    }

    /// [`Self::save`] for a run fed by a [`DataLoader`]: records the loader's position under the
    /// `"loader"` key of `extra` (a JSON object, or null for none), so that
    /// [`Self::resume_with_loader`] continues with exactly the next batch.
    ///
    /// Errors: `extra` is not an object or null; otherwise as [`Self::save`].
    pub fn save_with_loader(
        &self,
        engine: &Engine,
        loader: &LoaderState,
        extra: serde_json::Value,
    ) -> Result<PathBuf> {
        let mut extra = match extra {
            serde_json::Value::Null => serde_json::Value::Object(Default::default()),
            v @ serde_json::Value::Object(_) => v,
            other => bail!("checkpoint extra must be a JSON object, got {other}"),
        };
        extra["loader"] = serde_json::to_value(loader)?;
        self.save(engine, extra)
    }

    /// Resumes `engine` and `loader` from the newest checkpoint written by
    /// [`Self::save_with_loader`]; returns what was loaded, with notices as [`Self::resume`].
    /// `Ok(None)`: no checkpoint yet. On error neither the engine nor the loader changes.
    ///
    /// Errors: the checkpoint has no loader position, the position does not fit this loader
    /// (different batch size, dataset length, ...), or anything [`load`] reports.
    pub fn resume_with_loader<D: Dataset, C: Collate<D::Sample>>(
        &self,
        engine: &mut Engine,
        loader: &mut DataLoader<D, C>,
    ) -> Result<Option<Resumed>> {
        let (newest, skipped) = self.agreed_latest(engine)?;
        let Some(path) = newest else {
            return Ok(None);
        };
        let position = read_state(&path).and_then(|state| {
            serde_json::from_value::<LoaderState>(state.extra["loader"].clone()).with_context(
                || {
                    format!(
                        "{}: trainer_state.json has no loader position",
                        path.display()
                    )
                },
            )
        });
        agree_across_ranks(engine, position.is_ok(), "reading the loader position")?;
        let position = position?;
        let before = loader.state();
        let restored = loader.load_state(&position);
        if let Err(e) =
            agree_across_ranks(engine, restored.is_ok(), "restoring the loader position")
        {
            loader.load_state(&before)?;
            return Err(e);
        }
        restored?;
        match load::load_checked(&path, engine, skipped, self.exact) {
            Ok(resumed) => Ok(Some(resumed)),
            Err(e) => {
                loader.load_state(&before)?;
                Err(e)
            }
        }
    }

    /// [`Self::resume_with_loader`] for a run that was asked to resume: no checkpoint in the
    /// directory is an error instead of a silent fresh start.
    ///
    /// Errors: no complete checkpoint under [`Self::dir`] (the message names the folder and
    /// says how to start fresh), or anything [`Self::resume_with_loader`] reports.
    pub fn resume_existing_with_loader<D: Dataset, C: Collate<D::Sample>>(
        &self,
        engine: &mut Engine,
        loader: &mut DataLoader<D, C>,
    ) -> Result<Resumed> {
        self.resume_with_loader(engine, loader)?.ok_or_else(|| {
            anyhow!(
                "nothing to resume: no checkpoint in {} (no complete step-* folder); start a \
                 fresh run without resuming, or point at the folder that holds the checkpoints",
                self.dir.display()
            )
        })
    }

    /// Keeps the `keep_last` newest checkpoints (and always `just_saved`).
    fn prune(&self, just_saved: u64) -> Result<()> {
        let all = list_checkpoints(&self.dir)?;
        if all.iter().any(|(s, _)| *s > just_saved) {
            tracing::warn!(
                "checkpoint: {} holds checkpoints newer than step {just_saved} (an older run?); \
                 `latest` will pick those",
                self.dir.display()
            );
        }
        if self.keep_last == 0 {
            return Ok(());
        }
        let pid = std::process::id();
        for (s, path) in all.iter().rev().skip(self.keep_last) {
            if *s == just_saved {
                continue;
            }
            // rename first (atomic), so a crash mid-delete never leaves a half `step-*` dir
            let doomed = self
                .dir
                .join(format!("{TMP_PREFIX}prune-{}-{pid}", step_dir_name(*s)));
            fs::rename(path, &doomed)
                .with_context(|| format!("renaming {} for deletion", path.display()))?;
            fs::remove_dir_all(&doomed)
                .with_context(|| format!("deleting {}", doomed.display()))?;
        }
        sync_dir(&self.dir)
    }

    /// Removes `.tmp-*` directories of this process or of processes that no longer exist
    /// (left by a crash). Best effort: failures are logged.
    fn remove_stale_tmp_dirs(&self) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        let me = std::process::id();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with(TMP_PREFIX) {
                continue;
            }
            let Some(pid) = name.rsplit('-').next().and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            if pid == me || !process_alive(pid) {
                if let Err(err) = fs::remove_dir_all(e.path()) {
                    tracing::warn!("checkpoint: cannot remove {}: {err}", e.path().display());
                }
            }
        }
    }
}

/// The newest complete checkpoint under `dir`: the `step-N` directory with the largest `N`
/// that holds all three files. Temporary `.tmp-*` directories are ignored. `Ok(None)` when
/// `dir` does not exist or holds no checkpoint. It does not verify checksums ([`load`] does).
///
/// Errors: `dir` exists but cannot be read.
pub fn latest(dir: impl AsRef<Path>) -> Result<Option<PathBuf>> {
    let (newest, skipped) = newest_complete(dir.as_ref())?;
    warn_skipped(&skipped, newest.as_deref());
    Ok(newest)
}

/// Logs each [`ResumeNotice::SkippedIncomplete`] with what a later save does to the folder.
fn warn_skipped(skipped: &[ResumeNotice], newest: Option<&Path>) {
    for notice in skipped {
        tracing::warn!(
            "{notice}; {}; a save at its step will set it aside (renamed), not overwrite it",
            match newest {
                Some(p) => format!("the newest complete checkpoint is {}", p.display()),
                None => "there is no complete checkpoint".to_string(),
            }
        );
    }
}

/// Every `step-N` directory under `dir`, sorted by step, with the names of the checkpoint
/// files it lacks (none: a complete checkpoint).
fn step_dirs(dir: &Path) -> Result<Vec<(u64, PathBuf, Vec<&'static str>)>> {
    let listing = || format!("listing checkpoints in {}", dir.display());
    let mut out = Vec::new();
    for e in fs::read_dir(dir).with_context(listing)? {
        let e = e.with_context(listing)?;
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(step) = name
            .strip_prefix(STEP_PREFIX)
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        let path = e.path();
        let missing: Vec<&'static str> = [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE]
            .into_iter()
            .filter(|f| !path.join(f).is_file())
            .collect();
        out.push((step, path, missing));
    }
    out.sort();
    Ok(out)
}

/// Renames an existing `step-N` directory that a save would replace to
/// `step-N.set-aside-<unix seconds>` (not a checkpoint name: [`latest`] and pruning ignore it)
/// and warns, naming both.
fn set_aside(path: &Path) -> Result<()> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut aside = path.with_file_name(format!("{name}.set-aside-{secs}"));
    let mut k = 1;
    while aside.exists() {
        aside = path.with_file_name(format!("{name}.set-aside-{secs}-{k}"));
        k += 1;
    }
    fs::rename(path, &aside).with_context(|| {
        format!(
            "checkpoint save: setting {} aside as {}",
            path.display(),
            aside.display()
        )
    })?;
    tracing::warn!(
        "checkpoint: {} existed and was not written by this run: kept as {} (not overwritten)",
        path.display(),
        aside.display()
    );
    Ok(())
}

/// All complete `step-N` checkpoints under `dir`, sorted by step (oldest first).
pub fn list_checkpoints(dir: impl AsRef<Path>) -> Result<Vec<(u64, PathBuf)>> {
    Ok(step_dirs(dir.as_ref())?
        .into_iter()
        .filter(|(_, _, missing)| missing.is_empty())
        .map(|(step, path, _)| (step, path))
        .collect())
}

/// Writes named tensors (any device and float dtype, stored as they are) to one safetensors
/// file atomically ([`write_file_atomic`]). What it writes loads with
/// `candle_core::safetensors::load`, transformers and `safetensors.torch.load_file`.
///
/// Errors: two tensors of one name, an unsupported dtype, or an I/O failure (naming the file).
pub fn save_safetensors_atomic(path: &Path, tensors: Vec<(String, Tensor)>) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| anyhow!("save: {} has no file name", path.display()))?;
    let (bytes, _) = serialize_tensors(tensors, &name)?;
    write_file_atomic(path, &bytes)
}

/// Named tensors (any device and float dtype, stored as they are) as one safetensors file in
/// memory, the bytes [`save_safetensors_atomic`] writes (e.g. to send over a network).
///
/// Errors: two tensors of one name, or an unsupported dtype.
pub fn safetensors_bytes(tensors: Vec<(String, Tensor)>) -> Result<Vec<u8>> {
    Ok(serialize_tensors(tensors, "in-memory safetensors")?.0)
}

/// Writes `bytes` to `path` atomically: a temporary file beside `path`, fsync, rename over
/// `path`, fsync of the directory. A failure removes the temporary file and leaves any
/// previous `path` untouched.
///
/// Errors: an I/O failure, naming the file.
pub fn write_file_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| anyhow!("save: {} has no file name", path.display()))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let written = write_synced(&tmp, bytes).and_then(|()| {
        fs::rename(&tmp, path)
            .with_context(|| format!("save: renaming {} to {}", tmp.display(), path.display()))
    });
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written?;
    sync_dir(&dir)
}
