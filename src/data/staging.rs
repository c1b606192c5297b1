//! Pinned host staging and asynchronous host-to-device copies for the [`DataLoader`]
//! (feature `cuda`).
//!
//! The path of one batch, whose tensors are packed into one byte buffer (each tensor at a
//! 256-byte aligned offset):
//!
//! ```text
//! worker thread                                   training thread (DataLoader::next_batch)
//! ─────────────                                   ─────────────────────────────────────────
//! wait slot.copied (host)  // pinned reusable
//! collated CPU tensors ──memcpy──▶ pinned buffer
//! copy stream: wait slot.released  // staging reusable
//! copy stream: HtoD async pinned ──▶ staging
//! copy stream: record slot.copied    ───────────▶ compute stream: wait slot.copied  (GPU-side)
//!                                                 compute stream: alloc each tensor, DtoD
//!                                                 staging ──▶ tensor; record slot.released
//! ```
//!
//! The copy stream is a non-blocking stream of the device's context that this module creates
//! and destroys itself, with ordering by explicit events. It is deliberately not made with
//! `CudaContext::new_stream`, which would switch the whole context into cudarc's multi-stream
//! mode (an event record per kernel argument on every later launch, for every kernel of the
//! engine). The tensors handed to candle are allocated on candle's own stream (the per-thread
//! default stream of the calling thread, for a device made by `Device::new_cuda`), so their
//! lifetime is ordered with the kernels that use them exactly like any candle tensor: the one
//! device-to-device copy per tensor is the price of that, at device bandwidth.
//!
//! Slots (one pinned buffer + one device staging buffer + two events) are pooled; a slot is
//! taken by a worker and returned when its batch is handed over (or discarded), and grows to
//! the largest batch seen. At most about `prefetch_factor * num_workers + 1` slots exist.
//!
//! [`DataLoader`]: super::DataLoader

use std::sync::{Arc, Mutex, PoisonError};

use anyhow::{anyhow, bail, ensure, Context, Result};
use candle_core::cuda::cudarc::driver::{
    result, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PinnedHostSlice,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, DType, Device, Shape, Storage, Tensor};

/// Alignment of each tensor inside a staged buffer (bytes).
const ALIGN: usize = 256;

/// One staging slot: host and device buffers of `capacity` bytes and the two events that
/// order their reuse.
struct Slot {
    pinned: Option<PinnedHostSlice<u8>>,
    staging: Option<CudaSlice<u8>>,
    capacity: usize,
    /// Recorded on the copy stream after the host-to-device copy out of `pinned`.
    copied: CudaEvent,
    /// Recorded on the compute stream after the device-to-device copies out of `staging`.
    released: CudaEvent,
}

/// The loader's copy stream and slot pool for one CUDA device.
pub(crate) struct Stager {
    device: CudaDevice,
    ctx: Arc<CudaContext>,
    /// Created in [`Stager::new`], destroyed in `Drop` (wrapped as borrowed so that cudarc
    /// neither destroys it nor counts it as a context stream).
    copy: Arc<CudaStream>,
    free: Mutex<Vec<Slot>>,
}

/// Where one tensor lies in a staged buffer.
struct Part {
    dtype: DType,
    shape: Shape,
    offset: usize,
    bytes: usize,
}

/// A batch whose host-to-device copy has been issued; [`Staged::handover`] turns it into
/// candle tensors. Dropping it returns its slot to the pool.
pub(crate) struct Staged {
    stager: Arc<Stager>,
    slot: Option<Slot>,
    parts: Vec<Part>,
}

impl Stager {
    /// A copy stream and an empty slot pool on `device`'s context.
    pub(crate) fn new(device: &CudaDevice) -> Result<Arc<Self>> {
        let ctx = device.cuda_stream().context().clone();
        ctx.bind_to_thread()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .context("creating the data loader's CUDA copy stream")?;
        // SAFETY: `raw` is a stream of `ctx`, alive until `Drop` destroys it after every
        // allocation made on it has been freed and the stream synchronised.
        let copy = unsafe { ctx.wrap_borrowed_stream(raw) };
        Ok(Arc::new(Self {
            device: device.clone(),
            ctx,
            copy,
            free: Mutex::new(Vec::new()),
        }))
    }

    fn take_slot(&self) -> Result<Slot> {
        if let Some(slot) = self
            .free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
        {
            return Ok(slot);
        }
        Ok(Slot {
            pinned: None,
            staging: None,
            capacity: 0,
            copied: self.ctx.new_event(None)?,
            released: self.ctx.new_event(None)?,
        })
    }

