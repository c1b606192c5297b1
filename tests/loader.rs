//! DataLoader, samplers and datasets on the CPU. Expected orders and batch contents are
//! computed independently in the tests (a plain Fisher-Yates shuffle with the documented
//! `(seed, epoch)` key, and the batch rows from the formula that built the data).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Result;
use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use wick::data::{
    DataLoader, Dataset, DistributedSampler, LoaderConfig, LoaderState, TensorDataset, TextWindows,
};

const N: usize = 103;

/// Sample i: x = [i, i + 0.5, -i] (f32), y = i (u32).
fn row(i: usize) -> [f32; 3] {
    [i as f32, i as f32 + 0.5, -(i as f32)]
}

fn tensor_dataset(n: usize) -> TensorDataset {
    let x: Vec<f32> = (0..n).flat_map(row).collect();
    let y: Vec<u32> = (0..n as u32).collect();
    TensorDataset::new(vec![
        Tensor::from_vec(x, (n, 3), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, n, &Device::Cpu).unwrap(),
    ])
    .unwrap()
}

/// A dataset whose `get` takes an index-dependent time, so that workers finish out of order.
struct Slow(TensorDataset);

impl Dataset for Slow {
    type Sample = Vec<Tensor>;
    fn len(&self) -> usize {
        self.0.len()
    }
    fn get(&self, i: usize) -> Result<Vec<Tensor>> {
        std::thread::sleep(Duration::from_micros(((i * 7919) % 5) as u64 * 300));
        self.0.get(i)
    }
}

/// The documented order of epoch `e`: `StdRng::from_seed(seed LE ++ epoch LE ++ 0..)`,
/// `shuffle` of `0..n`.
fn reference_order(n: usize, seed: u64, epoch: u64, shuffle: bool) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if shuffle {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        key[8..16].copy_from_slice(&epoch.to_le_bytes());
        order.shuffle(&mut StdRng::from_seed(key));
    }
    order
}

/// What a batch holds, as plain values.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    epoch: u64,
    index: usize,
    indices: Vec<usize>,
    x: Vec<Vec<f32>>,
    y: Vec<u32>,
}

fn seen(b: wick::data::Batch) -> Seen {
    let (x, y) = b.pair().unwrap();
    assert_eq!(x.dims(), &[b.len(), 3]);
    assert_eq!(y.dims(), &[b.len()]);
    Seen {
        epoch: b.epoch,
        index: b.index,
        indices: b.indices,
        x: x.to_vec2().unwrap(),
        y: y.to_vec1().unwrap(),
    }
}

/// Run `epochs` whole epochs, checking the epoch boundaries.
fn run_epochs<D: Dataset<Sample = Vec<Tensor>>>(
    loader: &mut DataLoader<D>,
    epochs: u64,
) -> Vec<Vec<Seen>> {
    (0..epochs)
        .map(|e| {
            assert_eq!(loader.epoch(), e);
            let batches: Vec<Seen> = loader.epoch_iter().map(|b| seen(b.unwrap())).collect();
            assert_eq!(batches.len(), loader.num_batches());
            batches
        })
        .collect()
}

/// The rest of the current epoch.
fn one_epoch<D: Dataset<Sample = Vec<Tensor>>>(loader: &mut DataLoader<D>) -> Vec<Seen> {
    loader.epoch_iter().map(|b| seen(b.unwrap())).collect()
}

/// The batches the loader must produce: consecutive chunks of the reference order.
fn expected_epoch(order: &[usize], epoch: u64, bs: usize, drop_last: bool) -> Vec<Seen> {
    order
        .chunks(bs)
        .filter(|c| !drop_last || c.len() == bs)
        .enumerate()
        .map(|(k, c)| Seen {
            epoch,
            index: k,
            indices: c.to_vec(),
            x: c.iter().map(|&i| row(i).to_vec()).collect(),
            y: c.iter().map(|&i| i as u32).collect(),
        })
        .collect()
}

