//! The CUDA path of [`super::lora_linear_grouped`]: the forward and the backward as a few
//! cuBLAS GEMMs on device addresses ([`crate::cuda::gemm`]), with no widened copies, no
//! block-diagonal up projection and no elementwise passes. With `s` the scale, part `i` of the
//! stack at output columns `c_i`, rank columns `q_i` of `u` and rows `r_i` of `b`:
//!
//! ```text
//! forward    u = x A^T                      (M, R)
//!            y = x W^T                      (M, N)
//!            y[:, c_i] += s u[:, q_i] B_i^T per adapted part (beta = 1: no add pass)
//! backward   du[:, q_i] = s dy[:, c_i] B_i  (M, R)
//!            dA = du^T x                    (R, K)
//!            dB_i = dy[:, c_i]^T (s u[:, q_i])
//!            dx = dy W, then dx += du A     (M, K)
//! ```
//!
//! The forward adds the update to the rounded base output, as PEFT's `lora.Linear` does
//! (`result = base_layer(x)`, then `result + lora_B(lora_A(x)) * scaling`); the backward's
//! three results come back as views of one allocation.

use super::lora_linear::Block;
use crate::cuda::gemm::{gemm, Operand as Op};
use crate::cuda::launch::{alloc, in_ptr, out_ptr};
use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor,
};

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
}

/// The forward: `(x, W, A, B)` contiguous (layouts give their offsets), all in W's dtype.
pub(super) fn forward(
    d: &Dims,
    (x, lx): (&CudaStorage, &Layout),
    (w, lw): (&CudaStorage, &Layout),
    (a, la): (&CudaStorage, &Layout),
    (b, lb): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
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
        gemm(&dev, dtype, (m, r, k), 1.0, Op::n(px, k), Op::t(pa, k), 0.0, pu, r)?;
        gemm(&dev, dtype, (m, n, k), 1.0, Op::n(px, k), Op::t(pw, k), 0.0, py, n)?;
        for bl in &d.blocks {
            gemm(
                &dev,
                dtype,
                (m, bl.rows, d.rank),
                d.scale,
                Op::n(pu + bl.q as u64 * es, r),
                Op::t(pb + (bl.b_row * d.rank) as u64 * es, d.rank),
                1.0,
                py + bl.col as u64 * es,
                n,
            )?;
        }
    }
    drop(u);
    Ok(y)
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
    want_dx: bool,
) -> Result<(Option<Tensor>, Tensor, Tensor)> {
    let op = Backward {
        d: d.clone(),
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
    let db = flat.narrow(0, dx_len + rk, br)?.reshape((d.n_adapted(), d.rank))?;
    Ok((dx, da, db))
}

/// The backward as an op on dy whose output is `[dx | dA | dB]` flattened.
struct Backward {
    d: Dims,
    x: Tensor,
    w: Tensor,
    a: Tensor,
    b: Tensor,
    want_dx: bool,
}

fn cuda_of<'a>(
    t: &'a Tensor,
    what: &str,
) -> Result<std::sync::RwLockReadGuard<'a, Storage>> {
    let s = t.storage_and_layout().0;
    if !matches!(&*s, Storage::Cuda(_)) {
        bail!("{OP}: {what} is not on CUDA like dy (internal error)")
    }
    Ok(s)
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
        let guards = [
            (cuda_of(&self.x, "x")?, self.x.layout().clone(), "x"),
            (cuda_of(&self.w, "w")?, self.w.layout().clone(), "w"),
            (cuda_of(&self.a, "a")?, self.a.layout().clone(), "a"),
            (cuda_of(&self.b, "b")?, self.b.layout().clone(), "b"),
        ];
        let mut ptrs = [0u64; 4];
        let mut keep = Vec::with_capacity(4);
        for (i, (s, l, what)) in guards.iter().enumerate() {
            let Storage::Cuda(s) = &**s else {
                bail!("{OP}: {what} is not on CUDA (internal error)")
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
        let mut us = alloc(&dev, dtype, m * r)?;
        let mut du = alloc(&dev, dtype, m * r)?;
        {
            let (po, _go) = out_ptr(&mut out, &stream)?;
            let (pus, _gus) = out_ptr(&mut us, &stream)?;
            let (pdu, _gdu) = out_ptr(&mut du, &stream)?;
            let (pdx, pda, pdb) = (po, po + dx_len as u64 * es, po + (dx_len + r * k) as u64 * es);
            // s u = s x A^T, recomputed (M x R: cheaper than keeping it)
            gemm(&dev, dtype, (m, r, k), d.scale, Op::n(px, k), Op::t(pa, k), 0.0, pus, r)?;
            for bl in &d.blocks {
                let (dy_i, b_i) = (pdy + bl.col as u64 * es, pb + (bl.b_row * d.rank) as u64 * es);
                // du_i = s dy_i B_i
                gemm(
                    &dev,
                    dtype,
                    (m, d.rank, bl.rows),
                    d.scale,
                    Op::n(dy_i, n),
                    Op::n(b_i, d.rank),
                    0.0,
                    pdu + bl.q as u64 * es,
                    r,
                )?;
                // dB_i = dy_i^T (s u_i)
                gemm(
                    &dev,
                    dtype,
                    (bl.rows, d.rank, m),
                    1.0,
                    Op::t(dy_i, n),
                    Op::n(pus + bl.q as u64 * es, r),
                    0.0,
                    pdb + (bl.b_row * d.rank) as u64 * es,
                    d.rank,
                )?;
            }
            // dA = du^T x
            gemm(&dev, dtype, (r, k, m), 1.0, Op::t(pdu, r), Op::n(px, k), 0.0, pda, k)?;
            if self.want_dx {
                gemm(&dev, dtype, (m, k, n), 1.0, Op::n(pdy, n), Op::n(pw, k), 0.0, pdx, k)?;
                gemm(&dev, dtype, (m, k, r), 1.0, Op::n(pdu, r), Op::n(pa, k), 1.0, pdx, k)?;
            }
        }
        drop((us, du, keep));
        Ok((out, Shape::from(total)))
    }
}

/// True when the fused CUDA path applies: every operand on CUDA, x already in W's dtype.
pub(super) fn applies(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cuda() && x.dtype() == w.dtype() && matches!(w.dtype(), DType::F32 | DType::BF16 | DType::F16)
}
