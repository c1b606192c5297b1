//! Cross-entropy with its gradient, fused and differentiable:
//!
//! ```text
//! loss[r]  = lse(x[r]) - x[r][t[r]]                lse(v) = max(v) + log(sum(exp(v - max(v))))
//! dx[r][j] = g[r] * (softmax(x[r])[j] - [j == t[r]])
//! ```
//! One graph node instead of candle's log_softmax + gather + their backward: the logits stay in
//! their storage dtype (no f32 copy, no log-probability tensor, which for GPT-2's 16384 x 50304
//! logits are 3.3 GB each), the forward reads them once and keeps `lse` (one f32 per row, on
//! CUDA), the backward reads them once more and writes `dx` in the logits' dtype. Arithmetic is f32 whatever the storage dtype (wick's
//! autocast policy: losses in f32). Kernels: `kernels/cross_entropy.cu`.
//!
//! [`cross_entropy_mean`] is the same node with the mean over the rows folded in: its forward
//! adds the rows' losses in the op (no `sum_all` / affine nodes), its backward takes the scalar
//! upstream gradient and applies `g / N` inside the backward kernel, where candle's `mean_all`
//! would have run an affine and four zeroed-buffer adds (one per node) before it.

use crate::ops::common::{check_device, check_float, cpu_slice, index_u32, Elem, SideOutput};
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType,
};
use half::{bf16, f16};
use rayon::prelude::*;

/// Per-row cross-entropy of `logits: (N, C)` (f32, bf16 or f16) against class indices
/// `targets: (N,)` (u32; i64 and u8 are converted), as `torch.nn.functional.cross_entropy(...,
/// reduction="none")`: returns `(N,)` f32, differentiable with respect to the logits (the
/// gradient has the logits' dtype). For the usual mean loss use [`cross_entropy_mean`] (one
/// node; `.mean_all()` of this gives the same value in three more).
///
/// Errors (no panics): shapes other than `(N, C)` and `(N,)`, non-integer targets, devices that
/// differ, `C == 0`. A target `>= C` is an error on the CPU; on CUDA (where checking would
/// need a device read) that row's loss and gradient are NaN.
pub fn cross_entropy_rows(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let Some((logits, targets)) = checked(logits, targets)? else {
        return Tensor::zeros(0, DType::F32, logits.device());
    };
    logits.apply_op2(&targets, CrossEntropy::default())
}

/// [`cross_entropy_rows`] outside the graph, with the backward op that turns the same logits and
/// a loss gradient into `dlogits` (holding the forward's `lse` on CUDA): for ops that call the
/// backward themselves. Errors: as [`cross_entropy_rows`].
pub(in crate::ops) fn cross_entropy_rows_no_bwd(
    logits: &Tensor,
    targets: &Tensor,
) -> Result<(Tensor, CrossEntropyBwd)> {
    let Some((logits, targets)) = checked(logits, targets)? else {
        let empty = Tensor::zeros(0, DType::F32, logits.device())?;
        let bwd = CrossEntropyBwd {
            lse: None,
            mean_of: None,
        };
        return Ok((empty, bwd));
    };
    let fwd = CrossEntropy::default();
    let loss = logits.apply_op2_no_bwd(&targets, &fwd)?;
    Ok((loss, fwd.backward_op(logits.dim(0)?)))
}

/// Mean cross-entropy of `logits: (N, C)` (f32, bf16 or f16) against class indices
/// `targets: (N,)` (u32; i64 and u8 are converted), as `torch.nn.functional.cross_entropy(...,
/// reduction="mean")`: returns a rank-0 f32 tensor, `mean_r(lse(x[r]) - x[r][t[r]])`,
/// differentiable with respect to the logits (gradient `g / N * (softmax(x[r]) - onehot(t[r]))`
/// in the logits' dtype). The values are those of `cross_entropy_rows(..)?.mean_all()` up to
/// the order of the f32 sum over the rows (the gradient is the same bit for bit); it is one
/// graph node instead of four.
///
/// Errors (no panics): those of [`cross_entropy_rows`], and an empty batch (`N == 0`, whose
/// mean is undefined). A target `>= C` is an error on the CPU and a NaN loss on CUDA.
pub fn cross_entropy_mean(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let Some((logits, targets)) = checked(logits, targets)? else {
        bail!("cross_entropy_mean: the batch is empty (N = 0); the mean of no rows is undefined")
    };
    let op = CrossEntropy {
        mean: true,
        ..CrossEntropy::default()
    };
    logits.apply_op2(&targets, op)
}

