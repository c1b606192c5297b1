//! Activation checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
//! Cost", arXiv:1604.06174; PyTorch's `torch.utils.checkpoint` with `use_reentrant=True`): a
//! segment of the forward (a transformer block) keeps only its input; the backward runs the
//! segment again, this time recording a graph, and backpropagates through that.
//!
//! candle's autograd has no hook for this, so [`checkpoint`] builds it from custom ops:
//!
//! ```text
//! s0 = 0 (scalar)          s_i = Tap(s_{i-1}, w_i)          y = Segment(x, s_k)
//! ```
//! `Segment`'s forward is the segment run without a graph (its intermediates are freed at
//! once); its backward re-runs the segment from `x` with a graph, backpropagates `dy` through
//! it, returns `dx` and leaves each weight's gradient for its `Tap`. Every `Tap` is upstream of
//! `Segment` (through `s_k`), so candle's reverse topological order runs `Segment`'s backward
//! before theirs; a `Tap`'s forward is the identity on one scalar and its backward hands the
//! stored gradient to its weight. The weights receive the same gradients as without
//! checkpointing (the recomputation runs the same ops on the same inputs).

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor, TensorId, Var,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A differentiable segment of the forward: input `(..)` tensor to output tensor.
pub type SegmentFn = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// Runs `segment(x)` without keeping its activations: the result is differentiable with
/// respect to `x` and to every tensor of `weights` that autograd tracks (the segment's
/// parameters: list every one it uses, or it gets no gradient). Memory: the segment's input
/// and output instead of all its intermediates; time: one more forward of the segment in the
/// backward.
///
/// The segment must be deterministic (no dropout: the recomputation would draw another mask)
/// and its output contiguous. Backpropagate through the result once per forward.
///
/// Errors: those of `segment` (forward and recomputation).
pub fn checkpoint(x: &Tensor, weights: &[Tensor], segment: SegmentFn) -> Result<Tensor> {
    let shared = Arc::new(Mutex::new(HashMap::new()));
    let mut s = Tensor::zeros((), DType::F32, x.device())?;
    let mut tracked = Vec::new();
    for w in weights.iter().filter(|w| w.track_op()) {
        s = s.apply_op2(
            w,
            Tap {
                grads: shared.clone(),
            },
        )?;
        tracked.push(w.clone());
    }
    // the segment once without a graph: its output detached, the intermediates dropped here
    let y = segment(&x.detach())?.detach();
    x.apply_op2(
        &s,
        Segment {
            segment,
            weights: tracked,
            output: Mutex::new(Some(y)),
            grads: shared,
        },
    )
}

type Grads = Arc<Mutex<HashMap<TensorId, Tensor>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct Segment {
    segment: SegmentFn,
    weights: Vec<Tensor>,
    /// The forward's result, moved into the op's output storage by `cpu_fwd` / `cuda_fwd`.
    output: Mutex<Option<Tensor>>,
    grads: Grads,
}

impl Segment {
    /// The output, contiguous from the first element of its buffer (`cpu_fwd` hands the CPU
    /// buffer over whole).
    fn take_output(&self) -> Result<Tensor> {
        match lock(&self.output).take() {
            Some(y) if y.is_contiguous() && y.layout().start_offset() == 0 => Ok(y),
            Some(y) => y.copy(),
            None => bail!("checkpoint: the segment's output was already consumed (internal error)"),
        }
    }
}

impl CustomOp2 for Segment {
    fn name(&self) -> &'static str {
        "checkpoint"
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        _lx: &Layout,
        _s: &CpuStorage,
        _ls: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = self.take_output()?;
        let (st, _) = y.storage_and_layout();
        match &*st {
            Storage::Cpu(c) => Ok((c.clone(), y.shape().clone())),
            _ => bail!("checkpoint: the segment's output is not on the CPU like its input"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _x: &candle_core::CudaStorage,
        _lx: &Layout,
        _s: &candle_core::CudaStorage,
        _ls: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let y = self.take_output()?;
        let (st, layout) = y.storage_and_layout();
        match &*st {
            Storage::Cuda(c) => Ok((c.try_clone(layout)?, y.shape().clone())),
            _ => bail!("checkpoint: the segment's output is not on CUDA like its input"),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        s: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let xv = Var::from_tensor(&x.detach())?;
        // differentiated with grad_sink's backward below: block ops in the segment build their
        // one-node form
        let y = crate::grad_sink::forward_for_sink(|| (self.segment)(xv.as_tensor()))?;
        // a nested sink: leaf gradients from ops in the segment land in this store
        let grads = crate::grad_sink::backward(&(y * dy.detach())?.sum_all()?)?;
        let mut stash = lock(&self.grads);
        for w in &self.weights {
            if let Some(g) = grads.get(w) {
                stash.insert(w.id(), g.clone());
            }
        }
        Ok((grads.get(xv.as_tensor()).cloned(), Some(s.zeros_like()?)))
    }
}

/// Identity on a scalar; its backward hands its weight the gradient `Segment` left for it.
struct Tap {
    grads: Grads,
}

impl CustomOp2 for Tap {
    fn name(&self) -> &'static str {
        "checkpoint-tap"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        ls: &Layout,
        _w: &CpuStorage,
        _lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok((s.try_clone(ls)?, ls.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        ls: &Layout,
        _w: &candle_core::CudaStorage,
        _lw: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((s.try_clone(ls)?, ls.shape().clone()))
    }

    fn bwd(
        &self,
        _s: &Tensor,
        w: &Tensor,
        _out: &Tensor,
        ds: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = lock(&self.grads).remove(&w.id());
        Ok((Some(ds.clone()), crate::grad_sink::offer(w, g)?))
    }
}
