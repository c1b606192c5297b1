//! Length-grouped batches for dynamic padding: batches of examples of similar length, so that
//! padding each batch to its own longest example wastes little. The scheme of transformers'
//! `LengthGroupedSampler` (`group_by_length=True`): shuffle, cut the order into mega-batches
//! of `mega` batches, sort each mega-batch by length (longest first), cut it into batches; then
//! this module also shuffles the order of the batches, so that lengths are mixed over an epoch.

use rand::seq::SliceRandom;

/// Batches of indices into `lengths` (every index exactly once; the last batch of a
/// mega-batch may be short), for `epoch` of a run seeded by `seed` (the same RNG as
/// [`super::sampler::epoch_rng`]). `batch_size` and `mega` are at least 1 (0 is taken as 1).
pub fn length_grouped_batches(
    lengths: &[usize],
    batch_size: usize,
    mega: usize,
    seed: u64,
    epoch: u64,
) -> Vec<Vec<usize>> {
    let (bs, mega) = (batch_size.max(1), mega.max(1));
    let mut rng = super::sampler::epoch_rng(seed, epoch);
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.shuffle(&mut rng);
    let mut batches = Vec::with_capacity(lengths.len().div_ceil(bs));
    for chunk in order.chunks_mut(bs * mega) {
        chunk.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
        batches.extend(chunk.chunks(bs).map(<[usize]>::to_vec));
    }
    batches.shuffle(&mut rng);
    batches
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_once_and_little_padding() {
        let lengths: Vec<usize> = (0..1000).map(|i| 5 + (i * 7919) % 60).collect();
        let batches = length_grouped_batches(&lengths, 32, 50, 3, 0);
        let mut seen: Vec<usize> = batches.iter().flatten().copied().collect();
        seen.sort();
        assert_eq!(seen, (0..1000).collect::<Vec<_>>());
        let padded: usize = batches
            .iter()
            .map(|b| b.len() * b.iter().map(|&i| lengths[i]).max().unwrap())
            .sum();
        let real: usize = lengths.iter().sum();
        // random batches of 32 would pad to ~64 tokens each (about 1.8x the ~35 average)
        assert!((padded as f64) < 1.1 * real as f64, "{padded} vs {real}");
        assert_ne!(batches, length_grouped_batches(&lengths, 32, 50, 3, 1));
    }
}
