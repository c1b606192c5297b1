//! Data-parallel logic, independent of the backend: gradient buckets, averaging, found_inf
//! agreement, ZeRO-1 shard arithmetic, and [`Ddp`], the state the engine keeps when a
//! [`Collective`] is attached ([`crate::Engine::with_collective`]).
//!
//! **Buckets** follow PyTorch DDP (Li et al., "PyTorch Distributed: Experiences on
//! Accelerating Data Parallel Training", VLDB 2020, §3.2.3; `torch/csrc/distributed/c10d/
//! reducer.cpp`, `compute_bucket_assignment_by_size`): parameters are taken in **reverse**
//! registration order (gradients become ready roughly from the last layer back, so the first
//! bucket can be reduced first) and packed into consecutive buckets of at most
//! `bucket_cap_mb` MiB (PyTorch's default 25), optionally with a smaller first bucket
//! (PyTorch: 1 MiB). Each bucket is flattened into one tensor (f32, or bf16 with
//! [`DdpConfig::reduce_dtype`]), reduced with **one** collective call, and unflattened back, so
//! the number of calls is the number of buckets, not of parameters; [`super::reduce`] starts
//! each bucket's call during the backward once its gradients are final. Unlike PyTorch, which closes a bucket once it reaches the cap (so a bucket can
//! exceed it by one parameter), a bucket here never exceeds the cap unless it holds a single
//! parameter larger than the cap.
//!
//! **Averaging**: `average_buckets` is `sum / world_size`, PyTorch DDP's gradient. The engine
//! uses the weighted form, which is the same when every rank has the same micro-batch weights:
//! the gradient applied on every rank is `Σ_ranks Σ_i w_i g_i / Σ_ranks Σ_i w_i`, i.e. exactly
//! the gradient of the weighted mean loss over the global batch, also when ranks carry
//! different sample counts (a short last batch). The weight sum travels as one extra element of
//! the first bucket (f32), so it costs no extra collective and no host synchronisation (bf16
//! reduction and flat ZeRO-1 reduce it in one tiny f32 all-reduce of its own).
//!
//! **found_inf agreement**: every rank must skip the same steps, or the replicas diverge.
//! After an all-reduce every rank holds the same sums (an inf or NaN anywhere reaches every
//! rank), and [`agree_found_inf`] / [`Ddp::agree_stats`] make it explicit with an all-reduce MAX
//! of the local flag, which keeps the skip decision common even if something rank-local
//! (a sharded update, a rank-local check) were to differ.
//!
//! **ZeRO-1** in the engine is [`super::zero`] (optimizer state partitioned by whole
//! parameters, PyTorch's `ZeroRedundancyOptimizer` scheme, after this module's all-reduce) or
//! [`super::flat`] (equal ranges of the flattened parameters: reduce-scatter, all-gather),
//! chosen by [`DdpConfig::zero1_layout`]. The engine reaches them through [`super::GradSync`].

use super::{Collective, ReduceOp};
use crate::grads::{GradStats, HostStats};
use crate::params::{Param, ParamStore};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

/// Bytes per MiB (PyTorch's `bucket_cap_mb` is in MiB: `int(bucket_cap_mb * 1024 * 1024)`).
const MIB: f64 = 1024.0 * 1024.0;

/// Bucket sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketConfig {
    /// Cap of every bucket in MiB (PyTorch's `bucket_cap_mb`, default 25).
    pub bucket_cap_mb: f64,
    /// Cap of the first bucket in MiB (PyTorch uses 1 MiB so that communication starts early);
    /// `None`: the first bucket uses `bucket_cap_mb` too.
    pub first_bucket_cap_mb: Option<f64>,
}

impl Default for BucketConfig {
    fn default() -> Self {
        Self {
            bucket_cap_mb: 25.0,
            first_bucket_cap_mb: None,
        }
    }
}

