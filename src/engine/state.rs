//! What a checkpoint saves and restores besides the parameters: the engine's counters and
//! loss-scaler state ([`EngineState`]) and the optimizer state, gathered from (and under flat
//! ZeRO-1 cut back into) the ranks' shares by the gradient-synchronisation seam.

use super::{Engine, EngineState};
use crate::params::Param;
use anyhow::{bail, Result};
use candle_core::Tensor;

impl Engine {
    /// The parameters the optimizer updates and keeps state for, as [`crate::optim::Optimizer::state_tensors`]
    /// takes them: the store's, or under flat ZeRO-1 this rank's segments
    /// (`"{param}[start..end]"`, 1-D; [`crate::dist::flat`]).
    pub fn optimizer_params(&self) -> Vec<Param> {
        let params = self.store.params();
        self.sync.optimizer_params(&params).to_vec()
    }

    /// The optimizer state by name (`"{param}.exp_avg"`, ..., `"{param}.step"`), as checkpoints
    /// save it. With ZeRO-1 every rank gathers the owners' state, so the result is the full
    /// state on every rank (collective: call it on every rank).
    pub fn optimizer_state(&self) -> Result<Vec<(String, Tensor)>> {
        self.sync
            .gather_optimizer_state(self.optimizer.as_ref(), &self.store.params())
    }

    /// The counters and scaler state (device reads on the fused CUDA path). Only meaningful at
    /// an accumulation boundary; errors in the middle of an accumulation window, and when the
    /// scaler state is one a checkpoint could not restore.
    pub fn state(&self) -> Result<EngineState> {
        if self.grads.micro_steps() != 0 {
            bail!(
                "Engine::state: {} micro-batches are accumulated; checkpoint at an accumulation \
                 boundary (or close the window with Engine::step_weighted_closing)",
                self.grads.micro_steps()
            );
        }
        let scaler = self.scaler_state()?;
        scaler.validate()?;
        Ok(EngineState {
            boundaries: self.boundaries,
            applied_steps: self.optimizer_steps()?,
            scaler,
        })
    }

    /// Restores counters, scaler state and optimizer state (see [`crate::optim::Optimizer::load_state_tensors`];
    /// under ZeRO-1 each rank keeps its share). Parameters are restored separately, into the
    /// store (then call [`crate::params::ParamStore::refresh_working_copies`]). Nothing changes when an error
    /// is returned.
    pub fn load_state(
        &mut self,
        state: &EngineState,
        optimizer: &std::collections::HashMap<String, Tensor>,
    ) -> Result<()> {
        state.scaler.validate()?;
        self.sync.load_optimizer_state(
            self.optimizer.as_mut(),
            &self.store.params(),
            optimizer,
            state.applied_steps,
        )?;
        self.amp.load(state.scaler, state.applied_steps)?;
        self.boundaries = state.boundaries;
        self.grads.clear();
        self.generation += 1;
        Ok(())
    }
}
