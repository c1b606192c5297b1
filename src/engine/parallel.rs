//! The engine's data-parallel surface: attaching a process group ([`Engine::with_collective`],
//! which hands the gradient synchronisation to [`GradSync`]) and what it reports. The step
//! itself reaches the seam through three calls (`backward`, `finish_window`, `update`; see
//! [`crate::dist::sync`]).

use super::Engine;
use crate::dist::{Collective, DdpConfig, GradSync};
use anyhow::{bail, Result};

impl Engine {
    /// Attaches a process group: checks that every rank has the same parameter layout,
    /// broadcasts rank 0's parameters to every rank, and from then on all-reduces the gradients
    /// at each accumulation boundary (in buckets, f32, weighted by the micro-batch weights of
    /// every rank) before clipping, the norm and found_inf, which are therefore global; every
    /// rank skips together. Call it on every rank, right after [`Engine::new`] (or after
    /// restoring a checkpoint, which every rank restores alike). World size 1: only the
    /// collective is stored; steps run exactly as without it.
    pub fn with_collective(
        mut self,
        collective: Box<dyn Collective>,
        config: DdpConfig,
    ) -> Result<Self> {
        if self.sync.collective().is_some() {
            bail!("Engine::with_collective: a collective is attached already");
        }
        if config.zero1
            && config.zero1_layout == crate::dist::Zero1Layout::Flat
            && self.optimizer.needs_whole_tensors()
        {
            bail!(
                "Engine::with_collective: the optimizer has a whole-tensor rule (Muon), which \
                 needs whole matrices, and the flat ZeRO-1 layout splits them; use \
                 Zero1Layout::Parameters (whole parameters per rank)"
            );
        }
        self.sync = GradSync::attach(
            collective,
            config,
            &self.store,
            self.grads.micro_steps(),
            self.config.stochastic_rounding,
        )?;
        let (sync, amp) = (&self.sync, &self.amp);
        sync.adopt_optimizer(self.optimizer.as_mut(), &self.store.params(), || {
            amp.applied_steps()
        })?;
        self.generation += 1;
        Ok(self)
    }

    /// The attached process group, if any.
    pub fn collective(&self) -> Option<&dyn Collective> {
        self.sync.collective()
    }

    /// Data parallelism: `(started, buckets)`, how many gradient buckets began their
    /// all-reduce during the last boundary's backward, overlapping it (the first boundary
    /// starts none: it learns when each gradient is final; [`crate::dist::reduce`]). `None`
    /// without a collective of more than one rank or with [`crate::dist::DdpConfig::overlap`]
    /// off.
    pub fn buckets_started_in_backward(&self) -> Option<(usize, usize)> {
        self.sync.buckets_started_in_backward()
    }
}