impl BucketConfig {
    /// Errors unless the caps are finite and > 0.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("bucket_cap_mb", Some(self.bucket_cap_mb)),
            ("first_bucket_cap_mb", self.first_bucket_cap_mb),
        ] {
            if let Some(v) = v {
                if !(v.is_finite() && v > 0.0) {
                    bail!("{name} must be finite and > 0, got {v}");
                }
            }
        }
        Ok(())
    }

    /// The cap in bytes of bucket number `index` (at least one byte).
    pub fn cap_bytes(&self, index: usize) -> usize {
        let mb = match (index, self.first_bucket_cap_mb) {
            (0, Some(first)) => first,
            _ => self.bucket_cap_mb,
        };
        ((mb * MIB) as usize).max(1)
    }
}

/// How ZeRO-1 partitions the optimizer state among the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Zero1Layout {
    /// Whole parameters per rank (PyTorch's `ZeroRedundancyOptimizer`; [`super::zero`]):
    /// gradients all-reduced, each owner updates its parameters and broadcasts their masters.
    #[default]
    Parameters,
    /// Equal ranges of the flattened parameters ([`super::flat`]): gradients reduce-scattered,
    /// each rank updates its range, the ranges all-gathered. Balanced to the element, and the
    /// gradient reduction moves half the bytes of an all-reduce.
    Flat,
}

/// Data-parallel options of the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct DdpConfig {
    /// Gradient bucket sizes.
    pub buckets: BucketConfig,
    /// All-reduce MAX the found_inf flag after the gradient reduction (one tiny collective per
    /// step). The all-reduced gradients already agree; this makes the skip decision robust to
    /// anything rank-local (and is required by sharded updates).
    pub agree_found_inf: bool,
    /// ZeRO-1: each rank keeps the optimizer state of its share of the parameters only and
    /// updates only those; owners broadcast the updated weights (see [`super::zero`]).
    pub zero1: bool,
    /// How ZeRO-1 partitions the optimizer state (with `zero1`).
    pub zero1_layout: Zero1Layout,
    /// Start each bucket's all-reduce during the backward, once its gradients are final
    /// (PyTorch DDP's overlap of communication with the backward; [`super::reduce`]). Same
    /// results bit for bit as `false`, which reduces every bucket after the backward; a model
    /// whose graph changes from step to step needs `false`.
    pub overlap: bool,
    /// The dtype gradients are summed in across the ranks: f32 (default) or bf16 (half the
    /// bytes on the wire and a bf16 sum, as PyTorch's `bf16_compress_hook`; the applied
    /// gradient is f32 either way).
    pub reduce_dtype: DType,
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self {
            buckets: BucketConfig::default(),
            agree_found_inf: true,
            zero1: false,
            zero1_layout: Zero1Layout::Parameters,
            overlap: true,
            reduce_dtype: DType::F32,
        }
    }
}

impl DdpConfig {
    /// Errors: invalid bucket caps, or a reduce dtype other than f32 and bf16.
    pub fn validate(&self) -> Result<()> {
        self.buckets.validate()?;
        if !matches!(self.reduce_dtype, DType::F32 | DType::BF16) {
            bail!(
                "DdpConfig::reduce_dtype must be F32 or BF16, got {:?}",
                self.reduce_dtype
            );
        }
        Ok(())
    }
}

/// A bucket: consecutive entries of the list given to [`assign_buckets`] (in reverse order),
/// flattened into one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// Positions in the input list, in bucket order (descending).
    pub members: Vec<usize>,
    /// Start of each member in the flat bucket (elements).
    pub offsets: Vec<usize>,
    /// Elements in the bucket.
    pub numel: usize,
}

impl Bucket {
    /// Bytes of the flat bucket with elements of `elem_bytes` bytes.
    pub fn bytes(&self, elem_bytes: usize) -> usize {
        self.numel * elem_bytes
    }
}

