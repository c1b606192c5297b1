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
//! `Engine::step` calls the same three methods whatever the variant, in the order of its
//! story:
//!
//! ```text
//! backward       every micro-batch; at a window's last one the window's reduction begins
//!                and its buckets start as their gradients become final
//! finish_window  at the boundary: the global gradient replaces the buffers, the caller's
//!                check measures found_inf and the norm (over the ranks' shards), the ranks
//!                agree on the statistics
//! update         the optimizer step on this rank's parameters (or segments), the working
//!                copies refreshed, ZeRO-1's broadcast / all-gather of the updated masters
//! ```
//!
//! The window's weight lives in the gradient buffers ([`GradBuffers::window_weight`]); the seam
//! reads it there. Checkpoints reach the optimizer state through
//! [`GradSync::gather_optimizer_state`] and [`GradSync::load_optimizer_state`].

use super::ddp::Ddp;
use super::flat::FlatShard;
use super::reduce::Reduction;
use super::{Collective, DdpConfig, Zero1Layout};
use crate::grads::{GradBuffers, GradStats};
use crate::optim::Optimizer;
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
    fn shards_gradients(&self) -> Option<&dyn Collective> {
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
    fn before_update<'a>(&'a self, params: &'a [Param]) -> Result<std::borrow::Cow<'a, [Param]>> {
        Ok(match self.flat() {
            Some(f) => std::borrow::Cow::Owned(f.load_masters(params)?),
            None => std::borrow::Cow::Borrowed(params),
        })
    }

    /// Whether [`Self::after_update`] rewrites every master and working copy (flat ZeRO-1), so
    /// that the update need not refresh the working copies itself.
    fn gathers_masters(&self) -> bool {
        self.flat().is_some()
    }

    /// Flat ZeRO-1: this rank's share of a full optimizer state ([`FlatShard::shard_state`]),
    /// named after [`Self::optimizer_params`]. `None` otherwise (the state applies as is).
    fn shard_state(
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

    /// The backward of one micro-batch's `scaled_loss` ([`crate::grad_sink::backward`]). At a
    /// window's last micro-batch (`micro.closes_window`) with a collective of more than one
    /// rank, the window's [`Reduction`] begins first (from `grads`, the window so far, and
    /// `micro.weight`), and with [`DdpConfig::overlap`] its buckets start during the backward
    /// as their gradients become final; it is returned for [`Self::finish_window`]. `None`
    /// otherwise.
    ///
    /// Errors: beginning the reduction, the backward's, or a bucket's all-reduce. A gradient
    /// that changed after its bucket started is not an error here: the window is skipped on
    /// every rank ([`Reduction::after_backward`]).
    pub fn backward(
        &mut self,
        scaled_loss: &Tensor,
        params: &[Param],
        grads: &GradBuffers,
        micro: MicroBatch,
    ) -> Result<(GradStore, Option<Reduction>)> {
        let mut reduction = match (micro.closes_window, self.ddp()) {
            (true, Some(d)) => {
                Reduction::begin(d, self.flat(), params, grads, micro.weight, micro.keep_raw)?
            }
            _ => None,
        };
        let grads = self.backward_reducing(scaled_loss, reduction.as_mut())?;
        Ok((grads, reduction))
    }

    /// The backward; with a `reduction` and [`DdpConfig::overlap`], its buckets start as their
    /// gradients become final.
    fn backward_reducing(
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

    /// At the boundary: replaces the buffers by the global gradient ([`Reduction::finish`];
    /// flat ZeRO-1: this rank's segments of it), runs `check` on them (found_inf and the norm;
    /// its collective argument is flat ZeRO-1's, over whose ranks the sum of squares is
    /// summed, `None` otherwise), then makes every rank see the same statistics
    /// ([`Ddp::agree_stats`], on `device`), so that every rank skips together.
    ///
    /// Errors: the reduction's, `check`'s, or the agreement's collective.
    pub fn finish_window(
        &mut self,
        grads: &mut GradBuffers,
        reduction: Option<Reduction>,
        device: &Device,
        check: impl FnOnce(&mut GradBuffers, Option<&dyn Collective>) -> Result<GradStats>,
    ) -> Result<GradStats> {
        if let (Some(r), Some(d)) = (reduction, self.ddp()) {
            r.finish(d, self.flat(), grads)?;
        }
        let stats = check(grads, self.shards_gradients())?;
        match self.ddp_mut() {
            None => Ok(stats),
            Some(d) => d.agree_stats(stats, device),
        }
    }

    /// The update of one boundary: `step` runs the optimizer on the parameters this rank
    /// updates ([`Self::optimizer_params`]; flat ZeRO-1: its segments with their masters
    /// loaded) and returns whether it applied the update (`Some(true)`), skipped it
    /// (`Some(false)`) or left that on the device (`None`). An applied update refreshes the
    /// working copies from the masters ([`ParamStore::refresh_working_copies`]) unless
    /// `optimizer_wrote_working_copies`; then ZeRO-1 broadcasts (flat: all-gathers) the
    /// updated masters ([`Self::after_update`]).
    ///
    /// Errors: `step`'s, the refresh's, or a collective's.
    pub fn update(
        &self,
        params: &[Param],
        store: &ParamStore,
        optimizer_wrote_working_copies: bool,
        step: impl FnOnce(&[Param]) -> Result<Option<bool>>,
    ) -> Result<Option<bool>> {
        let updated = self.before_update(params)?;
        let applied = step(&updated)?;
        if applied == Some(true) && !optimizer_wrote_working_copies && !self.gathers_masters() {
            store.refresh_working_copies()?;
        }
        self.after_update(params)?;
        Ok(applied)
    }

    /// See [`Ddp::buckets_started_in_backward`]; `None` without a collective.
    pub fn buckets_started_in_backward(&self) -> Option<(usize, usize)> {
        self.ddp().and_then(Ddp::buckets_started_in_backward)
    }

    /// Hands `optimizer` its part of the parameters, right after [`Self::attach`]: ZeRO-1,
    /// the parameters this rank owns ([`Optimizer::set_owned`]); flat ZeRO-1, this rank's
    /// segments, whose state is cut from the state `optimizer` holds so far by the store's
    /// `params` (`applied`, the applied-step count, is asked for only then).
    ///
    /// Errors: reading or loading the optimizer state.
    pub fn adopt_optimizer(
        &self,
        optimizer: &mut dyn Optimizer,
        params: &[Param],
        applied: impl FnOnce() -> Result<u64>,
    ) -> Result<()> {
        optimizer.set_owned(self.owned());
        let Some(f) = self.flat() else {
            return Ok(());
        };
        let state = optimizer.state_tensors(params)?.into_iter().collect();
        let share = f.shard_state(params, &state)?;
        optimizer.load_state_tensors(f.params(), &share, applied()?)
    }

    /// The full optimizer state by name, as checkpoints save it: `optimizer`'s state over
    /// [`Self::optimizer_params`], gathered from every owner under ZeRO-1 ([`Self::gather_state`];
    /// collective: call it on every rank).
    pub fn gather_optimizer_state(
        &self,
        optimizer: &dyn Optimizer,
        params: &[Param],
    ) -> Result<Vec<(String, Tensor)>> {
        let local = optimizer.state_tensors(self.optimizer_params(params))?;
        self.gather_state(params, local, &optimizer.state_suffixes())
    }

    /// Loads a full optimizer state (by name, as [`Self::gather_optimizer_state`] returns it)
    /// into `optimizer`: under flat ZeRO-1 this rank's share of it ([`Self::shard_state`]),
    /// otherwise all of it; `applied` is the applied-step count.
    ///
    /// Errors: [`Optimizer::load_state_tensors`]'s (missing or mis-shaped entries); nothing
    /// changes then.
    pub fn load_optimizer_state(
        &self,
        optimizer: &mut dyn Optimizer,
        params: &[Param],
        full: &std::collections::HashMap<String, Tensor>,
        applied: u64,
    ) -> Result<()> {
        let share = self.shard_state(params, full)?;
        optimizer.load_state_tensors(
            self.optimizer_params(params),
            share.as_ref().unwrap_or(full),
            applied,
        )
    }

    /// ZeRO-1: which parameters this rank updates (`None`: every one).
    fn owned(&self) -> Option<Vec<bool>> {
        let GradSync::Zero1(d) = self else {
            return None;
        };
        let rank = d.collective().rank();
        d.owners().map(|o| o.iter().map(|&r| r == rank).collect())
    }

    /// After the optimizer step: ZeRO-1 owners broadcast their updated masters and the other
    /// ranks refresh those working copies; flat ZeRO-1 all-gathers every rank's range of the
    /// masters and refreshes every working copy. Nothing otherwise.
    fn after_update(&self, params: &[Param]) -> Result<()> {
        if let GradSync::Zero1Flat(d, f) = self {
            return f.gather_masters(d.collective(), params, || {
                params.iter().try_for_each(Param::refresh_working_copy)?;
                Ok(())
            });
        }
        let GradSync::Zero1(d) = self else {
            return Ok(());
        };
        let owners = d.owners().context("ZeRO-1 without a partition")?;
        super::zero::broadcast_owned(d.collective(), params, owners, |p| {
            Ok(p.refresh_working_copy()?)
        })
    }

    /// The full optimizer state from this rank's `local` share (ZeRO-1 gathers every owner's;
    /// collective: call it on every rank). Otherwise `local` as is.
    fn gather_state(
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

/// One micro-batch as the seam sees it ([`GradSync::backward`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MicroBatch {
    /// Its weight (finite, > 0): its sample or token count, say.
    pub weight: f64,
    /// The window holds this one micro-batch, whose raw gradient is kept as it is
    /// ([`GradBuffers::accumulate`]'s `keep_raw`).
    pub keep_raw: bool,
    /// It is the window's last: the optimizer step follows its backward.
    pub closes_window: bool,
}
