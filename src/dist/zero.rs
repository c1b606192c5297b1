//! ZeRO-1 in the engine: optimizer-state partitioning by whole parameters.
//!
//! Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
//! (SC 2020), stage 1 (`P_os`): each rank keeps the optimizer state (AdamW's `exp_avg` and
//! `exp_avg_sq`, SGD's momentum) of a part of the model only and updates only that part; the
//! other ranks receive the updated weights. The partition here is the one of PyTorch's
//! `torch.distributed.optim.ZeroRedundancyOptimizer` (whole parameters, largest first, each to
//! the rank with the fewest elements so far), which runs beside DDP's gradient all-reduce:
//!
//! ```text
//! backward → all-reduce gradients (Ddp, buckets)       every rank: the global gradient
//!          → global norm, found_inf (every rank alike)
//!          → update the parameters this rank owns      fused kernel, state for owned only
//!          → each owner broadcasts its updated masters  one collective per rank (flattened)
//!          → working copies refreshed from the masters
//! ```
//! Optimizer-state memory per rank is about `1 / world_size` of the full state (2 × 4 bytes
//! per parameter for AdamW) when the collective is attached before the first step (state that
//! exists already stays). Not combined with stochastic rounding (the engine refuses it: only
//! the owner would round stochastically). Communication per step is the all-reduce (2 × the gradient bytes
//! on the wire, as DDP) plus one broadcast of the masters (4 bytes per parameter). The flat
//! variant ([`super::flat`], `Zero1Layout::Flat`) balances to the element and reduce-scatters
//! instead (half the gradient bytes).
//!
//! Checkpoints hold the full state: [`gather_state`] collects every owner's state on every
//! rank, so a run can resume with another world size (each rank then keeps its new share).

use super::Collective;
use crate::params::Param;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};

/// Owner rank of each parameter (index = position in the store): largest parameters first,
/// each to the rank holding the fewest elements so far (ties: the lower rank). Frozen
/// parameters are assigned too (they have no state; the owner's copy is broadcast).
///
/// Errors: `world == 0`.
pub fn partition(numels: &[usize], world: usize) -> Result<Vec<usize>> {
    if world == 0 {
        bail!("ZeRO-1 partition: world size is 0");
    }
    let mut order: Vec<usize> = (0..numels.len()).collect();
    order.sort_by(|&a, &b| numels[b].cmp(&numels[a]).then(a.cmp(&b)));
    let mut load = vec![0usize; world];
    let mut owner = vec![0usize; numels.len()];
    for i in order {
        let r = (0..world).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        owner[i] = r;
        load[r] += numels[i];
    }
    Ok(owner)
}

/// The gradients this rank updates: `grads[i]` where `owner[i] == rank`, `None` elsewhere (the
/// optimizer then neither creates nor touches state for those parameters).
pub fn owned_grads(grads: &[Option<Tensor>], owner: &[usize], rank: usize) -> Vec<Option<Tensor>> {
    grads
        .iter()
        .zip(owner)
        .map(|(g, &o)| if o == rank { g.clone() } else { None })
        .collect()
}

/// After the update: every owner broadcasts the masters it updated (flattened, f32, one
/// collective per rank) and the other ranks copy them in. `refresh` is called for each
/// parameter received, to rebuild its working copy. World size 1: nothing to do.
///
/// Errors: a failed collective; a received buffer of the wrong size.
pub fn broadcast_owned(
    coll: &dyn Collective,
    params: &[Param],
    owner: &[usize],
    mut refresh: impl FnMut(&Param) -> Result<()>,
) -> Result<()> {
    let world = coll.world_size();
    if world == 1 {
        return Ok(());
    }
    for r in 0..world {
        let mine: Vec<&Param> = params
            .iter()
            .zip(owner)
            .filter(|(_, &o)| o == r)
            .map(|(p, _)| p)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let flat = flat_f32(mine.iter().map(|p| p.master.as_tensor()))?;
        let got = coll
            .broadcast(&flat, r)
            .with_context(|| format!("ZeRO-1: broadcasting rank {r}'s updated parameters"))?;
        if coll.rank() == r {
            continue;
        }
        let mut off = 0;
        for p in mine {
            let n = p.elem_count();
            let piece = got.narrow(0, off, n)?.reshape(p.master.dims())?;
            p.master.set(&piece)?;
            refresh(p)?;
            off += n;
        }
    }
    Ok(())
}

