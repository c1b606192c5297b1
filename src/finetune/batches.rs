//! Micro-batches of tokenized conversations on the device ([`MicroBatch`]) and their loss:
//! packed without padding (`crate::data::packing`: whole conversations up to a token budget,
//! attention kept inside each, RoPE positions restarting) or padded to the longest
//! conversation of a fixed count. The one place `wick finetune` meets the packing API.

use crate::data::chat::Tokenized;
use crate::data::packing::{self, TrainBatch};
use crate::models::Decoder;
use anyhow::{ensure, Result};
use candle_core::{Device, Tensor};

/// How examples are grouped into micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grouping {
    /// Whole examples, in order, while their tokens fit `budget` (a micro-batch has at least
    /// one example).
    Packed {
        /// Tokens per micro-batch at most.
        budget: usize,
    },
    /// `batch_size` examples per micro-batch (the last may have fewer), padded.
    Padded {
        /// Examples per micro-batch.
        batch_size: usize,
    },
}

/// `order` (indices into examples of `lengths` tokens) cut into micro-batches.
///
/// Errors: as [`packing::pack`] (an example longer than the budget, an index out of range).
pub fn group(lengths: &[usize], order: &[usize], grouping: Grouping) -> Result<Vec<Vec<usize>>> {
    Ok(match grouping {
        Grouping::Packed { budget } => packing::pack(lengths, order, budget)?,
        Grouping::Padded { batch_size } => order
            .chunks(batch_size.max(1))
            .map(<[usize]>::to_vec)
            .collect(),
    })
}

/// One micro-batch on the device, with its counts.
pub struct MicroBatch {
    /// The ids, targets and (packed) document offsets.
    pub batch: TrainBatch,
    /// Conversations in it.
    pub examples: usize,
    /// Real (non-padding) tokens in it.
    pub tokens: usize,
    /// Targets the loss averages over: the micro-batch's weight in its step.
    pub targets: usize,
}

impl MicroBatch {
    /// The micro-batch of `examples[i]` for `i` in `indices`, laid out as `grouping` says.
    ///
    /// Errors: no index, an index out of range, no trained target, a tensor that cannot be
    /// built on `device`.
    pub fn new(
        examples: &[Tokenized],
        indices: &[usize],
        grouping: Grouping,
        device: &Device,
    ) -> Result<Self> {
        ensure!(!indices.is_empty(), "an empty micro-batch");
        let picked: Vec<&Tokenized> = indices
            .iter()
            .map(|&i| {
                examples.get(i).ok_or_else(|| {
                    anyhow::anyhow!("example {i} of {} does not exist", examples.len())
                })
            })
            .collect::<Result<_>>()?;
        let batch = match grouping {
            Grouping::Packed { .. } => TrainBatch::packed(&picked, device)?,
            Grouping::Padded { .. } => TrainBatch::padded(&picked, device)?,
        };
        let targets = batch.trained_targets();
        ensure!(targets > 0, "a micro-batch with no trained target");
        Ok(Self {
            examples: batch.examples,
            tokens: batch.tokens,
            targets,
            batch,
        })
    }

    /// Mean cross-entropy over the micro-batch's trained targets, rank-0 f32 (training mode).
    ///
    /// Errors: the model's.
    pub fn loss(&self, model: &Decoder) -> Result<Tensor> {
        model.batch_loss(&self.batch)
    }
}
