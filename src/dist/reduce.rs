//! One accumulation window's gradient reduction, bucket by bucket, started during the backward
//! where the gradients allow it.
//!
//! PyTorch DDP (Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3; `reducer.cpp`) starts a
//! bucket's all-reduce from the autograd hook of the last of its gradients to become ready, so
//! that communication runs while the backward computes earlier layers, and it launches the
//! buckets strictly in bucket order, so that every rank issues the same collectives in the same
//! order whatever the order its gradients arrive in. [`Reduction`] does the same on wick's
//! gradient sink ([`crate::grad_sink::backward_with`]):
//!
//! - A parameter's gradient is **final** when the sink has taken it as many times as in the
//!   previous boundary backward, if candle added nothing to it then. That count is learned at
//!   every boundary ([`Reduction::after_backward`]); the first boundary only learns, so all of
//!   its buckets start after the backward. A parameter whose gradient candle computes itself
//!   (an op outside wick's) or that gets none keeps its bucket, and those after it, waiting for
//!   the end of the backward.
//! - Bucket `i` starts once its members are final and buckets `0..i` have started; after the
//!   backward the others start in order ([`Reduction::finish`]), then every bucket is awaited
//!   and unpacked.
//! - A gradient that grew after its bucket had started (a graph that changed between steps,
//!   which PyTorch DDP refuses) makes that window's sum wrong: every bucket is still reduced
//!   (so that all ranks issue the same collectives), the window counts as found_inf and every
//!   rank skips it (the flag joins the found_inf agreement), with a warning naming the
//!   parameter; later steps wait for that gradient's new number of contributions.
//!
//! A member's part of the flat bucket is the window's weighted contribution `prior + w * g` (or
//! `w * g` for the raw gradient of a single micro-batch), computed by the same kernel (CUDA) or
//! the same tensor ops (CPU) as the gradient accumulation and the bucket packing of a reduction
//! after the backward, so an early start changes when the sum is taken, not its bits
//! (`tests/ddp.rs` checks bit equality against `DdpConfig { overlap: false, .. }`).
//!
//! Flat ZeRO-1 ([`super::flat`]) packs every gradient into one flat buffer after the backward
//! and reduce-scatters it (no early start: one collective per window).
//!
//! Gradients travel in [`DdpConfig::reduce_dtype`]: f32, with the window's weight as one
//! more element of bucket 0; or bf16 (half the bytes, as PyTorch's `bf16_compress_hook`),
//! packed in f32 and rounded once, with the weight reduced beforehand in its own f32
//! all-reduce (bf16 carries integers exactly only up to 256).
//!
//! [`DdpConfig::reduce_dtype`]: super::DdpConfig::reduce_dtype

use super::ddp::{Bucket, Ddp};
use super::flat::FlatShard;
use super::Pending;
use crate::grads::GradBuffers;
use crate::params::Param;
use anyhow::{bail, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, TensorId};
use std::collections::HashMap;

/// The reduction of one accumulation window, begun before the boundary micro-batch's backward
/// ([`Reduction::begin`]) and finished at the boundary ([`Reduction::finish`]).
pub struct Reduction {
    params: Vec<Param>,
    /// Store positions of the reduced parameters ([`Ddp::reduced_params`]).
    idx: Vec<usize>,
    buckets: Vec<Bucket>,
    /// Differentiated tensor's id → store position, for the reduced parameters.
    position: HashMap<TensorId, usize>,
    /// Bucket of each store position.
    bucket_of: Vec<Option<usize>>,
    /// Sink offers that make each parameter's gradient final (learned; `None`: not early).
    expected: Vec<Option<usize>>,
    /// Offers seen in this backward, and the latest gradient so far (kept until its bucket
    /// starts) and its id, per store position.
    seen: Vec<usize>,
    latest: Vec<Option<Tensor>>,
    latest_id: Vec<Option<TensorId>>,
    /// Members of each bucket not final yet (`usize::MAX`: a member can never be early).
    missing: Vec<usize>,
    /// The window's buffers before this micro-batch (empty with `keep_raw`).
    prior: Vec<Option<Tensor>>,
    /// This micro-batch's weight, when it multiplies the gradient (`None`: 1).
    scale: Option<f64>,
    keep_raw: bool,
    /// The window's weight on this rank, this micro-batch included.
    window: f64,
    /// bf16 or flat ZeRO-1: the global weight, reduced before the buckets (started before
    /// the backward, awaited in [`Self::finish`]).
    weight_sum: Option<Pending>,
    /// Flat ZeRO-1: one bucket over every parameter, reduce-scattered after the backward.
    scatter: bool,
    started: Vec<Pending>,
    /// The gradient each early-started member was packed from.
    early: Vec<Option<TensorId>>,
}

