//! The engine's gradient-synchronisation seam: how the gradients of one accumulation window
//! become the gradient the optimizer applies, and how the update reaches every rank.
//!
//! | variant | at the boundary | after the update |
//! |---|---|---|
//! | [`GradSync::Solo`] | nothing | nothing |
//! | [`GradSync::Ddp`] | all-reduce in buckets (PyTorch DDP; started during the backward, [`super::reduce`]), found_inf agreed | nothing: every rank applied the same update |
//! | [`GradSync::Zero1`] | as DDP; each rank updates the parameters it owns ([`super::zero`]) | every owner broadcasts its updated masters |
//! | [`GradSync::Zero1Flat`] | reduce-scatter of the flat gradients; norm summed over the ranks; each rank updates its range ([`super::flat`]) | all-gather of the ranges' masters |
//!
//! `Engine::step` calls the same methods whatever the variant.

use super::ddp::Ddp;
use super::flat::FlatShard;
use super::reduce::Reduction;
use super::{Collective, DdpConfig, Zero1Layout};
use crate::grads::{GradBuffers, GradStats};
use crate::params::{Param, ParamStore};
use anyhow::{bail, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor};

/// How gradients are synchronised across ranks (see the module docs).
#[derive(Debug, Default)]
pub enum GradSync {
    /// One process: the local gradient is the gradient.
    #[default]
    Solo,
    /// Data parallelism: gradients all-reduced, every rank updates everything.
    Ddp(Ddp),
    /// ZeRO-1: gradients all-reduced, each rank updates (and keeps optimizer state for) the
    /// parameters it owns, then broadcasts them.
    Zero1(Ddp),
    /// Flat ZeRO-1 (more than one rank): gradients reduce-scattered, each rank updates (and
    /// keeps optimizer state for) its range of the flattened parameters, the ranges are
    /// all-gathered.
    Zero1Flat(Ddp, FlatShard),
}

impl GradSync {
    /// Attaches `collective` for `store`'s parameters: checks that every rank has the same
    /// layout, broadcasts rank 0's parameters, and with `config.zero1` partitions the
    /// parameters among the ranks.
    ///
    /// Errors: not at an accumulation boundary (`micro_steps != 0`); ZeRO-1 with stochastic
    /// rounding of mixed-precision working copies on more than one rank (only a parameter's
    /// owner would round stochastically, so the ranks' working copies would differ).
    pub fn attach(
        collective: Box<dyn Collective>,
        config: DdpConfig,
        store: &ParamStore,
        micro_steps: usize,
        stochastic_rounding: bool,
    ) -> Result<Self> {
        if micro_steps != 0 {
            bail!("Engine::with_collective: attach the collective at an accumulation boundary");
        }
        let zero1 = config.zero1;
        if zero1
            && stochastic_rounding
            && collective.world_size() > 1
            && store.precision().is_mixed()
        {
            bail!(
                "Engine::with_collective: ZeRO-1 with stochastic rounding would give the ranks \
                 different working copies (only a parameter's owner rounds stochastically); \
                 turn one of them off"
            );
        }
        let flat = zero1 && config.zero1_layout == Zero1Layout::Flat;
        let mut ddp = Ddp::new(collective, config)?;
        let params = store.params();
        ddp.shard_owners(&params)?;
        ddp.broadcast_parameters(store)
            .context("broadcasting the parameters from rank 0")?;
        let (rank, world) = (ddp.collective().rank(), ddp.collective().world_size());
        let idx = Ddp::reduced_params(&params);
        Ok(if flat && world > 1 && !idx.is_empty() {
            let shard = FlatShard::new(&params, &idx, rank, world)?;
            GradSync::Zero1Flat(ddp, shard)
        } else if zero1 && !flat {
            GradSync::Zero1(ddp)
        } else {
            // one rank or nothing to shard: nothing to partition either
            GradSync::Ddp(ddp)
        })
    }

