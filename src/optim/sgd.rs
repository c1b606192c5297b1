//! SGD with momentum, dampening, Nesterov momentum and coupled (L2) weight decay, with the
//! semantics of `torch.optim.SGD` (Nesterov momentum in the form of Sutskever, Martens, Dahl &
//! Hinton, "On the importance of initialization and momentum in deep learning", ICML 2013, as
//! PyTorch writes it):
//! ```text
//! d = g                                         # fp32 gradient buffer × multiplier
//! if weight_decay != 0 (decayed groups only):
//!     d = d + weight_decay * p                  # coupled L2 decay, added to the gradient
//! if momentum != 0:
//!     if b is None:  b = d                      # first step: no dampening
//!     else:          b = momentum * b + (1 - dampening) * d
//!     if nesterov:   d = d + momentum * b
//!     else:          d = b
//! p = p - lr * d
//! ```
//! `g` is the fp32 gradient buffer times the engine's multiplier (unscale × clip). The momentum
//! buffer (`momentum_buffer`) is fp32 whatever the compute dtype; with `momentum == 0` there is
//! none, as in PyTorch. A step with found_inf changes nothing.
//!
//! Every implementation (candle reference, fused CPU, fused CUDA in kernels/sgd.cu) performs
//! the same f32 operations in the same order on the same f32 constants (`Coeffs`), so the
//! fused CPU path reproduces the reference bit for bit.

use super::{Impl, Optimizer, StepInputs};
use crate::grads::with_cpu_f32;
use crate::params::Param;
use anyhow::{bail, Result};
use candle_core::{CpuStorage, DType, Layout, Tensor};
use rayon::prelude::*;
use std::sync::Mutex;

