//! The optimizer driver: everything an optimizer over fp32 master weights needs besides its
//! arithmetic, written once.
//!
//! An optimizer is an [`UpdateRule`]: its hyper-parameters, the names of its per-parameter state
//! tensors, its per-step coefficients, its element update (host), its reference update (candle
//! ops) and its CUDA kernel. [`Driver`] does the rest, the same way for every rule:
//!
//! - the work list: parameters with a gradient, trainable and (under ZeRO-1) owned by this
//!   rank; empty ones get their (empty) state and step count, as in PyTorch, but no update pass
//!   (candle's in-place ops reject some zero-size layouts);
//! - validation of every row before anything changes, so a step refused by validation changes nothing (a
//!   runtime error during the update itself, e.g. out of memory, can leave it part-applied);
//! - state creation (zeros, f32, the parameter's shape) at a parameter's first gradient;
//! - per-parameter step counts, as `torch.optim` counts them: a parameter's `t` counts the
//!   applied steps in which it had a gradient (on the host, or an `i64` device tensor on the
//!   fused CUDA path, counted by a kernel that reads found_inf, so nothing waits);
//! - named state tensors (`"{param}.{name}"`, `"{param}.step"` as an exact `i64`) for
//!   checkpoints, and their restore.
//!
//! Adding an optimizer is one file with its rule plus one kernel.

use super::host::host_update;
pub use super::rule::UpdateRule;
use super::state::{read_step, Buf, StepCounts};
use super::{Impl, Optimizer, StepInputs};
use crate::grads::{GradStats, HostStats};
use crate::params::Param;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;
use std::collections::HashMap;

/// An optimizer over fp32 masters: an [`UpdateRule`] run by the shared driver, on the
/// implementation chosen at construction (see [`super::OptimPath::resolve`]).
pub struct Driver<R: UpdateRule> {
    rule: R,
    imp: Impl,
    /// State tensors per parameter (store order), `None` until its first gradient.
    states: Vec<Option<Vec<Buf>>>,
    steps: StepCounts,
    /// ZeRO-1: the parameters this rank updates (`None`: all).
    owned: Option<Vec<bool>>,
}

impl<R: UpdateRule> Driver<R> {
    /// An optimizer with hyper-parameters `rule` running implementation `imp`. Errors when the
    /// hyper-parameters are out of range.
    pub fn new(rule: R, imp: Impl) -> Result<Self> {
        rule.validate()?;
        Ok(Self {
            steps: StepCounts::new(imp),
            rule,
            imp,
            states: Vec::new(),
            owned: None,
        })
    }

