//! Fully connected layer as one graph node, under autocast:
//!
//! ```text
//! xc = cast(x, w.dtype)          x: (.., K), w: (N, K), b: (N,)
//! y  = xc @ w^T + cast(b)        (.., N) in w's dtype
//! dx = cast(dy @ w, x.dtype)
//! dw = dy^T @ xc                 (recomputed from x; not kept from the forward)
//! db = Σ_rows dy                 (bias_add's column sum, then cast to b's dtype)
//! ```
//! The composed version (`to_dtype`, candle-nn's reshape / matmul with `w.t()` / reshape,
//! `bias_add`) is five graph nodes; candle's backward pays, per node, a zeroed gradient buffer
//! and an add of the full activation size, several kernel launches of host time each. Here the
//! forward is one `CustomOp` (the cast, candle's own GEMM with `w^T` as a transposed operand,
//! then bias_add's kernel, or one cuBLASLt matmul with the bias in its epilogue) and the
//! backward is three GEMMs and a column sum on detached tensors. With bf16/f16 weights and a
//! bias, the bias is added to the GEMM's f32 result before its one rounding: on CUDA in
//! cuBLASLt's epilogue (`CUBLASLT_EPILOGUE_BIAS`, so the output is written once, not written,
//! read and written again) where it takes the operands (contiguous, aligned, sizes multiples
//! of 8; elsewhere bias_add's kernel after the rounding), on the CPU always. The composed
//! version rounds the GEMM's output, then the sum: one rounding apart. f32 weights, or no bias:
//! the composed version's numerics exactly.

use crate::grad_sink::offer;
use crate::ops::common::{check_device, check_float};
use crate::ops::elementwise::bias;
use crate::ops::elementwise::bias::bias_add;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

pub(in crate::ops) const OP: &str = "linear";

/// `y = x @ w^T + b` in w's dtype, as one differentiable graph node: PyTorch's
/// `torch.nn.functional.linear(x, w, b)` under autocast, where x and b are cast to the compute
/// dtype (w's) and the GEMM runs in it.
///
/// - `x: (.., in)`: f32, bf16 or f16, any layout; cast to w's dtype (candle's `to_dtype`
///   rounding) when it differs. The gradient comes back in x's dtype.
/// - `w: (out, in)`: f32, bf16 or f16 (the compute dtype); contiguous or a transposed view of a
///   contiguous tensor is used without a copy.
/// - `b: (out,)`: f32, bf16 or f16 (wick keeps it as an fp32 master in mixed precision); cast to
///   w's dtype and added in f32: for bf16/f16 w to the GEMM's f32 result before its rounding
///   (module docs), for f32 w as [`crate::ops::bias_add`] does. Its gradient (the column sum
///   of dy, rounded to w's dtype as through the cast) comes back in b's dtype.
///
/// Returns `(.., out)` in w's dtype. The GEMMs are candle's (cuBLAS on CUDA), or with a bias
/// and bf16/f16 weights on CUDA one cuBLASLt matmul (module docs). Not twice
/// differentiable. Empty shapes (no rows, `in = 0` or `out = 0`) take the composed candle ops.
///
/// Errors (no panics): a scalar x; w not 2-D; x's last dimension not w's `in`; b not `(out,)`;
/// a dtype other than f32/bf16/f16; arguments on different devices.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    match operands(OP, x, w, b)? {
        Operands::Empty { rows } => composed(x, w, b, rows),
        Operands::Ready { x, w, b } => match b {
            Some(b) => x.apply_op3(&w, &b, Linear),
            None => x.apply_op2(&w, Linear),
        },
    }
}

/// The arguments of a linear-layer op, checked and laid out for [`forward`].
pub(in crate::ops) enum Operands {
    /// No rows, `in = 0` or `out = 0`: shapes that candle's matmul special-cases (`rows` rows).
    Empty { rows: usize },
    /// x contiguous when already in w's dtype (else the forward's cast copies it); w contiguous
    /// or a transposed view of a contiguous tensor (cuBLAS reads either); b contiguous.
    Ready {
        x: Tensor,
        w: Tensor,
        b: Option<Tensor>,
    },
}

