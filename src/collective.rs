//! The collective vocabulary: the [`Collective`] trait (rank, world size and the handful of
//! collectives data-parallel training needs), its [`ReduceOp`], the [`Pending`] result of a
//! started collective, and [`Solo`], the group of one process.
//!
//! It sits on the ground floor, below the gradient buffers ([`crate::grads`]) and the CUDA
//! gradient-norm kernel, which take an optional collective to sum a sharded gradient's norm
//! over the ranks, and below the data-parallel module `dist`, which implements it (the local
//! thread-group test double and NCCL) and re-exports it as
//! `wick::dist::{Collective, ReduceOp, Pending, Solo}`; nothing here imports `dist`.
//! The semantics follow `torch.distributed`'s collectives (every rank calls the same ones, in
//! the same order, with tensors of the same shape and dtype).

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

/// A reduction of a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum over the ranks.
    Sum,
    /// Element-wise maximum over the ranks.
    Max,
}

/// The collectives of data-parallel training, over the ranks of one process group.
///
/// Every rank must call the same collectives in the same order with tensors of the same
/// shape and dtype (as with NCCL and `torch.distributed`); a rank that does not arrive makes
/// the others wait (the local backend errors after its timeout; NCCL waits, see
/// `dist::watchdog`). Every method returns a new tensor and leaves its input untouched; results are
/// on the input's device, in the input's dtype, with the input's shape (except
/// [`Collective::reduce_scatter_sum`] and [`Collective::all_gather`], which work on flat
/// tensors).
pub trait Collective: Send {
    /// This process's rank, `0..world_size`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world_size(&self) -> usize;

    /// A short name of the backend ("solo", "local", "nccl").
    fn backend(&self) -> &'static str;

    /// Element-wise reduction of `t` over all ranks; every rank gets the result.
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// `all_reduce(t, Sum)`.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.all_reduce(t, ReduceOp::Sum)
    }

    /// `all_reduce(t, Max)`.
    fn all_reduce_max(&self, t: &Tensor) -> Result<Tensor> {
        self.all_reduce(t, ReduceOp::Max)
    }

    /// Starts `all_reduce(t, Sum)` and returns at once where the backend can run it beside
    /// this rank's compute (NCCL: on its communication stream, ordered after the work queued so
    /// far); the sum is read with [`Pending::wait`], which orders the compute after it. The
    /// default runs the collective now. Same rules as every collective: each rank starts the
    /// same collectives in the same order.
    fn all_reduce_sum_start(&self, t: &Tensor) -> Result<Pending> {
        Ok(Pending::ready(self.all_reduce_sum(t)?))
    }

    /// Rank `root`'s `t` on every rank (the other ranks' `t` gives only shape and dtype).
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;

    /// Sum over the ranks of a flat (1-D) tensor of `world_size * k` elements, of which rank `r`
    /// gets elements `r*k..(r+1)*k` (ZeRO's gradient reduce-scatter).
    fn reduce_scatter_sum(&self, flat: &Tensor) -> Result<Tensor>;

    /// The concatenation, in rank order, of every rank's flat (1-D) `shard` (all of one length).
    fn all_gather(&self, shard: &Tensor) -> Result<Tensor>;

    /// Returns when every rank has called it (and, on a GPU backend, when this rank's queued
    /// device work is done).
    fn barrier(&self) -> Result<()>;
}

/// A collective started by [`Collective::all_reduce_sum_start`]: its result, and what makes
/// this rank's compute wait for it. Dropping it unread also waits (a buffer still being
/// reduced must not be freed under the collective).
pub struct Pending {
    result: Tensor,
    join: Option<Box<dyn FnOnce() -> Result<()> + Send>>,
}

impl Pending {
    /// A result that is already there (backends that run collectives synchronously).
    pub fn ready(result: Tensor) -> Self {
        Self { result, join: None }
    }

    /// `result`, valid once `join` has run: `join` orders this rank's later compute after the
    /// collective (NCCL: the compute stream waits for the communication stream's event).
    pub fn new(result: Tensor, join: Box<dyn FnOnce() -> Result<()> + Send>) -> Self {
        Self {
            result,
            join: Some(join),
        }
    }

    /// The collective's result, ordered before every later use on this rank.
    ///
    /// Errors: the backend fails to order the streams.
    pub fn wait(mut self) -> Result<Tensor> {
        if let Some(join) = self.join.take() {
            join()?;
        }
        Ok(self.result.clone())
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(join) = self.join.take() {
            if let Err(e) = join() {
                tracing::error!("waiting for an unread collective: {e:#}");
            }
        }
    }
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("shape", &self.result.dims())
            .field("waited", &self.join.is_none())
            .finish()
    }
}

/// World size 1: every collective is the identity. What `dist::init` returns for a single process,
/// so that code paths are the same with and without a process group.
#[derive(Debug, Clone, Copy, Default)]
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn backend(&self) -> &'static str {
        "solo"
    }
    fn all_reduce(&self, t: &Tensor, _op: ReduceOp) -> Result<Tensor> {
        Ok(t.copy()?)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if root != 0 {
            bail!("broadcast from rank {root} in a group of 1");
        }
        Ok(t.copy()?)
    }
    fn reduce_scatter_sum(&self, flat: &Tensor) -> Result<Tensor> {
        check_flat(flat, "reduce_scatter_sum")?;
        Ok(flat.copy()?)
    }
    fn all_gather(&self, shard: &Tensor) -> Result<Tensor> {
        check_flat(shard, "all_gather")?;
        Ok(shard.copy()?)
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}

/// Errors unless `t` is 1-D (the flat tensors of reduce-scatter and all-gather).
pub(crate) fn check_flat(t: &Tensor, what: &str) -> Result<()> {
    if t.rank() != 1 {
        bail!("{what} needs a flat (1-D) tensor, got shape {:?}", t.dims());
    }
    Ok(())
}

/// Errors unless `dtype` is a float type a collective can carry.
pub(crate) fn check_float(dtype: DType, what: &str) -> Result<()> {
    if !dtype.is_float() {
        bail!("{what}: only float tensors are supported, got {dtype:?}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn solo_is_the_identity() -> Result<()> {
        let t = Tensor::new(&[1f32, -2.0, 3.5], &Device::Cpu)?;
        let s = Solo;
        assert_eq!((s.rank(), s.world_size()), (0, 1));
        for r in [
            s.all_reduce_sum(&t)?,
            s.all_reduce_max(&t)?,
            s.broadcast(&t, 0)?,
            s.reduce_scatter_sum(&t)?,
            s.all_gather(&t)?,
        ] {
            assert_eq!(r.to_vec1::<f32>()?, vec![1.0, -2.0, 3.5]);
        }
        assert!(s.broadcast(&t, 1).is_err());
        assert!(s.all_gather(&t.reshape((3, 1))?).is_err());
        s.barrier()
    }
}
