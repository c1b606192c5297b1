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

use super::{check_float, cpu_slice, Elem, SideOutput};
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType,
};
use half::{bf16, f16};
use rayon::prelude::*;

/// Per-row cross-entropy of `logits: (N, C)` (f32, bf16 or f16) against class indices
/// `targets: (N,)` (u32; i64 and u8 are converted), as `torch.nn.functional.cross_entropy(...,
/// reduction="none")`: returns `(N,)` f32, differentiable with respect to the logits (the
/// gradient has the logits' dtype). Take `.mean_all()` for the usual mean loss.
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
pub(super) fn cross_entropy_rows_no_bwd(
    logits: &Tensor,
    targets: &Tensor,
) -> Result<(Tensor, CrossEntropyBwd)> {
    let Some((logits, targets)) = checked(logits, targets)? else {
        let empty = Tensor::zeros(0, DType::F32, logits.device())?;
        return Ok((empty, CrossEntropyBwd { lse: None }));
    };
    let fwd = CrossEntropy::default();
    let loss = logits.apply_op2_no_bwd(&targets, &fwd)?;
    Ok((loss, CrossEntropyBwd { lse: fwd.lse.get() }))
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
    super::check_device(op, "targets", logits, targets)?;
    let targets = super::index_u32(op, "targets", targets)?;
    if n == 0 {
        return Ok(None);
    }
    Ok(Some((logits.contiguous()?, targets)))
}

/// The forward op ((x, t) → loss); on CUDA it leaves each row's `lse` (f32, `(N,)`) in `lse`.
#[derive(Default)]
struct CrossEntropy {
    lse: SideOutput,
}

/// The backward op ((x, t, g) → dx), with the forward's `lse` where it kept one (CUDA), else
/// recomputing it.
pub(super) struct CrossEntropyBwd {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    lse: Option<Tensor>,
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

fn bwd_cpu<T: Elem>(x: &[T], t: &[u32], g: &[f32], c: usize) -> Vec<T> {
    let mut dx = vec![T::from32(0.0); x.len()];
    dx.par_chunks_mut(c)
        .zip(x.par_chunks(c))
        .zip(t.par_iter().zip(g.par_iter()))
        .for_each(|((dr, xr), (&k, &gr))| {
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
        "cross_entropy"
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
        Ok((CpuStorage::F32(loss), Shape::from(lx.dims()[0])))
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
        Ok((loss, Shape::from(rows)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        t: &Tensor,
        _loss: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.to_dtype(DType::F32)?.contiguous()?;
        let op = CrossEntropyBwd {
            lse: self.lse.get(),
        };
        let dx = x.apply_op3_no_bwd(t, &g, &op)?;
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
        macro_rules! run {
            ($t:ty) => {{
                let xv = cpu_slice::<$t>(op, "logits", x, lx)?;
                <$t as WithDType>::to_cpu_storage_owned(bwd_cpu(xv, tv, gv, c))
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
            cuda::bwd(x, lx, t, lt, g, lg, lse)
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

    pub(super) fn bwd(
        x: &CudaStorage,
        lx: &Layout,
        t: &CudaStorage,
        lt: &Layout,
        g: &CudaStorage,
        lg: &Layout,
        lse: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        let op = "cross_entropy_backward";
        let dev = &x.device;
        let (rows, c) = rows_cols(op, lx)?;
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
            let (rows_i, c_i) = (rows as i32, c as i32);
            let mut lb = func.builder();
            lb.arg(&xp)
                .arg(&tp)
                .arg(&gp)
                .arg(&sp)
                .arg(&dxp)
                .arg(&rows_i)
                .arg(&c_i);
            // SAFETY: x and dx hold rows * c elements of the kernel's dtype, t, g and lse (when
            // not null) `rows` each.
            unsafe { lb.launch(cfg(rows)) }.w()?;
        }
        Ok((dx, lx.shape().clone()))
    }
}