/// Packs tensors of `numels` elements (each element `elem_bytes` bytes) into buckets, PyTorch
/// DDP style: in reverse order, consecutive, each at most [`BucketConfig::cap_bytes`] unless it
/// holds a single larger tensor. Every position appears in exactly one bucket (zero-size ones
/// too).
pub fn assign_buckets(
    numels: &[usize],
    elem_bytes: usize,
    config: &BucketConfig,
) -> Result<Vec<Bucket>> {
    config.validate()?;
    if elem_bytes == 0 {
        bail!("elem_bytes must be > 0");
    }
    let mut buckets = Vec::new();
    let mut cur = Bucket {
        members: Vec::new(),
        offsets: Vec::new(),
        numel: 0,
    };
    for i in (0..numels.len()).rev() {
        let n = numels[i];
        let cap = config.cap_bytes(buckets.len());
        if !cur.members.is_empty() && (cur.numel + n) * elem_bytes > cap {
            buckets.push(std::mem::replace(
                &mut cur,
                Bucket {
                    members: Vec::new(),
                    offsets: Vec::new(),
                    numel: 0,
                },
            ));
        }
        cur.offsets.push(cur.numel);
        cur.members.push(i);
        cur.numel += n;
    }
    if !cur.members.is_empty() {
        buckets.push(cur);
    }
    Ok(buckets)
}

/// The global found_inf: all-reduce MAX of this rank's flag (a one-element tensor on `device`).
pub fn agree_found_inf(coll: &dyn Collective, local: bool, device: &Device) -> Result<bool> {
    if coll.world_size() == 1 {
        return Ok(local);
    }
    let flag = Tensor::new(&[f32::from(u8::from(local))], device)?;
    let v = coll.all_reduce(&flag, ReduceOp::Max)?.to_vec1::<f32>()?;
    Ok(v.first().is_some_and(|&x| x != 0.0))
}

// ------------------------------------------------------------------------------------------
// The engine's data-parallel state
// ------------------------------------------------------------------------------------------

/// What the engine keeps when a collective is attached: the collective, the bucket
/// configuration, and when each gradient becomes final (learned by
/// [`super::reduce::Reduction`]). The window's weight is the gradient buffers'
/// ([`crate::grads::GradBuffers::window_weight`]).
pub struct Ddp {
    coll: Box<dyn Collective>,
    config: DdpConfig,
    ready_counts: Vec<Option<usize>>,
    /// (buckets started during the last boundary backward, buckets).
    overlap: Option<(usize, usize)>,
    /// A parameter whose gradient changed after its bucket had started in this window's
    /// backward: the window's sum is wrong, so every rank must skip its update.
    stale: Option<String>,
    /// ZeRO-1: the owner rank of each parameter (store order), set by [`Ddp::shard_owners`].
    owners: Option<Vec<usize>>,
}

impl std::fmt::Debug for Ddp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ddp")
            .field("backend", &self.coll.backend())
            .field("rank", &self.coll.rank())
            .field("world_size", &self.coll.world_size())
            .field("config", &self.config)
            .finish()
    }
}

/// A stable 64-bit FNV-1a hash (the same in every process, unlike std's `RandomState`).
fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

impl Ddp {
    /// Validates the configuration.
    pub fn new(coll: Box<dyn Collective>, config: DdpConfig) -> Result<Self> {
        config.validate()?;
        if coll.rank() >= coll.world_size() {
            bail!(
                "collective reports rank {} of world size {}",
                coll.rank(),
                coll.world_size()
            );
        }
        Ok(Self {
            coll,
            config,
            ready_counts: Vec::new(),
            overlap: None,
            stale: None,
            owners: None,
        })
    }

    /// With ZeRO-1: computes and keeps the owner of each of `params` ([`super::zero::partition`]).
    pub fn shard_owners(&mut self, params: &[Param]) -> Result<()> {
        if self.config.zero1 && self.config.zero1_layout == Zero1Layout::Parameters {
            let numels: Vec<usize> = params.iter().map(|p| p.elem_count()).collect();
            self.owners = Some(super::zero::partition(&numels, self.coll.world_size())?);
        }
        Ok(())
    }

