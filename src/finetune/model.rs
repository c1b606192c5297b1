//! Which model a fine-tuning run trains ([`ModelSpec`]: a GGUF file or an HF folder, with its
//! pretrained weights, random weights in its shapes, or a random tiny model of its family) and
//! reading it: config and positions first (cheap, for the checks that come before the weights),
//! then the tokenizer and the weights. `examples/finetune.rs` and `wick finetune` share it.

use crate::models::{DecoderConfig, DecoderWeights, Source};
use anyhow::{Context, Result};
use std::path::Path;

/// Positions of the tiny model ([`Weights::Tiny`]): its rotary tables.
pub const TINY_POSITIONS: usize = 512;

/// The weights a run starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weights {
    /// The file's own weights.
    Pretrained,
    /// The file's config with random weights N(0, 0.02) (timing runs; a GGUF holding only the
    /// metadata will do).
    Random,
    /// A random 2-block model of the file's family and vocabulary
    /// ([`DecoderConfig::tiny_family`], [`TINY_POSITIONS`] positions) with the file's tokenizer:
    /// smoke runs and tests, whose losses and text are noise.
    Tiny,
}

/// A model file or folder and the weights to start from.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    /// The GGUF file or HF folder.
    pub source: Source,
    /// Pretrained, random or tiny.
    pub weights: Weights,
}

/// A model's config as the run will build it, and its positions (the longest sequence).
#[derive(Debug, Clone)]
pub struct ModelShape {
    /// The config of the model that will be built (the tiny one for [`Weights::Tiny`]).
    pub config: DecoderConfig,
    /// Positions of that model: the file's context length, or [`TINY_POSITIONS`].
    pub positions: usize,
}

impl ModelSpec {
    /// The model's name for headers and an adapter's `base_model_name_or_path`: the file's or
    /// folder's name up to its first dot (`SmolLM2-135M-Instruct`).
    pub fn name(&self) -> String {
        model_name(self.source.path())
    }

    /// What a checkpoint records of the model: `"tiny"`, `"random-weights"` or the path.
    pub fn fingerprint(&self) -> String {
        match self.weights {
            Weights::Tiny => "tiny".into(),
            Weights::Random => "random-weights".into(),
            Weights::Pretrained => self.source.path().display().to_string(),
        }
    }

    /// The config and positions of the model this spec builds, from the file's metadata
    /// only (no weights read).
    ///
    /// Errors: the file cannot be read or names an architecture or key wick does not
    /// implement (naming the file).
    pub fn shape(&self) -> Result<ModelShape> {
        let file = self
            .source
            .config()
            .with_context(|| format!("reading {}", self.source.path().display()))?;
        Ok(match self.weights {
            Weights::Tiny => {
                let mut c = DecoderConfig::tiny_family(file.model_type, file.vocab_size);
                c.max_position_embeddings = TINY_POSITIONS;
                c.eos_token_id = file.eos_token_id;
                ModelShape {
                    config: c,
                    positions: TINY_POSITIONS,
                }
            }
            _ => ModelShape {
                positions: file.max_position_embeddings,
                config: file,
            },
        })
    }

    /// The weights, f32 on the CPU: the file's, or random ones (seeded) in `shape`'s config.
    ///
    /// Errors: as [`Source::weights`] and [`DecoderWeights::random`].
    pub fn weights(&self, shape: &ModelShape, seed: u64) -> Result<DecoderWeights> {
        match self.weights {
            Weights::Pretrained => self.source.weights(),
            Weights::Random | Weights::Tiny => DecoderWeights::random(shape.config.clone(), seed),
        }
    }

    /// A short description for the run's header: `SmolLM2-135M-Instruct (llama)`, with what
    /// random weights mean.
    pub fn describe(&self, shape: &ModelShape) -> String {
        let (name, family) = (self.name(), shape.config.model_type.model_type());
        match self.weights {
            Weights::Pretrained => format!("{name} ({family})"),
            Weights::Random => format!("{name} ({family}) config with random weights"),
            Weights::Tiny => {
                format!("random tiny {family} ({name}'s tokenizer; its losses and text are noise)")
            }
        }
    }
}

/// The name of a model file or folder up to its first dot.
pub fn model_name(path: &Path) -> String {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    name.split('.').next().unwrap_or_default().to_string()
}
