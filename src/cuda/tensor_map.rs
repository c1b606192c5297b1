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
        let pitch = inner * 2;
        if addr % 16 != 0 || pitch % 16 != 0 || box_inner * 2 > 128 || box_rows > 256 {
            bail!(
                "tensor map: address {addr:#x} and row pitch {pitch} B must be multiples of 16, \
                 boxes at most 128 B x 256 rows (asked {box_inner} x {box_rows})"
            )
        }
        let dims = [inner as u64, rows as u64, outer as u64];
        let strides = [pitch as u64, (pitch * rows) as u64];
        let boxes = [box_inner, box_rows, 1];
        let steps = [1u32; 3];
        let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
        // SAFETY: every pointer is to an array of the length the rank (3) asks for; the map is
        // written by the call (checked below) and only read afterwards.
        let r = unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                ty,
                3,
                addr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                steps.as_ptr(),
                sys::CUtensorMapInterleave_enum::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle_enum::CU_TENSOR_MAP_SWIZZLE_128B,
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
