//! `DataLoader`: batches of a [`Dataset`] in a seeded order, built by worker threads ahead of
//! use, collated into candle tensors and moved to the training device.
//!
//! Semantics follow `torch.utils.data.DataLoader` (map-style dataset, `batch_size`,
//! `shuffle`, `drop_last`, `num_workers`, `prefetch_factor`, `persistent_workers`,
//! `collate_fn`) plus a [`DistributedSampler`]:
//!
//! ```text
//! order   = Sampler { shuffle, seed }.epoch_order(len(dataset), epoch)    // seeded by (seed, epoch)
//! order   = distributed.shard(order)                                      // if data-parallel
//! batch k = collate([dataset.get(i) for i in order[k*B .. min((k+1)*B, n)]])
//! ```
//!
//! batches `k = 0, 1, ...` of epoch `e` are yielded **in that order whatever `num_workers`**:
//! batch `k` goes to worker `k % num_workers` (round robin, like PyTorch) and results are
//! put back in order by batch index. With `num_workers = 0` batches are built in the calling
//! thread. With `num_workers = W > 0` at most `prefetch_factor * W` batches are in flight
//! (being built, or built and waiting), so memory stays bounded.
//!
//! ## Position, resume
//! [`DataLoader::state`] is the position `(epoch, next batch index, seed)` plus the settings
//! that determine the order (so a mismatch is reported, not silently mis-resumed). There is no
//! RNG state to save: the order of an epoch is a function of `(seed, epoch)`. After
//! [`DataLoader::load_state`] the loader yields exactly the batches an uninterrupted run would
//! have yielded from that position on.
//!
//! ## Device transfer
//! `device: Cpu`: batches stay where the collate put them. `device: Cuda` (feature `cuda`):
//! each worker copies its collated batch into pinned (page-locked) host memory and starts an
//! asynchronous host-to-device copy on the loader's own copy stream, recording an event. When
//! [`DataLoader::next_batch`] hands the batch over, candle's stream waits on that event (on the
//! GPU, without blocking the host) and takes the data with a device-to-device copy into
//! tensors it owns. So batch `k + 1`'s host-to-device copy runs while step `k` computes.
//! Call `next_batch` from the thread that runs the training step: candle's CUDA device (from
//! `Device::new_cuda`) uses the per-thread default stream. For the same reason the workers
//! never call `Tensor::to_device(cuda)` themselves: the copy (and the allocation) would go to
//! the *worker's* per-thread stream, unordered with the training thread's kernels.
//! Other devices: `Tensor::to_device` in the worker.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use wick::data::{DataLoader, LoaderConfig, TensorDataset};
//! # fn main() -> anyhow::Result<()> {
//! let x = Tensor::arange(0f32, 10., &Device::Cpu)?.reshape((5, 2))?;
//! let y = Tensor::arange(0u32, 5, &Device::Cpu)?;
//! let ds = TensorDataset::new(vec![x, y])?;
//! let mut loader = DataLoader::new(ds, LoaderConfig::new(2).with_workers(2))?;
//! assert_eq!(loader.num_batches(), 3); // 2 + 2 + 1
//! let mut labels = vec![];
//! for batch in loader.epoch_iter() {
//!     let (_x, y) = batch?.pair()?;
//!     labels.extend(y.to_vec1::<u32>()?);
//! }
//! assert_eq!(labels, vec![0, 1, 2, 3, 4]);
//! assert_eq!(loader.epoch(), 1);
//! # Ok(()) }
//! ```

use std::any::Any;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

#[cfg(feature = "cuda")]
use crate::timing::Mark;
use crate::timing::Span;

use super::sampler::{batch_count, batch_range, DistributedSampler, Sampler};
use super::{Collate, Dataset, Stack};

