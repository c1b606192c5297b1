//! Rotary position embeddings (RoPE; Su et al. 2021, "RoFormer: Enhanced Transformer with
//! Rotary Position Embedding", arXiv:2104.09864) applied in place of a separate q/k split, on
//! the fused projection of a Llama-family decoder:
//!
//! ```text
//! qkv: (B, T, (H + 2 Hkv) D) = [q heads (H D) | k heads (Hkv D) | v heads (Hkv D)]
//! inv_freq[i] = base^(-2i / D),  angle[t, i] = pos(t) * inv_freq[i],  i < D/2
//! for each q and k head, with x1 = x[i], x2 = x[i + D/2]:
//!   y[i]       = x1 cos[t, i] - x2 sin[t, i]
//!   y[i + D/2] = x2 cos[t, i] + x1 sin[t, i]
//! v columns: copied
//! ```
//! This is HF transformers' `apply_rotary_pos_emb` with `rotate_half` (the halves of a head
//! are paired, not adjacent elements as in the RoFormer paper's interleaved form) and the
//! tables of its `LlamaRotaryEmbedding` (default rope type). The backward is the transposed
//! rotation, a rotation by `-angle`: `dx1 = dy1 cos + dy2 sin`, `dx2 = dy2 cos - dy1 sin`, so
//! the forward and backward are one kernel with the sign of `sin` flipped. Arithmetic is f32
//! whatever the storage dtype, rounded once to it. Kernel: `kernels/rotary.cu`.

use crate::ops::common::{check_device, check_float, cpu_slice, Elem};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};
use half::{bf16, f16};
use rayon::prelude::*;

/// The rotary tables `(cos, sin)` for positions `start..start + seq_len`, each
/// `(seq_len, head_dim / 2)` f32, contiguous, on `device`:
/// `cos[t, i] = cos((start + t) * base^(-2i / head_dim))`, likewise `sin`. The angles are
/// computed in f64 on the host and the cosines and sines rounded once to f32 (HF's
/// `LlamaRotaryEmbedding` computes the angles in f32, which differs by about one f32 ulp of
/// the angle: ~1e-4 absolute at position 8192). For decoding with a cache, `start` is the
/// number of cached positions.
///
/// Errors: `head_dim` zero or odd, `base` not finite or not positive, `start + seq_len`
/// overflowing. `seq_len == 0` gives empty `(0, head_dim / 2)` tables.
pub fn rotary_tables(
    seq_len: usize,
    head_dim: usize,
    base: f64,
    start: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    if head_dim == 0 || head_dim % 2 != 0 {
        bail!("rotary_tables: head_dim must be even and positive, found {head_dim}")
    }
    if !base.is_finite() || base <= 0.0 {
        bail!("rotary_tables: base must be finite and positive (Llama 2: 10000, SmolLM2: 100000), found {base}")
    }
    let inv_freq: Vec<f64> = (0..head_dim / 2)
        .map(|i| base.powf(-((2 * i) as f64) / head_dim as f64))
        .collect();
    rotary_tables_from_inv_freq(&inv_freq, seq_len, start, device)
}