/// The checked operands: contiguous logits and u32 targets, or `None` for zero rows.
fn checked(logits: &Tensor, targets: &Tensor) -> Result<Option<(Tensor, Tensor)>> {
    let op = "cross_entropy";
    check_float(op, "logits", logits.dtype())?;
    let (n, c) = match logits.dims() {
        &[n, c] if c > 0 => (n, c),
        d => bail!("{op}: logits must be (N, C) with C > 0, found shape {d:?}"),
    };
    match targets.dims() {
        &[m] if m == n => {}
        d => bail!("{op}: targets must be (N,) = ({n},) to match logits ({n}, {c}), found {d:?}"),
    }
    check_device(op, "targets", logits, targets)?;
    let targets = index_u32(op, "targets", targets)?;
    if n == 0 {
        return Ok(None);
    }
    Ok(Some((logits.contiguous()?, targets)))
}

/// The forward op: (x, t) → the rows' losses `(N,)`, or with `mean` their mean (rank 0). On
/// CUDA it leaves each row's `lse` (f32, `(N,)`) in `lse`.
#[derive(Default)]
struct CrossEntropy {
    lse: SideOutput,
    mean: bool,
}

impl CrossEntropy {
    /// The backward op of a forward over `rows` rows, with the `lse` it kept.
    fn backward_op(&self, rows: usize) -> CrossEntropyBwd {
        CrossEntropyBwd {
            lse: self.lse.get(),
            mean_of: self.mean.then(|| inv_rows(rows)),
        }
    }
}

/// The backward op ((x, t, g) → dx), with the forward's `lse` where it kept one (CUDA), else
/// recomputing it. Row `r`'s upstream gradient is `g[r]` (`mean_of: None`, g: `(N,)`), or
/// `g[0] * (1 / N)` for the mean loss (`mean_of: Some(1 / N as f32)`, g: one element).
pub(in crate::ops) struct CrossEntropyBwd {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    lse: Option<Tensor>,
    mean_of: Option<f32>,
}

impl CrossEntropyBwd {
    /// `(g_stride, g_scale)`: row r's gradient is `g[r * g_stride] * g_scale`.
    fn g_index(&self) -> (usize, f32) {
        match self.mean_of {
            Some(inv_n) => (0, inv_n),
            None => (1, 1.0),
        }
    }
}

/// `1 / rows` as the f32 that candle's `affine(x, 1 / rows, 0)` multiplies by.
fn inv_rows(rows: usize) -> f32 {
    (1.0 / rows as f64) as f32
}

/// `lse` of one row, f32, the kernel's formula (max first, then the sum of exponentials).
fn row_lse<T: Elem>(xr: &[T]) -> f32 {
    let m = xr
        .iter()
        .map(|v| v.to32())
        .fold(f32::NEG_INFINITY, f32::max);
    let s: f32 = xr.iter().map(|v| (v.to32() - m).exp()).sum();
    m + s.ln()
}

fn check_targets(op: &str, t: &[u32], c: usize) -> Result<()> {
    if let Some((r, k)) = t.iter().enumerate().find(|(_, k)| **k as usize >= c) {
        bail!("{op}: target {k} at row {r} is out of range for {c} classes (expected 0..{c})")
    }
    Ok(())
}

fn fwd_cpu<T: Elem>(x: &[T], t: &[u32], c: usize) -> Vec<f32> {
    x.par_chunks(c)
        .zip(t.par_iter())
        .map(|(xr, &k)| row_lse(xr) - xr[k as usize].to32())
        .collect()
}

/// The mean of the rows' losses: an f32 sum in row order, times `1 / rows` (in f32, as
/// candle's `mean_all` scales its sum).
fn mean_cpu(loss: &[f32]) -> f32 {
    loss.iter().sum::<f32>() * inv_rows(loss.len())
}

