//! The storage dtypes of the fused ops (f32, bf16, f16): the dispatch from a `DType` to its
//! Rust type (`with_type!`) and the f32 conversions of each ([`Elem`]).

use half::{bf16, f16};

/// Runs `$body!(T)` with `T` the Rust type of a fused op's storage dtype (f32, bf16 or f16);
/// an error naming `$op` for any other dtype. Used by the op modules (`DType`, `bf16` and
/// `f16` must be in scope there).
macro_rules! with_type {
    ($op:expr, $dt:expr, $body:ident) => {
        match $dt {
            DType::F32 => $body!(f32),
            DType::BF16 => $body!(bf16),
            DType::F16 => $body!(f16),
            d => candle_core::bail!(
                "{}: dtype {d:?} is not supported; use f32, bf16 or f16",
                $op
            ),
        }
    };
}

/// Storage element types of the fused ops, with f32 conversions (round to nearest even, as the
/// CUDA kernels' `from_f32`).
pub(crate) trait Elem: candle_core::WithDType + Send + Sync {
    fn to32(self) -> f32;
    fn from32(v: f32) -> Self;
}
impl Elem for f32 {
    fn to32(self) -> f32 {
        self
    }
    fn from32(v: f32) -> Self {
        v
    }
}
impl Elem for bf16 {
    fn to32(self) -> f32 {
        self.to_f32()
    }
    fn from32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
impl Elem for f16 {
    fn to32(self) -> f32 {
        self.to_f32()
    }
    fn from32(v: f32) -> Self {
        f16::from_f32(v)
    }
}
