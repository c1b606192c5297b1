//! Continue training SmolLM2-135M-Instruct (Llama architecture, from its GGUF) on Shakespeare,
//! fully or with LoRA, the setup of `../shared/reference/torch_llama.py`:
//!
//! ```text
//! scripts/fetch_smollm2.sh && scripts/fetch_shakespeare.sh
//! cargo run --release --features cuda --example finetune_llama -- --device cuda --full
//! cargo run --release --features cuda --example finetune_llama -- --device cuda --lora 16
//! ```
//! The text (data/shakespeare/input.txt) is tokenized with the GGUF's own tokenizer and split
//! 90/10 by position; batches are random windows of `--context` tokens. Prints the validation
//! loss and a greedy continuation of a fixed prompt before and after, ms/step, tokens/s and
//! peak memory (CUDA), and a `RESULT {json}` line. `--save DIR` writes the LoRA adapters
//! (PEFT's layout) or, with `--full`, the weights as an HF folder; `--save-merged DIR` writes
//! the LoRA-merged model as an HF folder. `--tiny` swaps the model for a random 2-block
//! config (CPU smoke runs); `--random-weights` keeps the GGUF's config with random weights
//! (timing runs from a GGUF that carries only the tokenizer and config).

use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Tensor};
use clap::Parser;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::path::PathBuf;
use std::time::Instant;
use wick::lora::{self, LoraConfig};
use wick::models::llama_io::{self, Gguf};
use wick::models::llama_tokenizer::LlamaTokenizer;
use wick::models::{FineTune, KvCache, Llama, LlamaConfig, LlamaWeights};
use wick::optim::LrSchedule;
use wick::{Engine, EngineConfig, ParamStore, Precision};

#[derive(Parser, Debug)]
#[command(about = "Fine-tune SmolLM2-135M (GGUF) on Shakespeare: full or LoRA")]
struct Args {
    /// The GGUF file (weights, tokenizer, chat template).
    #[arg(long, default_value = "data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")]
    gguf: PathBuf,
    /// Train text (scripts/fetch_shakespeare.sh).
    #[arg(long, default_value = "data/shakespeare/input.txt")]
    text: PathBuf,
    /// Full fine-tuning (every weight trainable).
    #[arg(long, conflicts_with = "lora")]
    full: bool,
    /// LoRA rank (the default mode, rank 16).
    #[arg(long)]
    lora: Option<usize>,
    /// LoRA alpha (default: 2 x rank).
    #[arg(long)]
    alpha: Option<f64>,
    /// LoRA dropout.
    #[arg(long, default_value_t = 0.0)]
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
    /// fp32, bf16-mixed or 16-mixed.
    #[arg(long, default_value = "bf16-mixed")]
    precision: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Timed training steps.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Untimed training steps before them (kernel JIT, allocator warm-up).
    #[arg(long, default_value_t = 3)]
    warmup_steps: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 1024)]
    context: usize,
    /// Validation batches (random windows of the last 10%, fixed seed).
    #[arg(long, default_value_t = 16)]
    val_batches: usize,
    /// Learning rate (default 5e-5 full, 1e-3 LoRA).
    #[arg(long)]
    lr: Option<f64>,
    /// AdamW weight decay (default 0.1 full, 0 LoRA), on every trainable tensor as in the
    /// PyTorch reference's single parameter group.
    #[arg(long)]
    weight_decay: Option<f64>,
    /// Global gradient-norm clip.
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// Tokens of the greedy continuation.
    #[arg(long, default_value_t = 40)]
    max_new_tokens: usize,
    /// Save the adapters (LoRA) or the weights (full) here.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Save the LoRA-merged model here (an HF folder).
    #[arg(long)]
    save_merged: Option<PathBuf>,
    /// Write the trained model's logits summary on the prompt (scripts/smollm2_fixture.py
    /// check-adapter / check-merged read it).
    #[arg(long)]
    export_logits: Option<PathBuf>,
    /// A random 2-block model (vocabulary of the GGUF's tokenizer) instead of the GGUF's.
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
    /// scripts/torch_llama_windows.py (the draws of ../shared/reference/torch_llama.py).
    #[arg(long)]
    windows: Option<PathBuf>,
    /// The mode's key in `--windows` (default: full or lora).
    #[arg(long)]
    windows_mode: Option<String>,
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

fn val_loss(model: &Llama, batches: &[(Tensor, Tensor)]) -> Result<f64> {
    let mut total = 0.0;
    for (x, y) in batches {
        total += model.loss(x, y)?.detach().to_scalar::<f32>()? as f64;
    }
    Ok(total / batches.len() as f64)
}