    /// Pack `tensors` into a slot's pinned buffer and start the asynchronous copy to the
    /// device on the copy stream. Runs on a worker thread (or the caller's, without workers).
    ///
    /// # Errors
    /// A dtype that candle's CUDA storage cannot hold, a CUDA allocation or copy failure.
    pub(crate) fn stage(self: &Arc<Self>, tensors: Vec<Tensor>) -> Result<Staged> {
        self.ctx.bind_to_thread()?;
        let hosts = tensors
            .iter()
            .map(|t| {
                let t = if t.device().is_cpu() {
                    t.clone()
                } else {
                    t.to_device(&Device::Cpu)?
                };
                Ok(t.contiguous()?)
            })
            .collect::<Result<Vec<Tensor>>>()?;
        let mut parts = Vec::with_capacity(hosts.len());
        let mut total = 0usize;
        for t in &hosts {
            check_dtype(t.dtype())?;
            let bytes = t.elem_count() * t.dtype().size_in_bytes();
            parts.push(Part {
                dtype: t.dtype(),
                shape: t.shape().clone(),
                offset: total,
                bytes,
            });
            total = (total + bytes).div_ceil(ALIGN) * ALIGN;
        }

        let mut slot = self.take_slot()?;
        // The previous copy out of this pinned buffer must be done before it is rewritten, and
        // the previous reads of its staging buffer before the copy stream rewrites or frees it.
        slot.copied.synchronize()?;
        self.copy.wait(&slot.released)?;
        if slot.capacity < total {
            slot.staging = None; // freed on the copy stream, after the wait above
            slot.pinned = None;
            let cap = total.next_power_of_two();
            // SAFETY: both buffers are fully written (up to `total`) before anything reads them.
            slot.pinned = Some(unsafe { self.ctx.alloc_pinned::<u8>(cap) }?);
            slot.staging = Some(unsafe { self.copy.alloc::<u8>(cap) }?);
            slot.capacity = cap;
        }
        if total > 0 {
            let (Some(pinned), Some(staging)) = (slot.pinned.as_mut(), slot.staging.as_mut())
            else {
                bail!("internal error: staging slot without buffers");
            };
            let host = pinned.as_mut_slice()?;
            for (t, p) in hosts.iter().zip(&parts) {
                copy_host_bytes(t, &mut host[p.offset..p.offset + p.bytes])?;
            }
            let (dst, _record) = staging.device_ptr_mut(&self.copy);
            // SAFETY: `dst` holds `capacity >= total` bytes; `host[..total]` is pinned memory
            // that stays untouched until `copied` (recorded below) has completed.
            unsafe { result::memcpy_htod_async(dst, &host[..total], self.copy.cu_stream()) }
                .context("host-to-device copy of a batch")?;
        }
        slot.copied.record(&self.copy)?;
        Ok(Staged {
            stager: self.clone(),
            slot: Some(slot),
            parts,
        })
    }
}

impl Staged {
    /// The device the batch is going to.
    pub(crate) fn device(&self) -> Device {
        Device::Cuda(self.stager.device.clone())
    }

    /// The batch as candle tensors on the device, ordered after the copy by an event (no host
    /// synchronisation). Runs on the training thread: the tensors are allocated on candle's
    /// stream as seen from the calling thread.
    pub(crate) fn handover(mut self) -> Result<Vec<Tensor>> {
        let stager = self.stager.clone();
        stager.ctx.bind_to_thread()?;
        let slot = self
            .slot
            .as_ref()
            .ok_or_else(|| anyhow!("internal error: staged batch without a slot"))?;
        let compute = stager.device.cuda_stream();
        compute.wait(&slot.copied)?;
        let base = match slot.staging.as_ref() {
            Some(s) => s.device_ptr(&compute).0,
            None => 0,
        };
        let mut out = Vec::with_capacity(self.parts.len());
        for p in &self.parts {
            let src = base + p.offset as u64;
            let storage = match p.dtype {
                DType::U8 => stager.copy_out::<u8>(p, src, &compute)?,
                DType::U32 => stager.copy_out::<u32>(p, src, &compute)?,
                DType::I16 => stager.copy_out::<i16>(p, src, &compute)?,
                DType::I32 => stager.copy_out::<i32>(p, src, &compute)?,
                DType::I64 => stager.copy_out::<i64>(p, src, &compute)?,
                DType::F16 => stager.copy_out::<half::f16>(p, src, &compute)?,
                DType::BF16 => stager.copy_out::<half::bf16>(p, src, &compute)?,
                DType::F32 => stager.copy_out::<f32>(p, src, &compute)?,
                DType::F64 => stager.copy_out::<f64>(p, src, &compute)?,
                d => bail!("dtype {d:?} cannot be staged to CUDA"),
            };
            out.push(Tensor::from_storage(
                Storage::Cuda(storage),
                p.shape.clone(),
                BackpropOp::none(),
                false,
            ));
        }
        slot.released.record(&compute)?;
        self.slot_back();
        Ok(out)
    }

