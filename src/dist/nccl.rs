//! The NCCL backend of [`Collective`] (feature `nccl`): cudarc 0.19.10's `Comm` through candle's
//! re-export, one process per GPU.
//!
//! The calls are the ones that worked in the team's NCCL probe on two H200s (exact f32/bf16
//! all-reduce and broadcast of candle tensors, 324 GB/s bus bandwidth at 1 GiB):
//!
//! - rank 0: `Id::new()`; `id.internal()` is the 128-byte id, shared by [`share_id`] (TCP);
//!   the others: `Id::uninit(bytes)`.
//! - every rank: `stream = device.cuda_stream(); stream.context().bind_to_thread();
//!   Comm::from_rank(stream.fork(), rank, world, id)`: the communicator runs on a
//!   **communication stream** of its own, forked from candle's stream of the model's device.
//!   Each collective is ordered by CUDA events, without host synchronisation: the
//!   communication stream waits for the work candle's stream has queued (the inputs), and
//!   candle's stream waits for the collective before anything reads its result, at once for
//!   the blocking methods, at [`super::Pending::wait`] for
//!   [`Collective::all_reduce_sum_start`], so that a gradient bucket is reduced while the
//!   backward goes on (PyTorch's `ProcessGroupNCCL` orders its NCCL streams the same way).
//! - collectives on the tensors' `CudaSlice`s through candle's in-place custom ops
//!   (`InplaceOp1` for all-reduce / broadcast on a fresh copy; `InplaceOp2` to write
//!   reduce-scatter / all-gather results into a new tensor).
//!
//! Pitfalls handled here (from the team's CUDA notes, copied into `docs/cuda.md`):
//!
//! 1. `ncclCommInitRank` blocks forever when a peer never arrives or the id is stale: the id
//!    is handed out only once every rank has reached the rendezvous, and the init runs under a
//!    [`Watchdog`] that ends the process with a clear message after `init_timeout`.
//! 2. Dropping a `Comm` aborts it (`ncclCommAbort`) and cudarc's `Drop` panics on error:
//!    [`NcclCollective::shutdown`] synchronises and barriers before dropping, and `Drop` catches
//!    a panic from cudarc's `Drop`.
//! 3. NVLink multicast (NVLS) must stay off on the shared machines: `NCCL_NVLS_ENABLE=0`
//!    (`wick launch` sets it; [`NcclCollective::init`] sets it when unset, before NCCL reads it,
//!    and warns when it is set to anything else).
//!
//! Collectives enqueue work and return; a peer that dies mid-run makes NCCL wait forever at
//! the next synchronisation. [`Collective::barrier`] runs under a watchdog (`op_timeout`);
//! long-running jobs should rely on `wick launch`, which stops every rank when one dies.

use super::rendezvous::{share_id, DistEnv, ID_BYTES};
use super::watchdog::Watchdog;
use super::{check_flat, check_float, Collective, Pending, ReduceOp};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{CpuStorage, CudaStorage, DType, Device, InplaceOp1, InplaceOp2, Layout, Tensor};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp as NcclOp};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Timeouts of the NCCL backend.
#[derive(Debug, Clone)]
pub struct NcclOptions {
    /// Rendezvous (every rank reaches rank 0 and gets the id).
    pub rendezvous_timeout: Duration,
    /// `ncclCommInitRank` (watchdog: the process exits after it).
    pub init_timeout: Duration,
    /// A barrier (watchdog: the process exits after it).
    pub op_timeout: Duration,
}

impl Default for NcclOptions {
    fn default() -> Self {
        Self {
            rendezvous_timeout: super::rendezvous::DEFAULT_TIMEOUT,
            init_timeout: Duration::from_secs(120),
            op_timeout: Duration::from_secs(600),
        }
    }
}

