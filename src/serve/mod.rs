//! Serving while training: the pieces an inference service needs to embed wick, answer
//! requests from a consistent copy of the weights, and keep fine-tuning from feedback.
//!
//! ```text
//! HTTP handlers ──try_push──▶ FeedbackQueue (bounded: full → the caller answers 429)
//!                                   │ micro-batches
//!                                   ▼
//!                     online::spawn trainer thread: Engine::step …
//!                                   │ every N steps: snapshot (deep copy) + publish
//!                                   ▼
//! HTTP handlers ◀──load()── Published<S> (arc-swap: one atomic pointer swap per version)
//! ```
//! A request loads the current [`Published`] snapshot once (`Arc` clone, lock-free) and
//! computes its whole answer from it, so it never sees half an update and never waits for the
//! trainer. The trainer only ever writes its own working weights; a snapshot is a deep copy
//! ([`snapshot::copy_params`], [`crate::models::Decoder::snapshot`]) made between steps.
//!
//! Generation runs through [`scheduler::Scheduler`]: one engine thread, continuous batching
//! over a paged KV cache ([`crate::models::PagedKvCache`]), each request pinned to the
//! snapshot it loaded.
//!
//! Nothing here holds global state: a process may run several services side by side.

pub mod online;
pub mod published;
pub mod queue;
pub mod sampling;
pub mod scheduler;
pub mod snapshot;

pub use online::{spawn, OnlineConfig, OnlineLearner, OnlineParts, OnlineStats, OnlineSummary};
pub use published::{Published, Versioned};
pub use queue::{feedback_queue, FeedbackReceiver, FeedbackSender, QueueError};
pub use sampling::SamplingParams;
pub use scheduler::{
    Detokenize, Event, FinishReason, OnEvent, Request, Scheduler, SchedulerConfig, SchedulerStats,
    SubmitError,
};
pub use snapshot::{copy_params, ParamSnapshot};
