//! Splitting a fused qkv projection into attention heads and merging heads back, as single
//! differentiable row permutations:
//!
//! ```text
//! split_heads:  (B, T, 3C) → (3, B, H, T, Dh)    out[s, b, h, t, :] = qkv[b, t, s*C + h*Dh ..][..Dh]
//! merge_heads:  (B, H, T, Dh) → (B, T, H*Dh)     out[b, t, h*Dh ..][..Dh] = y[b, h, t, :]
//! ```
//! Each is one copy kernel that moves whole rows of `Dh` elements (16-byte units when the rows
//! allow); the backward is the inverse permutation, one more such kernel. candle's
//! `narrow → reshape → transpose → contiguous` does the same with strided per-element copies,
//! and its backward pads every narrowed part with zeros: 1.7 ms forward + backward per block
//! for gptmini's 64x256x1152 bf16 projection on an H200 (these ops: see `profile_gpt_ops`).
//! Kernels: `kernels/heads.cu`.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

/// Splits `qkv: (B, T, 3C)` (any dtype, any layout: made contiguous) into one tensor
/// `(3, B, H, T, C / H)`: index 0 holds the queries, 1 the keys, 2 the values, each head's
/// `(T, Dh)` block contiguous (what the attention matmuls want). `.get(i)` on the result gives
/// contiguous views. Differentiable (the backward is the inverse copy).
///
/// Errors: qkv not rank 3, last dimension not divisible by 3, `C` not divisible by `n_head`,
/// `n_head == 0`.
pub fn split_heads(qkv: &Tensor, n_head: usize) -> Result<Tensor> {
    let (b, t, c3) = match qkv.dims() {
        &[b, t, c3] => (b, t, c3),
        d => bail!("split_heads: qkv must be (B, T, 3C), found shape {d:?}"),
    };
    if n_head == 0 || c3 % 3 != 0 || (c3 / 3) % n_head != 0 {
        bail!(
            "split_heads: last dimension {c3} must be 3 * n_head * head_dim with n_head = {n_head}"
        )
    }
    let h = n_head;
    let dh = c3 / 3 / h;
    // rows of Dh elements: input rows (B, T, 3, H), output rows (3, B, H, T)
    let fwd = Map {
        dims: [3, b, h, t],
        strides: [h, t * 3 * h, 1, 3 * h],
        row: dh,
    };
    let bwd = Map {
        dims: [b, t, 3, h],
        strides: [h * t, 1, b * h * t, t],
        row: dh,
    };
    apply(qkv, fwd, bwd, Shape::from((3, b, h, t, dh)))
}

/// Merges heads `y: (B, H, T, Dh)` into `(B, T, H * Dh)` (head `h` at columns
/// `h*Dh..(h+1)*Dh`), the layout the output projection takes. Differentiable.
///
/// Errors: y not rank 4.
pub fn merge_heads(y: &Tensor) -> Result<Tensor> {
    let (b, h, t, dh) = match y.dims() {
        &[b, h, t, dh] => (b, h, t, dh),
        d => bail!("merge_heads: y must be (B, H, T, Dh), found shape {d:?}"),
    };
    let fwd = Map {
        dims: [b, t, h, 1],
        strides: [h * t, 1, t, 0],
        row: dh,
    };
    let bwd = Map {
        dims: [b, h, t, 1],
        strides: [t * h, 1, h, 0],
        row: dh,
    };
    apply(y, fwd, bwd, Shape::from((b, t, h * dh)))
}

/// A row permutation: destination row `(a0, a1, a2, a3)` (row-major over `dims`) is source
/// row `Σ a_i * strides[i]`; rows hold `row` elements.
#[derive(Debug, Clone, Copy)]
struct Map {
    dims: [usize; 4],
    strides: [usize; 4],
    row: usize,
}

impl Map {
    fn rows(&self) -> usize {
        self.dims.iter().product()
    }

    /// Source row of each destination row, in destination order.
    fn sources(&self) -> impl Iterator<Item = usize> + '_ {
        let [d0, d1, d2, d3] = self.dims;
        let s = self.strides;
        (0..d0).flat_map(move |a0| {
            (0..d1).flat_map(move |a1| {
                (0..d2).flat_map(move |a2| {
                    (0..d3).map(move |a3| a0 * s[0] + a1 * s[1] + a2 * s[2] + a3 * s[3])
                })
            })
        })
    }
}

/// The op: `fwd` maps input to output, `bwd` maps the output's gradient back.
struct RowPermute {
    fwd: Map,
    bwd: Map,
    out: Shape,
    input: Shape,
}

fn apply(x: &Tensor, fwd: Map, bwd: Map, out: Shape) -> Result<Tensor> {
    if x.elem_count() == 0 {
        return Tensor::zeros(out, x.dtype(), x.device());
    }
    let op = RowPermute {
        fwd,
        bwd,
        out,
        input: x.shape().clone(),
    };
    x.contiguous()?.apply_op1(op)
}

