//! [`SideOutput`]: the tensor a custom op leaves beside its one output.

use candle_core::{Storage, Tensor};
use std::sync::Mutex;

/// A tensor a custom op leaves beside its one output: candle's `CustomOp` returns a single
/// storage, so a backward kernel that also produces parameter gradients (the norms), or a
/// forward that keeps something for its own backward (attention's log-sum-exp, the head
/// loss's logits), puts it here. Not tracked by autograd.
#[derive(Default)]
pub(crate) struct SideOutput(Mutex<Option<Tensor>>);

impl SideOutput {
    /// Holds `t`.
    pub(crate) fn holding(t: Tensor) -> Self {
        Self(Mutex::new(Some(t)))
    }

    /// Stores a storage produced inside `cpu_fwd` / `cuda_fwd` as a tensor of `shape`.
    pub(crate) fn put(&self, s: Storage, shape: impl Into<candle_core::Shape>) {
        let t = Tensor::from_storage(s, shape, candle_core::op::BackpropOp::none(), false);
        *self.lock() = Some(t);
    }

    /// Removes and returns the tensor (frees it once the caller drops it).
    pub(crate) fn take(&self) -> Option<Tensor> {
        self.lock().take()
    }

    /// The tensor, left in place (a second backward through the same graph finds it again).
    pub(crate) fn get(&self) -> Option<Tensor> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Tensor>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}
