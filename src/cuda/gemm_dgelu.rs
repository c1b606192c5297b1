//! The input gradient of `gelu(h) @ w^T` as one cuBLASLt matmul with the GELU derivative in
//! its epilogue:
//!
//! ```text
//! dh = (dy @ w) * gelu'(h)       dy: (M, K), w: (K, N), h: (M, N)
//! db = Σ_rows dh                 (N,), with `bias_grad`: the bias gradient of the layer
//!                                that produced h
//! ```
//!
//! cuBLASLt's `CUBLASLT_EPILOGUE_DGELU` ("GELU gradient. Apply GELU gradient to matmul output.
//! Store GELU gradient in the output matrix"; `CUBLASLT_EPILOGUE_DGELU_BGRAD` also "Bias
//! gradient in the auxiliary output (see CUBLASLT_MATMUL_DESC_BIAS_POINTER)", whose length is
//! the output's rows) reads the GELU input h through `CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER`,
//! "the same type as the output", with `CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD` "divisible by 8
//! and no less than the number of rows in the output matrix" (NVIDIA, cuBLAS documentation,
//! `cublasLtEpilogue_t` and `cublasLtMatmulDescAttributes_t`). The derivative multiplies the
//! GEMM's f32 accumulator, and dh is rounded once to the output dtype; the unfused form (a GEMM,
//! then `gelu.cu`'s backward kernel) rounds `dy @ w` to the dtype first, writes it, reads it
//! back with h and writes dh.
//!
//! Which GELU: NVIDIA's documentation writes `GELU(x)` without a formula. The cuBLASLt GELU
//! epilogues are the tanh approximation `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`:
//! PyTorch's `addmm` with `use_gelu` replaces the epilogue, where it cannot use it, by
//! `gelu(approximate="tanh")` (aten/src/ATen/native/cuda/Blas.cpp), and `tests/gemm_dgelu.rs`
//! checks the derivative against the tanh form's closed form on the GPU, where it tells the
//! two forms apart. So only `Activation::GeluTanh` takes this path; the exact (erf) GELU and
//! ReLU keep theirs.
//!
//! cuBLASLt is column-major: the row-major `dh (M, N) = dy (M, K) @ w (K, N)` is the
//! column-major `dh^T (N, M) = w^T (N, K) dy^T (K, M)`, where the stored w is the column-major
//! `(N, K)` with ld N (operand A, not transposed), dy the column-major `(K, M)` with ld K
//! (operand B), and h, like dh, the column-major `(N, M)` with ld N. The bias gradient runs
//! along dh^T's rows: N elements.

use candle_core::cuda::cudarc::cublaslt::{result, sys, MatmulShared};
use candle_core::cuda::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, DeviceId};
use candle_core::op::BackpropOp;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Device, Layout, Storage, Tensor};
use half::{bf16, f16};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;

type Result<T> = candle_core::Result<T>;

/// The outputs of [`dgelu_matmul`].
#[derive(Debug, Clone)]
pub struct DgeluGrads {
    /// `(dy @ w) * gelu_tanh'(h)`, h's shape and dtype.
    pub dh: Tensor,
    /// `Σ_rows dh`, `(N,)` in h's dtype, when asked for (`CUBLASLT_EPILOGUE_DGELU_BGRAD`).
    pub db: Option<Tensor>,
}

