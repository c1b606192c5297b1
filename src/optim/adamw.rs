//! AdamW: Adam with decoupled weight decay (Loshchilov & Hutter, "Decoupled Weight Decay
//! Regularization", ICLR 2019), with the semantics of `torch.optim.AdamW`:
//! ```text
//! t  = t + 1                                  # per-parameter step
//! p  = p * (1 - lr * weight_decay)            # decoupled decay (only decayed groups)
//! m  = beta1 * m + (1 - beta1) * g            # first moment (exp_avg)
//! v  = beta2 * v + (1 - beta2) * g^2          # second moment (exp_avg_sq)
//! p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//! ```
//! `g` is the fp32 gradient buffer times the engine's multiplier (unscale × clip). State is
//! fp32 whatever the compute dtype.

use super::{Impl, Optimizer, StepInputs};
use crate::grads::with_cpu_f32;
use crate::params::Param;
use anyhow::{bail, Result};
use candle_core::{CpuStorage, DType, Layout, Tensor};
use rayon::prelude::*;
use std::sync::Mutex;

/// AdamW hyper-parameters; defaults are `torch.optim.AdamW`'s.
#[derive(Debug, Clone, PartialEq)]
pub struct AdamWConfig {
    /// Base learning rate (the schedule overrides it per step). Default 1e-3.
    pub lr: f64,
    /// First-moment decay. Default 0.9.
    pub beta1: f64,
    /// Second-moment decay. Default 0.999.
    pub beta2: f64,
    /// Denominator term. Default 1e-8.
    pub eps: f64,
    /// Decoupled weight decay for decayed groups. Default 0.01.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

impl AdamWConfig {
    /// Checks ranges: betas in [0, 1), eps > 0, weight_decay >= 0.
    pub fn validate(&self) -> Result<()> {
        for (n, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            anyhow::ensure!(
                (0.0..1.0).contains(&b),
                "AdamW {n} must be in [0, 1), got {b}"
            );
        }
        anyhow::ensure!(self.eps > 0.0, "AdamW eps must be > 0, got {}", self.eps);
        anyhow::ensure!(self.weight_decay >= 0.0, "AdamW weight_decay must be >= 0");
        Ok(())
    }
}

/// Per-parameter state: moments and step count.
enum Moments {
    /// candle tensors (reference path).
    Tensors { m: Tensor, v: Tensor },
    /// host vectors updated in place by the fused CPU pass.
    Host { m: Vec<f32>, v: Vec<f32> },
}

struct State {
    step: u64,
    moments: Moments,
}

/// AdamW over fp32 masters, reference or fused.
pub struct AdamW {
    config: AdamWConfig,
    imp: Impl,
    states: Vec<Option<State>>,
}

impl AdamW {
    /// An optimizer running implementation `imp` (see [`super::OptimPath::resolve`]).
    /// Errors when the configuration is out of range.
    pub fn new(config: AdamWConfig, imp: Impl) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            config,
            imp,
            states: Vec::new(),
        })
    }

    /// The implementation in use.
    pub fn implementation(&self) -> Impl {
        self.imp
    }
}

/// Zero moments for `p`: host vectors on the fused CPU path, device tensors otherwise.
fn new_state(imp: Impl, p: &Param) -> Result<State> {
    let moments = if imp == Impl::FusedCpu {
        let n = p.elem_count();
        Moments::Host {
            m: vec![0.0; n],
            v: vec![0.0; n],
        }
    } else {
        // two allocations: the fused CUDA kernel writes both in place
        Moments::Tensors {
            m: p.master.zeros_like()?,
            v: p.master.zeros_like()?,
        }
    };
    Ok(State { step: 0, moments })
}

/// Scalars of one parameter's update, rounded to f32 once so that the reference and fused
/// paths perform bit-identical arithmetic (same constants, same operation order).
#[derive(Clone, Copy)]
struct Coeffs {
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    eps: f32,
    /// `1 - lr * weight_decay` (1 for groups without decay).
    decay: f32,
    /// `lr / (1 - beta1^t)`.
    step_size: f32,
    /// `1 / sqrt(1 - beta2^t)`.
    inv_bc2_sqrt: f32,
    grad_mult: f32,
}

