//! A bounded queue of feedback examples from request handlers to the trainer thread.
//!
//! Built on `std::sync::mpsc::sync_channel`: [`FeedbackSender::try_push`] never blocks and
//! fails with [`QueueError::Full`] at capacity (a service answers 429), so the queue never
//! grows without bound.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why an example was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueError {
    /// The queue holds `capacity` examples already: retry later.
    Full {
        /// The queue's capacity.
        capacity: usize,
    },
    /// The trainer has stopped (shutdown): nothing will take the example.
    Closed,
}

impl std::fmt::Display for QueueError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QueueError::Full { capacity } => write!(
                f,
                "the feedback queue is full ({capacity} examples waiting); retry later"
            ),
            QueueError::Closed => write!(f, "the trainer has stopped; feedback is not accepted"),
        }
    }
}

impl std::error::Error for QueueError {}

/// The producing end: cheap to clone, `Send + Sync` for `Send` examples.
#[derive(Debug)]
pub struct FeedbackSender<T> {
    tx: SyncSender<T>,
    depth: Arc<AtomicUsize>,
    capacity: usize,
}

impl<T> Clone for FeedbackSender<T> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            depth: self.depth.clone(),
            capacity: self.capacity,
        }
    }
}

/// The consuming end, owned by the trainer thread.
#[derive(Debug)]
pub struct FeedbackReceiver<T> {
    rx: Receiver<T>,
    depth: Arc<AtomicUsize>,
}

/// A queue holding at most `capacity` examples (at least 1; 0 is taken as 1).
pub fn feedback_queue<T>(capacity: usize) -> (FeedbackSender<T>, FeedbackReceiver<T>) {
    let capacity = capacity.max(1);
    let (tx, rx) = std::sync::mpsc::sync_channel(capacity);
    let depth = Arc::new(AtomicUsize::new(0));
    (
        FeedbackSender {
            tx,
            depth: depth.clone(),
            capacity,
        },
        FeedbackReceiver { rx, depth },
    )
}

impl<T> FeedbackSender<T> {
    /// Queues `example` without blocking.
    ///
    /// Errors: [`QueueError::Full`] at capacity, [`QueueError::Closed`] once the receiver is
    /// gone; the example is dropped in both cases.
    pub fn try_push(&self, example: T) -> Result<(), QueueError> {
        // count first so that the receiver's decrement can never run before the increment
        self.depth.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(example) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.depth.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    TrySendError::Full(_) => QueueError::Full {
                        capacity: self.capacity,
                    },
                    TrySendError::Disconnected(_) => QueueError::Closed,
                })
            }
        }
    }

    /// Examples waiting (approximate while pushes and pops race).
    pub fn depth(&self) -> usize {
        self.depth.load(Ordering::SeqCst)
    }

    /// The capacity.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

impl<T> FeedbackReceiver<T> {
    /// Waits up to `wait` for a first example, then takes whatever else is queued, up to `max`
    /// examples in all (at least 1). Empty when nothing came within `wait` or every sender is
    /// gone.
    pub fn next_batch(&self, max: usize, wait: Duration) -> Vec<T> {
        let deadline = Instant::now() + wait;
        let mut out = Vec::new();
        match self
            .rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Ok(x) => out.push(x),
            Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => return out,
        }
        while out.len() < max.max(1) {
            match self.rx.try_recv() {
                Ok(x) => out.push(x),
                Err(_) => break,
            }
        }
        self.depth.fetch_sub(out.len(), Ordering::SeqCst);
        out
    }

    /// Examples waiting.
    pub fn depth(&self) -> usize {
        self.depth.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_queue_refuses_and_batches_take_what_is_queued() {
        let (tx, rx) = feedback_queue::<u32>(3);
        for i in 0..3 {
            tx.try_push(i).unwrap();
        }
        assert_eq!(tx.try_push(9), Err(QueueError::Full { capacity: 3 }));
        assert_eq!(tx.depth(), 3);
        assert_eq!(rx.next_batch(2, Duration::from_millis(1)), vec![0, 1]);
        assert_eq!(rx.depth(), 1);
        tx.try_push(3).unwrap();
        assert_eq!(rx.next_batch(10, Duration::from_millis(1)), vec![2, 3]);
        assert!(rx.next_batch(10, Duration::from_millis(1)).is_empty());
        assert_eq!(tx.depth(), 0);
        drop(rx);
        assert_eq!(tx.try_push(4), Err(QueueError::Closed));
        assert_eq!(tx.depth(), 0);
    }
}
