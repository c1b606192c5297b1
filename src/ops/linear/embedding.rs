//! Embedding lookup with a scatter-add backward:
//!
//! ```text
//! y[r, :]      = table[ids[r], :]
//! dtable[v, :] = Σ_{r : ids[r] = v} dy[r, :]       (f32 accumulation)
//! ```
//! candle's `index_select` backward is `index_add` into a zero table, whose CUDA kernel gives
//! each thread one column and walks every id: 5.5 ms per step for gptmini's 16384 tokens on an
//! H200 (`profile_gpt_ops`, with the positions). Here the backward is one thread per element of
//! dy with an `atomicAdd` into an f32 table: fast, but the order of the additions into one row
//! is not fixed on the GPU, so the last bits of a row's sum can change between runs (the CPU
//! path adds in row order). With `PerfSettings::deterministic` the CUDA backward uses candle's
//! `index_add` instead (fixed order, slower). Under [`crate::grad_sink::backward`] (the engine's
//! backward) the gradient of a leaf table is written once, without candle's zero-filled table
//! and sum. Kernels: `kernels/embedding.cu`.

use crate::ops::common::{check_device, check_float, cpu_slice, index_u32, Elem};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

/// Rows of `table: (V, C)` (f32, bf16 or f16) picked by `ids` (u32; i64 and u8 are converted;
/// any shape): returns `(ids.dims().., C)` in the table's dtype, differentiable with respect
/// to the table (the gradient is accumulated in f32, then cast to the table's dtype).
///
/// Errors (no panics): a table not rank 2, non-integer ids, devices that differ; on the CPU an
/// id `>= V` (on CUDA, where checking would need a device read, that row is NaN forward and
/// contributes nothing backward).
pub fn embedding(ids: &Tensor, table: &Tensor) -> Result<Tensor> {
    let op = "embedding";
    check_float(op, "table", table.dtype())?;
    let (v, c) = match table.dims() {
        &[v, c] => (v, c),
        d => bail!("{op}: table must be (V, C), found shape {d:?}"),
    };
    check_device(op, "ids", table, ids)?;
    let ids = index_u32(op, "ids", ids)?;
    let mut out_dims = ids.dims().to_vec();
    out_dims.push(c);
    if ids.elem_count() == 0 || c == 0 {
        return Tensor::zeros(out_dims, table.dtype(), table.device());
    }
    let flat = ids.flatten_all()?;
    let y = flat.apply_op2(&table.contiguous()?, Embedding { vocab: v })?;
    y.reshape(out_dims)
}

struct Embedding {
    vocab: usize,
}

/// `(ids, dy) → dtable (V, C)` in f32.
struct EmbeddingBwd {
    vocab: usize,
}

fn check_ids(op: &str, ids: &[u32], vocab: usize) -> Result<()> {
    if let Some((r, id)) = ids.iter().enumerate().find(|(_, &i)| i as usize >= vocab) {
        bail!("{op}: id {id} at position {r} is out of range for a table of {vocab} rows")
    }
    Ok(())
}

fn gather<T: Elem + Copy>(ids: &[u32], table: &[T], c: usize) -> Vec<T> {
    let mut y = Vec::with_capacity(ids.len() * c);
    for &i in ids {
        y.extend_from_slice(&table[i as usize * c..(i as usize + 1) * c]);
    }
    y
}