impl Coeffs {
    fn new(c: &AdamWConfig, t: u64, lr: f64, decayed: bool, grad_mult: f64) -> Self {
        let wd = if decayed { c.weight_decay } else { 0.0 };
        let t = t.min(i32::MAX as u64) as i32;
        Self {
            beta1: c.beta1 as f32,
            one_minus_beta1: (1.0 - c.beta1) as f32,
            beta2: c.beta2 as f32,
            one_minus_beta2: (1.0 - c.beta2) as f32,
            eps: c.eps as f32,
            decay: (1.0 - lr * wd) as f32,
            step_size: (lr / (1.0 - c.beta1.powi(t))) as f32,
            inv_bc2_sqrt: (1.0 / (1.0 - c.beta2.powi(t)).sqrt()) as f32,
            grad_mult: grad_mult as f32,
        }
    }
}

impl Optimizer for AdamW {
    fn step(
        &mut self,
        params: &[Param],
        grads: &[Option<Tensor>],
        inputs: StepInputs,
    ) -> Result<Option<bool>> {
        // the fused CUDA path decides on the device; the others read found_inf here
        let host = match super::begin_step(
            "AdamW",
            self.imp,
            params,
            grads,
            &mut self.states,
            inputs.stats,
            |p| new_state(self.imp, p),
        )? {
            super::Begin::Skip => return Ok(Some(false)),
            super::Begin::Run(h) => h,
        };
        let config = self.config.clone();
        let lr = inputs.lr;
        let work = super::work_list(params, grads, &mut self.states);
        match (self.imp, host) {
            #[cfg(feature = "cuda")]
            (Impl::FusedCuda, _) => {
                let amp = inputs.amp_state.ok_or_else(|| {
                    anyhow::anyhow!("fused CUDA AdamW needs the engine's amp_state")
                })?;
                let stats = inputs
                    .stats
                    .tensor()
                    .ok_or_else(|| anyhow::anyhow!("fused CUDA AdamW needs device stats"))?;
                let rows = work
                    .into_iter()
                    .map(|(p, g, s)| match &s.moments {
                        Moments::Tensors { m, v } => Ok(crate::cuda::adamw::Row {
                            param: p,
                            grad: g,
                            m,
                            v,
                        }),
                        Moments::Host { .. } => bail!("AdamW state/path mismatch"),
                    })
                    .collect::<Result<Vec<_>>>()?;
                crate::cuda::adamw::step(
                    &rows,
                    stats,
                    amp,
                    &config,
                    lr,
                    inputs.seed,
                    inputs.stochastic_rounding,
                )?;
                return Ok(None);
            }
            (Impl::FusedCpu, Some(h)) => work.into_par_iter().try_for_each(|(p, g, s)| {
                s.step += 1;
                let k = Coeffs::new(&config, s.step, lr, p.options.weight_decay, h.multiplier);
                fused_update(p, g, s, k)
            })?,
            (Impl::Reference, Some(h)) => {
                for (p, g, s) in work {
                    s.step += 1;
                    let k = Coeffs::new(&config, s.step, lr, p.options.weight_decay, h.multiplier);
                    reference_update(p, g, s, k)?;
                }
            }
            (imp, _) => bail!("AdamW: implementation {imp:?} is not available in this build"),
        }
        Ok(Some(true))
    }

    fn writes_working_copies(&self) -> bool {
        self.imp == Impl::FusedCuda
    }

    fn state_tensors(&self, params: &[Param]) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (p, s) in params.iter().zip(&self.states) {
            let Some(s) = s else { continue };
            let (m, v) = match &s.moments {
                Moments::Tensors { m, v } => (m.clone(), v.clone()),
                Moments::Host { m, v } => (
                    Tensor::from_slice(m, p.master.shape(), p.master.device())?,
                    Tensor::from_slice(v, p.master.shape(), p.master.device())?,
                ),
            };
            out.push((format!("{}.exp_avg", p.name), m));
            out.push((format!("{}.exp_avg_sq", p.name), v));
            if self.imp != Impl::FusedCuda {
                // the fused CUDA path counts steps once, on the device (Engine::optimizer_steps)
                let step = Tensor::new(&[s.step as f32], p.master.device())?;
                out.push((format!("{}.step", p.name), step));
            }
        }
        Ok(out)
    }

    fn state_suffixes(&self) -> &'static [&'static str] {
        &["exp_avg", "exp_avg_sq", "step"]
    }

    fn load_state_tensors(
        &mut self,
        params: &[Param],
        tensors: &std::collections::HashMap<String, Tensor>,
        applied_steps: u64,
    ) -> Result<()> {
        let mut states = Vec::with_capacity(params.len());
        for p in params {
            let key = format!("{}.exp_avg", p.name);
            if !tensors.contains_key(&key) {
                states.push(None); // never stepped (no gradient yet, or frozen)
                continue;
            }
            let dev = p.master.device();
            let m = super::state_tensor(tensors, &key, p.master.shape(), dev)?;
            let v = super::state_tensor(
                tensors,
                &format!("{}.exp_avg_sq", p.name),
                p.master.shape(),
                dev,
            )?;
            let step = match tensors.get(&format!("{}.step", p.name)) {
                Some(t) => t
                    .flatten_all()?
                    .to_dtype(DType::F64)?
                    .to_vec1::<f64>()?
                    .first()
                    .copied()
                    .unwrap_or(0.0) as u64,
                None => applied_steps,
            };
            let moments = if self.imp == Impl::FusedCpu {
                Moments::Host {
                    m: m.flatten_all()?.to_vec1()?,
                    v: v.flatten_all()?.to_vec1()?,
                }
            } else {
                // fresh allocations: the fused CUDA kernel writes them in place
                Moments::Tensors {
                    m: m.copy()?,
                    v: v.copy()?,
                }
            };
            states.push(Some(State { step, moments }));
        }
        self.states = states;
        Ok(())
    }
}