    /// The implementation in use.
    pub fn implementation(&self) -> Impl {
        self.imp
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &R {
        &self.rule
    }

    /// The parameters to update this step ([`super::work::work_list`]).
    fn work_list(&self, params: &[Param], grads: &[Option<Tensor>]) -> Result<Vec<usize>> {
        super::work::work_list(R::NAME, params, grads, self.owned.as_deref())
    }

    /// Creates zero state for every work-list parameter that has none yet.
    fn ensure_states(&mut self, params: &[Param], work: &[usize]) -> Result<()> {
        if self.states.len() < params.len() {
            self.states.resize_with(params.len(), || None);
        }
        let n = self.rule.state_names().len();
        for &i in work {
            if self.states[i].is_none() {
                let bufs = (0..n)
                    .map(|_| Buf::zeros(self.imp, &params[i]))
                    .collect::<Result<Vec<_>>>()?;
                self.states[i] = Some(bufs);
            }
        }
        Ok(())
    }

    fn host_step(
        &mut self,
        params: &[Param],
        grads: &[Option<Tensor>],
        work: &[usize],
        h: HostStats,
        lr: f64,
    ) -> Result<()> {
        let StepCounts::Host(steps) = &mut self.steps else {
            bail!("{}: host step on a device step counter", R::NAME)
        };
        steps.resize(params.len().max(steps.len()), 0);
        let rule = &self.rule;
        let coeffs = |i: usize| {
            let p = &params[i];
            let lr = lr * p.options.lr_scale;
            rule.coeffs(steps[i] + 1, lr, p.options.weight_decay, h.multiplier)
        };
        let ks: Vec<R::Coeffs> = work.iter().map(|&i| coeffs(i)).collect();
        let firsts: Vec<bool> = work.iter().map(|&i| steps[i] == 0).collect();
        // disjoint mutable state of the work-list parameters
        let mut slots: Vec<(usize, &mut Vec<Buf>)> = self
            .states
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| Some((i, s.as_mut()?)))
            .filter(|(i, _)| work.binary_search(i).is_ok())
            .collect();
        // empty parameters: state and count, no pass over zero elements
        let nonempty: Vec<bool> = slots
            .iter()
            .map(|(i, _)| params[*i].elem_count() > 0)
            .collect();
        match self.imp {
            Impl::FusedCpu => slots
                .par_iter_mut()
                .zip(ks.par_iter().zip(firsts.par_iter()))
                .zip(nonempty.par_iter())
                .filter(|(_, &n)| n)
                .try_for_each(|(((i, bufs), (k, first)), _)| {
                    host_update::<R>(&params[*i], grad(grads, *i)?, bufs, k, *first)
                })?,
            _ => {
                for (((i, bufs), (k, first)), _) in slots
                    .iter_mut()
                    .zip(ks.iter().zip(&firsts))
                    .zip(&nonempty)
                    .filter(|(_, &n)| n)
                {
                    let p = &params[*i];
                    let g = grad(grads, *i)?.to_dtype(DType::F32)?;
                    let mut ts = bufs
                        .iter()
                        .map(|b| b.tensor().cloned())
                        .collect::<Result<Vec<_>>>()?;
                    let new_p = R::update_reference(
                        k,
                        &p.master.as_detached_tensor(),
                        &g,
                        &mut ts,
                        *first,
                    )?;
                    p.master.set(&new_p)?;
                    for (b, t) in bufs.iter_mut().zip(ts) {
                        *b = Buf::Tensor(t);
                    }
                }
            }
        }
        for &i in work {
            steps[i] += 1;
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn device_step(
        &mut self,
        params: &[Param],
        grads: &[Option<Tensor>],
        work: &[usize],
        stats: &Tensor,
        inputs: &StepInputs,
    ) -> Result<()> {
        let StepCounts::Device { counts, index } = &mut self.steps else {
            bail!("{}: device step on a host step counter", R::NAME)
        };
        let dev = stats.device();
        let have = counts.as_ref().map_or(0, |c| c.elem_count());
        if have < params.len() {
            let more = Tensor::zeros(params.len() - have, DType::I64, dev)?;
            *counts = Some(match counts.take() {
                Some(c) => Tensor::cat(&[&c, &more], 0)?,
                None => more,
            });
        }
        let counts = counts.as_ref().expect("allocated above");
        let idx: Vec<u32> = work.iter().map(|&i| i as u32).collect();
        if index.as_ref().is_none_or(|(v, _)| *v != idx) {
            let t = Tensor::new(idx.as_slice(), dev)?;
            *index = Some((idx, t));
        }
        let (_, idx_t) = index.as_ref().expect("set above");
        let seed = inputs.seed;
        let seed = (seed as u32) ^ ((seed >> 32) as u32).wrapping_mul(0x9E37_79B9);
        let rounding = crate::cuda::update::Rounding {
            seed,
            stochastic: i32::from(inputs.stochastic_rounding),
        };
        // one launch set per learning-rate group (the rate is a kernel argument)
        let mut scales: Vec<f64> = work.iter().map(|&i| params[i].options.lr_scale).collect();
        scales.sort_by(f64::total_cmp);
        scales.dedup();
        for scale in scales {
            let mut rows = Vec::with_capacity(work.len());
            for &i in work
                .iter()
                .filter(|&&i| params[i].options.lr_scale == scale)
            {
                let bufs = self.states[i].as_ref().expect("created by ensure_states");
                let mut st = [None, None];
                for (s, b) in st.iter_mut().zip(bufs) {
                    *s = Some(b.tensor()?);
                }
                rows.push(crate::cuda::update::Row {
                    param: &params[i],
                    grad: grad(grads, i)?,
                    states: st,
                    index: i,
                });
            }
            let args = self.rule.kernel_args(inputs.lr * scale, rounding);
            crate::cuda::update::launch(&R::KERNEL, &rows, stats, counts, &args)?;
        }
        crate::cuda::update::count_steps(counts, idx_t, stats)
    }
}

fn grad(grads: &[Option<Tensor>], i: usize) -> Result<&Tensor> {
    grads[i]
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("parameter {i} is in the work list without a gradient"))
}

/// Stats as the device kernels read them (`[found_inf, norm, multiplier]`, f32).
#[cfg(feature = "cuda")]
fn device_stats(stats: &GradStats, device: &Device) -> Result<Tensor> {
    Ok(match stats {
        GradStats::Device(t) => t.clone(),
        GradStats::Host(h) => Tensor::new(
            &[
                f32::from(u8::from(h.found_inf)),
                h.norm as f32,
                h.multiplier as f32,
            ],
            device,
        )?,
    })
}

impl<R: UpdateRule> Optimizer for Driver<R> {
    fn step(
        &mut self,
        params: &[Param],
        grads: &[Option<Tensor>],
        inputs: StepInputs,
    ) -> Result<Option<bool>> {
        if grads.len() != params.len() {
            bail!(
                "{}::step: {} gradient slots for {} parameters",
                R::NAME,
                grads.len(),
                params.len()
            );
        }
        let work = self.work_list(params, grads)?;
        if let GradStats::Host(h) = inputs.stats {
            if h.found_inf {
                return Ok(Some(false));
            }
        }
        self.ensure_states(params, &work)?;
        match (self.imp, inputs.stats) {
            #[cfg(feature = "cuda")]
            (Impl::FusedCuda, stats) => {
                let Some(first) = work.first() else {
                    return Ok(match stats {
                        GradStats::Host(_) => Some(true),
                        GradStats::Device(_) => None,
                    });
                };
                let dev = params[*first].master.device().clone();
                let t = device_stats(stats, &dev)?;
                self.device_step(params, grads, &work, &t, &inputs)?;
                Ok(match stats {
                    GradStats::Host(_) => Some(true),
                    GradStats::Device(_) => None,
                })
            }
            (_, GradStats::Host(h)) => {
                self.host_step(params, grads, &work, *h, inputs.lr)?;
                Ok(Some(true))
            }
            (imp, _) => bail!(
                "{}: implementation {imp:?} with device statistics is not available in this \
                 build",
                R::NAME
            ),
        }
    }