fn scatter_add<T: Elem>(ids: &[u32], dy: &[T], vocab: usize, c: usize) -> Vec<f32> {
    let mut d = vec![0f32; vocab * c];
    for (r, &i) in ids.iter().enumerate() {
        let row = &mut d[i as usize * c..(i as usize + 1) * c];
        for (o, g) in row.iter_mut().zip(&dy[r * c..(r + 1) * c]) {
            *o += g.to32();
        }
    }
    d
}

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(
        &self,
        ids: &CpuStorage,
        li: &Layout,
        table: &CpuStorage,
        lt: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let iv = cpu_slice::<u32>(op, "ids", ids, li)?;
        check_ids(op, iv, self.vocab)?;
        let c = lt.dims()[1];
        let out = match table.dtype() {
            DType::F32 => CpuStorage::F32(gather(iv, cpu_slice::<f32>(op, "table", table, lt)?, c)),
            DType::BF16 => {
                CpuStorage::BF16(gather(iv, cpu_slice::<bf16>(op, "table", table, lt)?, c))
            }
            DType::F16 => CpuStorage::F16(gather(iv, cpu_slice::<f16>(op, "table", table, lt)?, c)),
            d => bail!("{op}: table dtype {d:?} is not supported"),
        };
        Ok((out, Shape::from((iv.len(), c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ids: &candle_core::CudaStorage,
        li: &Layout,
        table: &candle_core::CudaStorage,
        lt: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::fwd(ids, li, table, lt, self.vocab)
    }

    fn bwd(
        &self,
        ids: &Tensor,
        table: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if !table.track_op() {
            return Ok((None, None)); // a frozen table (a constant): no scatter-add
        }
        let dy = if dy.dtype() == table.dtype() {
            dy.contiguous()?
        } else {
            dy.to_dtype(table.dtype())?.contiguous()?
        };
        let d = if dy.device().is_cuda() && crate::perf::deterministic() {
            // PerfSettings::deterministic: candle's index_add adds each column's ids in order
            // (slow, but the same bits every run)
            // candle's index_add skips u32::MAX and asserts on other out-of-range ids: map
            // those to u32::MAX so that they contribute nothing, as the fused kernel does
            let c = dy.dim(1)?;
            let skip = Tensor::full(u32::MAX, ids.shape(), ids.device())?;
            let ids = ids.ge(self.vocab as u32)?.where_cond(&skip, ids)?;
            Tensor::zeros((self.vocab, c), DType::F32, dy.device())?.index_add(
                &ids,
                &dy.to_dtype(DType::F32)?,
                0,
            )?
        } else {
            ids.apply_op2_no_bwd(&dy, &EmbeddingBwd { vocab: self.vocab })?
        };
        let d = if d.dtype() == table.dtype() {
            d
        } else {
            d.to_dtype(table.dtype())?
        };
        // under crate::grad_sink::backward a leaf table's gradient skips candle's zeros + add
        Ok((None, crate::grad_sink::offer(table, Some(d))?))
    }
}

impl CustomOp2 for EmbeddingBwd {
    fn name(&self) -> &'static str {
        "embedding_backward"
    }

    fn cpu_fwd(
        &self,
        ids: &CpuStorage,
        li: &Layout,
        dy: &CpuStorage,
        ld: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let iv = cpu_slice::<u32>(op, "ids", ids, li)?;
        check_ids(op, iv, self.vocab)?;
        let c = ld.dims()[1];
        let d = match dy.dtype() {
            DType::F32 => scatter_add(iv, cpu_slice::<f32>(op, "dy", dy, ld)?, self.vocab, c),
            DType::BF16 => scatter_add(iv, cpu_slice::<bf16>(op, "dy", dy, ld)?, self.vocab, c),
            DType::F16 => scatter_add(iv, cpu_slice::<f16>(op, "dy", dy, ld)?, self.vocab, c),
            d => bail!("{op}: dy dtype {d:?} is not supported"),
        };
        Ok((CpuStorage::F32(d), Shape::from((self.vocab, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ids: &candle_core::CudaStorage,
        li: &Layout,
        dy: &candle_core::CudaStorage,
        ld: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::bwd(ids, li, dy, ld, self.vocab)
    }
}

/// CUDA launchers for `kernels/embedding.cu`.
#[cfg(feature = "cuda")]
mod cuda {
    use crate::cuda::launch::{alloc, dtype_name, grid_stride_cfg, in_ptr, out_ptr, zeros_f32};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    const MODULE: &str = "wick_ops_embedding";

    pub(super) fn fwd(
        ids: &CudaStorage,
        li: &Layout,
        table: &CudaStorage,
        lt: &Layout,
        vocab: usize,
    ) -> Result<(CudaStorage, Shape)> {
        let op = "embedding";
        let dev = &table.device;
        let rows = li.shape().elem_count();
        let c = lt.dims()[1];
        let mut y = alloc(dev, table.dtype(), rows * c)?;
        {
            let stream = dev.cuda_stream();
            let (ip, _gi) = in_ptr(op, "ids", ids, li, &stream)?;
            let (tp, _gt) = in_ptr(op, "table", table, lt, &stream)?;
            let (yp, _gy) = out_ptr(&mut y, &stream)?;
            let name = format!("emb_fwd_{}", dtype_name(op, table.dtype())?);
            let func = dev.get_or_load_custom_func(&name, MODULE, crate::cuda::ptx::EMBEDDING)?;
            let (rows_i, c_i, v_i) = (rows as i64, c as i32, vocab as u32);
            let mut lb = func.builder();
            lb.arg(&ip)
                .arg(&tp)
                .arg(&yp)
                .arg(&rows_i)
                .arg(&c_i)
                .arg(&v_i);
            // SAFETY: ids holds `rows` u32, table vocab * c and y rows * c elements.
            unsafe { lb.launch(grid_stride_cfg(rows * c)) }.w()?;
        }
        Ok((y, Shape::from((rows, c))))
    }

    pub(super) fn bwd(
        ids: &CudaStorage,
        li: &Layout,
        dy: &CudaStorage,
        ld: &Layout,
        vocab: usize,
    ) -> Result<(CudaStorage, Shape)> {
        let op = "embedding_backward";
        let dev = &dy.device;
        let rows = li.shape().elem_count();
        let c = ld.dims()[1];
        let mut d = zeros_f32(dev, vocab * c)?;
        {
            let stream = dev.cuda_stream();
            let (ip, _gi) = in_ptr(op, "ids", ids, li, &stream)?;
            let (gp, _gg) = in_ptr(op, "dy", dy, ld, &stream)?;
            let (dp, _gd) = out_ptr(&mut d, &stream)?;
            let name = format!("emb_bwd_{}", dtype_name(op, dy.dtype())?);
            let func = dev.get_or_load_custom_func(&name, MODULE, crate::cuda::ptx::EMBEDDING)?;
            let (rows_i, c_i, v_i) = (rows as i64, c as i32, vocab as u32);
            let mut lb = func.builder();
            lb.arg(&ip)
                .arg(&gp)
                .arg(&dp)
                .arg(&rows_i)
                .arg(&c_i)
                .arg(&v_i);
            // SAFETY: ids holds `rows` u32, dy rows * c elements, d vocab * c f32.
            unsafe { lb.launch(grid_stride_cfg(rows * c)) }.w()?;
        }
        Ok((d, Shape::from((vocab, c))))
    }
}
