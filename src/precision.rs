//! Precision modes and the autocast op policy.
//!
//! wick follows the op lists of PyTorch's `torch.autocast` (CUDA): matmul-class ops
//! (linear, matmul, conv, attention products) run in the *compute dtype*; numerically
//! sensitive ops (softmax, log_softmax, layer/rms-norm statistics, reductions that feed a loss,
//! every loss) run in f32. Parameters always keep an fp32 *master* copy; in the mixed modes the
//! matmul-class layers differentiate a *working copy* in the compute dtype (see
//! [`crate::params`]).
//!
//! | mode | Lightning name | compute dtype | default loss scaler |
//! |---|---|---|---|
//! | [`Precision::Fp32`] | `"32"` | f32 | none |
//! | [`Precision::Bf16Mixed`] | `"bf16-mixed"` | bf16 | none |
//! | [`Precision::F16Mixed`] | `"16-mixed"` | f16 | dynamic |

use candle_core::{DType, Result, Tensor};
use std::fmt;
use std::str::FromStr;

/// Training precision. Parsed from Lightning's names (`"32"`, `"bf16-mixed"`, `"16-mixed"`);
/// `"fp32"`, `"f32"`, `"bf16"`, `"fp16"`, `"f16"` are accepted as aliases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    /// Everything in f32; no casts, no loss scaling.
    #[default]
    Fp32,
    /// bf16 autocast over fp32 master weights. bf16 has f32's exponent range, so no loss
    /// scaling is needed by default.
    Bf16Mixed,
    /// f16 autocast over fp32 master weights with a dynamic loss scaler by default.
    F16Mixed,
}

impl Precision {
    /// The dtype matmul-class ops run in: f32, bf16 or f16.
    pub fn compute_dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16Mixed => DType::BF16,
            Precision::F16Mixed => DType::F16,
        }
    }

    /// True when parameters have a working copy distinct from the fp32 master.
    pub fn is_mixed(self) -> bool {
        self != Precision::Fp32
    }

    /// Casts `x` to the compute dtype (policy for matmul-class inputs). A no-op when the dtype
    /// already matches. Casting is differentiable: gradients flow back in `x`'s dtype.
    pub fn to_compute(self, x: &Tensor) -> Result<Tensor> {
        cast(x, self.compute_dtype())
    }

    /// Lightning's name for the mode: `"32"`, `"bf16-mixed"` or `"16-mixed"`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "32",
            Precision::Bf16Mixed => "bf16-mixed",
            Precision::F16Mixed => "16-mixed",
        }
    }
}

/// Casts `x` to f32 (policy for softmax, norms, loss inputs); a no-op for f32 tensors.
pub fn to_f32(x: &Tensor) -> Result<Tensor> {
    cast(x, DType::F32)
}

fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    if x.dtype() == dtype {
        Ok(x.clone())
    } else {
        x.to_dtype(dtype)
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "32" | "32-true" | "fp32" | "f32" => Ok(Precision::Fp32),
            "bf16-mixed" | "bf16" => Ok(Precision::Bf16Mixed),
            "16-mixed" | "16" | "fp16" | "f16" | "fp16-mixed" => Ok(Precision::F16Mixed),
            other => anyhow::bail!(
                "unknown precision {other:?}: expected one of \"32\", \"bf16-mixed\", \"16-mixed\""
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lightning_names() {
        assert_eq!("32".parse::<Precision>().unwrap(), Precision::Fp32);
        assert_eq!(
            "bf16-mixed".parse::<Precision>().unwrap(),
            Precision::Bf16Mixed
        );
        assert_eq!(
            "16-mixed".parse::<Precision>().unwrap(),
            Precision::F16Mixed
        );
        let err = "bf17".parse::<Precision>().unwrap_err().to_string();
        assert!(err.contains("bf17") && err.contains("bf16-mixed"), "{err}");
        assert_eq!(Precision::F16Mixed.compute_dtype(), DType::F16);
    }
}
