//! Writes the micro-batches that `wick finetune --config FILE` trains on, in order, one JSON
//! line each (`{"ids": [[...], ...], "labels": [[...], ...]}`:
//! [`wick::data::packing::write_steps_jsonl`]), so that `scripts/reference/torch_chat_sft.py`
//! trains PyTorch on the very same conversations, grouped the same way (issue 38 item 6). The
//! plan is the command's own ([`wick::finetune::steps`] over the same data, tokenizer,
//! grouping and seed).
//!
//! ```text
//! cargo run --release --example chat_steps -- --config run.toml --out steps.jsonl
//! ```

use anyhow::{Context, Result};
use clap::Parser;
use std::path::PathBuf;
use wick::finetune::{config::FinetuneConfig, data, model_spec, steps};

/// Write a `wick finetune` config's micro-batches as JSON lines.
#[derive(Parser, Debug)]
struct Args {
    /// The run's TOML config.
    #[arg(long)]
    config: PathBuf,
    /// The JSONL file to write.
    #[arg(long)]
    out: PathBuf,
}

fn main() -> Result<()> {
    let a = Args::parse();
    let file = || format!("the config file {}", a.config.display());
    let mut c = FinetuneConfig::from_toml_file(&a.config)?;
    let spec = model_spec(&c).with_context(file)?;
    let shape = spec.shape().context("[model]").with_context(file)?;
    c.fit_to_model(shape.positions).with_context(file)?;
    let tok = spec.source.tokenizer()?;
    let chat = data::load(&c, &tok).with_context(file)?;
    let lengths: Vec<usize> = chat.train.iter().map(|t| t.ids.len()).collect();
    let steps = steps(&c, &lengths).with_context(file)?;
    let micro: Vec<Vec<usize>> = steps.into_iter().flat_map(|s| s.micro).collect();
    wick::data::packing::write_steps_jsonl(&a.out, &micro, &chat.train)?;
    let tokens: usize = micro.iter().flatten().map(|&i| lengths[i]).sum();
    println!(
        "{}: {} micro-batches, {tokens} tokens",
        a.out.display(),
        micro.len()
    );
    Ok(())
}
