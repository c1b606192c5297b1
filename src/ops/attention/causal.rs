//! Causal self-attention as one differentiable op, from the fused projection to the merged heads:
//!
//! ```text
//! qkv: (B, T, 3C) = [q | k | v], head h at columns h*Dh..(h+1)*Dh of each part, C = H * Dh
//! S_h = (q_h k_h^T) / sqrt(Dh), keys j <= i      P_h = softmax(S_h)      y_h = P_h v_h
//! y: (B, T, C), head h at columns h*Dh..(h+1)*Dh
//! ```
//! the math of PyTorch's `scaled_dot_product_attention(q, k, v, is_causal=True)` with the head
//! split and merge around it. Grouped-query attention (GQA; Ainslie et al. 2023,
//! arXiv:2305.13245, as in Llama 2/3 and SmolLM2) shares each key/value head among
//! `G = H / Hkv` query heads:
//!
//! ```text
//! qkv: (B, T, (H + 2 Hkv) Dh) = [q heads (H Dh) | k heads (Hkv Dh) | v heads (Hkv Dh)]
//! query head h attends with k and v head h / G        y: (B, T, H Dh)
//! ```
//! (`scaled_dot_product_attention(.., is_causal=True, enable_gqa=True)`); `Hkv == H` is the
//! multi-head case above. On CUDA (`Dh == 64`) it is a FlashAttention-2 kernel pair on tensor
//! cores (`kernels/attention.cu`; Dao 2023, arXiv:2307.08691): the `T x T` scores are never
//! stored, K and V are read in place for every query head of their group (never repeated in
//! memory), the forward keeps one f32 log-sum-exp per row, the backward recomputes the
//! probabilities and is deterministic (no atomics: the dK/dV kernel of a key/value head sums
//! over its query heads in registers). Everywhere else the op runs the CPU reference below (CPU
//! tensors), or [`grouped_causal_attention_composed`] (another head width). Softmax and
//! products accumulate in f32; the CUDA kernels round P and dS to the storage dtype (f32: to
//! TF32, or split into two TF32 parts in 3xTF32) before their products, as FlashAttention does.
//!
//! On compute capability 9.0 (H100, H200) bf16 and f16 take the same kernels built on Hopper's
//! warpgroup MMA (`kernels/attention_sm90a.cu`: `wgmma.m64n64k16` reading 128-byte-swizzled
//! shared memory, where the sm_80 build issues `mma.sync`); the tiling, the online softmax, the
//! order of the sums over tiles and the determinism are the same. `WICK_ATTENTION_KERNELS=mma`
//! (read once per process) selects the `mma.sync` build there too, for comparisons. There the
//! tiles are loaded by the bulk tensor copy engine (TMA: one instruction per 64 x 64 tile from
//! a tensor map, [`crate::cuda::tensor_map`], completion counted on an mbarrier), where the
//! other builds have every thread issue `cp.async` copies; the backward keeps the `cp.async`
//! kernels when T is not a multiple of 4 (the L and D rows' tensor maps need a 16-byte row
//! pitch), and `WICK_ATTENTION_LOADS=cp` selects them everywhere, for comparisons.
//!
//! The same kernels take two per-query lower bounds on the keys: a sliding window
//! ([`grouped_window_attention`]) and the documents of a packed row
//! ([`crate::ops::grouped_varlen_attention`], FlashAttention's varlen `cu_seqlens`: the per-token
//! tables of [`crate::ops::Segments`], read by the kernels, null for one document); whole tiles below
//! every row's bound are skipped and the tiles that cross it masked. The score scale is an
//! argument of the kernels (`1 / sqrt(Dh)` unless the varlen op is given another).
//!
//! f32 runs on TF32 tensor cores in one of two modes, chosen when the forward runs:
//! - where f32 GEMMs may use TF32 (candle's `gemm_reduced_precision_f32`, which
//!   [`crate::perf::PerfSettings`]`::tf32` sets; PyTorch's `allow_tf32`), every product takes
//!   TF32 operands (10 mantissa bits), as the projections around it do;
//! - otherwise 3xTF32: each operand is split into a TF32 value and a TF32 remainder and three
//!   products are summed (CUTLASS's `OpMultiplyAddFastF32`, which PyTorch's memory-efficient
//!   attention uses for f32), about f32's accuracy at three times the tensor-core work.

use super::composed::grouped_attention;
use super::heads::{merge_heads, split_heads};
use super::qkv::split_qkv;
use super::segments::Segments;
use super::softmax::causal_softmax_last_dim;
use crate::ops::common::{check_float, cpu_slice, Elem, SideOutput};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;
use std::sync::Arc;

/// Fused, differentiable causal self-attention of a fused projection `qkv: (B, T, 3C)` with
/// `n_head` heads of `Dh = C / n_head`; returns `(B, T, C)` in qkv's dtype (f32, bf16 or f16),
/// heads merged. Scale `1 / sqrt(Dh)`; query `t` attends to keys `0..=t`.
///
/// One graph node: on CUDA with `Dh == 64`, compute capability 8.0 or newer, `B*H <= 65535`
/// and `B*T*3C < 2^31`, the flash-attention kernels (memory O(B·T·C), no score tensor; f32 on
/// TF32 tensor cores, in the mode the module docs describe); on the CPU, a reference implementation in f32 (one rayon task per `(b, h)`);
/// otherwise the composition [`causal_attention_composed`] (several nodes, scores
/// materialised). Not twice differentiable. This is [`grouped_causal_attention`] with
/// `n_kv_head == n_head` (the same kernels, one query head per key/value head).
///
/// Errors (no panics): qkv not rank 3, a last dimension that is not `3 * n_head * Dh`,
/// `n_head == 0`, a non-float dtype. An empty `qkv` (B or T zero) gives an empty result.
pub fn causal_attention(qkv: &Tensor, n_head: usize) -> Result<Tensor> {
    dims(qkv, n_head)?;
    grouped_causal_attention(qkv, n_head, n_head)
}