/// Checks `x`, `w` and `b` as [`linear`] documents (errors named after `op`) and lays them out.
pub(in crate::ops) fn operands(
    op: &str,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
) -> Result<Operands> {
    check_float(op, "x", x.dtype())?;
    check_float(op, "w", w.dtype())?;
    check_device(op, "w", x, w)?;
    if let Some(b) = b {
        check_float(op, "b", b.dtype())?;
        check_device(op, "b", x, b)?;
    }
    let &[n, k] = w.dims() else {
        bail!(
            "{op}: w has shape {:?}; expected (out, in), a 2-D weight",
            w.dims()
        )
    };
    let Some(&x_k) = x.dims().last() else {
        bail!("{op}: x is a scalar; expected (.., in) with in = {k} (w is {:?}); use x.reshape(1) for a single feature", w.dims())
    };
    if x_k != k {
        bail!(
            "{op}: x has shape {:?} and w has shape {:?}; x's last dimension must equal w's second (in = {k}): reshape x, or transpose w if it is stored (in, out)",
            x.dims(),
            w.dims()
        )
    }
    if let Some(b) = b {
        if b.dims() != [n] {
            bail!(
                "{op}: b has shape {:?} but w has shape {:?}; b must be (out,) = ({n},)",
                b.dims(),
                w.dims()
            )
        }
    }
    let rows: usize = x.dims()[..x.rank() - 1].iter().product();
    if rows == 0 || n == 0 || k == 0 {
        return Ok(Operands::Empty { rows });
    }
    // The op casts a strided x itself (the cast writes a contiguous copy); an x already in w's
    // dtype goes to the GEMM as is and must be contiguous.
    let x = if x.dtype() == w.dtype() {
        x.contiguous()?
    } else {
        x.clone()
    };
    // cuBLAS takes w or w^T contiguous (a transposed operand); anything else is copied once.
    let w = if w.is_contiguous() || w.t()?.is_contiguous() {
        w.clone()
    } else {
        w.contiguous()?
    };
    let b = b.map(Tensor::contiguous).transpose()?;
    Ok(Operands::Ready { x, w, b })
}

/// The unfused ops, for the empty shapes that candle's matmul special-cases (as before the
/// fused op: with no rows, b is left out of the graph, like candle's own empty binary ops).
pub(in crate::ops) fn composed(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    rows: usize,
) -> Result<Tensor> {
    let (n, k) = w.dims2()?;
    let mut out = x.dims().to_vec();
    if let Some(d) = out.last_mut() {
        *d = n;
    }
    let x = x.to_dtype(w.dtype())?.reshape((rows, k))?;
    let y = x.matmul(&w.t()?)?.reshape(out)?;
    match b {
        Some(b) => bias_add(&y, b),
        None => Ok(y),
    }
}

/// The op; one struct for both arities (with and without bias).
pub(in crate::ops) struct Linear;

/// `(rows, out, in)` of the GEMM and the output shape, from the layouts of x and w.
fn gemm_dims(lx: &Layout, lw: &Layout) -> Result<(usize, usize, usize, Shape)> {
    let &[n, k] = lw.dims() else {
        bail!("{OP}: w must be 2-D (internal error: the public function checks it)")
    };
    let mut out = lx.dims().to_vec();
    match out.last_mut() {
        Some(d) if *d == k && k > 0 => *d = n,
        _ => bail!(
            "{OP}: x {:?} does not match w {:?} (internal error)",
            lx.dims(),
            lw.dims()
        ),
    }
    Ok((lx.shape().elem_count() / k, n, k, out.into()))
}

/// `cast(x) @ w^T` on any backend: x cast to w's dtype (a contiguous copy, whatever x's
/// layout), then candle's GEMM with w's layout transposed, which cuBLAS reads as a transposed
/// operand and the CPU gemm as strides (no copy of w).
pub(in crate::ops) fn cast_gemm<S: BackendStorage>(
    x: &S,
    lx: &Layout,
    w: &S,
    lw: &Layout,
) -> Result<(S, usize, usize, Shape)> {
    let (m, n, k, shape) = gemm_dims(lx, lw)?;
    let cast;
    let (xs, lxs) = if x.dtype() == w.dtype() {
        if !lx.is_contiguous() {
            bail!("{OP}: x must be contiguous (internal error: the public function makes it so)")
        }
        (x, Layout::contiguous_with_offset((m, k), lx.start_offset()))
    } else {
        cast = x.to_dtype(lx, w.dtype())?;
        (&cast, Layout::contiguous((m, k)))
    };
    let y = xs.matmul(w, (1, m, n, k), &lxs, &lw.transpose(0, 1)?)?;
    Ok((y, m, n, shape))
}