impl std::fmt::Debug for Reduction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reduction")
            .field("buckets", &self.buckets.len())
            .field("started", &self.started.len())
            .finish()
    }
}

impl Reduction {
    /// Begins the window's reduction before the backward of its last micro-batch, of weight
    /// `weight`; `prior` holds the window so far (its buffers, unused with `keep_raw`, the raw
    /// gradient of a single micro-batch, and its weight); `flat`: flat ZeRO-1's layout. `None`
    /// for world size 1 or nothing to reduce.
    ///
    /// Errors: a window weight that is not finite and > 0; with bf16 reduction or flat
    /// ZeRO-1, the weight's all-reduce; flat ZeRO-1 whose trainable parameters are no longer
    /// the ones it was attached with.
    pub fn begin(
        ddp: &Ddp,
        flat: Option<&FlatShard>,
        params: &[Param],
        prior: &GradBuffers,
        weight: f64,
        keep_raw: bool,
    ) -> Result<Option<Self>> {
        let window = prior.window_weight() + weight;
        if ddp.collective().world_size() == 1 {
            return Ok(None);
        }
        if !(window.is_finite() && window > 0.0) {
            bail!("gradient reduction: the accumulation window has weight {window}");
        }
        let idx = Ddp::reduced_params(params);
        if let Some(f) = flat {
            f.check_layout(params, &idx)?;
        }
        if idx.is_empty() {
            return Ok(None);
        }
        let buckets = match flat {
            Some(f) => vec![f.bucket()],
            None => ddp.buckets(params)?,
        };
        let n = params.len();
        let mut bucket_of = vec![None; n];
        for (bi, b) in buckets.iter().enumerate() {
            for &m in &b.members {
                bucket_of[idx[m]] = Some(bi);
            }
        }
        let expected: Vec<Option<usize>> = (0..n)
            .map(|i| ddp.ready_counts().get(i).copied().flatten())
            .collect();
        let missing = buckets
            .iter()
            .map(|b| {
                if b.members.iter().all(|&m| expected[idx[m]].is_some()) {
                    b.members.len()
                } else {
                    usize::MAX
                }
            })
            .collect();
        let weight_sum = match (ddp.config().reduce_dtype, flat) {
            (DType::F32, None) => None,
            _ => {
                let dev = params[idx[0]].master.device();
                let w = Tensor::new(&[window as f32], dev)?;
                Some(
                    ddp.collective()
                        .all_reduce_sum_start(&w)
                        .context("all-reduce of the window's weight")?,
                )
            }
        };
        Ok(Some(Self {
            position: idx
                .iter()
                .map(|&i| (params[i].differentiated().id(), i))
                .collect(),
            params: params.to_vec(),
            idx,
            buckets,
            bucket_of,
            expected,
            seen: vec![0; n],
            latest: vec![None; n],
            latest_id: vec![None; n],
            missing,
            prior: match keep_raw {
                true => Vec::new(),
                false => prior.buffers().to_vec(),
            },
            scale: (weight != 1.0).then_some(weight),
            keep_raw,
            window,
            weight_sum,
            scatter: flat.is_some(),
            started: Vec::new(),
            early: vec![None; n],
        }))
    }

    /// The sink's hook: `grad` is `leaf`'s gradient so far in this backward. Starts every
    /// bucket that is now ready, in bucket order.
    ///
    /// Errors: packing or starting a bucket's all-reduce.
    pub fn offer(&mut self, ddp: &Ddp, leaf: &Tensor, grad: &Tensor) -> Result<()> {
        let Some(&i) = self.position.get(&leaf.id()) else {
            return Ok(()); // not a reduced parameter of this store
        };
        self.seen[i] += 1;
        self.latest[i] = Some(grad.clone());
        self.latest_id[i] = Some(grad.id());
        if let (Some(bi), Some(want)) = (self.bucket_of[i], self.expected[i]) {
            if self.seen[i] == want {
                self.missing[bi] -= 1;
            }
        }
        while let Some(&0) = self.missing.get(self.started.len()) {
            let bi = self.started.len();
            let b = &self.buckets[bi];
            for &m in &b.members {
                self.early[self.idx[m]] = self.latest_id[self.idx[m]];
            }
            let early = Contribution {
                grads: &self.latest,
                prior: &self.prior,
                scale: self.scale,
            };
            let flat = pack(&self.params, &self.idx, b, &early, self.extra(bi))?;
            self.start(ddp, bi, flat)?;
            for &m in &self.buckets[bi].members {
                self.latest[self.idx[m]] = None; // packed: only its id is needed from here on
            }
        }
        Ok(())
    }

