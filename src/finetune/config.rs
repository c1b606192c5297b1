//! The TOML file of `wick finetune --config FILE` ([`FinetuneConfig`]): one table per concern,
//! every table `deny_unknown_fields` (a misspelt key is an error naming the key, its line and
//! the file), values checked after parsing with errors that name the key
//! (`tuning.r must be >= 1`). Defaults that depend on another key (the learning rate on the
//! method, the packing budget on the maximum length) are filled in by
//! [`FinetuneConfig::from_toml_file`] and [`FinetuneConfig::fit_to_model`], so the parsed
//! config says exactly what runs. docs/finetune.md documents every key.

use crate::lora::LoraConfig;
use crate::models::FineTune;
use crate::Precision;
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The whole file. `[model]` and `[data]` are required; every other table and key has a
/// default (docs/finetune.md lists them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FinetuneConfig {
    /// `"cpu"` or `"cuda"` (GPU 0; a `--features cuda` build).
    #[serde(default = "default_device")]
    pub device: String,
    /// Continue a run: `false` (default), `true` (the newest checkpoint under
    /// `save.dir/checkpoints`), or a checkpoint folder (`.../checkpoints/step-000040`).
    #[serde(default)]
    pub resume: Resume,
    /// The model to fine-tune.
    pub model: ModelSection,
    /// The conversations.
    pub data: DataSection,
    /// How examples are grouped into micro-batches.
    #[serde(default)]
    pub batch: BatchSection,
    /// LoRA or full fine-tuning, and the precision.
    #[serde(default)]
    pub tuning: TuningSection,
    /// Optimizer and learning-rate schedule, run length, seed.
    #[serde(default)]
    pub schedule: ScheduleSection,
    /// Evaluation on the held-out conversations.
    #[serde(default)]
    pub eval: EvalSection,
    /// Log rows and the progress bar.
    #[serde(default)]
    pub log: LogSection,
    /// Output folder, checkpoints, saved adapter and merged model.
    #[serde(default)]
    pub save: SaveSection,
}

fn default_device() -> String {
    "cpu".into()
}

/// `resume = false | true | "path/to/checkpoints/step-N"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged, expecting = "true, false or the path of a checkpoint folder")]
pub enum Resume {
    /// `true`: the newest checkpoint under `save.dir/checkpoints`; `false`: a fresh run.
    Flag(bool),
    /// This checkpoint folder.
    Path(PathBuf),
}

impl Default for Resume {
    fn default() -> Self {
        Resume::Flag(false)
    }
}

/// `[model]`: exactly one of `gguf` and `hf`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// A GGUF file (weights, tokenizer and chat template).
    pub gguf: Option<PathBuf>,
    /// An HF folder (`config.json`, `*.safetensors`, `tokenizer.json`,
    /// `tokenizer_config.json` with the chat template).
    pub hf: Option<PathBuf>,
    /// The file's config with random weights N(0, 0.02) (timing runs; a GGUF holding only the
    /// metadata will do).
    pub random_weights: bool,
    /// A random 2-block model of the file's family with its tokenizer (tests and smoke runs:
    /// the losses are noise).
    pub tiny: bool,
}

/// `[data]`: the training conversations (`train` JSONL files or the built-in `shakespeare`
/// dialogues) and the held-out ones.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataSection {
    /// JSONL files of conversations or prompt/completion pairs (`wick::data::chat`).
    pub train: Vec<PathBuf>,
    /// JSONL files of held-out conversations.
    pub eval: Vec<PathBuf>,
    /// Hold out this fraction of the training conversations instead (seeded, in `[0, 1)`).
    pub eval_fraction: Option<f64>,
    /// The Shakespeare dialogues built from the plays in this folder
    /// (`data/shakespeare/plays`, `scripts/fetch_shakespeare.sh`): 30 plays to train on, the
    /// 8 held-out plays to evaluate on (unless `eval_fraction` splits the 30).
    pub shakespeare: Option<PathBuf>,
    /// `"assistant"`: the loss on the assistant's tokens only; `"all"`: on every token.
    pub train_on: TrainOnName,
    /// Tokens per example at most (default 1024, or the model's positions if fewer).
    pub max_length: Option<usize>,
    /// What to do with a longer example: `"truncate"` (keep its start) or `"drop"`.
    pub overlong: Overlong,
    /// Train on the first N training conversations only (after the held-out split).
    pub max_train_examples: Option<usize>,
    /// Evaluate on the first N held-out conversations only.
    pub max_eval_examples: Option<usize>,
}

