//! Per-phase step timing: data, host-to-device, forward, backward, optimizer. On the CPU the
//! phases are timed with wall clocks around each phase.

use std::fmt::Write as _;
use std::time::Duration;

/// Time spent in each phase of one step (or summed over steps).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTimes {
    /// Producing the batch on the host (measured by the caller; see [`crate::Engine::step`]).
    pub data: Duration,
    /// Copying the batch to the device (measured by the caller).
    pub h2d: Duration,
    /// The user's forward closure, including the loss.
    pub forward: Duration,
    /// Scaling the loss and backpropagating.
    pub backward: Duration,
    /// Accumulation, unscale/inf check/norm, clipping, the update, working-copy refresh and
    /// the scaler update.
    pub optimizer: Duration,
}

impl PhaseTimes {
    /// The phases in display order, with their names.
    pub fn phases(&self) -> [(&'static str, Duration); 5] {
        [
            ("data", self.data),
            ("host-to-device", self.h2d),
            ("forward", self.forward),
            ("backward", self.backward),
            ("optimizer", self.optimizer),
        ]
    }

    /// Sum of all phases.
    pub fn total(&self) -> Duration {
        self.phases().iter().map(|(_, d)| *d).sum()
    }

    /// Adds another step's times.
    pub fn add(&mut self, o: &PhaseTimes) {
        self.data += o.data;
        self.h2d += o.h2d;
        self.forward += o.forward;
        self.backward += o.backward;
        self.optimizer += o.optimizer;
    }

    /// A table of the phases over `steps` steps: mean ms per step and % of the total.
    pub fn table(&self, steps: u64) -> String {
        let total = self.total().as_secs_f64().max(1e-12);
        let steps = steps.max(1) as f64;
        let mut s = format!("{:<16}{:>12}{:>8}\n", "phase", "ms/step", "%");
        for (name, d) in self.phases() {
            let _ = writeln!(
                s,
                "{name:<16}{:>12.3}{:>7.1}%",
                d.as_secs_f64() * 1e3 / steps,
                100.0 * d.as_secs_f64() / total
            );
        }
        let _ = writeln!(
            s,
            "{:<16}{:>12.3}{:>7.1}%",
            "step",
            total * 1e3 / steps,
            100.0
        );
        s
    }
}
