//! Sample order: which indices an epoch visits, in which order, and how that order is split
//! into batches and across data-parallel ranks.
//!
//! - [`Sampler`]: the order of epoch `e` over `0..n`: `0, 1, ..., n-1` (sequential), or a
//!   permutation drawn from an RNG seeded with the pair `(seed, e)` (shuffled). The order of an
//!   epoch depends on nothing else, so a run resumed at epoch `e` sees the same order as an
//!   uninterrupted one, and every rank of a data-parallel job computes the same order.
//! - [`DistributedSampler`]: rank `r` of `w` keeps `order[r], order[r + w], order[r + 2w], ...`
//!   after padding or truncating the order to a multiple of `w`, exactly like
//!   `torch.utils.data.distributed.DistributedSampler`.
//! - [`batch_count`] / [`batch_range`]: consecutive batches of `batch_size` over an order,
//!   the last one short or dropped (`drop_last`), like `torch.utils.data.BatchSampler`.
//!
//! ```
//! use wick::data::{DistributedSampler, Sampler};
//! let order = Sampler { shuffle: false, seed: 0 }.epoch_order(5, 0);
//! assert_eq!(order, vec![0, 1, 2, 3, 4]);
//! // 5 samples over 2 ranks: padded to 6 with the first sample of the order.
//! let r0 = DistributedSampler::new(0, 2).unwrap().shard(&order);
//! let r1 = DistributedSampler::new(1, 2).unwrap().shard(&order);
//! assert_eq!((r0, r1), (vec![0, 2, 4], vec![1, 3, 0]));
//! ```

use std::ops::Range;

use anyhow::{ensure, Result};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

/// The per-epoch order over a dataset of `n` samples.
///
/// Shuffled orders use `StdRng::from_seed(k)` (ChaCha12) with the 32-byte key
/// `k = seed.to_le_bytes() ++ epoch.to_le_bytes() ++ [0; 16]` and `SliceRandom::shuffle` of
/// `0..n`. Unlike PyTorch's `DistributedSampler` (which seeds with `seed + epoch`), distinct
/// `(seed, epoch)` pairs never share a key. Orders are reproducible for a given `rand` version
/// (pinned by Cargo.lock).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sampler {
    /// Shuffle each epoch (`true`) or visit `0..n` in order (`false`).
    pub shuffle: bool,
    /// Base seed of the shuffle; ignored when `shuffle` is false.
    pub seed: u64,
}

impl Sampler {
    /// The order of epoch `epoch`: a permutation of `0..n`.
    pub fn epoch_order(&self, n: usize, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..n).collect();
        if self.shuffle {
            order.shuffle(&mut epoch_rng(self.seed, epoch));
        }
        order
    }
}

/// The RNG of epoch `epoch` under base seed `seed` (see [`Sampler`] for the key layout).
pub fn epoch_rng(seed: u64, epoch: u64) -> StdRng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&epoch.to_le_bytes());
    StdRng::from_seed(key)
}

/// Splits each epoch's order across `world_size` data-parallel ranks, PyTorch
/// `DistributedSampler` semantics (<https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler>):
///
/// - `drop_last = false` (PyTorch's default): the order of `n` samples is **padded** to
///   `total = ceil(n / w) * w` by appending its own first `total - n` entries (repeating the
///   order if `n` is tiny), so every rank gets `ceil(n / w)` samples. The `total - n < w`
///   padded samples are the only samples seen twice in the epoch (by different ranks).
/// - `drop_last = true`: the order is **truncated** to `total = floor(n / w) * w`; each rank
///   gets `floor(n / w)` samples and the last `n - total < w` samples of the order are not
///   seen this epoch (with shuffling, a different tail each epoch).
///
/// Rank `r` then takes the strided slice `padded[r..total].step_by(w)`. Shards are disjoint
/// apart from the padding and together cover the (padded or truncated) order. All ranks must
/// use the same [`Sampler`] (same seed) so that they split the same order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DistributedSampler {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of data-parallel ranks (>= 1).
    pub world_size: usize,
    /// Truncate (`true`) instead of pad (`false`) to a multiple of `world_size`.
    pub drop_last: bool,
}