/// `dx` with row r's upstream gradient `g[r * g_stride] * g_scale` (the CUDA kernel's).
fn bwd_cpu<T: Elem>(
    x: &[T],
    t: &[u32],
    g: &[f32],
    (stride, scale): (usize, f32),
    c: usize,
) -> Vec<T> {
    let mut dx = vec![T::from32(0.0); x.len()];
    dx.par_chunks_mut(c)
        .zip(x.par_chunks(c))
        .zip(t.par_iter())
        .enumerate()
        .for_each(|(r, ((dr, xr), &k))| {
            let gr = g[r * stride] * scale;
            let lse = row_lse(xr);
            for (j, (o, v)) in dr.iter_mut().zip(xr).enumerate() {
                let hot = if j == k as usize { 1.0 } else { 0.0 };
                *o = T::from32(gr * ((v.to32() - lse).exp() - hot));
            }
        });
    dx
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        if self.mean {
            "cross_entropy_mean"
        } else {
            "cross_entropy"
        }
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        t: &CpuStorage,
        lt: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let c = lx.dims()[1];
        let tv = cpu_slice::<u32>(op, "targets", t, lt)?;
        check_targets(op, tv, c)?;
        macro_rules! run {
            ($t:ty) => {{
                fwd_cpu(cpu_slice::<$t>(op, "logits", x, lx)?, tv, c)
            }};
        }
        let loss = with_type!(op, x.dtype(), run);
        Ok(match self.mean {
            true => (CpuStorage::F32(vec![mean_cpu(&loss)]), Shape::from(())),
            false => (CpuStorage::F32(loss), Shape::from(lx.dims()[0])),
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        t: &candle_core::CudaStorage,
        lt: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (loss, lse) = cuda::fwd(x, lx, t, lt)?;
        let rows = lx.dims()[0];
        self.lse.put(candle_core::Storage::Cuda(lse), rows);
        Ok(match self.mean {
            true => (cuda::mean(&loss, rows, inv_rows(rows))?, Shape::from(())),
            false => (loss, Shape::from(rows)),
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        t: &Tensor,
        _loss: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.to_dtype(DType::F32)?.contiguous()?;
        let dx = x.apply_op3_no_bwd(t, &g, &self.backward_op(x.dim(0)?))?;
        Ok((Some(dx), None))
    }
}

impl CustomOp3 for CrossEntropyBwd {
    fn name(&self) -> &'static str {
        "cross_entropy_backward"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        t: &CpuStorage,
        lt: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let c = lx.dims()[1];
        let tv = cpu_slice::<u32>(op, "targets", t, lt)?;
        let gv = cpu_slice::<f32>(op, "g", g, lg)?;
        let gi = self.g_index();
        let need = if gi.0 == 0 { 1 } else { tv.len() };
        if gv.len() < need {
            bail!(
                "{op}: {} upstream gradients for {} rows (internal error)",
                gv.len(),
                tv.len()
            )
        }
        macro_rules! run {
            ($t:ty) => {{
                let xv = cpu_slice::<$t>(op, "logits", x, lx)?;
                <$t as WithDType>::to_cpu_storage_owned(bwd_cpu(xv, tv, gv, gi, c))
            }};
        }
        Ok((with_type!(op, x.dtype(), run), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        t: &candle_core::CudaStorage,
        lt: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::launch::with_saved(self.name(), "lse", self.lse.as_ref(), |lse| {
            cuda::bwd(x, lx, t, lt, (g, lg), self.g_index(), lse)
        })
    }
}

/// CUDA launchers for `kernels/cross_entropy.cu`.
#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::launch::{alloc, dtype_name, in_ptr, out_ptr, rows_cols, vec_ok};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, DType, Layout, Result, Shape};

    const MODULE: &str = "wick_ops_cross_entropy";
    /// `CE_THREADS` in kernels/cross_entropy.cu: one block per row.
    const THREADS: u32 = 512;

    fn cfg(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// `(loss, lse)`, each `(rows,)` f32.
    pub(super) fn fwd(
        x: &CudaStorage,
        lx: &Layout,
        t: &CudaStorage,
        lt: &Layout,
    ) -> Result<(CudaStorage, CudaStorage)> {
        let op = "cross_entropy";
        let dev = &x.device;
        let (rows, c) = rows_cols(op, lx)?;
        let mut loss = alloc(dev, DType::F32, rows)?;
        let mut lse = alloc(dev, DType::F32, rows)?;
        {
            let stream = dev.cuda_stream();
            let (xp, _gx) = in_ptr(op, "logits", x, lx, &stream)?;
            let (tp, _gt) = in_ptr(op, "targets", t, lt, &stream)?;
            let (lp, _gl) = out_ptr(&mut loss, &stream)?;
            let (sp, _gs) = out_ptr(&mut lse, &stream)?;
            let vec = vec_ok(c, x.dtype().size_in_bytes(), &[xp]);
            let kernel = format!(
                "ce_fwd_{}{}",
                dtype_name(op, x.dtype())?,
                if vec { "_vec" } else { "" }
            );
            let func =
                dev.get_or_load_custom_func(&kernel, MODULE, crate::cuda::ptx::CROSS_ENTROPY)?;
            let (rows_i, c_i) = (rows as i32, c as i32);
            let mut lb = func.builder();
            lb.arg(&xp)
                .arg(&tp)
                .arg(&lp)
                .arg(&sp)
                .arg(&rows_i)
                .arg(&c_i);
            // SAFETY: x holds rows * c elements of the kernel's dtype, t, loss and lse `rows`
            // u32 / f32 / f32.
            unsafe { lb.launch(cfg(rows)) }.w()?;
        }
        Ok((loss, lse))
    }

    /// The mean of `rows` f32 losses times `inv_n`, one f32 (`ce_mean`).
    pub(super) fn mean(loss: &CudaStorage, rows: usize, inv_n: f32) -> Result<CudaStorage> {
        let op = "cross_entropy_mean";
        let dev = &loss.device;
        let mut out = alloc(dev, DType::F32, 1)?;
        {
            let stream = dev.cuda_stream();
            let (lp, _gl) = in_ptr(op, "loss", loss, &Layout::contiguous(rows), &stream)?;
            let (op_, _go) = out_ptr(&mut out, &stream)?;
            let func =
                dev.get_or_load_custom_func("ce_mean", MODULE, crate::cuda::ptx::CROSS_ENTROPY)?;
            let rows_i = rows as i32;
            let mut lb = func.builder();
            lb.arg(&lp).arg(&op_).arg(&rows_i).arg(&inv_n);
            // SAFETY: loss holds `rows` f32, out one.
            unsafe { lb.launch(cfg(1)) }.w()?;
        }
        Ok(out)
    }

    /// `dx`; row r's upstream gradient is `g[r * g_stride] * g_scale`.
    pub(super) fn bwd(
        x: &CudaStorage,
        lx: &Layout,
        t: &CudaStorage,
        lt: &Layout,
        (g, lg): (&CudaStorage, &Layout),
        (g_stride, g_scale): (usize, f32),
        lse: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        let op = "cross_entropy_backward";
        let dev = &x.device;
        let (rows, c) = rows_cols(op, lx)?;
        let need = if g_stride == 0 { 1 } else { rows };
        if lg.shape().elem_count() < need {
            candle_core::bail!(
                "{op}: {} upstream gradients for {rows} rows (internal error)",
                lg.shape().elem_count()
            )
        }
        let mut dx = alloc(dev, x.dtype(), rows * c)?;
        {
            let stream = dev.cuda_stream();
            let (xp, _gx) = in_ptr(op, "logits", x, lx, &stream)?;
            let (tp, _gt) = in_ptr(op, "targets", t, lt, &stream)?;
            let (gp, _gg) = in_ptr(op, "g", g, lg, &stream)?;
            let lse = lse
                .map(|(s, l)| in_ptr(op, "lse", s, l, &stream))
                .transpose()?;
            let sp = lse.as_ref().map_or(0u64, |(p, _)| *p); // 0: the kernel recomputes lse
            let (dxp, _gdx) = out_ptr(&mut dx, &stream)?;
            let vec = vec_ok(c, x.dtype().size_in_bytes(), &[xp, dxp]);
            let kernel = format!(
                "ce_bwd_{}{}",
                dtype_name(op, x.dtype())?,
                if vec { "_vec" } else { "" }
            );
            let func =
                dev.get_or_load_custom_func(&kernel, MODULE, crate::cuda::ptx::CROSS_ENTROPY)?;
            let (rows_i, c_i, stride_i) = (rows as i32, c as i32, g_stride as i32);
            let mut lb = func.builder();
            lb.arg(&xp)
                .arg(&tp)
                .arg(&gp)
                .arg(&sp)
                .arg(&dxp)
                .arg(&rows_i)
                .arg(&c_i)
                .arg(&stride_i)
                .arg(&g_scale);
            // SAFETY: x and dx hold rows * c elements of the kernel's dtype, t and lse (when
            // not null) `rows` each, g `rows` (g_stride 1) or one (g_stride 0).
            unsafe { lb.launch(cfg(rows)) }.w()?;
        }
        Ok((dx, lx.shape().clone()))
    }
}
