//! Products with a weight: the autocast linear (cast, GEMM, bias in one node), the linear after
//! an activation, the LoRA-adapted linear of stacked modules (its parts' layout in
//! [`lora_parts`], its CUDA path in `lora_cuda`), and the embedding lookup.

pub(super) mod act_linear;
pub(super) mod bgmv;
pub(super) mod dense;
pub(super) mod embedding;
pub(super) mod lora;
#[cfg(feature = "cuda")]
pub(super) mod lora_cuda;
pub(super) mod lora_parts;