/// DataLoader settings. Start from [`LoaderConfig::new`] and chain `with_*`, or set the
/// public fields.
#[derive(Debug, Clone)]
pub struct LoaderConfig {
    /// Samples per batch (>= 1).
    pub batch_size: usize,
    /// Shuffle each epoch with an RNG seeded by `(seed, epoch)` (PyTorch default: `false`).
    pub shuffle: bool,
    /// Base seed of the shuffle. All ranks of a data-parallel job must use the same seed.
    pub seed: u64,
    /// Drop the last batch of an epoch when it has fewer than `batch_size` samples.
    pub drop_last: bool,
    /// Worker threads building batches; 0 builds them in the calling thread.
    pub num_workers: usize,
    /// Batches in flight per worker (>= 1 when `num_workers > 0`; PyTorch default 2): at most
    /// `prefetch_factor * num_workers` batches are being built or waiting to be yielded.
    pub prefetch_factor: usize,
    /// Keep the worker threads alive between epochs (default `true`, unlike PyTorch, since
    /// threads hold no copy of the dataset); `false` joins them at each epoch's end.
    pub persistent_workers: bool,
    /// Data-parallel split of each epoch (`None`: this process sees every sample).
    pub distributed: Option<DistributedSampler>,
    /// Where batches are delivered (see the module docs on CUDA staging).
    pub device: Device,
}

impl LoaderConfig {
    /// `batch_size` samples per batch; sequential order, keep the last batch, no workers,
    /// `prefetch_factor` 2, persistent workers, no distribution, CPU.
    pub fn new(batch_size: usize) -> Self {
        Self {
            batch_size,
            shuffle: false,
            seed: 0,
            drop_last: false,
            num_workers: 0,
            prefetch_factor: 2,
            persistent_workers: true,
            distributed: None,
            device: Device::Cpu,
        }
    }

    /// Shuffle every epoch with base seed `seed`.
    pub fn with_shuffle(mut self, seed: u64) -> Self {
        self.shuffle = true;
        self.seed = seed;
        self
    }

    /// Set `drop_last`.
    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Set `num_workers`.
    pub fn with_workers(mut self, num_workers: usize) -> Self {
        self.num_workers = num_workers;
        self
    }

    /// Set `prefetch_factor`.
    pub fn with_prefetch_factor(mut self, prefetch_factor: usize) -> Self {
        self.prefetch_factor = prefetch_factor;
        self
    }

    /// Set `persistent_workers`.
    pub fn with_persistent_workers(mut self, persistent: bool) -> Self {
        self.persistent_workers = persistent;
        self
    }

    /// Load only this rank's shard of each epoch.
    pub fn with_distributed(mut self, sampler: DistributedSampler) -> Self {
        self.distributed = Some(sampler);
        self
    }

    /// Deliver batches on `device`.
    pub fn with_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }
}

/// One batch: the collated tensors plus where it came from.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Epoch the batch belongs to.
    pub epoch: u64,
    /// Position of the batch in its epoch, `0..num_batches()`.
    pub index: usize,
    /// Dataset indices of the batch's samples, in batch order.
    pub indices: Vec<usize>,
    /// The collated fields, on the loader's device (for [`Stack`]: one `(B, ...)` tensor per
    /// sample field).
    pub tensors: Vec<Tensor>,
    /// On CUDA with pinned staging: the span on the compute stream from the handover's wait
    /// for the copy to the end of the device-side copies (the host-to-device time the step
    /// actually waits for; see [`crate::timing`]). `None` without pinned staging (CPU loaders,
    /// or a device other than CUDA).
    pub h2d: Option<Span>,
}

impl Batch {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// `len() == 0` (never true for a batch from a loader).
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// Field `field`, or an error naming how many fields there are.
    pub fn tensor(&self, field: usize) -> Result<&Tensor> {
        self.tensors.get(field).ok_or_else(|| {
            anyhow!(
                "batch has {} fields, asked for field {field}",
                self.tensors.len()
            )
        })
    }

