//! Frozen linear layers with LoRA updates as one graph node (Hu et al. 2021,
//! arXiv:2106.09685; PEFT's `lora.Linear`), for a projection that stacks several modules
//! along its output (`[Wq; Wk; Wv]`), each with its own adapter:
//!
//! ```text
//! y   = x W^T + s [u_1 B_1^T | u_2 B_2^T | ..]     x: (M, K), W: (N, K) frozen, N = sum N_i
//! u   = x A^T = [u_1 | u_2 | ..]                    A = [A_1; A_2; ..]: (P r, K), u_i: (M, r)
//! dB_i = s dy_i^T u_i    du_i = s dy_i B_i    dA = du^T x    dx = dy W + du A
//! ```
//! `B = [B_1; B_2; ..]: (sum N_i, r)` holds the adapted parts' up projections (a part without
//! an adapter has rank 0 and no rows in A or B). As separate ops the updates cost, per
//! projection, a full-size `(M, N)` tensor and an add kept for the backward (10 GB of
//! activations for SmolLM2-135M at 16 x 1024 tokens), and the block-diagonal up projection a
//! dozen tiny graph nodes (host time). Here base and update are one GEMM over the widened
//! inner dimension, `y = [x | s u] [W | B_bd]^T` (R/K more FLOPs, a few percent), the op keeps
//! only its inputs, and W, a constant, costs no `dW` GEMM.
//!
//! That is the CPU path (and CUDA's when x is not in W's dtype). On CUDA with x in W's dtype,
//! `lora_cuda` runs the forward and the backward as a few cuBLAS GEMMs on device addresses
//! instead: with many tokens, the adapters are merged into a copy of W once per call
//! (`W + s B_bd A`, kept for the backward), so the forward and dx cost what the frozen base
//! alone costs.

use super::dense::{cast_gemm, linear};
use super::lora_parts::{block_diagonal, offsets};
use crate::grad_sink::offer;
use crate::ops::common::{check_device, check_float};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

const OP: &str = "lora_linear";

/// `x @ w^T + scale * (x @ a^T) @ b^T` in w's dtype, one differentiable node; `w` is frozen.
///
/// - `x: (.., K)`: f32, bf16 or f16 (cast to w's dtype as [`crate::ops::linear`] does).
/// - `w: (N, K)`: the frozen base weight, a constant in the compute dtype (it gets no
///   gradient, whether or not autograd tracks it).
/// - `a: (R, K)`, `b: (N, R)`: the adapter in w's dtype; `scale` is LoRA's `alpha / r`.
///
/// Returns `(.., N)` in w's dtype; gradients for x (in x's dtype), a and b. Errors: as
/// [`lora_linear_grouped`].
pub fn lora_linear(x: &Tensor, w: &Tensor, a: &Tensor, b: &Tensor, scale: f64) -> Result<Tensor> {
    let parts = [(
        w.dims().first().copied().unwrap_or(0),
        a.dims().first().copied().unwrap_or(0),
    )];
    lora_linear_grouped(x, w, a, b, &parts, scale)
}

/// [`lora_linear`] for a stack of modules: `parts[i] = (N_i, r_i)`, the output rows of module
/// `i` in `w` (in order, summing to N) and its adapter's rank (0: no adapter; every adapted
/// part has the same rank r). `a: (sum r_i, K)` stacks the adapted parts' down projections,
/// `b: (sum of N_i over adapted parts, r)` their up projections.
///
/// Errors (no panics): shapes that do not chain or parts that do not add up, ranks that
/// differ, dtypes of a and b other than w's, a non-float dtype, tensors on different devices,
/// no rows or no adapter.
pub fn lora_linear_grouped(
    x: &Tensor,
    w: &Tensor,
    a: &Tensor,
    b: &Tensor,
    parts: &[(usize, usize)],
    scale: f64,
) -> Result<Tensor> {
    let ([x, a, b], op) = operands(x, w, a, b, parts, scale)?;
    x.apply_op3(&a, &b, op)
}

/// [`lora_linear_grouped`] with PEFT's LoRA dropout (`lora_dropout`, training): the dropout
/// applies to the adapters' input only, so the update is its own pair of GEMMs,
/// `y = x W^T + (dropout(x, p) A^T) (s B_bd)^T` with `B_bd` the block-diagonal of the parts'
/// up projections; separate differentiable ops (PEFT's `lora_B(lora_A(dropout(x))) * s`).
/// Shapes and dtypes as [`lora_linear_grouped`]; `p` in `[0, 1)`.
///
/// Errors: as [`lora_linear_grouped`], and `p` outside `[0, 1)`.
pub fn lora_linear_dropout(
    x: &Tensor,
    w: &Tensor,
    a: &Tensor,
    b: &Tensor,
    parts: &[(usize, usize)],
    scale: f64,
    p: f64,
) -> Result<Tensor> {
    if !(0.0..1.0).contains(&p) {
        candle_core::bail!("lora_linear_dropout: dropout {p} must be in [0, 1)");
    }
    let b_bd = block_diagonal(b, parts)?.affine(scale, 0.0)?;
    let xd = candle_nn::ops::dropout(x, p as f32)?;
    let y = linear(x, w, None)?;
    y + linear(&linear(&xd, a, None)?, &b_bd, None)?
}