/// b in w's dtype (bias_add casts it to the output dtype the same way).
fn cast_bias<'a, S: BackendStorage>(
    b: &'a S,
    lb: &Layout,
    dtype: candle_core::DType,
    cast: &'a mut Option<S>,
) -> Result<(&'a S, Layout)> {
    if b.dtype() == dtype {
        return Ok((b, lb.clone()));
    }
    let c = b.to_dtype(lb, dtype)?;
    let l = Layout::contiguous(lb.shape().clone());
    Ok((cast.insert(c), l))
}

/// The forward on either backend: the cast GEMM, then (with a bias) `add_bias` of the bias in
/// w's dtype. `add_bias` is bias_add's CPU or CUDA kernel.
pub(in crate::ops) fn forward<S: BackendStorage>(
    x: (&S, &Layout),
    w: (&S, &Layout),
    b: Option<(&S, &Layout)>,
    add_bias: impl Fn(&S, &Layout, &S, &Layout) -> Result<S>,
) -> Result<(S, Shape)> {
    let (y, m, n, shape) = cast_gemm(x.0, x.1, w.0, w.1)?;
    let Some((b, lb)) = b else {
        return Ok((y, shape));
    };
    let mut cast = None;
    let (b, lb) = cast_bias(b, lb, w.0.dtype(), &mut cast)?;
    // a second buffer: bias.cu's kernel takes x and y as distinct (__restrict__) pointers
    Ok((add_bias(&y, &Layout::contiguous((m, n)), b, &lb)?, shape))
}

/// The CPU forward with a bias. For bf16/f16 weights, the order of the CUDA path's cuBLASLt
/// bias epilogue ([`forward_cuda_bias`]): the GEMM of x and w (both in w's dtype) in f32, plus
/// the bias rounded to w's dtype, rounded once to w's dtype. Other dtypes: [`forward`].
pub(in crate::ops) fn forward_cpu_bias(
    x: (&CpuStorage, &Layout),
    w: (&CpuStorage, &Layout),
    b: (&CpuStorage, &Layout),
) -> Result<(CpuStorage, Shape)> {
    use candle_core::DType::{BF16, F16, F32};
    let dtype = w.0.dtype();
    if !matches!(dtype, BF16 | F16) {
        return forward(x, w, Some(b), bias::add_cpu);
    }
    let (m, n, k, shape) = gemm_dims(x.1, w.1)?;
    let wide = |s: &CpuStorage, l: &Layout, rows_cols: (usize, usize)| -> Result<CpuStorage> {
        // through w's dtype first (what the GEMM reads), then f32 (exact)
        match s.dtype() == dtype {
            true => s.to_dtype(l, F32),
            false => s
                .to_dtype(l, dtype)?
                .to_dtype(&Layout::contiguous(rows_cols), F32),
        }
    };
    let (x32, w32, b32) = (
        wide(x.0, x.1, (m, k))?,
        wide(w.0, w.1, (n, k))?,
        wide(b.0, b.1, (1, n))?,
    );
    let w_t = Layout::contiguous((n, k)).transpose(0, 1)?;
    let y = x32.matmul(&w32, (1, m, n, k), &Layout::contiguous((m, k)), &w_t)?;
    let lb = Layout::contiguous(n);
    let y = bias::add_cpu(&y, &Layout::contiguous((m, n)), &b32, &lb)?;
    Ok((y.to_dtype(&Layout::contiguous((m, n)), dtype)?, shape))
}

