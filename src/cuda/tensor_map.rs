//! Tensor maps for the bulk tensor copy engine (TMA, sm_90): the descriptor that
//! `cp.async.bulk.tensor` reads to copy a box of a tensor into shared memory
//! (`cuTensorMapEncodeTiled`, CUDA driver API, "Tensor Map Object Management"). A kernel takes
//! it by value as a `const __grid_constant__` parameter (kernels/attention_sm90a.cu).

use candle_core::cuda::cudarc::driver::{sys, DeviceRepr};
use candle_core::{bail, DType, Result};

/// A `CUtensorMap` (128 opaque bytes, encoded on the host) as a kernel argument.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub struct TensorMap(sys::CUtensorMap);

// SAFETY: plain bytes with the C layout the kernel's by-value parameter has.
unsafe impl DeviceRepr for TensorMap {}

impl TensorMap {
    /// The map of a contiguous 16-bit (bf16 or f16) tensor of shape `(outer, rows, inner)`
    /// at device address `addr`, read in boxes of `box_rows x box_inner` elements of one outer
    /// index, stored in shared memory with 128-byte swizzling (chunk c of row r at chunk
    /// c ^ (r % 8): the layout wgmma's 128-byte-swizzle descriptors read). Rows past `rows` (and
    /// columns past `inner`) are outside the tensor: the copy engine writes zeros there.
    ///
    /// Errors: another dtype; `addr` or the row pitch not a multiple of 16 bytes; a box row of
    /// more than 128 bytes (the swizzle's span) or over 256 rows; the driver's refusal.
    pub fn swizzled_128b(
        addr: u64,
        dtype: DType,
        [outer, rows, inner]: [usize; 3],
        [box_rows, box_inner]: [u32; 2],
    ) -> Result<Self> {
        use sys::CUtensorMapDataType_enum as Ty;
        let ty = match dtype {
            DType::BF16 => Ty::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            DType::F16 => Ty::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            d => bail!("tensor map: dtype {d:?}; expected bf16 or f16"),
        };
        if box_inner * 2 > 128 {
            bail!(
                "tensor map: a box row of {box_inner} elements is wider than the 128-byte swizzle"
            )
        }
        let pitch = inner * 2;
        Self::encode(
            addr,
            ty,
            &[inner as u64, rows as u64, outer as u64],
            &[pitch as u64, (pitch * rows) as u64],
            &[box_inner, box_rows, 1],
            sys::CUtensorMapSwizzle_enum::CU_TENSOR_MAP_SWIZZLE_128B,
        )
    }

    /// The map of a contiguous f32 matrix `(rows, inner)` at `addr`, read in boxes of `box_inner`
    /// elements of one row, stored as they are (no swizzle). Columns past `inner` are zeros.
    ///
    /// Errors: `addr` or the row pitch (`inner * 4` bytes) not a multiple of 16; the driver's
    /// refusal.
    pub fn rows_f32(addr: u64, [rows, inner]: [usize; 2], box_inner: u32) -> Result<Self> {
        Self::encode(
            addr,
            sys::CUtensorMapDataType_enum::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
            &[inner as u64, rows as u64],
            &[(inner * 4) as u64],
            &[box_inner, 1],
            sys::CUtensorMapSwizzle_enum::CU_TENSOR_MAP_SWIZZLE_NONE,
        )
    }

    /// `cuTensorMapEncodeTiled` with `dims.len()` dimensions (innermost first), byte strides of
    /// the outer ones, one box, unit element strides, zeros outside the tensor.
    fn encode(
        addr: u64,
        ty: sys::CUtensorMapDataType,
        dims: &[u64],
        strides: &[u64],
        boxes: &[u32],
        swizzle: sys::CUtensorMapSwizzle,
    ) -> Result<Self> {
        if addr % 16 != 0 || strides.iter().any(|s| s % 16 != 0) || boxes.iter().any(|&b| b > 256) {
            bail!(
                "tensor map: address {addr:#x} and strides {strides:?} must be multiples of 16 \
                 bytes, boxes at most 256 elements a side ({boxes:?})"
            )
        }
        let steps = [1u32; 5];
        let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
        // SAFETY: dims, boxes and steps have `rank` entries and strides `rank - 1` (the
        // callers'); the map is written by the call (checked below) and only read afterwards.
        let r = unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                ty,
                dims.len() as u32,
                addr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                steps.as_ptr(),
                sys::CUtensorMapInterleave_enum::CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle,
                sys::CUtensorMapL2promotion_enum::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                sys::CUtensorMapFloatOOBfill_enum::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            bail!("tensor map: cuTensorMapEncodeTiled failed ({r:?}) for {dims:?}, box {boxes:?}")
        }
        // SAFETY: written by the successful call above.
        Ok(Self(unsafe { map.assume_init() }))
    }
}
