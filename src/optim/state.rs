//! The optimizer driver's state: state tensors in each implementation's representation, and
//! per-parameter step counts on the host or on the device.

use super::Impl;
use crate::params::Param;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

/// One state tensor in the representation of the implementation.
pub(crate) enum Buf {
    /// candle tensor (reference path; the fused CUDA kernel writes it in place).
    Tensor(Tensor),
    /// Host vector updated in place by the fused CPU pass.
    Host(Vec<f32>),
}

impl Buf {
    pub(crate) fn zeros(imp: Impl, p: &Param) -> Result<Self> {
        Ok(match imp {
            Impl::FusedCpu => Buf::Host(vec![0.0; p.elem_count()]),
            // a fresh allocation each: the fused CUDA kernel writes them in place
            _ => Buf::Tensor(p.master.zeros_like()?),
        })
    }

    pub(crate) fn from_tensor(imp: Impl, t: Tensor) -> Result<Self> {
        Ok(match imp {
            Impl::FusedCpu => Buf::Host(t.flatten_all()?.to_vec1()?),
            _ => Buf::Tensor(t.copy()?),
        })
    }

    pub(crate) fn to_tensor(&self, p: &Param) -> Result<Tensor> {
        Ok(match self {
            Buf::Tensor(t) => t.clone(),
            Buf::Host(v) => Tensor::from_slice(v, p.master.shape(), p.master.device())?,
        })
    }

    pub(crate) fn tensor(&self) -> Result<&Tensor> {
        match self {
            Buf::Tensor(t) => Ok(t),
            Buf::Host(_) => bail!("optimizer state/path mismatch"),
        }
    }
}

/// Per-parameter applied-step counts.
pub(crate) enum StepCounts {
    /// Host counters (CPU paths).
    Host(Vec<u64>),
    /// `(n,)` i64 counters on the device (fused CUDA path), with the `(k,)` u32 index list of
    /// the last work list on the device (re-uploaded only when the work list changes).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Device {
        counts: Option<Tensor>,
        index: Option<(Vec<u32>, Tensor)>,
    },
}

impl StepCounts {
    pub(crate) fn new(imp: Impl) -> Self {
        match imp {
            Impl::FusedCuda => StepCounts::Device {
                counts: None,
                index: None,
            },
            _ => StepCounts::Host(Vec::new()),
        }
    }

    /// Every count as a host value (a device read on the CUDA path).
    pub(crate) fn read(&self, n: usize) -> Result<Vec<u64>> {
        let mut v = match self {
            StepCounts::Host(v) => v.clone(),
            StepCounts::Device { counts: None, .. } => Vec::new(),
            StepCounts::Device {
                counts: Some(t), ..
            } => t.to_vec1::<i64>()?.into_iter().map(|c| c as u64).collect(),
        };
        v.resize(n.max(v.len()), 0);
        Ok(v)
    }

    /// Replaces every count (on `device` for the CUDA path).
    pub(crate) fn set(&mut self, v: Vec<u64>, device: &Device) -> Result<()> {
        match self {
            StepCounts::Host(h) => *h = v,
            StepCounts::Device { counts, .. } => {
                let v: Vec<i64> = v.into_iter().map(|c| c as i64).collect();
                *counts = Some(Tensor::new(v.as_slice(), device)?);
            }
        }
        Ok(())
    }
}

/// A saved step count: one element of any numeric dtype, a whole number `>= 0`.
pub(crate) fn read_step(t: &Tensor, name: &str) -> Result<u64> {
    let v = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    match v.as_slice() {
        [s] if *s >= 0.0 && s.fract() == 0.0 => Ok(*s as u64),
        _ => bail!("optimizer state {name:?} must be one whole number >= 0, got {v:?}"),
    }
}