/// The CUDA forward with a bias: one cuBLASLt matmul with the bias in its epilogue
/// ([`crate::cuda::gemm_bias`]) for bf16/f16 with w and b contiguous, sizes multiples of 8 and
/// aligned operands (x cast first when its dtype differs), else [`forward`] with `bias.cu`'s
/// add. The epilogue adds the bias before the output's one rounding, as the CPU path
/// ([`forward_cpu_bias`]) does; the unfused form rounds the GEMM's output, then adds in f32 and
/// rounds again (one rounding apart).
#[cfg(feature = "cuda")]
pub(in crate::ops) fn forward_cuda_bias(
    x: (&candle_core::CudaStorage, &Layout),
    w: (&candle_core::CudaStorage, &Layout),
    b: (&candle_core::CudaStorage, &Layout),
) -> Result<(candle_core::CudaStorage, Shape)> {
    let (m, n, k, shape) = gemm_dims(x.1, w.1)?;
    let dtype = w.0.dtype();
    let fused = matches!(dtype, candle_core::DType::BF16 | candle_core::DType::F16)
        && w.1.is_contiguous()
        && b.1.is_contiguous()
        && (x.0.dtype() != dtype || x.1.is_contiguous());
    if !fused {
        return forward(x, w, Some(b), bias::add_cuda);
    }
    let (mut xc, mut bc) = (None, None);
    let (xs, x_off) = match x.0.dtype() == dtype {
        true => (x.0, x.1.start_offset()),
        false => (&*xc.insert(x.0.to_dtype(x.1, dtype)?), 0),
    };
    let (bs, lb) = cast_bias(b.0, b.1, dtype, &mut bc)?;
    let b_off = lb.start_offset();
    let dev = &x.0.device;
    let ws = (w.0, w.1.start_offset());
    // no cuBLASLt algorithm for the shape (or another cuBLASLt failure): the unfused path
    match crate::cuda::gemm_bias::linear_bias(dev, (m, n, k), (xs, x_off), ws, (bs, b_off)) {
        Ok(Some(y)) => Ok((y, shape)),
        Ok(None) | Err(_) => forward(x, w, Some(b), bias::add_cuda),
    }
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        forward((x, lx), (w, lw), None, bias::add_cpu)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        forward((x, lx), (w, lw), None, bias::add_cuda)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = grads(x, w, None, dy)?;
        Ok((dx, offer(w, dw)?))
    }
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        forward_cpu_bias((x, lx), (w, lw), (b, lb))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        forward_cuda_bias((x, lx), (w, lw), (b, lb))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = grads(x, w, Some(b), dy)?;
        Ok((dx, offer(w, dw)?, offer(b, db)?))
    }
}

/// `(dx, dw, db)` from detached tensors (no graph is recorded). candle's matmul takes the
/// transposed views `dy^T` and `w` as they are, so the only buffers are the outputs and, for an
/// x not in w's dtype, its cast (recomputed rather than kept alive from the forward). An input
/// that autograd does not track (a frozen base weight held as a constant, the ids-derived
/// input of a first layer) gets no gradient and costs no GEMM: a LoRA step skips `dW` of every
/// frozen base linear, as PyTorch does for `requires_grad=False`.
pub(in crate::ops) fn grads(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    dy: &Tensor,
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let want_b = b.is_some_and(Tensor::track_op);
    grads_wanted(x, w, b, dy, x.track_op(), w.track_op(), want_b)
}

/// [`grads`] with `dx` computed when `want_x`, `dw` when `want_w` and `db` when `want_b`,
/// whether or not autograd tracks x, w and b (an op that recomputes its GEMM input,
/// [`crate::ops::act_linear`], needs `dx` of an untracked tensor; a block op, `dw` and `db` of a
/// weight and bias it stacked from tracked parts).
pub(in crate::ops) fn grads_wanted(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    dy: &Tensor,
    want_x: bool,
    want_w: bool,
    want_b: bool,
) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
    let (x, w, dy) = (x.detach(), w.detach(), dy.detach());
    let (n, k) = w.dims2()?;
    let m = x.elem_count() / k;
    let dy = if dy.dtype() == w.dtype() {
        dy
    } else {
        dy.to_dtype(w.dtype())?
    };
    let dy2 = dy.reshape((m, n))?;
    let dw = if want_w {
        Some(dy2.t()?.matmul(&x.to_dtype(w.dtype())?.reshape((m, k))?)?)
    } else {
        None
    };
    let dx = if want_x {
        let dx = dy2.matmul(&w)?.reshape(x.shape())?;
        Some(if dx.dtype() == x.dtype() {
            dx
        } else {
            dx.to_dtype(x.dtype())?
        })
    } else {
        None
    };
    let db = match b.filter(|_| want_b) {
        Some(b) => {
            let db = bias::column_sum(&dy2, n)?;
            Some(if db.dtype() == b.dtype() {
                db
            } else {
                db.to_dtype(b.dtype())?
            })
        }
        None => None,
    };
    Ok((dx, dw, db))
}