    /// The ZeRO-1 owner of each parameter (`None` without ZeRO-1).
    pub fn owners(&self) -> Option<&[usize]> {
        self.owners.as_deref()
    }

    /// The collective.
    pub fn collective(&self) -> &dyn Collective {
        self.coll.as_ref()
    }

    /// The configuration.
    pub fn config(&self) -> &DdpConfig {
        &self.config
    }

    /// The parameters that take part in the gradient reduction: trainable, non-empty. Frozen
    /// flags and shapes are the same on every rank (same model), so this list is too.
    pub fn reduced_params(params: &[Param]) -> Vec<usize> {
        (0..params.len())
            .filter(|&i| !params[i].options.frozen && params[i].elem_count() > 0)
            .collect()
    }

    /// The buckets over [`Self::reduced_params`] (positions in that list), capped in bytes of
    /// the reduce dtype.
    pub fn buckets(&self, params: &[Param]) -> Result<Vec<Bucket>> {
        let idx = Self::reduced_params(params);
        let numels: Vec<usize> = idx.iter().map(|&i| params[i].elem_count()).collect();
        assign_buckets(
            &numels,
            self.config.reduce_dtype.size_in_bytes(),
            &self.config.buckets,
        )
    }

    /// Per store position, how many sink offers made the gradient final at the last boundary
    /// (`None`: not known to be final before the backward's end).
    pub fn ready_counts(&self) -> &[Option<usize>] {
        &self.ready_counts
    }

    /// Records what the last boundary backward learned: the counts [`Self::ready_counts`]
    /// returns, how many of `buckets` buckets it started, and the parameter, if any, whose
    /// gradient changed after its bucket had started (the window is then skipped on every
    /// rank, [`Self::agree_stats`]).
    pub fn set_ready_counts(
        &mut self,
        counts: Vec<Option<usize>>,
        started: usize,
        buckets: usize,
        stale: Option<String>,
    ) {
        self.ready_counts = counts;
        self.overlap = Some((started, buckets));
        self.stale = stale;
    }

    /// `(started, buckets)`: how many of the gradient buckets started their all-reduce during
    /// the last boundary's backward (the rest started after it). `None` before the first
    /// boundary backward with [`DdpConfig::overlap`].
    pub fn buckets_started_in_backward(&self) -> Option<(usize, usize)> {
        self.overlap
    }

    /// Checks that every rank has the same parameter layout (count, sizes, names: compared
    /// through an all-reduce MAX of the values and of their negations), then copies rank 0's
    /// masters to every rank and refreshes the working copies. Parameters identical on every
    /// rank are the premise of data parallelism (PyTorch DDP broadcasts at construction too).
    pub fn broadcast_parameters(&self, store: &ParamStore) -> Result<()> {
        if self.coll.world_size() == 1 {
            return Ok(());
        }
        let params = store.params();
        let dev = store.device();
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let mut total = 0usize;
        for p in &params {
            h = fnv1a(h, p.name.as_bytes());
            for d in p.master.dims() {
                h = fnv1a(h, &(*d as u64).to_le_bytes());
            }
            h = fnv1a(h, &[u8::from(p.options.frozen)]);
            total += p.elem_count();
        }
        // small integers only, so that f32 carries them exactly (< 2^24)
        let split = |x: u64| {
            [
                (x & 0xffff) as f32,
                ((x >> 16) & 0xffff) as f32,
                ((x >> 32) & 0xffff) as f32,
                (x >> 48) as f32,
            ]
        };
        let mut v: Vec<f32> = vec![(params.len() & 0xff_ffff) as f32];
        v.extend(split(total as u64));
        v.extend(split(h));
        let t = Tensor::new(v.as_slice(), dev)?;
        let max = self.coll.all_reduce_max(&t)?.to_vec1::<f32>()?;
        let min: Vec<f32> = self
            .coll
            .all_reduce_max(&t.neg()?)?
            .to_vec1::<f32>()?
            .into_iter()
            .map(|x| -x)
            .collect();
        if max != v || min != v {
            bail!(
                "rank {}: the parameter layout differs across ranks (this rank: {} parameters, {} \
                 elements, layout hash {h:016x}); build the same model, in the same order, on \
                 every rank before attaching the collective",
                self.coll.rank(),
                params.len(),
                total
            );
        }
        for p in &params {
            let t = self
                .coll
                .broadcast(p.master.as_tensor(), 0)
                .with_context(|| format!("broadcasting parameter {}", p.name))?;
            p.master.set(&t)?;
        }
        store.refresh_working_copies()?;
        Ok(())
    }