    /// The two fields of an `(input, target)` batch; an error unless there are exactly two.
    pub fn pair(&self) -> Result<(Tensor, Tensor)> {
        match self.tensors.as_slice() {
            [x, y] => Ok((x.clone(), y.clone())),
            t => bail!(
                "expected a batch of 2 fields (input, target), found {}",
                t.len()
            ),
        }
    }
}

/// A loader's position, for checkpoints: the next batch to yield is batch `batch` of epoch
/// `epoch` under base seed `seed`. The other fields fix the order and batching; restoring
/// into a loader whose settings differ is an error.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// Current epoch (0-based).
    pub epoch: u64,
    /// Index in `epoch` of the next batch to yield; `num_batches` when the epoch's batches have
    /// all been yielded but the end of the epoch has not been seen yet.
    pub batch: usize,
    /// Base seed of the shuffle.
    pub seed: u64,
    /// Whether epochs are shuffled.
    pub shuffle: bool,
    /// Samples per batch.
    pub batch_size: usize,
    /// Whether an incomplete last batch is dropped.
    pub drop_last: bool,
    /// Samples in the dataset.
    pub dataset_len: usize,
    /// Data-parallel rank (0 when not distributed).
    pub rank: usize,
    /// Data-parallel world size (1 when not distributed).
    pub world_size: usize,
    /// The distributed sampler's `drop_last` (false when not distributed).
    pub distributed_drop_last: bool,
}

impl LoaderState {
    /// The state as a JSON object.
    pub fn to_json(&self) -> Result<String> {
        Ok(serde_json::to_string(self)?)
    }

    /// Parse a state written by [`LoaderState::to_json`]; the error names the bad field.
    pub fn from_json(s: &str) -> Result<Self> {
        serde_json::from_str(s).context("parsing a DataLoader state (JSON)")
    }
}

/// A built batch on its way from a worker to the training thread.
enum Payload {
    /// Tensors ready for use (CPU target, or moved with `to_device` by the worker).
    Ready(Vec<Tensor>),
    /// In flight to the GPU through pinned staging; finished by `Stager::handover`.
    #[cfg(feature = "cuda")]
    Staged(super::staging::Staged),
}

/// How a collated batch reaches the target device.
#[derive(Clone)]
enum Transfer {
    None,
    ToDevice(Device),
    #[cfg(feature = "cuda")]
    Stage(Arc<super::staging::Stager>),
}

impl Transfer {
    fn for_device(device: &Device) -> Result<Self> {
        match device {
            Device::Cpu => Ok(Transfer::None),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => Ok(Transfer::Stage(super::staging::Stager::new(d)?)),
            other => Ok(Transfer::ToDevice(other.clone())),
        }
    }

    /// Worker side: start moving `tensors` to the device.
    fn start(&self, tensors: Vec<Tensor>) -> Result<Payload> {
        match self {
            Transfer::None => Ok(Payload::Ready(tensors)),
            Transfer::ToDevice(d) => Ok(Payload::Ready(
                tensors
                    .iter()
                    .map(|t| t.to_device(d))
                    .collect::<candle_core::Result<_>>()?,
            )),
            #[cfg(feature = "cuda")]
            Transfer::Stage(s) => Ok(Payload::Staged(s.stage(tensors)?)),
        }
    }

    /// Training-thread side: the batch's tensors, ready for the step, and the span of the
    /// handover on the compute stream (staged batches only).
    fn finish(&self, payload: Payload) -> Result<(Vec<Tensor>, Option<Span>)> {
        match payload {
            Payload::Ready(t) => Ok((t, None)),
            #[cfg(feature = "cuda")]
            Payload::Staged(s) => {
                let device = s.device();
                let start = Mark::now(&device)?;
                let tensors = s.handover()?;
                Ok((tensors, Some(Span::new(start, Mark::now(&device)?))))
            }
        }
    }
}

