//! Tensors as the wick kernels take them: device addresses, the multi-tensor launch shape,
//! and the operands of the fused optimizer updates.

use anyhow::{bail, Result};
use candle_core::cuda::cudarc::driver::{DevicePtr, LaunchConfig};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Storage, Tensor};

/// The CUDA device of `t`, or an error naming what was found.
pub fn cuda_device(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        other => bail!("expected a CUDA tensor, found one on {other:?}"),
    }
}

/// Device address of the first element of a contiguous CUDA tensor (f32, bf16, f16, u32, f64,
/// i64).
///
/// The address stays valid while `t` (or a clone sharing its storage) is alive; candle never
/// moves a storage. Every launch goes to candle's single stream, so ordering with candle's
/// own kernels is the stream order. Errors for non-CUDA or non-contiguous tensors.
pub fn addr(t: &Tensor) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(c) = &*storage else {
        bail!("expected a CUDA tensor, found one on {:?}", t.device())
    };
    if !layout.is_contiguous() {
        bail!(
            "kernel input of shape {:?} is not contiguous; call .contiguous() first",
            t.dims()
        );
    }
    let stream = c.device.cuda_stream();
    let (base, elem) = match t.dtype() {
        DType::F32 => (c.as_cuda_slice::<f32>()?.device_ptr(&stream).0, 4),
        DType::BF16 => (c.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0, 2),
        DType::F16 => (c.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0, 2),
        DType::U32 => (c.as_cuda_slice::<u32>()?.device_ptr(&stream).0, 4),
        DType::F64 => (c.as_cuda_slice::<f64>()?.device_ptr(&stream).0, 8),
        DType::I64 => (c.as_cuda_slice::<i64>()?.device_ptr(&stream).0, 8),
        d => bail!("unsupported dtype {d:?} for a wick kernel"),
    };
    Ok(base + (layout.start_offset() * elem) as u64)
}

// SAFETY: plain-old-data with the C layout of the kernels' by-value `TensorListMeta`.
unsafe impl<const D: usize> candle_core::cuda::cudarc::driver::DeviceRepr
    for super::multi_tensor::Meta<D>
{
}

/// Launch configuration of a multi-tensor launch: `split` blocks of `MT_BLOCK` threads per
/// chunk (the kernel's `mt_span(meta, split)`; 1 for the kernels without a `split` argument).
pub fn mt_config<const D: usize>(l: &super::multi_tensor::Launch<D>, split: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (l.blocks * split, 1, 1),
        block_dim: (super::multi_tensor::BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The master, gradient and working copy of one parameter as the fused update kernels take
/// them: kernel-name suffixes `(grad, working)` and device addresses.
pub struct UpdateOperands {
    /// Suffix of the gradient dtype the kernel reads (`f32`, `bf16`, `f16`).
    pub grad_suffix: &'static str,
    /// Suffix of the working-copy dtype (`f32` when there is none).
    pub working_suffix: &'static str,
    /// Address of the fp32 master.
    pub master: u64,
    /// Address of the gradient as the kernel reads it.
    pub grad: u64,
    /// Address of the working copy, 0 when the parameter has none.
    pub working: u64,
}

/// Checks one parameter for a fused update (`who` names the optimizer in errors) and returns
/// its operands. Kernels exist for f32 gradients with any working copy and for half gradients
/// of the working copy's dtype; other gradients, and non-contiguous ones, are converted, and the
/// converted tensor is pushed to `keep`, which must live until the launches are queued.
pub fn update_operands(
    who: &str,
    param: &crate::params::Param,
    grad: &Tensor,
    keep: &mut Vec<Tensor>,
) -> Result<UpdateOperands> {
    if param.master.dtype() != DType::F32 {
        bail!("fused {who}: master of {} must be f32", param.name);
    }
    if grad.elem_count() != param.elem_count() {
        bail!(
            "fused {who}: gradient of {} has {} elements, expected {}",
            param.name,
            grad.elem_count(),
            param.elem_count()
        );
    }
    let w = param.working.as_ref().map(|w| w.as_tensor());
    let working_suffix = super::launch::dtype_name(who, w.map_or(DType::F32, |w| w.dtype()))?;
    let gs = super::launch::dtype_name(who, grad.dtype())?;
    let (grad_suffix, g) = if gs != "f32" && gs != working_suffix {
        ("f32", grad.to_dtype(DType::F32)?)
    } else if grad.is_contiguous() {
        (gs, grad.clone())
    } else {
        (gs, grad.contiguous()?)
    };
    let ops = UpdateOperands {
        grad_suffix,
        working_suffix,
        master: addr(param.master.as_tensor())?,
        grad: addr(&g)?,
        working: w.map(addr).transpose()?.unwrap_or(0),
    };
    keep.push(g);
    Ok(ops)
}

/// Rows of a fused update, grouped by (gradient dtype, working-copy dtype) suffixes: the key of
/// the kernel instantiation each group needs.
pub type UpdateGroups<const D: usize> =
    std::collections::BTreeMap<(&'static str, &'static str), Vec<super::multi_tensor::Row<D>>>;