/// Fused, differentiable grouped-query causal self-attention of a fused projection
/// `qkv: (B, T, (H + 2 Hkv) Dh)` with `H = n_head` query heads and `Hkv = n_kv_head` key/value
/// heads (columns `[q heads | k heads | v heads]`, head h of a part at columns
/// `h Dh..(h + 1) Dh` of it; q and k already rotated, e.g. by [`crate::ops::rotary_qkv`]); returns
/// `(B, T, H Dh)` in qkv's dtype (f32, bf16 or f16), heads merged. Query head h uses key/value
/// head `h / (H / Hkv)`; scale `1 / sqrt(Dh)`; query `t` attends to keys `0..=t`: PyTorch's
/// `scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)`.
/// `n_kv_head == n_head` is [`causal_attention`].
///
/// One graph node: on CUDA with `Dh == 64`, compute capability 8.0 or newer, `B*H <= 65535`
/// and `B*T*(H + 2 Hkv)*Dh < 2^31`, the flash-attention kernels (K and V read in place, memory
/// O(B·T·(H + 2 Hkv)·Dh), no score tensor; f32 on TF32 tensor cores, in the mode the module
/// docs describe); on the CPU, a reference
/// implementation in f32 (one rayon task per `(b, query head)`, the key/value gradients summed
/// over each group in a fixed order); otherwise the composition
/// [`grouped_causal_attention_composed`]. Not twice differentiable.
///
/// Errors (no panics): qkv not rank 3, `n_head` or `n_kv_head` zero, `n_head` not a multiple
/// of `n_kv_head`, a last dimension that is not `(n_head + 2 n_kv_head) * Dh`, a non-float
/// dtype. An empty `qkv` (B or T zero) gives an empty result.
pub fn grouped_causal_attention(qkv: &Tensor, n_head: usize, n_kv_head: usize) -> Result<Tensor> {
    grouped_window_attention(qkv, n_head, n_kv_head, None)
}

/// [`grouped_causal_attention`] with a sliding window: query `i` attends to keys `j` with
/// `j <= i` and `i - j < W` (`W = window`, keys counted including the query's own;
/// transformers' `sliding_window` as Mistral, Qwen2 and Gemma 3 use it). `None`, or a window
/// of at least T, is [`grouped_causal_attention`] exactly (the same kernels, bit for bit).
///
/// The same single node, layouts, kernels and limits: the CPU reference skips the keys outside
/// the window; the CUDA kernels (forward, dK/dV and dQ, on `mma.sync` and on Hopper's wgmma)
/// mask the scores of keys `i - j >= W` inside the tiles that cross the window's edge and skip
/// the key (or query) tiles entirely outside every row's window, so the work is O(T W) rather
/// than O(T^2). Where the kernels do not apply (another head width on CUDA, other devices) it
/// is the composition [`crate::ops::grouped_attention`] (scores materialised).
///
/// Errors (no panics): as [`grouped_causal_attention`], and `window == Some(0)` (every key
/// masked).
pub fn grouped_window_attention(
    qkv: &Tensor,
    n_head: usize,
    n_kv_head: usize,
    window: Option<usize>,
) -> Result<Tensor> {
    let d = grouped_dims(qkv, n_head, n_kv_head)?;
    let window = binding_window("grouped_window_attention", window, d.t)?;
    if d.b * d.t == 0 {
        return Tensor::zeros((d.b, d.t, d.c()), qkv.dtype(), qkv.device());
    }
    match (fused(qkv, d, Masks::window(window))?, window) {
        (Some((y, _)), _) => Ok(y),
        (None, None) => grouped_causal_attention_composed(qkv, n_head, n_kv_head),
        (None, Some(w)) => {
            let (q, k, v) = split_qkv(qkv, n_head, n_kv_head, d.dh)?;
            grouped_attention(&q, &k, &v, 0, Some(w), 1.0 / (d.dh as f64).sqrt())
        }
    }
}

/// The window where it binds (`W < T`); `None` where every earlier key is seen. Refuses
/// `Some(0)`.
pub(in crate::ops) fn binding_window(
    op: &str,
    window: Option<usize>,
    t: usize,
) -> Result<Option<usize>> {
    match window {
        Some(0) => {
            bail!("{op}: window Some(0) masks every key; use None (no window) or a window >= 1")
        }
        Some(w) if w < t => Ok(Some(w)),
        _ => Ok(None),
    }
}

/// The attention op of a fused node, kept by a block op that calls its `bwd` itself.
pub(in crate::ops) type AttentionOp = Arc<Box<dyn CustomOp1 + Send + Sync>>;

/// [`grouped_causal_attention`]'s one-node form, with the op that ran it, for a non-empty
/// `qkv`; `None` where that function takes the composition (head width other than 64, older
/// GPUs, other devices).
pub(in crate::ops) fn fused_attention(
    qkv: &Tensor,
    n_head: usize,
    n_kv_head: usize,
    window: Option<usize>,
) -> Result<Option<(Tensor, AttentionOp)>> {
    let d = grouped_dims(qkv, n_head, n_kv_head)?;
    let window = binding_window("grouped_window_attention", window, d.t)?;
    fused(qkv, d, Masks::window(window))
}

/// What a fused attention node adds to plain causal attention at the default scale.
#[derive(Clone, Debug, Default)]
pub(in crate::ops) struct Masks {
    /// Keys seen per query (its own included) where that is fewer than T; `None`: causal.
    pub window: Option<usize>,
    /// The score scale; `None`: `1 / sqrt(Dh)`.
    pub scale: Option<f64>,
    /// Documents of a packed row (FlashAttention's varlen `cu_seqlens`): query i sees no key
    /// before `first_key[i]`; `None`: one document.
    pub segments: Option<Segments>,
}

impl Masks {
    fn window(window: Option<usize>) -> Self {
        Self {
            window,
            ..Self::default()
        }
    }

    /// The score scale as the kernels and the CPU reference use it.
    fn scale(&self, d: Dims) -> f32 {
        match self.scale {
            Some(s) => s as f32,
            None => 1.0 / (d.dh as f32).sqrt(),
        }
    }

    /// The first key of each query's document on the host (CPU reference).
    fn first_keys(&self) -> Option<&[u32]> {
        self.segments.as_ref().map(Segments::first_key_host)
    }
}

/// [`fused_attention`] for dimensions already checked, a window that binds (or `None`), a
/// checked scale and segments on qkv's device whose length is T.
pub(in crate::ops) fn fused_with(
    qkv: &Tensor,
    n_head: usize,
    n_kv_head: usize,
    masks: Masks,
) -> Result<Option<(Tensor, AttentionOp)>> {
    let d = grouped_dims(qkv, n_head, n_kv_head)?;
    fused(qkv, d, masks)
}

