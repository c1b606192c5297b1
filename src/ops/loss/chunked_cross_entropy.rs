//! The language-model head and its cross-entropy, summed over the rows, computed a chunk of rows
//! at a time with the gradient made in the forward: memory that does not grow with
//! tokens x vocabulary.
//!
//! This is Liger-Kernel's `FusedLinearCrossEntropy` scheme (Hsu et al. 2024, "Liger Kernel:
//! Efficient Triton Kernels for LLM Training", `liger_kernel/ops/fused_linear_cross_entropy.py`):
//! for each chunk of `k` rows
//!
//! ```text
//! logits_c  = h_c W^T                      (k, V)  compute dtype, candle's GEMM (f32 accumulation)
//! loss_c    = lse(logits_c) - logits_c[t]  (k,)    f32, the cross-entropy kernels
//! dlogits_c = softmax(logits_c) - onehot   (k, V)  the cross-entropy backward kernel, g = 1
//! dh[c]     = dlogits_c W                  (k, C)  into a preallocated (N, C) in h's dtype
//! dW       += dlogits_c^T h_c              (V, C)  accumulated in f32
//! ```
//!
//! and the chunk's logits and their gradient are freed before the next chunk. The graph node's
//! backward only scales: `dh = g dh`, `dW = g dW` (g: the upstream gradient of the scalar loss,
//! read on the device, no host synchronisation).
//!
//! Memory while the op runs: one chunk's logits and their gradient (`2 k V` elements of the
//! compute dtype), `dh` (`N x C`, h's dtype) and `dW` (`V x C` f32, plus one `V x C` chunk
//! product in the compute dtype); `dh` and `dW` are held from the forward to the backward, which
//! frees them. [`crate::ops::linear_cross_entropy_rows`] holds the full `N x V` logits instead (and
//! their gradient in the backward): 1.6 GB + 1.6 GB for GPT-2's 16384 x 50304 bf16.
//!
//! The price: the gradient is computed even if no backward follows (an evaluation loss costs
//! the two gradient GEMMs too; detach `h` and `w` to skip them), and `dW` is read and written
//! once per chunk (`N / k` passes over `V x C` f32).

use super::cross_entropy::cross_entropy_rows_no_bwd;
#[cfg(feature = "cuda")]
use super::linear_cross_entropy::stored_cuda;
use super::linear_cross_entropy::{check_head, stored_cpu};
use crate::ops::common::check_device;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Tensor};
use std::sync::Mutex;

/// The target that marks a row to skip (zero loss, zero gradient), as PyTorch's
/// `cross_entropy(ignore_index=-100)` and transformers' labels: `-100` in i64 targets. In u32
/// targets the ignored value is `u32::MAX`; u8 targets have none.
pub const IGNORE_INDEX: i64 = -100;

/// Logit elements of one chunk when the caller names no chunk size: `2^26` (128 MB in bf16,
/// 256 MB in f32; the chunk's gradient as much again).
pub const DEFAULT_CHUNK_LOGITS: usize = 1 << 26;

/// Rows per chunk for `n` rows and `v` classes when none is given: the largest power of two
/// whose `rows x v` logits fit [`DEFAULT_CHUNK_LOGITS`] elements, clamped to `[1, n]`. A fixed
/// budget (rather than Liger's `next_power_of_2(n / ceil(v / c))`, logits about the size of
/// `h`) keeps the peak independent of the batch, and gives GPT-2 (V = 50304) chunks of 1024 rows:
/// 16 passes over `dW` for 16384 rows instead of Liger's 64.
pub fn default_chunk_rows(n: usize, v: usize) -> usize {
    let fit = (DEFAULT_CHUNK_LOGITS / v.max(1)).max(1);
    let pow2 = 1usize << (usize::BITS - 1 - fit.leading_zeros()); // largest power of two <= fit
    pow2.clamp(1, n.max(1))
}

