//! Continue training a pretrained decoder of any family wick implements (Llama, SmolLM2,
//! Mistral, Qwen2/2.5, Qwen3, Gemma 3: [`wick::models::family`]) on Shakespeare, fully or with
//! LoRA, the setup of `scripts/reference/torch_finetune.py`. The model is a GGUF file
//! (`--gguf FILE`, default SmolLM2-135M-Instruct) or an HF folder (`--hf DIR`); its family is
//! read from the file, and the model is driven through [`wick::models::CausalLm`]:
//!
//! ```text
//! scripts/fetch_smollm2.sh && scripts/fetch_shakespeare.sh
//! # the real model on 2 CPU cores, about two minutes (the README's measured command)
//! cargo run --release --example finetune -- --lora 16 --steps 20 --context 64 --batch 4
//! cargo run --release --features cuda --example finetune -- --device cuda --full
//! cargo run --release --features cuda --example finetune -- --device cuda --lora 16 --save --save-merged
//! ```
//! The text (data/shakespeare/input.txt) is cut at the line break nearest 90% of its bytes:
//! training windows come from the part before, validation windows from the part after. Of
//! each part only as many tokens as the run's windows span are tokenized (steps x batch x
//! (context + 1) for training; the windows are random, so they may overlap), with the GGUF's
//! own tokenizer; a resumed run tokenizes exactly the checkpointing run's training tokens, so
//! it draws the same windows whatever its `--steps`. Batches are random windows of `--context`
//! tokens. Prints the validation loss and a greedy continuation of a fixed prompt before and
//! after, ms/step, tokens/s ([`wick::throughput`]: warm-up and checkpoint saves excluded) and
//! peak memory (CUDA), and a `RESULT {json}` line; a progress bar on a terminal.
//!
//! `--save [DIR]` writes the LoRA adapters (PEFT's layout) or, with `--full`, the weights as an
//! HF folder; `--save-merged [DIR]` writes the LoRA-merged model as an HF folder; both default
//! under `runs/` (ignored by git), and HF folders carry `tokenizer.json` and
//! `tokenizer_config.json` (with the chat template) for transformers. `--save-every N` writes a
//! checkpoint every N steps into `--checkpoint-dir`; `--resume` continues the newest one after
//! checking its run's flags against this run's; Ctrl-C, during training or after it (final
//! validation, generation, saves), saves a checkpoint there and exits with status 130.
//!
//! `--tiny` swaps the model for a random 2-block config (CPU smoke runs: its losses and text are
//! noise); `--random-weights` keeps the GGUF's config with random weights (timing runs from a
//! GGUF that carries only the tokenizer and config).
//!
//! Reading the model, saving adapters and HF folders, and checking a checkpoint against the run
//! are [`wick::finetune`]'s, shared with `wick finetune --config run.toml` (chat data).

use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Tensor};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::time::Instant;
use wick::checkpoint::{self, Checkpointer};
use wick::cli::{dropout, non_negative_f64, non_negative_usize, positive_f64, positive_usize};
use wick::finetune::model::{self as model_files, ModelSpec, Weights};
use wick::finetune::{resume as resume_check, save};
use wick::lora::LoraConfig;
use wick::models::tokenizer::{safe_cut, TextTokenizer};
use wick::models::{CausalLm, Source};
use wick::models::{Decoder, DecoderWeights, FineTune, KvCache};
use wick::optim::LrSchedule;
use wick::throughput::{Throughput, Unit};
use wick::{Engine, EngineConfig, ParamStore, Precision};