    /// After the backward, with its gradients `grads`: checks that every early-started member
    /// was packed from its final gradient, and learns for the next boundary which gradients are
    /// final when (module docs). A member packed too early marks the window stale in `ddp`
    /// (every rank then skips it; [`Ddp::agree_stats`]); the reduction itself goes on, so that
    /// every rank still issues the same collectives.
    pub fn after_backward(&mut self, ddp: &mut Ddp, grads: &GradStore) {
        let mut stale = None;
        let counts = (0..self.params.len())
            .map(|i| {
                let held = grads.get(self.params[i].differentiated()).map(Tensor::id);
                if self.early[i].is_some() && self.early[i] != held {
                    stale.get_or_insert_with(|| self.params[i].name.clone());
                }
                (self.seen[i] > 0 && self.latest_id[i] == held).then_some(self.seen[i])
            })
            .collect();
        self.latest = Vec::new();
        ddp.set_ready_counts(counts, self.started.len(), self.buckets.len(), stale);
    }

    /// At the boundary, after the accumulation: starts the buckets not started yet (from
    /// `grads`' buffers), then replaces the buffers by the global gradient
    /// `Σ_ranks contribution / Σ_ranks weight` in f32, with normaliser 1. A trainable
    /// parameter without a gradient on this rank contributes zeros.
    ///
    /// Flat ZeRO-1 (`flat`): the buffers become this rank's segments of the global gradient,
    /// in [`FlatShard::params`] order.
    ///
    /// Errors: packing, a collective, or buffers that do not match the parameters.
    pub fn finish(
        mut self,
        ddp: &Ddp,
        flat: Option<&FlatShard>,
        grads: &mut GradBuffers,
    ) -> Result<()> {
        // the buffers hold the window's sum, or with `keep_raw` this micro-batch's raw gradient
        let buffers = Contribution {
            grads: grads.buffers(),
            prior: &[],
            scale: if self.keep_raw { self.scale } else { None },
        };
        if let Some(f) = flat.filter(|_| self.scatter) {
            let packed = pack(&self.params, &self.idx, &self.buckets[0], &buffers, None)?;
            let range = ddp
                .collective()
                .reduce_scatter_sum(&packed.to_dtype(ddp.config().reduce_dtype)?)
                .context("flat ZeRO-1: reduce-scatter of the gradients")?
                .to_dtype(DType::F32)?;
            let w = self.weight_sum.take().context("the weight sum")?.wait()?;
            return grads.set_segments(f.segment_grads(&range.broadcast_div(&w)?)?);
        }
        for bi in self.started.len()..self.buckets.len() {
            let b = &self.buckets[bi];
            let flat = pack(&self.params, &self.idx, b, &buffers, self.extra(bi))?;
            self.start(ddp, bi, flat)?;
        }
        let mut reduced: Vec<Option<Tensor>> = vec![None; self.params.len()];
        let mut weight_sum = self.weight_sum.take().map(Pending::wait).transpose()?;
        for (bi, pending) in std::mem::take(&mut self.started).into_iter().enumerate() {
            let b = &self.buckets[bi];
            let mut sum = pending
                .wait()
                .with_context(|| format!("all-reduce of gradient bucket {bi}"))?
                .to_dtype(DType::F32)?;
            if weight_sum.is_none() {
                weight_sum = Some(sum.narrow(0, b.numel, 1)?);
                sum = sum.narrow(0, 0, b.numel)?;
            }
            let w = weight_sum
                .as_ref()
                .context("the weight sum rides in bucket 0")?;
            let avg = sum.broadcast_div(w)?;
            for (&m, &off) in b.members.iter().zip(&b.offsets) {
                let p = &self.params[self.idx[m]];
                reduced[self.idx[m]] = Some(
                    avg.narrow(0, off, p.elem_count())?
                        .reshape(p.master.dims())?,
                );
            }
        }
        grads.set_reduced(reduced)
    }

    /// The window's weight as the last element of bucket 0 in f32 reduction.
    fn extra(&self, bi: usize) -> Option<f64> {
        (bi == 0 && self.weight_sum.is_none()).then_some(self.window)
    }

