//! The evaluation loss on the held-out conversations: every held-out example once, in order,
//! in micro-batches grouped as the training ones, the micro-batch losses weighted by their
//! trained targets, so the result is the mean cross-entropy over all held-out targets
//! (transformers' `eval_loss` with token-weighted averaging).

use super::batches::{group, micro_batch, Grouping};
use crate::data::chat::Tokenized;
use crate::models::Decoder;
use anyhow::{Context, Result};
use candle_core::Device;

/// The held-out examples' micro-batches, fixed for the run.
pub struct EvalSet<'a> {
    examples: &'a [Tokenized],
    groups: Vec<Vec<usize>>,
    grouping: Grouping,
}

impl<'a> EvalSet<'a> {
    /// `examples` in their order, grouped by `grouping`.
    ///
    /// Errors: as [`group`].
    pub fn new(examples: &'a [Tokenized], grouping: Grouping) -> Result<Self> {
        let lengths: Vec<usize> = examples.iter().map(|t| t.ids.len()).collect();
        let order: Vec<usize> = (0..examples.len()).collect();
        Ok(Self {
            groups: group(&lengths, &order, grouping)?,
            examples,
            grouping,
        })
    }

    /// No held-out example.
    pub fn is_empty(&self) -> bool {
        self.examples.is_empty()
    }

    /// Held-out examples.
    pub fn len(&self) -> usize {
        self.examples.len()
    }

    /// Mean cross-entropy of `model` over every trained target of the held-out examples.
    ///
    /// Errors: no example, or the model's error on a micro-batch.
    pub fn loss(&self, model: &Decoder, device: &Device) -> Result<f64> {
        anyhow::ensure!(!self.is_empty(), "no held-out conversation to evaluate on");
        let (mut sum, mut weight) = (0.0f64, 0usize);
        for g in &self.groups {
            let mb = micro_batch(self.examples, g, self.grouping, device)?;
            let l = model
                .eval_loss(&mb)
                .context("the evaluation loss")?
                .to_scalar::<f32>()?;
            sum += l as f64 * mb.trained_targets() as f64;
            weight += mb.trained_targets();
        }
        Ok(sum / weight as f64)
    }
}