    /// Makes the boundary statistics agree across ranks (all-reduce MAX; see
    /// [`DdpConfig::agree_found_inf`], always with [`DdpConfig::overlap`]): on the device the
    /// whole `[found_inf, norm, multiplier]` tensor (no host synchronisation), on the host the
    /// found_inf flag. A window whose overlapped sum went stale on this rank (a gradient that
    /// changed after its bucket started) counts as found_inf, so that every rank skips it.
    pub fn agree_stats(&mut self, stats: GradStats, device: &Device) -> Result<GradStats> {
        let stats = match self.stale.take() {
            Some(name) => {
                tracing::warn!(
                    "data parallelism: the gradient of {name} changed after its bucket's \
                     all-reduce had started (the graph differs from the previous step's); every \
                     rank skips this step, and later steps wait for that gradient's new number \
                     of contributions. A model whose graph changes from step to step should set \
                     DdpConfig::overlap = false"
                );
                let flag = match &stats {
                    GradStats::Device(t) => {
                        GradStats::device(Tensor::new(&[1f32, 0.0, 0.0], t.device())?)
                    }
                    GradStats::Host(_) => GradStats::host(HostStats {
                        found_inf: true,
                        norm: f64::NAN,
                        multiplier: 1.0,
                    }),
                };
                stats.with_found_inf_of(&flag)?
            }
            None => stats,
        };
        if self.coll.world_size() == 1 || !(self.config.agree_found_inf || self.config.overlap) {
            return Ok(stats);
        }
        if let Some(t) = stats.tensor() {
            return Ok(GradStats::device(self.coll.all_reduce_max(t)?));
        }
        let h = stats.read()?;
        let found_inf = agree_found_inf(self.coll.as_ref(), h.found_inf, device)?;
        Ok(GradStats::host(HostStats { found_inf, ..h }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_reverse_consecutive_and_capped() -> Result<()> {
        // 1 MiB cap, f32: 262144 elements
        let cfg = BucketConfig {
            bucket_cap_mb: 1.0,
            first_bucket_cap_mb: Some(0.25),
        };
        let numels = [100_000, 200_000, 10, 300_000, 0, 65_536];
        let b = assign_buckets(&numels, 4, &cfg)?;
        let members: Vec<Vec<usize>> = b.iter().map(|b| b.members.clone()).collect();
        // first bucket 0.25 MiB = 65536 elements: [5, 4]; then 300000 alone (larger than the cap);
        // then [2, 1] (200010 ≤ 262144), then [0]
        assert_eq!(members, vec![vec![5, 4], vec![3], vec![2, 1], vec![0]]);
        assert_eq!(b[2].offsets, vec![0, 10]);
        assert_eq!(b[2].numel, 200_010);
        assert!(assign_buckets(
            &numels,
            4,
            &BucketConfig {
                bucket_cap_mb: 0.0,
                first_bucket_cap_mb: None
            }
        )
        .is_err());
        assert!(assign_buckets(&[], 4, &cfg)?.is_empty());
        Ok(())
    }
}