/// Fetch, collate and start the transfer of one batch; a panic becomes an error.
fn build_batch<D: Dataset, C: Collate<D::Sample>>(
    dataset: &D,
    collate: &C,
    transfer: &Transfer,
    indices: &[usize],
) -> Result<Payload> {
    let run = || -> Result<Payload> {
        let samples = indices
            .iter()
            .map(|&i| {
                dataset
                    .get(i)
                    .with_context(|| format!("dataset.get({i}) failed"))
            })
            .collect::<Result<Vec<_>>>()?;
        let tensors = collate.collate(samples).context("collate failed")?;
        transfer.start(tensors)
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(r) => r,
        Err(p) => Err(anyhow!(
            "panic while building a batch (dataset.get / collate): {}",
            panic_message(p.as_ref())
        )),
    }
}

fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

struct Work {
    generation: u64,
    index: usize,
    indices: Vec<usize>,
}

struct Done {
    generation: u64,
    index: usize,
    result: Result<Payload>,
}

/// The worker threads: one bounded task queue each, one shared result queue.
struct Pool {
    tasks: Vec<SyncSender<Work>>,
    results: Receiver<Done>,
    handles: Vec<JoinHandle<()>>,
    /// Tasks sent and not yet received back (including stale ones).
    in_flight: usize,
}

impl Pool {
    fn spawn<D: Dataset, C: Collate<D::Sample>>(
        dataset: &Arc<D>,
        collate: &Arc<C>,
        transfer: &Transfer,
        workers: usize,
        prefetch: usize,
    ) -> Result<Self> {
        // Never more than prefetch * workers results outstanding, so workers never block on it.
        let (done_tx, results) = mpsc::sync_channel::<Done>(prefetch * workers);
        let mut tasks = Vec::with_capacity(workers);
        let mut handles = Vec::with_capacity(workers);
        for w in 0..workers {
            let (task_tx, task_rx) = mpsc::sync_channel::<Work>(prefetch);
            let (dataset, collate, transfer, done_tx) = (
                dataset.clone(),
                collate.clone(),
                transfer.clone(),
                done_tx.clone(),
            );
            let handle = std::thread::Builder::new()
                .name(format!("wick-loader-{w}"))
                .spawn(move || {
                    while let Ok(work) = task_rx.recv() {
                        let result = build_batch(&*dataset, &*collate, &transfer, &work.indices)
                            .with_context(|| format!("in data loader worker {w}"));
                        let done = Done {
                            generation: work.generation,
                            index: work.index,
                            result,
                        };
                        if done_tx.send(done).is_err() {
                            break;
                        }
                    }
                })
                .with_context(|| format!("spawning data loader worker {w}"))?;
            tasks.push(task_tx);
            handles.push(handle);
        }
        Ok(Self {
            tasks,
            results,
            handles,
            in_flight: 0,
        })
    }

