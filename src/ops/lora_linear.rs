//! A frozen linear layer with a LoRA update as one graph node (Hu et al. 2021,
//! arXiv:2106.09685; PEFT's `lora.Linear` with the scale folded into `B`):
//!
//! ```text
//! y  = x W^T + (x A^T) B^T          x: (.., K), W: (N, K) frozen, A: (R, K), B: (N, R)
//! u  = x A^T                        (recomputed in the backward, (M, R): small)
//! dB = dy^T u       du = dy B       dA = du^T x       dx = dy W + du A
//! ```
//! As separate ops (`linear(x, W) + linear(linear(x, A), B)`) the update costs a full-size
//! `(M, N)` tensor and an add per projection, both kept for the backward: 10 GB of activations
//! for SmolLM2-135M at 16 x 1024 tokens. Here the forward adds the update into the output
//! inside the op and keeps nothing but its inputs; `W` gets no gradient (it is a constant) and
//! costs no `dW` GEMM.

use super::linear::cast_gemm;
use super::{check_device, check_float};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

const OP: &str = "lora_linear";

/// `x @ w^T + (x @ a^T) @ b^T` in w's dtype, one differentiable node; `w` is frozen.
///
/// - `x: (.., K)`: f32, bf16 or f16 (cast to w's dtype as [`super::linear`] does).
/// - `w: (N, K)`: the frozen base weight, a constant in the compute dtype (it gets no
///   gradient, whether or not autograd tracks it).
/// - `a: (R, K)`, `b: (N, R)`: the adapter in w's dtype, the LoRA scale already in `b`.
///
/// Returns `(.., N)` in w's dtype. Gradients for x (in x's dtype), a and b. Not twice
/// differentiable. Errors (no panics): shapes that do not chain, dtypes of a and b other than
/// w's, a non-float dtype, tensors on different devices, no rows.
pub fn lora_linear(x: &Tensor, w: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    check_float(OP, "x", x.dtype())?;
    check_float(OP, "w", w.dtype())?;
    for (what, t) in [("w", w), ("a", a), ("b", b)] {
        check_device(OP, what, x, t)?;
    }
    let (n, k, r) = match (w.dims(), a.dims(), b.dims()) {
        (&[n, k], &[r, ka], &[nb, rb]) if ka == k && nb == n && rb == r => (n, k, r),
        (dw, da, db) => bail!(
            "{OP}: w {dw:?}, a {da:?} and b {db:?} do not chain; expected w (N, K), a (R, K), b (N, R)"
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
    let rows = x.elem_count() / k.max(1);
    if rows == 0 || n == 0 || r == 0 {
        bail!("{OP}: empty operands (x {:?}, rank {r}, N {n})", x.dims());
    }
    let x = if x.dtype() == w.dtype() {
        x.contiguous()?
    } else {
        x.clone()
    };
    x.apply_op3(
        &a.contiguous()?,
        &b.contiguous()?,
        LoraLinear {
            w: w.detach().contiguous()?,
        },
    )
}

struct LoraLinear {
    /// The frozen base weight `(N, K)`, contiguous.
    w: Tensor,
}

/// The forward on either backend: `y = cast(x) W^T`, `u = cast(x) A^T`, `y + u B^T`.
fn forward<S: BackendStorage>(
    x: (&S, &Layout),
    w: (&S, &Layout),
    a: (&S, &Layout),
    b: (&S, &Layout),
) -> Result<(S, Shape)> {
    let (y, m, n, shape) = cast_gemm(x.0, x.1, w.0, w.1)?;
    let (u, _, r, _) = cast_gemm(x.0, x.1, a.0, a.1)?;
    let (d, ..) = cast_gemm(&u, &Layout::contiguous((m, r)), b.0, b.1)?;
    let l = Layout::contiguous((m, n));
    Ok((y.binary_impl::<candle_core::op::Add>(&d, &l, &l)?, shape))
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
        forward((x, lx), (w, lw), (a, la), (b, lb))
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
        forward((x, lx), (w, lw), (a, la), (b, lb))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let w = &self.w;
        let (n, k) = w.dims2()?;
        let m = x.elem_count() / k;
        let xc = x.detach().to_dtype(w.dtype())?.reshape((m, k))?;
        let dy2 = dy.detach().to_dtype(w.dtype())?.reshape((m, n))?;
        let (a, b) = (a.detach(), b.detach());
        let u = xc.matmul(&a.t()?)?; // (M, R)
        let db = dy2.t()?.matmul(&u)?; // (N, R)
        let du = dy2.matmul(&b)?; // (M, R)
        let da = du.t()?.matmul(&xc)?; // (R, K)
        let dx = if x.track_op() {
            let dx = (dy2.matmul(w)? + du.matmul(&a)?)?.reshape(x.shape())?;
            Some(dx.to_dtype(x.dtype())?)
        } else {
            None
        };
        Ok((dx, Some(da), Some(db)))
    }
}