    fn ddp(&self) -> Option<&Ddp> {
        match self {
            GradSync::Solo => None,
            GradSync::Ddp(d) | GradSync::Zero1(d) | GradSync::Zero1Flat(d, _) => Some(d),
        }
    }

    fn ddp_mut(&mut self) -> Option<&mut Ddp> {
        match self {
            GradSync::Solo => None,
            GradSync::Ddp(d) | GradSync::Zero1(d) | GradSync::Zero1Flat(d, _) => Some(d),
        }
    }

    fn flat(&self) -> Option<&FlatShard> {
        match self {
            GradSync::Zero1Flat(_, f) => Some(f),
            _ => None,
        }
    }

    /// Flat ZeRO-1: the collective over whose ranks the gradient is split (the boundary's sum
    /// of squares is summed over them). `None` otherwise.
    pub fn shards_gradients(&self) -> Option<&dyn Collective> {
        match self {
            GradSync::Zero1Flat(d, _) => Some(d.collective()),
            _ => None,
        }
    }

    /// The parameters the optimizer updates and keeps state for: `params` (the store's), or
    /// flat ZeRO-1's segments of this rank.
    pub fn optimizer_params<'a>(&'a self, params: &'a [Param]) -> &'a [Param] {
        self.flat().map_or(params, FlatShard::params)
    }

