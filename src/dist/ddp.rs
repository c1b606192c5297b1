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
//! (PyTorch: 1 MiB). Each bucket is flattened into one f32 tensor, reduced with **one**
//! collective call, and unflattened back, so the number of calls is the number of buckets, not
//! of parameters. Unlike PyTorch, which closes a bucket once it reaches the cap (so a bucket can
//! exceed it by one parameter), a bucket here never exceeds the cap unless it holds a single
//! parameter larger than the cap.
//!
//! **Averaging**: `average_buckets` is `sum / world_size`, PyTorch DDP's gradient. The engine
//! uses the weighted form, which is the same when every rank has the same micro-batch weights:
//! the gradient applied on every rank is `Σ_ranks Σ_i w_i g_i / Σ_ranks Σ_i w_i`, i.e. exactly
//! the gradient of the weighted mean loss over the global batch, also when ranks carry
//! different sample counts (a short last batch). The weight sum travels as one extra element of
//! the first bucket, so it costs no extra collective and no host synchronisation.
//!
//! **found_inf agreement**: every rank must skip the same steps, or the replicas diverge.
//! After an all-reduce every rank holds the same sums (an inf or NaN anywhere reaches every
//! rank), and [`agree_found_inf`] / [`Ddp::agree_stats`] make it explicit with an all-reduce MAX
//! of the local flag, which keeps the skip decision common even if something rank-local
//! (a sharded update, a rank-local check) were to differ.
//!
//! **ZeRO-1** in the engine is [`super::zero`]: optimizer state partitioned by whole parameters
//! (PyTorch's `ZeroRedundancyOptimizer` scheme) after this module's all-reduce. The engine
//! reaches both through [`super::GradSync`].

use super::{Collective, ReduceOp};
use crate::grads::{GradBuffers, GradStats, HostStats};
use crate::params::{Param, ParamStore};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

/// Bytes per MiB (PyTorch's `bucket_cap_mb` is in MiB: `int(bucket_cap_mb * 1024 * 1024)`).
const MIB: f64 = 1024.0 * 1024.0;