/// Sum over the rows of `lse(h_i W^T) - (h_i W^T)[t_i]`: a rank-0 f32 tensor, one graph node,
/// computed `chunk_rows` rows at a time so that at most `chunk_rows x V` logits (and their
/// gradient) exist at once (module docs: Liger-Kernel's fused linear cross-entropy).
///
/// - `h`: `(N, C)` hidden states; `w`: `(V, C)` output weights (for a tied head, the embedding's
///   working copy: its gradient reaches the table through candle's graph or the engine's
///   gradient sink, as for [`crate::ops::linear_cross_entropy_rows`]). Same float dtype (f32, bf16,
///   f16), same device, any layout. GEMMs in that dtype (candle's, f32 accumulation), the loss
///   in f32, `dW` accumulated over the chunks in f32.
/// - `targets`: `(N,)` class indices, u32, i64 or u8. A row whose target is [`IGNORE_INDEX`]
///   (i64 `-100`; u32 `u32::MAX`) adds zero loss and zero gradient. On the CPU such rows are
///   dropped before the chunks (the targets are read on the host); on a GPU they are masked on
///   the device (their row's upstream gradient in the cross-entropy backward is 0), with no
///   host read.
/// - `chunk_rows`: rows per chunk; `None` for [`default_chunk_rows`]. Values over `N` mean one
///   chunk.
///
/// The mean loss of the trained rows is this divided by their count (which the caller knows:
/// it builds the targets).
///
/// Gradients: `h` in h's dtype, `w` in w's dtype, both `g x` the forward's (g the upstream
/// gradient, a device scalar). Computed in the forward, held by the node and freed by the
/// first backward: a second backward through the same graph is an error. An `h` or `w` that
/// is not tracked (detached, a constant) costs no `dh` or `dW` GEMM; with neither tracked the
/// result is outside the graph.
///
/// With `N == 0` the result is a zero rank-0 tensor outside the graph.
///
/// Errors (no panics): shapes other than `(N, C)`, `(V, C)`, `(N,)`; dtypes that differ or
/// are not float; integer targets of another dtype; devices that differ; `V == 0`;
/// `chunk_rows == Some(0)`. On the CPU a target outside `0..V` (other than the ignore index) is
/// an error; on a GPU that row's loss and gradient are NaN (as
/// [`crate::ops::cross_entropy_rows`]).
pub fn linear_cross_entropy_sum(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    chunk_rows: Option<usize>,
) -> Result<Tensor> {
    let op = "linear_cross_entropy_sum";
    let (n, c, v) = check_head(op, h, w)?;
    match targets.dims() {
        &[m] if m == n => {}
        d => bail!("{op}: targets must be (N,) = ({n},) to match h ({n}, {c}), found {d:?}"),
    }
    if !matches!(targets.dtype(), DType::U32 | DType::I64 | DType::U8) {
        bail!(
            "{op}: targets must hold integer indices (u32, i64 or u8), found {:?}",
            targets.dtype()
        )
    }
    check_device(op, "targets", h, targets)?;
    if chunk_rows == Some(0) {
        bail!("{op}: chunk_rows must be at least 1 (None picks a default)")
    }
    let dev = h.device();
    if n == 0 {
        return Tensor::zeros((), DType::F32, dev);
    }
    let chunk = chunk_rows
        .unwrap_or_else(|| default_chunk_rows(n, v))
        .min(n);
    let rows = Rows::of(op, targets, v)?;
    let (want_dh, want_dw) = (h.track_op(), w.track_op());
    // contiguous operands for candle's CUDA GEMM (a no-op for the usual contiguous inputs)
    let (hc, wc) = (h.detach().contiguous()?, w.detach().contiguous()?);
    let hr = match &rows.keep {
        Some(keep) => hc.index_select(keep, 0)?, // the trained rows (CPU, some ignored)
        None => hc,
    };
    let m = hr.dim(0)?;
    let wt = wc.t()?;
    let ones = match (&rows.weight, want_dh || want_dw) {
        (None, true) => Some(Tensor::ones(chunk.min(m), DType::F32, dev)?),
        _ => None,
    };
    let dh = match want_dh {
        true => Some(Tensor::zeros((m, c), h.dtype(), dev)?),
        false => None,
    };
    let mut dw = DwSum::default();
    let mut losses = Vec::with_capacity(m.div_ceil(chunk));
    for s in (0..m).step_by(chunk) {
        let k = chunk.min(m - s);
        let hk = hr.narrow(0, s, k)?;
        let tk = rows.t.narrow(0, s, k)?;
        let logits = hk.matmul(&wt)?; // (k, V), no graph
        let (loss, ce_bwd) = cross_entropy_rows_no_bwd(&logits, &tk)?;
        losses.push(loss);
        if !(want_dh || want_dw) {
            continue;
        }
        // row r's upstream gradient: 1, or the device mask (0 for an ignored row)
        let g = match (&rows.weight, &ones) {
            (Some(weight), _) => weight.narrow(0, s, k)?,
            (None, Some(o)) => o.narrow(0, 0, k)?,
            (None, None) => bail!("{op}: no row weights (internal error)"),
        };
        let dlogits = logits.apply_op3_no_bwd(&tk, &g, &ce_bwd)?; // softmax - onehot
        drop(logits);
        if let Some(dh) = &dh {
            dh.slice_set(&dlogits.matmul(&wc)?, 0, s)?; // (k, V) @ (V, C)
        }
        if want_dw {
            dw.add(&dlogits.t()?.matmul(&hk)?)?; // (V, k) @ (k, C)
        }
    }
    let loss = match (losses.len(), &rows.kept) {
        (0, _) => Tensor::zeros((), DType::F32, dev)?, // every row ignored
        (_, None) => Tensor::cat(&losses, 0)?.sum_all()?,
        (_, Some(kept)) => {
            // ignored rows: 0 (where, not a product: their loss against the stand-in target 0
            // need not be finite)
            let l = Tensor::cat(&losses, 0)?;
            kept.where_cond(&l, &l.zeros_like()?)?.sum_all()?
        }
    };
    if !(want_dh || want_dw) {
        return Ok(loss);
    }
    let dw = match want_dw {
        true => Some(dw.into_tensor(v, c, dev)?),
        false => None,
    };
    h.apply_op2(
        w,
        SumNode {
            loss,
            grads: Mutex::new(Some(Held {
                dh,
                keep: rows.keep,
                dw,
            })),
        },
    )
}

