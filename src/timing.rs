//! Marks and spans on a step's timeline: wall clocks on the CPU, CUDA events on the GPU.
//!
//! On CUDA the host only *queues* work, so a wall clock around a phase measures how long the
//! host took to enqueue it, not how long the GPU ran it. A [`Mark`] on a CUDA device therefore
//! also records a timing event on candle's compute stream (`cuEventRecord`, no
//! synchronisation); a [`Span`] between two marks is resolved later with
//! `cuEventElapsedTime`, which waits for the end event. Resolve spans in batches (every N
//! steps, where the caller reads the loss anyway) so the hot path never waits for the GPU.
//! The event time is the GPU-timeline time between the two records: it includes any time the
//! GPU sat idle waiting for the host to queue the phase's work (a launch-bound phase).

#[cfg(feature = "cuda")]
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use candle_core::Device;

use crate::profile::PhaseTimes;

#[cfg(feature = "cuda")]
use candle_core::cuda::cudarc::driver::{sys::CUevent_flags, CudaEvent};

/// One point in time: the host clock, and on CUDA an event on the compute stream.
#[derive(Clone)]
pub struct Mark {
    host: Instant,
    #[cfg(feature = "cuda")]
    event: Option<Arc<CudaEvent>>,
}

impl std::fmt::Debug for Mark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mark")
            .field("host", &self.host)
            .field("device", &self.is_device())
            .finish()
    }
}

impl Mark {
    /// Marks now on `device`'s timeline. On CUDA this records a timing event on the stream
    /// candle uses from this thread (no host wait). Errors: the event cannot be created or
    /// recorded (a CUDA driver error).
    pub fn now(device: &Device) -> Result<Mark> {
        let host = Instant::now();
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                let event = d
                    .cuda_stream()
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
                Ok(Mark {
                    host,
                    event: Some(Arc::new(event)),
                })
            }
            _ => Ok(Mark::host_only(host)),
        }
    }

    fn host_only(host: Instant) -> Mark {
        Mark {
            host,
            #[cfg(feature = "cuda")]
            event: None,
        }
    }

    /// True when this mark carries a device event.
    pub fn is_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.event.is_some()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }
}

/// The interval between two marks.
#[derive(Debug, Clone)]
pub struct Span {
    start: Mark,
    end: Mark,
}

impl Span {
    /// The span from `start` to `end` (marks taken in that order on one device).
    pub fn new(start: Mark, end: Mark) -> Span {
        Span { start, end }
    }

    /// Wall time the host spent between the two marks (on CUDA: time to enqueue the work).
    pub fn host(&self) -> Duration {
        self.end.host.saturating_duration_since(self.start.host)
    }

    /// True when [`Span::resolve`] measures device time (both marks carry events).
    pub fn is_device(&self) -> bool {
        self.start.is_device() && self.end.is_device()
    }

    /// The span's duration: CUDA-event time when both marks carry events (waits until the end
    /// event has completed), otherwise the host wall time.
    /// Errors: a CUDA driver error while reading the events.
    pub fn resolve(&self) -> Result<Duration> {
        #[cfg(feature = "cuda")]
        if let (Some(a), Some(b)) = (&self.start.event, &self.end.event) {
            let ms = a.elapsed_ms(b)?;
            return Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3));
        }
        Ok(self.host())
    }
}

/// The three engine phases of one [`crate::Engine::step`] call, as spans.
#[derive(Debug, Clone)]
pub struct StepSpans {
    /// The forward closure, including the loss.
    pub forward: Span,
    /// Loss scaling and backpropagation.
    pub backward: Span,
    /// Accumulation and, at an accumulation boundary, the optimizer step.
    pub optimizer: Span,
}

impl StepSpans {
    /// Spans from four marks taken before the forward, after it, after backward and after
    /// the optimizer phase.
    pub fn from_marks(m: [Mark; 4]) -> StepSpans {
        let [a, b, c, d] = m;
        StepSpans {
            forward: Span::new(a, b.clone()),
            backward: Span::new(b, c.clone()),
            optimizer: Span::new(c, d),
        }
    }

    /// Host (enqueue) times of the three phases; data and h2d are zero.
    pub fn host(&self) -> PhaseTimes {
        PhaseTimes {
            forward: self.forward.host(),
            backward: self.backward.host(),
            optimizer: self.optimizer.host(),
            ..PhaseTimes::default()
        }
    }

    /// Device times of the three phases where measured with events (waits for the step's last
    /// event), else host times; data and h2d are zero.
    /// Errors: a CUDA driver error while reading the events.
    pub fn resolve(&self) -> Result<PhaseTimes> {
        Ok(PhaseTimes {
            forward: self.forward.resolve()?,
            backward: self.backward.resolve()?,
            optimizer: self.optimizer.resolve()?,
            ..PhaseTimes::default()
        })
    }
}

/// Spans queued during a run and resolved together: the trainer pushes every step's spans and
/// drains them where it synchronises anyway (a log row), so reading the events never adds a
/// wait to the hot path.
#[derive(Debug, Default)]
pub struct PendingPhases {
    steps: Vec<(Option<Span>, StepSpans)>,
}

impl PendingPhases {
    /// Queues one step's spans and its batch's host-to-device span (if any).
    pub fn push(&mut self, h2d: Option<Span>, spans: StepSpans) {
        self.steps.push((h2d, spans));
    }

    /// Number of queued steps.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    /// No queued steps.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// Resolves and removes every queued step, returning the summed forward, backward,
    /// optimizer and h2d times (data is zero: the caller times it on the host).
    /// Errors: a CUDA driver error while reading the events.
    pub fn drain(&mut self) -> Result<PhaseTimes> {
        let mut sum = PhaseTimes::default();
        for (h2d, s) in self.steps.drain(..) {
            let mut t = s.resolve()?;
            if let Some(h) = h2d {
                t.h2d = h.resolve()?;
            }
            sum.add(&t);
        }
        Ok(sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_spans_resolve_to_host_time() -> Result<()> {
        let a = Mark::now(&Device::Cpu)?;
        std::thread::sleep(Duration::from_millis(5));
        let b = Mark::now(&Device::Cpu)?;
        let s = Span::new(a, b);
        assert!(!s.is_device());
        assert!(s.host() >= Duration::from_millis(5));
        assert_eq!(s.resolve()?, s.host());
        Ok(())
    }
    #[test]
    fn pending_phases_sum_the_queued_steps() -> Result<()> {
        let m = || Mark::now(&Device::Cpu);
        let mut p = PendingPhases::default();
        let mut want = PhaseTimes::default();
        for _ in 0..3 {
            let marks = [m()?, m()?, m()?, m()?];
            let h2d = Span::new(m()?, m()?);
            let s = StepSpans::from_marks(marks);
            let mut t = s.host();
            t.h2d = h2d.host();
            want.add(&t);
            p.push(Some(h2d), s);
        }
        assert_eq!(p.len(), 3);
        assert_eq!(p.drain()?, want);
        assert!(p.is_empty());
        Ok(())
    }
}