#[test]
fn four_workers_yield_each_sample_once_in_the_seeded_order_like_zero_workers() {
    let (seed, bs) = (42, 8);
    let cfg = LoaderConfig::new(bs).with_shuffle(seed);
    let mut seq = DataLoader::new(tensor_dataset(N), cfg.clone()).unwrap();
    let mut par = DataLoader::new(
        Slow(tensor_dataset(N)),
        cfg.with_workers(4).with_prefetch_factor(2),
    )
    .unwrap();
    let a = run_epochs(&mut seq, 3);
    let b = run_epochs(&mut par, 3);
    assert_eq!(a, b, "0 and 4 workers must give identical batches");
    for (e, batches) in b.iter().enumerate() {
        let order = reference_order(N, seed, e as u64, true);
        assert_eq!(*batches, expected_epoch(&order, e as u64, bs, false));
        let all: Vec<usize> = batches.iter().flat_map(|s| s.indices.clone()).collect();
        assert_eq!(all.len(), N);
        assert_eq!(
            all.iter().copied().collect::<BTreeSet<_>>(),
            (0..N).collect(),
            "every sample exactly once in epoch {e}"
        );
        assert_eq!(batches.last().unwrap().indices.len(), N % bs);
    }
}

#[test]
fn epochs_differ_and_sequential_order_is_identity() {
    let mut l = DataLoader::new(
        tensor_dataset(N),
        LoaderConfig::new(10).with_shuffle(7).with_workers(2),
    )
    .unwrap();
    let e = run_epochs(&mut l, 3);
    let orders: Vec<Vec<usize>> = e
        .iter()
        .map(|b| b.iter().flat_map(|s| s.indices.clone()).collect())
        .collect();
    assert_ne!(orders[0], orders[1]);
    assert_ne!(orders[1], orders[2]);
    assert_ne!(orders[0], (0..N).collect::<Vec<_>>());

    let mut s = DataLoader::new(tensor_dataset(N), LoaderConfig::new(10).with_workers(3)).unwrap();
    for batches in run_epochs(&mut s, 2) {
        let order: Vec<usize> = batches.iter().flat_map(|s| s.indices.clone()).collect();
        assert_eq!(order, (0..N).collect::<Vec<_>>());
    }
}

#[test]
fn drop_last_drops_only_the_incomplete_batch() {
    for workers in [0, 3] {
        let cfg = LoaderConfig::new(8)
            .with_shuffle(5)
            .with_drop_last(true)
            .with_workers(workers);
        let mut l = DataLoader::new(tensor_dataset(N), cfg).unwrap();
        assert_eq!(l.num_batches(), N / 8);
        for (e, batches) in run_epochs(&mut l, 2).into_iter().enumerate() {
            let order = reference_order(N, 5, e as u64, true);
            assert_eq!(batches, expected_epoch(&order, e as u64, 8, true));
            assert!(batches.iter().all(|b| b.indices.len() == 8));
        }
        // Divisible length: drop_last changes nothing.
        let mut l = DataLoader::new(
            tensor_dataset(96),
            LoaderConfig::new(8)
                .with_drop_last(true)
                .with_workers(workers),
        )
        .unwrap();
        assert_eq!(l.num_batches(), 12);
        assert_eq!(run_epochs(&mut l, 1)[0].len(), 12);
    }
    // Keeping the last batch: 13 batches, the last of 103 - 96 = 7.
    let l = DataLoader::new(tensor_dataset(N), LoaderConfig::new(8)).unwrap();
    assert_eq!(l.num_batches(), 13);
    // drop_last with fewer samples than a batch is an error, not an empty epoch.
    let err = DataLoader::new(tensor_dataset(5), LoaderConfig::new(8).with_drop_last(true))
        .err()
        .expect("no batch at all must be an error");
    assert!(format!("{err:#}").contains("no complete batch"), "{err:#}");
}

