//! Flat ZeRO-1: the optimizer state partitioned by equal ranges of the flattened parameters.
//!
//! Rajbhandari et al., "ZeRO" (SC 2020), stage 1 (`P_os`), in the flat form of DeepSpeed's
//! `DeepSpeedZeroOptimizer` and PyTorch FSDP's `FlatParameter`: the trainable parameters,
//! flattened in store order and padded to a multiple of the world size `W`, form one index
//! space of `W * S` elements; rank `r` owns `[r * S, (r + 1) * S)`. Per boundary:
//!
//! ```text
//! pack the window's gradients into one flat f32 buffer   (W * S elements, padding 0)
//! reduce-scatter (sum)        → this rank's S elements of Σ_ranks contribution
//! divide by the global weight → this rank's range of the global gradient
//! sum of squares of the range, all-reduced → the global norm (every rank alike)
//! fused update of the range   → its masters and moments only (state: 1 / W of the full)
//! all-gather of the ranges    → every rank's full fp32 masters; working copies refreshed
//! ```
//!
//! A parameter may straddle two ranks: each rank updates its part, a **segment**. The
//! optimizer sees one 1-D parameter per segment (named `"{param}[start..end]"`, the parent's
//! options), whose master is refreshed from the store before each update, so the store's
//! masters stay the only ones that matter (checkpoints, evaluation, a master changed by hand).
//! Masters are gathered in fp32 (4 bytes per parameter, like the whole-parameter variant's
//! broadcast) rather than the working copies, so that every rank's masters stay whole.
//!
//! Checkpoints hold the full state ([`FlatShard::gather_state`]: every range gathered, split
//! back into `"{param}.{suffix}"` tensors) and a run resumes on any world size
//! ([`FlatShard::shard_state`] cuts this rank's segments out of a full state).

use super::ddp::Bucket;
use super::Collective;
use crate::params::{Param, ParamOptions};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};
use std::collections::HashMap;

/// The part `[start, start + len)` of store parameter `pos` (elements of its flattened
/// master) that lies in this rank's range, at `at` in the range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Store position of the parameter.
    pub pos: usize,
    /// First element (of the flattened parameter) in this rank's range.
    pub start: usize,
    /// Elements in the range.
    pub len: usize,
    /// Offset in this rank's range.
    pub at: usize,
}

/// This rank's range of the flat parameters and the optimizer's view of it (module docs).
#[derive(Debug)]
pub struct FlatShard {
    world: usize,
    device: candle_core::Device,
    /// Store positions of the flattened parameters (trainable, non-empty), in store order.
    idx: Vec<usize>,
    /// Flat offset of each `idx` entry.
    offsets: Vec<usize>,
    /// Elements of each rank's range (`S`).
    shard: usize,
    segments: Vec<Segment>,
    /// One 1-D f32 parameter per segment.
    params: Vec<Param>,
}

impl FlatShard {
    /// The layout of `params`' trainable, non-empty members (`idx`, store positions) over
    /// `world` ranks, and this `rank`'s segments with their optimizer parameters (masters
    /// allocated on the parameters' device, filled by [`Self::load_masters`]).
    ///
    /// Errors: `rank >= world`, or allocation.
    pub fn new(params: &[Param], idx: &[usize], rank: usize, world: usize) -> Result<Self> {
        if world == 0 || rank >= world {
            bail!("flat ZeRO-1: rank {rank} of world size {world}");
        }
        let Some(first) = idx.first() else {
            bail!("flat ZeRO-1: no trainable parameter to shard");
        };
        let device = params[*first].master.device().clone();
        let mut offsets = Vec::with_capacity(idx.len());
        let mut total = 0;
        for &i in idx {
            offsets.push(total);
            total += params[i].elem_count();
        }
        let shard = total.div_ceil(world).max(1);
        let (lo, hi) = (rank * shard, (rank + 1) * shard);
        let mut segments = Vec::new();
        let mut owned = Vec::new();
        for (&i, &off) in idx.iter().zip(&offsets) {
            let p = &params[i];
            let (a, b) = (off.max(lo), (off + p.elem_count()).min(hi));
            if a >= b {
                continue;
            }
            let s = Segment {
                pos: i,
                start: a - off,
                len: b - a,
                at: a - lo,
            };
            let master = Var::zeros(s.len, DType::F32, p.master.device())?;
            owned.push(Param {
                name: format!("{}[{}..{}]", p.name, s.start, s.start + s.len),
                master,
                working: None,
                options: ParamOptions {
                    ..p.options.clone()
                },
            });
            segments.push(s);
        }
        Ok(Self {
            world,
            device,
            idx: idx.to_vec(),
            offsets,
            shard,
            segments,
            params: owned,
        })
    }

