//! Losses. Every loss runs in f32 whatever the dtype of its inputs (autocast policy) and
//! returns a rank-0 f32 tensor.

use crate::precision::to_f32;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor, D};

/// Mean cross-entropy of `logits: (N, C)` against class indices `targets: (N,)` (u32 or i64),
/// `mean(lse(logits[i]) - logits[i, t_i])` in f32, like `torch.nn.functional.cross_entropy`
/// with `reduction="mean"`. f32, bf16 and f16 logits go through the fused
/// [`crate::ops::cross_entropy_mean`] (one graph node: no f32 copy of the logits, the mean
/// taken inside the op, a one-pass gradient in the logits' dtype); other float dtypes through
/// `log_softmax` in f32.
///
/// Errors: logits not rank 2, targets not rank 1, batch sizes that differ, non-integer
/// targets, an empty batch, or (on the CPU) a target `>= C`.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
    check_ce(logits, targets).map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
    if matches!(logits.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return crate::ops::cross_entropy_mean(logits, targets);
    }
    let logp = candle_nn::ops::log_softmax(&to_f32(logits)?, D::Minus1)?;
    let targets = targets.to_dtype(DType::U32)?.unsqueeze(1)?;
    let picked = logp.gather(&targets, 1)?;
    picked.mean_all()?.neg()
}

fn check_ce(logits: &Tensor, targets: &Tensor) -> Result<()> {
    let (n, c) = match logits.dims() {
        &[n, c] => (n, c),
        d => bail!(
            "cross_entropy: logits must be (N, C), found shape {d:?}; flatten leading dims first"
        ),
    };
    match targets.dims() {
        &[m] if m == n => {}
        d => bail!("cross_entropy: targets must be (N,) = ({n},) to match logits (N, C) = ({n}, {c}); found shape {d:?}"),
    }
    if !matches!(targets.dtype(), DType::U32 | DType::I64 | DType::U8) {
        bail!(
            "cross_entropy: targets must hold class indices (u32 or i64), found {:?}",
            targets.dtype()
        );
    }
    if n == 0 {
        bail!("cross_entropy: the batch is empty (N = 0)");
    }
    Ok(())
}

/// Mean squared error `mean((pred - target)^2)` in f32; shapes must be equal.
pub fn mse(pred: &Tensor, target: &Tensor) -> candle_core::Result<Tensor> {
    if pred.dims() != target.dims() {
        candle_core::bail!(
            "mse: prediction shape {:?} != target shape {:?}",
            pred.dims(),
            target.dims()
        );
    }
    (to_f32(pred)? - to_f32(target)?)?.sqr()?.mean_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn cross_entropy_closed_form() -> anyhow::Result<()> {
        let logits = Tensor::new(&[[0f32, 0., 0.], [1., 2., 3.]], &Device::Cpu)?;
        let t = Tensor::new(&[0u32, 2], &Device::Cpu)?;
        let got = cross_entropy(&logits, &t)?.to_scalar::<f32>()?;
        let l1 = 3f32.ln();
        let l2 = -(3f32 - (1f32.exp() + 2f32.exp() + 3f32.exp()).ln());
        assert!((got - (l1 + l2) / 2.0).abs() < 1e-6);
        let bad = cross_entropy(&logits, &Tensor::new(&[0u32], &Device::Cpu)?).unwrap_err();
        assert!(bad.to_string().contains("targets must be (N,)"), "{bad}");
        Ok(())
    }
}
