//! [`Published`]: the current inference snapshot behind an atomic pointer, with a version.

use arc_swap::ArcSwap;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A snapshot and the version it was published as (0 for the initial one).
#[derive(Debug)]
pub struct Versioned<T> {
    /// Publication number: 0 for the value given to [`Published::new`], then 1, 2, ...
    pub version: u64,
    /// The snapshot (e.g. an inference model over a copy of the weights).
    pub value: T,
    /// When it was published.
    pub published_at: Instant,
}

/// The current snapshot for readers, replaced atomically by one writer at a time.
///
/// Readers call [`Published::load`]: a lock-free `Arc` clone (`arc-swap`) that never waits
/// for a publication and keeps its snapshot alive for as long as it holds it, so a request
/// computes its whole answer from one version. [`Published::publish`] swaps in a new value
/// with the next version number. The newest `keep` versions (the current one included) stay
/// retrievable by number through [`Published::get`] (e.g. for audits that recompute an answer).
pub struct Published<T> {
    current: ArcSwap<Versioned<T>>,
    /// Serialises publishers and holds the retained versions, oldest first.
    history: Mutex<VecDeque<Arc<Versioned<T>>>>,
    keep: usize,
}

impl<T> Published<T> {
    /// Publishes `initial` as version 0. `keep` (at least 1; 0 is taken as 1) is how many of
    /// the newest versions [`Published::get`] can return.
    pub fn new(initial: T, keep: usize) -> Self {
        Self::starting_at(initial, 0, keep)
    }

    /// Publishes `initial` as version `version`, e.g. the last version published before a
    /// restart from a checkpoint, so that version numbers never repeat across restarts.
    pub fn starting_at(initial: T, version: u64, keep: usize) -> Self {
        let first = Arc::new(Versioned {
            version,
            value: initial,
            published_at: Instant::now(),
        });
        Self {
            current: ArcSwap::new(first.clone()),
            history: Mutex::new(VecDeque::from([first])),
            keep: keep.max(1),
        }
    }

    /// The current snapshot (lock-free; never blocks on a publication).
    pub fn load(&self) -> Arc<Versioned<T>> {
        self.current.load_full()
    }

    /// The current version number.
    pub fn version(&self) -> u64 {
        self.current.load().version
    }

    /// Makes `value` the current snapshot with the next version number, which it returns.
    /// Readers that loaded the previous snapshot keep it until they drop it.
    pub fn publish(&self, value: T) -> u64 {
        let mut history = self.history.lock().unwrap_or_else(|e| e.into_inner());
        let version = history.back().map_or(0, |v| v.version + 1);
        let next = Arc::new(Versioned {
            version,
            value,
            published_at: Instant::now(),
        });
        self.current.store(next.clone());
        history.push_back(next);
        while history.len() > self.keep {
            history.pop_front();
        }
        version
    }

    /// Version `version` if it is among the newest `keep`, else `None`.
    pub fn get(&self, version: u64) -> Option<Arc<Versioned<T>>> {
        let history = self.history.lock().unwrap_or_else(|e| e.into_inner());
        history.iter().find(|v| v.version == version).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_count_up_and_old_readers_keep_their_snapshot() {
        let p = Published::new("a".to_string(), 2);
        let held = p.load();
        assert_eq!(p.publish("b".into()), 1);
        assert_eq!(p.publish("c".into()), 2);
        assert_eq!((held.version, held.value.as_str()), (0, "a"));
        let now = p.load();
        assert_eq!((now.version, now.value.as_str()), (2, "c"));
        assert_eq!(p.version(), 2);
        // the newest 2 are retained
        assert!(p.get(0).is_none());
        assert_eq!(p.get(1).unwrap().value, "b");
        assert_eq!(p.get(2).unwrap().value, "c");
        assert!(p.get(3).is_none());
    }
}