    /// Errors unless `idx` (the store's trainable, non-empty parameters now) are the ones the
    /// layout was built for: a parameter frozen, unfrozen or added after
    /// [`crate::Engine::with_collective`] changes the ranges, which every rank would have to
    /// rebuild together.
    pub fn check_layout(&self, params: &[Param], idx: &[usize]) -> Result<()> {
        let sizes = |v: &[usize]| {
            v.iter()
                .map(|&i| params.get(i).map(Param::elem_count))
                .collect::<Vec<_>>()
        };
        if idx != self.idx.as_slice() || sizes(idx) != sizes(&self.idx) {
            bail!(
                "flat ZeRO-1: the trainable parameters changed after Engine::with_collective \
                 ({} then, {} now); freeze or add parameters before attaching the collective",
                self.idx.len(),
                idx.len()
            );
        }
        Ok(())
    }

    /// Elements of each rank's range.
    pub fn shard_len(&self) -> usize {
        self.shard
    }

    /// This rank's segments.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The optimizer's parameters: one per segment, in range order.
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// The whole flat layout as one bucket over `idx` (members in store order, `W * S`
    /// elements: the padding after the last parameter stays 0), for the gradient packing.
    pub fn bucket(&self) -> Bucket {
        Bucket {
            members: (0..self.idx.len()).collect(),
            offsets: self.offsets.clone(),
            numel: self.shard * self.world,
        }
    }

    /// This rank's range of the global gradient (`S` elements, f32) cut into its segments'
    /// gradients, in [`Self::params`] order.
    ///
    /// Errors: a range of the wrong length.
    pub fn segment_grads(&self, range: &Tensor) -> Result<Vec<Option<Tensor>>> {
        if range.dims() != [self.shard] {
            bail!(
                "flat ZeRO-1: a gradient range of shape {:?}, expected [{}]",
                range.dims(),
                self.shard
            );
        }
        self.segments
            .iter()
            .map(|s| Ok(Some(range.narrow(0, s.at, s.len)?)))
            .collect()
    }

    /// The optimizer's parameters for an update: each segment's master refreshed from the
    /// store's (so that the update starts from the store's current masters) and its parent's
    /// current options (weight decay, learning-rate scale, frozen). The layout is the one
    /// [`super::reduce::Reduction::begin`] checked at this boundary ([`Self::check_layout`]).
    ///
    /// Errors: a copy fails.
    pub fn load_masters(&self, params: &[Param]) -> Result<Vec<Param>> {
        self.segments
            .iter()
            .zip(&self.params)
            .map(|(s, p)| {
                let src = params[s.pos]
                    .master
                    .flatten_all()?
                    .narrow(0, s.start, s.len)?;
                p.master.set(&src)?;
                Ok(Param {
                    options: params[s.pos].options.clone(),
                    ..p.clone()
                })
            })
            .collect()
    }

    /// After the update: all-gathers every rank's updated range (fp32) and writes it into the
    /// store's masters (every parameter, on every rank), then `refresh` rebuilds the working
    /// copies.
    ///
    /// Errors: the collective, or a gathered buffer of the wrong size.
    pub fn gather_masters(
        &self,
        coll: &dyn Collective,
        params: &[Param],
        refresh: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let range = self.range_of(|i| Ok(Some(self.params[i].master.as_tensor().clone())))?;
        let full = coll
            .all_gather(&range)
            .context("flat ZeRO-1: all-gather of the updated masters")?;
        for (&i, &off) in self.idx.iter().zip(&self.offsets) {
            let p = &params[i];
            let piece = full
                .narrow(0, off, p.elem_count())?
                .reshape(p.master.dims())?;
            p.master.set(&piece)?;
        }
        refresh()
    }