impl DistributedSampler {
    /// Rank `rank` of `world_size`, padding (PyTorch's default `drop_last=False`).
    ///
    /// # Errors
    /// `world_size == 0` or `rank >= world_size`.
    pub fn new(rank: usize, world_size: usize) -> Result<Self> {
        let s = Self {
            rank,
            world_size,
            drop_last: false,
        };
        s.validate()?;
        Ok(s)
    }

    /// The same sampler with `drop_last` set (truncate instead of pad).
    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Check `world_size >= 1` and `rank < world_size`.
    pub fn validate(&self) -> Result<()> {
        ensure!(
            self.world_size >= 1,
            "DistributedSampler world_size must be at least 1, got 0"
        );
        ensure!(
            self.rank < self.world_size,
            "DistributedSampler rank {} is out of range for world_size {} (ranks are 0..{})",
            self.rank,
            self.world_size,
            self.world_size
        );
        Ok(())
    }

    /// Samples per rank per epoch for a dataset of `n`: `ceil(n / w)` when padding,
    /// `floor(n / w)` when dropping.
    pub fn shard_len(&self, n: usize) -> usize {
        let w = self.world_size.max(1);
        if self.drop_last {
            n / w
        } else {
            n.div_ceil(w)
        }
    }

    /// This rank's share of `order` (see the type's docs). Empty when `order` is empty, or
    /// when dropping and `order.len() < world_size`.
    pub fn shard(&self, order: &[usize]) -> Vec<usize> {
        let n = order.len();
        let w = self.world_size.max(1);
        let per_rank = self.shard_len(n);
        if n == 0 || per_rank == 0 {
            return Vec::new();
        }
        // Position p of the padded/truncated order is order[p % n] (padding wraps around).
        (0..per_rank)
            .map(|k| order[(self.rank + k * w) % n])
            .collect()
    }
}

/// Batches per epoch over `n` samples: `ceil(n / batch_size)`, or `floor(n / batch_size)`
/// with `drop_last` (the incomplete last batch is dropped). `batch_size` must be >= 1.
pub fn batch_count(n: usize, batch_size: usize, drop_last: bool) -> usize {
    let b = batch_size.max(1);
    if drop_last {
        n / b
    } else {
        n.div_ceil(b)
    }
}

/// Positions in the epoch order of batch `index`: `index * b .. min((index + 1) * b, n)`.
pub fn batch_range(index: usize, n: usize, batch_size: usize) -> Range<usize> {
    let start = (index * batch_size).min(n);
    start..(start + batch_size).min(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffled_orders_are_permutations_and_depend_on_seed_and_epoch() {
        let s = Sampler {
            shuffle: true,
            seed: 3,
        };
        let a = s.epoch_order(100, 0);
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        assert_eq!(a, s.epoch_order(100, 0));
        assert_ne!(a, s.epoch_order(100, 1));
        let other = Sampler {
            shuffle: true,
            seed: 4,
        };
        assert_ne!(a, other.epoch_order(100, 0));
        // (seed, epoch) = (3, 1) and (4, 0) differ, unlike seed + epoch seeding.
        assert_ne!(s.epoch_order(100, 1), other.epoch_order(100, 0));
    }

    #[test]
    fn padding_wraps_for_tiny_datasets() {
        // n = 2 over 5 ranks: padded to 5 = [a, b, a, b, a].
        let order = vec![7, 9];
        let got: Vec<Vec<usize>> = (0..5)
            .map(|r| DistributedSampler::new(r, 5).unwrap().shard(&order))
            .collect();
        assert_eq!(got, vec![vec![7], vec![9], vec![7], vec![9], vec![7]]);
        let dropped = DistributedSampler::new(0, 5)
            .unwrap()
            .with_drop_last(true)
            .shard(&order);
        assert!(dropped.is_empty());
    }

    #[test]
    fn batches() {
        assert_eq!(batch_count(10, 4, false), 3);
        assert_eq!(batch_count(10, 4, true), 2);
        assert_eq!(batch_count(8, 4, true), 2);
        assert_eq!(batch_range(2, 10, 4), 8..10);
        assert_eq!(batch_range(0, 10, 4), 0..4);
    }

    #[test]
    fn bad_rank_is_an_error() {
        assert!(DistributedSampler::new(2, 2).is_err());
        assert!(DistributedSampler::new(0, 0).is_err());
    }
}
