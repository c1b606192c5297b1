//! The CUDA path of [`super::lora_linear_grouped`]: the forward and the backward as a few
//! cuBLAS GEMMs on device addresses ([`crate::cuda::gemm`]), with no widened copies, no
//! block-diagonal up projection and no elementwise passes. With `s` the scale, part `i` of the
//! stack at output columns `c_i`, rank columns `q_i` of `u` and rows `r_i` of `b`:
//!
//! ```text
//! forward    u = x A^T                      (M, R), kept for the backward
//!            y[:, c_i] = s u[:, q_i] B_i^T  per adapted part
//!            y += x W^T                     (M, N; beta = 1: no add pass)
//! backward   du[:, q_i] = s dy[:, c_i] B_i  (M, R)
//!            dA = du^T x                    (R, K)
//!            dB_i = s dy[:, c_i]^T u[:, q_i]
//!            dx = dy W, then dx += du A     (M, K)
//! ```
//!
//! The base GEMM accumulates onto the rounded update in f32 and rounds the sum once (PEFT's
//! `lora.Linear` rounds the base output, then adds `lora_B(lora_A(x)) * scaling`); with an
//! unadapted part in the stack, the base goes first and the updates add into it. Adjacent parts of
//! the same size (`k_proj`/`v_proj`, `gate_proj`/`up_proj`) share one strided batched GEMM per
//! product. The backward's three results come back as views of one allocation.

use super::lora_linear::Block;
use crate::cuda::gemm::{gemm, gemm_batched, Batch, Operand as Op};
use crate::cuda::launch::{alloc, in_ptr, out_ptr};
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Storage,
    Tensor,
};
use std::sync::Mutex;

const OP: &str = "lora_linear";

/// Sizes of one grouped LoRA GEMM: `x (M, K)`, `W (N, K)`, `A (R, K)`, `B (N_adapted, r)`.
#[derive(Debug, Clone)]
pub(super) struct Dims {
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

/// The forward: `(x, W, A, B)` contiguous (layouts give their offsets), all in W's dtype.
/// Returns y `(M, N)` and u `(M, R)` (for the backward).
pub(super) fn forward(
    d: &Dims,
    (x, lx): (&CudaStorage, &Layout),
    (w, lw): (&CudaStorage, &Layout),
    (a, la): (&CudaStorage, &Layout),
    (b, lb): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaStorage)> {
    let dev = w.device().clone();
    let dtype = w.dtype();
    let stream = dev.cuda_stream();
    let es = dtype.size_in_bytes() as u64;
    let (px, _gx) = in_ptr(OP, "x", x, lx, &stream)?;
    let (pw, _gw) = in_ptr(OP, "w", w, lw, &stream)?;
    let (pa, _ga) = in_ptr(OP, "a", a, la, &stream)?;
    let (pb, _gb) = in_ptr(OP, "b", b, lb, &stream)?;
    let mut u = alloc(&dev, dtype, d.m * d.r_sum)?;
    let mut y = alloc(&dev, dtype, d.m * d.n)?;
    {
        let (pu, _gu) = out_ptr(&mut u, &stream)?;
        let (py, _gy) = out_ptr(&mut y, &stream)?;
        let (m, n, k, r) = (d.m, d.n, d.k, d.r_sum);
        u_gemm(d, &dev, dtype, px, pa, pu)?;
        // When the adapted parts cover every output column, the updates are written first and
        // the base GEMM adds itself into them in its epilogue (beta = 1): the (M, N) output is
        // read once inside a compute-bound GEMM instead of read and written again by the small
        // update GEMMs. Otherwise the base goes first and the updates add into it.
        let updates_first = d.n_adapted() == n;
        let base = |beta: f32| {
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
        if !updates_first {
            base(0.0)?;
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
            base(1.0)?;
        }
    }
    Ok((y, u))
}

/// `(dx, dA, dB)` from `dy (M, N)`; dx is `None` when `want_dx` is false. Every tensor is on
/// CUDA in W's dtype (the caller checks), x contiguous `(.., K)`.
pub(super) fn backward(
    d: &Dims,
    x: &Tensor,
    w: &Tensor,
    a: &Tensor,
    b: &Tensor,
    dy: &Tensor,
    u: Option<CudaStorage>,
    want_dx: bool,
) -> Result<(Option<Tensor>, Tensor, Tensor)> {
    let op = Backward {
        d: d.clone(),
        u: Mutex::new(u),
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
    /// The forward's `u = x A^T` (recomputed when absent).
    u: Mutex<Option<CudaStorage>>,
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
        let mut ptrs = [0u64; 4];
        let mut keep = Vec::with_capacity(4);
        for (i, ((s, l), what)) in held.iter().zip(["x", "w", "a", "b"]).enumerate() {
            let Storage::Cuda(s) = &**s else {
                bail!("{OP}: {what} is not on CUDA like dy (internal error)")
            };
            let (p, g) = in_ptr(OP, what, s, l, &stream)?;
            ptrs[i] = p;
            keep.push(g);
        }
        let [px, pw, pa, pb] = ptrs;
        let (pdy, _gdy) = in_ptr(OP, "dy", dy, ldy, &stream)?;
        let dx_len = if self.want_dx { m * k } else { 0 };
        let total = dx_len + r * k + d.n_adapted() * d.rank;
        let mut out = alloc(&dev, dtype, total)?;
        let saved = self.u.lock().map(|mut u| u.take()).unwrap_or(None);
        let mut u = match saved {
            Some(u) => u,
            None => {
                let mut u = alloc(&dev, dtype, m * r)?;
                let (pu, _gu) = out_ptr(&mut u, &stream)?;
                u_gemm(d, &dev, dtype, px, pa, pu)?;
                drop(_gu);
                u
            }
        };
        let mut du = alloc(&dev, dtype, m * r)?;
        {
            let (po, _go) = out_ptr(&mut out, &stream)?;
            let (pu, _gu) = out_ptr(&mut u, &stream)?;
            let (pdu, _gdu) = out_ptr(&mut du, &stream)?;
            let (pdx, pda, pdb) = (
                po,
                po + dx_len as u64 * es,
                po + (dx_len + r * k) as u64 * es,
            );
            for (bl, count) in d.runs() {
                let (dy_i, b_i) = (
                    pdy + bl.col as u64 * es,
                    pb + (bl.b_row * d.rank) as u64 * es,
                );
                // du_j = s dy_j B_j
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
                    d.scale,
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
            // dA = du^T x
            gemm(
                &dev,
                dtype,
                (r, k, m),
                1.0,
                Op::t(pdu, r),
                Op::n(px, k),
                0.0,
                pda,
                k,
            )?;
            if self.want_dx {
                gemm(
                    &dev,
                    dtype,
                    (m, k, n),
                    1.0,
                    Op::n(pdy, n),
                    Op::n(pw, k),
                    0.0,
                    pdx,
                    k,
                )?;
                gemm(
                    &dev,
                    dtype,
                    (m, k, r),
                    1.0,
                    Op::n(pdu, r),
                    Op::n(pa, k),
                    1.0,
                    pdx,
                    k,
                )?;
            }
        }
        drop((u, du, keep));
        Ok((out, Shape::from(total)))
    }
}

/// True when the fused CUDA path applies: every operand on CUDA, x already in W's dtype.
pub(super) fn applies(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cuda()
        && x.dtype() == w.dtype()
        && matches!(w.dtype(), DType::F32 | DType::BF16 | DType::F16)
}