/// The rows that are trained: their targets (u32, in `0..V` except on a GPU), and either the
/// indices of the kept rows (CPU, when some were ignored) or per-row weights 1 / 0 (GPU).
struct Rows {
    t: Tensor,
    keep: Option<Tensor>,
    weight: Option<Tensor>,
    /// u8, 0 at the ignored rows (GPU, i64 and u32 targets).
    kept: Option<Tensor>,
}

impl Rows {
    fn of(op: &str, targets: &Tensor, v: usize) -> Result<Self> {
        match targets.device() {
            Device::Cpu => Self::compacted(op, targets, v),
            _ => Self::masked(targets),
        }
    }

    /// Read on the host: checked, the ignored rows dropped.
    fn compacted(op: &str, targets: &Tensor, v: usize) -> Result<Self> {
        let raw: Vec<i64> = match targets.dtype() {
            DType::I64 => targets.to_vec1::<i64>()?,
            DType::U32 => targets
                .to_vec1::<u32>()?
                .into_iter()
                .map(|k| match k {
                    u32::MAX => IGNORE_INDEX,
                    k => k as i64,
                })
                .collect(),
            _ => targets
                .to_vec1::<u8>()?
                .into_iter()
                .map(i64::from)
                .collect(),
        };
        let (mut keep, mut t) = (Vec::with_capacity(raw.len()), Vec::with_capacity(raw.len()));
        for (r, &k) in raw.iter().enumerate() {
            if k == IGNORE_INDEX {
                continue;
            }
            if k < 0 || k as u64 >= v as u64 {
                bail!(
                    "{op}: target {k} at row {r} is out of range for {v} classes (expected \
                     0..{v}, or the ignore index {IGNORE_INDEX} / u32::MAX)"
                )
            }
            keep.push(r as u32);
            t.push(k as u32);
        }
        let all = keep.len() == raw.len();
        Ok(Self {
            t: Tensor::from_vec(t, keep.len(), &Device::Cpu)?,
            keep: match all {
                true => None,
                false => Some(Tensor::from_vec(keep.clone(), keep.len(), &Device::Cpu)?),
            },
            weight: None,
            kept: None,
        })
    }

