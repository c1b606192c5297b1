//! The output of a custom op whose forward was computed beforehand with tensor ops (no graph
//! recorded), handed to candle as the op's output so that the graph node is the custom op's:
//! its backward, and what it keeps (only its inputs), are then the op's own.
//! [`super::gelu_linear`] and [`crate::recompute::checkpoint`] build their nodes this way.

use candle_core::{bail, CpuStorage, Result, Shape, Storage, Tensor};
use std::sync::Mutex;

/// A forward result waiting for its op's `cpu_fwd` / `cuda_fwd`, which take it once.
pub(crate) struct PrecomputedOutput {
    op: &'static str,
    output: Mutex<Option<Tensor>>,
}

impl PrecomputedOutput {
    /// Holds `y` for the op named `op` (the name goes into errors).
    pub(crate) fn new(op: &'static str, y: Tensor) -> Self {
        Self {
            op,
            output: Mutex::new(Some(y)),
        }
    }

    fn take(&self) -> Result<Tensor> {
        let taken = self.output.lock().unwrap_or_else(|e| e.into_inner()).take();
        match taken {
            Some(y) => y.contiguous(),
            None => bail!("{}: the output was already taken (internal error)", self.op),
        }
    }

    /// The output as a CPU storage: a copy of the held tensor's buffer (candle's custom-op
    /// interface takes an owned storage; the held tensor is dropped right after). A view that
    /// does not start at the buffer's first element is copied out first.
    pub(crate) fn cpu(&self) -> Result<(CpuStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let y = self.take()?;
        let y = if y.layout().start_offset() == 0 {
            y
        } else {
            y.copy()?
        };
        let (st, layout) = y.storage_and_layout();
        match &*st {
            Storage::Cpu(c) => Ok((c.try_clone(layout)?, y.shape().clone())),
            _ => bail!("{}: the output is not on the CPU like the inputs", self.op),
        }
    }

    /// The output as a CUDA storage: a device copy of the held tensor.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(&self) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let y = self.take()?;
        let (st, layout) = y.storage_and_layout();
        match &*st {
            Storage::Cuda(c) => Ok((c.try_clone(layout)?, y.shape().clone())),
            _ => bail!("{}: the output is not on CUDA like the inputs", self.op),
        }
    }
}