    fn dead_worker(&self) -> Option<usize> {
        self.handles.iter().position(|h| h.is_finished())
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Closing the task queues ends each worker's loop after its current batch.
        self.tasks.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// Batches of a [`Dataset`]; see the module docs. `C` is the [`Collate`] step
/// ([`Stack`] by default).
pub struct DataLoader<D: Dataset, C: Collate<D::Sample> = Stack> {
    dataset: Arc<D>,
    collate: Arc<C>,
    config: LoaderConfig,
    dataset_len: usize,
    /// Samples per epoch for this rank.
    shard_len: usize,
    num_batches: usize,
    epoch: u64,
    /// Next batch to yield in `epoch`.
    batch: usize,
    /// This rank's order for one epoch, cached.
    order: Option<(u64, Arc<Vec<usize>>)>,
    transfer: Transfer,
    pool: Option<Pool>,
    /// Bumped whenever the position jumps; results of older generations are discarded.
    generation: u64,
    /// Next batch index to hand to a worker.
    next_dispatch: usize,
    /// Built batches of the current generation waiting for their turn.
    reorder: BTreeMap<usize, Result<Payload>>,
}

impl<D: Dataset<Sample = Vec<Tensor>>> DataLoader<D, Stack> {
    /// A loader that [`Stack`]s samples (lists of tensors) into batches.
    ///
    /// # Errors
    /// See [`DataLoader::with_collate`].
    pub fn new(dataset: D, config: LoaderConfig) -> Result<Self> {
        Self::with_collate(dataset, Stack, config)
    }
}

impl<D: Dataset, C: Collate<D::Sample>> DataLoader<D, C> {
    /// A loader with a custom collate step. Workers are started on the first batch.
    ///
    /// # Errors
    /// `batch_size == 0`; `num_workers > 0` with `prefetch_factor == 0`; an invalid
    /// distributed rank; an empty dataset; settings that leave an epoch without a single batch
    /// (`drop_last` with fewer samples than `batch_size`, or fewer samples than ranks); a CUDA
    /// device on which the copy stream cannot be created.
    pub fn with_collate(dataset: D, collate: C, config: LoaderConfig) -> Result<Self> {
        ensure!(
            config.batch_size >= 1,
            "DataLoader batch_size must be at least 1, got 0"
        );
        ensure!(
            config.num_workers == 0 || config.prefetch_factor >= 1,
            "DataLoader prefetch_factor must be at least 1 with num_workers = {}",
            config.num_workers
        );
        if let Some(d) = &config.distributed {
            d.validate()?;
        }
        let n = dataset.len();
        ensure!(
            n > 0,
            "the dataset is empty: a DataLoader needs at least one sample \
             (check the data path, the split, or the context length)"
        );
        let shard_len = config.distributed.map_or(n, |d| d.shard_len(n));
        ensure!(
            shard_len > 0,
            "{n} samples over world_size {} with distributed drop_last leave each rank no \
             samples; use drop_last = false (padding) or fewer ranks",
            config.distributed.map_or(1, |d| d.world_size)
        );
        let num_batches = batch_count(shard_len, config.batch_size, config.drop_last);
        ensure!(
            num_batches > 0,
            "drop_last with batch_size {} and {shard_len} samples per epoch gives no complete \
             batch; lower batch_size or set drop_last = false",
            config.batch_size
        );
        let transfer = Transfer::for_device(&config.device)?;
        Ok(Self {
            dataset: Arc::new(dataset),
            collate: Arc::new(collate),
            config,
            dataset_len: n,
            shard_len,
            num_batches,
            epoch: 0,
            batch: 0,
            order: None,
            transfer,
            pool: None,
            generation: 0,
            next_dispatch: 0,
            reorder: BTreeMap::new(),
        })
    }

    /// The settings (with the seed of the last [`DataLoader::load_state`], if any).
    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }

    /// The dataset.
    pub fn dataset(&self) -> &D {
        &self.dataset
    }

    /// Batches per epoch for this rank.
    pub fn num_batches(&self) -> usize {
        self.num_batches
    }

    /// Samples per epoch for this rank before `drop_last` (the shard size when distributed).
    pub fn num_samples(&self) -> usize {
        self.shard_len
    }

    /// The current epoch (0-based); it advances when [`DataLoader::next_batch`] reports the
    /// end of an epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// This rank's sample order for `epoch` (what the batches of that epoch are cut from).
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        self.compute_order(epoch)
    }