#[derive(Parser, Debug)]
#[command(
    about = "Fine-tune a pretrained decoder (GGUF or HF folder) on Shakespeare: full or LoRA"
)]
struct Args {
    /// The GGUF file (weights, tokenizer, chat template); the default when --hf is not given
    /// is data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf.
    #[arg(long, conflicts_with = "hf")]
    gguf: Option<PathBuf>,
    /// An HF folder instead: config.json, *.safetensors (sharded with
    /// model.safetensors.index.json), tokenizer.json, tokenizer_config.json.
    #[arg(long)]
    hf: Option<PathBuf>,
    /// Train text (scripts/fetch_shakespeare.sh).
    #[arg(long, default_value = "data/shakespeare/input.txt")]
    text: PathBuf,
    /// Full fine-tuning (every weight trainable).
    #[arg(long, conflicts_with = "lora")]
    full: bool,
    /// LoRA rank (the default mode, rank 16).
    #[arg(long, allow_negative_numbers = true, value_parser = positive_usize)]
    lora: Option<usize>,
    /// LoRA alpha (default: 2 x rank).
    #[arg(long, allow_negative_numbers = true, value_parser = positive_f64)]
    alpha: Option<f64>,
    /// LoRA dropout, in [0, 1).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = dropout)]
    lora_dropout: f64,
    /// LoRA target modules, comma-separated (PEFT's names).
    #[arg(
        long,
        default_value = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    )]
    targets: String,
    /// Recompute each block's activations in the backward.
    #[arg(long)]
    checkpointing: bool,
    /// Precision: "32" (fp32), "bf16-mixed" or "16-mixed".
    #[arg(long, default_value = "bf16-mixed")]
    precision: Precision,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Timed training steps (after --warmup-steps).
    #[arg(long, default_value_t = 100, allow_negative_numbers = true, value_parser = positive_usize)]
    steps: usize,
    /// Untimed training steps before them (kernel JIT, allocator warm-up).
    #[arg(long, default_value_t = 3, allow_negative_numbers = true, value_parser = non_negative_usize)]
    warmup_steps: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 16, allow_negative_numbers = true, value_parser = positive_usize)]
    batch: usize,
    /// Tokens per sequence (at least 2, at most the model's positions: 8192 for SmolLM2, 512
    /// for --tiny).
    #[arg(long, default_value_t = 1024, allow_negative_numbers = true, value_parser = positive_usize)]
    context: usize,
    /// Validation batches (random windows of the validation part, fixed seed).
    #[arg(long, default_value_t = 16, allow_negative_numbers = true, value_parser = positive_usize)]
    val_batches: usize,
    /// Learning rate (default 5e-5 full, 1e-3 LoRA).
    #[arg(long, allow_negative_numbers = true, value_parser = positive_f64)]
    lr: Option<f64>,
    /// AdamW weight decay (default 0.1 full, 0 LoRA), on every trainable tensor as in the
    /// PyTorch reference's single parameter group.
    #[arg(long, allow_negative_numbers = true, value_parser = non_negative_f64)]
    weight_decay: Option<f64>,
    /// Global gradient-norm clip (0: no clipping).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = non_negative_f64)]
    clip: f64,
    /// Tokens of the greedy continuation (0: none).
    #[arg(long, default_value_t = 40, allow_negative_numbers = true, value_parser = non_negative_usize)]
    max_new_tokens: usize,
    /// Print a log line every N steps (and at the last step).
    #[arg(long, default_value_t = 25, allow_negative_numbers = true, value_parser = positive_usize)]
    log_every: usize,
    /// Save the adapters (LoRA, PEFT's layout) or the weights (full, an HF folder), with the
    /// tokenizer files, at the end; without DIR into runs/finetune/adapter or .../model.
    #[arg(long, num_args = 0..=1, value_name = "DIR")]
    save: Option<Option<PathBuf>>,
    /// Save the LoRA-merged model (an HF folder with the tokenizer) at the end; without DIR
    /// into runs/finetune/merged.
    #[arg(long, num_args = 0..=1, value_name = "DIR")]
    save_merged: Option<Option<PathBuf>>,
    /// Training checkpoints (--save-every, Ctrl-C, --resume) go here.
    #[arg(long, default_value = "runs/finetune/checkpoints")]
    checkpoint_dir: PathBuf,
    /// Save a checkpoint every N steps and at the end (0: only on Ctrl-C).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = non_negative_usize)]
    save_every: usize,
    /// Keep the newest N checkpoints in --checkpoint-dir (0: all).
    #[arg(long, default_value_t = 2, allow_negative_numbers = true, value_parser = non_negative_usize)]
    keep_last: usize,
    /// Continue from the newest checkpoint in --checkpoint-dir (an error when there is none).
    /// Pass the original run's flags; --steps may grow.
    #[arg(long)]
    resume: bool,
    /// Write the trained model's logits summary on the prompt (scripts/smollm2_fixture.py
    /// check-adapter / check-merged read it).
    #[arg(long)]
    export_logits: Option<PathBuf>,
    /// A random 2-block model (the GGUF's tokenizer and vocabulary, random weights) instead of
    /// SmolLM2: a CPU smoke run whose losses and generated text are noise.
    #[arg(long)]
    tiny: bool,
    /// The GGUF's config with random weights (N(0, 0.02)), for timing runs that need no
    /// pretrained weights: a GGUF holding only the metadata (tokenizer, config) will do.
    #[arg(long, conflicts_with = "tiny")]
    random_weights: bool,
    /// Seed of the batch order and initialisations.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Train and validate on these windows instead of drawing them: the JSON of
    /// scripts/torch_llama_windows.py (the draws of scripts/reference/torch_llama.py). The
    /// whole text is tokenized and split at 90% of its tokens, as torch_llama.py does.
    #[arg(long)]
    windows: Option<PathBuf>,
    /// The mode's key in `--windows` (default: full or lora).
    #[arg(long)]
    windows_mode: Option<String>,
}

/// The default model: SmolLM2-135M-Instruct (scripts/fetch_smollm2.sh).
const DEFAULT_GGUF: &str = "data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

