//! Precision modes and the autocast policy.
//!
//! [`Autocast`] is the one policy object: models and layers ask it which dtype an op runs in
//! ([`Autocast::dtype`], [`Autocast::cast`]) and which parameters get a working copy in which
//! dtype ([`Autocast::working_dtype`]); the [`crate::params::ParamStore`] holds it and hands it
//! out ([`crate::params::ParamStore::autocast`]). It follows PyTorch's `torch.autocast` (CUDA
//! op lists, "Autocast Op Reference" of the `torch.amp` documentation): ops of the
//! [`OpClass::Matmul`] class (linear, matmul, bmm, conv, the attention products) run in the
//! *compute dtype*; ops of the [`OpClass::F32`] class (softmax, log_softmax, layer/rms-norm
//! statistics, reductions that feed a loss, every loss) run in f32; the other ops run in
//! whatever dtype their inputs have. Parameters always keep an fp32 *master* copy; in the
//! mixed modes the parameters of matmul-class ops ([`Role::Matmul`]) are differentiated as a
//! *working copy* in the compute dtype, refreshed from the master after each applied update
//! by one function ([`crate::params::Param::refresh_working_copy`]).
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
    /// The mode's autocast policy.
    pub fn autocast(self) -> Autocast {
        Autocast::new(self)
    }

    /// The dtype matmul-class ops run in: f32, bf16 or f16 ([`Autocast::compute_dtype`]).
    pub fn compute_dtype(self) -> DType {
        self.autocast().compute_dtype()
    }

    /// True when parameters have a working copy distinct from the fp32 master.
    pub fn is_mixed(self) -> bool {
        self != Precision::Fp32
    }

    /// Casts `x` to the compute dtype (policy for matmul-class inputs). A no-op when the dtype
    /// already matches. Casting is differentiable: gradients flow back in `x`'s dtype.
    pub fn to_compute(self, x: &Tensor) -> Result<Tensor> {
        self.autocast().cast(OpClass::Matmul, x)
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

/// The classes of ops that torch.autocast's lists assign a dtype to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpClass {
    /// Ops that run in the compute dtype ("ops that can autocast to float16"): linear,
    /// matmul, bmm, conv, the attention products.
    Matmul,
    /// Ops that run in f32 whatever the mode ("ops that autocast to float32"): softmax,
    /// log_softmax, the statistics of layer and RMS norms, reductions that feed a loss, every
    /// loss.
    F32,
}

/// Which tensor of a parameter the model's forward pass differentiates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Input of a matmul-class op: a working copy in the compute dtype (the master itself in
    /// [`Precision::Fp32`]).
    Matmul,
    /// Input of an f32 op (norm gain/bias): the fp32 master is differentiated directly.
    Fp32,
}

/// The autocast policy of a precision mode (module docs): the dtype each [`OpClass`] runs in,
/// and which parameter [`Role`]s get a working copy. One value per
/// [`crate::params::ParamStore`]; layers and models keep the store's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Autocast {
    precision: Precision,
}

impl Autocast {
    /// The policy of `precision`.
    pub fn new(precision: Precision) -> Self {
        Self { precision }
    }

    /// The precision mode the policy implements.
    pub fn precision(self) -> Precision {
        self.precision
    }

    /// The dtype [`OpClass::Matmul`] ops run in: f32, bf16 or f16.
    pub fn compute_dtype(self) -> DType {
        self.dtype(OpClass::Matmul)
    }

    /// The dtype ops of `class` run in.
    pub fn dtype(self, class: OpClass) -> DType {
        match (class, self.precision) {
            (OpClass::F32, _) | (OpClass::Matmul, Precision::Fp32) => DType::F32,
            (OpClass::Matmul, Precision::Bf16Mixed) => DType::BF16,
            (OpClass::Matmul, Precision::F16Mixed) => DType::F16,
        }
    }

    /// `x` cast to the dtype of `class` (a no-op when it has it already). Casting is
    /// differentiable: gradients flow back in `x`'s dtype.
    pub fn cast(self, class: OpClass, x: &Tensor) -> Result<Tensor> {
        cast(x, self.dtype(class))
    }

    /// The dtype of the working copy a parameter of `role` gets, `None` when its fp32 master
    /// is differentiated directly (every role in [`Precision::Fp32`]; [`Role::Fp32`] always).
    pub fn working_dtype(self, role: Role) -> Option<DType> {
        match (role, self.precision.is_mixed()) {
            (Role::Matmul, true) => Some(self.compute_dtype()),
            _ => None,
        }
    }
}

impl From<Precision> for Autocast {
    fn from(precision: Precision) -> Self {
        Self::new(precision)
    }
}

/// Casts `x` to f32 (the [`OpClass::F32`] ops: softmax, norms, loss inputs); a no-op for f32
/// tensors.
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

    #[test]
    fn the_policy_follows_autocast_lists() -> Result<()> {
        // (mode, matmul-class dtype, working copy of a matmul parameter)
        let table = [
            (Precision::Fp32, DType::F32, None),
            (Precision::Bf16Mixed, DType::BF16, Some(DType::BF16)),
            (Precision::F16Mixed, DType::F16, Some(DType::F16)),
        ];
        let x = Tensor::new(&[1.5f32, -2.0], &candle_core::Device::Cpu)?;
        for (mode, matmul, working) in table {
            let a = mode.autocast();
            assert_eq!(a.precision(), mode);
            assert_eq!(a.dtype(OpClass::Matmul), matmul);
            assert_eq!(a.dtype(OpClass::F32), DType::F32, "{mode}");
            assert_eq!(a.working_dtype(Role::Matmul), working, "{mode}");
            assert_eq!(a.working_dtype(Role::Fp32), None, "{mode}");
            let c = a.cast(OpClass::Matmul, &x)?;
            assert_eq!(c.dtype(), matmul);
            // both values are exact in every dtype: the cast keeps them
            assert_eq!(c.to_dtype(DType::F32)?.to_vec1::<f32>()?, vec![1.5, -2.0]);
            assert_eq!(a.cast(OpClass::F32, &c)?.dtype(), DType::F32);
        }
        Ok(())
    }
}