/// The full optimizer state on every rank: each owner broadcasts the state tensors of its
/// parameters (`"{param}.{suffix}"` names from `local`, which holds this rank's own), and every
/// rank returns all of them, in parameter order. World size 1: `local` as is.
///
/// Errors: a failed collective; state names that do not start with a parameter name.
pub fn gather_state(
    coll: &dyn Collective,
    params: &[Param],
    owner: &[usize],
    local: Vec<(String, Tensor)>,
    suffixes: &[&str],
) -> Result<Vec<(String, Tensor)>> {
    let world = coll.world_size();
    if world == 1 {
        return Ok(local);
    }
    let local: std::collections::HashMap<String, Tensor> = local.into_iter().collect();
    let mut out = std::collections::HashMap::new();
    for r in 0..world {
        // the names and shapes every rank can derive: owned parameters that have state
        let names: Vec<(String, &Param, Vec<usize>)> = params
            .iter()
            .zip(owner)
            .filter(|(_, &o)| o == r)
            .flat_map(|(p, _)| {
                suffixes
                    .iter()
                    .map(move |s| (format!("{}.{s}", p.name), p, state_shape(s, p)))
            })
            .collect();
        if names.is_empty() {
            continue;
        }
        // a flag per tensor (1: the owner has it) rides in front of the data
        let parts: Vec<Tensor> = if coll.rank() == r {
            let mut flags = Vec::with_capacity(names.len());
            let mut data = Vec::with_capacity(names.len());
            for (n, p, shape) in &names {
                let k: usize = shape.iter().product();
                match local.get(n) {
                    Some(t) if n.ends_with(".step") && t.elem_count() == 1 => {
                        flags.push(1f32);
                        data.push(encode_step(t)?);
                    }
                    Some(t) if !n.ends_with(".step") && t.elem_count() == k => {
                        flags.push(1f32);
                        data.push(t.to_dtype(DType::F32)?.flatten_all()?);
                    }
                    Some(t) => {
                        // flag 2: every rank fails after the broadcast (failing here alone
                        // would leave the other ranks waiting in it)
                        tracing::error!(
                            "ZeRO-1: optimizer state {n} has shape {:?}, expected {shape:?}",
                            t.dims()
                        );
                        flags.push(2f32);
                        data.push(Tensor::zeros(k, DType::F32, p.master.device())?);
                    }
                    None => {
                        flags.push(0f32);
                        data.push(Tensor::zeros(k, DType::F32, p.master.device())?);
                    }
                }
            }
            let dev = names[0].1.master.device();
            let mut v = vec![Tensor::new(flags.as_slice(), dev)?];
            v.extend(data);
            v
        } else {
            let dev = names[0].1.master.device();
            let mut v = vec![Tensor::zeros(names.len(), DType::F32, dev)?];
            v.extend(
                names
                    .iter()
                    .map(|(_, _, shape)| {
                        Tensor::zeros(shape.iter().product::<usize>(), DType::F32, dev)
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?,
            );
            v
        };
        let got = coll
            .broadcast(&Tensor::cat(&parts, 0)?, r)
            .with_context(|| format!("ZeRO-1: gathering rank {r}'s optimizer state"))?;
        let flags = got.narrow(0, 0, names.len())?.to_vec1::<f32>()?;
        if let Some(i) = flags.iter().position(|f| *f == 2.0) {
            bail!(
                "ZeRO-1: rank {r} holds optimizer state {} with an unexpected shape (expected \
                 {:?}); see that rank's log",
                names[i].0,
                names[i].2
            );
        }
        let mut off = names.len();
        for ((n, _, shape), f) in names.iter().zip(flags) {
            let k: usize = shape.iter().product();
            if f == 1.0 && n.ends_with(".step") {
                out.insert(n.clone(), decode_step(&got.narrow(0, off, k)?)?);
            } else if f == 1.0 {
                out.insert(n.clone(), got.narrow(0, off, k)?.reshape(shape.as_slice())?);
            }
            off += k;
        }
    }
    // parameter order, suffix order (as a single rank's state_tensors lists them)
    let mut ordered = Vec::with_capacity(out.len());
    for p in params {
        for s in suffixes {
            if let Some(t) = out.remove(&format!("{}.{s}", p.name)) {
                ordered.push((format!("{}.{s}", p.name), t));
            }
        }
    }
    Ok(ordered)
}

/// Shape of a state tensor in transit: the per-parameter step count travels as two f32
/// ([`encode_step`]), moments have the parameter's shape.
fn state_shape(suffix: &str, p: &Param) -> Vec<usize> {
    if suffix == "step" {
        vec![2]
    } else {
        p.master.dims().to_vec()
    }
}

/// An exact step count `s < 2^48` as the two f32 `[s / 2^24, s % 2^24]` (the collectives move
/// floats; one f32 is exact only below 2^24).
fn encode_step(t: &Tensor) -> Result<Tensor> {
    let s = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?[0] as u64;
    let v = [(s >> 24) as f32, (s & 0xff_ffff) as f32];
    Ok(Tensor::new(&v, t.device())?)
}

/// The inverse of [`encode_step`]: a `(1,)` i64 count.
fn decode_step(t: &Tensor) -> Result<Tensor> {
    let v = t.to_vec1::<f32>()?;
    let s = ((v[0] as i64) << 24) + v[1] as i64;
    Ok(Tensor::new(&[s], t.device())?)
}

fn flat_f32<'a>(ts: impl Iterator<Item = &'a Tensor>) -> Result<Tensor> {
    let parts = ts
        .map(|t| t.to_dtype(DType::F32)?.flatten_all())
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_counts_cross_the_collective_exactly() -> Result<()> {
        for s in [0i64, 7, (1 << 24) + 1, (1 << 40) + 3] {
            let t = Tensor::new(&[s], &candle_core::Device::Cpu)?;
            assert_eq!(decode_step(&encode_step(&t)?)?.to_vec1::<i64>()?, vec![s]);
        }
        Ok(())
    }

    #[test]
    fn partition_is_greedy_largest_first_and_balanced() -> Result<()> {
        // sizes 10, 7, 6, 3, 2 over 2 ranks: 10→0, 7→1, 6→1 (7 < 10), 3→0 (10 < 13), 2→0 (13 == 13 → rank 0)
        let owner = partition(&[3, 10, 6, 2, 7], 2)?;
        assert_eq!(owner, vec![0, 0, 1, 0, 1]);
        let load = |r| {
            owner
                .iter()
                .zip([3, 10, 6, 2, 7])
                .filter(|(o, _)| **o == r)
                .map(|(_, n)| n)
                .sum::<usize>()
        };
        assert_eq!((load(0), load(1)), (15, 13));
        assert_eq!(partition(&[5, 5], 1)?, vec![0, 0]);
        assert!(partition(&[1], 0).is_err());
        Ok(())
    }

    #[test]
    fn owned_grads_keeps_only_this_ranks() -> Result<()> {
        let g = Some(Tensor::new(&[1f32], &candle_core::Device::Cpu)?);
        let out = owned_grads(&[g.clone(), g.clone(), None], &[0, 1, 0], 1);
        assert!(out[0].is_none() && out[1].is_some() && out[2].is_none());
        Ok(())
    }
}