impl Args {
    /// `--gguf` or `--hf`, SmolLM2's GGUF when neither is given.
    fn source(&self) -> Result<Source> {
        let gguf = match (&self.gguf, &self.hf) {
            (None, None) => Some(Path::new(DEFAULT_GGUF)),
            (g, _) => g.as_deref(),
        };
        Source::from_args(gguf, self.hf.as_deref())
    }

    /// The model's name for headers and the adapter's `base_model_name_or_path`: the file's
    /// or folder's name up to its first dot (`SmolLM2-135M-Instruct`).
    fn model_name(&self) -> String {
        model_files::model_name(self.model_path())
    }

    /// The model and the weights `--tiny` / `--random-weights` ask for.
    fn spec(&self) -> Result<ModelSpec> {
        let weights = match (self.tiny, self.random_weights) {
            (true, _) => Weights::Tiny,
            (_, true) => Weights::Random,
            _ => Weights::Pretrained,
        };
        Ok(ModelSpec {
            source: self.source()?,
            weights,
        })
    }

    /// The model's file or folder, as [`Args::source`] picks it.
    fn model_path(&self) -> &Path {
        match (&self.gguf, &self.hf) {
            (Some(g), _) => g,
            (None, Some(h)) => h,
            (None, None) => Path::new(DEFAULT_GGUF),
        }
    }
}

/// Window starts read from `--windows`: validation batches and per-step training batches.
struct Windows {
    val: Vec<Vec<usize>>,
    train: Vec<Vec<usize>>,
}

fn read_windows(path: &std::path::Path, mode: &str, train_tokens: usize) -> Result<Windows> {
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
    )
    .with_context(|| format!("parsing {}", path.display()))?;
    if v["train_tokens"].as_u64() != Some(train_tokens as u64) {
        bail!(
            "{}: made for {} training tokens, this text has {train_tokens}; tokenizers differ?",
            path.display(),
            v["train_tokens"]
        );
    }
    let lists = |key: &str| -> Result<Vec<Vec<usize>>> {
        serde_json::from_value(v[key].clone())
            .with_context(|| format!("{}: no list of windows under {key:?}", path.display()))
    };
    Ok(Windows {
        val: lists("val")?,
        train: lists(mode)?,
    })
}

const PROMPT: &str = "ROMEO:\nO, she doth teach the torches to burn bright!";

/// `(x, y)` windows of `t` tokens at `starts`, on `dev`.
fn windows(ids: &[u32], starts: &[usize], t: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
    let mut x = Vec::with_capacity(starts.len() * t);
    let mut y = Vec::with_capacity(starts.len() * t);
    for &s in starts {
        x.extend_from_slice(&ids[s..s + t]);
        y.extend_from_slice(&ids[s + 1..s + t + 1]);
    }
    Ok((
        Tensor::from_vec(x, (starts.len(), t), dev)?,
        Tensor::from_vec(y, (starts.len(), t), dev)?,
    ))
}

fn random_starts(rng: &mut StdRng, len: usize, t: usize, n: usize) -> Vec<usize> {
    (0..n).map(|_| rng.random_range(0..len - t - 1)).collect()
}

fn val_loss(model: &impl CausalLm, batches: &[(Tensor, Tensor)]) -> Result<f64> {
    let mut total = 0.0;
    for (x, y) in batches {
        total += model.loss(x, y)?.detach().to_scalar::<f32>()? as f64;
    }
    Ok(total / batches.len() as f64)
}

/// The summary of the prompt's logits that scripts/smollm2_fixture.py compares.
fn logits_summary(
    model: &impl CausalLm,
    prompt: &[u32],
    dev: &Device,
) -> Result<serde_json::Value> {
    let x = Tensor::from_slice(prompt, (1, prompt.len()), dev)?;
    let logits = model
        .forward_cached(&x, &mut KvCache::default())?
        .squeeze(0)?
        .to_device(&Device::Cpu)?;
    let rows: Vec<Vec<f32>> = logits.to_vec2()?;
    let lse: Vec<f32> = rows
        .iter()
        .map(|r| {
            let m = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            m + r.iter().map(|v| (v - m).exp()).sum::<f32>().ln()
        })
        .collect();
    let last = rows.last().context("empty prompt")?;
    let mut order: Vec<usize> = (0..last.len()).collect();
    order.sort_by(|&a, &b| last[b].total_cmp(&last[a]));
    Ok(serde_json::json!({
        "prompt_ids": prompt,
        "last_top_ids": &order[..20],
        "first16": rows.iter().map(|r| r[..16].to_vec()).collect::<Vec<_>>(),
        "logsumexp": lse,
    }))
}

/// The text cut for training and validation, tokenized (see the module docs).
struct Split {
    train: Vec<u32>,
    val: Vec<u32>,
    /// How the split was made, for the header.
    what: String,
}