#[test]
fn distributed_shards_are_disjoint_and_cover_the_epoch() {
    for world in [2usize, 3] {
        assert_ne!(N % world, 0);
        for epoch in 0..2u64 {
            let order = reference_order(N, 11, epoch, true);
            // Padding (PyTorch default): pad with the order's first entries, stride by world.
            let per = N.div_ceil(world);
            let pad = per * world - N;
            let padded: Vec<usize> = order.iter().chain(&order[..pad]).copied().collect();
            let mut all = Vec::new();
            for rank in 0..world {
                let s = DistributedSampler::new(rank, world).unwrap();
                let shard = s.shard(&order);
                let expected: Vec<usize> =
                    padded.iter().skip(rank).step_by(world).copied().collect();
                assert_eq!(shard, expected);
                assert_eq!(shard.len(), per);
                all.extend(shard);
            }
            assert_eq!(
                all.iter().copied().collect::<BTreeSet<_>>(),
                (0..N).collect()
            );
            // The only repeats are the padding samples.
            let mut counts = vec![0usize; N];
            for &i in &all {
                counts[i] += 1;
            }
            let repeated: BTreeSet<usize> = (0..N).filter(|&i| counts[i] > 1).collect();
            assert_eq!(repeated, order[..pad].iter().copied().collect());
            assert!(counts.iter().all(|&c| c == 1 || c == 2));

            // Truncating: disjoint, covering the order but its last N % world samples.
            let mut all = Vec::new();
            for rank in 0..world {
                let s = DistributedSampler::new(rank, world)
                    .unwrap()
                    .with_drop_last(true);
                let shard = s.shard(&order);
                assert_eq!(shard.len(), N / world);
                all.extend(shard);
            }
            let set: BTreeSet<usize> = all.iter().copied().collect();
            assert_eq!(set.len(), all.len(), "shards overlap");
            assert_eq!(set, order[..N / world * world].iter().copied().collect());
        }

        // Through the loader: each rank's batches are its shard, cut in order.
        let mut union = Vec::new();
        for rank in 0..world {
            let cfg = LoaderConfig::new(6)
                .with_shuffle(11)
                .with_workers(2)
                .with_distributed(
                    DistributedSampler::new(rank, world)
                        .unwrap()
                        .with_drop_last(true),
                );
            let mut l = DataLoader::new(tensor_dataset(N), cfg).unwrap();
            assert_eq!(l.num_samples(), N / world);
            let got: Vec<usize> = run_epochs(&mut l, 1)[0]
                .iter()
                .flat_map(|s| s.indices.clone())
                .collect();
            let shard = DistributedSampler::new(rank, world)
                .unwrap()
                .with_drop_last(true)
                .shard(&reference_order(N, 11, 0, true));
            assert_eq!(got, shard);
            union.extend(got);
        }
        let set: BTreeSet<usize> = union.iter().copied().collect();
        assert_eq!(set.len(), union.len(), "ranks overlap");
    }
}

#[test]
fn restore_mid_epoch_continues_with_the_same_batches() {
    let cfg = LoaderConfig::new(7).with_shuffle(3).with_workers(4);
    let mut a = DataLoader::new(Slow(tensor_dataset(N)), cfg.clone()).unwrap();
    run_epochs(&mut a, 1);
    for _ in 0..4 {
        a.next_batch().unwrap().unwrap();
    }
    let json = a.state().to_json().unwrap();
    let state = LoaderState::from_json(&json).unwrap();
    assert_eq!((state.epoch, state.batch, state.seed), (1, 4, 3));
    // The rest of epoch 1, then epoch 2, uninterrupted.
    let mut rest_a: Vec<Seen> = a.epoch_iter().map(|b| seen(b.unwrap())).collect();
    rest_a.extend(one_epoch(&mut a));

    // A fresh loader, other worker count and another configured seed: the saved seed wins.
    let cfg_b = LoaderConfig::new(7).with_shuffle(999).with_workers(2);
    let mut b = DataLoader::new(tensor_dataset(N), cfg_b).unwrap();
    b.next_batch().unwrap(); // some batches in flight that must be discarded
    b.load_state(&state).unwrap();
    let mut rest_b: Vec<Seen> = b.epoch_iter().map(|b| seen(b.unwrap())).collect();
    rest_b.extend(one_epoch(&mut b));
    assert_eq!(rest_a, rest_b);
    assert_eq!(rest_a[0].index, 4);
    assert_eq!(rest_a[0].epoch, 1);

    // Independent check of the first resumed batch.
    let order = reference_order(N, 3, 1, true);
    assert_eq!(rest_b[0].indices, order[28..35].to_vec());

    // Restoring mid-epoch with 0 workers gives the same, too.
    let mut c = DataLoader::new(tensor_dataset(N), LoaderConfig::new(7).with_shuffle(0)).unwrap();
    c.load_state(&state).unwrap();
    let rest_c: Vec<Seen> = c.epoch_iter().map(|b| seen(b.unwrap())).collect();
    assert_eq!(rest_c[..], rest_a[..rest_c.len()]);

    // A state saved with other settings is refused with the reason.
    let mut d = DataLoader::new(tensor_dataset(N), LoaderConfig::new(8).with_shuffle(3)).unwrap();
    let msg = format!("{:#}", d.load_state(&state).unwrap_err());
    assert!(
        msg.contains("batch_size") && msg.contains('7') && msg.contains('8'),
        "{msg}"
    );
    let mut e = DataLoader::new(tensor_dataset(50), LoaderConfig::new(7).with_shuffle(3)).unwrap();
    let msg = format!("{:#}", e.load_state(&state).unwrap_err());
    assert!(msg.contains("dataset_len"), "{msg}");
}

