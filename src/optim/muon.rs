//! Muon: momentum orthogonalised by Newton–Schulz, for the 2-D weights of hidden layers
//! (K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024,
//! <https://kellerjordan.github.io/posts/muon/>), with the semantics of `torch.optim.Muon`
//! (PyTorch 2.9's `torch/optim/_muon.py`, read at pytorch/pytorch@098e03f:
//! `_single_tensor_muon`, `_zeropower_via_newtonschulz`, `_adjust_lr`). For a matrix `W` of `rows x cols` with gradient `g`:
//! ```text
//! B  = B + (1 - momentum) * (g - B)          # momentum_buffer.lerp_(g, 1 - momentum), f32
//! U  = g + momentum * (B - g)                # nesterov: g.lerp(B, momentum); else U = B
//! X  = bf16(U), transposed if rows > cols    # the Newton–Schulz iterations run in bf16
//! X  = X / max(||X||_F, eps)                 # spectral norm at most 1
//! repeat ns_steps times:                     # quintic iteration, coefficients (a, b, c)
//!     G = X X^T;  X = a X + (b G + c G G) X
//! O  = X, transposed back
//! W  = W * (1 - lr * weight_decay)           # decoupled decay at the unadjusted rate
//! W  = W - adjusted_lr * O                   # adjust_lr (below)
//! ```
//! with `adjusted_lr = lr * sqrt(max(1, rows / cols))` ("original", PyTorch's default) or
//! `lr * 0.2 * sqrt(max(rows, cols))` ("match_rms_adamw").
//! The GEMMs are candle's bf16 matmuls (or f32 ones, [`MuonConfig::ns_dtype`]) on the
//! parameter's device (cuBLAS on CUDA, gemm on the CPU); the momentum and the master stay f32.
//! The gradient is the engine's fp32 buffer times its multiplier (unscale × clip). Muon is
//! meant for hidden layers only: embeddings, the head, norms and biases belong in an AdamW
//! group ([`super::groups::ParamGroups::muon_with_adamw`]), as the PyTorch documentation
//! advises. `torch.optim.Muon`'s `use_addmm` (the same polynomial fused into `addmm` calls; a
//! rounding difference only) has no counterpart here.

use super::rule::TensorRule;
use crate::params::Param;
use anyhow::{bail, ensure, Result};
use candle_core::{DType, Tensor};

/// Muon's learning-rate adjustment by the matrix's shape `(A, B)` (`torch.optim.Muon`'s
/// `adjust_lr_fn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AdjustLr {
    /// `lr * sqrt(max(1, A / B))` (Keller Jordan's; PyTorch's default, `None` or `"original"`).
    #[default]
    Original,
    /// `lr * 0.2 * sqrt(max(A, B))`, matching AdamW's update RMS so that AdamW's learning rate
    /// and weight decay carry over (J. Liu et al., "Muon is Scalable for LLM Training", 2025).
    MatchRmsAdamW,
}

impl AdjustLr {
    /// The rate for a matrix of `rows` × `cols` at base rate `lr`.
    pub fn adjusted(self, lr: f64, rows: usize, cols: usize) -> f64 {
        let (a, b) = (rows as f64, cols as f64);
        match self {
            AdjustLr::Original => lr * (a / b).max(1.0).sqrt(),
            AdjustLr::MatchRmsAdamW => lr * 0.2 * a.max(b).sqrt(),
        }
    }
}

impl std::str::FromStr for AdjustLr {
    type Err = anyhow::Error;

    /// `"original"` or `"match_rms_adamw"` (PyTorch's names); anything else is refused by name.
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "original" => Ok(AdjustLr::Original),
            "match_rms_adamw" => Ok(AdjustLr::MatchRmsAdamW),
            _ => bail!(
                "Muon adjust_lr_fn {s:?} is not supported; use \"original\" or \"match_rms_adamw\""
            ),
        }
    }
}

/// Muon hyper-parameters; defaults are `torch.optim.Muon`'s (PyTorch 2.9).
#[derive(Debug, Clone, PartialEq)]
pub struct MuonConfig {
    /// Base learning rate (the schedule and the group's scale set it per step). Default 1e-3.
    pub lr: f64,
    /// Decoupled weight decay (`W *= 1 - lr * weight_decay`) for decayed parameters.
    /// Default 0.1.
    pub weight_decay: f64,
    /// Momentum factor. Default 0.95.
    pub momentum: f64,
    /// Nesterov momentum. Default true.
    pub nesterov: bool,
    /// The quintic's coefficients `(a, b, c)`. Default (3.4445, -4.7750, 2.0315).
    pub ns_coefficients: (f64, f64, f64),
    /// Lower bound of the Frobenius norm the iteration input is divided by. Default 1e-7.
    pub eps: f64,
    /// Newton–Schulz iterations (< 100, as PyTorch requires). Default 5.
    pub ns_steps: usize,
    /// The shape-based learning-rate adjustment. Default [`AdjustLr::Original`].
    pub adjust_lr: AdjustLr,
    /// The dtype the Newton–Schulz iterations run in: bf16 (default), as `torch.optim.Muon`
    /// runs them, or f32 (slower; for accuracy studies and tight tests). Others are refused.
    pub ns_dtype: DType,
}