/// The rotary tables `(cos, sin)` for positions `start..start + seq_len` and the given inverse
/// frequencies (one per rotated pair, `head_dim / 2` of them), each `(seq_len,
/// inv_freq.len())` f32, contiguous, on `device`: `cos[t, i] = cos((start + t) *
/// inv_freq[i])`, likewise `sin`, the angles in f64 and rounded once to f32. [`rotary_tables`]
/// is this with `inv_freq[i] = base^(-2i / head_dim)`; a scaled RoPE (transformers'
/// `rope_scaling`, e.g. `DecoderConfig::rope_inv_freq`) passes its rescaled frequencies.
///
/// Errors: `inv_freq` empty or holding a value that is not finite and positive,
/// `start + seq_len` overflowing.
pub fn rotary_tables_from_inv_freq(
    inv_freq: &[f64],
    seq_len: usize,
    start: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    if inv_freq.is_empty() {
        bail!("rotary_tables: no inverse frequencies (head_dim / 2 of them are needed)")
    }
    if let Some(f) = inv_freq.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
        bail!(
            "rotary_tables: inverse frequency {f} must be finite and positive (check the RoPE \
             base and scaling)"
        )
    }
    if start.checked_add(seq_len).is_none() {
        bail!("rotary_tables: positions start + seq_len = {start} + {seq_len} overflow")
    }
    let half = inv_freq.len();
    let mut cos = Vec::with_capacity(seq_len * half);
    let mut sin = Vec::with_capacity(seq_len * half);
    for t in 0..seq_len {
        let pos = (start + t) as f64;
        for f in inv_freq {
            let (s, c) = (pos * f).sin_cos();
            cos.push(c as f32);
            sin.push(s as f32);
        }
    }
    Ok((
        Tensor::from_vec(cos, (seq_len, half), device)?,
        Tensor::from_vec(sin, (seq_len, half), device)?,
    ))
}

/// Rotates the q and k heads of a fused projection `qkv: (B, T, (H + 2 Hkv) D)` (f32, bf16
/// or f16, any layout: made contiguous) by the rotary tables `cos`, `sin: (T, D/2)` f32 (from
/// [`rotary_tables`]; T is qkv's), with `H = n_head` query heads and `Hkv = n_kv_head` key and
/// value heads: columns `[q heads | k heads | v heads]`, head h of a part at columns
/// `h D..(h + 1) D` of it. For every q and k head and `i < D/2`, with `x1 = x[i]`,
/// `x2 = x[i + D/2]`: `y[i] = x1 cos[t, i] - x2 sin[t, i]`, `y[i + D/2] = x2 cos[t, i] + x1
/// sin[t, i]` (HF's `apply_rotary_pos_emb` with `rotate_half`); the v columns are copied.
/// Returns qkv's shape and dtype, computed in f32 and rounded once.
///
/// One graph node, differentiable with respect to `qkv` only (the backward is the rotation by
/// `-angle`); `cos` and `sin` are constants and get no gradient. Not twice differentiable.
///
/// Errors (no panics): qkv not rank 3 or not a float dtype, `n_head` or `n_kv_head` zero, a
/// last dimension that is not `(n_head + 2 n_kv_head) D` with D even, cos or sin not f32, not
/// of shape `(T, D/2)`, or on another device. An empty qkv is returned as is.
pub fn rotary_qkv(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    n_head: usize,
    n_kv_head: usize,
) -> Result<Tensor> {
    match operands(qkv, cos, sin, n_head, n_kv_head)? {
        Some(([x, cos, sin], rot)) => x.apply_op3(&cos, &sin, rot),
        None => Ok(qkv.clone()),
    }
}

/// [`rotary_qkv`]'s arguments checked (its errors) and laid out, `[qkv, cos, sin]`, with the
/// op; `None` for an empty qkv (returned as is).
pub(in crate::ops) fn operands(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    n_head: usize,
    n_kv_head: usize,
) -> Result<Option<([Tensor; 3], Rotary)>> {
    let op = "rotary_qkv";
    check_float(op, "qkv", qkv.dtype())?;
    let (b, t, w) = match qkv.dims() {
        &[b, t, w] => (b, t, w),
        d => bail!(
            "{op}: qkv must be (B, T, (n_head + 2 * n_kv_head) * head_dim), found shape {d:?}"
        ),
    };
    let heads = n_head + 2 * n_kv_head;
    if n_head == 0 || n_kv_head == 0 || w == 0 || w % heads != 0 || (w / heads) % 2 != 0 {
        bail!(
            "{op}: qkv's last dimension {w} must be (n_head + 2 * n_kv_head) * head_dim with \
             n_head = {n_head}, n_kv_head = {n_kv_head} (both >= 1) and head_dim even"
        )
    }
    let half = w / heads / 2;
    for (what, tab) in [("cos", cos), ("sin", sin)] {
        if tab.dtype() != DType::F32 {
            bail!(
                "{op}: {what} must be f32 (as rotary_tables makes it), found {:?}",
                tab.dtype()
            )
        }
        if tab.dims() != [t, half] {
            bail!(
                "{op}: {what} must be (T, head_dim / 2) = ({t}, {half}) for qkv {:?}, found {:?} \
                 (narrow a longer table to qkv's positions)",
                qkv.dims(),
                tab.dims()
            )
        }
        check_device(op, what, qkv, tab)?;
    }
    if b * t == 0 {
        return Ok(None);
    }
    let rot = Rotary {
        n_rot: n_head + n_kv_head,
        half,
        inverse: false,
    };
    let laid = [qkv.contiguous()?, cos.contiguous()?, sin.contiguous()?];
    Ok(Some((laid, rot)))
}