/// Training and validation tokens: with `--windows`, the whole text split at 90% of its
/// tokens (torch_llama.py's split); else the text cut at the line break nearest 90% of its
/// bytes, and of each part only the tokens `train_need` / `val_need` ask for. `keep_train`
/// (a resumed run: the checkpointing run's count) keeps exactly that many training tokens, so
/// that the random windows are drawn from the same pool whatever `--steps` is now.
fn split_text(
    tok: &TextTokenizer,
    text: &str,
    whole: bool,
    train_need: usize,
    val_need: usize,
    keep_train: Option<usize>,
) -> Result<Split> {
    let split = if whole {
        let ids = tok.encode(text)?;
        let n_train = (0.9 * ids.len() as f64) as usize; // torch_llama.py: int(0.9 * len(ids))
        let what = format!("whole text {} tokens, split at token {n_train}", ids.len());
        let (train, val) = ids.split_at(n_train);
        Split {
            train: train.to_vec(),
            val: val.to_vec(),
            what,
        }
    } else {
        // the first place at or after 90% where a cut leaves the tokens as the whole text's
        let cut = safe_cut(text, text.len() * 9 / 10);
        let need = keep_train.unwrap_or(train_need);
        let (mut train, used_train) = tok.encode_prefix(&text[..cut], need)?;
        if keep_train.is_some() {
            train.truncate(need);
        }
        let (val, used_val) = tok.encode_prefix(&text[cut..], val_need)?;
        Split {
            what: format!(
                "train: {} tokens of bytes 0-{used_train}, validation: {} tokens of bytes \
                 {cut}-{} (of {} bytes)",
                train.len(),
                val.len(),
                cut + used_val,
                text.len()
            ),
            train,
            val,
        }
    };
    if let Some(n) = keep_train {
        ensure!(
            split.train.len() == n,
            "--resume: the checkpoint's run trained on {n} tokens of its text, this text gives \
             {}; pass the original run's --text",
            split.train.len()
        );
    }
    Ok(split)
}

/// The flags that set the model, its trainable parameters and the data a run draws.
struct Plan {
    fine_tune: FineTune,
    /// `full` or `lora{rank}`.
    mode: String,
    lr: f64,
    weight_decay: f64,
    /// `--warmup-steps` + `--steps`.
    total_steps: usize,
}

fn plan(a: &Args) -> Result<Plan> {
    ensure!(
        a.context >= 2,
        "--context {} is too short: a window needs at least 2 tokens",
        a.context
    );
    let rank = a.lora.unwrap_or(16);
    let fine_tune = if a.full {
        FineTune::Full
    } else {
        let l = LoraConfig {
            r: rank,
            alpha: a.alpha.unwrap_or(2.0 * rank as f64),
            use_rslora: false,
            dropout: a.lora_dropout,
            target_modules: a.targets.split(',').map(|s| s.trim().to_string()).collect(),
        };
        l.validate()?;
        FineTune::Lora(l)
    };
    Ok(Plan {
        fine_tune,
        mode: if a.full {
            "full".to_string()
        } else {
            format!("lora{rank}")
        },
        lr: a.lr.unwrap_or(if a.full { 5e-5 } else { 1e-3 }),
        weight_decay: a.weight_decay.unwrap_or(if a.full { 0.1 } else { 0.0 }),
        total_steps: a.warmup_steps + a.steps,
    })
}

/// What a checkpoint records about its run; `--resume` refuses a run whose flags differ.
fn run_fingerprint(a: &Args, plan: &Plan) -> serde_json::Value {
    let lora = match &plan.fine_tune {
        FineTune::Lora(l) => serde_json::json!({
            "alpha": l.alpha, "dropout": l.dropout, "target_modules": l.target_modules,
        }),
        FineTune::Full => serde_json::Value::Null,
    };
    serde_json::json!({
        "mode": plan.mode,
        "lora": lora,
        "model": match a.spec() {
            Ok(spec) => spec.fingerprint(),
            Err(_) => a.model_path().display().to_string(),
        },
        "precision": a.precision.name(),
        "context": a.context,
        "batch": a.batch,
        "seed": a.seed,
        "windows": a.windows.as_ref().map(|p| p.display().to_string()),
    })
}

/// The checkpoint `--resume` continues, checked against this run's flags before anything is
/// loaded.
struct Prior {
    path: PathBuf,
    step: usize,
    /// The training tokens the checkpointing run drew its windows from (absent in checkpoints
    /// of older builds).
    train_tokens: Option<usize>,
}