fn permute_cpu<T: Copy + Default>(src: &[T], map: &Map) -> Vec<T> {
    let mut out = vec![T::default(); map.rows() * map.row];
    for (dst, s) in out.chunks_mut(map.row).zip(map.sources()) {
        dst.copy_from_slice(&src[s * map.row..(s + 1) * map.row]);
    }
    out
}

impl CustomOp1 for RowPermute {
    fn name(&self) -> &'static str {
        "row_permute"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some((o1, o2)) = l.contiguous_offsets() else {
            bail!("row_permute: input must be contiguous (internal error)")
        };
        macro_rules! run {
            ($v:expr, $w:ident) => {
                CpuStorage::$w(permute_cpu(&$v[o1..o2], &self.fwd))
            };
        }
        let out = match s {
            CpuStorage::F32(v) => run!(v, F32),
            CpuStorage::BF16(v) => run!(v, BF16),
            CpuStorage::F16(v) => run!(v, F16),
            CpuStorage::F64(v) => run!(v, F64),
            CpuStorage::U32(v) => run!(v, U32),
            CpuStorage::U8(v) => run!(v, U8),
            CpuStorage::I64(v) => run!(v, I64),
            _ => bail!("row_permute: dtype {:?} is not supported", s.dtype()),
        };
        Ok((out, self.out.clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((cuda::permute(s, l, &self.fwd)?, self.out.clone()))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let back = RowPermute {
            fwd: self.bwd,
            bwd: self.fwd,
            out: self.input.clone(),
            input: self.out.clone(),
        };
        Ok(Some(dy.contiguous()?.apply_op1_no_bwd(&back)?))
    }
}

/// CUDA launcher for `kernels/heads.cu`.
#[cfg(feature = "cuda")]
mod cuda {
    use super::Map;
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{DevicePtr, DevicePtrMut, PushKernelArg};
    use candle_core::cuda::WrapErr;
    use candle_core::{bail, CudaStorage, DType, Layout, Result};

    const MODULE: &str = "wick_ops_heads";

    pub(super) fn permute(s: &CudaStorage, l: &Layout, map: &Map) -> Result<CudaStorage> {
        let Some((o1, _)) = l.contiguous_offsets() else {
            bail!("row_permute: input must be contiguous (internal error)")
        };
        let dev = &s.device;
        let dtype = s.dtype();
        let elem = dtype.size_in_bytes();
        let n = map.rows() * map.row;
        let stream = dev.cuda_stream();
        macro_rules! go {
            ($t:ty) => {{
                let src = s.as_cuda_slice::<$t>()?;
                // SAFETY: every element is written by the kernel below.
                let mut dst = unsafe { dev.alloc::<$t>(n.max(1))? };
                {
                    let (sp, _gs) = src.device_ptr(&stream);
                    let sp = sp + (o1 * elem) as u64;
                    let (dp, _gd) = dst.device_ptr_mut(&stream);
                    launch(dev, sp, dp, map, elem)?;
                }
                CudaStorage::wrap_cuda_slice(dst, dev.clone())
            }};
        }
        Ok(match dtype {
            DType::F32 => go!(f32),
            DType::BF16 => go!(half::bf16),
            DType::F16 => go!(half::f16),
            DType::U32 => go!(u32),
            d => bail!("row_permute: no CUDA kernel for dtype {d:?}"),
        })
    }

    fn launch(
        dev: &candle_core::CudaDevice,
        src: u64,
        dst: u64,
        map: &Map,
        elem: usize,
    ) -> Result<()> {
        let row_bytes = map.row * elem;
        let unit = [16usize, 4, 2]
            .into_iter()
            .find(|u| row_bytes % u == 0 && src % *u as u64 == 0 && dst % *u as u64 == 0)
            .ok_or_else(|| candle_core::Error::Msg("row_permute: odd row size".into()))?;
        let upr = (row_bytes / unit) as i32;
        let total = (map.rows() * row_bytes / unit) as i64;
        if total == 0 {
            return Ok(());
        }
        let name = format!("permute_rows_u{unit}");
        let func = dev.get_or_load_custom_func(&name, MODULE, crate::cuda::ptx::HEADS)?;
        let [_, d1, d2, d3] = map.dims.map(|d| d as i32);
        let [s0, s1, s2, s3] = map.strides.map(|s| s as i64);
        let cfg = crate::cuda::launch::grid_stride_cfg(total as usize);
        let mut lb = func.builder();
        lb.arg(&src)
            .arg(&dst)
            .arg(&total)
            .arg(&upr)
            .arg(&d1)
            .arg(&d2)
            .arg(&d3)
            .arg(&s0)
            .arg(&s1)
            .arg(&s2)
            .arg(&s3);
        // SAFETY: src holds the input's rows, dst `total` units; the map stays in bounds.
        unsafe { lb.launch(cfg) }.w()?;
        Ok(())
    }
}
