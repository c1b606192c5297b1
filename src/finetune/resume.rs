//! Checking a checkpoint against the run that wants to continue it, before anything is loaded:
//! the checkpoint's `extra["run"]` (the fingerprint of the run that saved it: the settings that
//! change the steps' results) must equal this run's, and its step must be before this run's
//! last. `examples/finetune.rs` (flags) and `wick finetune` (the config file) share it.

use crate::checkpoint;
use anyhow::{ensure, Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The checkpoint a run continues, checked by [`check_prior`].
#[derive(Debug, Clone)]
pub struct Prior {
    /// The `step-N` folder.
    pub path: PathBuf,
    /// Its step (optimizer steps done).
    pub step: u64,
    /// Its `extra` JSON (the fingerprint under `"run"`, and what the run stored beside it).
    pub extra: Value,
}

/// The keys of `ours` whose value in `theirs` differs, as `key THEIRS (this run: OURS)`.
pub fn differences(ours: &Value, theirs: &Value) -> Vec<String> {
    ours.as_object()
        .into_iter()
        .flatten()
        .filter(|(k, v)| theirs.get(k.as_str()) != Some(v))
        .map(|(k, v)| {
            let t = theirs.get(k.as_str()).unwrap_or(&Value::Null);
            format!("{k} {t} (this run: {v})")
        })
        .collect()
}

/// Reads the checkpoint at `path` and checks it against this run: its `extra["run"]` must equal
/// `fingerprint` key by key, and its step must be below `last_step` (when given). `fix` ends
/// the error of a different run (e.g. "pass the original run's flags").
///
/// Errors: an unreadable checkpoint (naming it), a different run (naming each key with both
/// values), a checkpoint at or past `last_step`.
pub fn check_prior(
    path: &Path,
    fingerprint: &Value,
    last_step: Option<u64>,
    fix: &str,
) -> Result<Prior> {
    let state = checkpoint::read_state(path)
        .with_context(|| format!("reading the checkpoint {}", path.display()))?;
    let differ = differences(fingerprint, &state.extra["run"]);
    ensure!(
        differ.is_empty(),
        "{} was made by a different run: {}; {fix}",
        path.display(),
        differ.join(", ")
    );
    if let Some(last) = last_step {
        ensure!(
            state.step < last,
            "{} is at step {}, which already reaches this run's last step {last}",
            path.display(),
            state.step
        );
    }
    Ok(Prior {
        path: path.to_path_buf(),
        step: state.step,
        extra: state.extra,
    })
}