/// With `--resume`, the newest checkpoint's `trainer_state.json`: refused when its run's flags
/// differ from this run's or it already reaches `total_steps`.
fn check_resume(
    a: &Args,
    ckpt: &Checkpointer,
    fingerprint: &serde_json::Value,
    total_steps: usize,
) -> Result<Option<Prior>> {
    if !a.resume {
        return Ok(None);
    }
    let Some(path) = ckpt.latest().context("--resume")? else {
        bail!(
            "nothing to resume: no checkpoint in {} (drop --resume to start fresh, or pass \
             the run's --checkpoint-dir)",
            a.checkpoint_dir.display()
        );
    };
    let state =
        resume_check::check_prior(&path, fingerprint, None, "pass the original run's flags")
            .context("--resume")?;
    let step = state.step as usize;
    ensure!(
        step < total_steps,
        "--resume: {} is at step {step}, which already reaches --warmup-steps + --steps = \
         {total_steps}; raise --steps to train further",
        path.display()
    );
    let train_tokens = state.extra["train_tokens"].as_u64().map(|n| n as usize);
    Ok(Some(Prior {
        path,
        step,
        train_tokens,
    }))
}

/// `DIR` of `--save DIR`, or `default` for a bare `--save`.
fn out_dir(flag: &Option<Option<PathBuf>>, default: &str) -> Option<PathBuf> {
    flag.as_ref()
        .map(|d| d.clone().unwrap_or_else(|| PathBuf::from(default)))
}

/// The model's weights, its tokenizer and the tokenized text.
struct Loaded {
    weights: DecoderWeights,
    tok: TextTokenizer,
    /// The model's positions (the longest `--context`).
    positions: usize,
    split: Split,
    load_s: f64,
    tokenize_s: f64,
}

/// Opens the GGUF, builds the weights `--tiny` / `--random-weights` ask for, and tokenizes the
/// text: as many training tokens as the run's windows span (`keep_train` of a resumed run:
/// exactly the checkpointing run's count), and as many validation tokens as its batches span.
fn load_model_and_data(a: &Args, total_steps: usize, keep_train: Option<usize>) -> Result<Loaded> {
    let t0 = Instant::now();
    let spec = a.spec()?;
    let shape = spec.shape().with_context(|| {
        format!(
            "{} (for the default model, run scripts/fetch_smollm2.sh)",
            spec.source.path().display()
        )
    })?;
    let positions = shape.positions;
    ensure!(
        a.context <= positions,
        "--context {} exceeds the {} positions of {}; pass --context {positions} or less",
        a.context,
        positions,
        if a.tiny {
            "the --tiny model".to_string()
        } else {
            format!("{} (its context length)", spec.source.path().display())
        }
    );
    let tok = spec.source.tokenizer()?;
    let weights = spec.weights(&shape, a.seed)?;
    let load_s = t0.elapsed().as_secs_f64();
    let text = std::fs::read_to_string(&a.text).with_context(|| {
        format!(
            "reading {} (run scripts/fetch_shakespeare.sh)",
            a.text.display()
        )
    })?;
    let t1 = Instant::now();
    // the tokens the windows can reach: steps x batch windows of context + 1 tokens
    let window = a.context + 1;
    let split = split_text(
        &tok,
        &text,
        a.windows.is_some(),
        (total_steps * a.batch * window).max(window + 1),
        (a.val_batches * a.batch * window).max(window + 1),
        keep_train,
    )?;
    let tokenize_s = t1.elapsed().as_secs_f64();
    for (part, ids) in [("training", &split.train), ("validation", &split.val)] {
        if ids.len() < a.context + 2 {
            bail!(
                "{}: the {part} part has {} tokens, fewer than --context {} + 2; use a longer \
                 text or a shorter --context",
                a.text.display(),
                ids.len(),
                a.context
            );
        }
    }
    Ok(Loaded {
        weights,
        tok,
        positions,
        split,
        load_s,
        tokenize_s,
    })
}

/// The `--windows` file's windows, checked against the run's batch, context and steps.
fn fixed_windows(a: &Args, split: &Split, total_steps: usize) -> Result<Option<Windows>> {
    let Some(p) = &a.windows else {
        return Ok(None);
    };
    let mode = a
        .windows_mode
        .clone()
        .unwrap_or(if a.full { "full" } else { "lora" }.into());
    let w = read_windows(p, &mode, split.train.len())?;
    let fits = |l: &[Vec<usize>], len: usize| {
        l.iter().flatten().all(|&s| s + a.context < len) && l.iter().all(|b| b.len() == a.batch)
    };
    ensure!(
        w.train.len() >= total_steps
            && fits(&w.train, split.train.len())
            && fits(&w.val, split.val.len()),
        "{}: the windows do not fit --batch {} --context {} and {total_steps} steps",
        p.display(),
        a.batch,
        a.context
    );
    Ok(Some(w))
}