/// SGD hyper-parameters; defaults are `torch.optim.SGD`'s (with `lr = 1e-3`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SgdConfig {
    /// Base learning rate (the schedule overrides it per step). Default 1e-3.
    pub lr: f64,
    /// Momentum factor (0: plain SGD, no buffer). Default 0.
    pub momentum: f64,
    /// Dampening of the gradient's contribution to the momentum buffer. Default 0.
    pub dampening: f64,
    /// Coupled L2 weight decay for decayed groups (added to the gradient). Default 0.
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`). Default false.
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

impl SgdConfig {
    /// SGD at `lr` with `momentum`, no dampening, no decay, no Nesterov.
    pub fn new(lr: f64, momentum: f64) -> Self {
        Self {
            lr,
            momentum,
            ..Self::default()
        }
    }

    /// Checks ranges as `torch.optim.SGD` does: lr, momentum and weight_decay finite and
    /// `>= 0`, dampening finite, and Nesterov only with `momentum > 0` and `dampening == 0`.
    pub fn validate(&self) -> Result<()> {
        for (n, v) in [
            ("lr", self.lr),
            ("momentum", self.momentum),
            ("weight_decay", self.weight_decay),
        ] {
            anyhow::ensure!(
                v.is_finite() && v >= 0.0,
                "SGD {n} must be finite and >= 0, got {v}"
            );
        }
        anyhow::ensure!(
            self.dampening.is_finite(),
            "SGD dampening must be finite, got {}",
            self.dampening
        );
        if self.nesterov {
            anyhow::ensure!(
                self.uses_momentum() && self.dampening == 0.0,
                "SGD nesterov requires momentum > 0 and dampening == 0 (got momentum {}, dampening {}); \
                 set nesterov = false or adjust them",
                self.momentum,
                self.dampening
            );
        }
        Ok(())
    }

    /// True when the update keeps a momentum buffer: the momentum is non-zero once rounded to
    /// f32 (the single test every implementation uses).
    pub fn uses_momentum(&self) -> bool {
        self.momentum as f32 != 0.0
    }
}

/// Scalars of one parameter's update, computed in f64 and rounded to f32 once, so that the
/// reference, fused CPU and fused CUDA paths perform bit-identical arithmetic (same constants,
/// same operation order).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Coeffs {
    pub lr: f32,
    pub momentum: f32,
    /// `1 - dampening`.
    pub one_minus_dampening: f32,
    /// The weight decay of this parameter's group (0 for groups without decay).
    pub weight_decay: f32,
    pub nesterov: bool,
    /// `unscale * clip`.
    pub grad_mult: f32,
}

impl Coeffs {
    pub(crate) fn new(c: &SgdConfig, lr: f64, decayed: bool, grad_mult: f64) -> Self {
        Self {
            lr: lr as f32,
            momentum: c.momentum as f32,
            one_minus_dampening: (1.0 - c.dampening) as f32,
            weight_decay: if decayed { c.weight_decay as f32 } else { 0.0 },
            nesterov: c.nesterov,
            grad_mult: grad_mult as f32,
        }
    }

    /// One element, in f32: the order of operations every implementation follows. Returns
    /// the new parameter value; `b` is the momentum buffer (ignored without momentum), `first`
    /// says that it has not been initialised yet.
    #[inline(always)]
    pub(crate) fn apply(&self, p: f32, b: &mut f32, g: f32, first: bool) -> f32 {
        let mut d = g * self.grad_mult; // unscaled, clipped gradient
        if self.weight_decay != 0.0 {
            d += p * self.weight_decay; // coupled L2 decay
        }
        if self.momentum != 0.0 {
            let buf = if first {
                d // first step: the buffer is the gradient, no dampening
            } else {
                *b * self.momentum + d * self.one_minus_dampening
            };
            *b = buf;
            d = if self.nesterov {
                d + buf * self.momentum
            } else {
                buf
            };
        }
        p - d * self.lr
    }
}

/// A parameter's momentum buffer, in the representation of the implementation.
enum Buffer {
    /// Not initialised yet (torch's `momentum_buffer is None`), or no momentum at all.
    Empty,
    /// candle tensor (reference path).
    Tensor(Tensor),
    /// Host vector updated in place by the fused CPU pass.
    Host(Vec<f32>),
    /// Device buffer written in place by kernels/sgd.cu. `first_at` is a `(1,)` f32 tensor
    /// holding the applied-step count (`amp_state[3]`) at which the buffer was created: while
    /// the device count still equals it, no step has been applied and the kernel initialises
    /// the buffer with the gradient (-1 for buffers loaded from a checkpoint). The host cannot
    /// tell without a synchronisation whether the creating step was skipped, so a checkpoint
    /// taken on this path before a parameter's first applied step stores a zero buffer that
    /// resumes as initialised (its next step uses `(1 - dampening) * d`: identical to PyTorch
    /// when dampening is 0).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Device { buf: Tensor, first_at: Tensor },
}

struct State {
    /// Applied steps of this parameter (host paths; the fused CUDA path counts on the device).
    step: u64,
    buf: Buffer,
}

/// SGD over fp32 masters, reference or fused.
pub struct Sgd {
    config: SgdConfig,
    imp: Impl,
    states: Vec<Option<State>>,
}

impl Sgd {
    /// An optimizer running implementation `imp` (see [`super::OptimPath::resolve`]).
    /// Errors when the configuration is out of range.
    pub fn new(config: SgdConfig, imp: Impl) -> Result<Self> {
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

    /// The configuration.
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }
}

impl Optimizer for Sgd {
    fn step(
        &mut self,
        params: &[Param],
        grads: &[Option<Tensor>],
        inputs: StepInputs,
    ) -> Result<Option<bool>> {
        // the fused CUDA path decides on the device; the others read found_inf here
        let host = match super::begin_step(
            "SGD",
            self.imp,
            params,
            grads,
            &mut self.states,
            inputs.stats,
            |_| {
                Ok(State {
                    step: 0,
                    buf: Buffer::Empty,
                })
            },
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
                    anyhow::anyhow!("fused CUDA SGD needs the engine's amp_state")
                })?;
                let stats = inputs
                    .stats
                    .tensor()
                    .ok_or_else(|| anyhow::anyhow!("fused CUDA SGD needs device stats"))?;
                let mut rows = Vec::with_capacity(work.len());
                for (p, g, s) in work {
                    if config.uses_momentum() && matches!(s.buf, Buffer::Empty) {
                        s.buf = Buffer::Device {
                            buf: p.master.zeros_like()?,
                            // the applied-step count now, before this step's kernel (stream order)
                            first_at: amp.narrow(0, 3, 1)?.copy()?,
                        };
                    }
                    let (buf, first_at) = match &s.buf {
                        Buffer::Device { buf, first_at } => (Some(buf), Some(first_at)),
                        Buffer::Empty => (None, None),
                        _ => bail!("SGD state/path mismatch"),
                    };
                    rows.push(crate::cuda::sgd::Row {
                        param: p,
                        grad: g,
                        buf,
                        first_at,
                    });
                }
                crate::cuda::sgd::step(
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
                let k = Coeffs::new(&config, lr, p.options.weight_decay, h.multiplier);
                fused_update(p, g, s, k)
            })?,
            (Impl::Reference, Some(h)) => {
                for (p, g, s) in work {
                    s.step += 1;
                    let k = Coeffs::new(&config, lr, p.options.weight_decay, h.multiplier);
                    reference_update(p, g, s, k)?;
                }
            }
            (imp, _) => bail!("SGD: implementation {imp:?} is not available in this build"),
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
            let buf = match &s.buf {
                Buffer::Empty => None,
                Buffer::Tensor(t) | Buffer::Device { buf: t, .. } => Some(t.clone()),
                Buffer::Host(v) => {
                    Some(Tensor::from_slice(v, p.master.shape(), p.master.device())?)
                }
            };
            if let Some(b) = buf {
                out.push((format!("{}.momentum_buffer", p.name), b));
            }
            if self.imp != Impl::FusedCuda {
                // the fused CUDA path counts steps once, on the device (Engine::optimizer_steps)
                let step = Tensor::new(&[s.step as f32], p.master.device())?;
                out.push((format!("{}.step", p.name), step));
            }
        }
        Ok(out)
    }

    fn state_suffixes(&self) -> &'static [&'static str] {
        &["momentum_buffer", "step"]
    }

    fn load_state_tensors(
        &mut self,
        params: &[Param],
        tensors: &std::collections::HashMap<String, Tensor>,
        applied_steps: u64,
    ) -> Result<()> {
        let mut states = Vec::with_capacity(params.len());
        for p in params {
            let buf_key = format!("{}.momentum_buffer", p.name);
            let step_key = format!("{}.step", p.name);
            let has_buf = tensors.contains_key(&buf_key);
            if !has_buf && !tensors.contains_key(&step_key) {
                states.push(None); // never stepped (no gradient yet, or frozen)
                continue;
            }
            let step = match tensors.get(&step_key) {
                Some(t) => t
                    .flatten_all()?
                    .to_dtype(DType::F64)?
                    .to_vec1::<f64>()?
                    .first()
                    .copied()
                    .unwrap_or(0.0) as u64,
                None => applied_steps,
            };
            let buf = if has_buf && self.config.uses_momentum() {
                let dev = p.master.device();
                let b = super::state_tensor(tensors, &buf_key, p.master.shape(), dev)?;
                match self.imp {
                    Impl::FusedCpu => Buffer::Host(b.flatten_all()?.to_vec1()?),
                    Impl::Reference => Buffer::Tensor(b),
                    // a fresh allocation: the kernel writes it in place; -1 = initialised
                    Impl::FusedCuda => Buffer::Device {
                        buf: b.copy()?,
                        first_at: Tensor::new(&[-1f32], dev)?,
                    },
                }
            } else {
                // momentum 0 (a buffer in the checkpoint is ignored, as PyTorch does), or
                // momentum without a buffer yet: the next step initialises it
                Buffer::Empty
            };
            states.push(Some(State { step, buf }));
        }
        self.states = states;
        Ok(())
    }
}

/// Reference update in candle tensor ops (f32), in [`Coeffs::apply`]'s order.
fn reference_update(p: &Param, g: &Tensor, s: &mut State, k: Coeffs) -> Result<()> {
    if p.elem_count() == 0 {
        // candle's ops return empty tensors that alias their input; the state still gets its
        // (empty) buffer, as on the fused path
        if k.momentum != 0.0 && matches!(s.buf, Buffer::Empty) {
            s.buf = Buffer::Tensor(p.master.zeros_like()?);
        }
        return Ok(());
    }
    let master = p.master.as_detached_tensor();
    let mut d = (g.to_dtype(DType::F32)? * k.grad_mult as f64)?;
    if k.weight_decay != 0.0 {
        d = (d + (&master * k.weight_decay as f64)?)?;
    }
    if k.momentum != 0.0 {
        let buf = match &s.buf {
            Buffer::Empty => d.clone(),
            Buffer::Tensor(b) => ((b * k.momentum as f64)? + (&d * k.one_minus_dampening as f64)?)?,
            _ => bail!("SGD state/path mismatch"),
        };
        d = if k.nesterov {
            (d + (&buf * k.momentum as f64)?)?
        } else {
            buf.clone()
        };
        s.buf = Buffer::Tensor(buf);
    }
    let p_new = (master - (d * k.lr as f64)?)?;
    p.master.set(&p_new)?;
    Ok(())
}

/// The fused CPU update: one pass over each element of p, g and the momentum buffer.
fn fused_update(p: &Param, g: &Tensor, s: &mut State, k: Coeffs) -> Result<()> {
    let first = match &s.buf {
        Buffer::Empty if k.momentum != 0.0 => {
            s.buf = Buffer::Host(vec![0.0; p.elem_count()]);
            true
        }
        Buffer::Empty | Buffer::Host(_) => false,
        _ => bail!("SGD state/path mismatch"),
    };
    let mut none: Vec<f32> = Vec::new();
    let buf = match &mut s.buf {
        Buffer::Host(b) => b.as_mut_slice(),
        _ => none.as_mut_slice(),
    };
    with_cpu_f32(g, |g| {
        let op = FusedSgd {
            g,
            buf: Mutex::new(buf),
            first,
            k,
        };
        p.master.as_tensor().inplace_op1(&op)
    })??;
    Ok(())
}

struct FusedSgd<'a> {
    g: &'a [f32],
    /// Momentum buffer (empty without momentum).
    buf: Mutex<&'a mut [f32]>,
    first: bool,
    k: Coeffs,
}

impl candle_core::InplaceOp1 for FusedSgd<'_> {
    fn name(&self) -> &'static str {
        "wick-fused-sgd-cpu"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let p = super::master_slice(storage, layout, "SGD")?;
        let mut guard = self
            .buf
            .lock()
            .map_err(|_| candle_core::Error::Msg("poisoned".into()))?;
        let buf: &mut [f32] = &mut guard;
        let momentum = self.k.momentum != 0.0;
        if p.len() != self.g.len() || (momentum && buf.len() != p.len()) {
            candle_core::bail!(
                "fused SGD: {} params, {} grads, {} momentum buffer elements",
                p.len(),
                self.g.len(),
                buf.len()
            );
        }
        let (k, first) = (self.k, self.first);
        const CHUNK: usize = 1 << 14;
        if momentum {
            p.par_chunks_mut(CHUNK)
                .zip(buf.par_chunks_mut(CHUNK))
                .zip(self.g.par_chunks(CHUNK))
                .for_each(|((p, b), g)| {
                    for i in 0..p.len() {
                        p[i] = k.apply(p[i], &mut b[i], g[i], first);
                    }
                });
        } else {
            p.par_chunks_mut(CHUNK)
                .zip(self.g.par_chunks(CHUNK))
                .for_each(|(p, g)| {
                    let mut unused = 0f32;
                    for i in 0..p.len() {
                        p[i] = k.apply(p[i], &mut unused, g[i], false);
                    }
                });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_follows_pytorch() {
        assert!(SgdConfig::default().validate().is_ok());
        assert!(SgdConfig::new(0.1, 0.9).validate().is_ok());
        let bad = |c: SgdConfig| c.validate().unwrap_err().to_string();
        let nesterov_no_momentum = SgdConfig {
            nesterov: true,
            ..SgdConfig::new(0.1, 0.0)
        };
        assert!(bad(nesterov_no_momentum).contains("nesterov requires momentum > 0"));
        let nesterov_dampening = SgdConfig {
            nesterov: true,
            dampening: 0.1,
            ..SgdConfig::new(0.1, 0.9)
        };
        assert!(bad(nesterov_dampening).contains("dampening == 0"));
        assert!(bad(SgdConfig::new(-0.1, 0.9)).contains("lr"));
        assert!(bad(SgdConfig::new(0.1, -0.5)).contains("momentum"));
        assert!(bad(SgdConfig {
            weight_decay: -1.0,
            ..SgdConfig::default()
        })
        .contains("weight_decay"));
        assert!(bad(SgdConfig {
            dampening: f64::NAN,
            ..SgdConfig::default()
        })
        .contains("dampening"));
    }

    #[test]
    fn config_round_trips_through_json() {
        let c = SgdConfig {
            nesterov: true,
            weight_decay: 5e-4,
            ..SgdConfig::new(0.1, 0.9)
        };
        let s = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<SgdConfig>(&s).unwrap(), c);
        let partial: SgdConfig = serde_json::from_str(r#"{"lr":0.5}"#).unwrap();
        assert_eq!(partial, SgdConfig::new(0.5, 0.0));
        assert!(serde_json::from_str::<SgdConfig>(r#"{"lr":0.5,"moment":0.9}"#).is_err());
    }

    #[test]
    fn scalar_update_matches_the_formula() {
        let c = SgdConfig {
            dampening: 0.5,
            weight_decay: 0.25,
            ..SgdConfig::new(0.5, 0.5)
        };
        let k = Coeffs::new(&c, 0.5, true, 2.0);
        let mut b = 0.0;
        // first: d = 2*1 + 0.25*4 = 3, b = 3, p = 4 - 0.5*3 = 2.5
        assert_eq!(k.apply(4.0, &mut b, 1.0, true), 2.5);
        assert_eq!(b, 3.0);
        // then: d = 2*1 + 0.25*2.5 = 2.625, b = 0.5*3 + 0.5*2.625 = 2.8125, p = 2.5 - 1.40625
        assert_eq!(k.apply(2.5, &mut b, 1.0, false), 1.09375);
        assert_eq!(b, 2.8125);
    }
}
