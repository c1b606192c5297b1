//! The dataset seam: a [`Dataset`] maps an index to a sample, a [`Collate`] step turns a list
//! of samples into the tensors of one batch.
//!
//! This is PyTorch's map-style dataset (`__len__` + `__getitem__`) and `collate_fn`:
//!
//! ```text
//! batch = collate([dataset.get(i) for i in batch_indices])      // -> Vec<Tensor>
//! ```
//!
//! The default collate, [`Stack`], takes samples that are lists of tensors (one per field,
//! e.g. `[image, label]`) and stacks each field along a new leading batch dimension, like
//! `torch.utils.data.default_collate` does for a tuple of tensors:
//! `B` samples `[x: (784,), y: ()]` become `[x: (B, 784), y: (B,)]`.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use wick::data::{Collate, Dataset, Stack, TensorDataset};
//! # fn main() -> anyhow::Result<()> {
//! let x = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &Device::Cpu)?;
//! let y = Tensor::new(&[7u32, 8, 9], &Device::Cpu)?;
//! let ds = TensorDataset::new(vec![x, y])?;
//! assert_eq!(ds.len(), 3);
//! let batch = Stack.collate(vec![ds.get(2)?, ds.get(0)?])?;
//! assert_eq!(batch[0].to_vec2::<f32>()?, vec![vec![5., 6.], vec![1., 2.]]);
//! assert_eq!(batch[1].to_vec1::<u32>()?, vec![9, 7]);
//! # Ok(()) }
//! ```

use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Tensor};

/// A map-style dataset: `len()` samples, addressed by index `0..len()`.
///
/// `get` is called from the loader's worker threads (hence `Send + Sync`); it must be
/// deterministic for the loader's resume guarantee (same index, same sample). Implementations
/// return an error, not a panic, for an index out of range (the loader only asks for indices
/// below `len()`; a panic inside `get` is caught by the loader and turned into an error).
pub trait Dataset: Send + Sync + 'static {
    /// One sample, as produced by [`Dataset::get`] and consumed by a [`Collate`].
    type Sample: Send + 'static;

    /// Number of samples.
    fn len(&self) -> usize;

    /// `len() == 0`.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sample at `index` (`index < len()`).
    fn get(&self, index: usize) -> Result<Self::Sample>;
}

impl<D: Dataset> Dataset for Arc<D> {
    type Sample = D::Sample;
    fn len(&self) -> usize {
        (**self).len()
    }
    fn get(&self, index: usize) -> Result<Self::Sample> {
        (**self).get(index)
    }
}

/// Turns the samples of one batch into the batch's tensors (PyTorch's `collate_fn`).
///
/// Runs on the loader's worker threads; the tensors it returns should be on the CPU (the
/// loader moves them to the configured device). Any `Fn(Vec<S>) -> Result<Vec<Tensor>>`
/// closure is a `Collate<S>`.
pub trait Collate<S>: Send + Sync + 'static {
    /// Collate `samples` (in batch order, never empty) into the batch's tensors.
    fn collate(&self, samples: Vec<S>) -> Result<Vec<Tensor>>;
}

impl<S, F> Collate<S> for F
where
    F: Fn(Vec<S>) -> Result<Vec<Tensor>> + Send + Sync + 'static,
{
    fn collate(&self, samples: Vec<S>) -> Result<Vec<Tensor>> {
        self(samples)
    }
}

/// The default collate: samples are `Vec<Tensor>` with the same number of fields; field `j`
/// of the batch is `Tensor::stack([s[j] for s in samples], 0)`, of shape `(B, ...)` where
/// `...` is the field's per-sample shape (a scalar field gives `(B,)`). Dtypes are kept.
///
/// # Errors
/// No samples; samples with different field counts; a field whose shape or dtype differs
/// between samples (the message names the field and the two shapes).
#[derive(Debug, Clone, Copy, Default)]
pub struct Stack;

impl Collate<Vec<Tensor>> for Stack {
    fn collate(&self, samples: Vec<Vec<Tensor>>) -> Result<Vec<Tensor>> {
        let Some(first) = samples.first() else {
            bail!("cannot collate an empty list of samples");
        };
        let fields = first.len();
        for (k, s) in samples.iter().enumerate() {
            ensure!(
                s.len() == fields,
                "sample {k} of the batch has {} fields but sample 0 has {fields}; \
                 every sample must have the same fields",
                s.len()
            );
        }
        (0..fields)
            .map(|j| {
                let column: Vec<&Tensor> = samples.iter().map(|s| &s[j]).collect();
                for (k, t) in column.iter().enumerate() {
                    ensure!(
                        t.dims() == column[0].dims() && t.dtype() == column[0].dtype(),
                        "field {j} of sample {k} is {:?} {:?} but sample 0 has {:?} {:?}; \
                         Stack needs equal shapes (pad in a custom Collate)",
                        t.dtype(),
                        t.dims(),
                        column[0].dtype(),
                        column[0].dims()
                    );
                }
                Tensor::stack(&column, 0).with_context(|| format!("stacking field {j}"))
            })
            .collect()
    }
}

/// In-memory tensors indexed along dim 0, like `torch.utils.data.TensorDataset`.
///
/// Sample `i` is `[t.get(i) for t in tensors]`: each field loses its leading dimension, so
/// with `images: (N, 784) f32` and `labels: (N,) u32` a sample is `[(784,) f32, () u32]` and
/// a [`Stack`]ed batch is `[(B, 784) f32, (B,) u32]`. Samples are views; nothing is copied
/// until collation.
#[derive(Debug, Clone)]
pub struct TensorDataset {
    tensors: Vec<Tensor>,
    len: usize,
}

impl TensorDataset {
    /// Wrap `tensors`, which must all have the same size `N >= 0` along dim 0 and live on the
    /// CPU (the loader moves batches to the training device).
    ///
    /// # Errors
    /// No tensors; a tensor of rank 0; sizes along dim 0 that differ (the message lists the
    /// shapes); a tensor not on the CPU.
    pub fn new(tensors: Vec<Tensor>) -> Result<Self> {
        ensure!(
            !tensors.is_empty(),
            "TensorDataset::new needs at least one tensor"
        );
        for (j, t) in tensors.iter().enumerate() {
            ensure!(
                t.rank() >= 1,
                "TensorDataset tensor {j} is a scalar; tensors are indexed along dim 0"
            );
            ensure!(
                matches!(t.device(), Device::Cpu),
                "TensorDataset tensor {j} is on {:?}; keep dataset tensors on the CPU and set \
                 the loader's `device` to move batches",
                t.device()
            );
        }
        let len = tensors[0].dim(0)?;
        if tensors.iter().any(|t| t.dims()[0] != len) {
            let shapes: Vec<_> = tensors.iter().map(|t| t.dims().to_vec()).collect();
            bail!("TensorDataset tensors differ in size along dim 0: shapes {shapes:?}");
        }
        Ok(Self { tensors, len })
    }

    /// The wrapped tensors, `(N, ...)` each.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }
}

impl Dataset for TensorDataset {
    type Sample = Vec<Tensor>;

    fn len(&self) -> usize {
        self.len
    }

    /// `[t.get(index) for t in tensors]`; an error if `index >= len()`.
    fn get(&self, index: usize) -> Result<Vec<Tensor>> {
        ensure!(
            index < self.len,
            "index {index} out of range for a TensorDataset of {} samples",
            self.len
        );
        self.tensors.iter().map(|t| Ok(t.get(index)?)).collect()
    }
}