impl Default for MuonConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            weight_decay: 0.1,
            momentum: 0.95,
            nesterov: true,
            ns_coefficients: (3.4445, -4.7750, 2.0315),
            eps: 1e-7,
            ns_steps: 5,
            adjust_lr: AdjustLr::Original,
            ns_dtype: DType::BF16,
        }
    }
}

/// Muon over fp32 masters: [`MuonConfig`] run by the whole-tensor driver.
pub type Muon = super::TensorDriver<MuonConfig>;

/// The Newton–Schulz orthogonalisation of a 2-D `g` (any float dtype, any device), as
/// `torch.optim.Muon`'s `_zeropower_via_newtonschulz`: in `dtype` (bf16 in PyTorch),
/// transposed when it has more rows than columns, divided by `max(||g||_F, eps)` (the norm
/// summed in f32, rounded to `dtype` as PyTorch's bf16 `norm()` returns it), then `steps`
/// iterations of `X = a X + (b G + c G G) X` with `G = X X^T`. Returns `dtype` of `g`'s shape:
/// roughly `U S' V^T` for `g = U S V^T`, each singular value `s` mapped to the quintic
/// `a x + b x^3 + c x^5` iterated `steps` times from `s / ||g||_F` (about [0.7, 1.2] for
/// the default coefficients). Nothing is read back to the host.
///
/// Errors: `g` not 2-D.
pub fn newton_schulz(
    g: &Tensor,
    (a, b, c): (f64, f64, f64),
    steps: usize,
    eps: f64,
    dtype: DType,
) -> Result<Tensor> {
    let (rows, cols) = g.dims2().map_err(|_| {
        anyhow::anyhow!("Newton–Schulz needs a 2-D matrix, got shape {:?}", g.dims())
    })?;
    let tall = rows > cols;
    let mut x = g.to_dtype(dtype)?;
    if tall {
        x = x.t()?.contiguous()?;
    }
    let norm = x
        .to_dtype(DType::F32)?
        .sqr()?
        .sum_all()?
        .sqrt()?
        .to_dtype(dtype)?
        .maximum(eps)?;
    x = x.broadcast_div(&norm)?;
    for _ in 0..steps {
        let gram = x.matmul(&x.t()?)?;
        let poly = ((&gram * b)? + (gram.matmul(&gram)? * c)?)?;
        x = ((&x * a)? + poly.matmul(&x)?)?;
    }
    if tall {
        x = x.t()?.contiguous()?;
    }
    Ok(x)
}

impl TensorRule for MuonConfig {
    const NAME: &'static str = "Muon";

    /// Checks ranges as PyTorch does (lr, momentum, weight_decay >= 0; ns_steps < 100) and
    /// that every number is finite and eps > 0.
    fn validate(&self) -> Result<()> {
        for (n, v) in [
            ("lr", self.lr),
            ("momentum", self.momentum),
            ("weight_decay", self.weight_decay),
        ] {
            ensure!(
                v.is_finite() && v >= 0.0,
                "Muon {n} must be finite and >= 0, got {v}"
            );
        }
        ensure!(
            self.eps.is_finite() && self.eps > 0.0,
            "Muon eps must be finite and > 0, got {}",
            self.eps
        );
        let (a, b, c) = self.ns_coefficients;
        ensure!(
            [a, b, c].iter().all(|v| v.is_finite()),
            "Muon ns_coefficients must be finite, got {:?}",
            self.ns_coefficients
        );
        ensure!(
            matches!(self.ns_dtype, DType::BF16 | DType::F32),
            "Muon ns_dtype must be BF16 (torch.optim.Muon's) or F32, got {:?}",
            self.ns_dtype
        );
        ensure!(
            self.ns_steps < 100,
            "Muon ns_steps must be < 100 (as torch.optim.Muon requires), got {}",
            self.ns_steps
        );
        Ok(())
    }

    fn check(&self, param: &Param) -> Result<()> {
        if param.master.rank() != 2 {
            bail!(
                "Muon updates 2-D matrices only; {} has shape {:?}: put it in an AdamW group \
                 (embeddings, norms, biases and the head belong there too)",
                param.name,
                param.master.dims()
            );
        }
        Ok(())
    }

    fn state_names(&self) -> &'static [&'static str] {
        &["momentum_buffer"]
    }

    fn update(
        &self,
        master: &Tensor,
        grad: &Tensor,
        states: &mut [Tensor],
        lr: f64,
        decayed: bool,
    ) -> Result<Tensor> {
        let [buf] = states else {
            bail!("Muon keeps one state tensor, got {}", states.len())
        };
        let (rows, cols) = master.dims2()?;
        let mu = self.momentum;
        *buf = (&*buf + ((grad - &*buf)? * (1.0 - mu))?)?;
        let u = if self.nesterov {
            (grad + ((&*buf - grad)? * mu)?)?
        } else {
            buf.clone()
        };
        let o = newton_schulz(
            &u,
            self.ns_coefficients,
            self.ns_steps,
            self.eps,
            self.ns_dtype,
        )?;
        let wd = if decayed { self.weight_decay } else { 0.0 };
        let step = self.adjust_lr.adjusted(lr, rows, cols);
        Ok(((master * (1.0 - lr * wd))? - (o.to_dtype(DType::F32)? * step)?)?)
    }
}
