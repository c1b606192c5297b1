//! Differentiable fused ops: each is one candle `CustomOp` with a forward and a backward kernel,
//! on the CPU (rayon, one pass per row) and on CUDA (kernels in `kernels/*.cu`).
//!
//! The ops are grouped by kind, each kind a folder; this module is their public face (every
//! op is re-exported here, `wick::ops::layer_norm`):
//!
//! | kind | holds |
//! |---|---|
//! | `common` | the toolkit: dtype dispatch (`with_type!`, `Elem`), argument checks, CPU storage access, `SideOutput`; no ops |
//! | `elementwise` | bias add, GELU, ReLU, the residual add, SwiGLU, GeGLU |
//! | `norm` | LayerNorm, RMSNorm, the per-head q/k RMSNorm |
//! | `attention` | causal (flash), windowed, packed-document (varlen), key-padding, composed, KV-cached and paged (block-table) attention; softmaxes; head split/merge; rotary embedding |
//! | `linear` | the autocast linear, activation + linear, LoRA linear (CPU and CUDA paths), batched per-row LoRA (BGMV), embedding |
//! | `loss` | cross-entropy over logits and fused with the head's linear |
//! | `block` | pre-norm and post-norm transformer blocks as one node, on top of the kinds above |
//!
//! Every kind builds on `common`; `block` builds on the others and nothing imports `block`.
//! No two files import each other: a vocabulary that several files speak has a file of its
//! own (`block/layer.rs`, `linear/lora_parts.rs`, `attention/qkv.rs`, `attention/segments.rs`).
//!
//! | op | computes (over the last dim) | x dtype | output dtype |
//! |---|---|---|---|
//! | [`layer_norm`] | `y = (x - mean) / sqrt(var + eps) * w + b` | f32, bf16, f16 | x's (or f32: [`layer_norm_with_dtype`]) |
//! | [`rms_norm`] | `y = x / sqrt(mean(x^2) + eps) * w` | f32, bf16, f16 | x's (or f32: [`rms_norm_with_dtype`]) |
//! | [`softmax_last_dim`] | `y = exp(x - max) / sum(exp(x - max))` | f32, bf16, f16 | x's |
//! | [`causal_softmax_last_dim`] | the same over keys `j <= i` of `(.., T, T)` scores, 0 above | f32, bf16, f16 | x's |
//! | [`key_padding_softmax_last_dim`] | the same over the first `len[b]` keys of `(B, .., Tk)` scores, 0 after | f32, bf16, f16 | x's |
//! | [`linear`] | `y = cast(x) @ w^T + b` (autocast `F.linear`: cast, GEMM, bias in one node) | x: f32, bf16, f16; w: the compute dtype | w's |
//! | [`bias_add`] | `y = x + b` over the last dim; `db` = column sum | f32, bf16, f16 | x's |
//! | [`embedding`] | `y = table[ids]`; `dtable` scatter-added in f32 | f32, bf16, f16 table | table's |
//! | [`gelu_tanh`] | `y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` (elementwise) | f32, bf16, f16 | x's |
//! | [`gelu_erf`] | `y = 0.5 x (1 + erf(x / sqrt(2)))` (elementwise, BERT's) | f32, bf16, f16 | x's |
//! | [`act_linear`] / [`gelu_linear`] | `y = act(h) @ w^T + b` (act: GELU tanh or erf, ReLU; [`gelu_linear`]: erf) in one node that keeps only `h` (the activation's output recomputed in the backward) | h: the compute dtype | w's |
//! | [`split_heads`] / [`merge_heads`] | `(B, T, 3C) → (3, B, H, T, Dh)` / `(B, H, T, Dh) → (B, T, C)` row copies | any | x's |
//! | [`causal_attention`] | `y = softmax(q k^T / sqrt(Dh) + causal mask) v` per head, `(B, T, 3C) → (B, T, C)` (flash attention on CUDA) | f32, bf16, f16 | x's |
//! | [`grouped_causal_attention`] | the same with `Hkv` key/value heads shared by `H / Hkv` query heads each (GQA), `(B, T, (H + 2Hkv) Dh) → (B, T, H Dh)`, K/V never repeated on CUDA | f32, bf16, f16 | x's |
//! | [`grouped_attention`] | `y = softmax(q k^T * scale + mask) v`, q `(B, H, T, D)` at positions `start..start + T`, k/v `(B, Hkv, start + T, D)`, causal with an optional sliding window (composed, scores f32; the KV cache's and the windows' path) | f32, bf16, f16 | v's, `(B, T, H D)` |
//! | [`grouped_window_attention`] | [`grouped_causal_attention`] with a sliding window (W keys per query; flash kernels on CUDA skipping the tiles outside every window) | f32, bf16, f16 | x's |
//! | [`window_causal_attention`] | [`grouped_causal_attention`] with a sliding window and a scale; the fused op ([`grouped_window_attention`]) where the scale is the default, else [`grouped_attention`] (composed) | f32, bf16, f16 | x's |
//! | [`grouped_varlen_attention`] / [`grouped_varlen_attention_composed`] | [`window_causal_attention`] over the documents packed in one `(1, N)` row ([`Segments`]: FlashAttention's varlen `cu_seqlens`), query i seeing keys of its own document only (flash kernels on CUDA skipping the tiles before a query tile's first document; the composition materialises a document mask) | f32, bf16, f16 | x's |
//! | [`qk_rms_norm`] | per-head RMSNorm of the q and k parts of `(B, T, (H + 2Hkv) Dh)` (Qwen3's and Gemma 3's `q_norm`/`k_norm`), v unchanged (composed) | f32, bf16, f16 | x's |
//! | [`geglu_tanh`] | `y = gelu_tanh(g) * u`, `(.., 2F) = [g \| u] → (.., F)` (Gemma 3's MLP activation; composed, f32) | f32, bf16, f16 | x's |
//! | [`rotary_qkv`] | RoPE (`rotate_half` form) on the q and k heads of `(B, T, (H + 2Hkv) Dh)`, v copied; tables from [`rotary_tables`] | f32, bf16, f16 (tables f32) | x's |
//! | [`swiglu`] | `y = silu(g) * u`, `(.., 2F) = [g \| u] → (.., F)` (Llama's MLP activation) | f32, bf16, f16 | x's |
//! | [`lora_linear`] / [`lora_linear_grouped`] | `y = x W^T + s (x A^T) B^T`, W frozen (no gradient), the LoRA updates of stacked modules inside the node | x: f32, bf16, f16; W, A, B: the compute dtype | W's |
//! | [`linear_cross_entropy_rows`] | `loss = lse(h W^T) - (h W^T)[t]` per row, the logits never a graph tensor | f32, bf16, f16 | f32 loss |
//! | [`linear_cross_entropy_sum`] | `loss = sum_r lse(h_r W^T) - (h_r W^T)[t_r]`, chunks of rows with the gradient made in the forward (Liger's fused linear cross-entropy): at most `chunk x V` logits at once, [`IGNORE_INDEX`] rows skipped | f32, bf16, f16 | rank-0 f32 loss |
//! | [`residual_add`] | `out = x + f32(y)`, the residual stream f32, the branch in any float dtype (elementwise) | x f32, y f32/bf16/f16 | f32 |
//! | [`cross_entropy_rows`] | `loss = lse(x) - x[t]` per row, `dx = g (softmax(x) - onehot(t))` | f32, bf16, f16 | f32 loss, x's dx |
//! | [`cross_entropy_mean`] | `loss = mean_r(lse(x[r]) - x[r][t[r]])`, one node with its `g / N` backward | f32, bf16, f16 | rank-0 f32 loss, x's dx |
//! | [`pre_norm_stack`] / [`mlp_block`] / [`attention_block`] | halves `x ← x + branch(norm(x))` in a row ([`Half`]: GPT-2's attention and MLP, or any [`Layer`]s after a LayerNorm or RMSNorm) as one node under the engine's backward ([`crate::grad_sink`]), the composition elsewhere | x f32 | f32 |
//! | [`post_norm_block`] | `norm(x + branch(x))` (BERT's sub-blocks) likewise | x f32 | f32 |
//!
//! Statistics and arithmetic are f32 whatever the storage dtype, as wick's autocast policy asks
//! for norms and softmax ([`crate::precision`]); storing the output in x's dtype halves the
//! memory traffic of the next matmul, which runs in the compute dtype anyway. Gains and biases
//! are used in f32 (wick keeps them as fp32 masters; other dtypes are cast, differentiably).
//!
//! Why: candle-nn 0.11.1's fused `layer_norm`, `rms_norm` and `softmax_last_dim` are
//! forward-only (autograd silently stops there), and the differentiable compositions
//! (`layer_norm_slow`, `softmax`) cost ten graph nodes and 5–60 ms per call at GPT-2 shapes on an
//! H200. Each op here is one graph node with its own backward. The backward is itself a fused op
//! (one kernel for dx and the parameter-gradient partials, one for the deterministic
//! second-pass reduction); it is not differentiable again (no second-order gradients).
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! # fn main() -> candle_core::Result<()> {
//! let x = Var::new(&[[1f32, 2., 3., 4.]], &Device::Cpu)?;
//! let w = Var::new(&[1f32, 1., 1., 1.], &Device::Cpu)?;
//! let b = Var::new(&[0f32, 0., 0., 0.], &Device::Cpu)?;
//! let y = wick::ops::layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5)?;
//! let got: Vec<f32> = y.flatten_all()?.to_vec1()?;
//! assert!((got[0] + 1.3416).abs() < 1e-4); // (1 - 2.5) / sqrt(1.25)
//! let grads = y.sum_all()?.backward()?;
//! assert!(grads.get(&w).is_some() && grads.get(&b).is_some());
//! # Ok(()) }
//! ```