/// [`lora_linear_grouped`]'s arguments checked (its errors) and laid out, `[x, a, b]`, with
/// the op.
pub(in crate::ops) fn operands(
    x: &Tensor,
    w: &Tensor,
    a: &Tensor,
    b: &Tensor,
    parts: &[(usize, usize)],
    scale: f64,
) -> Result<([Tensor; 3], LoraLinear)> {
    check_float(OP, "x", x.dtype())?;
    check_float(OP, "w", w.dtype())?;
    for (what, t) in [("w", w), ("a", a), ("b", b)] {
        check_device(OP, what, x, t)?;
    }
    let r = parts.iter().map(|p| p.1).max().unwrap_or(0);
    let ranks_ok = parts.iter().all(|p| p.1 == 0 || p.1 == r);
    let n_sum: usize = parts.iter().map(|p| p.0).sum();
    let r_sum: usize = parts.iter().map(|p| p.1).sum();
    let n_adapted: usize = parts.iter().filter(|p| p.1 > 0).map(|p| p.0).sum();
    let (n, k) = match (w.dims(), a.dims(), b.dims()) {
        (&[n, k], &[ra, ka], &[nb, rb])
            if ka == k
                && n == n_sum
                && ra == r_sum
                && nb == n_adapted
                && rb == r
                && r > 0
                && ranks_ok =>
        {
            (n, k)
        }
        (dw, da, db) => bail!(
            "{OP}: w {dw:?}, a {da:?} and b {db:?} do not chain with the parts (rows, rank) \
             {parts:?}; expected w (sum rows, K), a (sum ranks, K), b (adapted rows, r) with one \
             rank r > 0"
        ),
    };
    if a.dtype() != w.dtype() || b.dtype() != w.dtype() {
        bail!(
            "{OP}: a is {:?} and b {:?} but w is {:?}; the adapter must be in the compute dtype",
            a.dtype(),
            b.dtype(),
            w.dtype()
        )
    }
    if x.dims().last() != Some(&k) {
        bail!(
            "{OP}: x has shape {:?}; its last dimension must be w's K = {k}",
            x.dims()
        )
    }
    if x.elem_count() == 0 || n == 0 {
        bail!("{OP}: empty operands (x {:?}, N {n})", x.dims());
    }
    let x = if x.dtype() == w.dtype() {
        x.contiguous()?
    } else {
        x.clone()
    };
    let op = LoraLinear {
        w: w.detach().contiguous()?,
        parts: parts.to_vec(),
        rank: r,
        scale,
        #[cfg(feature = "cuda")]
        merged: Default::default(),
    };
    Ok(([x, a.contiguous()?, b.contiguous()?], op))
}

/// The op of [`lora_linear_grouped`]; its clones share the saved merged weight.
#[derive(Clone)]
pub(in crate::ops) struct LoraLinear {
    /// The frozen base weight `(N, K)`, contiguous.
    w: Tensor,
    /// `(N_i, r_i)` per stacked module.
    parts: Vec<(usize, usize)>,
    rank: usize,
    scale: f64,
    /// CUDA: the forward's merged weight `W + s B_bd A`, taken by the backward (which merges
    /// again when absent).
    #[cfg(feature = "cuda")]
    merged: std::sync::Arc<std::sync::Mutex<Option<candle_core::CudaStorage>>>,
}

/// The forward on the CPU (and on CUDA when x needs a cast), as one GEMM over K + R:
/// `y = [x | s u] [W | B_bd]^T`, with `u = cast(x) A^T` and `B_bd` the block-diagonal `(N, R)` of the parts' up projections
/// (zero outside each adapted part's rows and rank columns). The widened operands are built
/// here (copies of x, u, W and B: no full-size `(M, N)` update pass) and dropped after the GEMM.
fn forward<S>(
    op: &LoraLinear,
    x: (&S, &Layout),
    w: (&S, &Layout),
    a: (&S, &Layout),
    b: (&S, &Layout),
) -> Result<(S, Shape)>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let (u, m, r_sum, shape_u) = cast_gemm(x.0, x.1, a.0, a.1)?;
    let (n, k) = (w.1.dims()[0], w.1.dims()[1]);
    let mut shape = shape_u.dims().to_vec();
    if let Some(d) = shape.last_mut() {
        *d = n;
    }
    let us = u.affine(&Layout::contiguous((m, r_sum)), op.scale, 0.0)?;
    let dtype = w.0.dtype();
    let dev = w.0.device().clone();
    let kp = k + r_sum;
    let cast;
    let (xs, x_off) = if x.0.dtype() == dtype {
        (x.0, x.1.start_offset())
    } else {
        cast = x.0.to_dtype(x.1, dtype)?;
        (&cast, 0)
    };
    let mut xp = dev.zeros_impl(&Shape::from((m, kp)), dtype)?;
    xs.copy2d(&mut xp, m, k, k, kp, x_off, 0)?;
    us.copy2d(&mut xp, m, r_sum, r_sum, kp, 0, k)?;
    let mut wp = dev.zeros_impl(&Shape::from((n, kp)), dtype)?;
    w.0.copy2d(&mut wp, n, k, k, kp, w.1.start_offset(), 0)?;
    let r = op.rank;
    for bl in offsets(&op.parts) {
        b.0.copy2d(
            &mut wp,
            bl.rows,
            r,
            r,
            kp,
            b.1.start_offset() + bl.b_row * r,
            bl.col * kp + k + bl.q,
        )?;
    }
    let lw = Layout::contiguous((n, kp)).transpose(0, 1)?;
    let y = xp.matmul(&wp, (1, m, n, kp), &Layout::contiguous((m, kp)), &lw)?;
    Ok((y, Shape::from(shape)))
}