    /// The next batch of the current epoch, or `Ok(None)` once at the end of each epoch (the
    /// following call starts the next epoch).
    ///
    /// # Errors
    /// A failing (or panicking) `dataset.get` or collate, a failed device copy, or a worker
    /// thread that died. The position does not advance: the next call retries the same batch.
    pub fn next_batch(&mut self) -> Result<Option<Batch>> {
        if self.batch >= self.num_batches {
            self.epoch += 1;
            self.batch = 0;
            self.reset_pipeline();
            if !self.config.persistent_workers {
                self.pool = None;
            }
            return Ok(None);
        }
        let (epoch, index) = (self.epoch, self.batch);
        let order = self.order();
        let indices = self.indices_of(&order, index);
        let built = if self.config.num_workers == 0 {
            build_batch(&*self.dataset, &*self.collate, &self.transfer, &indices)
        } else {
            self.receive(&order, index)
        };
        let tensors = built.and_then(|payload| self.transfer.finish(payload));
        match tensors {
            Ok((tensors, h2d)) => {
                self.batch += 1;
                if self.config.num_workers > 0 {
                    // Keep the workers busy while the caller computes.
                    self.dispatch(&order)?;
                }
                Ok(Some(Batch {
                    epoch,
                    index,
                    indices,
                    tensors,
                    h2d,
                }))
            }
            Err(e) => {
                self.reset_pipeline();
                Err(e.context(format!("loading batch {index} of epoch {epoch}")))
            }
        }
    }