    fn slot_back(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.stager
                .free
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(slot);
        }
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        self.slot_back();
    }
}

impl Stager {
    /// A new device tensor's storage, filled from `src` (a device address in a staging buffer)
    /// by a device-to-device copy on `compute`.
    fn copy_out<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
        &self,
        p: &Part,
        src: u64,
        compute: &Arc<CudaStream>,
    ) -> Result<CudaStorage> {
        let n = p.shape.elem_count();
        ensure!(
            n * std::mem::size_of::<T>() == p.bytes,
            "internal error: staged part of {} bytes for {n} elements of {:?}",
            p.bytes,
            p.dtype
        );
        // SAFETY: fully written by the copy below before any kernel reads it.
        let mut dst = unsafe { self.device.alloc::<T>(n) }?;
        if p.bytes > 0 {
            let (d, _record) = dst.device_ptr_mut(compute);
            // SAFETY: `src..src + bytes` lies in the slot's staging buffer (written by the copy
            // that `compute` waited for); `d` holds `bytes` bytes; both on this context.
            unsafe { result::memcpy_dtod_async(d, src, p.bytes, compute.cu_stream()) }
                .context("device-to-device copy of a staged batch")?;
        }
        Ok(CudaStorage::wrap_cuda_slice(dst, self.device.clone()))
    }
}

impl Drop for Stager {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        let slots = std::mem::take(&mut *self.free.lock().unwrap_or_else(PoisonError::into_inner));
        // Everything that may still read a staging buffer or a pinned buffer must be done
        // before they are freed and the stream destroyed.
        for s in &slots {
            let _ = self.copy.wait(&s.released);
        }
        let _ = self.copy.synchronize();
        drop(slots);
        let _ = self.copy.synchronize();
        // SAFETY: created in `new`, no allocation on it is left, and it is idle.
        let _ = unsafe { result::stream::destroy(self.copy.cu_stream()) };
    }
}

fn check_dtype(d: DType) -> Result<()> {
    match d {
        DType::U8
        | DType::U32
        | DType::I16
        | DType::I32
        | DType::I64
        | DType::F16
        | DType::BF16
        | DType::F32
        | DType::F64 => Ok(()),
        d => bail!(
            "the loader cannot stage a {d:?} tensor to CUDA; collate to u8, u32, i16, i32, i64, \
             f16, bf16, f32 or f64"
        ),
    }
}

/// Copy the bytes of a contiguous CPU tensor into `dst` (exactly its size).
fn copy_host_bytes(t: &Tensor, dst: &mut [u8]) -> Result<()> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!(
            "internal error: staging expects a CPU tensor, found {:?}",
            t.device()
        );
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| anyhow!("internal error: staging expects a contiguous tensor"))?;
    fn as_bytes<T>(s: &[T]) -> &[u8] {
        // SAFETY: plain numeric data; any byte pattern of it is a valid `u8` slice.
        unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
    }
    let src: &[u8] = match cpu {
        CpuStorage::U8(v) => &v[start..end],
        CpuStorage::U32(v) => as_bytes(&v[start..end]),
        CpuStorage::I16(v) => as_bytes(&v[start..end]),
        CpuStorage::I32(v) => as_bytes(&v[start..end]),
        CpuStorage::I64(v) => as_bytes(&v[start..end]),
        CpuStorage::F16(v) => as_bytes(&v[start..end]),
        CpuStorage::BF16(v) => as_bytes(&v[start..end]),
        CpuStorage::F32(v) => as_bytes(&v[start..end]),
        CpuStorage::F64(v) => as_bytes(&v[start..end]),
        _ => bail!("the loader cannot stage a {:?} tensor to CUDA", t.dtype()),
    };
    ensure!(
        src.len() == dst.len(),
        "internal error: staging {} bytes into {}",
        src.len(),
        dst.len()
    );
    dst.copy_from_slice(src);
    Ok(())
}