/// `dh = (dy @ w) * gelu_tanh'(h)`, and with `bias_grad` also `db = Σ_rows dh`, as one cuBLASLt
/// matmul with the `CUBLASLT_EPILOGUE_DGELU` (or `..._DGELU_BGRAD`) epilogue (module docs):
/// the input gradient of `gelu_tanh(h) @ w^T` for the upstream gradient `dy`, and the bias
/// gradient of the layer that produced h.
///
/// - `dy: (.., K)`, `h: (.., N)` with the same rows, `w: (K, N)` (the second layer's `(out,
///   in)` weight as stored); all on one CUDA device, all bf16 or all f16, contiguous.
///
/// Returns the gradients with dh in h's shape, computed in f32 (the GEMM's accumulator and the
/// epilogue's derivative) and rounded once to the dtype. `Ok(None)` where the epilogue is not
/// taken, for the caller's unfused path: another device or dtype, dtypes that differ,
/// non-contiguous operands, shapes that do not match, no rows, `K` or `N` not a multiple of 8,
/// an operand not 16-byte aligned, sizes beyond cuBLASLt's i32 range, candle's
/// reduced-precision switch on for the dtype (the unfused GEMM would then not accumulate in
/// f32), or no cuBLASLt algorithm for the problem (an older cuBLAS without the epilogue
/// included).
///
/// Errors (no panics): the allocation of the outputs or the cuBLASLt launch fails.
pub fn dgelu_matmul(
    dy: &Tensor,
    w: &Tensor,
    h: &Tensor,
    bias_grad: bool,
) -> Result<Option<DgeluGrads>> {
    let Some(p) = plan(dy, w, h) else {
        return Ok(None);
    };
    let Device::Cuda(dev) = h.device() else {
        return Ok(None);
    };
    let (sdy, ldy) = dy.storage_and_layout();
    let (sw, lw) = w.storage_and_layout();
    let (sh, lh) = h.storage_and_layout();
    let (Storage::Cuda(sdy), Storage::Cuda(sw), Storage::Cuda(sh)) = (&*sdy, &*sw, &*sh) else {
        return Ok(None);
    };
    let ops = [(sdy, ldy), (sw, lw), (sh, lh)];
    use sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_16F};
    let out = match h.dtype() {
        DType::BF16 => typed::<bf16>(dev, p, ops, CUDA_R_16BF, bias_grad)?,
        DType::F16 => typed::<f16>(dev, p, ops, CUDA_R_16F, bias_grad)?,
        _ => None,
    };
    let Some((dh, db)) = out else {
        return Ok(None);
    };
    let wrap = |s: CudaStorage, shape: &[usize]| {
        Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false)
    };
    Ok(Some(DgeluGrads {
        dh: wrap(dh, h.dims()),
        db: db.map(|db| wrap(db, &[p.n])),
    }))
}

/// The GEMM's sizes: `m` rows, `n` = h's width (the output's), `k` = dy's width.
#[derive(Debug, Clone, Copy)]
struct Plan {
    m: usize,
    n: usize,
    k: usize,
}

/// The sizes when the operands fit the epilogue (see [`dgelu_matmul`]), else `None`.
fn plan(dy: &Tensor, w: &Tensor, h: &Tensor) -> Option<Plan> {
    let dtype = h.dtype();
    let half = matches!(dtype, DType::BF16 | DType::F16);
    if !half || dy.dtype() != dtype || w.dtype() != dtype || reduced_precision(dtype) {
        return None;
    }
    let same_device = h.device().same_device(dy.device()) && h.device().same_device(w.device());
    if !h.device().is_cuda() || !same_device {
        return None;
    }
    let &[k, n] = w.dims() else { return None };
    let (dk, hn) = (*dy.dims().last()?, *h.dims().last()?);
    let m = h.elem_count().checked_div(n)?;
    let rows_match = dy.dims()[..dy.rank() - 1] == h.dims()[..h.rank() - 1];
    if dk != k || hn != n || !rows_match || m == 0 || k % 8 != 0 || n % 8 != 0 {
        return None;
    }
    let fits = |v: usize| i32::try_from(v).is_ok();
    if !(fits(m) && fits(n) && fits(k)) {
        return None;
    }
    let ready = |t: &Tensor| t.is_contiguous() && (t.layout().start_offset() * 2) % 16 == 0;
    (ready(dy) && ready(w) && ready(h)).then_some(Plan { m, n, k })
}

/// Whether candle's cuBLAS switch lets GEMMs of `dtype` accumulate below f32
/// (`PerfSettings::reduced_precision_reductions`).
fn reduced_precision(dtype: DType) -> bool {
    match dtype {
        DType::BF16 => candle_core::cuda::gemm_reduced_precision_bf16(),
        DType::F16 => candle_core::cuda::gemm_reduced_precision_f16(),
        _ => false,
    }
}

/// The matmul on `[dy, w, h]` in the element type `T` (cuBLASLt type `dt`): `(dh, db)`
/// storages, or `None` where cuBLASLt offers no algorithm.
fn typed<T>(
    dev: &CudaDevice,
    p: Plan,
    [dy, w, h]: [(&CudaStorage, &Layout); 3],
    dt: sys::cudaDataType_t,
    bias_grad: bool,
) -> Result<Option<(CudaStorage, Option<CudaStorage>)>>
where
    T: CudaDType + DeviceRepr,
{
    let stream = dev.cuda_stream();
    let (dys, ws, hs) = (
        dy.0.as_cuda_slice::<T>()?,
        w.0.as_cuda_slice::<T>()?,
        h.0.as_cuda_slice::<T>()?,
    );
    // the inputs' guards live until the work is queued
    let (dyp, _gdy) = dys.device_ptr(&stream);
    let (wp, _gw) = ws.device_ptr(&stream);
    let (hp, _gh) = hs.device_ptr(&stream);
    let a = element::<T>(wp, w.1, p.k * p.n, ws.len())?;
    let b = element::<T>(dyp, dy.1, p.m * p.k, dys.len())?;
    let aux = element::<T>(hp, h.1, p.m * p.n, hs.len())?;
    // SAFETY: the matmul writes every one of the m * n outputs (beta = 0) and, with the bias
    // gradient, every one of its n elements.
    let mut dh = unsafe { dev.alloc::<T>(p.m * p.n)? };
    let mut db = match bias_grad {
        true => Some(unsafe { dev.alloc::<T>(p.n)? }),
        false => None,
    };
    let ran = {
        let (d, _gd) = dh.device_ptr_mut(&stream);
        let bias = db.as_mut().map(|db| db.device_ptr_mut(&stream));
        let ptrs = Pointers {
            a,
            b,
            d,
            aux,
            bias: bias.as_ref().map(|(p, _)| *p),
        };
        launch(dev, p, dt, ptrs)?
    };
    if !ran {
        return Ok(None);
    }
    let wrap = |s| CudaStorage::wrap_cuda_slice(s, dev.clone());
    Ok(Some((wrap(dh), db.map(wrap))))
}