#[test]
fn state_at_the_end_of_an_epoch_resumes_into_the_next() {
    let cfg = LoaderConfig::new(10).with_shuffle(1).with_workers(2);
    let mut a = DataLoader::new(tensor_dataset(N), cfg.clone()).unwrap();
    for _ in 0..a.num_batches() {
        a.next_batch().unwrap().unwrap();
    }
    let state = a.state();
    assert_eq!((state.epoch, state.batch), (0, a.num_batches()));
    let mut b = DataLoader::new(tensor_dataset(N), cfg).unwrap();
    b.load_state(&state).unwrap();
    assert!(a.next_batch().unwrap().is_none());
    assert!(b.next_batch().unwrap().is_none());
    assert_eq!((a.epoch(), b.epoch()), (1, 1));
    let ea: Vec<Seen> = a.epoch_iter().map(|x| seen(x.unwrap())).collect();
    let eb: Vec<Seen> = b.epoch_iter().map(|x| seen(x.unwrap())).collect();
    assert_eq!(ea, eb);
    assert_eq!(
        ea,
        expected_epoch(&reference_order(N, 1, 1, true), 1, 10, false)
    );
}

#[test]
fn empty_dataset_and_bad_settings_are_errors() {
    let empty = TensorDataset::new(vec![Tensor::zeros(
        (0, 3),
        candle_core::DType::F32,
        &Device::Cpu,
    )
    .unwrap()])
    .unwrap();
    assert_eq!(empty.len(), 0);
    let err = DataLoader::new(empty, LoaderConfig::new(4).with_workers(2))
        .err()
        .expect("an empty dataset must be an error");
    assert!(format!("{err:#}").contains("empty"), "{err:#}");

    let err = DataLoader::new(tensor_dataset(5), LoaderConfig::new(0))
        .err()
        .unwrap();
    assert!(format!("{err:#}").contains("batch_size"), "{err:#}");
    let err = DataLoader::new(
        tensor_dataset(5),
        LoaderConfig::new(2).with_workers(2).with_prefetch_factor(0),
    )
    .err()
    .unwrap();
    assert!(format!("{err:#}").contains("prefetch_factor"), "{err:#}");
    let bad = DistributedSampler {
        rank: 3,
        world_size: 2,
        drop_last: false,
    };
    let err = DataLoader::new(
        tensor_dataset(5),
        LoaderConfig::new(2).with_distributed(bad),
    )
    .err()
    .unwrap();
    assert!(format!("{err:#}").contains("rank 3"), "{err:#}");

    let err = TensorDataset::new(vec![
        Tensor::zeros((4, 2), candle_core::DType::F32, &Device::Cpu).unwrap(),
        Tensor::zeros(5, candle_core::DType::U32, &Device::Cpu).unwrap(),
    ])
    .unwrap_err();
    assert!(format!("{err:#}").contains("dim 0"), "{err:#}");
}

/// A dataset that panics on one index.
struct Panicky(TensorDataset, usize);

