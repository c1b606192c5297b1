//! Writing a fine-tuned model: the LoRA adapter as PEFT's folder and the (merged) weights as an
//! HF folder, each with the tokenizer files (`tokenizer.json`, `tokenizer_config.json` with the
//! chat template), so that `PeftModel.from_pretrained`, `AutoTokenizer.from_pretrained` and
//! `AutoModelForCausalLM.from_pretrained` load them as they are. Every file is written
//! atomically (a temporary file renamed into place). `examples/finetune.rs` and
//! `wick finetune` share it.

use crate::lora;
use crate::models::files;
use crate::models::tokenizer::TextTokenizer;
use crate::models::{Decoder, DecoderWeights};
use crate::ParamStore;
use anyhow::{bail, Context, Result};
use std::path::Path;

/// Writes an HF folder: `config.json` and `model.safetensors` of `weights`, then the tokenizer
/// files (`positions` becomes `model_max_length`).
///
/// Errors: an I/O failure, naming the file.
pub fn save_hf_folder(
    weights: &DecoderWeights,
    tok: &TextTokenizer,
    dir: &Path,
    positions: usize,
) -> Result<()> {
    files::save_pretrained(weights, dir)?;
    tok.save_pretrained(dir, positions)
        .with_context(|| format!("writing the tokenizer files into {}", dir.display()))
}

/// Writes `model`'s LoRA adapters (their fp32 masters in `store`) as PEFT's folder
/// (`adapter_model.safetensors`, `adapter_config.json` naming `base_model`) plus the tokenizer
/// files, as PEFT's trainers do.
///
/// Errors: the model has no LoRA adapters (a full fine-tune), or an I/O failure.
pub fn save_adapter(
    model: &Decoder,
    store: &ParamStore,
    tok: &TextTokenizer,
    base_model: &str,
    dir: &Path,
    positions: usize,
) -> Result<()> {
    let Some(l) = model.lora() else {
        bail!("no LoRA adapters to save: the model is fully fine-tuned (save it as an HF folder)");
    };
    lora::save_adapter_tensors(model.adapter_masters(store)?, l, base_model, dir)?;
    tok.save_pretrained(dir, positions)
        .with_context(|| format!("writing the tokenizer files into {}", dir.display()))
}

/// Writes `model` with every LoRA update merged (the trained weights of a full fine-tune) as
/// an HF folder with the tokenizer files.
///
/// Errors: as [`save_hf_folder`].
pub fn save_merged(
    model: &Decoder,
    store: &ParamStore,
    tok: &TextTokenizer,
    dir: &Path,
    positions: usize,
) -> Result<()> {
    save_hf_folder(&model.merged_weights(store)?, tok, dir, positions)
}