/// The address of a contiguous operand's first element (`base` is its buffer's), checked to
/// leave `len` elements inside the buffer of `buf_len`.
fn element<T>(base: u64, l: &Layout, len: usize, buf_len: usize) -> Result<u64> {
    let off = l.start_offset();
    if off + len > buf_len {
        bail!("dgelu_matmul: an operand's {len} elements from {off} exceed its buffer (internal error)")
    }
    Ok(base + (off * std::mem::size_of::<T>()) as u64)
}

/// Device addresses of the operands: A = w, B = dy, D = dh, the epilogue's aux input h and
/// the bias gradient's output.
struct Pointers {
    a: u64,
    b: u64,
    d: u64,
    aux: u64,
    bias: Option<u64>,
}

/// Sets up the descriptors, asks cuBLASLt's heuristic for an algorithm and queues the matmul
/// on the device's stream. `Ok(false)`: cuBLASLt refused the problem before any work was
/// queued (no algorithm, or an attribute it does not know).
fn launch(dev: &CudaDevice, p: Plan, dt: sys::cudaDataType_t, ptr: Pointers) -> Result<bool> {
    let (lt, ws) = handle(dev)?;
    let (m, n, k) = (p.m as u64, p.n as u64, p.k as u64);
    let setup = || -> std::result::Result<_, result::CublasError> {
        let a = MatrixLayout::new(dt, n, k, n as i64)?;
        let b = MatrixLayout::new(dt, k, m, k as i64)?;
        let d = MatrixLayout::new(dt, n, m, n as i64)?;
        let desc = Desc::new()?;
        use sys::cublasLtMatmulDescAttributes_t as A;
        let no_trans: i32 = 0; // CUBLAS_OP_N: both operands as stored
        desc.set(A::CUBLASLT_MATMUL_DESC_TRANSA, &no_trans)?;
        desc.set(A::CUBLASLT_MATMUL_DESC_TRANSB, &no_trans)?;
        let epilogue = match ptr.bias {
            Some(_) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DGELU_BGRAD,
            None => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DGELU,
        };
        desc.set(A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
        desc.set(A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &ptr.aux)?;
        desc.set(A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &(n as i64))?;
        if let Some(bias) = &ptr.bias {
            desc.set(A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias)?;
        }
        let pref = Pref::new()?;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        pref.set(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws.len())?;
        // the heuristic assumes 256-byte aligned operands unless told otherwise
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            &alignment(ptr.a),
        )?;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            &alignment(ptr.b),
        )?;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            &alignment(ptr.d),
        )?;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            &alignment(ptr.d),
        )?;
        // SAFETY: the descriptors are live; the heuristic reads the pointers' values only.
        let heuristic = unsafe {
            result::get_matmul_algo_heuristic(*lt.handle(), desc.0, a.0, b.0, d.0, d.0, pref.0)?
        };
        Ok((a, b, d, desc, heuristic))
    };
    let Ok((a, b, d, desc, heuristic)) = setup() else {
        return Ok(false);
    };
    let stream = dev.cuda_stream();
    let (wsp, _gws) = ws.device_ptr(&stream);
    let (alpha, beta) = (1f32, 0f32);
    // SAFETY: the pointers cover the operands the layouts describe (checked by the caller's
    // `slice`), the workspace is this thread's, used by one matmul at a time; everything is
    // queued on the device's stream, after the work that wrote the inputs.
    unsafe {
        result::matmul(
            *lt.handle(),
            desc.0,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            ptr.a as *const c_void,
            a.0,
            ptr.b as *const c_void,
            b.0,
            ptr.d as *const c_void,
            d.0,
            ptr.d as *mut c_void,
            d.0,
            &heuristic.algo,
            wsp as *mut c_void,
            ws.len(),
            stream.cu_stream() as *mut _,
        )
    }
    .map_err(|e| {
        candle_core::Error::Msg(format!("dgelu_matmul (cuBLASLt DGELU epilogue): {e:?}"))
    })?;
    Ok(true)
}

