//! Peak memory of one BERT fine-tuning step per recomputation mode ([`Recompute`]), measured
//! on the CPU by a counting global allocator: all-MiniLM-L6-v2's config (data/minilm, from
//! scripts/fetch_minilm.sh; random weights, the values do not matter), a classification head,
//! AdamW, bf16-mixed by default, one fixed batch of `--batch` rows of `--tokens` tokens.
//!
//! Each mode gets a fresh store and engine; two steps run first (the second allocates the
//! optimizer's moments), then the third step's peak is read. The "static" column is what the
//! store and optimizer hold between steps (fp32 masters, bf16 working copies, moments); "step"
//! is the peak above it: activations, gradients and temporaries. On the CPU every tensor lives
//! in host memory, so the figures track the GPU's (the CUDA pool's high-water mark) to within
//! the CUDA kernels' own workspaces.
//!
//! ```text
//! cargo run --release --example bert_memory -- --tokens 32
//! ```

use anyhow::Result;
use candle_core::Device;
use clap::Parser;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use wick::models::bert::{classification_loss, mean_pool, ClassifierHead, PaddedBatch, Recompute};
use wick::models::{Bert, BertConfig};
use wick::{Engine, EngineConfig, ParamStore, Precision};

/// The system allocator, counting the bytes in use and their high-water mark.
struct Counting;
static IN_USE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = IN_USE.fetch_add(by, Relaxed) + by;
    PEAK.fetch_max(now, Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            grew(l.size());
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        IN_USE.fetch_sub(l.size(), Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = System.realloc(p, l, new);
        if !q.is_null() {
            IN_USE.fetch_sub(l.size(), Relaxed);
            grew(new);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

#[derive(Parser, Debug)]
#[command(about = "Peak memory of a BERT fine-tuning step per recomputation mode (CPU)")]
struct Args {
    /// Folder with config.json.
    #[arg(long, default_value = "data/minilm")]
    model_dir: std::path::PathBuf,
    /// Rows per batch.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Tokens per row (the padded width; the genre task's longest batch is 32).
    #[arg(long, default_value_t = 32)]
    tokens: usize,
    /// 32 (fp32), bf16-mixed or 16-mixed.
    #[arg(long, default_value = "bf16-mixed")]
    precision: Precision,
}

fn mb(bytes: usize) -> f64 {
    bytes as f64 / 1e6
}

/// (static bytes, step peak bytes above them) for one mode.
fn measure(args: &Args, config: &BertConfig, recompute: Recompute) -> Result<(usize, usize)> {
    let store = ParamStore::new(args.precision, Device::Cpu, 0);
    let mut bert = Bert::new(&store, config.clone())?;
    bert.set_recompute(recompute);
    let head = ClassifierHead::new(&store, "head", config.hidden_size, 6)?;
    let mut engine = Engine::new(store.clone(), EngineConfig::adamw(1e-4))?;
    let vocab = config.vocab_size as u32;
    let rows: Vec<Vec<u32>> = (0..args.batch as u32)
        .map(|r| {
            (0..args.tokens as u32)
                .map(|j| (r * 131 + j * 17) % (vocab - 1) + 1)
                .collect()
        })
        .collect();
    let batch = PaddedBatch::new(&rows, 0, 8, &Device::Cpu)?;
    let labels: Vec<u32> = (0..args.batch as u32).map(|i| i % 6).collect();
    let mut result = (0, 0);
    for step in 0..3 {
        let before = IN_USE.load(Relaxed);
        PEAK.store(before, Relaxed);
        engine.step(|_| {
            let h = bert.forward(&batch).map_err(candle_core::Error::wrap)?;
            let pooled = mean_pool(&h, &batch.lengths).map_err(candle_core::Error::wrap)?;
            let logits = head.forward(&pooled).map_err(candle_core::Error::wrap)?;
            classification_loss(&logits, &labels).map_err(candle_core::Error::wrap)
        })?;
        if step == 2 {
            result = (before, PEAK.load(Relaxed) - before);
        }
    }
    Ok(result)
}

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.batch >= 1 && args.tokens >= 2,
        "--batch must be >= 1 and --tokens >= 2"
    );
    let config = BertConfig::from_json_file(&args.model_dir.join("config.json"))?;
    anyhow::ensure!(
        config.vocab_size >= 2,
        "the config's vocab_size is {}; the synthetic batch needs at least 2 ids",
        config.vocab_size
    );
    anyhow::ensure!(
        args.tokens <= config.max_position_embeddings,
        "--tokens {} is above the model's {} positions",
        args.tokens,
        config.max_position_embeddings
    );
    println!(
        "BERT step memory on the CPU: batch {} x {} tokens, {}",
        args.batch, args.tokens, args.precision
    );
    println!("| recompute | static MB | step MB | peak MB |");
    println!("|---|---:|---:|---:|");
    for mode in [Recompute::Off, Recompute::Attention, Recompute::Layer] {
        let (stat, step) = measure(&args, &config, mode)?;
        println!(
            "| {mode} | {:.1} | {:.1} | {:.1} |",
            mb(stat),
            mb(step),
            mb(stat + step)
        );
    }
    Ok(())
}
