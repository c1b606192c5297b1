//! The conversations of a `wick finetune` run ([`ChatData`]): read from the `[data]` JSONL
//! files or built from the Shakespeare plays, split into training and held-out conversations,
//! cut to the configured counts, then rendered with the model's chat template and tokenized
//! with their labels and the length policy ([`crate::data::chat::prepare`]), each side with
//! its [`Report`].

use super::config::FinetuneConfig;
use crate::data::chat::{self, ChatExample, Report, Tokenized};
use crate::models::tokenizer::TextTokenizer;
use anyhow::{ensure, Context, Result};
use std::path::PathBuf;

/// The tokenized conversations of a run.
#[derive(Debug, Clone)]
pub struct ChatData {
    /// Training examples, in source order (the epochs shuffle them).
    pub train: Vec<Tokenized>,
    /// Held-out examples (empty when the config has no evaluation data).
    pub eval: Vec<Tokenized>,
    /// What [`chat::prepare`] did with the training conversations.
    pub train_report: Report,
    /// What it did with the held-out ones (`None` without evaluation data).
    pub eval_report: Option<Report>,
    /// Where the two sides came from, for the run's header.
    pub sources: String,
}

/// Reads, splits and tokenizes the conversations `config.data` names (its `max_length` filled
/// by [`FinetuneConfig::fit_to_model`]).
///
/// Errors: a file that cannot be read or a malformed line (naming the file and line); a plays
/// folder that cannot be read; a chat template that fails (naming the example); no training
/// example left after the length policy.
pub fn load(config: &FinetuneConfig, tok: &TextTokenizer) -> Result<ChatData> {
    let d = &config.data;
    let seed = config.schedule.seed;
    let (mut train, mut eval, mut sources) = match &d.shakespeare {
        Some(dir) => {
            let dia = chat::shakespeare_dialogues(dir).context("data.shakespeare")?;
            let what = format!(
                "the Shakespeare dialogues of {} ({} plays to train on)",
                dir.display(),
                dia.train_plays.len()
            );
            if d.eval_fraction.is_some() || !d.eval.is_empty() {
                (dia.train, Vec::new(), what)
            } else {
                let held = format!("; held out: {} other plays", dia.held_out_plays.len());
                (dia.train, dia.held_out, what + &held)
            }
        }
        None => (
            read_all(&d.train, "data.train")?,
            Vec::new(),
            files(&d.train),
        ),
    };
    if let Some(f) = d.eval_fraction {
        (train, eval) = chat::split_held_out(train, f, seed).context("data.eval_fraction")?;
        sources += &format!("; held out: {f} of them (seed {seed})");
    } else if !d.eval.is_empty() {
        eval = read_all(&d.eval, "data.eval")?;
        sources += &format!("; held out: {}", files(&d.eval));
    }
    if let Some(n) = d.max_train_examples {
        train.truncate(n);
    }
    if let Some(n) = d.max_eval_examples {
        eval.truncate(n);
    }
    let (max_len, train_on, policy) = (config.max_length(), d.train_on.chat(), d.overlong.chat());
    let (train, train_report) = chat::prepare(&train, tok, train_on, max_len, policy)
        .context("tokenizing the training conversations")?;
    ensure!(
        !train.is_empty(),
        "no training conversation is left to train on ({train_report}); check data.max_length, \
         data.overlong and data.train_on"
    );
    let (eval, eval_report) = if eval.is_empty() {
        (Vec::new(), None)
    } else {
        let (e, r) = chat::prepare(&eval, tok, train_on, max_len, policy)
            .context("tokenizing the held-out conversations")?;
        (e, Some(r))
    };
    Ok(ChatData {
        train,
        eval,
        train_report,
        eval_report,
        sources,
    })
}

/// The examples of every file, in order.
fn read_all(paths: &[PathBuf], key: &str) -> Result<Vec<ChatExample>> {
    let mut out = Vec::new();
    for p in paths {
        out.extend(chat::read_jsonl(p).with_context(|| key.to_string())?);
    }
    Ok(out)
}

fn files(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
