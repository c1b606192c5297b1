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
//! if let Some((path, extra)) = ckpt.resume(&mut engine)? {
//!     start = extra["next_step"].as_u64().unwrap_or(0);
//!     println!("resumed from {}", path.display());
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
}

impl Checkpointer {
    /// Checkpoints under `dir` (created on the first save), keeping the `keep_last` newest
    /// `step-*` directories after each successful save (`0`: keep all).
    pub fn new(dir: impl Into<PathBuf>, keep_last: usize) -> Self {
        Self {
            dir: dir.into(),
            keep_last,
        }
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
        install_dir(&tmp, &final_path, &self.dir, pid)?;
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

    /// Loads the newest checkpoint into `engine` when there is one ([`latest`] then [`load`]);
    /// returns its path and `extra`. `Ok(None)`: no checkpoint yet (fresh start). Errors as
    /// [`load`]; the newest checkpoint failing to load is an error, never a silent fallback to
    /// an older one.
    pub fn resume(&self, engine: &mut Engine) -> Result<Option<(PathBuf, serde_json::Value)>> {
        match self.latest()? {
            None => Ok(None),
            Some(path) => {
                let extra = load(&path, engine)?;
                Ok(Some((path, extra)))
            }
        }
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
    /// [`Self::save_with_loader`]; returns its path and `extra`. `Ok(None)`: no checkpoint yet.
    /// On error neither the engine nor the loader changes.
    ///
    /// Errors: the checkpoint has no loader position, the position does not fit this loader
    /// (different batch size, dataset length, ...), or anything [`load`] reports.
    pub fn resume_with_loader<D: Dataset, C: Collate<D::Sample>>(
        &self,
        engine: &mut Engine,
        loader: &mut DataLoader<D, C>,
    ) -> Result<Option<(PathBuf, serde_json::Value)>> {
        let Some(path) = self.latest()? else {
            return Ok(None);
        };
        let state = read_state(&path)?;
        let position: LoaderState = serde_json::from_value(state.extra["loader"].clone())
            .with_context(|| {
                format!(
                    "{}: trainer_state.json has no loader position",
                    path.display()
                )
            })?;
        let before = loader.state();
        // data parallel: rank 0 saved its own position; every rank stands at the same batch,
        // so each restores it under its own rank (the world size must match: a different one
        // shards the epoch differently and is refused)
        let position = if engine.collective().is_some() {
            LoaderState {
                rank: before.rank,
                ..position
            }
        } else {
            position
        };
        let restored = loader.load_state(&position);
        if let Err(e) =
            agree_across_ranks(engine, restored.is_ok(), "restoring the loader position")
        {
            loader.load_state(&before)?;
            return Err(e);
        }
        restored?;
        match load(&path, engine) {
            Ok(extra) => Ok(Some((path, extra))),
            Err(e) => {
                loader.load_state(&before)?;
                Err(e)
            }
        }
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
    let dir = dir.as_ref();
    if !dir.exists() {
        return Ok(None);
    }
    Ok(list_checkpoints(dir)?.pop().map(|(_, p)| p))
}

/// All complete `step-N` checkpoints under `dir`, sorted by step (oldest first).
pub fn list_checkpoints(dir: impl AsRef<Path>) -> Result<Vec<(u64, PathBuf)>> {
    let dir = dir.as_ref();
    let entries =
        fs::read_dir(dir).with_context(|| format!("listing checkpoints in {}", dir.display()))?;
    let mut out = Vec::new();
    for e in entries {
        let e = e.with_context(|| format!("listing checkpoints in {}", dir.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(step) = name
            .strip_prefix(STEP_PREFIX)
            .and_then(|s| s.parse::<u64>().ok())
        else {
            continue;
        };
        let path = e.path();
        let complete = [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE]
            .iter()
            .all(|f| path.join(f).is_file());
        if complete {
            out.push((step, path));
        }
    }
    out.sort();
    Ok(out)
}

/// Reads and validates `trainer_state.json` of the checkpoint at `path` (format name and
/// version), without touching the tensor files: to inspect `extra`, the step or the engine
/// state before building a model.
///
/// Errors: the file is missing, unreadable, not valid JSON, or of another format version;
/// the message names the file.
pub fn read_state(path: impl AsRef<Path>) -> Result<TrainerState> {
    let path = path.as_ref();
    let file = path.join(STATE_FILE);
    if !file.exists() {
        let hint = if path.is_dir() && list_checkpoints(path).is_ok_and(|l| !l.is_empty()) {
            " (this looks like a checkpoint root: pass checkpoint::latest(dir) instead)"
        } else {
            ""
        };
        bail!(
            "checkpoint {}: {STATE_FILE} is missing{hint}",
            path.display()
        );
    }
    let bytes =
        fs::read(&file).with_context(|| format!("checkpoint {}: cannot read", file.display()))?;
    let raw: serde_json::Value = serde_json::from_slice(&bytes).with_context(|| {
        format!(
            "checkpoint {}: not valid JSON (corrupt or truncated file)",
            file.display()
        )
    })?;
    let format = raw.get("format").and_then(|v| v.as_str());
    ensure!(
        format == Some(FORMAT_NAME),
        "checkpoint {}: not a wick checkpoint (\"format\" is {:?}, expected {FORMAT_NAME:?})",
        file.display(),
        format
    );
    let version = raw.get("format_version").and_then(|v| v.as_u64());
    let writer = raw
        .get("wick_version")
        .and_then(|v| v.as_str())
        .unwrap_or("?");
    ensure!(
        version == Some(FORMAT_VERSION as u64),
        "checkpoint {}: wrong version: format_version {} (written by wick {writer}); this wick {} \
         reads format_version {FORMAT_VERSION}",
        file.display(),
        version.map_or_else(|| "missing".to_string(), |v| v.to_string()),
        env!("CARGO_PKG_VERSION")
    );
    let state: TrainerState = serde_json::from_value(raw)
        .with_context(|| format!("checkpoint {}: invalid trainer state", file.display()))?;
    let s = state.engine.scaler;
    ensure!(
        s.scale.is_finite() && s.scale > 0.0,
        "checkpoint {}: invalid loss scale {} in engine.scaler",
        file.display(),
        s.scale
    );
    ensure!(
        state.engine.applied_steps <= state.engine.boundaries,
        "checkpoint {}: engine.applied_steps {} > engine.boundaries {}",
        file.display(),
        state.engine.applied_steps,
        state.engine.boundaries
    );
    Ok(state)
}

/// Loads the checkpoint directory `path` (a `step-N` directory) into `engine`: masters (and
/// working copies re-derived from them), optimizer state, counters and scaler state. Returns
/// the `extra` JSON given to [`Checkpointer::save`].
///
/// Everything is validated before the engine is changed: format version, size and SHA-256 of
/// both tensor files, safetensors structure, that `model.safetensors` holds exactly the
/// model's parameters as f32 tensors of the right shapes, and that every optimizer-state
/// tensor belongs to a parameter. Errors name the file and what is wrong (missing tensor,
/// unexpected tensor, shape or dtype mismatch, truncated or corrupt file, checksum mismatch,
/// wrong version); the engine is then unchanged. The checkpoint on disk is only read.
pub fn load(path: impl AsRef<Path>, engine: &mut Engine) -> Result<serde_json::Value> {
    let started = Instant::now();
    let path = path.as_ref();
    // read and validate everything first; under data parallelism every rank then agrees before
    // anything collective runs (a rank that failed alone would leave the others waiting)
    let checked = validate(path, engine);
    agree_across_ranks(engine, checked.is_ok(), "reading the checkpoint")?;
    let Validated {
        state,
        model,
        optim,
        model_file,
        optim_file,
    } = checked?;

    // apply: the engine first (atomic: it checks the optimizer map before changing anything),
    // then the masters (checked above, so only a device error can fail there; then roll back)
    let rollback = match engine.state() {
        Ok(s) => Some((s, engine.optimizer_state()?)),
        Err(_) => None,
    };
    engine
        .load_state(&state.engine, &optim)
        .with_context(|| format!("checkpoint {}", optim_file.display()))?;
    if let Err(e) = engine.store().load_masters(&model) {
        let restored = match rollback {
            Some((s, o)) => {
                let o: HashMap<String, Tensor> = o.into_iter().collect();
                engine.load_state(&s, &o).is_ok()
            }
            None => false,
        };
        return Err(e.context(format!(
            "checkpoint {}: writing the master weights failed ({})",
            model_file.display(),
            if restored {
                "engine state rolled back; the masters may be partly overwritten"
            } else {
                "the engine may be partly restored: load again"
            }
        )));
    }
    tracing::info!(
        "checkpoint {} loaded in {:.3} s",
        path.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(state.extra)
}

/// A checkpoint read from disk and checked against the engine, not applied yet.
struct Validated {
    state: TrainerState,
    model: HashMap<String, Tensor>,
    optim: HashMap<String, Tensor>,
    model_file: PathBuf,
    optim_file: PathBuf,
}

/// Reads and checks the checkpoint at `path` against `engine` (see [`load`]); changes nothing.
fn validate(path: &Path, engine: &Engine) -> Result<Validated> {
    let state = read_state(path)?;
    let running = optimizer_name(engine);
    ensure!(
        state.optimizer.is_empty() || state.optimizer == running,
        "checkpoint {}: the optimizer state was written by {}, the engine runs {running}; \
         build the engine with the checkpoint's optimizer",
        path.join(STATE_FILE).display(),
        state.optimizer
    );
    let precision = engine.store().precision().to_string();
    if state.precision != precision {
        tracing::warn!(
            "checkpoint {}: saved in {}, loading into {precision} (masters are f32: allowed, \
             but the losses will not match the original run)",
            path.display(),
            state.precision
        );
    }
    let (model, optim) = rayon::join(
        || read_checked(path, MODEL_FILE, &state),
        || read_checked(path, OPTIMIZER_FILE, &state),
    );
    let (model, optim) = (model?, optim?);

    // model.safetensors: exactly the model's parameters, f32, same shapes
    let model_file = path.join(MODEL_FILE);
    let params = engine.store().params();
    let missing: Vec<&str> = params
        .iter()
        .filter(|p| !model.contains_key(&p.name))
        .map(|p| p.name.as_str())
        .collect();
    ensure!(
        missing.is_empty(),
        "checkpoint {}: missing tensor(s) {} (the model has {} parameters, the file {} tensors; a different model?)",
        model_file.display(),
        name_list(&missing),
        params.len(),
        model.len()
    );
    let mut unexpected: Vec<&str> = model
        .keys()
        .filter(|k| engine.store().get(k).is_none())
        .map(String::as_str)
        .collect();
    unexpected.sort_unstable();
    ensure!(
        unexpected.is_empty(),
        "checkpoint {}: unexpected tensor(s) {} that the model does not have (a different model?)",
        model_file.display(),
        name_list(&unexpected)
    );
    let mut bad = Vec::new();
    for p in &params {
        let t = &model[&p.name];
        if t.dims() != p.master.dims() {
            bad.push(format!(
                "shape mismatch for {:?}: the file has {:?}, the model expects {:?}",
                p.name,
                t.dims(),
                p.master.dims()
            ));
        } else if t.dtype() != DType::F32 {
            bad.push(format!(
                "dtype mismatch for {:?}: {:?}, master weights are f32",
                p.name,
                t.dtype()
            ));
        }
    }
    ensure!(
        bad.is_empty(),
        "checkpoint {}: {}",
        model_file.display(),
        if bad.len() > 5 {
            format!("{}; and {} more", bad[..5].join("; "), bad.len() - 5)
        } else {
            bad.join("; ")
        }
    );

    // optimizer.safetensors: every entry is "<param>.<field>" of a known parameter, shaped
    // like it (moments) or with one element (counters)
    let optim_file = path.join(OPTIMIZER_FILE);
    let by_name: HashMap<&str, &[usize]> = params
        .iter()
        .map(|p| (p.name.as_str(), p.master.dims()))
        .collect();
    let mut names: Vec<&String> = optim.keys().collect();
    names.sort();
    for name in names {
        let t = &optim[name];
        let owner = name
            .rmatch_indices('.')
            .map(|(i, _)| &name[..i])
            .find(|prefix| by_name.contains_key(prefix));
        let Some(owner) = owner else {
            bail!(
                "checkpoint {}: optimizer state {name:?} belongs to no parameter of the model (a different model?)",
                optim_file.display()
            );
        };
        let pshape = by_name[owner];
        ensure!(
            t.dims() == pshape || t.elem_count() == 1,
            "checkpoint {}: shape mismatch for {name:?}: the file has {:?}, parameter {owner:?} has {:?}",
            optim_file.display(),
            t.dims(),
            pshape
        );
    }
    Ok(Validated {
        state,
        model,
        optim,
        model_file,
        optim_file,
    })
}

/// Under data parallelism (a collective of world size > 1 attached to `engine`): every rank
/// reports whether its part of `what` succeeded (an all-reduce MAX of a failure flag, which is
/// also a barrier). A rank whose own part failed gets `Ok` here and returns its own error; the
/// others get an error saying another rank failed. Without a collective: `Ok`.
fn agree_across_ranks(engine: &Engine, ok: bool, what: &str) -> Result<()> {
    let Some(c) = engine.collective().filter(|c| c.world_size() > 1) else {
        return Ok(());
    };
    let flag = Tensor::new(&[if ok { 0f32 } else { 1f32 }], engine.store().device())?;
    let failed = c
        .all_reduce_max(&flag)
        .with_context(|| format!("checkpoint: agreeing across ranks on {what}"))?
        .to_vec1::<f32>()?[0];
    ensure!(
        failed == 0.0 || !ok,
        "checkpoint: {what} failed on another rank (rank {} of {} is fine here); see that rank's error",
        c.rank(),
        c.world_size()
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Ctrl-C

static INTERRUPTED: AtomicBool = AtomicBool::new(false);
static HANDLER: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();

/// Installs a handler for SIGINT (Ctrl-C), SIGTERM and SIGHUP that sets the flag read by
/// [`interrupted`]; a second signal exits the process at once with status 130. Call it once
/// before training (later calls are no-ops returning the first call's outcome). The training
/// loop polls [`interrupted`] at a step boundary, saves a checkpoint and stops.
///
/// Errors: another signal handler was already installed through the `ctrlc` crate, or the
/// operating system refused.
pub fn install_interrupt_handler() -> Result<()> {
    HANDLER
        .get_or_init(|| {
            ctrlc::set_handler(|| {
                if INTERRUPTED.swap(true, Ordering::SeqCst) {
                    std::process::exit(130);
                }
                eprintln!("\ninterrupt: saving a checkpoint at the next step boundary (again to quit now)");
            })
            .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(|e| anyhow!("installing the Ctrl-C handler: {e}"))
}

/// True once SIGINT/SIGTERM/SIGHUP arrived after [`install_interrupt_handler`] (or after
/// [`request_interrupt`]).
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Sets the interrupt flag by hand (e.g. from a time limit or a test).
pub fn request_interrupt() {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Clears the interrupt flag (e.g. after saving, to continue).
pub fn clear_interrupt() {
    INTERRUPTED.store(false, Ordering::SeqCst);
}

// ---------------------------------------------------------------------------------------------
// helpers

/// The optimizer's name: the variant of [`crate::engine::OptimizerConfig`] (`"AdamW"`, `"Sgd"`).
fn optimizer_name(engine: &Engine) -> String {
    let debug = format!("{:?}", engine.config().optimizer);
    debug
        .split(|c: char| !c.is_alphanumeric() && c != '_')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// `["a", "b", ...]`, at most 10 names.
fn name_list(names: &[&str]) -> String {
    let shown: Vec<String> = names.iter().take(10).map(|n| format!("{n:?}")).collect();
    if names.len() > 10 {
        format!("[{}, ... {} more]", shown.join(", "), names.len() - 10)
    } else {
        format!("[{}]", shown.join(", "))
    }
}

fn step_dir_name(step: u64) -> String {
    format!("{STEP_PREFIX}{step:06}")
}

fn digest(bytes: &[u8]) -> FileDigest {
    FileDigest {
        bytes: bytes.len() as u64,
        sha256: hex(&Sha256::digest(bytes)),
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Reads `dir/file`, checks its size and SHA-256 against `state`, and parses it as
/// safetensors into CPU tensors.
fn read_checked(dir: &Path, file: &str, state: &TrainerState) -> Result<HashMap<String, Tensor>> {
    let path = dir.join(file);
    let expected = state.files.get(file).ok_or_else(|| {
        anyhow!(
            "checkpoint {}: no checksum for {file} in {STATE_FILE}",
            dir.join(STATE_FILE).display()
        )
    })?;
    let bytes =
        fs::read(&path).with_context(|| format!("checkpoint {}: cannot read", path.display()))?;
    ensure!(
        bytes.len() as u64 == expected.bytes,
        "checkpoint {}: truncated or incomplete file: {} bytes, {STATE_FILE} records {}",
        path.display(),
        bytes.len(),
        expected.bytes
    );
    let got = hex(&Sha256::digest(&bytes));
    ensure!(
        got == expected.sha256,
        "checkpoint {}: checksum mismatch: sha256 {got}, {STATE_FILE} records {} (the file is \
         corrupt or was modified)",
        path.display(),
        expected.sha256
    );
    candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).with_context(|| {
        format!(
            "checkpoint {}: corrupt file: not a valid safetensors file",
            path.display()
        )
    })
}

/// One tensor's bytes, ready for `safetensors::serialize`.
struct Raw {
    dtype: StDtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &Raw {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn le_bytes<T: Copy, const N: usize>(v: Vec<T>, f: fn(T) -> [u8; N]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * N);
    for x in v {
        out.extend_from_slice(&f(x));
    }
    out
}

fn raw_tensor(t: &Tensor) -> Result<Raw> {
    let flat = t.flatten_all()?.to_device(&Device::Cpu)?;
    let (dtype, data) = match t.dtype() {
        DType::F32 => (
            StDtype::F32,
            le_bytes(flat.to_vec1::<f32>()?, f32::to_le_bytes),
        ),
        DType::F64 => (
            StDtype::F64,
            le_bytes(flat.to_vec1::<f64>()?, f64::to_le_bytes),
        ),
        DType::BF16 => (
            StDtype::BF16,
            le_bytes(flat.to_vec1::<half::bf16>()?, half::bf16::to_le_bytes),
        ),
        DType::F16 => (
            StDtype::F16,
            le_bytes(flat.to_vec1::<half::f16>()?, half::f16::to_le_bytes),
        ),
        DType::U32 => (
            StDtype::U32,
            le_bytes(flat.to_vec1::<u32>()?, u32::to_le_bytes),
        ),
        DType::I64 => (
            StDtype::I64,
            le_bytes(flat.to_vec1::<i64>()?, i64::to_le_bytes),
        ),
        DType::U8 => (StDtype::U8, flat.to_vec1::<u8>()?),
        other => bail!("dtype {other:?} is not supported in checkpoints"),
    };
    Ok(Raw {
        dtype,
        shape: t.dims().to_vec(),
        data,
    })
}

/// Serialises named tensors (any device) into a safetensors byte buffer; returns it with its
/// size and SHA-256.
fn serialize_tensors(tensors: Vec<(String, Tensor)>, file: &str) -> Result<(Vec<u8>, FileDigest)> {
    let mut raws = BTreeMap::new();
    for (name, t) in tensors {
        let raw =
            raw_tensor(&t).with_context(|| format!("checkpoint save: {file}: tensor {name:?}"))?;
        if raws.insert(name.clone(), raw).is_some() {
            bail!("checkpoint save: {file}: two tensors are named {name:?}");
        }
    }
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let bytes = safetensors::serialize(raws.iter().map(|(k, v)| (k.as_str(), v)), Some(meta))
        .map_err(|e| anyhow!("checkpoint save: {file}: safetensors serialisation failed: {e}"))?;
    drop(raws);
    let d = digest(&bytes);
    Ok((bytes, d))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path)
        .with_context(|| format!("checkpoint save: creating {}", path.display()))?;
    f.write_all(bytes)
        .with_context(|| format!("checkpoint save: writing {}", path.display()))?;
    f.sync_all()
        .with_context(|| format!("checkpoint save: fsync {}", path.display()))?;
    Ok(())
}

/// fsyncs a directory so that the entries created or renamed in it are durable.
fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("checkpoint: fsync of directory {}", dir.display()))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Moves the finished `tmp` directory to `dst`. When `dst` exists (the same step saved
/// twice), exchanges the two atomically where the OS can, then deletes the old one.
fn install_dir(tmp: &Path, dst: &Path, root: &Path, pid: u32) -> Result<()> {
    if !dst.exists() {
        return fs::rename(tmp, dst).with_context(|| {
            format!(
                "checkpoint save: renaming {} to {}",
                tmp.display(),
                dst.display()
            )
        });
    }
    if exchange(tmp, dst) {
        // `tmp` now holds the old checkpoint
        sync_dir(root)?;
        fs::remove_dir_all(tmp)
            .with_context(|| format!("checkpoint save: removing {}", tmp.display()))?;
        return Ok(());
    }
    // no atomic exchange: move the old one aside (a short window without this step's
    // directory; earlier checkpoints stay intact), then move the new one in
    let name = dst
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let old = root.join(format!("{TMP_PREFIX}old-{name}-{pid}"));
    fs::rename(dst, &old).with_context(|| {
        format!(
            "checkpoint save: renaming {} to {}",
            dst.display(),
            old.display()
        )
    })?;
    if let Err(e) = fs::rename(tmp, dst) {
        let _ = fs::rename(&old, dst); // put the previous checkpoint back
        return Err(e).with_context(|| {
            format!(
                "checkpoint save: renaming {} to {}",
                tmp.display(),
                dst.display()
            )
        });
    }
    sync_dir(root)?;
    fs::remove_dir_all(&old).with_context(|| format!("checkpoint save: removing {}", old.display()))
}

/// Atomically swaps two paths (Linux `renameat2(RENAME_EXCHANGE)`); false when unsupported.
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> bool {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let (Ok(ca), Ok(cb)) = (
        CString::new(a.as_os_str().as_bytes()),
        CString::new(b.as_os_str().as_bytes()),
    ) else {
        return false;
    };
    // SAFETY: both pointers are valid NUL-terminated strings for the duration of the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    rc == 0
}

#[cfg(not(target_os = "linux"))]
fn exchange(_a: &Path, _b: &Path) -> bool {
    false
}

/// Whether process `pid` still exists (Linux: /proc; elsewhere assume it does, so that
/// another process's save in progress is never removed).
fn process_alive(pid: u32) -> bool {
    let proc_root = Path::new("/proc");
    if proc_root.join("self").exists() {
        proc_root.join(pid.to_string()).exists()
    } else {
        true
    }
}