/// [`fused_attention`] for dimensions already checked and a window that binds (or `None`).
fn fused(qkv: &Tensor, d: Dims, masks: Masks) -> Result<Option<(Tensor, AttentionOp)>> {
    let fused = match qkv.device() {
        candle_core::Device::Cpu => true,
        candle_core::Device::Cuda(dev) => {
            d.dh == HEAD_DIM
                && matches!(qkv.dtype(), DType::BF16 | DType::F16 | DType::F32)
                && cuda_kernels_apply(dev, d)
        }
        _ => false,
    };
    if !fused || d.b * d.t == 0 {
        return Ok(None);
    }
    let op: AttentionOp = Arc::new(Box::new(Attention {
        n_head: d.h,
        n_kv_head: d.hkv,
        masks,
        // f32 on TF32 operands where f32 GEMMs may use TF32 (candle's switch)
        tf32: candle_core::cuda::gemm_reduced_precision_f32(),
        lse: SideOutput::default(),
    }));
    let y = qkv.contiguous()?.apply_op1_arc(op.clone())?;
    Ok(Some((y, op)))
}

/// The same attention as [`causal_attention`] composed of separate differentiable ops:
/// [`crate::ops::split_heads`], `q / sqrt(Dh)`, `q @ k^T`, [`crate::ops::causal_softmax_last_dim`],
/// `@ v`, [`crate::ops::merge_heads`]. The `(B, H, T, T)` scores and probabilities are materialised
/// in qkv's dtype. Used where the fused kernels do not apply (`Dh != 64` on CUDA) and as the
/// independent reference in tests. For a power-of-two `Dh` the scaling of `q` is exact.
///
/// Errors: as [`causal_attention`].
pub fn causal_attention_composed(qkv: &Tensor, n_head: usize) -> Result<Tensor> {
    let (_, _, c) = dims(qkv, n_head)?;
    let heads = split_heads(qkv, n_head)?; // (3, B, H, T, Dh)
    let q = heads
        .get(0)?
        .affine(1.0 / ((c / n_head) as f64).sqrt(), 0.0)?;
    let att = causal_softmax_last_dim(&q.matmul(&heads.get(1)?.t()?)?)?;
    merge_heads(&att.matmul(&heads.get(2)?)?)
}

/// The same attention as [`grouped_causal_attention`] composed of separate differentiable
/// ops, with the key/value heads repeated: `narrow` to each part, `reshape` / `transpose` to
/// `(B, heads, T, Dh)`, each k and v head broadcast to the `H / Hkv` query heads of its group
/// (the gradient sums over them), then as [`causal_attention_composed`]: `q / sqrt(Dh)`,
/// `q @ k^T`, [`crate::ops::causal_softmax_last_dim`], `@ v`, [`crate::ops::merge_heads`]. With
/// `n_kv_head == n_head` it is [`causal_attention_composed`]. Used where the fused kernels do
/// not apply (`Dh != 64` on CUDA) and as the independent reference in tests.
///
/// Errors: as [`grouped_causal_attention`].
pub fn grouped_causal_attention_composed(
    qkv: &Tensor,
    n_head: usize,
    n_kv_head: usize,
) -> Result<Tensor> {
    let d = grouped_dims(qkv, n_head, n_kv_head)?;
    if n_kv_head == n_head {
        return causal_attention_composed(qkv, n_head);
    }
    let (b, t, dh, g) = (d.b, d.t, d.dh, d.h / d.hkv);
    // (B, heads, T, Dh) of the `heads` heads starting at head column `first`
    let part = |first: usize, heads: usize| {
        qkv.narrow(2, first * dh, heads * dh)?
            .reshape((b, t, heads, dh))?
            .transpose(1, 2)
    };
    // each key/value head repeated for the query heads of its group: (B, H, T, Dh)
    let repeat = |x: Tensor| {
        x.unsqueeze(2)?
            .broadcast_as((b, d.hkv, g, t, dh))?
            .reshape((b, d.h, t, dh))
    };
    let q = part(0, d.h)?
        .contiguous()?
        .affine(1.0 / (dh as f64).sqrt(), 0.0)?;
    let k = repeat(part(d.h, d.hkv)?)?;
    let v = repeat(part(d.h + d.hkv, d.hkv)?)?;
    let att = causal_softmax_last_dim(&q.matmul(&k.t()?)?)?;
    merge_heads(&att.matmul(&v)?)
}

/// Whether the CUDA kernels take this problem: tensor-core `mma.sync` with bf16/f16/TF32 needs
/// compute capability 8.0 or newer; `B*H` goes on the grid's y dimension (at most 65535) and
/// the kernels index rows with 32-bit integers. Outside these limits the composed path runs.
#[cfg(feature = "cuda")]
fn cuda_kernels_apply(dev: &candle_core::CudaDevice, d: Dims) -> bool {
    let cc = dev.cuda_stream().context().compute_capability();
    let sm80 = cc.is_ok_and(|(major, _)| major >= 8);
    sm80 && d.b * d.h <= 65535 && d.b * d.t * d.w() <= i32::MAX as usize
}

/// Without the `cuda` feature there are no kernels.
#[cfg(not(feature = "cuda"))]
fn cuda_kernels_apply(_dev: &candle_core::CudaDevice, _d: Dims) -> bool {
    false
}

/// Head width of the CUDA kernels (`ATT_D` in kernels/attention.cu).
const HEAD_DIM: usize = 64;

/// `(B, T, C)` of a valid `qkv`.
fn dims(qkv: &Tensor, n_head: usize) -> Result<(usize, usize, usize)> {
    check_float("causal_attention", "qkv", qkv.dtype())?;
    let (b, t, c3) = match qkv.dims() {
        &[b, t, c3] => (b, t, c3),
        d => bail!("causal_attention: qkv must be (B, T, 3C), found shape {d:?}"),
    };
    if n_head == 0 || c3 == 0 || c3 % (3 * n_head) != 0 {
        bail!(
            "causal_attention: qkv's last dimension {c3} must be 3 * n_head * head_dim with \
             n_head = {n_head} (and head_dim >= 1)"
        )
    }
    Ok((b, t, c3 / 3))
}