/// One rank's NCCL communicator on the model's CUDA device.
pub struct NcclCollective {
    comm: Option<Comm>,
    /// candle's stream: the inputs are written and the results read there.
    stream: Arc<CudaStream>,
    /// The communicator's stream.
    comm_stream: Arc<CudaStream>,
    device: Device,
    rank: usize,
    world: usize,
    options: NcclOptions,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are not
// concurrent; `Collective` methods take `&self` but the engine owns its collective and calls it
// from one thread at a time (`Collective` is `Send`, not `Sync`). The stream is cudarc's
// `Arc<CudaStream>`, itself `Send + Sync`.
unsafe impl Send for NcclCollective {}

impl std::fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCollective")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.device)
            .finish()
    }
}

fn nccl_err(e: cudarc::nccl::result::NcclError) -> anyhow::Error {
    anyhow!("NCCL error: {e:?}")
}

fn cerr(e: cudarc::nccl::result::NcclError) -> candle_core::Error {
    candle_core::Error::Msg(format!("NCCL error: {e:?}"))
}

/// A fresh NCCL unique id (rank 0), as the 128 bytes to share.
pub fn unique_id() -> Result<[u8; ID_BYTES]> {
    let id = Id::new().map_err(nccl_err).context("ncclGetUniqueId")?;
    Ok(std::array::from_fn(|i| id.internal()[i] as u8))
}

fn cuda_dev(device: &Device) -> Result<CudaDevice> {
    match device {
        Device::Cuda(d) => Ok(d.clone()),
        other => bail!("the NCCL backend needs a CUDA device, got {other:?}"),
    }
}

/// Makes sure NVLink multicast is off before NCCL reads its environment.
fn ensure_nvls_off() {
    match std::env::var("NCCL_NVLS_ENABLE") {
        Ok(v) if v.trim() == "0" => {}
        Ok(v) => tracing::warn!(
            "NCCL_NVLS_ENABLE={v}: NVLink multicast should stay off on shared machines (set NCCL_NVLS_ENABLE=0)"
        ),
        // SAFETY (edition 2021: safe fn): called before the communicator exists, on the
        // thread that initialises NCCL; NCCL reads the variable during ncclCommInitRank.
        Err(_) => std::env::set_var("NCCL_NVLS_ENABLE", "0"),
    }
}

impl NcclCollective {
    /// The whole setup from torchrun's environment: checks that `device` is
    /// `cuda:LOCAL_RANK`, shares rank 0's unique id over TCP ([`share_id`]), then creates the
    /// communicator on `device`'s stream under a watchdog.
    pub fn init(env: &DistEnv, device: &Device, options: &NcclOptions) -> Result<Self> {
        let cdev = cuda_dev(device)?;
        let ordinal = cdev.cuda_stream().context().ordinal();
        if ordinal != env.local_rank {
            bail!(
                "rank {}: the model is on cuda:{ordinal} but LOCAL_RANK={} (use Device::new_cuda(LOCAL_RANK))",
                env.rank,
                env.local_rank
            );
        }
        ensure_nvls_off();
        let id = if env.rank == 0 {
            Some(unique_id()?)
        } else {
            None
        };
        let t = Instant::now();
        let id = share_id(env, id.as_ref(), options.rendezvous_timeout)?;
        tracing::info!(
            "rank {}: rendezvous done in {:.2} s",
            env.rank,
            t.elapsed().as_secs_f64()
        );
        Self::from_id(device, env.rank, env.world_size, &id, options)
    }

