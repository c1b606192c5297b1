//! Argument checks the ops share, each an error naming the op, the argument and the fix.

use candle_core::{bail, DType, Result, Tensor};

/// Errors unless `dtype` is one of the storage dtypes the fused ops take (f32, bf16, f16).
pub(crate) fn check_float(op: &str, what: &str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(()),
        d => bail!("{op}: {what} has dtype {d:?}; expected f32, bf16 or f16 (cast it with .to_dtype(DType::F32))"),
    }
}

/// Errors unless `a` and `b` are on the same device.
pub(crate) fn check_device(op: &str, what: &str, x: &Tensor, other: &Tensor) -> Result<()> {
    if !x.device().same_device(other.device()) {
        bail!(
            "{op}: {what} is on {:?} but x is on {:?}; move both to the same device",
            other.device(),
            x.device()
        )
    }
    Ok(())
}

/// Class indices / token ids as a contiguous u32 tensor (u32 as is; i64 and u8 converted);
/// `what` names the argument in the error for other dtypes.
pub(crate) fn index_u32(op: &str, what: &str, t: &Tensor) -> Result<Tensor> {
    match t.dtype() {
        DType::U32 => t.contiguous(),
        DType::I64 | DType::U8 => t.to_dtype(DType::U32),
        d => bail!("{op}: {what} must hold integer indices (u32, i64 or u8), found {d:?}"),
    }
}
