//! What a load or resume restored, and what in it differs from what the caller asked for.
//!
//! A resume that quietly takes an older checkpoint, or loads masters saved in another
//! precision, changes the run the user asked for. Those facts are returned in
//! [`Resumed::notices`] (and also logged with `tracing`), so a caller without a tracing
//! subscriber still sees them: print them, or accept them; [`Checkpointer::exact`] refuses
//! them before anything is loaded.

use super::*;
use std::fmt;

/// The result of [`load`], [`Checkpointer::resume`] and their loader forms.
#[derive(Debug, Clone)]
pub struct Resumed {
    /// The `step-N` directory that was loaded.
    pub path: PathBuf,
    /// The `extra` JSON given to [`Checkpointer::save`] (data position, config, ...).
    pub extra: serde_json::Value,
    /// What differs from an exact continuation of the newest save; empty when nothing does.
    pub notices: Vec<ResumeNotice>,
}

/// One way a loaded checkpoint differs from what the caller asked for.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ResumeNotice {
    /// A newer `step-N` folder is incomplete (a save was cut off, or files were removed): it
    /// was skipped and an older checkpoint loaded; the steps after the loaded one run again.
    SkippedIncomplete {
        /// The incomplete folder.
        path: PathBuf,
        /// The checkpoint files it lacks (`model.safetensors`, ...).
        missing: Vec<String>,
    },
    /// The checkpoint was saved in another precision: the f32 masters load as they are, but
    /// the working copies and so the losses differ from the original run's.
    PrecisionChanged {
        /// The precision the checkpoint was saved in (`"32"`, `"bf16-mixed"`, `"16-mixed"`).
        saved: String,
        /// The engine's precision.
        running: String,
    },
}

impl fmt::Display for ResumeNotice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ResumeNotice::SkippedIncomplete { path, missing } => write!(
                f,
                "checkpoint {} is incomplete (missing {}): skipped, an older checkpoint was \
                 loaded",
                path.display(),
                missing.join(", ")
            ),
            ResumeNotice::PrecisionChanged { saved, running } => write!(
                f,
                "the checkpoint was saved in {saved} and loaded into {running}: the f32 masters \
                 are exact, the losses will not match the original run's"
            ),
        }
    }
}

/// The loaded folder, then each notice in brackets: `runs/x/step-000040 [note: ...]`.
impl fmt::Display for Resumed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path.display())?;
        for notice in &self.notices {
            write!(f, " [note: {notice}]")?;
        }
        Ok(())
    }
}

/// [`ResumeNotice::SkippedIncomplete`] for every incomplete `step-N` folder newer than the
/// newest complete one under `dir`, with the newest complete one.
pub(super) fn newest_complete(dir: &Path) -> Result<(Option<PathBuf>, Vec<ResumeNotice>)> {
    if !dir.exists() {
        return Ok((None, Vec::new()));
    }
    let dirs = step_dirs(dir)?;
    let newest = dirs
        .iter()
        .rfind(|(_, _, missing)| missing.is_empty())
        .map(|(s, p, _)| (*s, p.clone()));
    let newest_step = newest.as_ref().map(|(s, _)| *s);
    let skipped = dirs
        .into_iter()
        .filter(|(step, _, missing)| !missing.is_empty() && newest_step.is_none_or(|n| *step > n))
        .map(|(_, path, missing)| ResumeNotice::SkippedIncomplete {
            path,
            missing: missing.into_iter().map(str::to_string).collect(),
        })
        .collect();
    Ok((newest.map(|(_, p)| p), skipped))
}