    /// The communicator of rank `rank` of `world` from a shared unique id, on `device`'s
    /// stream; `ncclCommInitRank` runs under a watchdog of `options.init_timeout`.
    pub fn from_id(
        device: &Device,
        rank: usize,
        world: usize,
        id: &[u8; ID_BYTES],
        options: &NcclOptions,
    ) -> Result<Self> {
        if rank >= world {
            bail!("rank {rank} must be < world size {world}");
        }
        let cdev = cuda_dev(device)?;
        let stream = cdev.cuda_stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| anyhow!("binding the CUDA context: {e:?}"))?;
        let raw: [std::ffi::c_char; ID_BYTES] = std::array::from_fn(|i| id[i] as std::ffi::c_char);
        // on a device from `crate::cuda::new_device` (event tracking off) the fork only adds a
        // stream, ordered by `enqueue`'s events; on one from candle's `Device::new_cuda` it also
        // turns on cudarc's per-access event tracking (correct, more host time per launch)
        let comm_stream = stream
            .fork()
            .map_err(|e| anyhow!("creating the communication stream: {e:?}"))?;
        let dog = Watchdog::arm_exit("ncclCommInitRank", rank, options.init_timeout);
        let comm = Comm::from_rank(comm_stream.clone(), rank, world, Id::uninit(raw));
        dog.disarm();
        let comm = comm
            .map_err(nccl_err)
            .with_context(|| format!("rank {rank}: ncclCommInitRank (world size {world})"))?;
        Ok(Self {
            comm: Some(comm),
            stream,
            comm_stream,
            device: device.clone(),
            rank,
            world,
            options: options.clone(),
        })
    }

    fn comm(&self) -> Result<&Comm> {
        self.comm
            .as_ref()
            .ok_or_else(|| anyhow!("the NCCL communicator was shut down"))
    }

    fn check_device(&self, t: &Tensor, what: &str) -> Result<()> {
        if !t.device().same_device(&self.device) {
            bail!(
                "{what}: tensor on {:?}, the communicator is on {:?}",
                t.device(),
                self.device
            );
        }
        check_float(t.dtype(), what)
    }

    /// A fresh contiguous copy of `t` (every float dtype but f8 is native to NCCL; f8 goes as
    /// f32).
    fn staging(&self, t: &Tensor) -> Result<Tensor> {
        let dt = match t.dtype() {
            d @ (DType::F64 | DType::F32 | DType::BF16 | DType::F16) => d,
            _ => DType::F32,
        };
        // `copy` guarantees a storage of its own: the in-place op must not touch `t`
        Ok(t.to_dtype(dt)?.contiguous()?.copy()?)
    }

    /// Runs `collective` on the communication stream after the work queued so far on
    /// candle's stream; returns its result and an event that marks its end.
    fn enqueue<R>(&self, collective: impl FnOnce(&Comm) -> Result<R>) -> Result<(R, CudaEvent)> {
        let inputs = self
            .stream
            .record_event(None)
            .map_err(|e| anyhow!("recording an event: {e:?}"))?;
        self.comm_stream
            .wait(&inputs)
            .map_err(|e| anyhow!("ordering the communication stream: {e:?}"))?;
        let r = collective(self.comm()?)?;
        let done = self
            .comm_stream
            .record_event(None)
            .map_err(|e| anyhow!("recording an event: {e:?}"))?;
        Ok((r, done))
    }

    /// [`Self::enqueue`], then candle's stream waits for the collective.
    fn run<R>(&self, collective: impl FnOnce(&Comm) -> Result<R>) -> Result<R> {
        let (r, done) = self.enqueue(collective)?;
        self.stream
            .wait(&done)
            .map_err(|e| anyhow!("waiting for the collective: {e:?}"))?;
        Ok(r)
    }

    /// Synchronises, barriers, then destroys the communicator (the clean way to end: dropping
    /// a communicator aborts it).
    pub fn shutdown(mut self) -> Result<()> {
        self.barrier()?;
        if let Some(c) = self.comm.take() {
            drop_comm(c);
        }
        Ok(())
    }
}

fn drop_comm(c: Comm) {
    // cudarc's Drop calls ncclCommAbort and panics on error: keep that panic inside
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(c)));
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        if let Some(c) = self.comm.take() {
            let _ = self.stream.synchronize();
            let _ = self.comm_stream.synchronize();
            drop_comm(c);
        }
    }
}

fn op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Max => NcclOp::Max,
    }
}

/// In-place all-reduce (`Some(op)`) or broadcast from `root` (`op: None`) of a contiguous
/// f32/f64/bf16/f16 CUDA tensor.
struct InPlace<'a> {
    comm: &'a Comm,
    op: Option<ReduceOp>,
    root: usize,
}