impl Dataset for Panicky {
    type Sample = Vec<Tensor>;
    fn len(&self) -> usize {
        self.0.len()
    }
    fn get(&self, i: usize) -> Result<Vec<Tensor>> {
        if i == self.1 {
            panic!("boom at {i}");
        }
        self.0.get(i)
    }
}

#[test]
fn a_panic_in_a_worker_is_an_error_and_the_loader_survives() {
    for workers in [0, 2] {
        let mut l = DataLoader::new(
            Panicky(tensor_dataset(20), 13),
            LoaderConfig::new(4).with_workers(workers),
        )
        .unwrap();
        for k in 0..3 {
            assert_eq!(l.next_batch().unwrap().unwrap().index, k);
        }
        // Batch 3 holds sample 13.
        for _ in 0..2 {
            let msg = format!("{:#}", l.next_batch().unwrap_err());
            assert!(msg.contains("panic") && msg.contains("boom at 13"), "{msg}");
            assert!(msg.contains("batch 3 of epoch 0"), "{msg}");
            assert_eq!(l.state().batch, 3, "a failed batch is not skipped");
        }
        // A restored position past the bad batch continues normally.
        let mut s = l.state();
        s.batch = 4;
        l.load_state(&s).unwrap();
        assert_eq!(
            l.next_batch().unwrap().unwrap().indices,
            vec![16, 17, 18, 19]
        );
        assert!(l.next_batch().unwrap().is_none());
    }
}

#[test]
fn non_persistent_workers_restart_each_epoch() {
    let cfg = LoaderConfig::new(9)
        .with_shuffle(2)
        .with_workers(3)
        .with_persistent_workers(false)
        .with_prefetch_factor(1);
    let mut l = DataLoader::new(tensor_dataset(N), cfg).unwrap();
    for (e, batches) in run_epochs(&mut l, 2).into_iter().enumerate() {
        let order = reference_order(N, 2, e as u64, true);
        assert_eq!(batches, expected_epoch(&order, e as u64, 9, false));
    }
}

static TMP: AtomicUsize = AtomicUsize::new(0);