impl LoraLinear {
    /// The GEMM sizes for an x of layout `lx` (the CUDA path's view of the op).
    #[cfg(feature = "cuda")]
    fn dims(&self, lx: &Layout) -> Result<super::lora_cuda::Dims> {
        let (n, k) = self.w.dims2()?;
        Ok(super::lora_cuda::Dims {
            m: lx.shape().elem_count() / k,
            n,
            k,
            r_sum: self.parts.iter().map(|p| p.1).sum(),
            rank: self.rank,
            blocks: offsets(&self.parts),
            scale: self.scale as f32,
        })
    }
}

impl CustomOp3 for LoraLinear {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        a: &CpuStorage,
        la: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (ws, lw) = self.w.storage_and_layout();
        let Storage::Cpu(w) = &*ws else {
            bail!("{OP}: w is not on the CPU like x")
        };
        forward(self, (x, lx), (w, lw), (a, la), (b, lb))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        a: &candle_core::CudaStorage,
        la: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (ws, lw) = self.w.storage_and_layout();
        let Storage::Cuda(w) = &*ws else {
            bail!("{OP}: w is not on CUDA like x")
        };
        if x.dtype() == w.dtype() {
            let (y, merged) =
                super::lora_cuda::forward(&self.dims(lx)?, (x, lx), (w, lw), (a, la), (b, lb))?;
            if let Ok(mut saved) = self.merged.lock() {
                *saved = merged;
            }
            let mut shape = lx.dims().to_vec();
            if let Some(d) = shape.last_mut() {
                *d = lw.dims()[0];
            }
            return Ok((y, Shape::from(shape)));
        }
        forward(self, (x, lx), (w, lw), (a, la), (b, lb))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, da, db) = self.grads(x, a, b, dy, x.track_op())?;
        Ok((dx, offer(a, Some(da))?, offer(b, Some(db))?))
    }
}

impl LoraLinear {
    /// `(dx, da, db)` as computed (not offered to a sink), dx only when `want_x`.
    pub(in crate::ops) fn grads(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        dy: &Tensor,
        want_x: bool,
    ) -> Result<(Option<Tensor>, Tensor, Tensor)> {
        let w = &self.w;
        #[cfg(feature = "cuda")]
        if super::lora_cuda::applies(x, w) {
            let d = self.dims(x.layout())?;
            let merged = self.merged.lock().map(|mut w| w.take()).unwrap_or(None);
            return super::lora_cuda::backward(&d, x, w, a, b, dy, merged, want_x);
        }
        let (n, k) = w.dims2()?;
        let m = x.elem_count() / k;
        let xc = x.detach().to_dtype(w.dtype())?.reshape((m, k))?;
        let dy2 = dy.detach().to_dtype(w.dtype())?.reshape((m, n))?;
        let (a, b) = (a.detach(), b.detach());
        let us = xc.matmul(&a.t()?)?.affine(self.scale, 0.0)?; // s u, (M, R)
        let r_sum = us.dim(1)?;
        // W' = [W | B_bd] as in the forward; dX' = dy W' gives dx's base part and d(s u)
        let b_bd = block_diagonal(&b, &self.parts)?; // (N, R)
        let dxp = dy2.matmul(&Tensor::cat(&[w, &b_bd], 1)?)?; // (M, K + R)
        let du = dxp.narrow(1, k, r_sum)?.affine(self.scale, 0.0)?; // s dy B_bd, (M, R)
        let da = du.t()?.matmul(&xc)?; // (R, K)
                                       // dB_bd = dy^T (s u): the adapted parts' diagonal blocks of one (N, R) GEMM
        let g = dy2.t()?.matmul(&us)?;
        let db = Tensor::cat(
            &offsets(&self.parts)
                .iter()
                .map(|bl| g.narrow(0, bl.col, bl.rows)?.narrow(1, bl.q, self.rank))
                .collect::<Result<Vec<_>>>()?,
            0,
        )?;
        let dx = if want_x {
            let dx = (dxp.narrow(1, 0, k)? + du.matmul(&a)?)?.reshape(x.shape())?;
            Some(dx.to_dtype(x.dtype())?)
        } else {
            None
        };
        Ok((dx, da, db))
    }
}