    /// An iterator over the rest of the current epoch; it ends after the epoch's last batch
    /// (the loader then stands at the start of the next epoch) or after yielding an error.
    pub fn epoch_iter(&mut self) -> EpochIter<'_, D, C> {
        EpochIter {
            loader: self,
            done: false,
        }
    }

    /// Jump to the start of `epoch` (like PyTorch's `sampler.set_epoch`).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.batch = 0;
        self.reset_pipeline();
    }

    /// The current position, for a checkpoint.
    pub fn state(&self) -> LoaderState {
        let d = self.config.distributed;
        LoaderState {
            epoch: self.epoch,
            batch: self.batch,
            seed: self.config.seed,
            shuffle: self.config.shuffle,
            batch_size: self.config.batch_size,
            drop_last: self.config.drop_last,
            dataset_len: self.dataset_len,
            rank: d.map_or(0, |d| d.rank),
            world_size: d.map_or(1, |d| d.world_size),
            distributed_drop_last: d.is_some_and(|d| d.drop_last),
        }
    }

    /// Continue from `state`: the next batch is batch `state.batch` of epoch `state.epoch`, in
    /// the order of `state.seed` (which replaces the configured seed). Batches in flight are
    /// discarded.
    ///
    /// # Errors
    /// The state was saved with a different dataset length, batch size, `drop_last`,
    /// `shuffle` or world size (the message lists each difference), or its batch index is
    /// beyond the epoch's batch count. The rank may differ: data-parallel ranks stand at the
    /// same epoch and batch, so any rank's saved position (a checkpoint holds rank 0's)
    /// restores every rank, each on its own shard.
    pub fn load_state(&mut self, state: &LoaderState) -> Result<()> {
        let mine = self.state();
        let mut diffs = Vec::new();
        macro_rules! check {
            ($f:ident) => {
                if mine.$f != state.$f {
                    diffs.push(format!(
                        "{}: saved {:?}, this loader {:?}",
                        stringify!($f),
                        state.$f,
                        mine.$f
                    ));
                }
            };
        }
        check!(dataset_len);
        check!(batch_size);
        check!(drop_last);
        check!(shuffle);
        check!(world_size);
        check!(distributed_drop_last);
        ensure!(
            diffs.is_empty(),
            "DataLoader state does not match this loader ({}); the saved position would give \
             different batches",
            diffs.join("; ")
        );
        ensure!(
            state.batch <= self.num_batches,
            "DataLoader state points at batch {} but an epoch has {} batches",
            state.batch,
            self.num_batches
        );
        if state.seed != self.config.seed {
            self.config.seed = state.seed;
            self.order = None;
        }
        self.epoch = state.epoch;
        self.batch = state.batch;
        self.reset_pipeline();
        Ok(())
    }

    fn compute_order(&self, epoch: u64) -> Vec<usize> {
        let sampler = Sampler {
            shuffle: self.config.shuffle,
            seed: self.config.seed,
        };
        let order = sampler.epoch_order(self.dataset_len, epoch);
        match &self.config.distributed {
            Some(d) => d.shard(&order),
            None => order,
        }
    }

    fn order(&mut self) -> Arc<Vec<usize>> {
        match &self.order {
            Some((e, o)) if *e == self.epoch => o.clone(),
            _ => {
                let o = Arc::new(self.compute_order(self.epoch));
                self.order = Some((self.epoch, o.clone()));
                o
            }
        }
    }

    fn indices_of(&self, order: &[usize], index: usize) -> Vec<usize> {
        order[batch_range(index, self.shard_len, self.config.batch_size)].to_vec()
    }

    /// Forget batches in flight (they finish and are discarded) and dispatch from `batch`.
    fn reset_pipeline(&mut self) {
        self.generation += 1;
        self.reorder.clear();
        self.next_dispatch = self.batch;
    }

    /// Hand batches to the workers, round robin by batch index, up to the in-flight bound.
    fn dispatch(&mut self, order: &[usize]) -> Result<()> {
        let cap = self.config.prefetch_factor * self.config.num_workers;
        loop {
            let Some(pool) = self.pool.as_ref() else {
                return Ok(());
            };
            if self.next_dispatch >= self.num_batches || pool.in_flight + self.reorder.len() >= cap
            {
                return Ok(());
            }
            let index = self.next_dispatch;
            let w = index % pool.tasks.len();
            let work = Work {
                generation: self.generation,
                index,
                indices: self.indices_of(order, index),
            };
            if pool.tasks[w].send(work).is_err() {
                self.pool = None;
                bail!("data loader worker {w} exited unexpectedly");
            }
            if let Some(pool) = self.pool.as_mut() {
                pool.in_flight += 1;
            }
            self.next_dispatch += 1;
        }
    }

    /// Wait for batch `index` of the current generation from the workers.
    fn receive(&mut self, order: &[usize], index: usize) -> Result<Payload> {
        if self.pool.is_none() {
            self.pool = Some(Pool::spawn(
                &self.dataset,
                &self.collate,
                &self.transfer,
                self.config.num_workers,
                self.config.prefetch_factor,
            )?);
        }
        loop {
            self.dispatch(order)?;
            if let Some(r) = self.reorder.remove(&index) {
                return r;
            }
            let Some(pool) = self.pool.as_mut() else {
                bail!("data loader workers are gone");
            };
            match pool.results.recv_timeout(Duration::from_millis(200)) {
                Ok(done) => {
                    pool.in_flight -= 1;
                    if done.generation == self.generation {
                        self.reorder.insert(done.index, done.result);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    if let Some(w) = pool.dead_worker() {
                        self.pool = None;
                        bail!("data loader worker {w} exited unexpectedly");
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.pool = None;
                    bail!("all data loader workers exited unexpectedly");
                }
            }
        }
    }
}

impl<D: Dataset, C: Collate<D::Sample>> Drop for DataLoader<D, C> {
    fn drop(&mut self) {
        // Join the workers before the staged batches and the copy stream go away.
        self.pool = None;
        self.reorder.clear();
    }
}

/// Iterator over the rest of the current epoch, from [`DataLoader::epoch_iter`].
pub struct EpochIter<'a, D: Dataset, C: Collate<D::Sample>> {
    loader: &'a mut DataLoader<D, C>,
    done: bool,
}

impl<D: Dataset, C: Collate<D::Sample>> EpochIter<'_, D, C> {
    /// The loader's position now (after the batches yielded so far).
    pub fn state(&self) -> LoaderState {
        self.loader.state()
    }
}

impl<D: Dataset, C: Collate<D::Sample>> Iterator for EpochIter<'_, D, C> {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        if self.done {
            return None;
        }
        match self.loader.next_batch() {
            Ok(Some(b)) => Some(Ok(b)),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}