    /// This rank's range as one flat f32 tensor of `S` elements, segment `i` taken from
    /// `part(i)` (`None`: zeros), padding 0.
    fn range_of(&self, part: impl Fn(usize) -> Result<Option<Tensor>>) -> Result<Tensor> {
        let dev = &self.device;
        let mut parts = Vec::with_capacity(self.segments.len() + 1);
        let mut filled = 0;
        for (i, s) in self.segments.iter().enumerate() {
            parts.push(match part(i)? {
                Some(t) => t.flatten_all()?.to_dtype(DType::F32)?,
                None => Tensor::zeros(s.len, DType::F32, dev)?,
            });
            filled += s.len;
        }
        if filled < self.shard {
            parts.push(Tensor::zeros(self.shard - filled, DType::F32, dev)?);
        }
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// The full optimizer state on every rank from this rank's `local` state (names of
    /// [`Self::params`]): per moment suffix one all-gather of the ranges, split into
    /// `"{param}.{suffix}"` tensors of the parameters' shapes; the per-parameter step count of
    /// the rank holding the parameter's first element, exactly (one all-reduce). Parameters
    /// without state on their first element's rank (never stepped) are left out, as a single
    /// rank leaves them out. Collective: call it on every rank.
    ///
    /// Errors: a collective, or a local state tensor of the wrong size.
    pub fn gather_state(
        &self,
        coll: &dyn Collective,
        params: &[Param],
        local: Vec<(String, Tensor)>,
        suffixes: &[&str],
    ) -> Result<Vec<(String, Tensor)>> {
        let local: HashMap<String, Tensor> = local.into_iter().collect();
        let dev = &self.device;
        // per flattened parameter: [has state, step / 2^24, step % 2^24] from the rank that
        // holds its first element
        let mut meta = vec![0f32; 3 * self.idx.len()];
        for (s, p) in self.segments.iter().zip(&self.params) {
            let Some(step) = local.get(&format!("{}.step", p.name)) else {
                continue;
            };
            if s.start == 0 {
                let k = self
                    .idx
                    .iter()
                    .position(|&i| i == s.pos)
                    .context("a segment")?;
                let v = step.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?[0] as u64;
                meta[3 * k..3 * k + 3].copy_from_slice(&[
                    1.0,
                    (v >> 24) as f32,
                    (v & 0xff_ffff) as f32,
                ]);
            }
        }
        let meta = coll
            .all_reduce_sum(&Tensor::new(meta.as_slice(), dev)?)
            .context("flat ZeRO-1: gathering the step counts")?
            .to_vec1::<f32>()?;
        let mut out: HashMap<String, Tensor> = HashMap::new();
        for suffix in suffixes.iter().filter(|s| **s != "step") {
            let range = self.range_of(|i| {
                let name = format!("{}.{suffix}", self.params[i].name);
                match local.get(&name) {
                    Some(t) if t.elem_count() != self.segments[i].len => bail!(
                        "flat ZeRO-1: optimizer state {name} has {} elements, expected {}",
                        t.elem_count(),
                        self.segments[i].len
                    ),
                    t => Ok(t.cloned()),
                }
            })?;
            let full = coll
                .all_gather(&range)
                .with_context(|| format!("flat ZeRO-1: all-gather of the {suffix} state"))?;
            for (k, (&i, &off)) in self.idx.iter().zip(&self.offsets).enumerate() {
                if meta[3 * k] == 0.0 {
                    continue;
                }
                let p = &params[i];
                let t = full
                    .narrow(0, off, p.elem_count())?
                    .reshape(p.master.dims())?;
                out.insert(format!("{}.{suffix}", p.name), t);
            }
        }
        for (k, &i) in self.idx.iter().enumerate() {
            if meta[3 * k] != 0.0 {
                let s = ((meta[3 * k + 1] as i64) << 24) + meta[3 * k + 2] as i64;
                out.insert(format!("{}.step", params[i].name), Tensor::new(&[s], dev)?);
            }
        }
        // parameter order, suffix order (as a single rank's state_tensors lists them)
        let mut ordered = Vec::with_capacity(out.len());
        for p in params {
            for s in suffixes {
                let name = format!("{}.{s}", p.name);
                if let Some(t) = out.remove(&name) {
                    ordered.push((name, t));
                }
            }
        }
        Ok(ordered)
    }

    /// This rank's share of a full optimizer state (`"{param}.{suffix}"`, as saved): for every
    /// segment, `"{segment}.{suffix}"` cut from the parameter's tensor and `"{segment}.step"`
    /// the parameter's count; state of other ranks' ranges is dropped. Tensors that are absent
    /// stay absent (the optimizer then decides, as for a single rank).
    ///
    /// Errors: a moment tensor whose size is not its parameter's.
    pub fn shard_state(
        &self,
        params: &[Param],
        full: &HashMap<String, Tensor>,
    ) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        for (s, sp) in self.segments.iter().zip(&self.params) {
            let p = &params[s.pos];
            let prefix = format!("{}.", p.name);
            for (name, t) in full {
                let Some(suffix) = name.strip_prefix(&prefix) else {
                    continue;
                };
                if suffix.contains('.') {
                    continue; // another parameter whose name extends this one's
                }
                let t = if suffix == "step" {
                    t.clone()
                } else {
                    if t.elem_count() != p.elem_count() {
                        bail!(
                            "optimizer state {name} has {} elements, the parameter {}",
                            t.elem_count(),
                            p.elem_count()
                        );
                    }
                    t.flatten_all()?.narrow(0, s.start, s.len)?
                };
                out.insert(format!("{}.{suffix}", sp.name), t);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn store(shapes: &[usize]) -> Result<Vec<Param>> {
        let s = crate::ParamStore::new(crate::Precision::Fp32, Device::Cpu, 1);
        for (i, &n) in shapes.iter().enumerate() {
            s.get_or_init(
                &format!("p{i}"),
                n,
                candle_nn::Init::Const(i as f64),
                crate::params::Role::Fp32,
            )?;
        }
        Ok(s.params())
    }

    #[test]
    fn ranges_cover_every_element_once_and_split_parameters_at_range_ends() -> Result<()> {
        let params = store(&[5, 3, 7])?; // 15 elements, 2 ranks: ranges of 8
        let idx = [0, 1, 2];
        let a = FlatShard::new(&params, &idx, 0, 2)?;
        let b = FlatShard::new(&params, &idx, 1, 2)?;
        assert_eq!(a.shard_len(), 8);
        let seg = |pos, start, len, at| Segment {
            pos,
            start,
            len,
            at,
        };
        assert_eq!(a.segments(), &[seg(0, 0, 5, 0), seg(1, 0, 3, 5)]);
        assert_eq!(b.segments(), &[seg(2, 0, 7, 0)]);
        let c = FlatShard::new(&params, &idx, 1, 3)?; // ranges of 5: [5, 10)
        assert_eq!(c.segments(), &[seg(1, 0, 3, 0), seg(2, 0, 2, 3)]);
        assert_eq!(c.params()[1].name, "p2[0..2]");
        let d = FlatShard::new(&params, &idx, 2, 3)?; // [10, 15)
        assert_eq!(d.segments(), &[seg(2, 2, 5, 0)]);
        assert_eq!(d.bucket().numel, 15);
        assert!(FlatShard::new(&params, &idx, 3, 3).is_err());
        Ok(())
    }

    #[test]
    fn a_full_state_cut_into_shards_keeps_each_segment_and_the_step() -> Result<()> {
        let params = store(&[4, 6])?;
        let d = FlatShard::new(&params, &[0, 1], 1, 2)?; // [5, 10): p1[1..6]
        let full: HashMap<String, Tensor> = [
            (
                "p0.exp_avg".to_string(),
                Tensor::arange(0f32, 4.0, &Device::Cpu)?,
            ),
            (
                "p1.exp_avg".to_string(),
                Tensor::arange(10f32, 16.0, &Device::Cpu)?,
            ),
            ("p1.step".to_string(), Tensor::new(&[7i64], &Device::Cpu)?),
        ]
        .into_iter()
        .collect();
        let got = d.shard_state(&params, &full)?;
        assert_eq!(got.len(), 2);
        assert_eq!(
            got["p1[1..6].exp_avg"].to_vec1::<f32>()?,
            vec![11.0, 12.0, 13.0, 14.0, 15.0]
        );
        assert_eq!(got["p1[1..6].step"].to_vec1::<i64>()?, vec![7]);
        Ok(())
    }
}