/// Validation batches: the `--windows` file's, or `--val-batches` random ones (fixed seed).
fn val_batches(
    a: &Args,
    val: &[u32],
    fixed: Option<&Windows>,
    dev: &Device,
) -> Result<Vec<(Tensor, Tensor)>> {
    match fixed {
        Some(w) => w
            .val
            .iter()
            .map(|s| windows(val, s, a.context, dev))
            .collect(),
        None => {
            let mut rng = StdRng::seed_from_u64(a.seed + 1);
            (0..a.val_batches)
                .map(|_| {
                    let s = random_starts(&mut rng, val.len(), a.context, a.batch);
                    windows(val, &s, a.context, dev)
                })
                .collect()
        }
    }
}

/// The header line: the model, its trainable parameters, frozen bytes and precision.
fn header(a: &Args, plan: &Plan, model: &Decoder, trainable: usize, dev: &Device) -> String {
    let mode = &plan.mode;
    let (name, family) = (a.model_name(), model.config().model_type.model_type());
    let what = match (a.tiny, a.random_weights, &plan.fine_tune) {
        (true, _, _) => format!(
            "random tiny {family} ({mode}; random weights, {name}'s tokenizer): a smoke run, \
             its losses and greedy text are noise"
        ),
        (_, true, _) => {
            format!("{name} ({family}) config with random weights ({mode}, timing run)")
        }
        (_, _, FineTune::Full) => format!("{name} ({family}), full fine-tune"),
        (_, _, FineTune::Lora(l)) => format!("{name} ({family}), LoRA r{}", l.r),
    };
    format!(
        "{what}: {} blocks, {trainable} trainable parameters, frozen base {:.1} MB, {}",
        model.config().num_hidden_layers,
        model.frozen_bytes() as f64 / 1e6,
        wick::perf::precision_on_device(a.precision, dev),
    )
}

/// AdamW (beta2 0.95, the PyTorch reference's), a constant learning rate, `--clip`.
fn build_engine(a: &Args, plan: &Plan, store: &ParamStore) -> Result<Engine> {
    let mut ec = EngineConfig::adamw(plan.lr);
    if let wick::engine::OptimizerConfig::AdamW(o) = &mut ec.optimizer {
        o.beta2 = 0.95;
        o.weight_decay = plan.weight_decay;
    }
    ec.schedule = LrSchedule::Constant { lr: plan.lr };
    ec.max_grad_norm = (a.clip > 0.0).then_some(a.clip);
    Engine::new(store.clone(), ec)
}

/// Loads the checkpoint [`check_resume`] checked into `engine`, and prints its notices.
fn resume(a: &Args, ckpt: &Checkpointer, engine: &mut Engine, prior: &Prior) -> Result<()> {
    let resumed = ckpt.resume(engine).context("--resume")?;
    let path = resumed.as_ref().map(|r| r.path.clone());
    ensure!(
        path.as_ref() == Some(&prior.path) && engine.boundaries() as usize == prior.step,
        "--resume: {} changed while this run started (another run writing to {}?)",
        prior.path.display(),
        a.checkpoint_dir.display()
    );
    for n in resumed.iter().flat_map(|r| &r.notices) {
        println!("note: {n}");
    }
    println!(
        "resumed from {} at step {}",
        prior.path.display(),
        prior.step
    );
    Ok(())
}

/// What the training loop leaves for the report.
struct Trained {
    /// `(step, loss)` at the log points.
    losses: Vec<(usize, f32)>,
    throughput: Throughput,
    ms_per_step: f64,
    /// The checkpoint saved at the last step, if `--save-every` saved one.
    final_checkpoint: Option<PathBuf>,
}

/// Everything the training loop needs besides the flags.
struct Loop<'a> {
    model: &'a Decoder,
    engine: &'a mut Engine,
    ckpt: &'a Checkpointer,
    /// The `extra` JSON of every checkpoint.
    extra: &'a serde_json::Value,
    train: &'a [u32],
    fixed: Option<&'a Windows>,
    dev: &'a Device,
}

