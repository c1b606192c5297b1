//! Micro-batches of tokenized conversations on the device ([`micro_batch`]):
//! packed without padding (`crate::data::packing`: whole conversations up to a token budget,
//! attention kept inside each, RoPE positions restarting) or padded to the longest
//! conversation of a fixed count. The one place `wick finetune` meets the packing API.

use crate::data::chat::Tokenized;
use crate::data::packing::{self, TrainBatch};
use anyhow::{ensure, Result};
use candle_core::Device;

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

/// The micro-batch of `examples[i]` for `i` in `indices` on `device`, laid out as `grouping`
/// says ([`TrainBatch`] carries its counts: examples, tokens, trained targets).
///
/// Errors: no index, an index out of range, no trained target, a tensor that cannot be built
/// on `device`.
pub fn micro_batch(
    examples: &[Tokenized],
    indices: &[usize],
    grouping: Grouping,
    device: &Device,
) -> Result<TrainBatch> {
    ensure!(!indices.is_empty(), "an empty micro-batch");
    let picked: Vec<&Tokenized> = indices
        .iter()
        .map(|&i| {
            examples
                .get(i)
                .ok_or_else(|| anyhow::anyhow!("example {i} of {} does not exist", examples.len()))
        })
        .collect::<Result<_>>()?;
    let batch = match grouping {
        Grouping::Packed { .. } => TrainBatch::packed(&picked, device)?,
        Grouping::Padded { .. } => TrainBatch::padded(&picked, device)?,
    };
    ensure!(
        batch.trained_targets() > 0,
        "a micro-batch with no trained target"
    );
    Ok(batch)
}