fn range(l: &Layout) -> candle_core::Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("NCCL needs a contiguous tensor".into()))
}

impl InplaceOp1 for InPlace<'_> {
    fn name(&self) -> &'static str {
        "nccl-in-place"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("NCCL collectives need CUDA tensors")
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        let (a, b) = range(l)?;
        fn go<T: cudarc::nccl::NcclType + cudarc::driver::DeviceRepr>(
            this: &InPlace<'_>,
            sl: &mut CudaSlice<T>,
            a: usize,
            b: usize,
        ) -> candle_core::Result<()> {
            let mut v = sl.slice_mut(a..b);
            match this.op {
                Some(o) => this
                    .comm
                    .all_reduce_in_place(&mut v, &op(o))
                    .map_err(cerr)?,
                None => this
                    .comm
                    .broadcast_in_place(&mut v, this.root as i32)
                    .map_err(cerr)?,
            };
            Ok(())
        }
        match s.dtype() {
            DType::F32 => go(self, s.as_cuda_slice_mut::<f32>()?, a, b),
            DType::F64 => go(self, s.as_cuda_slice_mut::<f64>()?, a, b),
            DType::BF16 => go(self, s.as_cuda_slice_mut::<half::bf16>()?, a, b),
            DType::F16 => go(self, s.as_cuda_slice_mut::<half::f16>()?, a, b),
            dt => candle_core::bail!("NCCL in-place collective: unsupported dtype {dt:?}"),
        }
    }
}

/// `dst ← reduce_scatter(src)` (`scatter: true`) or `dst ← all_gather(src)`, both contiguous
/// f32/f64/bf16/f16 CUDA tensors of one dtype.
struct IntoDst<'a> {
    comm: &'a Comm,
    scatter: bool,
}

