//! The driver of the whole-tensor rule kind ([`TensorRule`]): one whole parameter at a time,
//! in candle ops on the parameter's device.
//!
//! Per step: the work list and every parameter checked before anything changes
//! ([`super::work::work_list`], [`TensorRule::check`]); state created (zeros, f32, the
//! parameter's shape) at a parameter's first gradient, as `torch.optim` creates it lazily;
//! the gradient multiplied by the engine's multiplier (unscale × clip); the rule's update; the
//! new master and its working copy written. With statistics on the device (the fused CUDA
//! path) nothing is read back: the multiplier is a device scalar and found_inf selects, element
//! by element, the old master and state over the new ones (`where_cond`), so a skipped step
//! leaves everything as it was without the host waiting. No per-parameter step count is kept
//! (Muon's update does not depend on one; `torch.optim.Muon` keeps none either).

use super::rule::TensorRule;
use super::{Optimizer, StepInputs};
use crate::grads::GradStats;
use crate::params::Param;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use std::collections::HashMap;

/// An optimizer over fp32 masters made of one [`TensorRule`]; see the module docs.
pub struct TensorDriver<R: TensorRule> {
    rule: R,
    /// State tensors per parameter (store order), `None` until its first gradient.
    states: Vec<Option<Vec<Tensor>>>,
    /// ZeRO-1: the parameters this rank updates (`None`: all).
    owned: Option<Vec<bool>>,
}

/// The gradient multiplier and the skip flag of one step, where the statistics live.
enum Gate {
    /// Host statistics: the multiplier as a number (a found_inf step never gets here).
    Host(f64),
    /// Device statistics: the multiplier `(1,)` f32 and found_inf as a `(1,)` u8 mask.
    Device { mult: Tensor, skip: Tensor },
}

impl<R: TensorRule> TensorDriver<R> {
    /// An optimizer with hyper-parameters `rule`. Errors when they are out of range.
    pub fn new(rule: R) -> Result<Self> {
        rule.validate()?;
        Ok(Self {
            rule,
            states: Vec::new(),
            owned: None,
        })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &R {
        &self.rule
    }

    fn work_list(
        &self,
        params: &[Param],
        grads: &[Option<Tensor>],
        inputs: &StepInputs,
    ) -> Result<Vec<usize>> {
        let work = super::work::work_list(R::NAME, params, grads, self.owned.as_deref())?;
        for &i in &work {
            self.rule.check(&params[i])?;
        }
        if inputs.stochastic_rounding && !work.is_empty() {
            bail!(
                "{}: stochastic rounding of the working copies is not supported by whole-tensor \
                 rules (they round to nearest); turn EngineConfig::stochastic_rounding off",
                R::NAME
            );
        }
        Ok(work)
    }

    /// One parameter: the rule's update, gated by found_inf on the device, written back.
    fn update_one(&mut self, p: &Param, i: usize, g: &Tensor, lr: f64, gate: &Gate) -> Result<()> {
        let master = p.master.as_detached_tensor();
        let g = g.to_dtype(DType::F32)?.reshape(master.shape())?;
        let g = match gate {
            Gate::Host(m) => (g * *m)?,
            Gate::Device { mult, .. } => g.broadcast_mul(mult)?,
        };
        // the state is written back only once the whole update has succeeded
        let old = self.states[i].clone().unwrap_or_default();
        let mut new = old.clone();
        let lr = lr * p.options.lr_scale;
        let updated = self
            .rule
            .update(&master, &g, &mut new, lr, p.options.weight_decay);
        let mut new_master = updated?;
        if let Gate::Device { skip, .. } = gate {
            let keep = skip.broadcast_as(master.shape())?;
            new_master = keep.where_cond(&master, &new_master)?;
            for (n, o) in new.iter_mut().zip(&old) {
                *n = keep.where_cond(o, n)?;
            }
        }
        p.master.set(&new_master)?;
        if let Some(w) = &p.working {
            w.set(&new_master.to_dtype(w.dtype())?)?;
        }
        self.states[i] = Some(new);
        Ok(())
    }
}

impl<R: TensorRule> Optimizer for TensorDriver<R> {
    fn step(
        &mut self,
        params: &[Param],
        grads: &[Option<Tensor>],
        inputs: StepInputs,
    ) -> Result<Option<bool>> {
        let work = self.work_list(params, grads, &inputs)?;
        let gate = match inputs.stats {
            GradStats::Host(h) if h.found_inf => return Ok(Some(false)),
            GradStats::Host(h) => Gate::Host(h.multiplier),
            GradStats::Device(t) => Gate::Device {
                mult: t.narrow(0, 2, 1)?.to_dtype(DType::F32)?,
                skip: t.narrow(0, 0, 1)?.gt(0.0)?,
            },
        };
        if self.states.len() < params.len() {
            self.states.resize_with(params.len(), || None);
        }
        for &i in &work {
            let p = &params[i];
            if self.states[i].is_none() {
                let zeros = (0..self.rule.state_names().len())
                    .map(|_| p.master.zeros_like())
                    .collect::<candle_core::Result<Vec<_>>>()?;
                self.states[i] = Some(zeros);
            }
            if p.elem_count() == 0 {
                continue; // state as PyTorch creates it, no update of zero elements
            }
            let g = grads[i].as_ref().expect("in the work list");
            self.update_one(p, i, g, inputs.lr, &gate)?;
        }
        Ok(match gate {
            Gate::Host(_) => Some(true),
            Gate::Device { .. } => None,
        })
    }

    fn check(&self, params: &[Param], grads: &[Option<Tensor>], inputs: &StepInputs) -> Result<()> {
        self.work_list(params, grads, inputs).map(|_| ())
    }

    fn needs_whole_tensors(&self) -> bool {
        true
    }

    fn writes_working_copies(&self) -> bool {
        true
    }

    fn set_owned(&mut self, owned: Option<Vec<bool>>) {
        self.owned = owned;
    }

    fn state_tensors(&self, params: &[Param]) -> Result<Vec<(String, Tensor)>> {
        let names = self.rule.state_names();
        let mut out = Vec::new();
        for (p, s) in params.iter().zip(&self.states) {
            for (n, t) in names.iter().zip(s.iter().flatten()) {
                out.push((format!("{}.{n}", p.name), t.clone()));
            }
        }
        Ok(out)
    }

    fn state_suffixes(&self) -> Vec<&'static str> {
        self.rule.state_names().to_vec()
    }

    fn load_state_tensors(
        &mut self,
        params: &[Param],
        tensors: &HashMap<String, Tensor>,
        _applied_steps: u64,
    ) -> Result<()> {
        let names = self.rule.state_names();
        let mut states = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            let owned = self.owned.as_ref().is_none_or(|o| o.get(i) == Some(&true));
            let has_state = names
                .iter()
                .any(|n| tensors.contains_key(&format!("{}.{n}", p.name)));
            if !owned || !has_state {
                states.push(None); // never stepped, or not this rank's
                continue;
            }
            let bufs = names
                .iter()
                .map(|n| {
                    let key = format!("{}.{n}", p.name);
                    let t =
                        super::state_tensor(tensors, &key, p.master.shape(), p.master.device())?;
                    Ok(t.copy()?) // its own storage: the step replaces it, never aliases
                })
                .collect::<Result<Vec<_>>>()?;
            states.push(Some(bufs));
        }
        self.states = states;
        Ok(())
    }
}
