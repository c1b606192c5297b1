//! The optimizer steps of a run, decided before the first one ([`plan`]): each epoch's seeded
//! order of the training examples ([`crate::data::chat::epoch_order`]), grouped into
//! micro-batches ([`super::batches::group`]: packed to a token budget, or padded batches of a
//! fixed count), then `accumulation_steps` micro-batches per step, the epoch's last step taking
//! what is left. The plan depends only on the lengths, the grouping, the accumulation and the
//! seed, so a resumed run finds its next step at index `engine.boundaries()`, and a run given
//! more steps or epochs plans the same steps first.

use super::batches::{group, Grouping};
use crate::data::chat::epoch_order;
use anyhow::Result;

/// One optimizer step: its epoch and its micro-batches (indices into the training examples).
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// 0-based epoch.
    pub epoch: u64,
    /// Micro-batches, each a list of example indices, in order.
    pub micro: Vec<Vec<usize>>,
}

/// How long a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Length {
    /// Whole passes over the examples.
    Epochs(u64),
    /// This many optimizer steps (epochs repeat as needed; the last may be cut short).
    Steps(u64),
}

/// The steps of a run over examples of `lengths` tokens (see the module docs).
///
/// Errors: as [`group`] (an example longer than the packing budget).
pub fn plan(
    lengths: &[usize],
    grouping: Grouping,
    accumulation_steps: usize,
    seed: u64,
    length: Length,
) -> Result<Vec<Step>> {
    let accumulation = accumulation_steps.max(1);
    let mut steps = Vec::new();
    let mut epoch = 0u64;
    loop {
        match length {
            Length::Epochs(e) if epoch >= e => break,
            Length::Steps(s) if steps.len() as u64 >= s => break,
            _ => {}
        }
        let order = epoch_order(lengths.len(), seed, epoch);
        let micro = group(lengths, &order, grouping)?;
        if micro.is_empty() {
            break;
        }
        for window in micro.chunks(accumulation) {
            steps.push(Step {
                epoch,
                micro: window.to_vec(),
            });
        }
        epoch += 1;
    }
    if let Length::Steps(s) = length {
        steps.truncate(s as usize);
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_longer_run_plans_the_same_steps_first() {
        let lengths: Vec<usize> = (0..23).map(|i| 5 + (i * 7) % 13).collect();
        let g = Grouping::Padded { batch_size: 4 };
        let one = plan(&lengths, g, 2, 7, Length::Epochs(1)).unwrap();
        // 23 examples: 6 micro-batches of <= 4, 3 steps of 2
        assert_eq!(one.len(), 3);
        let mut seen: Vec<usize> = one.iter().flat_map(|s| s.micro.concat()).collect();
        seen.sort();
        assert_eq!(seen, (0..23).collect::<Vec<_>>());
        let three = plan(&lengths, g, 2, 7, Length::Epochs(3)).unwrap();
        assert_eq!(three.len(), 9);
        assert_eq!(three[..3], one[..]);
        assert_eq!(three[8].epoch, 2);
        let five = plan(&lengths, g, 2, 7, Length::Steps(5)).unwrap();
        assert_eq!(five[..], three[..5]);
    }
}
