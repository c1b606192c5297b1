//! The metrics files of a run: `metrics.csv` and `metrics.jsonl`, one row per log step or
//! evaluation. A fresh run creates them; a resumed run keeps the rows up to the step it resumed
//! from (dropping those of the abandoned steps after it) and appends, so the files, and the
//! plots drawn from them, cover the whole run.
//!
//! Throughput columns: `samples_per_s` is always samples per second; `tokens_per_s` is filled
//! when the run has tokens ([`super::TrainerConfig::tokens_per_sample`]), empty otherwise. Both
//! are over the wall-clock seconds of the steps since the previous row, evaluations and hooks
//! excluded ([`crate::throughput`]).

use super::Metrics;
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;

/// One row of the metrics files. Empty fields are written as empty CSV cells / omitted JSON.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MetricsRow {
    /// Optimizer step.
    pub step: u64,
    /// Epoch (0-based).
    pub epoch: u64,
    /// Mean micro-batch training loss since the previous row (every micro-batch counts).
    pub loss: Option<f64>,
    /// Validation loss, when this row carries an evaluation.
    pub val_loss: Option<f64>,
    /// Learning rate of the last step.
    pub lr: Option<f64>,
    /// Global gradient norm of the last step.
    pub grad_norm: Option<f64>,
    /// Loss scale of the last step.
    pub loss_scale: Option<f64>,
    /// Samples trained on per wall-clock second of the steps since the previous row.
    pub samples_per_s: Option<f64>,
    /// Tokens trained on per wall-clock second of the same steps (samples x
    /// `tokens_per_sample`); `None` when the run has no tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_per_s: Option<f64>,
    /// Every metric of the evaluation (JSONL only).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub eval: Metrics,
}

/// The `metrics.csv` and `metrics.jsonl` writers of one run (the [`super::Trainer`]'s and
/// `wick finetune`'s).
pub struct MetricsFiles {
    csv: BufWriter<File>,
    jsonl: BufWriter<File>,
}

/// The header of `metrics.csv`.
pub const CSV_HEADER: &str =
    "step,epoch,loss,val_loss,lr,grad_norm,loss_scale,samples_per_s,tokens_per_s";

/// The header written before the `tokens_per_s` column existed (its `samples_per_s` held tokens/s
/// for runs with tokens). A resumed run upgrades such a file: the header becomes [`CSV_HEADER`]
/// and each kept row gets an empty `tokens_per_s` cell.
const OLD_CSV_HEADER: &str = "step,epoch,loss,val_loss,lr,grad_norm,loss_scale,samples_per_s";

impl MetricsFiles {
    /// Opens the files in `dir` (created if missing). `resumed_at`: `None` for a fresh run
    /// (the files are replaced); `Some(step)` for a run resumed at `step` (rows after `step`,
    /// left by the abandoned part of the earlier run, are dropped; new rows are appended).
    ///
    /// Errors: `dir` cannot be created, a file cannot be read or written, or an existing
    /// `metrics.csv` has another header (written by something else; an older wick's header
    /// without `tokens_per_s` is upgraded, see [`CSV_HEADER`]).
    pub fn open(dir: &Path, resumed_at: Option<u64>) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let (csv, jsonl) = (dir.join("metrics.csv"), dir.join("metrics.jsonl"));
        let (mut csv_w, jsonl_w) = match resumed_at {
            Some(step) if csv.exists() || jsonl.exists() => {
                keep_rows_up_to(&csv, step, csv_step, true)?;
                keep_rows_up_to(&jsonl, step, jsonl_step, false)?;
                (append(&csv)?, append(&jsonl)?)
            }
            _ => (create(&csv)?, create(&jsonl)?),
        };
        if std::fs::metadata(&csv).map(|m| m.len()).unwrap_or(0) == 0 {
            writeln!(csv_w, "{CSV_HEADER}")?;
            csv_w.flush()?;
        }
        Ok(Self {
            csv: csv_w,
            jsonl: jsonl_w,
        })
    }

    /// Writes one row to both files and flushes them.
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

