//! Throughput figures with their basis, one convention for every report wick prints.
//!
//! A throughput is the number of items trained on (tokens: sequences × tokens per sequence,
//! padding not counted; or samples, for models without tokens) divided by the wall-clock
//! seconds of the steps that trained them. What those seconds exclude (warm-up steps,
//! evaluation, checkpoint saves) is named beside the figure, so that two numbers are only
//! compared on the same basis:
//!
//! ```
//! use wick::throughput::{Throughput, Unit};
//! let t = Throughput {
//!     items: 3 * 16 * 1024,
//!     unit: Unit::Tokens,
//!     secs: 0.5,
//!     steps: (4, 6),
//!     excluded: "warm-up",
//! };
//! assert_eq!(t.per_s(), 98304.0);
//! assert_eq!(t.to_string(), "98304 tokens/s (trained tokens / wall-clock s of steps 4-6; warm-up excluded)");
//! assert_eq!(t.json()["tokens_per_s"], 98304.0);
//! ```

use std::fmt;

/// What a throughput counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Trained tokens (sequences × tokens per sequence, padding not counted).
    Tokens,
    /// Trained samples (images, rows: models without tokens).
    Samples,
}

impl Unit {
    /// `"tokens"` or `"samples"`.
    pub fn name(self) -> &'static str {
        match self {
            Unit::Tokens => "tokens",
            Unit::Samples => "samples",
        }
    }
}

/// Items trained on over the wall-clock seconds of the steps that trained them.
#[derive(Debug, Clone, PartialEq)]
pub struct Throughput {
    /// Items trained on in the timed steps.
    pub items: u64,
    /// What an item is.
    pub unit: Unit,
    /// Wall-clock seconds of the timed steps (what [`Throughput::excluded`] names left out).
    pub secs: f64,
    /// The first and last timed step, 1-based and inclusive.
    pub steps: (u64, u64),
    /// What the seconds leave out, e.g. `"warm-up, evaluation and checkpoint saves"`; empty
    /// when nothing is.
    pub excluded: &'static str,
}

impl Throughput {
    /// Items per second; 0 when no time was measured.
    pub fn per_s(&self) -> f64 {
        if self.secs > 0.0 {
            self.items as f64 / self.secs
        } else {
            0.0
        }
    }

    /// How [`Throughput::per_s`] is computed, e.g. `trained tokens / wall-clock s of steps 4-103;
    /// warm-up excluded`: print it beside the figure.
    pub fn basis(&self) -> String {
        let (first, last) = self.steps;
        let mut s = format!(
            "trained {} / wall-clock s of steps {first}-{last}",
            self.unit.name()
        );
        if !self.excluded.is_empty() {
            s.push_str(&format!("; {} excluded", self.excluded));
        }
        s
    }

    /// `{"tokens_per_s": ..., "tokens_per_s_basis": "..."}` (or `samples_per_s`), the keys of
    /// wick's JSON result lines.
    pub fn json(&self) -> serde_json::Value {
        let key = format!("{}_per_s", self.unit.name());
        let mut m = serde_json::Map::new();
        m.insert(key.clone(), self.per_s().into());
        m.insert(format!("{key}_basis"), self.basis().into());
        serde_json::Value::Object(m)
    }
}

impl fmt::Display for Throughput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.0} {}/s ({})",
            self.per_s(),
            self.unit.name(),
            self.basis()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_without_exclusions_and_no_time() {
        let t = Throughput {
            items: 512 * 20,
            unit: Unit::Samples,
            secs: 2.0,
            steps: (1, 20),
            excluded: "",
        };
        assert_eq!(t.per_s(), 5120.0);
        assert_eq!(
            t.to_string(),
            "5120 samples/s (trained samples / wall-clock s of steps 1-20)"
        );
        assert_eq!(t.json()["samples_per_s_basis"], t.basis().as_str());
        assert_eq!(Throughput { secs: 0.0, ..t }.per_s(), 0.0);
    }
}