/// The rotation of the first `n_rot` heads of each row (q and k heads, `2 half` columns each)
/// by the tables; the rest of the row is copied. `inverse` rotates by `-angle` (the backward).
#[derive(Clone, Copy)]
pub(in crate::ops) struct Rotary {
    n_rot: usize,
    half: usize,
    inverse: bool,
}

impl Rotary {
    fn check(&self, lx: &Layout, lc: &Layout, ls: &Layout) -> Result<(usize, usize)> {
        let op = self.name();
        let (t, w) = match lx.dims() {
            &[_, t, w] if w >= 2 * self.half * self.n_rot => (t, w),
            d => bail!("{op}: x has shape {d:?} (internal error)"),
        };
        if lc.dims() != [t, self.half] || ls.dims() != [t, self.half] {
            bail!(
                "{op}: tables {:?} {:?} for x {:?} (internal error)",
                lc.dims(),
                ls.dims(),
                lx.dims()
            )
        }
        Ok((t, w))
    }
}

/// CPU rotation: rows of `w` elements, row r at position `r % t`.
fn rotate_cpu<T: Elem>(
    x: &[T],
    cos: &[f32],
    sin: &[f32],
    r: &Rotary,
    t: usize,
    w: usize,
) -> Vec<T> {
    let (half, sgn) = (r.half, if r.inverse { -1.0f32 } else { 1.0 });
    let rot_cols = 2 * half * r.n_rot;
    let mut out = x.to_vec();
    out.par_chunks_mut(w).enumerate().for_each(|(row, y)| {
        let ti = row % t;
        let (c, s) = (&cos[ti * half..][..half], &sin[ti * half..][..half]);
        let xr = &x[row * w..][..w];
        for h0 in (0..rot_cols).step_by(2 * half) {
            for i in 0..half {
                let (x1, x2) = (xr[h0 + i].to32(), xr[h0 + half + i].to32());
                let si = sgn * s[i];
                y[h0 + i] = T::from32(x1 * c[i] - x2 * si);
                y[h0 + half + i] = T::from32(x2 * c[i] + x1 * si);
            }
        }
    });
    out
}

