//! GeGLU with the tanh GELU (Gemma 3's MLP activation), composed of [`super::gelu`]'s op.
//!
//! Source of the semantics: transformers' `modeling_gemma3.py` (`Gemma3MLP`).

use super::gelu::gelu_tanh;
use super::swiglu::gated_width;
use candle_core::{DType, Result, Tensor, D};

/// GeGLU with the tanh GELU (Gemma 3's MLP, `hidden_activation = "gelu_pytorch_tanh"`):
/// `x: (.., 2F) = [gate | up]` (the gate the first F columns, as [`crate::ops::swiglu`] takes them)
/// → `gelu_tanh(gate) * up`, `(.., F)`, with `gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g +
/// 0.044715 g^3)))` (wick's fused [`crate::ops::gelu_tanh`]; candle's `Tensor::gelu` is the same
/// approximation). Computed in f32, the result in x's dtype. Differentiable.
///
/// Errors (no panics): a scalar, an odd last dimension, a dtype other than f32/bf16/f16. An
/// empty x gives an empty `(.., F)` result.
pub fn geglu_tanh(x: &Tensor) -> Result<Tensor> {
    let f = gated_width("geglu_tanh", x)?;
    if x.elem_count() == 0 {
        return x.narrow(D::Minus1, 0, f);
    }
    let gate = x.narrow(D::Minus1, 0, f)?.to_dtype(DType::F32)?;
    let up = x.narrow(D::Minus1, f, f)?.to_dtype(DType::F32)?;
    (gelu_tanh(&gate)? * up)?.to_dtype(x.dtype())
}