    fn check(&self, params: &[Param], grads: &[Option<Tensor>], _: &StepInputs) -> Result<()> {
        self.work_list(params, grads).map(|_| ())
    }

    fn writes_working_copies(&self) -> bool {
        self.imp == Impl::FusedCuda
    }

    fn set_owned(&mut self, owned: Option<Vec<bool>>) {
        self.owned = owned;
    }

    fn state_tensors(&self, params: &[Param]) -> Result<Vec<(String, Tensor)>> {
        let steps = self.steps.read(params.len())?;
        let names = self.rule.state_names();
        let mut out = Vec::new();
        for (i, (p, s)) in params.iter().zip(&self.states).enumerate() {
            let Some(bufs) = s else { continue };
            for (n, b) in names.iter().zip(bufs) {
                out.push((format!("{}.{n}", p.name), b.to_tensor(p)?));
            }
            let step = Tensor::new(&[steps[i] as i64], p.master.device())?;
            out.push((format!("{}.step", p.name), step));
        }
        Ok(out)
    }

    fn state_suffixes(&self) -> Vec<&'static str> {
        let mut v = self.rule.state_names().to_vec();
        v.push("step");
        v
    }

    fn load_state_tensors(
        &mut self,
        params: &[Param],
        tensors: &HashMap<String, Tensor>,
        applied_steps: u64,
    ) -> Result<()> {
        let names = self.rule.state_names();
        let mut states = Vec::with_capacity(params.len());
        let mut steps = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            let owned = self.owned.as_ref().is_none_or(|o| o.get(i) == Some(&true));
            let step_key = format!("{}.step", p.name);
            let has_state = names
                .iter()
                .any(|n| tensors.contains_key(&format!("{}.{n}", p.name)));
            if !owned || (!has_state && !tensors.contains_key(&step_key)) {
                states.push(None); // never stepped (no gradient yet, frozen), or not this rank's
                steps.push(0);
                continue;
            }
            let mut step = match tensors.get(&step_key) {
                Some(t) => read_step(t, &step_key)?,
                // checkpoints of the fused CUDA path before per-parameter counts
                None => applied_steps,
            };
            let mut bufs = Vec::with_capacity(names.len());
            for n in names {
                let key = format!("{}.{n}", p.name);
                if !has_state {
                    // a state the checkpoint's optimizer did not keep (SGD saved without
                    // momentum): it starts fresh, and the next step initialises it
                    bufs.push(Buf::zeros(self.imp, p)?);
                    step = 0;
                    continue;
                }
                let t = super::state_tensor(tensors, &key, p.master.shape(), p.master.device())?;
                bufs.push(Buf::from_tensor(self.imp, t)?);
            }
            states.push(Some(bufs));
            steps.push(step);
        }
        let device = params
            .first()
            .map_or(Device::Cpu, |p| p.master.device().clone());
        self.steps.set(steps, &device)?;
        self.states = states;
        Ok(())
    }
}