impl InplaceOp2 for IntoDst<'_> {
    fn name(&self) -> &'static str {
        "nccl-into"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!("NCCL collectives need CUDA tensors")
    }

    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        dst_l: &Layout,
        src: &CudaStorage,
        src_l: &Layout,
    ) -> candle_core::Result<()> {
        let (da, db) = range(dst_l)?;
        let (sa, sb) = range(src_l)?;
        fn go<T: cudarc::nccl::NcclType + cudarc::driver::DeviceRepr>(
            this: &IntoDst<'_>,
            d: &mut CudaSlice<T>,
            s: &CudaSlice<T>,
            (da, db, sa, sb): (usize, usize, usize, usize),
        ) -> candle_core::Result<()> {
            let mut dv = d.slice_mut(da..db);
            let sv = s.slice(sa..sb);
            if this.scatter {
                this.comm
                    .reduce_scatter(&sv, &mut dv, &NcclOp::Sum)
                    .map_err(cerr)?;
            } else {
                this.comm.all_gather(&sv, &mut dv).map_err(cerr)?;
            }
            Ok(())
        }
        match (dst.dtype(), src.dtype()) {
            (DType::F32, DType::F32) => go(
                self,
                dst.as_cuda_slice_mut::<f32>()?,
                src.as_cuda_slice::<f32>()?,
                (da, db, sa, sb),
            ),
            (DType::F64, DType::F64) => go(
                self,
                dst.as_cuda_slice_mut::<f64>()?,
                src.as_cuda_slice::<f64>()?,
                (da, db, sa, sb),
            ),
            (DType::BF16, DType::BF16) => go(
                self,
                dst.as_cuda_slice_mut::<half::bf16>()?,
                src.as_cuda_slice::<half::bf16>()?,
                (da, db, sa, sb),
            ),
            (DType::F16, DType::F16) => go(
                self,
                dst.as_cuda_slice_mut::<half::f16>()?,
                src.as_cuda_slice::<half::f16>()?,
                (da, db, sa, sb),
            ),
            (d, s) => candle_core::bail!("NCCL collective: dtypes {d:?} / {s:?} not supported"),
        }
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce(&self, t: &Tensor, o: ReduceOp) -> Result<Tensor> {
        self.check_device(t, "all_reduce")?;
        let buf = self.staging(t)?;
        self.run(|comm| {
            let op = InPlace {
                comm,
                op: Some(o),
                root: 0,
            };
            buf.inplace_op1(&op).context("ncclAllReduce")
        })?;
        Ok(buf.to_dtype(t.dtype())?.reshape(t.dims())?)
    }

    fn all_reduce_sum_start(&self, t: &Tensor) -> Result<Pending> {
        self.check_device(t, "all_reduce_sum_start")?;
        let buf = self.staging(t)?;
        let ((), done) = self.enqueue(|comm| {
            let op = InPlace {
                comm,
                op: Some(ReduceOp::Sum),
                root: 0,
            };
            buf.inplace_op1(&op).context("ncclAllReduce")
        })?;
        // f8 went as f32: cast after the wait (the cast is a kernel on candle's stream)
        let (stream, dtype, dims) = (self.stream.clone(), t.dtype(), t.dims().to_vec());
        let result = buf.reshape(dims)?;
        let join = move || {
            stream
                .wait(&done)
                .map_err(|e| anyhow!("waiting for the all-reduce: {e:?}"))
        };
        if result.dtype() != dtype {
            join()?;
            return Ok(Pending::ready(result.to_dtype(dtype)?));
        }
        Ok(Pending::new(result, Box::new(join)))
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.check_device(t, "broadcast")?;
        if root >= self.world {
            bail!("broadcast from rank {root} in a group of {}", self.world);
        }
        let buf = self.staging(t)?;
        self.run(|comm| {
            let op = InPlace {
                comm,
                op: None,
                root,
            };
            buf.inplace_op1(&op).context("ncclBroadcast")
        })?;
        Ok(buf.to_dtype(t.dtype())?.reshape(t.dims())?)
    }

    fn reduce_scatter_sum(&self, flat: &Tensor) -> Result<Tensor> {
        self.check_device(flat, "reduce_scatter_sum")?;
        check_flat(flat, "reduce_scatter_sum")?;
        let n = flat.elem_count();
        if n % self.world != 0 {
            bail!("reduce_scatter_sum: {n} elements do not split into {} equal shards (pad the input to a multiple of the world size first)", self.world);
        }
        let src = self.staging(flat)?;
        let dst = Tensor::zeros(n / self.world, src.dtype(), &self.device)?;
        self.run(|comm| {
            let op = IntoDst {
                comm,
                scatter: true,
            };
            dst.inplace_op2(&src, &op).context("ncclReduceScatter")
        })?;
        Ok(dst.to_dtype(flat.dtype())?)
    }

    fn all_gather(&self, shard: &Tensor) -> Result<Tensor> {
        self.check_device(shard, "all_gather")?;
        check_flat(shard, "all_gather")?;
        let src = self.staging(shard)?;
        let dst = Tensor::zeros(shard.elem_count() * self.world, src.dtype(), &self.device)?;
        self.run(|comm| {
            let op = IntoDst {
                comm,
                scatter: false,
            };
            dst.inplace_op2(&src, &op).context("ncclAllGather")
        })?;
        Ok(dst.to_dtype(shard.dtype())?)
    }

    fn barrier(&self) -> Result<()> {
        let dog = Watchdog::arm_exit("barrier", self.rank, self.options.op_timeout);
        let r = (|| -> Result<()> {
            let one = Tensor::ones(1, DType::F32, &self.device)?;
            let s = self.all_reduce(&one, ReduceOp::Sum)?;
            self.stream
                .synchronize()
                .map_err(|e| anyhow!("synchronize: {e:?}"))?;
            let v = s.to_vec1::<f32>()?;
            if v.first().copied() != Some(self.world as f32) {
                bail!("barrier: got {v:?}, expected [{}]", self.world);
            }
            Ok(())
        })();
        dog.disarm();
        r
    }
}