/// The problem shape of a valid grouped `qkv`.
fn grouped_dims(qkv: &Tensor, n_head: usize, n_kv_head: usize) -> Result<Dims> {
    let op = "grouped_causal_attention";
    check_float(op, "qkv", qkv.dtype())?;
    let (b, t, w) = match qkv.dims() {
        &[b, t, w] => (b, t, w),
        d => bail!(
            "{op}: qkv must be (B, T, (n_head + 2 * n_kv_head) * head_dim), found shape {d:?}"
        ),
    };
    if n_head == 0 || n_kv_head == 0 || n_head % n_kv_head != 0 {
        bail!(
            "{op}: n_head = {n_head} must be a positive multiple of n_kv_head = {n_kv_head} \
             (each key/value head serves n_head / n_kv_head query heads)"
        )
    }
    let heads = n_head + 2 * n_kv_head;
    if w == 0 || w % heads != 0 {
        bail!(
            "{op}: qkv's last dimension {w} must be (n_head + 2 * n_kv_head) * head_dim with \
             n_head = {n_head}, n_kv_head = {n_kv_head} (and head_dim >= 1)"
        )
    }
    Ok(Dims {
        b,
        t,
        h: n_head,
        hkv: n_kv_head,
        dh: w / heads,
    })
}

/// The forward op. On CUDA it leaves the rows' log-sum-exp in `lse` for the backward; `tf32`:
/// f32 products on plain TF32 operands (else 3xTF32), fixed for the forward and its backward.
struct Attention {
    n_head: usize,
    n_kv_head: usize,
    masks: Masks,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    tf32: bool,
    lse: SideOutput,
}

/// The backward op: `(qkv, y, dy) → dqkv`; `lse` and `tf32` are the forward's (CUDA only).
struct AttentionBwd {
    n_head: usize,
    n_kv_head: usize,
    masks: Masks,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    tf32: bool,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    lse: Option<Tensor>,
}

/// Problem shape: batch, sequence, query heads, key/value heads, head width.
#[derive(Clone, Copy, Debug)]
struct Dims {
    b: usize,
    t: usize,
    h: usize,
    hkv: usize,
    dh: usize,
}

impl Dims {
    fn of(l: &Layout, n_head: usize, n_kv_head: usize) -> Result<Self> {
        let heads = n_head + 2 * n_kv_head;
        match l.dims() {
            &[b, t, w] if w % heads == 0 && n_head % n_kv_head == 0 => Ok(Self {
                b,
                t,
                h: n_head,
                hkv: n_kv_head,
                dh: w / heads,
            }),
            d => bail!("causal_attention: qkv has shape {d:?} (internal error)"),
        }
    }
    /// Width of the output rows (the query heads).
    fn c(&self) -> usize {
        self.h * self.dh
    }
    /// Width of the qkv rows.
    fn w(&self) -> usize {
        (self.h + 2 * self.hkv) * self.dh
    }
    /// First column in a qkv row of query head `head` (part 0), or of key/value head `head`'s
    /// keys (part 1) or values (part 2).
    fn col(&self, part: usize, head: usize) -> usize {
        match part {
            0 => head * self.dh,
            1 => (self.h + head) * self.dh,
            _ => (self.h + self.hkv + head) * self.dh,
        }
    }
}

/// Offsets of the `T` rows (`Dh` elements each) of head `hi` of batch row `bi` in a
/// `(B, T, width)` matrix whose heads start at column `col` (q, k or v of qkv; y; dy).
fn head_rows(
    d: Dims,
    bi: usize,
    hi: usize,
    width: usize,
    col: usize,
) -> impl Iterator<Item = usize> {
    (0..d.t).map(move |ti| (bi * d.t + ti) * width + col + hi * d.dh)
}

/// One head's rows as an f32 `(T, Dh)` matrix.
fn get_head<T: Elem>(src: &[T], rows: impl Iterator<Item = usize>, dh: usize) -> Vec<f32> {
    rows.flat_map(|r| src[r..r + dh].iter().map(|v| v.to32()))
        .collect()
}

/// Writes one head's f32 `(T, Dh)` matrix to its rows of `out`.
fn put_head<T: Elem>(out: &mut [T], m: &[f32], rows: impl Iterator<Item = usize>, dh: usize) {
    for (r, src) in rows.zip(m.chunks(dh)) {
        for (o, v) in out[r..r + dh].iter_mut().zip(src) {
            *o = T::from32(*v);
        }
    }
}

/// Query head `hi`'s q and its key/value head's k and v as f32 `(T, Dh)` matrices.
fn head_qkv<T: Elem>(qkv: &[T], d: Dims, bi: usize, hi: usize) -> [Vec<f32>; 3] {
    let kvh = hi / (d.h / d.hkv);
    std::array::from_fn(|part| {
        let col = d.col(part, if part == 0 { hi } else { kvh });
        get_head(qkv, head_rows(d, bi, 0, d.w(), col), d.dh)
    })
}

/// The first key query `i` sees: `0`, or `i + 1 - W` with a window of W keys, and not before
/// the first token of its document (`docs[i]`, packed rows).
fn first_key(i: usize, window: Option<usize>, docs: Option<&[u32]>) -> usize {
    let w = window.map_or(0, |w| (i + 1).saturating_sub(w));
    docs.map_or(w, |f| w.max(f[i] as usize))
}

/// Row `i` of one head's probabilities (keys `lo..=i`, `lo` = [`first_key`]), f32.
fn probs(q: &[f32], k: &[f32], i: usize, lo: usize, dh: usize, scale: f32) -> Vec<f32> {
    let qi = &q[i * dh..(i + 1) * dh];
    let mut p: Vec<f32> = (lo..=i)
        .map(|j| {
            let kj = &k[j * dh..(j + 1) * dh];
            scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f32>()
        })
        .collect();
    let m = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0;
    for v in &mut p {
        *v = (*v - m).exp();
        s += *v;
    }
    for v in &mut p {
        *v /= s;
    }
    p
}

/// CPU reference forward: `(B, T, (H + 2 Hkv) Dh)` → `(B, T, H Dh)`, one rayon task per
/// `(b, query head)`.
fn fwd_cpu<T: Elem>(qkv: &[T], d: Dims, masks: &Masks) -> Vec<T> {
    let (scale, window, docs) = (masks.scale(d), masks.window, masks.first_keys());
    let heads: Vec<Vec<f32>> = (0..d.b * d.h)
        .into_par_iter()
        .map(|bh| {
            let [q, k, v] = head_qkv(qkv, d, bh / d.h, bh % d.h);
            let mut y = vec![0f32; d.t * d.dh];
            for i in 0..d.t {
                let lo = first_key(i, window, docs);
                let p = probs(&q, &k, i, lo, d.dh, scale);
                let yi = &mut y[i * d.dh..(i + 1) * d.dh];
                for (j, pj) in (lo..).zip(&p) {
                    for (o, vv) in yi.iter_mut().zip(&v[j * d.dh..(j + 1) * d.dh]) {
                        *o += pj * vv;
                    }
                }
            }
            y
        })
        .collect();
    let c = d.c();
    let mut out = vec![T::from32(0.0); d.b * d.t * c];
    for (bh, y) in heads.iter().enumerate() {
        put_head(&mut out, y, head_rows(d, bh / d.h, bh % d.h, c, 0), d.dh);
    }
    out
}