impl Default for DataSection {
    fn default() -> Self {
        Self {
            train: Vec::new(),
            eval: Vec::new(),
            eval_fraction: None,
            shakespeare: None,
            train_on: TrainOnName::Assistant,
            max_length: None,
            overlong: Overlong::Truncate,
            max_train_examples: None,
            max_eval_examples: None,
        }
    }
}

/// `data.train_on`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrainOnName {
    /// The assistant's turns (TRL's `assistant_only_loss`).
    Assistant,
    /// Every token.
    All,
}

impl TrainOnName {
    /// As `wick::data::chat` takes it.
    pub fn chat(self) -> crate::data::chat::TrainOn {
        match self {
            TrainOnName::Assistant => crate::data::chat::TrainOn::Assistant,
            TrainOnName::All => crate::data::chat::TrainOn::All,
        }
    }
}

/// `data.overlong`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Overlong {
    /// Keep the first `max_length` tokens.
    Truncate,
    /// Leave the example out.
    Drop,
}

impl Overlong {
    /// As `wick::data::chat::prepare` takes it.
    pub fn chat(self) -> crate::data::chat::Truncation {
        match self {
            Overlong::Truncate => crate::data::chat::Truncation::KeepStart,
            Overlong::Drop => crate::data::chat::Truncation::Drop,
        }
    }
}

/// `[batch]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BatchSection {
    /// Pack whole conversations into micro-batches of `tokens_per_batch` tokens, without
    /// padding, attention kept inside each conversation (default); `false`: padded batches of
    /// `batch_size` conversations.
    pub packing: bool,
    /// The packing budget: tokens of one micro-batch at most (default 8 x `data.max_length`,
    /// TRL's 8 sequences of `max_length`). Must be at least `data.max_length`.
    pub tokens_per_batch: Option<usize>,
    /// Conversations per padded micro-batch (`packing = false`; default 8).
    pub batch_size: Option<usize>,
    /// Micro-batches per optimizer step, their gradients weighted by trained tokens.
    pub accumulation_steps: usize,
}

impl Default for BatchSection {
    fn default() -> Self {
        Self {
            packing: true,
            tokens_per_batch: None,
            batch_size: None,
            accumulation_steps: 1,
        }
    }
}

/// `[tuning]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TuningSection {
    /// `"lora"` (default) or `"full"`.
    pub method: Method,
    /// LoRA rank (default 16).
    pub r: Option<usize>,
    /// LoRA alpha (default 2 x r).
    pub alpha: Option<f64>,
    /// LoRA dropout in `[0, 1)` (default 0).
    pub dropout: Option<f64>,
    /// Scale by alpha / sqrt(r) (PEFT's `use_rslora`; default false).
    pub use_rslora: Option<bool>,
    /// PEFT's module names or globs (default the seven block linears).
    pub target_modules: Option<Vec<String>>,
    /// `"bf16"` (default), `"f16"` (both mixed over fp32 masters) or `"f32"`.
    pub precision: PrecisionName,
    /// Recompute each block's activations in the backward (less memory, about a third more
    /// compute).
    pub gradient_checkpointing: bool,
}

impl Default for TuningSection {
    fn default() -> Self {
        Self {
            method: Method::Lora,
            r: None,
            alpha: None,
            dropout: None,
            use_rslora: None,
            target_modules: None,
            precision: PrecisionName::Bf16,
            gradient_checkpointing: false,
        }
    }
}

/// `tuning.method`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Adapters on a frozen base.
    Lora,
    /// Every weight trainable.
    Full,
}

/// `tuning.precision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrecisionName {
    /// bf16 autocast over fp32 masters.
    Bf16,
    /// f16 autocast over fp32 masters, with dynamic loss scaling.
    F16,
    /// fp32 throughout.
    F32,
}

