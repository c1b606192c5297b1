//! Datasets and data loading.
//!
//! - [`dataset`]: the [`Dataset`] and [`Collate`] seams, [`TensorDataset`] (in-memory tensors).
//! - [`chat`]: chat fine-tuning data: JSONL conversations and prompt/completion pairs, the
//!   chat template, assistant-only labels, length policy, held-out split, Shakespeare dialogues.
//! - [`packing`]: chat examples into training batches, packed without padding (variable-length
//!   attention) or padded, the trained targets gathered on the host.
//! - [`text`]: [`TextWindows`], byte-level language-modelling windows over a text file.
//! - [`mnist`]: the MNIST idx reader (raw or gzipped) for the data fetched by `scripts/`.
//! - [`plays`]: Shakespeare's lines labelled by the genre of their play, split by play.
//! - [`buckets`]: length-grouped batches (dynamic padding with little waste).
//! - [`sampler`]: per-epoch seeded order, batching, [`DistributedSampler`].
//! - [`loader`]: [`DataLoader`]: worker threads, bounded prefetch, in-order delivery,
//!   save/restore of the position, asynchronous copies to the GPU.
//! - `staging` (feature `cuda`): pinned host staging and the copy stream behind the loader.

pub mod buckets;
#[cfg(feature = "tokenizers")]
pub mod chat;
pub mod dataset;
pub mod loader;
pub mod mnist;
pub mod packing;
pub mod plays;
pub mod sampler;
#[cfg(feature = "cuda")]
mod staging;
pub mod text;

pub use dataset::{Collate, Dataset, Stack, TensorDataset};
pub use loader::{Batch, DataLoader, EpochIter, LoaderConfig, LoaderState};
pub use sampler::{DistributedSampler, Sampler};
pub use text::TextWindows;