    /// Before the update: [`Self::optimizer_params`]; flat ZeRO-1's segments with their
    /// masters copied from the store's and their parents' current options
    /// ([`FlatShard::load_masters`]).
    pub fn before_update<'a>(
        &'a self,
        params: &'a [Param],
    ) -> Result<std::borrow::Cow<'a, [Param]>> {
        Ok(match self.flat() {
            Some(f) => std::borrow::Cow::Owned(f.load_masters(params)?),
            None => std::borrow::Cow::Borrowed(params),
        })
    }

    /// Whether [`Self::after_update`] rewrites every master and working copy (flat ZeRO-1), so
    /// that the engine need not refresh the working copies itself.
    pub fn gathers_masters(&self) -> bool {
        self.flat().is_some()
    }

    /// Flat ZeRO-1: this rank's share of a full optimizer state ([`FlatShard::shard_state`]),
    /// named after [`Self::optimizer_params`]. `None` otherwise (the state applies as is).
    pub fn shard_state(
        &self,
        params: &[Param],
        full: &std::collections::HashMap<String, Tensor>,
    ) -> Result<Option<std::collections::HashMap<String, Tensor>>> {
        self.flat().map(|f| f.shard_state(params, full)).transpose()
    }

    /// The collective, when one is attached.
    pub fn collective(&self) -> Option<&dyn Collective> {
        self.ddp().map(|d| d.collective())
    }

    /// Records one micro-batch of weight `weight` (this rank's share of the global
    /// normaliser).
    pub fn note_micro_batch(&mut self, weight: f64) {
        if let Some(d) = self.ddp_mut() {
            d.note_micro_batch(weight);
        }
    }

    /// Before the backward of a window's last micro-batch (weight `weight`; `prior`: the
    /// window's buffers so far): the window's [`Reduction`], or `None` without a collective of
    /// more than one rank.
    pub fn begin_reduction(
        &self,
        params: &[Param],
        prior: &[Option<Tensor>],
        weight: f64,
        keep_raw: bool,
    ) -> Result<Option<Reduction>> {
        match self.ddp() {
            None => Ok(None),
            Some(d) => Reduction::begin(d, self.flat(), params, prior, weight, keep_raw),
        }
    }

    /// The backward of `scaled_loss` ([`crate::grad_sink::backward`]); with a `reduction` and
    /// [`DdpConfig::overlap`], its buckets start as their gradients become final.
    ///
    /// Errors: the backward's, or a bucket's all-reduce. A gradient that changed after its
    /// bucket started is not an error here: the window is skipped on every rank
    /// ([`Reduction::after_backward`]).
    pub fn backward(
        &mut self,
        scaled_loss: &Tensor,
        reduction: Option<&mut Reduction>,
    ) -> Result<GradStore> {
        let flat = self.flat().is_some(); // one reduce-scatter after the backward
        let (Some(r), Some(d)) = (reduction, self.ddp_mut()) else {
            return Ok(crate::grad_sink::backward(scaled_loss)?);
        };
        if !d.config().overlap || flat {
            return Ok(crate::grad_sink::backward(scaled_loss)?);
        }
        let grads = {
            let d: &Ddp = d;
            crate::grad_sink::backward_with(scaled_loss, &mut |leaf, g| {
                r.offer(d, leaf, g)
                    .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
            })?
        };
        r.after_backward(d, &grads);
        Ok(grads)
    }

    /// At the boundary, before the norm and found_inf: replaces the buffers by the global
    /// gradient ([`Reduction::finish`]) and ends the window.
    pub fn reduce(&mut self, grads: &mut GradBuffers, reduction: Option<Reduction>) -> Result<()> {
        if let Some(d) = self.ddp_mut() {
            d.take_window_weight();
        }
        match (reduction, self.ddp()) {
            (Some(r), Some(d)) => r.finish(d, self.flat(), grads),
            _ => Ok(()),
        }
    }

    /// Makes every rank see the same boundary statistics, so that every rank skips together.
    pub fn agree(&mut self, stats: GradStats, device: &Device) -> Result<GradStats> {
        match self.ddp_mut() {
            None => Ok(stats),
            Some(d) => d.agree_stats(stats, device),
        }
    }

    /// See [`Ddp::buckets_started_in_backward`]; `None` without a collective.
    pub fn buckets_started_in_backward(&self) -> Option<(usize, usize)> {
        self.ddp().and_then(Ddp::buckets_started_in_backward)
    }

    /// ZeRO-1: which parameters this rank updates (`None`: every one).
    pub fn owned(&self) -> Option<Vec<bool>> {
        let GradSync::Zero1(d) = self else {
            return None;
        };
        let rank = d.collective().rank();
        d.owners().map(|o| o.iter().map(|&r| r == rank).collect())
    }

    /// After the optimizer step: ZeRO-1 owners broadcast their updated masters and the other
    /// ranks refresh those working copies; flat ZeRO-1 all-gathers every rank's range of the
    /// masters and refreshes every working copy. Nothing otherwise.
    pub fn after_update(&self, params: &[Param]) -> Result<()> {
        if let GradSync::Zero1Flat(d, f) = self {
            return f.gather_masters(d.collective(), params, || {
                for p in params {
                    if let Some(w) = &p.working {
                        w.set(&p.master.as_tensor().to_dtype(w.dtype())?)?;
                    }
                }
                Ok(())
            });
        }
        let GradSync::Zero1(d) = self else {
            return Ok(());
        };
        let owners = d.owners().context("ZeRO-1 without a partition")?;
        super::zero::broadcast_owned(d.collective(), params, owners, |p| {
            if let Some(w) = &p.working {
                w.set(&p.master.as_tensor().to_dtype(w.dtype())?)?;
            }
            Ok(())
        })
    }

    /// The full optimizer state from this rank's `local` share (ZeRO-1 gathers every owner's;
    /// collective: call it on every rank). Otherwise `local` as is.
    pub fn gather_state(
        &self,
        params: &[Param],
        local: Vec<(String, Tensor)>,
        suffixes: &[&str],
    ) -> Result<Vec<(String, Tensor)>> {
        match self {
            GradSync::Zero1(d) => {
                let owners = d.owners().context("ZeRO-1 without a partition")?;
                super::zero::gather_state(d.collective(), params, owners, local, suffixes)
            }
            GradSync::Zero1Flat(d, f) => f.gather_state(d.collective(), params, local, suffixes),
            _ => Ok(local),
        }
    }
}
