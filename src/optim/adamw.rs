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
//! fp32 whatever the compute dtype; `t` counts the applied steps in which this parameter had a
//! gradient ([`super::driver`]), on every path, as PyTorch counts it. The kernel is
//! kernels/adamw.cu.

use super::driver::Driver;
use super::rule::UpdateRule;
use anyhow::Result;
use candle_core::Tensor;

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

/// AdamW over fp32 masters, reference or fused: [`AdamWConfig`] run by the optimizer driver.
pub type AdamW = Driver<AdamWConfig>;

/// Scalars of one parameter's update, rounded to f32 once so that the reference, fused CPU and
/// fused CUDA paths perform the same arithmetic (same constants, same operation order).
#[derive(Clone, Copy, Debug)]
pub struct Coeffs {
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

impl UpdateRule for AdamWConfig {
    const NAME: &'static str = "AdamW";
    type Coeffs = Coeffs;

    /// Checks ranges: betas in [0, 1), eps > 0, weight_decay >= 0.
    fn validate(&self) -> Result<()> {
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

    fn state_names(&self) -> &'static [&'static str] {
        &["exp_avg", "exp_avg_sq"]
    }

    fn coeffs(&self, t: u64, lr: f64, decayed: bool, grad_mult: f64) -> Coeffs {
        let wd = if decayed { self.weight_decay } else { 0.0 };
        let t = t.min(i32::MAX as u64) as i32;
        Coeffs {
            beta1: self.beta1 as f32,
            one_minus_beta1: (1.0 - self.beta1) as f32,
            beta2: self.beta2 as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
            eps: self.eps as f32,
            decay: (1.0 - lr * wd) as f32,
            step_size: (lr / (1.0 - self.beta1.powi(t))) as f32,
            inv_bc2_sqrt: (1.0 / (1.0 - self.beta2.powi(t)).sqrt()) as f32,
            grad_mult: grad_mult as f32,
        }
    }

    fn update_host(k: &Coeffs, p: &mut [f32], g: &[f32], states: &mut [&mut [f32]], _: bool) {
        let [m, v] = states else { return };
        // locals: the coefficients and slices must not be re-read through references that
        // the f32 stores could alias (that alone costs the loop its vectorisation, ~5x)
        let (k, m, v): (Coeffs, &mut [f32], &mut [f32]) = (*k, m, v);
        let rows = p.iter_mut().zip(g).zip(m.iter_mut().zip(v.iter_mut()));
        for ((p, &g), (m, v)) in rows {
            let gi = g * k.grad_mult; // unscaled, clipped gradient
            *m = *m * k.beta1 + gi * k.one_minus_beta1; // first moment
            *v = *v * k.beta2 + (gi * gi) * k.one_minus_beta2; // second moment
            let denom = v.sqrt() * k.inv_bc2_sqrt + k.eps; // sqrt(v_hat) + eps
            *p = *p * k.decay - (*m / denom) * k.step_size; // decoupled decay, Adam step
        }
    }

    fn update_reference(
        k: &Coeffs,
        p: &Tensor,
        g: &Tensor,
        states: &mut [Tensor],
        _: bool,
    ) -> Result<Tensor> {
        let [m, v] = states else {
            anyhow::bail!("AdamW keeps two state tensors, got {}", states.len())
        };
        let g = (g * k.grad_mult as f64)?;
        *m = ((&*m * k.beta1 as f64)? + (&g * k.one_minus_beta1 as f64)?)?;
        *v = ((&*v * k.beta2 as f64)? + (g.sqr()? * k.one_minus_beta2 as f64)?)?;
        let denom = v.sqrt()?.affine(k.inv_bc2_sqrt as f64, k.eps as f64)?;
        Ok(((p * k.decay as f64)? - ((&*m / denom)? * k.step_size as f64)?)?)
    }

    #[cfg(feature = "cuda")]
    type KernelArgs = KernelArgs;

    #[cfg(feature = "cuda")]
    const KERNEL: crate::cuda::update::Kernel = crate::cuda::update::Kernel {
        name: "adamw",
        ptx: crate::cuda::ptx::ADAMW,
    };

    #[cfg(feature = "cuda")]
    fn kernel_args(&self, lr: f64, rounding: crate::cuda::update::Rounding) -> KernelArgs {
        KernelArgs {
            lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            rounding,
        }
    }
}

#[cfg(feature = "cuda")]
crate::cuda::update::kernel_args! {
    /// Mirror of `AdamWArgs` in kernels/adamw.cu: the kernel derives each parameter's
    /// [`Coeffs`] from these in double precision, as [`UpdateRule::coeffs`] does on the host.
    pub struct KernelArgs {
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    }
}

// the layout of the C struct in the kernel (checked at compile time)
#[cfg(feature = "cuda")]
const _: () = assert!(std::mem::size_of::<KernelArgs>() == 48);
