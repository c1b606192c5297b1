//! Gradient coverage: which trainable parameters received no gradient from a backward pass,
//! and why that usually happens.
//!
//! In candle-nn 0.11.1, `ops::layer_norm`, `ops::rms_norm` and `ops::softmax_last_dim` (and so
//! `candle_nn::LayerNorm` / `RmsNorm` on contiguous input, and rotary embeddings) are fused
//! forward-only ops: autograd stops there silently and every parameter upstream trains as if
//! frozen (candle issues #2168, #2977, #3011, #3752). The engine runs this check after the first
//! backward of a run (and whenever asked) and refuses to continue when a trainable parameter
//! got no gradient.

use crate::params::Param;
use candle_core::backprop::GradStore;
use std::fmt;

/// Parameters without a gradient after one backward pass.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Coverage {
    /// Trainable parameters that received no gradient (an error for the engine).
    pub missing: Vec<String>,
    /// Parameters marked frozen that received no gradient (expected; a warning).
    pub missing_frozen: Vec<String>,
}

/// The usual causes, printed with every report.
pub const LIKELY_CAUSE: &str = "likely cause: a forward-only op lies between these parameters and the loss. \
In candle-nn 0.11.1 candle_nn::LayerNorm / RmsNorm (on contiguous input), ops::layer_norm, ops::rms_norm, \
ops::softmax_last_dim and the rotary-embedding kernels have no backward, so autograd stops there silently \
(candle #2168, #2977, #3011, #3752). Use wick::nn::LayerNorm or the differentiable candle_nn::ops::softmax / \
layer_norm_slow instead; other causes are a .detach(), a parameter the forward never uses, or an integer cast. \
If the parameters are frozen on purpose, mark them with ParamStore::freeze";

impl Coverage {
    /// Checks every parameter of `params` against `grads`.
    pub fn check(params: &[Param], grads: &GradStore) -> Self {
        let mut c = Coverage::default();
        for p in params {
            if grads.get(p.differentiated()).is_none() {
                if p.options.frozen {
                    c.missing_frozen.push(p.name.clone());
                } else {
                    c.missing.push(p.name.clone());
                }
            }
        }
        c
    }

    /// True when every trainable parameter got a gradient.
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty()
    }
}

impl fmt::Display for Coverage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.missing.is_empty() {
            write!(
                f,
                "{} trainable parameter(s) received no gradient: {}; {LIKELY_CAUSE}",
                self.missing.len(),
                self.missing.join(", ")
            )?;
        }
        if !self.missing_frozen.is_empty() {
            if !self.missing.is_empty() {
                f.write_str(". ")?;
            }
            write!(
                f,
                "{} frozen parameter(s) received no gradient (expected): {}",
                self.missing_frozen.len(),
                self.missing_frozen.join(", ")
            )?;
        }
        Ok(())
    }
}