    /// On the device: ignored rows get the stand-in target 0 and weight 0. Device ops only (no
    /// copy from the host: the constants are filled on the device), so this also runs inside
    /// a CUDA graph capture.
    fn masked(targets: &Tensor) -> Result<Self> {
        let dev = targets.device();
        let n = targets.dim(0)?;
        let ignored = match targets.dtype() {
            DType::I64 => Some(Tensor::full(IGNORE_INDEX, n, dev)?),
            DType::U32 => Some(Tensor::full(u32::MAX, n, dev)?),
            _ => None,
        };
        let t = match targets.dtype() {
            DType::U32 => targets.contiguous()?,
            _ => targets.to_dtype(DType::U32)?,
        };
        let Some(ignored) = ignored else {
            let weight = Tensor::ones(n, DType::F32, dev)?;
            return Ok(Self {
                t,
                keep: None,
                weight: Some(weight),
                kept: None,
            });
        };
        let kept = targets.ne(&ignored)?; // u8, 1 = trained
        let t = kept.where_cond(&t, &t.zeros_like()?)?;
        Ok(Self {
            t,
            keep: None,
            weight: Some(kept.to_dtype(DType::F32)?),
            kept: Some(kept),
        })
    }
}

/// `dW` summed over the chunks in f32: on CUDA in place (wick's accumulate kernel, no f32 copy
/// of the chunk's product), elsewhere as candle adds.
#[derive(Default)]
struct DwSum {
    acc: Option<Tensor>,
    #[cfg(feature = "cuda")]
    pool: [Option<Tensor>; 1],
    #[cfg(feature = "cuda")]
    bufs: [Option<Tensor>; 1],
}

impl DwSum {
    fn add(&mut self, d: &Tensor) -> Result<()> {
        #[cfg(feature = "cuda")]
        if d.device().is_cuda() {
            crate::cuda::accumulate::accumulate(
                &mut self.pool,
                &mut self.bufs,
                &[Some(d.clone())],
                1.0,
            )
            .map_err(|e| candle_core::Error::Msg(format!("linear_cross_entropy_sum: {e:#}")))?;
            self.acc = self.bufs[0].clone();
            return Ok(());
        }
        let d = d.to_dtype(DType::F32)?;
        self.acc = Some(match self.acc.take() {
            Some(a) => (a + d)?,
            None => d,
        });
        Ok(())
    }

    /// The sum, or zeros when no chunk was added (every row ignored).
    fn into_tensor(self, v: usize, c: usize, dev: &Device) -> Result<Tensor> {
        match self.acc {
            Some(a) => Ok(a),
            None => Tensor::zeros((v, c), DType::F32, dev),
        }
    }
}

/// What the forward computed for the backward.
struct Held {
    /// `(M, C)` in h's dtype, the trained rows' `dh` at `g = 1`.
    dh: Option<Tensor>,
    /// The trained rows' indices in `h` when some were dropped (CPU).
    keep: Option<Tensor>,
    /// `(V, C)` f32 at `g = 1`.
    dw: Option<Tensor>,
}

/// The graph node: its forward hands out the loss computed above (one f32), its backward the
/// held gradients times the upstream one.
struct SumNode {
    loss: Tensor,
    /// Taken (and freed) by the backward.
    grads: Mutex<Option<Held>>,
}

impl CustomOp2 for SumNode {
    fn name(&self) -> &'static str {
        "linear_cross_entropy_sum"
    }

    fn cpu_fwd(
        &self,
        _h: &CpuStorage,
        _lh: &Layout,
        _w: &CpuStorage,
        _lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        stored_cpu("linear_cross_entropy_sum", &self.loss)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _h: &candle_core::CudaStorage,
        _lh: &Layout,
        _w: &candle_core::CudaStorage,
        _lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        stored_cuda("linear_cross_entropy_sum", &self.loss)
    }

    fn bwd(
        &self,
        h: &Tensor,
        w: &Tensor,
        _loss: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let taken = self.grads.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(held) = taken else {
            bail!(
                "linear_cross_entropy_sum: the backward already ran for this graph (the \
                 gradients are freed by the first one); run the forward again"
            )
        };
        // g in f32 (a bf16 g would round the mean's 1 / N), the products cast once
        let g = g.detach().to_dtype(DType::F32)?.reshape(())?;
        let scaled = |d: Tensor, dtype: DType| -> Result<Tensor> {
            d.to_dtype(DType::F32)?.broadcast_mul(&g)?.to_dtype(dtype)
        };
        let dh = match (held.dh, held.keep) {
            (None, _) => None,
            (Some(d), None) => Some(scaled(d, h.dtype())?),
            (Some(d), Some(keep)) => {
                let d = scaled(d, h.dtype())?;
                Some(h.zeros_like()?.index_add(&keep, &d, 0)?)
            }
        };
        let dw = held.dw.map(|d| scaled(d, w.dtype())).transpose()?;
        Ok((dh, crate::grad_sink::offer(w, dw)?))
    }
}