/// Reference update in candle tensor ops (f32).
fn reference_update(p: &Param, g: &Tensor, s: &mut State, k: Coeffs) -> Result<()> {
    let Moments::Tensors { m, v } = &mut s.moments else {
        bail!("AdamW state/path mismatch")
    };
    if p.elem_count() == 0 {
        return Ok(()); // candle's ops return empty tensors that alias their input
    }
    let g = (g.to_dtype(DType::F32)? * k.grad_mult as f64)?;
    *m = ((&*m * k.beta1 as f64)? + (&g * k.one_minus_beta1 as f64)?)?;
    *v = ((&*v * k.beta2 as f64)? + (g.sqr()? * k.one_minus_beta2 as f64)?)?;
    let denom = v.sqrt()?.affine(k.inv_bc2_sqrt as f64, k.eps as f64)?;
    let p_new = ((p.master.as_detached_tensor() * k.decay as f64)?
        - ((&*m / denom)? * k.step_size as f64)?)?;
    p.master.set(&p_new)?;
    Ok(())
}

/// The fused CPU update: one pass over each element of p, g, m, v.
fn fused_update(p: &Param, g: &Tensor, s: &mut State, k: Coeffs) -> Result<()> {
    let Moments::Host { m, v } = &mut s.moments else {
        bail!("AdamW state/path mismatch")
    };
    with_cpu_f32(g, |g| {
        let op = FusedAdamW {
            g,
            mv: Mutex::new((m.as_mut_slice(), v.as_mut_slice())),
            k,
        };
        p.master.as_tensor().inplace_op1(&op)
    })??;
    Ok(())
}

struct FusedAdamW<'a> {
    g: &'a [f32],
    mv: Mutex<(&'a mut [f32], &'a mut [f32])>,
    k: Coeffs,
}

impl candle_core::InplaceOp1 for FusedAdamW<'_> {
    fn name(&self) -> &'static str {
        "wick-fused-adamw-cpu"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let p = super::master_slice(storage, layout, "AdamW")?;
        let mut guard = self
            .mv
            .lock()
            .map_err(|_| candle_core::Error::Msg("poisoned".into()))?;
        let (m, v) = &mut *guard;
        if p.len() != self.g.len() || m.len() != p.len() {
            candle_core::bail!(
                "fused AdamW: {} params, {} grads, {} moments",
                p.len(),
                self.g.len(),
                m.len()
            );
        }
        let k = self.k;
        const CHUNK: usize = 1 << 14;
        p.par_chunks_mut(CHUNK)
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .zip(self.g.par_chunks(CHUNK))
            .for_each(|(((p, m), v), g)| {
                for i in 0..p.len() {
                    let gi = g[i] * k.grad_mult; // unscaled, clipped gradient
                    m[i] = m[i] * k.beta1 + gi * k.one_minus_beta1; // first moment
                    v[i] = v[i] * k.beta2 + (gi * gi) * k.one_minus_beta2; // second moment
                    let denom = v[i].sqrt() * k.inv_bc2_sqrt + k.eps; // sqrt(v_hat) + eps
                    p[i] = p[i] * k.decay - (m[i] / denom) * k.step_size; // decoupled decay, Adam step
                }
            });
        Ok(())
    }
}