impl PrecisionName {
    /// The engine's precision.
    pub fn precision(self) -> Precision {
        match self {
            PrecisionName::Bf16 => Precision::Bf16Mixed,
            PrecisionName::F16 => Precision::F16Mixed,
            PrecisionName::F32 => Precision::Fp32,
        }
    }
}

/// `[schedule]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScheduleSection {
    /// Peak learning rate (default 2e-4 with LoRA, 2e-5 full).
    pub learning_rate: Option<f64>,
    /// After the warmup: `"linear"` (default, transformers' default) or `"cosine"`, decaying
    /// to 0 at the last step, or `"constant"`.
    pub lr_scheduler: LrScheduler,
    /// Linear warmup steps from 0 to the learning rate.
    pub warmup_steps: u64,
    /// Passes over the training conversations (default 1 when `max_steps` is not given).
    pub epochs: Option<u64>,
    /// Optimizer steps to run instead of whole epochs (the data repeats as needed).
    pub max_steps: Option<u64>,
    /// AdamW's decoupled weight decay on matrices (not on norms and biases; default 0).
    pub weight_decay: f64,
    /// Global gradient-norm clip (default 1.0; 0: none).
    pub max_grad_norm: f64,
    /// Seed of the shuffles, the held-out split and the initialisations (default 42).
    pub seed: u64,
}

impl Default for ScheduleSection {
    fn default() -> Self {
        Self {
            learning_rate: None,
            lr_scheduler: LrScheduler::Linear,
            warmup_steps: 0,
            epochs: None,
            max_steps: None,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            seed: 42,
        }
    }
}

/// `schedule.lr_scheduler`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrScheduler {
    /// Linear decay to 0.
    Linear,
    /// Cosine decay to 0.
    Cosine,
    /// Constant after the warmup.
    Constant,
}

/// `[eval]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvalSection {
    /// Evaluate every N optimizer steps (default: at the end of each epoch), and always after
    /// the last step.
    pub every_steps: Option<u64>,
    /// Also evaluate the untrained model (step 0) of a fresh run.
    pub at_start: bool,
}

/// `[log]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogSection {
    /// Write a metrics row (and a line when there is no terminal) every N optimizer steps.
    pub every_steps: u64,
    /// Show a progress bar on a terminal.
    pub progress: bool,
}

impl Default for LogSection {
    fn default() -> Self {
        Self {
            every_steps: 10,
            progress: true,
        }
    }
}

/// `[save]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SaveSection {
    /// The run's folder: `metrics.csv`, `metrics.jsonl`, plots, `checkpoints/`, `adapter/`,
    /// `merged/`.
    pub dir: PathBuf,
    /// A checkpoint every N optimizer steps (0: none in between); one is always written after
    /// the last step and on Ctrl-C.
    pub every_steps: u64,
    /// Keep the newest N checkpoints (0: all).
    pub keep_last: usize,
    /// Write the LoRA adapter (PEFT's folder) to `dir/adapter` at the end (default: true with
    /// LoRA; an error with a full fine-tune).
    pub adapter: Option<bool>,
    /// Write an HF folder to `dir/merged` at the end: the LoRA-merged model, or the trained
    /// weights of a full fine-tune (default: false with LoRA, true full).
    pub merged: Option<bool>,
}

impl Default for SaveSection {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("runs/finetune-chat"),
            every_steps: 0,
            keep_last: 2,
            adapter: None,
            merged: None,
        }
    }
}

/// Default `data.max_length` (TRL's `SFTConfig.max_length`).
pub const DEFAULT_MAX_LENGTH: usize = 1024;
/// Default LoRA rank.
pub const DEFAULT_RANK: usize = 16;
/// Default peak learning rate of a LoRA run.
pub const DEFAULT_LORA_LR: f64 = 2e-4;
/// Default peak learning rate of a full fine-tune.
pub const DEFAULT_FULL_LR: f64 = 2e-5;
/// Default `tuning.target_modules`: PEFT's usual Llama set ([`crate::lora::ALL_LINEAR`]).
pub const DEFAULT_TARGETS: &[&str] = &crate::lora::ALL_LINEAR;