/// The summary of the prompt's logits that scripts/smollm2_fixture.py compares.
fn logits_summary(model: &Llama, prompt: &[u32], dev: &Device) -> Result<serde_json::Value> {
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

fn main() -> Result<()> {
    let a = Args::parse();
    ensure!(
        a.batch >= 1 && a.context >= 2 && a.val_batches >= 1,
        "--batch and --val-batches must be >= 1 and --context >= 2"
    );
    let precision: Precision = a.precision.parse()?;
    let dev = wick::device_from_flag(&a.device)?;
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
    let lr = a.lr.unwrap_or(if a.full { 5e-5 } else { 1e-3 });
    let wd = a.weight_decay.unwrap_or(if a.full { 0.1 } else { 0.0 });
    ensure!(lr.is_finite() && lr > 0.0, "--lr must be finite and > 0");

    // model, tokenizer, data
    let t0 = Instant::now();
    let gguf = Gguf::open(&a.gguf).with_context(|| {
        format!(
            "{} (run scripts/fetch_smollm2.sh to fetch SmolLM2-135M-Instruct)",
            a.gguf.display()
        )
    })?;
    let tok = LlamaTokenizer::from_gguf(&gguf)?;
    let weights = if a.tiny {
        let mut c = LlamaConfig::tiny(gguf.config()?.vocab_size);
        c.max_position_embeddings = a.context.max(64);
        c.eos_token_id = gguf.config()?.eos_token_id;
        LlamaWeights::random(c, a.seed)?
    } else if a.random_weights {
        LlamaWeights::random(gguf.config()?, a.seed)?
    } else {
        let mut g = gguf;
        g.weights()?
    };
    let load_s = t0.elapsed().as_secs_f64();
    ensure!(
        a.context <= weights.config.max_position_embeddings,
        "--context {} exceeds the model's {} positions",
        a.context,
        weights.config.max_position_embeddings
    );
    let text = std::fs::read_to_string(&a.text).with_context(|| {
        format!(
            "reading {} (run scripts/fetch_shakespeare.sh)",
            a.text.display()
        )
    })?;
    let t1 = Instant::now();
    let ids = tok.encode(&text)?;
    let tokenize_s = t1.elapsed().as_secs_f64();
    let n_train = (0.9 * ids.len() as f64) as usize; // torch_llama.py: int(0.9 * len(ids))
    let (train, val) = ids.split_at(n_train);
    if val.len() < a.context + 2 {
        bail!(
            "{}: {} tokens leave {} for validation, fewer than --context {} + 2",
            a.text.display(),
            ids.len(),
            val.len(),
            a.context
        );
    }
    let fixed = match &a.windows {
        Some(p) => {
            let mode = a
                .windows_mode
                .clone()
                .unwrap_or(if a.full { "full" } else { "lora" }.into());
            let w = read_windows(p, &mode, train.len())?;
            let needed = a.warmup_steps + a.steps;
            let fits = |l: &[Vec<usize>], len: usize| {
                l.iter().flatten().all(|&s| s + a.context < len)
                    && l.iter().all(|b| b.len() == a.batch)
            };
            ensure!(
                w.train.len() >= needed && fits(&w.train, train.len()) && fits(&w.val, val.len()),
                "{}: the windows do not fit --batch {} --context {} and {needed} steps",
                p.display(),
                a.batch,
                a.context
            );
            Some(w)
        }
        None => None,
    };
    let mut vrng = StdRng::seed_from_u64(a.seed + 1);
    let val_batches = match &fixed {
        Some(w) => w
            .val
            .iter()
            .map(|s| windows(val, s, a.context, &dev))
            .collect::<Result<Vec<_>>>()?,
        None => (0..a.val_batches)
            .map(|_| {
                let s = random_starts(&mut vrng, val.len(), a.context, a.batch);
                windows(val, &s, a.context, &dev)
            })
            .collect::<Result<Vec<_>>>()?,
    };

    let store = ParamStore::new(precision, dev.clone(), a.seed);
    let mut model = Llama::new(&store, &weights, &fine_tune)?;
    drop(weights);
    model.set_checkpointing(a.checkpointing)?;
    store.set_weight_decay("*", true)?;
    let trainable = store.num_elements();
    println!(
        "SmolLM2 {}: {} blocks, {} trainable parameters, frozen base {:.1} MB, {} on {:?}; \
         text {} tokens ({} train / {} val), loaded in {load_s:.1} s, tokenized in {tokenize_s:.1} s",
        if a.full { "full fine-tune" } else { "LoRA" },
        model.config().num_hidden_layers,
        trainable,
        model.frozen_bytes() as f64 / 1e6,
        precision.name(),
        dev,
        ids.len(),
        train.len(),
        val.len()
    );
    let prompt = tok.encode(PROMPT)?;
    let greedy = |m: &Llama| -> Result<String> {
        tok.decode(&m.generate(&prompt, a.max_new_tokens, 0.0, 0)?)
    };
    let val_before = val_loss(&model, &val_batches)?;
    let greedy_before = greedy(&model)?;
    println!("validation loss before: {val_before:.4}");
    println!("greedy before: {greedy_before:?}");

    let mut ec = EngineConfig::adamw(lr);
    if let wick::engine::OptimizerConfig::AdamW(o) = &mut ec.optimizer {
        o.beta2 = 0.95;
        o.weight_decay = wd;
    }
    ec.schedule = LrSchedule::Constant { lr };
    ec.max_grad_norm = Some(a.clip);
    let mut engine = Engine::new(store.clone(), ec)?;
    let mut rng = StdRng::seed_from_u64(a.seed);
    let mut drawn = 0;
    let mut step = |engine: &mut Engine| -> Result<wick::StepReport> {
        let s = match &fixed {
            Some(w) => w.train[drawn].clone(),
            None => random_starts(&mut rng, train.len(), a.context, a.batch),
        };
        drawn += 1;
        let (x, y) = windows(train, &s, a.context, &dev)?;
        engine.step(|_| model.loss(&x, &y))
    };
    wick::cuda::reset_peak_memory(&dev)?;
    for _ in 0..a.warmup_steps {
        step(&mut engine)?;
    }
    dev.synchronize()?;
    let t2 = Instant::now();
    let mut last_loss = f32::NAN;
    for i in 0..a.steps {
        let r = step(&mut engine)?;
        // reading the loss waits for the step: only at the log points
        if i % 25 == 0 || i + 1 == a.steps {
            last_loss = r.loss()?;
            let (host, gpu) = (r.times(), r.spans.resolve()?);
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            println!(
                "step {i:>4}  loss {last_loss:.4}  device fwd/bwd/optim {:.1}/{:.1}/{:.1} ms, \
                 host queueing {:.1}/{:.1}/{:.1} ms",
                ms(gpu.forward),
                ms(gpu.backward),
                ms(gpu.optimizer),
                ms(host.forward),
                ms(host.backward),
                ms(host.optimizer)
            );
        }
    }
    dev.synchronize()?;
    let secs = t2.elapsed().as_secs_f64();
    let ms = secs * 1e3 / a.steps.max(1) as f64;
    let tokens_per_s = (a.batch * a.context) as f64 / ms * 1e3;
    let peak = wick::cuda::peak_memory_gb(&dev);
    let val_after = val_loss(&model, &val_batches)?;
    let greedy_after = greedy(&model)?;
    println!(
        "validation loss after {} steps: {val_after:.4}",
        a.steps + a.warmup_steps
    );
    println!("greedy after: {greedy_after:?}");
    println!(
        "{:.2} ms/step, {:.0} tokens/s, peak memory {}",
        ms,
        tokens_per_s,
        peak.map_or("n/a (CPU)".into(), |g| format!("{g:.2} GB"))
    );

    if let Some(dir) = &a.save {
        match model.lora() {
            Some(l) => lora::save_adapter_tensors(
                model.adapter_masters(&store)?,
                l,
                "SmolLM2-135M-Instruct",
                dir,
            )?,
            None => llama_io::save_pretrained(&model.merged_weights(&store)?, dir)?,
        }
        println!("saved to {}", dir.display());
    }
    if let Some(dir) = &a.save_merged {
        llama_io::save_pretrained(&model.merged_weights(&store)?, dir)?;
        println!("saved the merged model to {}", dir.display());
    }
    if let Some(f) = &a.export_logits {
        let s = logits_summary(&model, &prompt, &dev)?;
        wick::checkpoint::write_file_atomic(f, serde_json::to_string(&s)?.as_bytes())?;
    }
    let result = serde_json::json!({
        "mode": if a.full { "full".to_string() } else { format!("lora{rank}") },
        "checkpointing": a.checkpointing, "precision": precision.name(),
        "batch": a.batch, "context": a.context, "steps": a.steps, "warmup_steps": a.warmup_steps,
        "trainable": trainable, "frozen_bytes": model.frozen_bytes(),
        "ms_per_step": ms, "tok_per_s": tokens_per_s, "peak_GB": peak,
        "val_loss_before": val_before, "val_loss_after": val_after, "last_train_loss": last_loss,
        "greedy_before": greedy_before, "greedy_after": greedy_after,
    });
    println!("RESULT {result}");
    Ok(())
}