impl CustomOp3 for Rotary {
    fn name(&self) -> &'static str {
        if self.inverse {
            "rotary_qkv_backward"
        } else {
            "rotary_qkv"
        }
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        c: &CpuStorage,
        lc: &Layout,
        s: &CpuStorage,
        ls: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = self.name();
        let (t, w) = self.check(lx, lc, ls)?;
        let cv = cpu_slice::<f32>(op, "cos", c, lc)?;
        let sv = cpu_slice::<f32>(op, "sin", s, ls)?;
        macro_rules! run {
            ($t:ty) => {{
                let xv = cpu_slice::<$t>(op, "x", x, lx)?;
                <$t as candle_core::WithDType>::to_cpu_storage_owned(rotate_cpu(
                    xv, cv, sv, self, t, w,
                ))
            }};
        }
        Ok((with_type!(op, x.dtype(), run), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        c: &candle_core::CudaStorage,
        lc: &Layout,
        s: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (t, w) = self.check(lx, lc, ls)?;
        let y = cuda::launch(self, (x, lx), (c, lc), (s, ls), t, w)?;
        Ok((y, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dy = if dy.dtype() == x.dtype() {
            dy.contiguous()?
        } else {
            dy.to_dtype(x.dtype())?.contiguous()?
        };
        let back = Rotary {
            n_rot: self.n_rot,
            half: self.half,
            inverse: !self.inverse,
        };
        Ok((Some(dy.apply_op3_no_bwd(cos, sin, &back)?), None, None))
    }
}

/// CUDA launcher for `kernels/rotary.cu`.
#[cfg(feature = "cuda")]
mod cuda {
    use super::Rotary;
    use crate::cuda::launch::{alloc, dtype_name, grid_stride_cfg, in_ptr, out_ptr, vec_ok, In};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::PushKernelArg;
    use candle_core::cuda::WrapErr;
    use candle_core::{bail, CudaStorage, CustomOp3, DType, Result};

    /// Runs `rotary_<dtype>[_vec](x, cos, sin, y, rows, T, n_rot, n_copy, half, sgn)`.
    pub(super) fn launch(
        r: &Rotary,
        (x, lx): In<'_>,
        (c, lc): In<'_>,
        (s, ls): In<'_>,
        t: usize,
        w: usize,
    ) -> Result<CudaStorage> {
        let op = r.name();
        if c.dtype() != DType::F32 || s.dtype() != DType::F32 {
            bail!("{op}: the tables must be f32 (internal error)")
        }
        if w > i32::MAX as usize || t.saturating_mul(r.half) > i32::MAX as usize {
            bail!("{op}: rows of {w} elements or {t} positions exceed the kernel's i32 range")
        }
        let dev = x.device();
        let n = lx.shape().elem_count();
        let rows = n / w;
        let mut y = alloc(dev, x.dtype(), n)?;
        let stream = dev.cuda_stream();
        {
            let (xp, _gx) = in_ptr(op, "x", x, lx, &stream)?;
            let (cp, _gc) = in_ptr(op, "cos", c, lc, &stream)?;
            let (sp, _gs) = in_ptr(op, "sin", s, ls, &stream)?;
            let (yp, _gy) = out_ptr(&mut y, &stream)?;
            let elem = x.dtype().size_in_bytes();
            let vec = vec_ok(r.half, elem, &[xp, cp, sp, yp]);
            let per_thread = if vec { 16 / elem } else { 1 };
            let name = format!(
                "rotary_{}{}",
                dtype_name(op, x.dtype())?,
                if vec { "_vec" } else { "" }
            );
            let func =
                dev.get_or_load_custom_func(&name, "wick_ops_rotary", crate::cuda::ptx::ROTARY)?;
            let n_copy = w - 2 * r.half * r.n_rot;
            let units = (r.n_rot * r.half + n_copy) / per_thread;
            let (rows_i, t_i, rot_i, copy_i, half_i) = (
                rows as i64,
                t as i32,
                r.n_rot as i32,
                n_copy as i32,
                r.half as i32,
            );
            let sgn: f32 = if r.inverse { -1.0 } else { 1.0 };
            let mut lb = func.builder();
            lb.arg(&xp)
                .arg(&cp)
                .arg(&sp)
                .arg(&yp)
                .arg(&rows_i)
                .arg(&t_i)
                .arg(&rot_i)
                .arg(&copy_i)
                .arg(&half_i)
                .arg(&sgn);
            // SAFETY: x and y hold rows * w elements of the kernel's dtype, cos and sin T * half
            // floats; the vector kernel is chosen only when every pointer is 16-byte aligned and
            // half splits into whole vectors.
            unsafe { lb.launch(grid_stride_cfg(rows * units)) }.w()?;
        }
        Ok(y)
    }
}
