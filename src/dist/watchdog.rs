//! A deadline for calls that can block forever.
//!
//! NCCL's communicator setup (`ncclCommInitRank`) waits forever when a peer never arrives or a
//! stale unique id is used, and nothing in NCCL times out (the pitfall recorded in
//! `docs/cuda.md`, "NCCL across processes on 2 GPUs"). A blocked thread cannot be
//! interrupted, so the watchdog's default action ends the process: it prints which rank timed
//! out in which phase, flushes, and calls `_exit(3)` (no atexit handlers or C++ destructors,
//! which could themselves block on the stuck communicator). The supervisor (`wick launch`,
//! torchrun) then sees a non-zero exit and stops the other ranks.
//!
//! ```
//! use std::time::Duration;
//! use wick::dist::watchdog::Watchdog;
//! let dog = Watchdog::arm("demo", Duration::from_secs(60), |_msg: &str| {});
//! // ... the call that could block ...
//! dog.disarm(); // returns at once; the action never runs
//! ```

use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// An armed deadline: runs its action if not disarmed (or dropped) within the timeout.
#[derive(Debug)]
pub struct Watchdog {
    cancel: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Arms a deadline of `timeout` for `phase`. When it passes, `on_expire` runs on the
    /// watchdog's thread with a message naming the phase and the time waited.
    pub fn arm<F>(phase: &str, timeout: Duration, on_expire: F) -> Self
    where
        F: FnOnce(&str) + Send + 'static,
    {
        let (tx, rx) = mpsc::channel::<()>();
        let phase = phase.to_string();
        let start = Instant::now();
        let thread = std::thread::Builder::new()
            .name("wick-watchdog".into())
            .spawn(move || {
                // a message or a closed channel (disarm / drop) both mean: stand down
                if let Err(RecvTimeoutError::Timeout) = rx.recv_timeout(timeout) {
                    let msg = format!(
                        "watchdog: {phase} did not finish within {:.1} s",
                        start.elapsed().as_secs_f64()
                    );
                    on_expire(&msg);
                }
            })
            .ok();
        Self {
            cancel: Some(tx),
            thread,
        }
    }

    /// Arms a deadline whose action ends the process (see the module docs): it prints
    /// `[rank R] FATAL <message>` on stderr, flushes, and exits with status 3 through `_exit`.
    pub fn arm_exit(phase: &str, rank: usize, timeout: Duration) -> Self {
        Self::arm(phase, timeout, move |msg| {
            use std::io::Write;
            eprintln!(
                "[rank {rank}] FATAL {msg}; exiting (a peer probably died or never started; \
                 check the other ranks' output)"
            );
            let _ = std::io::stdout().flush();
            let _ = std::io::stderr().flush();
            // SAFETY: `_exit` only ends the process; nothing runs after it.
            unsafe { libc::_exit(3) }
        })
    }

    /// Stands the watchdog down and waits for its thread (which returns at once).
    pub fn disarm(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(tx) = self.cancel.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn fires_after_the_timeout_and_not_when_disarmed() {
        let fired = Arc::new(AtomicBool::new(false));
        let f = fired.clone();
        let dog = Watchdog::arm("quick", Duration::from_secs(30), move |_| {
            f.store(true, Ordering::SeqCst)
        });
        dog.disarm();
        assert!(!fired.load(Ordering::SeqCst));

        let msg = Arc::new(std::sync::Mutex::new(String::new()));
        let m = msg.clone();
        let dog = Watchdog::arm("slow call", Duration::from_millis(20), move |s| {
            *m.lock().unwrap() = s.to_string()
        });
        std::thread::sleep(Duration::from_millis(200));
        drop(dog);
        let msg = msg.lock().unwrap().clone();
        assert!(msg.contains("slow call did not finish"), "{msg}");
    }
}
