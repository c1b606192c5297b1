//! The run's metrics files, in the [`crate::trainer`]'s format (`metrics.csv` with
//! [`CSV_HEADER`], `metrics.jsonl` with the same rows), so `wick plot` and the Trainer's plots
//! read them: a fresh run replaces them; a resumed run keeps the rows up to the step it
//! resumed from and appends, so the files cover the whole run. Each row is flushed as written.

use crate::trainer::{MetricsRow, CSV_HEADER};
use anyhow::{bail, Context, Result};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;

/// `metrics.csv` and `metrics.jsonl` of one run.
pub struct MetricsWriter {
    csv: BufWriter<File>,
    jsonl: BufWriter<File>,
}

impl MetricsWriter {
    /// Opens the files in `dir` (created if missing): replaced for a fresh run
    /// (`resumed_at = None`), cut after step `s` and appended to for a run resumed at `s`.
    ///
    /// Errors: the folder or a file cannot be created, read or written; an existing
    /// `metrics.csv` with another header (naming the file).
    pub fn open(dir: &Path, resumed_at: Option<u64>) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let (csv, jsonl) = (dir.join("metrics.csv"), dir.join("metrics.jsonl"));
        let open = |p: &Path, append: bool| -> Result<BufWriter<File>> {
            let f = OpenOptions::new()
                .create(true)
                .write(true)
                .append(append)
                .truncate(!append)
                .open(p)
                .with_context(|| format!("opening {}", p.display()))?;
            Ok(BufWriter::new(f))
        };
        let append = match resumed_at {
            Some(step) => {
                keep_up_to(&csv, step, true)?;
                keep_up_to(&jsonl, step, false)?;
                true
            }
            None => false,
        };
        let mut w = Self {
            csv: open(&csv, append)?,
            jsonl: open(&jsonl, append)?,
        };
        if std::fs::metadata(&csv).map(|m| m.len()).unwrap_or(0) == 0 {
            writeln!(w.csv, "{CSV_HEADER}")?;
            w.csv.flush()?;
        }
        Ok(w)
    }

    /// Writes `row` to both files and flushes them.
    ///
    /// Errors: an I/O failure.
    pub fn write(&mut self, r: &MetricsRow) -> Result<()> {
        let f = |v: Option<f64>| v.map(|x| format!("{x}")).unwrap_or_default();
        writeln!(
            self.csv,
            "{},{},{},{},{},{},{},{},{}",
            r.step,
            r.epoch,
            f(r.loss),
            f(r.val_loss),
            f(r.lr),
            f(r.grad_norm),
            f(r.loss_scale),
            f(r.samples_per_s),
            f(r.tokens_per_s)
        )?;
        serde_json::to_writer(&mut self.jsonl, r)?;
        writeln!(self.jsonl)?;
        self.csv.flush()?;
        self.jsonl.flush()?;
        Ok(())
    }
}

/// The step of a row: a CSV row's first cell, a JSONL row's `step`.
fn row_step(line: &str, csv: bool) -> Option<u64> {
    if csv {
        line.split(',').next()?.trim().parse().ok()
    } else {
        serde_json::from_str::<serde_json::Value>(line).ok()?["step"].as_u64()
    }
}

/// Rewrites `path` (if it exists) with the rows of steps `<= step` only, through a temporary
/// file and a rename; a CSV keeps its header, which must be [`CSV_HEADER`].
fn keep_up_to(path: &Path, step: u64, csv: bool) -> Result<()> {
    if !path.exists() {
        return Ok(());
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text.lines();
    let mut kept = String::new();
    if csv {
        match lines.next().map(str::trim) {
            None | Some(CSV_HEADER) => {}
            Some(other) => bail!(
                "{}: the header is {other:?}, not {CSV_HEADER:?}, so the resumed run cannot \
                 append to it; move the file away or choose another save.dir",
                path.display()
            ),
        }
        kept.push_str(CSV_HEADER);
        kept.push('\n');
    }
    for line in lines.filter(|l| row_step(l, csv).is_some_and(|s| s <= step)) {
        kept.push_str(line);
        kept.push('\n');
    }
    crate::checkpoint::write_file_atomic(path, kept.as_bytes())
}
