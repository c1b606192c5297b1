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
//! fused CPU path reproduces the reference bit for bit. "First step" is the parameter's first
//! applied step (its per-parameter count is 0, [`super::driver`]), where PyTorch finds
//! `momentum_buffer is None`.

use super::driver::Driver;
use super::rule::UpdateRule;
use anyhow::Result;
use candle_core::Tensor;

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
pub struct Coeffs {
    pub(crate) lr: f32,
    pub(crate) momentum: f32,
    /// `1 - dampening`.
    pub(crate) one_minus_dampening: f32,
    /// The weight decay of this parameter's group (0 for groups without decay).
    pub(crate) weight_decay: f32,
    pub(crate) nesterov: bool,
    /// `unscale * clip`.
    pub(crate) grad_mult: f32,
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

/// SGD over fp32 masters, reference or fused: [`SgdConfig`] run by the optimizer driver.
pub type Sgd = Driver<SgdConfig>;

impl UpdateRule for SgdConfig {
    const NAME: &'static str = "SGD";
    type Coeffs = Coeffs;

    fn validate(&self) -> Result<()> {
        SgdConfig::validate(self)
    }

    fn state_names(&self) -> &'static [&'static str] {
        if self.uses_momentum() {
            &["momentum_buffer"]
        } else {
            &[] // no buffer at all, as in PyTorch
        }
    }

    fn coeffs(&self, _t: u64, lr: f64, decayed: bool, grad_mult: f64) -> Coeffs {
        Coeffs::new(self, lr, decayed, grad_mult)
    }

    fn update_host(k: &Coeffs, p: &mut [f32], g: &[f32], states: &mut [&mut [f32]], first: bool) {
        // a local copy of the coefficients: re-read through the reference, the f32 stores
        // could alias them and the loop would not vectorise
        let k = *k;
        match states {
            [b] => {
                let b: &mut [f32] = b;
                for ((p, &g), b) in p.iter_mut().zip(g).zip(b.iter_mut()) {
                    *p = k.apply(*p, b, g, first);
                }
            }
            _ => {
                let mut unused = 0f32;
                for (p, &g) in p.iter_mut().zip(g) {
                    *p = k.apply(*p, &mut unused, g, false);
                }
            }
        }
    }

    /// In `Coeffs::apply`'s order.
    fn update_reference(
        k: &Coeffs,
        p: &Tensor,
        g: &Tensor,
        states: &mut [Tensor],
        first: bool,
    ) -> Result<Tensor> {
        let mut d = (g * k.grad_mult as f64)?;
        if k.weight_decay != 0.0 {
            d = (d + (p * k.weight_decay as f64)?)?;
        }
        if let [b] = states {
            let buf = if first {
                d.clone()
            } else {
                ((&*b * k.momentum as f64)? + (&d * k.one_minus_dampening as f64)?)?
            };
            d = if k.nesterov {
                (d + (&buf * k.momentum as f64)?)?
            } else {
                buf.clone()
            };
            *b = buf;
        }
        Ok((p - (d * k.lr as f64)?)?)
    }

    #[cfg(feature = "cuda")]
    type KernelArgs = KernelArgs;

    #[cfg(feature = "cuda")]
    const KERNEL: crate::cuda::update::Kernel = crate::cuda::update::Kernel {
        name: "sgd",
        ptx: crate::cuda::ptx::SGD,
    };

    #[cfg(feature = "cuda")]
    fn kernel_args(&self, lr: f64, rounding: crate::cuda::update::Rounding) -> KernelArgs {
        // the multiplier is read on the device (stats[2]); the group picks the decay
        let k = Coeffs::new(self, lr, true, 1.0);
        KernelArgs {
            lr: k.lr,
            momentum: k.momentum,
            one_minus_dampening: k.one_minus_dampening,
            weight_decay: k.weight_decay,
            nesterov: i32::from(k.nesterov),
            rounding,
        }
    }
}

#[cfg(feature = "cuda")]
crate::cuda::update::kernel_args! {
    /// Mirror of `SgdArgs` in kernels/sgd.cu: the f32 values of [`Coeffs`], rounded once on
    /// the host exactly as the CPU paths round them.
    pub struct KernelArgs {
        lr: f32,
        momentum: f32,
        one_minus_dampening: f32,
        /// Weight decay of decayed groups (`tensor_group = 1`); the others use 0.
        weight_decay: f32,
        nesterov: i32,
    }
}

// the layout of the C struct in the kernel (checked at compile time)
#[cfg(feature = "cuda")]
const _: () = assert!(std::mem::size_of::<KernelArgs>() == 28);

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