/// CPU reference backward: `(qkv, dy)` → `dqkv`, recomputing the probabilities:
/// `dP = dy v^T`, `dS = P (dP - rowsum(dy * y))`, `dq = scale dS k`, `dk = scale dS^T q`,
/// `dv = P^T dy` per query head (one rayon task each); the dk and dv of the query heads of a
/// group are then summed in head order into their key/value head (deterministic).
fn bwd_cpu<T: Elem>(qkv: &[T], dy: &[T], d: Dims, masks: &Masks) -> Vec<T> {
    let (scale, window, docs) = (masks.scale(d), masks.window, masks.first_keys());
    let c = d.c();
    let dh = d.dh;
    let heads: Vec<[Vec<f32>; 3]> = (0..d.b * d.h)
        .into_par_iter()
        .map(|bh| {
            let (bi, hi) = (bh / d.h, bh % d.h);
            let [q, k, v] = head_qkv(qkv, d, bi, hi);
            let g_all = get_head(dy, head_rows(d, bi, hi, c, 0), dh);
            let (mut dq, mut dk, mut dv) = (
                vec![0f32; d.t * dh],
                vec![0f32; d.t * dh],
                vec![0f32; d.t * dh],
            );
            for i in 0..d.t {
                let lo = first_key(i, window, docs);
                let p = probs(&q, &k, i, lo, dh, scale);
                let g = &g_all[i * dh..(i + 1) * dh];
                let dp: Vec<f32> = (lo..=i)
                    .map(|j| g.iter().zip(&v[j * dh..]).map(|(a, b)| a * b).sum())
                    .collect();
                let dsum: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum(); // = dy_i . y_i
                for j in lo..=i {
                    let (pj, dpj) = (p[j - lo], dp[j - lo]);
                    let ds = pj * (dpj - dsum);
                    for e in 0..dh {
                        dq[i * dh + e] += scale * ds * k[j * dh + e];
                        dk[j * dh + e] += scale * ds * q[i * dh + e];
                        dv[j * dh + e] += pj * g[e];
                    }
                }
            }
            [dq, dk, dv]
        })
        .collect();
    let g = d.h / d.hkv;
    let mut out = vec![T::from32(0.0); d.b * d.t * d.w()];
    for (bh, [dq, _, _]) in heads.iter().enumerate() {
        let rows = head_rows(d, bh / d.h, 0, d.w(), d.col(0, bh % d.h));
        put_head(&mut out, dq, rows, dh);
    }
    for bk in 0..d.b * d.hkv {
        let (bi, kvh) = (bk / d.hkv, bk % d.hkv);
        let group = &heads[bi * d.h + kvh * g..][..g];
        for part in 1..3 {
            let mut sum = group[0][part].clone();
            for member in &group[1..] {
                for (s, v) in sum.iter_mut().zip(&member[part]) {
                    *s += v;
                }
            }
            put_head(
                &mut out,
                &sum,
                head_rows(d, bi, 0, d.w(), d.col(part, kvh)),
                dh,
            );
        }
    }
    out
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        "causal_attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let d = Dims::of(l, self.n_head, self.n_kv_head)?;
        macro_rules! run {
            ($t:ty) => {{
                let x = cpu_slice::<$t>(op, "qkv", s, l)?;
                <$t as candle_core::WithDType>::to_cpu_storage_owned(fwd_cpu(x, d, &self.masks))
            }};
        }
        Ok((
            with_type!(op, s.dtype(), run),
            Shape::from((d.b, d.t, d.c())),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let d = Dims::of(l, self.n_head, self.n_kv_head)?;
        let (y, lse) = cuda::fwd(s, l, d, &self.masks, self.tf32)?;
        self.lse
            .put(candle_core::Storage::Cuda(lse), d.b * d.h * d.t);
        Ok((y, Shape::from((d.b, d.t, d.c()))))
    }

    fn bwd(&self, qkv: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let dy = if dy.dtype() == y.dtype() {
            dy.contiguous()?
        } else {
            dy.to_dtype(y.dtype())?
        };
        let op = AttentionBwd {
            n_head: self.n_head,
            n_kv_head: self.n_kv_head,
            masks: self.masks.clone(),
            tf32: self.tf32,
            lse: self.lse.get(),
        };
        Ok(Some(qkv.apply_op3_no_bwd(y, &dy, &op)?))
    }
}

impl CustomOp3 for AttentionBwd {
    fn name(&self) -> &'static str {
        "causal_attention_backward"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        _y: &CpuStorage,
        _ly: &Layout,
        dy: &CpuStorage,
        ldy: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let d = Dims::of(l, self.n_head, self.n_kv_head)?;
        if s.dtype() != dy.dtype() {
            bail!(
                "{op}: dy is {:?}, qkv {:?} (internal error)",
                dy.dtype(),
                s.dtype()
            )
        }
        macro_rules! run {
            ($t:ty) => {{
                let x = cpu_slice::<$t>(op, "qkv", s, l)?;
                let g = cpu_slice::<$t>(op, "dy", dy, ldy)?;
                <$t as candle_core::WithDType>::to_cpu_storage_owned(bwd_cpu(x, g, d, &self.masks))
            }};
        }
        Ok((with_type!(op, s.dtype(), run), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        y: &candle_core::CudaStorage,
        ly: &Layout,
        dy: &candle_core::CudaStorage,
        ldy: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let op = self.name();
        let d = Dims::of(l, self.n_head, self.n_kv_head)?;
        let Some(lse) = &self.lse else {
            bail!("{op}: the forward left no log-sum-exp (internal error)")
        };
        let dqkv = crate::cuda::launch::with_saved(op, "log-sum-exp", Some(lse), |lse| {
            let Some(lse) = lse else {
                bail!("{op}: no log-sum-exp (internal error)")
            };
            cuda::bwd(cuda::Args {
                qkv: (s, l),
                y: (y, ly),
                dy: (dy, ldy),
                lse,
                d,
                masks: &self.masks,
                tf32: self.tf32,
            })
        })?;
        Ok((dqkv, l.shape().clone()))
    }
}

/// CUDA launchers for `kernels/attention.cu` (mma.sync, sm_80+) and
/// `kernels/attention_sm90a.cu` (the same kernels on wgmma, Hopper).
#[cfg(feature = "cuda")]
mod cuda {
    use super::{Dims, Masks, Segments, HEAD_DIM};
    use crate::cuda::launch::{alloc, dtype_name, in_ptr, out_ptr, with_saved, In};
    use crate::cuda::tensor_map::TensorMap;
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::sys::CUfunction_attribute;
    use candle_core::cuda::cudarc::driver::{
        CudaFunction, LaunchArgs, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda::WrapErr;
    use candle_core::{bail, CudaStorage, DType, Layout, Result};

    /// Threads per block of the tile kernels (`ATT_THREADS`), rows per tile (`ATT_TILE`).
    const THREADS: u32 = 128;
    const TILE: usize = 64;
    /// Dynamic shared memory of the f32 tile kernels: four staged 64-row tiles of 68 floats
    /// (`AttF32::LD`); the 16-bit mma.sync kernels stage theirs in static shared memory.
    const F32_SMEM: u32 = 4 * TILE as u32 * 68 * 4;
    /// Dynamic shared memory of the wgmma kernels: 64-row tiles of 128 bytes, four staged and
    /// the block's own rows (one in the forward, two in the backward), and 1 KiB to align them
    /// to 1024 bytes. The forward's 41 KiB let 5 blocks share an SM.
    const WGMMA_SMEM_FWD: u32 = 5 * TILE as u32 * 128 + 1024;
    const WGMMA_SMEM_BWD: u32 = 6 * TILE as u32 * 128 + 1024;
    /// The TMA kernels' tile: 64 rows x 64 head columns.
    const TILE_BOX: [u32; 2] = [TILE as u32, HEAD_DIM as u32];

    /// One build of the kernels: its module, PTX, entry-name suffix and the dynamic shared
    /// memory of its forward and backward tile kernels.
    struct Kernels {
        module: &'static str,
        /// The kernels load their tiles with the bulk tensor copy engine (`attn_*_tma_*`,
        /// sm_90a only), from tensor maps of their inputs.
        tma: bool,
        ptx: &'static str,
        suffix: &'static str,
        smem_fwd: u32,
        smem_bwd: u32,
    }

    impl Kernels {
        /// The wgmma build for bf16/f16 on compute capability 9.0 (its PTX targets sm_90a,
        /// which runs there only), unless `WICK_ATTENTION_KERNELS=mma` asks for the mma.sync
        /// build (a diagnostic switch for comparisons); the mma.sync build otherwise.
        fn pick(
            op: &str,
            d: Dims,
            dev: &candle_core::CudaDevice,
            dtype: DType,
            tf32: bool,
        ) -> Result<Self> {
            let suffix = check(op, d, dtype, tf32)?;
            let hopper = dev.cuda_stream().context().compute_capability().ok() == Some((9, 0));
            if hopper && dtype != DType::F32 && !mma_forced() {
                return Ok(Self {
                    module: "wick_ops_attention_sm90a",
                    tma: !cp_async_forced(),
                    ptx: crate::cuda::ptx::ATTENTION_SM90A,
                    suffix,
                    smem_fwd: WGMMA_SMEM_FWD,
                    smem_bwd: WGMMA_SMEM_BWD,
                });
            }
            Ok(Self {
                module: "wick_ops_attention",
                tma: false,
                ptx: crate::cuda::ptx::ATTENTION,
                suffix,
                smem_fwd: if dtype == DType::F32 { F32_SMEM } else { 0 },
                smem_bwd: if dtype == DType::F32 { F32_SMEM } else { 0 },
            })
        }

        /// The entry `name` of this build (candle loads the module once per device).
        fn entry(&self, name: &str) -> String {
            format!("{name}_{}", self.suffix)
        }
    }

    /// `WICK_ATTENTION_KERNELS=mma`, read once.
    fn mma_forced() -> bool {
        static FORCED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *FORCED.get_or_init(|| {
            std::env::var("WICK_ATTENTION_KERNELS").is_ok_and(|v| v.eq_ignore_ascii_case("mma"))
        })
    }

    /// `WICK_ATTENTION_LOADS=cp`: the wgmma build's kernels loading their tiles with every
    /// thread's cp.async rather than the bulk tensor copy engine (a diagnostic switch for
    /// comparisons), read once.
    fn cp_async_forced() -> bool {
        static FORCED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *FORCED.get_or_init(|| {
            std::env::var("WICK_ATTENTION_LOADS").is_ok_and(|v| v.eq_ignore_ascii_case("cp"))
        })
    }

    /// The backward's inputs.
    pub(super) struct Args<'a> {
        pub qkv: In<'a>,
        pub y: In<'a>,
        pub dy: In<'a>,
        pub lse: In<'a>,
        pub d: Dims,
        /// The window where it binds, the scale, the documents of a packed row.
        pub masks: &'a Masks,
        pub tf32: bool,
    }

    /// A contiguous copy at offset 0 of an input whose first element is not 16-byte aligned
    /// (the kernels load 16-byte vectors); `None` when the input can be used as it is.
    fn realign((s, l): In<'_>) -> Result<Option<(CudaStorage, Layout)>> {
        if (l.start_offset() * s.dtype().size_in_bytes()) % 16 == 0 {
            return Ok(None);
        }
        let mut fresh = alloc(s.device(), s.dtype(), l.shape().elem_count())?;
        s.copy_strided_src(&mut fresh, 0, l)?;
        Ok(Some((fresh, Layout::contiguous(l.shape()))))
    }

    /// Launch shape of the tile kernels: one block per 64-row tile and per (batch row, head),
    /// `heads` being the query heads (forward, dQ) or the key/value heads (dK/dV).
    fn tile_cfg(d: Dims, heads: usize, smem: u32) -> Result<LaunchConfig> {
        let bh = d.b * d.h;
        if bh > 65535 || d.t > i32::MAX as usize / 4 || d.b * d.t * d.w() > i32::MAX as usize {
            bail!(
                "causal_attention: B*H = {bh} (at most 65535) or T = {} too large for the CUDA \
                 kernels; split the batch",
                d.t
            )
        }
        Ok(LaunchConfig {
            grid_dim: (d.t.div_ceil(TILE) as u32, (d.b * heads) as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem,
        })
    }

    /// Allows a tile kernel the dynamic shared memory `cfg` asks for (past the default 48 KiB
    /// for f32 and wgmma; every sm_80+ GPU offers at least 163 KiB per block).
    fn allow_smem(func: &CudaFunction, cfg: &LaunchConfig) -> Result<()> {
        if cfg.shared_mem_bytes > 0 {
            func.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                cfg.shared_mem_bytes as i32,
            )
            .w()?;
        }
        Ok(())
    }

    /// The arguments after the inputs of the backward's dK/dV and dQ kernels, the same in every
    /// build: `(dqkv, T, H, Hkv, scale2, scale, W, first_key, last_query)`.
    #[allow(clippy::type_complexity)]
    fn push_tail<'a>(
        lb: &mut LaunchArgs<'a>,
        a: &'a (u64, i32, i32, i32, f32, f32, i32, u64, u64),
    ) {
        lb.arg(&a.0)
            .arg(&a.1)
            .arg(&a.2)
            .arg(&a.3)
            .arg(&a.4)
            .arg(&a.5)
            .arg(&a.6)
            .arg(&a.7)
            .arg(&a.8);
    }

    /// Runs `f` with the device addresses of the documents' `(first_key, last_query)` tables
    /// (`(T,)` u32, read as int by the kernels), `(0, 0)` (null: one document) without
    /// segments; the tables stay borrowed for the whole of `f`.
    fn with_tables<R>(
        op: &str,
        masks: &Masks,
        stream: &candle_core::cuda::cudarc::driver::CudaStream,
        f: impl FnOnce(u64, u64) -> Result<R>,
    ) -> Result<R> {
        let seg = masks.segments.as_ref();
        with_saved(op, "first_key", seg.map(Segments::first_key), |fk| {
            with_saved(op, "last_query", seg.map(Segments::last_query), |lq| {
                let fk = fk
                    .map(|(s, l)| in_ptr(op, "first_key", s, l, stream))
                    .transpose()?;
                let lq = lq
                    .map(|(s, l)| in_ptr(op, "last_query", s, l, stream))
                    .transpose()?;
                f(
                    fk.as_ref().map_or(0, |p| p.0),
                    lq.as_ref().map_or(0, |p| p.0),
                )
            })
        })
    }

    /// The kernels' window argument W: keys seen per query, `i32::MAX` where every earlier key
    /// is seen (no tile is then skipped or window-masked: the causal kernels' work exactly).
    fn window_arg(window: Option<usize>, d: Dims) -> i32 {
        match window {
            Some(w) if w < d.t => w as i32,
            _ => i32::MAX,
        }
    }

    /// The kernels' name suffix: the dtype's, or `tf32` for f32 on plain TF32 operands.
    fn check(op: &str, d: Dims, dtype: DType, tf32: bool) -> Result<&'static str> {
        if d.hkv == 0 || d.h % d.hkv != 0 {
            bail!(
                "{op}: {} query heads for {} key/value heads (internal error)",
                d.h,
                d.hkv
            )
        }
        if d.dh != HEAD_DIM {
            bail!("{op}: the CUDA kernels take head width {HEAD_DIM}, found {} (internal error: the public function falls back)", d.dh)
        }
        match dtype {
            DType::F32 if tf32 => Ok("tf32"),
            DType::BF16 | DType::F16 | DType::F32 => dtype_name(op, dtype),
            d => {
                bail!("{op}: the CUDA kernels take f32, bf16 or f16, found {d:?} (internal error)")
            }
        }
    }

    /// `(scale * log2(e), scale)`: the kernels' exponent and gradient scales.
    fn scales(d: Dims, masks: &Masks) -> (f32, f32) {
        let scale = masks.scale(d);
        (scale * std::f32::consts::LOG2_E, scale)
    }

    /// `(y, lse)`: y `(B, T, C)` in qkv's dtype, lse f32 `(B*H*T)` in base 2.
    pub(super) fn fwd(
        s: &CudaStorage,
        l: &Layout,
        d: Dims,
        masks: &Masks,
        tf32: bool,
    ) -> Result<(CudaStorage, CudaStorage)> {
        let op = "causal_attention";
        let dev = s.device();
        let kernels = Kernels::pick(op, d, dev, s.dtype(), tf32)?;
        let cfg = tile_cfg(d, d.h, kernels.smem_fwd)?;
        let copy = realign((s, l))?;
        let (s, l) = copy.as_ref().map_or((s, l), |(s, l)| (s, l));
        let mut y = alloc(dev, s.dtype(), d.b * d.t * d.c())?;
        let mut lse = alloc(dev, DType::F32, d.b * d.h * d.t)?;
        let stream = dev.cuda_stream();
        {
            let (xp, _gx) = in_ptr(op, "qkv", s, l, &stream)?;
            let (yp, _gy) = out_ptr(&mut y, &stream)?;
            let (lp, _gl) = out_ptr(&mut lse, &stream)?;
            let name = if kernels.tma {
                "attn_fwd_tma"
            } else {
                "attn_fwd"
            };
            let func =
                dev.get_or_load_custom_func(&kernels.entry(name), kernels.module, kernels.ptx)?;
            allow_smem(&func, &cfg)?;
            let (t, h, hkv) = (d.t as i32, d.h as i32, d.hkv as i32);
            let (scale2, _) = scales(d, masks);
            let map = if kernels.tma {
                // qkv as (B, T, W) read in 64 x 64 tiles (kernels/attention_sm90a.cu)
                Some(TensorMap::swizzled_128b(
                    xp,
                    s.dtype(),
                    [d.b, d.t, d.w()],
                    TILE_BOX,
                )?)
            } else {
                None
            };
            let win = window_arg(masks.window, d);
            with_tables(op, masks, &stream, |first_key, _| {
                let mut lb = func.builder();
                match &map {
                    Some(map) => lb.arg(map),
                    None => lb.arg(&xp),
                };
                lb.arg(&yp)
                    .arg(&lp)
                    .arg(&t)
                    .arg(&h)
                    .arg(&hkv)
                    .arg(&scale2)
                    .arg(&win)
                    .arg(&first_key);
                // SAFETY: qkv holds B*T*(H + 2 Hkv)*64 elements (16-byte aligned; the tensor map
                // describes exactly those), y B*T*C, lse B*H*T floats; H is a multiple of Hkv
                // (checked); first_key is null or T u32 (the public function checks its length).
                unsafe { lb.launch(cfg) }.w()?;
                Ok(())
            })?;
        }
        Ok((y, lse))
    }

    /// `dqkv: (B, T, 3C)` in qkv's dtype.
    pub(super) fn bwd(a: Args<'_>) -> Result<CudaStorage> {
        let op = "causal_attention_backward";
        let d = a.d;
        if a.dy.0.dtype() != a.qkv.0.dtype() || a.y.0.dtype() != a.qkv.0.dtype() {
            bail!("{op}: y and dy must have qkv's dtype (internal error)")
        }
        let dtype = a.qkv.0.dtype();
        let kernels = Kernels::pick(op, d, a.qkv.0.device(), dtype, a.tf32)?;
        let cfgs = [
            tile_cfg(d, d.hkv, kernels.smem_bwd)?,
            tile_cfg(d, d.h, kernels.smem_bwd)?,
        ];
        let (cq, cy, cdy) = (realign(a.qkv)?, realign(a.y)?, realign(a.dy)?);
        let (qs, ql) = cq.as_ref().map_or(a.qkv, |(s, l)| (s, l));
        let (ys, yl) = cy.as_ref().map_or(a.y, |(s, l)| (s, l));
        let (gs, gl) = cdy.as_ref().map_or(a.dy, |(s, l)| (s, l));
        let dev = qs.device();
        let stream = dev.cuda_stream();
        let rows = d.b * d.t * d.h;
        let mut dsum = alloc(dev, DType::F32, rows)?;
        // every element is written once: the q columns by dq, the k and v columns by dkdv
        let mut dqkv = alloc(dev, qs.dtype(), d.b * d.t * d.w())?;
        let load = |name: &str| {
            dev.get_or_load_custom_func(&kernels.entry(name), kernels.module, kernels.ptx)
        };
        {
            let (qp, _gq) = in_ptr(op, "qkv", qs, ql, &stream)?;
            let (yp, _gy) = in_ptr(op, "y", ys, yl, &stream)?;
            let (gp, _gg) = in_ptr(op, "dy", gs, gl, &stream)?;
            let (lp, _gl) = in_ptr(op, "lse", a.lse.0, a.lse.1, &stream)?;
            let (dp, _gd) = out_ptr(&mut dsum, &stream)?;
            let (op_, _go) = out_ptr(&mut dqkv, &stream)?;
            let (t, h, hkv, rows_i) = (d.t as i32, d.h as i32, d.hkv as i32, rows as i32);
            let (scale2, scale) = scales(d, a.masks);
            // D = rowsum(dy * y): 16 bytes of a (b, t, h) row per lane, 8 warps per block
            // striding over the rows (at most 16 blocks per SM of an H100/H200)
            let func = load("attn_bwd_dot")?;
            let mut lb = func.builder();
            lb.arg(&yp).arg(&gp).arg(&dp).arg(&rows_i).arg(&t).arg(&h);
            let rows_per_warp = 32 / (HEAD_DIM / (16 / dtype.size_in_bytes()));
            let dot_cfg = LaunchConfig {
                grid_dim: (rows.div_ceil(8 * rows_per_warp).min(132 * 16) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: y and dy hold B*T*C elements, dsum B*H*T floats.
            unsafe { lb.launch(dot_cfg) }.w()?;
            let win = window_arg(a.masks.window, d);
            with_tables(op, a.masks, &stream, |first_key, last_query| {
                let tail_args = (op_, t, h, hkv, scale2, scale, win, first_key, last_query);
                // dkdv: one block per (key tile, batch row, key/value head); dq: per query head.
                // The TMA kernels read L and D rows through tensor maps, whose row pitch (T floats)
                // must be a multiple of 16 bytes.
                if kernels.tma && d.t % 4 == 0 {
                    let qm = TensorMap::swizzled_128b(qp, dtype, [d.b, d.t, d.w()], TILE_BOX)?;
                    let om = TensorMap::swizzled_128b(gp, dtype, [d.b, d.t, d.c()], TILE_BOX)?;
                    let lm = TensorMap::rows_f32(lp, [d.b * d.h, d.t], TILE as u32)?;
                    let dm = TensorMap::rows_f32(dp, [d.b * d.h, d.t], TILE as u32)?;
                    let func = load("attn_bwd_dkdv_tma")?;
                    allow_smem(&func, &cfgs[0])?;
                    let mut lb = func.builder();
                    lb.arg(&qm).arg(&om).arg(&lm).arg(&dm);
                    push_tail(&mut lb, &tail_args);
                    // SAFETY: the maps describe qkv (B, T, (H + 2 Hkv) * 64), dy (B, T, C), lse and
                    // dsum (B*H, T) exactly; dqkv holds B*T*(H + 2 Hkv)*64 elements, of which this
                    // kernel writes the k and v columns.
                    unsafe { lb.launch(cfgs[0]) }.w()?;
                    let func = load("attn_bwd_dq_tma")?;
                    allow_smem(&func, &cfgs[1])?;
                    let mut lb = func.builder();
                    lb.arg(&qm).arg(&om).arg(&lp).arg(&dp);
                    push_tail(&mut lb, &tail_args);
                    // SAFETY: as above; lse and dsum hold B*H*T floats; this kernel writes the q
                    // columns.
                    unsafe { lb.launch(cfgs[1]) }.w()?;
                } else {
                    for (name, cfg) in ["attn_bwd_dkdv", "attn_bwd_dq"].into_iter().zip(cfgs) {
                        let func = load(name)?;
                        allow_smem(&func, &cfg)?;
                        let mut lb = func.builder();
                        lb.arg(&qp).arg(&gp).arg(&lp).arg(&dp);
                        push_tail(&mut lb, &tail_args);
                        // SAFETY: qkv and dqkv hold B*T*(H + 2 Hkv)*64 elements (16-byte aligned), dy
                        // B*T*C, lse and dsum B*H*T floats; dkdv writes the k and v columns, dq the q
                        // columns; H is a multiple of Hkv (checked).
                        unsafe { lb.launch(cfg) }.w()?;
                    }
                }
                Ok(())
            })?;
        }
        Ok(dqkv)
    }
}
