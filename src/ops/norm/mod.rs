//! Normalisation over the last dimension: LayerNorm and RMSNorm (one fused kernel pair,
//! statistics in f32), and the per-head RMSNorm of q and k.

pub(super) mod layer_norm;
pub(super) mod qk_norm;
pub(super) mod rms_norm;
