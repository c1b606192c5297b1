//! The fused CPU update: one rayon pass over each element of a parameter, its gradient and its
//! state tensors, running an [`UpdateRule`]'s element update.

use super::rule::UpdateRule;
use super::state::Buf;
use crate::grads::with_cpu_f32;
use crate::params::Param;
use anyhow::{bail, Result};
use candle_core::{CpuStorage, Layout, Tensor};
use rayon::prelude::*;
use std::sync::Mutex;

/// Elements per rayon task of the host update.
const HOST_CHUNK: usize = 1 << 14;

/// The fused CPU update of one parameter: one pass over each element of p, g and the state.
pub(crate) fn host_update<R: UpdateRule>(
    p: &Param,
    g: &Tensor,
    bufs: &mut [Buf],
    k: &R::Coeffs,
    first: bool,
) -> Result<()> {
    let mut states = Vec::with_capacity(bufs.len());
    for b in bufs.iter_mut() {
        match b {
            Buf::Host(v) => states.push(v.as_mut_slice()),
            Buf::Tensor(_) => bail!("{}: state/path mismatch", R::NAME),
        }
    }
    with_cpu_f32(g, |g| {
        let op = HostUpdate::<R> {
            g,
            states: Mutex::new(states),
            k: *k,
            first,
        };
        p.master.as_tensor().inplace_op1(&op)
    })??;
    Ok(())
}

/// One rayon task of the host update: a chunk of the master, of the gradient, of each state.
type Chunk<'a> = (&'a mut [f32], &'a [f32], Vec<&'a mut [f32]>);

struct HostUpdate<'a, R: UpdateRule> {
    g: &'a [f32],
    states: Mutex<Vec<&'a mut [f32]>>,
    k: R::Coeffs,
    first: bool,
}

impl<R: UpdateRule> candle_core::InplaceOp1 for HostUpdate<'_, R> {
    fn name(&self) -> &'static str {
        "wick-fused-update-cpu"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(data) = storage else {
            candle_core::bail!("fused {}: master weights must be f32", R::NAME)
        };
        let Some((a, b)) = layout.contiguous_offsets() else {
            candle_core::bail!("fused {}: master weights must be contiguous", R::NAME)
        };
        let p = &mut data[a..b];
        let mut guard = self
            .states
            .lock()
            .map_err(|_| candle_core::Error::Msg("poisoned".into()))?;
        if p.len() != self.g.len() || guard.iter().any(|s| s.len() != p.len()) {
            candle_core::bail!(
                "fused {}: {} params, {} grads, state lengths {:?}",
                R::NAME,
                p.len(),
                self.g.len(),
                guard.iter().map(|s| s.len()).collect::<Vec<_>>()
            );
        }
        // chunk i of the master, the gradient and every state tensor
        let mut tasks: Vec<Chunk> = p
            .chunks_mut(HOST_CHUNK)
            .zip(self.g.chunks(HOST_CHUNK))
            .map(|(p, g)| (p, g, Vec::new()))
            .collect();
        for s in guard.iter_mut() {
            for (t, c) in tasks.iter_mut().zip(s.chunks_mut(HOST_CHUNK)) {
                t.2.push(c);
            }
        }
        let (k, first) = (self.k, self.first);
        tasks
            .into_par_iter()
            .for_each(|(p, g, mut s)| R::update_host(&k, p, g, &mut s, first));
        Ok(())
    }
}