/// Bytes of one element of the reduction dtype (f32).
pub const REDUCE_ELEM_BYTES: usize = 4;

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
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self {
            buckets: BucketConfig::default(),
            agree_found_inf: true,
            zero1: false,
        }
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
/// configuration, and this accumulation window's weight sum.
pub struct Ddp {
    coll: Box<dyn Collective>,
    config: DdpConfig,
    window_weight: f64,
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
        config.buckets.validate()?;
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
            window_weight: 0.0,
            owners: None,
        })
    }

    /// With ZeRO-1: computes and keeps the owner of each of `params` ([`super::zero::partition`]).
    pub fn shard_owners(&mut self, params: &[Param]) -> Result<()> {
        if self.config.zero1 {
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

    /// The buckets over [`Self::reduced_params`] (positions in that list).
    pub fn buckets(&self, params: &[Param]) -> Result<Vec<Bucket>> {
        let idx = Self::reduced_params(params);
        let numels: Vec<usize> = idx.iter().map(|&i| params[i].elem_count()).collect();
        assign_buckets(&numels, REDUCE_ELEM_BYTES, &self.config.buckets)
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

    /// Records one micro-batch of weight `weight` in this accumulation window.
    pub fn note_micro_batch(&mut self, weight: f64) {
        self.window_weight += weight;
    }

    /// At the accumulation boundary: replaces this rank's gradient buffers by the global
    /// gradient `Σ_ranks contribution / Σ_ranks weight` (see the module docs), in f32, with the
    /// buffers' normaliser set to 1, bucket by bucket (one `all_reduce_sum` per bucket; the
    /// window's weight rides in the first). `keep_raw`: the buffers hold the raw gradient of a
    /// single micro-batch (the engine's `accumulation_steps == 1` path, whose normaliser is 1),
    /// so the contribution is `buffer * weight`; otherwise the buffers already hold
    /// `Σ_i w_i g_i`. A trainable parameter without a gradient on this rank contributes zeros.
    /// World size 1: nothing changes.
    pub fn reduce_gradients(
        &mut self,
        params: &[Param],
        grads: &mut GradBuffers,
        keep_raw: bool,
    ) -> Result<()> {
        let weight = std::mem::take(&mut self.window_weight);
        if self.coll.world_size() == 1 {
            return Ok(());
        }
        if !(weight.is_finite() && weight > 0.0) {
            bail!("reduce_gradients: the accumulation window has weight {weight}");
        }
        let idx = Self::reduced_params(params);
        if idx.is_empty() {
            return Ok(());
        }
        let buckets = self.buckets(params)?;
        let scale = if keep_raw && weight != 1.0 {
            Some(weight)
        } else {
            None
        };
        let mut reduced: Vec<Option<Tensor>> = vec![None; params.len()];
        let mut total_weight: Option<Tensor> = None;
        #[cfg(feature = "cuda")]
        if params.first().is_some_and(|p| p.master.device().is_cuda()) {
            // pack each bucket with the multi-tensor accumulate kernel (one launch per gradient
            // dtype and up to 160 tensors) instead of a cast and a copy per parameter
            for (bi, b) in buckets.iter().enumerate() {
                let dev = params[idx[b.members[0]]].master.device().clone();
                let flat =
                    self.pack_bucket(params, grads.buffers(), &idx, b, bi == 0, &dev, scale)?;
                if bi == 0 {
                    flat.slice_set(&Tensor::new(&[weight as f32], &dev)?, 0, b.numel)?;
                }
                let sum = self
                    .coll
                    .all_reduce_sum(&flat)
                    .with_context(|| format!("all-reduce of gradient bucket {bi}"))?;
                self.unpack_bucket(params, &idx, b, bi, sum, &mut total_weight, &mut reduced)?;
            }
            return grads.set_reduced(reduced);
        }
        {
            let bufs = grads.buffers();
            for (bi, b) in buckets.iter().enumerate() {
                let mut parts = Vec::with_capacity(b.members.len() + 1);
                for &m in &b.members {
                    let p = &params[idx[m]];
                    let part = match bufs.get(idx[m]).and_then(|x| x.as_ref()) {
                        Some(g) => g.flatten_all()?.to_dtype(DType::F32)?,
                        None => Tensor::zeros(p.elem_count(), DType::F32, p.master.device())?,
                    };
                    parts.push(match scale {
                        Some(w) => (part * w)?,
                        None => part,
                    });
                }
                let dev = parts[0].device().clone();
                if bi == 0 {
                    parts.push(Tensor::new(&[weight as f32], &dev)?);
                }
                let flat = Tensor::cat(&parts, 0)?;
                let sum = self
                    .coll
                    .all_reduce_sum(&flat)
                    .with_context(|| format!("all-reduce of gradient bucket {bi}"))?;
                self.unpack_bucket(params, &idx, b, bi, sum, &mut total_weight, &mut reduced)?;
            }
        }
        grads.set_reduced(reduced)
    }

    /// CUDA: one f32 buffer holding the bucket's gradients (times `scale` when given) and, for
    /// bucket 0, one more element for the weight sum; a parameter without a gradient is zeros.
    #[cfg(feature = "cuda")]
    #[allow(clippy::too_many_arguments)]
    fn pack_bucket(
        &self,
        params: &[Param],
        bufs: &[Option<Tensor>],
        idx: &[usize],
        b: &Bucket,
        first: bool,
        dev: &Device,
        scale: Option<f64>,
    ) -> Result<Tensor> {
        let flat = Tensor::zeros(b.numel + usize::from(first), DType::F32, dev)?;
        let k = b.members.len();
        let (mut views, mut fresh, mut incoming) = (vec![None; k], vec![None; k], vec![None; k]);
        for (j, (&m, &off)) in b.members.iter().zip(&b.offsets).enumerate() {
            let n = params[idx[m]].elem_count();
            if let Some(g) = bufs.get(idx[m]).and_then(|x| x.as_ref()) {
                views[j] = Some(flat.narrow(0, off, n)?);
                incoming[j] = Some(g.flatten_all()?);
            }
        }
        // `fresh` all None: every view is written as 0 + scale * g
        crate::cuda::accumulate::accumulate(
            &mut views,
            &mut fresh,
            &incoming,
            scale.unwrap_or(1.0) as f32,
        )?;
        Ok(flat)
    }

    /// Splits an all-reduced bucket back into per-parameter gradients divided by the global
    /// weight (which bucket 0 carries in its last element).
    #[allow(clippy::too_many_arguments)]
    fn unpack_bucket(
        &self,
        params: &[Param],
        idx: &[usize],
        b: &Bucket,
        bi: usize,
        mut sum: Tensor,
        total_weight: &mut Option<Tensor>,
        reduced: &mut [Option<Tensor>],
    ) -> Result<()> {
        if bi == 0 {
            *total_weight = Some(sum.narrow(0, b.numel, 1)?);
            sum = sum.narrow(0, 0, b.numel)?;
        }
        let w = total_weight
            .as_ref()
            .context("the weight sum rides in bucket 0")?;
        let avg = sum.broadcast_div(w)?;
        for (&m, &off) in b.members.iter().zip(&b.offsets) {
            let p = &params[idx[m]];
            reduced[idx[m]] = Some(
                avg.narrow(0, off, p.elem_count())?
                    .reshape(p.master.dims())?,
            );
        }
        Ok(())
    }

    /// Makes the boundary statistics agree across ranks (all-reduce MAX; see
    /// [`DdpConfig::agree_found_inf`]): on the device the whole `[found_inf, norm, multiplier]`
    /// tensor (no host synchronisation), on the host the found_inf flag.
    pub fn agree_stats(&self, stats: GradStats, device: &Device) -> Result<GradStats> {
        if self.coll.world_size() == 1 || !self.config.agree_found_inf {
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