#[macro_use]
mod common;

mod attention;
mod block;
mod elementwise;
mod linear;
mod loss;
mod norm;

pub use attention::causal::{
    causal_attention, causal_attention_composed, grouped_causal_attention,
    grouped_causal_attention_composed, grouped_window_attention,
};
pub use attention::composed::grouped_attention;
pub use attention::heads::{merge_heads, split_heads};
pub use attention::padded::key_padding_attention;
pub use attention::paged::{paged_attention, PagedSeq};
pub use attention::rotary::{rotary_qkv, rotary_tables, rotary_tables_from_inv_freq};
pub use attention::segments::Segments;
pub use attention::softmax::{
    causal_softmax_last_dim, key_padding_softmax_last_dim, softmax_last_dim,
};
pub use attention::varlen::{grouped_varlen_attention, grouped_varlen_attention_composed};
pub use attention::window::window_causal_attention;
pub use block::layer::{Layer, NormParams};
pub use block::post_norm::post_norm_block;
pub use block::pre_norm::{
    attention_block, mlp_block, pre_norm_composed, pre_norm_stack, AttentionParams, Half, MlpParams,
};
pub use elementwise::bias::bias_add;
pub use elementwise::geglu::geglu_tanh;
pub use elementwise::gelu::{gelu_erf, gelu_tanh};
pub use elementwise::residual::residual_add;
pub use elementwise::swiglu::swiglu;
pub use linear::act_linear::{act_linear, gelu_linear, Activation};
pub use linear::bgmv::bgmv;
pub use linear::dense::linear;
pub use linear::embedding::embedding;
pub use linear::lora::{lora_linear, lora_linear_dropout, lora_linear_grouped};
pub use loss::chunked_cross_entropy::{
    default_chunk_rows, linear_cross_entropy_sum, DEFAULT_CHUNK_LOGITS, IGNORE_INDEX,
};
pub use loss::cross_entropy::{cross_entropy_mean, cross_entropy_rows};
pub use loss::linear_cross_entropy::linear_cross_entropy_rows;
pub use norm::layer_norm::{layer_norm, layer_norm_with_dtype};
pub use norm::qk_norm::qk_rms_norm;
pub use norm::rms_norm::{rms_norm, rms_norm_with_dtype};