/// [`DEFAULT_TARGETS`] as owned names.
fn default_targets() -> Vec<String> {
    DEFAULT_TARGETS.iter().map(|s| s.to_string()).collect()
}

impl FinetuneConfig {
    /// Reads, checks and completes the file at `path` (see [`FinetuneConfig::parse`]).
    ///
    /// Errors: the file cannot be read (naming it), or [`FinetuneConfig::parse`]'s errors,
    /// each naming the file.
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the config file {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("the config file {}", path.display()))
    }

    /// Parses TOML text, checks every value and fills the defaults that depend on other keys
    /// (learning rate, LoRA settings, packing budget, save switches, epochs).
    ///
    /// Errors: invalid TOML, an unknown key or table, a missing `[model]` / `[data]`, a value
    /// of the wrong type (each with its line), and the checks of [`FinetuneConfig::validate`],
    /// each naming the key.
    pub fn parse(text: &str) -> Result<Self> {
        let mut c: Self = toml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
        c.validate()?;
        c.fill_defaults();
        Ok(c)
    }

    /// Checks the values of a parsed file, naming the key of each problem.
    ///
    /// Errors: see docs/finetune.md for the rules (one model source, one data source, counts
    /// >= 1, fractions and rates in range, LoRA keys with a full fine-tune, ...).
    pub fn validate(&self) -> Result<()> {
        let m = &self.model;
        match (&m.gguf, &m.hf) {
            (Some(_), Some(_)) => bail!("[model] has both gguf and hf: give one of them"),
            (None, None) => bail!(
                "[model] needs gguf = \"file.gguf\" or hf = \"folder\" (missing key model.gguf)"
            ),
            _ => {}
        }
        ensure!(
            !(m.tiny && m.random_weights),
            "model.tiny and model.random_weights are both true: choose one"
        );
        ensure!(
            self.device == "cpu" || self.device == "cuda",
            "device must be \"cpu\" or \"cuda\", got {:?}",
            self.device
        );
        if let Resume::Path(p) = &self.resume {
            ensure!(
                !p.as_os_str().is_empty(),
                "resume is an empty path: give true, false or a checkpoint folder"
            );
        }
        self.validate_data()?;
        self.validate_batch()?;
        self.validate_tuning()?;
        self.validate_schedule()?;
        ensure!(
            self.eval.every_steps != Some(0),
            "eval.every_steps must be >= 1 (leave it out to evaluate at the end of each epoch)"
        );
        ensure!(self.log.every_steps >= 1, "log.every_steps must be >= 1");
        ensure!(
            !self.save.dir.as_os_str().is_empty(),
            "save.dir is empty: name the run's folder"
        );
        Ok(())
    }

    fn validate_data(&self) -> Result<()> {
        let d = &self.data;
        match (d.train.is_empty(), &d.shakespeare) {
            (false, Some(_)) => {
                bail!("[data] has both train and shakespeare: give one source of conversations")
            }
            (true, None) => bail!(
                "[data] needs train = [\"conversations.jsonl\", ...] or shakespeare = \
                 \"data/shakespeare/plays\" (missing key data.train)"
            ),
            _ => {}
        }
        ensure!(
            d.eval.is_empty() || d.eval_fraction.is_none(),
            "[data] has both eval and eval_fraction: give one"
        );
        if let Some(f) = d.eval_fraction {
            ensure!(
                f.is_finite() && f > 0.0 && f < 1.0,
                "data.eval_fraction must be in (0, 1), got {f}"
            );
        }
        if let Some(n) = d.max_length {
            ensure!(
                n >= 2,
                "data.max_length must be >= 2 (an example needs a target), got {n}"
            );
        }
        for (key, v) in [
            ("data.max_train_examples", d.max_train_examples),
            ("data.max_eval_examples", d.max_eval_examples),
        ] {
            ensure!(
                v != Some(0),
                "{key} must be >= 1 (leave it out to use them all)"
            );
        }
        Ok(())
    }

    fn validate_batch(&self) -> Result<()> {
        let b = &self.batch;
        ensure!(
            b.accumulation_steps >= 1,
            "batch.accumulation_steps must be >= 1"
        );
        if b.packing {
            ensure!(
                b.batch_size.is_none(),
                "batch.batch_size is for padded batches (packing = false); packed batches are \
                 sized by batch.tokens_per_batch"
            );
            if let Some(t) = b.tokens_per_batch {
                let max_len = self.data.max_length.unwrap_or(2);
                ensure!(
                    t >= max_len,
                    "batch.tokens_per_batch ({t}) must be >= data.max_length ({max_len}): a \
                     micro-batch must hold the longest example"
                );
            }
        } else {
            ensure!(
                b.tokens_per_batch.is_none(),
                "batch.tokens_per_batch is the packing budget (packing = true); padded batches \
                 are sized by batch.batch_size"
            );
            ensure!(b.batch_size != Some(0), "batch.batch_size must be >= 1");
        }
        Ok(())
    }

    fn validate_tuning(&self) -> Result<()> {
        let t = &self.tuning;
        match t.method {
            Method::Full => {
                for (key, set) in [
                    ("r", t.r.is_some()),
                    ("alpha", t.alpha.is_some()),
                    ("dropout", t.dropout.is_some()),
                    ("use_rslora", t.use_rslora.is_some()),
                    ("target_modules", t.target_modules.is_some()),
                ] {
                    ensure!(
                        !set,
                        "tuning.{key} is a LoRA setting but tuning.method is \"full\": remove \
                         it, or set method = \"lora\""
                    );
                }
                ensure!(
                    self.save.adapter != Some(true),
                    "save.adapter needs tuning.method = \"lora\"; a full fine-tune is saved \
                     with save.merged"
                );
            }
            Method::Lora => {
                ensure!(t.r != Some(0), "tuning.r must be >= 1");
                if let Some(a) = t.alpha {
                    ensure!(
                        a.is_finite() && a > 0.0,
                        "tuning.alpha must be a finite number > 0, got {a}"
                    );
                }
                if let Some(p) = t.dropout {
                    ensure!(
                        (0.0..1.0).contains(&p),
                        "tuning.dropout must be in [0, 1), got {p}"
                    );
                    ensure!(
                        !(p > 0.0 && t.gradient_checkpointing),
                        "tuning.gradient_checkpointing needs tuning.dropout = 0 (the recomputed \
                         block would draw another dropout mask)"
                    );
                }
                if let Some(m) = &t.target_modules {
                    ensure!(
                        !m.is_empty(),
                        "tuning.target_modules is empty: name at least one (e.g. \"q_proj\")"
                    );
                }
            }
        }
        Ok(())
    }

    fn validate_schedule(&self) -> Result<()> {
        let s = &self.schedule;
        if let Some(lr) = s.learning_rate {
            ensure!(
                lr.is_finite() && lr > 0.0,
                "schedule.learning_rate must be a finite number > 0, got {lr}"
            );
        }
        ensure!(
            !(s.epochs.is_some() && s.max_steps.is_some()),
            "[schedule] has both epochs and max_steps: give one"
        );
        ensure!(s.epochs != Some(0), "schedule.epochs must be >= 1");
        ensure!(s.max_steps != Some(0), "schedule.max_steps must be >= 1");
        ensure!(
            s.weight_decay.is_finite() && s.weight_decay >= 0.0,
            "schedule.weight_decay must be a finite number >= 0, got {}",
            s.weight_decay
        );
        ensure!(
            s.max_grad_norm.is_finite() && s.max_grad_norm >= 0.0,
            "schedule.max_grad_norm must be a finite number >= 0 (0: no clipping), got {}",
            s.max_grad_norm
        );
        Ok(())
    }

    /// Fills the defaults that depend on other keys (after [`FinetuneConfig::validate`]);
    /// `data.max_length` and `batch.tokens_per_batch` are filled by
    /// [`FinetuneConfig::fit_to_model`], which knows the model's positions.
    fn fill_defaults(&mut self) {
        let lora = self.tuning.method == Method::Lora;
        let t = &mut self.tuning;
        if lora {
            let r = *t.r.get_or_insert(DEFAULT_RANK);
            t.alpha.get_or_insert(2.0 * r as f64);
            t.dropout.get_or_insert(0.0);
            t.use_rslora.get_or_insert(false);
            t.target_modules.get_or_insert_with(default_targets);
        }
        self.schedule.learning_rate.get_or_insert(if lora {
            DEFAULT_LORA_LR
        } else {
            DEFAULT_FULL_LR
        });
        if self.schedule.max_steps.is_none() {
            self.schedule.epochs.get_or_insert(1);
        }
        self.save.adapter.get_or_insert(lora);
        self.save.merged.get_or_insert(!lora);
        if !self.batch.packing {
            self.batch.batch_size.get_or_insert(8);
        }
    }

    /// Fills `data.max_length` (1024, or `positions` if fewer) and `batch.tokens_per_batch`
    /// (8 x `max_length`) from the model's positions.
    ///
    /// Errors: a `data.max_length` beyond the model's positions; a packing budget below it.
    pub fn fit_to_model(&mut self, positions: usize) -> Result<()> {
        let max_len = match self.data.max_length {
            Some(n) => {
                ensure!(
                    n <= positions,
                    "data.max_length {n} exceeds the model's {positions} positions; set it to \
                     {positions} or less"
                );
                n
            }
            None => DEFAULT_MAX_LENGTH.min(positions),
        };
        self.data.max_length = Some(max_len);
        if self.batch.packing {
            let budget = *self.batch.tokens_per_batch.get_or_insert(8 * max_len);
            ensure!(
                budget >= max_len,
                "batch.tokens_per_batch ({budget}) must be >= data.max_length ({max_len}): a \
                 micro-batch must hold the longest example"
            );
        }
        Ok(())
    }

    /// The model's fine-tuning mode: LoRA with the (filled) settings, or full.
    ///
    /// Errors: the LoRA settings fail [`LoraConfig::validate`] (e.g. an invalid glob).
    pub fn fine_tune(&self) -> Result<FineTune> {
        let t = &self.tuning;
        Ok(match t.method {
            Method::Full => FineTune::Full,
            Method::Lora => {
                let r = t.r.unwrap_or(DEFAULT_RANK);
                let l = LoraConfig {
                    r,
                    alpha: t.alpha.unwrap_or(2.0 * r as f64),
                    use_rslora: t.use_rslora.unwrap_or(false),
                    dropout: t.dropout.unwrap_or(0.0),
                    target_modules: t.target_modules.clone().unwrap_or_else(default_targets),
                };
                l.validate().context("[tuning]")?;
                FineTune::Lora(l)
            }
        })
    }

    /// `data.max_length` (after [`FinetuneConfig::fit_to_model`]; 1024 before).
    pub fn max_length(&self) -> usize {
        self.data.max_length.unwrap_or(DEFAULT_MAX_LENGTH)
    }

    /// The peak learning rate (filled; before, the method's default).
    pub fn learning_rate(&self) -> f64 {
        let default = match self.tuning.method {
            Method::Lora => DEFAULT_LORA_LR,
            Method::Full => DEFAULT_FULL_LR,
        };
        self.schedule.learning_rate.unwrap_or(default)
    }

    /// The run's folder for checkpoints: `save.dir/checkpoints`.
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.save.dir.join("checkpoints")
    }

    /// What a checkpoint records of its run: everything that changes the steps' results
    /// (model, data, batches, tuning, schedule but its length), not the evaluation, logging,
    /// saving or run length. A resume whose config differs in one of these is refused,
    /// naming the key.
    pub fn fingerprint(&self) -> serde_json::Value {
        let mut schedule = serde_json::to_value(&self.schedule).unwrap_or_default();
        if let Some(o) = schedule.as_object_mut() {
            // a resumed run may train further
            o.remove("epochs");
            o.remove("max_steps");
        }
        let flat = |prefix: &str, v: serde_json::Value| -> Vec<(String, serde_json::Value)> {
            match v {
                serde_json::Value::Object(o) => o
                    .into_iter()
                    .map(|(k, v)| (format!("{prefix}.{k}"), v))
                    .collect(),
                other => vec![(prefix.to_string(), other)],
            }
        };
        let to = |v: serde_json::Result<serde_json::Value>| v.unwrap_or_default();
        let mut out = serde_json::Map::new();
        for (prefix, v) in [
            ("model", to(serde_json::to_value(&self.model))),
            ("data", to(serde_json::to_value(&self.data))),
            ("batch", to(serde_json::to_value(&self.batch))),
            ("tuning", to(serde_json::to_value(&self.tuning))),
            ("schedule", schedule),
        ] {
            out.extend(flat(prefix, v));
        }
        out.remove("data.max_eval_examples");
        out.remove("data.eval");
        serde_json::Value::Object(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = "[model]\ngguf = \"m.gguf\"\n[data]\ntrain = [\"a.jsonl\"]\n";

    fn err(text: &str) -> String {
        format!("{:#}", FinetuneConfig::parse(text).unwrap_err())
    }

    #[test]
    fn defaults_follow_the_method() {
        let c = FinetuneConfig::parse(MIN).unwrap();
        assert_eq!(c.tuning.r, Some(16));
        assert_eq!(c.tuning.alpha, Some(32.0));
        assert_eq!(c.schedule.learning_rate, Some(2e-4));
        assert_eq!(c.schedule.epochs, Some(1));
        assert_eq!((c.save.adapter, c.save.merged), (Some(true), Some(false)));
        let full = FinetuneConfig::parse(&format!("{MIN}[tuning]\nmethod = \"full\"\n")).unwrap();
        assert_eq!(full.tuning.r, None);
        assert_eq!(full.schedule.learning_rate, Some(2e-5));
        assert_eq!(
            (full.save.adapter, full.save.merged),
            (Some(false), Some(true))
        );
        let mut c = c;
        c.fit_to_model(512).unwrap();
        assert_eq!(c.data.max_length, Some(512));
        assert_eq!(c.batch.tokens_per_batch, Some(4096));
    }

    #[test]
    fn errors_name_the_key() {
        let e = err(&format!("{MIN}[tuning]\nrank = 8\n"));
        assert!(e.contains("unknown field `rank`"), "{e}");
        let e = err("[model]\ngguf = \"m\"\n");
        assert!(e.contains("missing field `data`"), "{e}");
        let e = err(&format!("{MIN}[tuning]\nr = 0\n"));
        assert!(e.contains("tuning.r must be >= 1"), "{e}");
        let e = err(&format!("{MIN}[tuning]\nmethod = \"full\"\nr = 8\n"));
        assert!(e.contains("tuning.r is a LoRA setting"), "{e}");
        let e = err(&format!("{MIN}[tuning]\nmethod = \"qlora\"\n"));
        assert!(e.contains("unknown variant `qlora`"), "{e}");
        let e = err(&format!("{MIN}[batch]\nbatch_size = 4\n"));
        assert!(e.contains("batch.batch_size is for padded batches"), "{e}");
        let e = err(&format!("{MIN}[schedule]\nepochs = 1\nmax_steps = 3\n"));
        assert!(e.contains("both epochs and max_steps"), "{e}");
        let e = err(&format!("{MIN}[data2]\n"));
        assert!(e.contains("unknown field `data2`"), "{e}");
        let e = err("[model]\n[data]\ntrain = [\"a\"]\n");
        assert!(e.contains("model.gguf"), "{e}");
        let e = err(&format!("resume = 3\n{MIN}"));
        assert!(e.contains("checkpoint folder"), "{e}");
    }

    #[test]
    fn the_fingerprint_leaves_out_the_run_length_and_the_outputs() {
        let a = FinetuneConfig::parse(MIN).unwrap();
        let b = FinetuneConfig::parse(&format!(
            "{MIN}[schedule]\nmax_steps = 9\n[save]\ndir = \"x\"\n[eval]\nat_start = true\n"
        ))
        .unwrap();
        assert_eq!(a.fingerprint(), b.fingerprint());
        let c = FinetuneConfig::parse(&format!("{MIN}[schedule]\nseed = 1\n")).unwrap();
        assert_ne!(a.fingerprint(), c.fingerprint());
        assert!(a.fingerprint().get("tuning.r").is_some());
    }
}
