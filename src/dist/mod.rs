//! Data-parallel training: one process per GPU, gradients averaged over NCCL.
//!
//! The seam is the [`Collective`] trait: rank, world size and the handful of collectives that
//! data-parallel training needs (all-reduce sum / max, broadcast from a root, reduce-scatter and
//! all-gather of flat tensors, barrier). It lives on the ground floor, in [`crate::collective`]
//! (the gradient buffers below this module take one), and is re-exported here.
//! Implementations:
//!
//! - [`Solo`]: world size 1, every collective is the identity (no process group).
//! - [`local::LocalCollective`]: N ranks as threads of one process, exact and deterministic
//!   (sums in rank order 0..N-1): the CPU test double of NCCL.
//! - `nccl::NcclCollective` (feature `nccl`): NCCL through cudarc, one process per GPU,
//!   collectives enqueued on candle's stream (no host synchronisation).
//!
//! The rest is independent of the backend:
//!
//! - [`rendezvous`]: torchrun's environment contract (RANK, WORLD_SIZE, LOCAL_RANK,
//!   MASTER_ADDR, MASTER_PORT) and the TCP rendezvous that shares NCCL's 128-byte unique id.
//! - [`ddp`]: gradient bucketing (PyTorch DDP's reverse-order size-capped buckets), averaging,
//!   found_inf agreement and ZeRO-1 shard arithmetic; [`crate::Engine::with_collective`] plugs
//!   it into the engine through [`sync`].
//! - [`reduce`]: one window's reduction, its buckets started during the backward as their
//!   gradients become final (PyTorch DDP's overlap).
//! - [`zero`] and [`flat`]: ZeRO-1 by whole parameters, or by equal ranges of the flattened
//!   parameters (reduce-scatter, each rank's update of its range, all-gather).
//! - [`launch`]: `wick launch`, which starts and supervises the local ranks.
//! - [`watchdog`]: a deadline for calls that can block forever (NCCL's communicator setup).
//!
//! Process-level flow of a rank started by `wick launch` (or torchrun):
//!
//! ```text
//! DistEnv::from_env()            RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
//! device = cuda(LOCAL_RANK)
//! collective = init(&env, &device)   rank 0: ncclGetUniqueId → TCP → every rank; ncclCommInitRank
//! engine = Engine::new(store, cfg)?.with_collective(collective, DdpConfig::default())?
//!                                    (parameters broadcast from rank 0)
//! for batch in DistributedSampler shard: engine.step_weighted(n, ..)
//!                                    (last backward of a window: bucket all-reduces start
//!                                     as gradients become final; at the boundary: the rest,
//!                                     global norm,
//!                                     found_inf agreed with MAX, identical updates)
//! ```

pub mod ddp;
pub mod flat;
pub mod launch;
pub mod local;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod reduce;
pub mod rendezvous;
pub mod sync;
pub mod watchdog;
pub mod zero;

pub use ddp::{Bucket, BucketConfig, DdpConfig, Zero1Layout};
pub use local::LocalCollective;
pub use rendezvous::DistEnv;
pub use sync::GradSync;

pub(crate) use crate::collective::{check_flat, check_float};
pub use crate::collective::{Collective, Pending, ReduceOp, Solo};

use anyhow::Result;

/// The process group of this process, from torchrun's environment ([`DistEnv::from_env`]).
///
/// - No WORLD_SIZE in the environment, or WORLD_SIZE=1: [`Solo`].
/// - WORLD_SIZE > 1 with the `nccl` feature: rendezvous on MASTER_ADDR:MASTER_PORT, then an
///   NCCL communicator on `device` (which must be `cuda:LOCAL_RANK`, the device the model lives
///   on, so that collectives are ordered with its kernels). See `nccl::NcclCollective::init`.
/// - WORLD_SIZE > 1 without the `nccl` feature: an error saying how to build.
pub fn init(device: &candle_core::Device) -> Result<Box<dyn Collective>> {
    let Some(env) = DistEnv::from_env()? else {
        return Ok(Box::new(Solo));
    };
    if env.world_size == 1 {
        return Ok(Box::new(Solo));
    }
    init_nccl(&env, device)
}

#[cfg(feature = "nccl")]
fn init_nccl(env: &DistEnv, device: &candle_core::Device) -> Result<Box<dyn Collective>> {
    Ok(Box::new(nccl::NcclCollective::init(
        env,
        device,
        &nccl::NcclOptions::default(),
    )?))
}

#[cfg(not(feature = "nccl"))]
fn init_nccl(env: &DistEnv, _device: &candle_core::Device) -> Result<Box<dyn Collective>> {
    anyhow::bail!(
        "WORLD_SIZE={} asks for {} processes, but this build of wick has no NCCL backend: \
         build with `--features nccl` (CUDA toolkit and NCCL needed)",
        env.world_size,
        env.world_size
    )
}