fn temp_file(name: &str, contents: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "wick-loader-{}-{}",
        std::process::id(),
        TMP.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

#[test]
fn text_windows_give_next_byte_targets() {
    let text = b"To be, or not to be: that is the question.\n";
    let t = 8;
    let path = temp_file("hamlet.txt", text);
    let w = TextWindows::from_file(&path, t).unwrap();
    assert_eq!(w.len(), text.len() - t);
    for i in [0, 1, 17, w.len() - 1] {
        let s = w.get(i).unwrap();
        let x: Vec<u32> = text[i..i + t].iter().map(|&b| b as u32).collect();
        let y: Vec<u32> = text[i + 1..i + t + 1].iter().map(|&b| b as u32).collect();
        assert_eq!(s[0].dtype(), candle_core::DType::U32);
        assert_eq!(s[0].dims(), &[t]);
        assert_eq!(s[0].to_vec1::<u32>().unwrap(), x);
        assert_eq!(s[1].to_vec1::<u32>().unwrap(), y);
    }
    assert!(w.get(w.len()).is_err());

    // Through a loader: (B, T) u32 batches whose rows are the windows of the order.
    let mut l = DataLoader::new(
        w.clone(),
        LoaderConfig::new(5).with_shuffle(9).with_workers(2),
    )
    .unwrap();
    let order = reference_order(w.len(), 9, 0, true);
    let b = l.next_batch().unwrap().unwrap();
    let (x, y) = b.pair().unwrap();
    assert_eq!(x.dims(), &[5, t]);
    let (x, y) = (x.to_vec2::<u32>().unwrap(), y.to_vec2::<u32>().unwrap());
    for (r, &i) in order[..5].iter().enumerate() {
        assert_eq!(
            x[r],
            text[i..i + t].iter().map(|&b| b as u32).collect::<Vec<_>>()
        );
        assert_eq!(
            y[r],
            text[i + 1..i + t + 1]
                .iter()
                .map(|&b| b as u32)
                .collect::<Vec<_>>()
        );
    }

    // Stride and split by position.
    let s = w.clone().with_stride(t).unwrap();
    assert_eq!(s.len(), (text.len() - t - 1) / t + 1);
    assert_eq!(
        s.window(2).unwrap().0,
        text[2 * t..3 * t]
            .iter()
            .map(|&b| b as u32)
            .collect::<Vec<_>>()
    );
    let (train, val) = w.split(0.75).unwrap();
    let cut = (text.len() as f64 * 0.75).floor() as usize;
    assert_eq!(train.bytes(), &text[..cut]);
    assert_eq!(val.bytes(), &text[cut..]);
    assert_eq!(train.len(), cut - t);
    assert_eq!(val.len(), text.len() - cut - t);
    let (vx, vy) = val.window(0).unwrap();
    assert_eq!(vx[0], text[cut] as u32);
    assert_eq!(*vy.last().unwrap(), text[cut + t] as u32);
    let (tx, ty) = train.window(train.len() - 1).unwrap();
    assert_eq!(
        *ty.last().unwrap(),
        text[cut - 1] as u32,
        "no window crosses the cut"
    );
    assert_eq!(tx.len(), t);
}

#[test]
fn text_window_errors_name_the_problem() {
    let missing = std::env::temp_dir().join("wick-no-such-dir/none.txt");
    let msg = format!("{:#}", TextWindows::from_file(&missing, 4).unwrap_err());
    assert!(msg.contains("none.txt"), "{msg}");

    let short = temp_file("short.txt", b"abcd");
    let msg = format!("{:#}", TextWindows::from_file(&short, 4).unwrap_err());
    assert!(
        msg.contains("short.txt") && msg.contains("4 bytes") && msg.contains("at least 5"),
        "{msg}"
    );
    assert!(TextWindows::from_file(&short, 3).is_ok());
    assert!(TextWindows::from_file(&short, 0).is_err());

    let empty = temp_file("empty.txt", b"");
    assert!(TextWindows::from_file(&empty, 1).is_err());

    let w = TextWindows::from_bytes(b"0123456789".to_vec(), 4).unwrap();
    let msg = format!("{:#}", w.split(0.9).unwrap_err());
    assert!(msg.contains("9 and 1 bytes"), "{msg}");
    assert!(w.split(1.0).is_err() && w.split(0.0).is_err());
    assert!(w.clone().with_stride(0).is_err());
}

/// Counts `get` calls.
struct Counting(TensorDataset, std::sync::Arc<AtomicUsize>);

impl Dataset for Counting {
    type Sample = Vec<Tensor>;
    fn len(&self) -> usize {
        self.0.len()
    }
    fn get(&self, i: usize) -> Result<Vec<Tensor>> {
        self.1.fetch_add(1, Ordering::SeqCst);
        self.0.get(i)
    }
}

#[test]
fn prefetch_is_bounded_by_prefetch_factor_times_workers() {
    let gets = std::sync::Arc::new(AtomicUsize::new(0));
    let (bs, workers, prefetch) = (4, 3, 2);
    let cfg = LoaderConfig::new(bs)
        .with_workers(workers)
        .with_prefetch_factor(prefetch);
    let mut l = DataLoader::new(Counting(tensor_dataset(N), gets.clone()), cfg).unwrap();
    for yielded in 1..=3 {
        l.next_batch().unwrap().unwrap();
        // The yielded batches plus a full pipeline of prefetch * workers batches, no more.
        let want = (yielded + prefetch * workers) * bs;
        let t = std::time::Instant::now();
        while gets.load(Ordering::SeqCst) < want && t.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(gets.load(Ordering::SeqCst), want);
    }
}

/// On a GPU machine (`cargo test --features cuda`): batches delivered on CUDA through pinned
/// staging equal the CPU batches, field by field, for several dtypes and with workers.
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use candle_core::DType;

    fn fields(n: usize, wide: usize) -> TensorDataset {
        let cpu = &Device::Cpu;
        let x: Vec<f32> = (0..n).flat_map(row).collect();
        let bytes: Vec<u8> = (0..n * 33).map(|i| (i * 31 % 251) as u8).collect();
        let half: Vec<f32> = (0..n * 2).map(|i| i as f32 * 0.25).collect();
        let long: Vec<i64> = (0..n as i64).map(|i| i * 1_000_000_007 - 5).collect();
        let big: Vec<f32> = (0..n * wide).map(|i| (i % 9973) as f32).collect();
        TensorDataset::new(vec![
            Tensor::from_vec(x, (n, 3), cpu).unwrap(),
            Tensor::arange(0u32, n as u32, cpu).unwrap(),
            Tensor::from_vec(bytes, (n, 33), cpu).unwrap(),
            Tensor::from_vec(half, (n, 2), cpu)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap(),
            Tensor::from_vec(long, n, cpu).unwrap(),
            Tensor::from_vec(big, (n, wide), cpu).unwrap(),
        ])
        .unwrap()
    }

    fn same(a: &Tensor, b: &Tensor) {
        assert!(b.device().is_cuda(), "batch not on the GPU");
        assert_eq!(a.dims(), b.dims());
        assert_eq!(a.dtype(), b.dtype());
        let b = b.to_device(&Device::Cpu).unwrap();
        let (a, b) = match a.dtype() {
            DType::BF16 | DType::F32 => (
                a.to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap(),
                b.to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap(),
            ),
            DType::I64 => (
                a.flatten_all()
                    .unwrap()
                    .to_vec1::<i64>()
                    .unwrap()
                    .iter()
                    .map(|&v| v as f64)
                    .collect(),
                b.flatten_all()
                    .unwrap()
                    .to_vec1::<i64>()
                    .unwrap()
                    .iter()
                    .map(|&v| v as f64)
                    .collect(),
            ),
            _ => (
                a.to_dtype(DType::U32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<u32>()
                    .unwrap()
                    .iter()
                    .map(|&v| v as f64)
                    .collect(),
                b.to_dtype(DType::U32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<u32>()
                    .unwrap()
                    .iter()
                    .map(|&v| v as f64)
                    .collect(),
            ),
        };
        assert!(a == b, "GPU batch differs from the CPU batch");
    }

    #[test]
    fn cuda_batches_equal_cpu_batches() {
        let dev = match Device::new_cuda(0) {
            Ok(d) => d,
            Err(e) => {
                eprintln!("skipping: no CUDA device ({e})");
                return;
            }
        };
        // 64 Ki f32 per sample: 8 MiB batches, so slots grow and copies take real time.
        let ds = fields(N, 65536);
        for workers in [0, 1, 3] {
            let cfg = LoaderConfig::new(32).with_shuffle(4).with_workers(workers);
            let mut cpu = DataLoader::new(ds.clone(), cfg.clone()).unwrap();
            let mut gpu = DataLoader::new(ds.clone(), cfg.with_device(dev.clone())).unwrap();
            let mut held = std::collections::VecDeque::new();
            for _epoch in 0..3 {
                while let Some(g) = gpu.next_batch().unwrap() {
                    let c = cpu.next_batch().unwrap().unwrap();
                    assert_eq!(c.indices, g.indices);
                    // Queue GPU work on the batch, as a step would, before checking it.
                    let s = g.tensors[5].sqr().unwrap().sum_all().unwrap();
                    for (a, b) in c.tensors.iter().zip(&g.tensors) {
                        same(a, b);
                    }
                    let want = c.tensors[5].sqr().unwrap().sum_all().unwrap();
                    let (s, want) = (s.to_vec0::<f32>().unwrap(), want.to_vec0::<f32>().unwrap());
                    assert!((s - want).abs() <= 1e-4 * want.abs(), "{s} vs {want}");
                    // Keep a few batches alive while later ones are staged.
                    held.push_back(g);
                    if held.len() > 3 {
                        held.pop_front();
                    }
                }
                assert!(cpu.next_batch().unwrap().is_none());
            }
            // Resume mid-epoch on the GPU.
            let mut a = DataLoader::new(
                ds.clone(),
                LoaderConfig::new(32)
                    .with_shuffle(4)
                    .with_workers(workers)
                    .with_device(dev.clone()),
            )
            .unwrap();
            a.next_batch().unwrap();
            let st = a.state();
            let x = a.next_batch().unwrap().unwrap();
            let mut b = DataLoader::new(
                ds.clone(),
                LoaderConfig::new(32)
                    .with_shuffle(4)
                    .with_workers(2)
                    .with_device(dev.clone()),
            )
            .unwrap();
            b.load_state(&st).unwrap();
            let y = b.next_batch().unwrap().unwrap();
            assert_eq!(x.indices, y.indices);
            for (p, q) in x.tensors.iter().zip(&y.tensors) {
                same(&p.to_device(&Device::Cpu).unwrap(), q);
            }
        }
    }

    /// Time per step of a loop "next batch, 10 bf16 4096^3 matmuls + a reduction of the batch,
    /// read the result back": staged loader vs. a CPU loader plus `to_device` in the loop vs.
    /// compute alone. Run with `--ignored --nocapture` on a GPU machine.
    #[test]
    #[ignore]
    fn cuda_staging_timing() {
        let Ok(dev) = Device::new_cuda(0) else {
            eprintln!("skipping: no CUDA device");
            return;
        };
        let n = 512;
        let ds = TensorDataset::new(vec![
            Tensor::ones((n, 65536), DType::F32, &Device::Cpu).unwrap(),
            Tensor::arange(0u32, n as u32, &Device::Cpu).unwrap(),
        ])
        .unwrap();
        let w = Tensor::ones((4096, 4096), DType::BF16, &dev).unwrap();
        let step = |x: &Tensor| -> f32 {
            let mut h = w.clone();
            for _ in 0..10 {
                h = h.matmul(&w).unwrap().affine(1e-4, 0.).unwrap();
            }
            let a = h.to_dtype(DType::F32).unwrap().sum_all().unwrap();
            let b = x.sum_all().unwrap();
            (a + b).unwrap().to_vec0::<f32>().unwrap()
        };
        // One epoch (16 steps) of warm-up, then 4 epochs timed: (ms/step, ms/step in next).
        let steps = 4 * (n / 32);
        let timed = |next: &mut dyn FnMut() -> Option<Tensor>| -> (f64, f64) {
            let mut wait = 0f64;
            let mut t = std::time::Instant::now();
            for k in 0..(n / 32 + steps) {
                if k == n / 32 {
                    (wait, t) = (0., std::time::Instant::now());
                }
                let t0 = std::time::Instant::now();
                let x = next();
                wait += t0.elapsed().as_secs_f64();
                step(&x.unwrap());
            }
            let per = |s: f64| s * 1e3 / steps as f64;
            (per(t.elapsed().as_secs_f64()), per(wait))
        };
        let ones = Tensor::ones((32, 65536), DType::F32, &Device::Cpu).unwrap();
        let (alone, _) = timed(&mut || Some(ones.to_device(&dev).unwrap()));
        let on_dev = ones.to_device(&dev).unwrap();
        let (compute, _) = timed(&mut || Some(on_dev.clone()));
        let mut cpu = DataLoader::new(ds.clone(), LoaderConfig::new(32).with_workers(2)).unwrap();
        let mut next_cpu = || loop {
            if let Some(b) = cpu.next_batch().unwrap() {
                return Some(b.tensors[0].to_device(&dev).unwrap());
            }
        };
        let (plain, plain_wait) = timed(&mut next_cpu);
        let mut staged = Vec::new();
        for (workers, prefetch) in [(2, 2), (4, 4)] {
            let cfg = LoaderConfig::new(32)
                .with_workers(workers)
                .with_prefetch_factor(prefetch)
                .with_device(dev.clone());
            let mut gpu = DataLoader::new(ds.clone(), cfg).unwrap();
            let mut next = || loop {
                if let Some(b) = gpu.next_batch().unwrap() {
                    return Some(b.tensors[0].clone());
                }
            };
            let (per, wait) = timed(&mut next);
            staged.push(format!(
                "{workers} workers x {prefetch}: {per:.3} (in next_batch {wait:.3})"
            ));
        }
        let alone = format!("compute on a resident batch {compute:.3}, with a fresh to_device of a ready batch {alone:.3}");
        let plain = format!("{plain:.3} (in next_batch + to_device {plain_wait:.3})");
        println!(
            "ms/step over {steps} steps, 8 MiB batches: {alone}; CPU loader (2 workers) + to_device {plain}, staged loader {staged:?}"
        );
    }
}
