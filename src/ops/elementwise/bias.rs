//! Bias add over the last dimension, fused and differentiable:
//!
//! ```text
//! y  = x + b          x: (.., C), b: (C,)
//! dx = dy             (passed through, no copy)
//! db = Σ_rows dy      (f32 accumulation)
//! ```
//! candle's `broadcast_add` runs a strided-index kernel forward (0.45 ms for gptmini's
//! 16384 x 1536 bf16 MLP activations on an H200, about 9x the cost of the 16-byte-vector
//! kernel here), and its backward reduces the rows with one thread block per column reading a
//! strided column. Here the column sum is one kernel on CUDA (`bias_grad`: f32 accumulation in
//! a fixed order, rounded once to dy's dtype; it replaced a `ones(1, N) @ dy` GEMV, which took
//! two launches and an allocation for the ones) and an f32 `sum` on the CPU (candle's CPU half
//! GEMM accumulates in the half dtype). Kernels: `kernels/bias.cu`.

use crate::ops::common::{check_device, check_float, cpu_slice, Elem};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

/// `x + b` broadcast over the leading dimensions of `x: (.., C)`, `b: (C,)`; the result has x's
/// dtype (b is cast to it, differentiably, when it differs). Arithmetic in f32.
///
/// Errors (no panics): b not `(C,)` for x's last dimension `C`; a dtype other than
/// f32/bf16/f16; devices that differ.
pub fn bias_add(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    check_float("bias_add", "x", x.dtype())?;
    check_float("bias_add", "b", b.dtype())?;
    check_device("bias_add", "b", x, b)?;
    let c = x.dims().last().copied().unwrap_or(0);
    if x.rank() == 0 || b.dims() != [c] {
        bail!(
            "bias_add: b must be (C,) for x (.., C); found x {:?} and b {:?}",
            x.dims(),
            b.dims()
        )
    }
    let b = if b.dtype() == x.dtype() {
        b.clone()
    } else {
        b.to_dtype(x.dtype())?
    };
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    x.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd)
}

struct BiasAdd;

/// The column sum of a contiguous `(rows, C)` CUDA tensor as one op (no graph): `(C,)` in its
/// dtype, f32 accumulation rounded once (`bias_grad`, module docs). CPU gradients take
/// [`column_sum`]'s f32 sum instead.
struct ColumnSum;

impl CustomOp1 for ColumnSum {
    fn name(&self) -> &'static str {
        "bias_grad"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("bias_grad: the column-sum kernel runs on CUDA only; the CPU path sums in f32 (internal error)")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, c) = l.shape().dims2()?;
        Ok((cuda::column_sum(s, l, rows, c)?, Shape::from(c)))
    }
}

fn fwd_cpu<T: Elem>(x: &[T], b: &[T]) -> Vec<T> {
    let c = b.len();
    let mut y = vec![T::from32(0.0); x.len()];
    y.par_chunks_mut(c)
        .zip(x.par_chunks(c))
        .for_each(|(yr, xr)| {
            for ((o, v), w) in yr.iter_mut().zip(xr).zip(b) {
                *o = T::from32(v.to32() + w.to32());
            }
        });
    y
}

/// Storage-level forward, `x + b` for a contiguous `x: (.., C)` and `b: (C,)` of the same
/// dtype, into a new buffer. Shared with ops that end in a bias add (`linear`), so
/// that their bias has exactly this op's numerics.
pub(in crate::ops) fn add_cpu(
    x: &CpuStorage,
    lx: &Layout,
    b: &CpuStorage,
    lb: &Layout,
) -> Result<CpuStorage> {
    let op = "bias_add";
    if x.dtype() != b.dtype() {
        bail!(
            "{op}: x is {:?} but b is {:?} (internal error: callers cast b)",
            x.dtype(),
            b.dtype()
        )
    }
    macro_rules! run {
        ($t:ty) => {{
            let xv = cpu_slice::<$t>(op, "x", x, lx)?;
            let bv = cpu_slice::<$t>(op, "b", b, lb)?;
            <$t as candle_core::WithDType>::to_cpu_storage_owned(fwd_cpu(xv, bv))
        }};
    }
    Ok(with_type!(op, x.dtype(), run))
}

/// [`add_cpu`] on the GPU (the kernels of `kernels/bias.cu`).
#[cfg(feature = "cuda")]
pub(in crate::ops) fn add_cuda(
    x: &candle_core::CudaStorage,
    lx: &Layout,
    b: &candle_core::CudaStorage,
    lb: &Layout,
) -> Result<candle_core::CudaStorage> {
    if x.dtype() != b.dtype() {
        bail!(
            "bias_add: x is {:?} but b is {:?} (internal error: callers cast b)",
            x.dtype(),
            b.dtype()
        )
    }
    cuda::fwd(x, lx, b, lb)
}