/// The largest power of two (at most 256) that divides the address: what cuBLASLt may assume.
fn alignment(ptr: u64) -> u32 {
    1u32 << ptr.trailing_zeros().min(8)
}

/// The calling thread's cuBLASLt handle for `dev` ([`super::gemm_bias`]'s) and this module's
/// workspace (the handle's own is private to cudarc): 32 MiB on compute capability 9 and
/// above, 4 MiB below, NVIDIA's recommendation, allocated on first use and kept.
fn handle(
    dev: &CudaDevice,
) -> Result<(
    std::sync::Arc<candle_core::cuda::cudarc::cublaslt::CudaBlasLT>,
    std::rc::Rc<CudaSlice<u8>>,
)> {
    thread_local! {
        static WORKSPACES: RefCell<HashMap<DeviceId, std::rc::Rc<CudaSlice<u8>>>> =
            RefCell::new(HashMap::new());
    }
    let lt = super::gemm_bias::handle(dev)?;
    let ws = WORKSPACES.with(|w| -> Result<_> {
        let mut map = w.borrow_mut();
        if let Some(ws) = map.get(&dev.id()) {
            return Ok(ws.clone());
        }
        use candle_core::cuda::cudarc::driver::sys::CUdevice_attribute as Attr;
        let major = dev
            .cuda_stream()
            .context()
            .attribute(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(|e| candle_core::Error::Msg(format!("cuBLASLt workspace: {e:?}")))?;
        let bytes = if major >= 9 { 32 << 20 } else { 4 << 20 };
        // SAFETY: a scratch buffer; cuBLASLt writes before it reads.
        let ws = std::rc::Rc::new(unsafe { dev.alloc::<u8>(bytes)? });
        map.insert(dev.id(), ws.clone());
        Ok(ws)
    })?;
    Ok((lt, ws))
}

/// A cuBLASLt matrix layout, destroyed on drop.
struct MatrixLayout(sys::cublasLtMatrixLayout_t);

impl MatrixLayout {
    fn new(
        dt: sys::cudaDataType_t,
        rows: u64,
        cols: u64,
        ld: i64,
    ) -> std::result::Result<Self, result::CublasError> {
        result::create_matrix_layout(dt, rows, cols, ld).map(Self)
    }
}

impl Drop for MatrixLayout {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once; a failure leaks a few bytes of host memory.
        let _ = unsafe { result::destroy_matrix_layout(self.0) };
    }
}

/// A cuBLASLt matmul descriptor (f32 compute and scale), destroyed on drop.
struct Desc(sys::cublasLtMatmulDesc_t);

impl Desc {
    fn new() -> std::result::Result<Self, result::CublasError> {
        let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        result::create_matmul_desc(compute, sys::cudaDataType_t::CUDA_R_32F).map(Self)
    }

    fn set<V>(
        &self,
        attr: sys::cublasLtMatmulDescAttributes_t,
        v: &V,
    ) -> std::result::Result<(), result::CublasError> {
        // SAFETY: the descriptor is live; `v` is the attribute's value type (cuBLASLt checks the
        // size).
        unsafe {
            result::set_matmul_desc_attribute(
                self.0,
                attr,
                v as *const V as *const c_void,
                std::mem::size_of::<V>(),
            )
        }
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once.
        let _ = unsafe { result::destroy_matmul_desc(self.0) };
    }
}

/// A cuBLASLt matmul preference, destroyed on drop.
struct Pref(sys::cublasLtMatmulPreference_t);

impl Pref {
    fn new() -> std::result::Result<Self, result::CublasError> {
        result::create_matmul_pref().map(Self)
    }

    fn set<V>(
        &self,
        attr: sys::cublasLtMatmulPreferenceAttributes_t,
        v: &V,
    ) -> std::result::Result<(), result::CublasError> {
        // SAFETY: the preference is live; `v` is the attribute's value type.
        unsafe {
            result::set_matmul_pref_attribute(
                self.0,
                attr,
                v as *const V as *const c_void,
                std::mem::size_of::<V>(),
            )
        }
    }
}

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by `new`, destroyed once.
        let _ = unsafe { result::destroy_matmul_pref(self.0) };
    }
}