    fn start(&mut self, ddp: &Ddp, bi: usize, flat: Tensor) -> Result<()> {
        let flat = flat.to_dtype(ddp.config().reduce_dtype)?;
        let pending = ddp
            .collective()
            .all_reduce_sum_start(&flat)
            .with_context(|| format!("all-reduce of gradient bucket {bi}"))?;
        self.started.push(pending);
        Ok(())
    }
}

/// What a member contributes to its bucket, by store position: `prior + scale * g` with
/// `g = grads[i]` (a missing `prior` is 0, a missing `scale` 1, a missing `g` contributes 0).
struct Contribution<'a> {
    grads: &'a [Option<Tensor>],
    prior: &'a [Option<Tensor>],
    scale: Option<f64>,
}

/// Bucket `b` as one flat f32 tensor of `b.numel` elements: each member's (store position
/// `idx[m]`) [`Contribution`], zeros after the last member, and `extra`, when given, as one
/// more element.
fn pack(
    params: &[Param],
    idx: &[usize],
    b: &Bucket,
    c: &Contribution,
    extra: Option<f64>,
) -> Result<Tensor> {
    let dev = params[idx[b.members[0]]].master.device().clone();
    #[cfg(feature = "cuda")]
    if dev.is_cuda() {
        return pack_cuda(params, idx, b, c, extra);
    }
    let (grads, prior, scale) = (c.grads, c.prior, c.scale);
    let at = |v: &[Option<Tensor>], i: usize| v.get(i).and_then(|x| x.clone());
    let mut parts = Vec::with_capacity(b.members.len() + 1);
    for &m in &b.members {
        let i = idx[m];
        let part = match at(grads, i) {
            Some(g) => {
                let g = g.flatten_all()?.to_dtype(DType::F32)?;
                let g = match scale {
                    Some(w) => (g * w)?,
                    None => g,
                };
                match at(prior, i) {
                    Some(acc) => (acc.flatten_all()? + g)?,
                    None => g,
                }
            }
            None => match at(prior, i) {
                Some(acc) => acc.flatten_all()?,
                None => Tensor::zeros(params[i].elem_count(), DType::F32, &dev)?,
            },
        };
        parts.push(part);
    }
    let filled: usize = parts.iter().map(Tensor::elem_count).sum();
    if filled < b.numel {
        parts.push(Tensor::zeros(b.numel - filled, DType::F32, &dev)?); // flat ZeRO-1's padding
    }
    if let Some(x) = extra {
        parts.push(Tensor::new(&[x as f32], &dev)?);
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// [`pack`] with the multi-tensor accumulate kernel (one launch per gradient dtype and up to
/// 160 tensors): each member's view of the flat buffer holds its prior (or 0) and receives
/// `scale * g`, the kernel and arithmetic of the gradient accumulation.
#[cfg(feature = "cuda")]
fn pack_cuda(
    params: &[Param],
    idx: &[usize],
    b: &Bucket,
    c: &Contribution,
    extra: Option<f64>,
) -> Result<Tensor> {
    let (grads, prior, scale) = (c.grads, c.prior, c.scale);
    let dev = params[idx[b.members[0]]].master.device().clone();
    let flat = Tensor::zeros(b.numel + usize::from(extra.is_some()), DType::F32, &dev)?;
    let k = b.members.len();
    let (mut views, mut held, mut incoming) = (vec![None; k], vec![None; k], vec![None; k]);
    for (j, (&m, &off)) in b.members.iter().zip(&b.offsets).enumerate() {
        let i = idx[m];
        let n = params[i].elem_count();
        if let Some(acc) = prior.get(i).and_then(|x| x.as_ref()) {
            flat.slice_set(&acc.flatten_all()?, 0, off)?;
            // `held` set: the kernel adds to the view instead of overwriting it
            held[j] = Some(acc.clone());
        }
        if let Some(g) = grads.get(i).and_then(|x| x.as_ref()) {
            views[j] = Some(flat.narrow(0, off, n)?);
            incoming[j] = Some(g.flatten_all()?);
        }
    }
    crate::cuda::accumulate::accumulate(
        &mut views,
        &mut held,
        &incoming,
        scale.unwrap_or(1.0) as f32,
    )?;
    if let Some(x) = extra {
        flat.slice_set(&Tensor::new(&[x as f32], &dev)?, 0, b.numel)?;
    }
    Ok(flat)
}
