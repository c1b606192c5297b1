//! The CUDA path of [`crate::ops::lora_linear_grouped`]: the forward and the backward as one small
//! kernel and a few cuBLAS GEMMs on device addresses ([`crate::cuda::gemm`]), with no widened
//! copies and no passes over the tokens besides the GEMMs. With `s` the scale, part `i` of the
//! stack at output rows `c_i` of W, rank columns `q_i` of `u` and rows `r_i` of `b`:
//!
//! ```text
//! forward    W' = W + s B_bd A                 (N, K): the adapters merged into a copy of W
//!            y = x W'^T                        (M, N): one GEMM, as for the frozen base alone
//! backward   dx = dy W'                        (= dy W + s (dy B_bd) A)
//!            u = x A^T                         (M, R)
//!            g[:, q_i] = dy[:, c_i] B_i        (M, R)
//!            dA = s g^T x                      (R, K)
//!            dB_i = s dy[:, c_i]^T u[:, q_i]
//! ```
//! `B_bd` is the block-diagonal `(N, R)` up projection (part i's `B_i` at its output rows and
//! rank columns, zeros elsewhere). The merge (`kernels/lora.cu`, one launch) reads W, A and B
//! and writes W' once per call, independent of the M tokens, and it takes every `(M, N)` and
//! `(M, K)` update pass off the token dimension: the forward and dx cost what the frozen base
//! alone costs. W' is rounded once to the compute dtype (the merge accumulates in f32), as
//! PEFT's `merge` does for bf16 weights; PEFT's unmerged `lora.Linear` instead rounds the base
//! output and the update separately. With fewer than [`MERGE_MIN_ROWS`] tokens per input
//! feature (decoding), the forward stays unmerged: the update GEMMs `s u B_i^T` are written
//! first and the base GEMM accumulates onto them (beta = 1).
//! Adjacent parts of the same size (`k_proj`/`v_proj`, `gate_proj`/`up_proj`) share one strided
//! batched GEMM per product. The backward's three results come back as views of one allocation.

use super::lora_parts::Block;
use crate::cuda::gemm::{gemm, gemm_batched, Batch, Operand as Op};
use crate::cuda::launch::{alloc, dtype_name, in_ptr, out_ptr};
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Storage,
    Tensor,
};
use std::sync::Mutex;

const OP: &str = "lora_linear";

/// Sizes of one grouped LoRA GEMM: `x (M, K)`, `W (N, K)`, `A (R, K)`, `B (N_adapted, r)`.
#[derive(Debug, Clone)]
pub(in crate::ops) struct Dims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub r_sum: usize,
    pub rank: usize,
    pub blocks: Vec<Block>,
    pub scale: f32,
}

impl Dims {
    fn n_adapted(&self) -> usize {
        self.blocks.iter().map(|b| b.rows).sum()
    }

    /// The blocks as runs of adjacent equal blocks, `(first, count)`: block `j` of a run sits
    /// `j * rows` output columns, `j * rank` columns of u and `j * rows` rows of b further.
    fn runs(&self) -> Vec<(Block, usize)> {
        let mut out: Vec<(Block, usize)> = Vec::new();
        for &bl in &self.blocks {
            if let Some((first, count)) = out.last_mut() {
                let j = *count;
                if bl.rows == first.rows
                    && bl.col == first.col + j * first.rows
                    && bl.q == first.q + j * self.rank
                    && bl.b_row == first.b_row + j * first.rows
                {
                    *count += 1;
                    continue;
                }
            }
            out.push((bl, 1));
        }
        out
    }
}

/// The forward merges the adapters into W when there are at least this many tokens per input
/// feature (`M >= 2 K`): the merge reads and writes about `4 N K` elements whatever M is, the
/// unmerged update pass about `2 M N`.
const MERGE_MIN_ROWS: usize = 2;

/// `u = x A^T`, `(M, R)` in the compute dtype.
fn u_gemm(d: &Dims, dev: &CudaDevice, dtype: DType, px: u64, pa: u64, pu: u64) -> Result<()> {
    gemm(
        dev,
        dtype,
        (d.m, d.r_sum, d.k),
        1.0,
        Op::n(px, d.k),
        Op::t(pa, d.k),
        0.0,
        pu,
        d.r_sum,
    )
}

/// Blocks per launch of `kernels/lora.cu` (its `LORA_MAX_PARTS`).
const MAX_PARTS: usize = 8;