fn create(path: &Path) -> Result<BufWriter<File>> {
    Ok(BufWriter::new(
        File::create(path).with_context(|| format!("creating {}", path.display()))?,
    ))
}

fn append(path: &Path) -> Result<BufWriter<File>> {
    let f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {} to append", path.display()))?;
    Ok(BufWriter::new(f))
}

/// The step of a `metrics.csv` row (its first cell).
fn csv_step(line: &str) -> Option<u64> {
    line.split(',').next()?.trim().parse().ok()
}

/// The step of a `metrics.jsonl` row.
fn jsonl_step(line: &str) -> Option<u64> {
    serde_json::from_str::<serde_json::Value>(line).ok()?["step"].as_u64()
}

/// Rewrites `path` (if it exists) with only the rows whose step is `<= step` (lines without
/// a step, e.g. a torn last line, are dropped too), through a temporary file and a rename.
/// With `csv_header`, the first line must be [`CSV_HEADER`] or [`OLD_CSV_HEADER`] (upgraded).
fn keep_rows_up_to(
    path: &Path,
    step: u64,
    row_step: fn(&str) -> Option<u64>,
    csv_header: bool,
) -> Result<()> {
    if !path.exists() {
        return Ok(());
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text.lines();
    let mut kept = String::new();
    // rows of an old-header file get the missing `tokens_per_s` cell
    let mut cell = "";
    if csv_header {
        match lines.next().map(str::trim) {
            None => {}
            Some(CSV_HEADER) => {}
            Some(OLD_CSV_HEADER) => cell = ",",
            Some(first) => bail!(
                "{}: the header is {first:?}, not wick's {CSV_HEADER:?}, so the resumed run \
                 cannot append to it; move the file away or choose another metrics folder",
                path.display()
            ),
        }
        kept.push_str(CSV_HEADER);
        kept.push('\n');
    }
    for line in lines {
        if row_step(line).is_some_and(|s| s <= step) {
            kept.push_str(line);
            kept.push_str(cell);
            kept.push('\n');
        }
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, kept).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `metrics.csv` of an older wick (no `tokens_per_s` column) resumed at step 2: the rows up
    /// to 2 are kept with an empty `tokens_per_s` cell, under the new header, and the new row
    /// appends with both columns. A foreign header is refused and the file left as it was.
    #[test]
    fn a_resume_upgrades_the_old_header_and_refuses_a_foreign_one() -> Result<()> {
        let dir = std::env::temp_dir().join(format!("wick-metrics-old-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let csv = dir.join("metrics.csv");
        std::fs::write(
            &csv,
            format!("{OLD_CSV_HEADER}\n1,0,2.5,,0.001,,,640\n2,0,2.25,,0.001,,,650\n3,0,2,,,,,1\n"),
        )?;
        let mut files = MetricsFiles::open(&dir, Some(2))?;
        files.write(&MetricsRow {
            step: 3,
            samples_per_s: Some(10.0),
            tokens_per_s: Some(80.0),
            ..Default::default()
        })?;
        drop(files);
        assert_eq!(
            std::fs::read_to_string(&csv)?,
            "step,epoch,loss,val_loss,lr,grad_norm,loss_scale,samples_per_s,tokens_per_s\n\
             1,0,2.5,,0.001,,,640,\n2,0,2.25,,0.001,,,650,\n3,0,,,,,,10,80\n"
        );
        let jsonl = std::fs::read_to_string(dir.join("metrics.jsonl"))?;
        assert!(jsonl.contains("\"tokens_per_s\":80.0"), "{jsonl}");

        let foreign = "step,loss\n1,2.5\n";
        std::fs::write(&csv, foreign)?;
        let err = MetricsFiles::open(&dir, Some(2)).err().expect("refused");
        assert!(format!("{err:#}").contains("move the file away"), "{err:#}");
        assert_eq!(std::fs::read_to_string(&csv)?, foreign);
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