/// Steps `engine.boundaries()..total_steps`: logs the loss every `--log-every` steps, saves
/// checkpoints every `--save-every` steps, and on Ctrl-C saves one and exits with status 130.
/// The throughput counts the steps after `--warmup-steps`, less the time of checkpoint saves.
fn train_loop(a: &Args, l: Loop, total_steps: usize) -> Result<Trained> {
    let start = l.engine.boundaries() as usize;
    // the batches: drawn in step order (a resumed run replays the draws of the steps done)
    let mut rng = StdRng::seed_from_u64(a.seed);
    let mut draw = |step: usize| -> Vec<usize> {
        match l.fixed {
            Some(w) => w.train[step].clone(),
            None => random_starts(&mut rng, l.train.len(), a.context, a.batch),
        }
    };
    for s in 0..start {
        draw(s);
    }
    let bar = ProgressBar::new((total_steps - start) as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    wick::cuda::reset_peak_memory(l.dev)?;
    // timed: the steps after --warmup-steps that this process runs, less checkpoint saves
    let first_timed = start.max(a.warmup_steps);
    let mut timer: Option<Instant> = None;
    let mut save_secs = 0.0;
    let mut final_checkpoint = None;
    let mut losses: Vec<(usize, f32)> = Vec::new();
    for s in start..total_steps {
        if s == first_timed {
            l.dev.synchronize()?;
            timer = Some(Instant::now());
        }
        let (x, y) = windows(l.train, &draw(s), a.context, l.dev)?;
        let r = l.engine.step(|_| l.model.loss(&x, &y))?;
        let step = s + 1;
        bar.inc(1);
        // reading the loss waits for the step: only at the log points
        if s % a.log_every == 0 || step == total_steps {
            let loss = r.loss()?;
            losses.push((step, loss));
            bar.set_message(format!("loss {loss:.4}"));
            let (host, gpu) = (r.times(), r.spans.resolve()?);
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            let line = format!(
                "step {step:>4}/{total_steps}  loss {loss:.4}  device fwd/bwd/optim \
                 {:.1}/{:.1}/{:.1} ms, host queueing {:.1}/{:.1}/{:.1} ms",
                ms(gpu.forward),
                ms(gpu.backward),
                ms(gpu.optimizer),
                ms(host.forward),
                ms(host.backward),
                ms(host.optimizer)
            );
            bar.suspend(|| println!("{line}"));
        }
        let interrupted = checkpoint::interrupted();
        let periodic = a.save_every > 0 && (step % a.save_every == 0 || step == total_steps);
        if periodic || interrupted {
            // the step's own work is timed, the save is not
            l.dev.synchronize()?;
            let t = Instant::now();
            let path = l.ckpt.save(l.engine, l.extra.clone())?;
            save_secs += t.elapsed().as_secs_f64();
            bar.suspend(|| println!("saved checkpoint {}", path.display()));
            if interrupted {
                bar.finish_and_clear();
                println!(
                    "interrupted: saved {} (continue with --resume)",
                    path.display()
                );
                std::process::exit(checkpoint::INTERRUPTED_EXIT_CODE);
            }
            if step == total_steps {
                final_checkpoint = Some(path);
            }
        }
    }
    bar.finish_and_clear();
    l.dev.synchronize()?;
    let timed_steps = total_steps - first_timed;
    let secs = timer.map_or(0.0, |t| t.elapsed().as_secs_f64()) - save_secs;
    Ok(Trained {
        losses,
        throughput: Throughput {
            items: (timed_steps * a.batch * a.context) as u64,
            unit: Unit::Tokens,
            secs: secs.max(0.0),
            steps: (first_timed as u64 + 1, total_steps as u64),
            excluded: "warm-up and checkpoint saves",
        },
        ms_per_step: secs.max(0.0) * 1e3 / timed_steps.max(1) as f64,
        final_checkpoint,
    })
}

/// Ctrl-C after the training loop (final validation, generation, saves): saves the trained
/// state as a checkpoint (unless the last step's checkpoint holds it) and exits with 130.
fn exit_if_interrupted(
    engine: &Engine,
    ckpt: &Checkpointer,
    extra: &serde_json::Value,
    final_checkpoint: Option<&Path>,
) -> Result<()> {
    if !checkpoint::interrupted() {
        return Ok(());
    }
    let path = match final_checkpoint {
        Some(p) => p.to_path_buf(),
        None => ckpt.save(engine, extra.clone())?,
    };
    println!(
        "interrupted after training: the trained state is in {} (--resume with a larger \
         --steps trains further)",
        path.display()
    );
    std::process::exit(checkpoint::INTERRUPTED_EXIT_CODE);
}

/// `--save`, `--save-merged` and `--export-logits`, each after a Ctrl-C check.
fn save_outputs(
    a: &Args,
    model: &Decoder,
    store: &ParamStore,
    tok: &TextTokenizer,
    positions: usize,
    prompt: &[u32],
    interrupted: &dyn Fn() -> Result<()>,
) -> Result<()> {
    let default = if a.full {
        "runs/finetune/model"
    } else {
        "runs/finetune/adapter"
    };
    if let Some(dir) = out_dir(&a.save, default) {
        // with the tokenizer files, as PEFT's trainers do
        match model.lora() {
            Some(_) => save::save_adapter(model, store, tok, &a.model_name(), &dir, positions)?,
            None => save::save_merged(model, store, tok, &dir, positions)?,
        }
        println!("saved to {}", dir.display());
        interrupted()?;
    }
    if let Some(dir) = out_dir(&a.save_merged, "runs/finetune/merged") {
        save::save_merged(model, store, tok, &dir, positions)?;
        println!("saved the merged model to {}", dir.display());
        interrupted()?;
    }
    if let Some(f) = &a.export_logits {
        let s = logits_summary(model, prompt, model.device())?;
        wick::checkpoint::write_file_atomic(f, serde_json::to_string(&s)?.as_bytes())?;
    }
    Ok(())
}

fn main() -> Result<()> {
    wick::cli::init_logging();
    let a = Args::parse();
    let plan = plan(&a)?;
    let total_steps = plan.total_steps;
    let precision = a.precision;
    let dev = wick::device_from_flag(&a.device)?;
    // checkpoints: --resume is checked against this run's flags before anything is loaded
    let ckpt = Checkpointer::new(&a.checkpoint_dir, a.keep_last);
    let fingerprint = run_fingerprint(&a, &plan);
    let prior = check_resume(&a, &ckpt, &fingerprint, total_steps)?;

    let Loaded {
        weights,
        tok,
        positions,
        split,
        load_s,
        tokenize_s,
    } = load_model_and_data(&a, total_steps, prior.as_ref().and_then(|p| p.train_tokens))?;
    let (train, val) = (&split.train[..], &split.val[..]);
    let fixed = fixed_windows(&a, &split, total_steps)?;
    let val_batches = val_batches(&a, val, fixed.as_ref(), &dev)?;

    let store = ParamStore::new(precision, dev.clone(), a.seed);
    let mut model = Decoder::new(&store, &weights, &plan.fine_tune)?;
    drop(weights);
    model.set_checkpointing(a.checkpointing)?;
    store.set_weight_decay("*", true)?;
    let trainable = store.num_elements();
    println!("{}", header(&a, &plan, &model, trainable, &dev));
    println!(
        "text {}: {}; loaded in {load_s:.1} s, tokenized in {tokenize_s:.1} s",
        a.text.display(),
        split.what
    );

    let mut engine = build_engine(&a, &plan, &store)?;
    if let Some(p) = &prior {
        resume(&a, &ckpt, &mut engine, p)?;
    }
    let start = engine.boundaries() as usize;
    let extra = serde_json::json!({ "run": fingerprint, "train_tokens": train.len() });

    let prompt = tok.encode(PROMPT)?;
    let noise = if a.tiny {
        " (random tiny model: noise)"
    } else {
        ""
    };
    let greedy = |m: &Decoder| -> Result<String> {
        tok.decode(&m.generate(&prompt, a.max_new_tokens, 0.0, 0)?)
    };
    let val_before = val_loss(&model, &val_batches)?;
    let greedy_before = greedy(&model)?;
    println!("validation loss at step {start}: {val_before:.4}");
    println!("greedy at step {start}{noise}: {greedy_before:?}");

    // Ctrl-C from here on saves a checkpoint and exits with 130
    checkpoint::install_interrupt_handler()?;
    let l = Loop {
        model: &model,
        engine: &mut engine,
        ckpt: &ckpt,
        extra: &extra,
        train,
        fixed: fixed.as_ref(),
        dev: &dev,
    };
    let trained = train_loop(&a, l, total_steps)?;
    let interrupted =
        || exit_if_interrupted(&engine, &ckpt, &extra, trained.final_checkpoint.as_deref());
    interrupted()?;
    let peak = wick::cuda::peak_memory_gb(&dev);
    let val_after = val_loss(&model, &val_batches)?;
    interrupted()?;
    let greedy_after = greedy(&model)?;
    interrupted()?;
    println!("validation loss after {total_steps} steps: {val_after:.4}");
    println!("greedy after{noise}: {greedy_after:?}");
    println!(
        "{:.2} ms/step, {}, peak memory {}",
        trained.ms_per_step,
        trained.throughput,
        peak.map_or("n/a (CPU)".into(), |g| format!("{g:.2} GB"))
    );
    save_outputs(&a, &model, &store, &tok, positions, &prompt, &interrupted)?;

    let mut result = serde_json::json!({
        "mode": plan.mode, "tiny": a.tiny,
        "checkpointing": a.checkpointing, "precision": precision.name(),
        "batch": a.batch, "context": a.context, "steps": a.steps, "warmup_steps": a.warmup_steps,
        "resumed_at": start, "train_tokens": train.len(), "val_tokens": val.len(),
        "trainable": trainable, "frozen_bytes": model.frozen_bytes(),
        "ms_per_step": trained.ms_per_step,
        "peak_GB": peak,
        "val_loss_before": val_before, "val_loss_after": val_after,
        "last_train_loss": trained.losses.last().map(|l| l.1), "train_losses": trained.losses,
        "greedy_before": greedy_before, "greedy_after": greedy_after,
    });
    if let (Some(r), serde_json::Value::Object(t)) =
        (result.as_object_mut(), trained.throughput.json())
    {
        r.extend(t);
    }
    println!("RESULT {result}");
    Ok(())
}