/// The bias gradient of `dy: (.., C)`: the sum over all rows, `(C,)`: in dy's dtype from the
/// CUDA kernel (f32 accumulation, one rounding), in f32 from the CPU's f32 sums (the caller
/// casts to the bias's dtype, so on the CPU an f32 bias master gets the f32 sum unrounded).
/// Shared with `linear`'s backward.
pub(in crate::ops) fn column_sum(dy: &Tensor, c: usize) -> Result<Tensor> {
    let rows = dy.elem_count() / c.max(1);
    let dy2 = dy.reshape((rows, c))?;
    if dy.device().is_cuda() && rows > 0 && c > 0 {
        check_float("bias_grad", "dy", dy.dtype())?;
        return dy2.detach().contiguous()?.apply_op1_no_bwd(&ColumnSum);
    }
    match dy.dtype() {
        DType::F32 => dy2.sum(0),
        _ => dy2.to_dtype(DType::F32)?.sum(0),
    }
}

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "bias_add"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok((add_cpu(x, lx, b, lb)?, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((add_cuda(x, lx, b, lb)?, lx.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let db = column_sum(dy, b.dim(0)?)?;
        let db = if db.dtype() == b.dtype() {
            db
        } else {
            db.to_dtype(b.dtype())?
        };
        Ok((Some(dy.clone()), crate::grad_sink::offer(b, Some(db))?))
    }
}

/// CUDA launcher for `kernels/bias.cu`.
#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::launch::{alloc, dtype_name, grid_stride_cfg, in_ptr, out_ptr, vec_ok};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, Layout, Result};

    const MODULE: &str = "wick_ops_bias";

    /// `BG_X` x `BG_Y` in kernels/bias.cu.
    const BG_X: usize = 32;
    const BG_Y: usize = 32;
    /// Up to this many rows one chunk (one launch); beyond, chunks of `CHUNK` rows and a
    /// second, finishing launch (enough blocks to fill the GPU for tall gradients).
    const ONE_CHUNK_ROWS: usize = 4096;
    const CHUNK: usize = 1024;

    /// `db[c] = sum_r dy[r][c]` for a contiguous `dy: (rows, c)`, in dy's dtype.
    pub(super) fn column_sum(
        dy: &CudaStorage,
        l: &Layout,
        rows: usize,
        c: usize,
    ) -> Result<CudaStorage> {
        let op = "bias_grad";
        crate::cuda::launch::rows_cols(op, l)?; // i32 ranges
        let dev = &dy.device;
        let tn = dtype_name(op, dy.dtype())?;
        // chunks of CHUNK rows, longer where more would pass the grid's y limit (65535); the
        // split depends on the shape only
        let chunk = if rows <= ONE_CHUNK_ROWS {
            rows
        } else {
            CHUNK.max(rows.div_ceil(65535))
        };
        let chunks = rows.div_ceil(chunk.max(1)).max(1);
        let mut db = alloc(dev, dy.dtype(), c)?;
        let mut partials = match chunks > 1 {
            true => Some(alloc(dev, candle_core::DType::F32, chunks * c)?),
            false => None,
        };
        {
            let stream = dev.cuda_stream();
            let (dyp, _gdy) = in_ptr(op, "dy", dy, l, &stream)?;
            let (dbp, _gdb) = out_ptr(&mut db, &stream)?;
            let part = partials.as_mut().map(|p| out_ptr(p, &stream)).transpose()?;
            let pp = part.as_ref().map_or(0u64, |(p, _)| *p); // 0: write db directly
            let func = dev.get_or_load_custom_func(
                &format!("bias_grad_{tn}"),
                MODULE,
                crate::cuda::ptx::BIAS,
            )?;
            let cfg = LaunchConfig {
                grid_dim: (c.div_ceil(BG_X) as u32, chunks as u32, 1),
                block_dim: (BG_X as u32, BG_Y as u32, 1),
                shared_mem_bytes: 0,
            };
            let (rows_i, c_i, chunk_i) = (rows as i32, c as i32, chunk as i32);
            let mut lb = func.builder();
            lb.arg(&dyp)
                .arg(&dbp)
                .arg(&pp)
                .arg(&rows_i)
                .arg(&c_i)
                .arg(&chunk_i);
            // SAFETY: dy holds rows * c elements, db c, partials (when not null) chunks * c f32.
            unsafe { lb.launch(cfg) }.w()?;
            if chunks > 1 {
                let func = dev.get_or_load_custom_func(
                    &format!("bias_grad_finish_{tn}"),
                    MODULE,
                    crate::cuda::ptx::BIAS,
                )?;
                let chunks_i = chunks as i32;
                let mut lb = func.builder();
                lb.arg(&pp).arg(&dbp).arg(&chunks_i).arg(&c_i);
                let cfg = LaunchConfig {
                    grid_dim: (c.div_ceil(256) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: partials holds chunks * c f32, db c elements.
                unsafe { lb.launch(cfg) }.w()?;
            }
            drop(part);
        }
        Ok(db)
    }

    pub(super) fn fwd(
        x: &CudaStorage,
        lx: &Layout,
        b: &CudaStorage,
        lb: &Layout,
    ) -> Result<CudaStorage> {
        let op = "bias_add";
        let dev = &x.device;
        let n = lx.shape().elem_count();
        let c = lb.shape().elem_count();
        let mut y = alloc(dev, x.dtype(), n)?;
        {
            let stream = dev.cuda_stream();
            let (xp, _gx) = in_ptr(op, "x", x, lx, &stream)?;
            let (bp, _gb) = in_ptr(op, "b", b, lb, &stream)?;
            let (yp, _gy) = out_ptr(&mut y, &stream)?;
            let elem = x.dtype().size_in_bytes();
            let vec = vec_ok(c, elem, &[xp, bp, yp]);
            let name = format!(
                "bias_add_{}{}",
                dtype_name(op, x.dtype())?,
                if vec { "_vec" } else { "" }
            );
            let func = dev.get_or_load_custom_func(&name, MODULE, crate::cuda::ptx::BIAS)?;
            let per_thread = if vec { 16 / elem } else { 1 };
            let cfg = grid_stride_cfg(n.div_ceil(per_thread));
            let (n_i, c_i) = (n as i64, c as i32);
            let mut lb = func.builder();
            lb.arg(&xp).arg(&bp).arg(&yp).arg(&n_i).arg(&c_i);
            // SAFETY: x and y hold n elements, b holds c, of the kernel's dtype.
            unsafe { lb.launch(cfg) }.w()?;
        }
        Ok(y)
    }
}
