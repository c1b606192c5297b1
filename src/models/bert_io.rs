//! Pretrained BERT weights in and out, by transformers' tensor names.
//!
//! [`load_pretrained`] reads a `model.safetensors` (the names of `BertModel`, with or without
//! the `bert.` prefix of `BertFor*` checkpoints) into the encoder's fp32 masters;
//! [`save_pretrained`] writes a folder that transformers' `BertModel.from_pretrained`,
//! sentence-transformers and candle-transformers' `BertModel` load back.

use super::bert::BertConfig;
use crate::params::ParamStore;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// Checkpoint tensors that the encoder does not use: BERT's pooler (mean pooling replaces it)
/// and the `position_ids` buffer some exports carry.
pub const UNUSED_TENSORS: [&str; 3] = [
    "pooler.dense.weight",
    "pooler.dense.bias",
    "embeddings.position_ids",
];

/// The encoder's parameter-name prefixes; other store parameters (a head) are not in the file.
const ENCODER_PREFIXES: [&str; 2] = ["embeddings.", "encoder."];

fn is_encoder(name: &str) -> bool {
    ENCODER_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// What [`load_pretrained`] found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadReport {
    /// Encoder parameters loaded from the file.
    pub loaded: usize,
    /// Tensors of the file that the model has no parameter for (a warning, as transformers'
    /// "weights not used"), sorted.
    pub unexpected: Vec<String>,
    /// Known unused tensors that were skipped ([`UNUSED_TENSORS`]), sorted.
    pub ignored: Vec<String>,
}

/// Loads the encoder parameters of `store` (names `embeddings.*` and `encoder.*`, created by
/// [`super::Bert::new`]) from the safetensors file `path` (any float dtype; cast to f32) and
/// refreshes the working copies. A `bert.` prefix is stripped from the names that have one
/// (`BertFor*` checkpoints; their head tensors are then reported as unexpected).
///
/// All-or-nothing: every name and shape is checked before a master changes.
///
/// Errors: an unreadable file; encoder parameters missing from the file (every one named);
/// shape mismatches (every one named with the file's and the model's shapes).
pub fn load_pretrained(store: &ParamStore, path: &Path) -> Result<LoadReport> {
    let mut file = candle_core::safetensors::load(path, &Device::Cpu)
        .with_context(|| format!("reading BERT weights from {}", path.display()))?;
    // BertFor* checkpoints: the encoder under `bert.`, heads (`cls.*`, `classifier.*`) beside it
    if file.keys().any(|k| k.starts_with("bert.")) {
        file = file
            .into_iter()
            .map(|(k, v)| match k.strip_prefix("bert.") {
                Some(rest) => (rest.to_string(), v),
                None => (k, v),
            })
            .collect();
    }
    let params: Vec<_> = store
        .params()
        .into_iter()
        .filter(|p| is_encoder(&p.name))
        .collect();
    let mut missing = Vec::new();
    let mut mismatched = Vec::new();
    let mut staged = Vec::with_capacity(params.len());
    for p in &params {
        match file.get(&p.name) {
            None => missing.push(p.name.clone()),
            Some(t) if t.dims() != p.master.dims() => mismatched.push(format!(
                "{}: file {:?}, model {:?}",
                p.name,
                t.dims(),
                p.master.dims()
            )),
            Some(t) => staged.push(t.to_dtype(DType::F32)?.to_device(store.device())?),
        }
    }
    if !missing.is_empty() || !mismatched.is_empty() {
        let mut msg = format!("{} does not fit the model:", path.display());
        if !missing.is_empty() {
            msg += &format!(
                " {} tensor(s) missing: {};",
                missing.len(),
                missing.join(", ")
            );
        }
        if !mismatched.is_empty() {
            msg += &format!(
                " {} shape mismatch(es): {};",
                mismatched.len(),
                mismatched.join("; ")
            );
        }
        bail!("{msg} nothing was loaded (is config.json the one of these weights?)");
    }
    let known: HashMap<&str, ()> = params.iter().map(|p| (p.name.as_str(), ())).collect();
    let mut report = LoadReport {
        loaded: params.len(),
        ..LoadReport::default()
    };
    for name in file.keys().filter(|k| !known.contains_key(k.as_str())) {
        if UNUSED_TENSORS.contains(&name.as_str()) {
            report.ignored.push(name.clone());
        } else {
            report.unexpected.push(name.clone());
        }
    }
    report.unexpected.sort();
    report.ignored.sort();
    if !report.unexpected.is_empty() {
        tracing::warn!(
            "{}: {} tensor(s) not used by the model: {}",
            path.display(),
            report.unexpected.len(),
            report.unexpected.join(", ")
        );
    }
    for (p, t) in params.iter().zip(staged) {
        p.master.set(&t)?;
    }
    store.refresh_working_copies()?;
    Ok(report)
}

/// Writes the encoder (the fp32 masters of every `embeddings.*` / `encoder.*` parameter, by
/// transformers' names) to `dir/model.safetensors` and its configuration to `dir/config.json`
/// (`model_type: "bert"`, `architectures: ["BertModel"]`, so that transformers and
/// sentence-transformers recognise it), and copies `tokenizer` to `dir/tokenizer.json` when
/// given. Each file is written atomically. Other parameters (a head) are not written; save
/// them with [`crate::checkpoint::save_safetensors_atomic`].
///
/// Errors: no encoder parameter in the store, or an I/O failure (naming the file).
pub fn save_pretrained(
    store: &ParamStore,
    config: &BertConfig,
    dir: &Path,
    tokenizer: Option<&Path>,
) -> Result<()> {
    let tensors: Vec<(String, Tensor)> = store
        .masters()
        .into_iter()
        .filter(|(n, _)| is_encoder(n))
        .collect();
    if tensors.is_empty() {
        bail!(
            "save_pretrained: the store has no BERT encoder parameters (embeddings.*, encoder.*)"
        );
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    crate::checkpoint::save_safetensors_atomic(&dir.join("model.safetensors"), tensors)?;
    let mut json = serde_json::to_value(config)?;
    if let Some(m) = json.as_object_mut() {
        m.insert("model_type".into(), "bert".into());
        m.insert("architectures".into(), serde_json::json!(["BertModel"]));
        m.insert("position_embedding_type".into(), "absolute".into());
        // transformers' defaults, for configs made in code (readers such as
        // candle-transformers require them)
        for (k, v) in [
            ("hidden_dropout_prob", 0.1),
            ("attention_probs_dropout_prob", 0.1),
            ("initializer_range", 0.02),
        ] {
            m.entry(k).or_insert(v.into());
        }
    }
    crate::checkpoint::write_file_atomic(
        &dir.join("config.json"),
        serde_json::to_string_pretty(&json)?.as_bytes(),
    )?;
    if let Some(t) = tokenizer {
        let bytes = std::fs::read(t).with_context(|| format!("reading {}", t.display()))?;
        crate::checkpoint::write_file_atomic(&dir.join("tokenizer.json"), &bytes)?;
    }
    Ok(())
}