/// `kernels/lora.cu`'s `LoraParts`: the adapted blocks of one launch.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct Parts {
    count: i32,
    row: [i32; MAX_PARTS],
    rows: [i32; MAX_PARTS],
    q: [i32; MAX_PARTS],
    b_row: [i32; MAX_PARTS],
}

// SAFETY: `#[repr(C)]` plain data laid out as the kernel's `LoraParts` (ints only).
unsafe impl candle_core::cuda::cudarc::driver::DeviceRepr for Parts {}

/// `kernels/lora.cu`'s launch shape: 256 threads over the columns, one block row per
/// output row (up to the grid's limit; the kernel strides over the rest).
fn merge_cfg(n: usize, k: usize) -> candle_core::cuda::cudarc::driver::LaunchConfig {
    const THREADS: usize = 256;
    candle_core::cuda::cudarc::driver::LaunchConfig {
        grid_dim: (
            k.div_ceil(THREADS).max(1) as u32,
            n.clamp(1, 65_535) as u32,
            1,
        ),
        block_dim: (THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The merged weight `W' = W + s B_bd A`, `(N, K)` (`kernels/lora.cu`: r products per element
/// in f32, one rounding to the compute dtype), one launch per [`MAX_PARTS`] blocks.
fn merge(
    d: &Dims,
    (w, lw): (&CudaStorage, &Layout),
    (a, la): (&CudaStorage, &Layout),
    (b, lb): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::WrapErr;
    let dev = w.device().clone();
    let stream = dev.cuda_stream();
    let name = format!("lora_merge_{}", dtype_name(OP, w.dtype())?);
    let func = dev.get_or_load_custom_func(&name, "wick_ops_lora", crate::cuda::ptx::LORA)?;
    let mut merged = alloc(&dev, w.dtype(), d.n * d.k)?;
    let (pw, _gw) = in_ptr(OP, "w", w, lw, &stream)?;
    let (pa, _ga) = in_ptr(OP, "a", a, la, &stream)?;
    let (pb, _gb) = in_ptr(OP, "b", b, lb, &stream)?;
    let (pm, _gm) = out_ptr(&mut merged, &stream)?;
    let (n, k, r, scale) = (d.n as i64, d.k as i64, d.rank as i32, d.scale);
    for (i, chunk) in d.blocks.chunks(MAX_PARTS).enumerate() {
        let mut p = Parts {
            count: chunk.len() as i32,
            ..Parts::default()
        };
        for (j, bl) in chunk.iter().enumerate() {
            (p.row[j], p.rows[j], p.q[j], p.b_row[j]) =
                (bl.col as i32, bl.rows as i32, bl.q as i32, bl.b_row as i32);
        }
        let copy_rest = i32::from(i == 0);
        let mut lb = func.builder();
        lb.arg(&pw)
            .arg(&pa)
            .arg(&pb)
            .arg(&pm)
            .arg(&n)
            .arg(&k)
            .arg(&r)
            .arg(&scale)
            .arg(&p)
            .arg(&copy_rest);
        // SAFETY: W and the output hold N K elements, A R K and B N_adapted r, all of the kernel's
        // dtype; every block lies inside them (the public function checked the parts).
        unsafe { lb.launch(merge_cfg(d.n, d.k)) }.w()?;
    }
    drop((_gw, _ga, _gb, _gm));
    Ok(merged)
}

/// The forward: `(x, W, A, B)` contiguous (layouts give their offsets), all in W's dtype.
/// Returns y `(M, N)` and, when it merged the adapters into W (`M >= MERGE_MIN_ROWS K`), the
/// merged weight `(N, K)` for the backward.
pub(in crate::ops) fn forward(
    d: &Dims,
    (x, lx): (&CudaStorage, &Layout),
    (w, lw): (&CudaStorage, &Layout),
    (a, la): (&CudaStorage, &Layout),
    (b, lb): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    let dev = w.device().clone();
    let dtype = w.dtype();
    let stream = dev.cuda_stream();
    let es = dtype.size_in_bytes() as u64;
    let (px, _gx) = in_ptr(OP, "x", x, lx, &stream)?;
    let (pw, _gw) = in_ptr(OP, "w", w, lw, &stream)?;
    let (pa, _ga) = in_ptr(OP, "a", a, la, &stream)?;
    let (pb, _gb) = in_ptr(OP, "b", b, lb, &stream)?;
    let (m, n, k, r) = (d.m, d.n, d.k, d.r_sum);
    let mut y = alloc(&dev, dtype, m * n)?;
    // y (+)= x W^T for the (N, K) weight at pw
    let base = |pw: u64, py: u64, beta: f32| {
        gemm(
            &dev,
            dtype,
            (m, n, k),
            1.0,
            Op::n(px, k),
            Op::t(pw, k),
            beta,
            py,
            n,
        )
    };
    if m >= MERGE_MIN_ROWS * k {
        let mut merged = merge(d, (w, lw), (a, la), (b, lb))?;
        {
            let (pm, _gm) = out_ptr(&mut merged, &stream)?;
            let (py, _gy) = out_ptr(&mut y, &stream)?;
            base(pm, py, 0.0)?;
        }
        return Ok((y, Some(merged)));
    }
    let mut u = alloc(&dev, dtype, m * r)?;
    {
        let (pu, _gu) = out_ptr(&mut u, &stream)?;
        let (py, _gy) = out_ptr(&mut y, &stream)?;
        u_gemm(d, &dev, dtype, px, pa, pu)?;
        // When the adapted parts cover every output column, the updates are written first and
        // the base GEMM adds itself into them in its epilogue (beta = 1): the (M, N) output is
        // read once inside the base GEMM instead of read and written again by the small update
        // GEMMs. Otherwise the base goes first and the updates add into it.
        let updates_first = d.n_adapted() == n;
        if !updates_first {
            base(pw, py, 0.0)?;
        }
        for (bl, count) in d.runs() {
            // y[:, c_j] (+)= s u_j B_j^T
            let batch = Batch {
                count,
                sa: d.rank,
                sb: bl.rows * d.rank,
                sc: bl.rows,
            };
            gemm_batched(
                &dev,
                dtype,
                (m, bl.rows, d.rank),
                d.scale,
                Op::n(pu + bl.q as u64 * es, r),
                Op::t(pb + (bl.b_row * d.rank) as u64 * es, d.rank),
                if updates_first { 0.0 } else { 1.0 },
                py + bl.col as u64 * es,
                n,
                batch,
            )?;
        }
        if updates_first {
            base(pw, py, 1.0)?;
        }
    }
    Ok((y, None))
}

/// `(dx, dA, dB)` from `dy (M, N)`; dx is `None` when `want_dx` is false. `merged` is the
/// forward's merged weight (merged again here when absent). Every tensor is on CUDA in W's
/// dtype (the caller checks), x contiguous `(.., K)`.
pub(in crate::ops) fn backward(
    d: &Dims,
    x: &Tensor,
    w: &Tensor,
    a: &Tensor,
    b: &Tensor,
    dy: &Tensor,
    merged: Option<CudaStorage>,
    want_dx: bool,
) -> Result<(Option<Tensor>, Tensor, Tensor)> {
    let op = Backward {
        d: d.clone(),
        merged: Mutex::new(merged),
        x: x.contiguous()?,
        w: w.clone(),
        a: a.contiguous()?,
        b: b.contiguous()?,
        want_dx,
    };
    let flat = dy.contiguous()?.apply_op1_no_bwd(&op)?;
    let (mk, rk, br) = (d.m * d.k, d.r_sum * d.k, d.n_adapted() * d.rank);
    let dx_len = if want_dx { mk } else { 0 };
    let dx = if want_dx {
        Some(flat.narrow(0, 0, mk)?.reshape(x.shape())?)
    } else {
        None
    };
    let da = flat.narrow(0, dx_len, rk)?.reshape((d.r_sum, d.k))?;
    let db = flat
        .narrow(0, dx_len + rk, br)?
        .reshape((d.n_adapted(), d.rank))?;
    Ok((dx, da, db))
}

/// The backward as an op on dy whose output is `[dx | dA | dB]` flattened.
struct Backward {
    d: Dims,
    /// The forward's merged weight `W + s B_bd A` (merged again when absent).
    merged: Mutex<Option<CudaStorage>>,
    x: Tensor,
    w: Tensor,
    a: Tensor,
    b: Tensor,
    want_dx: bool,
}

impl CustomOp1 for Backward {
    fn name(&self) -> &'static str {
        "lora_linear_backward"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("{OP}: the fused backward is CUDA-only (internal error: the CPU takes the composed one)")
    }

    fn cuda_fwd(&self, dy: &CudaStorage, ldy: &Layout) -> Result<(CudaStorage, Shape)> {
        let d = &self.d;
        let dev = dy.device().clone();
        let dtype = dy.dtype();
        let stream = dev.cuda_stream();
        let es = dtype.size_in_bytes() as u64;
        let (m, n, k, r) = (d.m, d.n, d.k, d.r_sum);
        let held = [&self.x, &self.w, &self.a, &self.b].map(|t| t.storage_and_layout());
        let mut cuda: Vec<(&CudaStorage, &Layout)> = Vec::with_capacity(4);
        let mut ptrs = [0u64; 4];
        let mut keep = Vec::with_capacity(4);
        for (i, ((s, l), what)) in held.iter().zip(["x", "w", "a", "b"]).enumerate() {
            let Storage::Cuda(s) = &**s else {
                bail!("{OP}: {what} is not on CUDA like dy (internal error)")
            };
            let (p, g) = in_ptr(OP, what, s, l, &stream)?;
            ptrs[i] = p;
            keep.push(g);
            cuda.push((s, l));
        }
        let [px, _, pa, pb] = ptrs;
        let (pdy, _gdy) = in_ptr(OP, "dy", dy, ldy, &stream)?;
        let dx_len = if self.want_dx { m * k } else { 0 };
        let total = dx_len + r * k + d.n_adapted() * d.rank;
        let mut out = alloc(&dev, dtype, total)?;
        let mut u = alloc(&dev, dtype, m * r)?;
        let mut du = alloc(&dev, dtype, m * r)?;
        let saved = self.merged.lock().map(|mut w| w.take()).unwrap_or(None);
        let mut merged = match (saved, self.want_dx) {
            (Some(w), true) => Some(w),
            (None, true) => Some(merge(d, cuda[1], cuda[2], cuda[3])?),
            (_, false) => None,
        };
        {
            let (po, _go) = out_ptr(&mut out, &stream)?;
            let (pu, _gu) = out_ptr(&mut u, &stream)?;
            let (pdu, _gdu) = out_ptr(&mut du, &stream)?;
            let (pdx, pda, pdb) = (
                po,
                po + dx_len as u64 * es,
                po + (dx_len + r * k) as u64 * es,
            );
            if let Some(merged) = merged.as_mut() {
                // dx = dy (W + s B_bd A) = dy W + s (dy B_bd) A
                let (pm, _gm) = out_ptr(merged, &stream)?;
                gemm(
                    &dev,
                    dtype,
                    (m, k, n),
                    1.0,
                    Op::n(pdy, n),
                    Op::n(pm, k),
                    0.0,
                    pdx,
                    k,
                )?;
            }
            u_gemm(d, &dev, dtype, px, pa, pu)?;
            for (bl, count) in d.runs() {
                let (dy_i, b_i) = (
                    pdy + bl.col as u64 * es,
                    pb + (bl.b_row * d.rank) as u64 * es,
                );
                // g_j = dy_j B_j (unscaled: s goes into dA's GEMM)
                let batch = Batch {
                    count,
                    sa: bl.rows,
                    sb: bl.rows * d.rank,
                    sc: d.rank,
                };
                gemm_batched(
                    &dev,
                    dtype,
                    (m, d.rank, bl.rows),
                    1.0,
                    Op::n(dy_i, n),
                    Op::n(b_i, d.rank),
                    0.0,
                    pdu + bl.q as u64 * es,
                    r,
                    batch,
                )?;
                // dB_j = s dy_j^T u_j
                let batch = Batch {
                    count,
                    sa: bl.rows,
                    sb: d.rank,
                    sc: bl.rows * d.rank,
                };
                gemm_batched(
                    &dev,
                    dtype,
                    (bl.rows, d.rank, m),
                    d.scale,
                    Op::t(dy_i, n),
                    Op::n(pu + bl.q as u64 * es, r),
                    0.0,
                    pdb + (bl.b_row * d.rank) as u64 * es,
                    d.rank,
                    batch,
                )?;
            }
            // dA = s g^T x
            gemm(
                &dev,
                dtype,
                (r, k, m),
                d.scale,
                Op::t(pdu, r),
                Op::n(px, k),
                0.0,
                pda,
                k,
            )?;
        }
        drop((u, du, merged, keep));
        Ok((out, Shape::from(total)))
    }
}

/// True when the fused CUDA path applies: every operand on CUDA, x already in W's dtype.
pub(in crate::ops) fn applies(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cuda()
        && x.dtype() == w.dtype()
        && matches!(w.dtype(), DType::F32 | DType::BF16 | DType::F16)
}
