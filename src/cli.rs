//! Value parsers for command-line flags, shared by the `wick` binary and the examples, and their
//! logging setup ([`init_logging`]).
//!
//! Each parser takes the flag's text and returns the value or a message saying what range the
//! flag accepts; clap prints that message after the flag's own name (`error: invalid value '-1'
//! for '--lr <LR>': must be a finite number > 0`). Numeric flags that use them should also set
//! `allow_negative_numbers = true`, so that `--lr -1` reaches the parser and gets the range
//! error instead of clap's `unexpected argument '-1' found`:
//!
//! ```
//! use clap::Parser;
//! #[derive(Parser)]
//! struct Args {
//!     #[arg(long, allow_negative_numbers = true, value_parser = wick::cli::positive_f64)]
//!     lr: f64,
//!     #[arg(long, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
//!     steps: usize,
//! }
//! let err = Args::try_parse_from(["t", "--lr", "-1", "--steps", "3"]).err().unwrap();
//! assert!(err.to_string().contains("'--lr <LR>'"));
//! assert!(err.to_string().contains("> 0"));
//! let err = Args::try_parse_from(["t", "--lr", "1e-3", "--steps", "0"]).err().unwrap();
//! assert!(err.to_string().contains("'--steps <STEPS>'"));
//! let ok = Args::try_parse_from(["t", "--lr", "1e-3", "--steps", "3"]).unwrap();
//! assert_eq!((ok.lr, ok.steps), (1e-3, 3));
//! ```

/// Shows wick's `tracing` warnings and errors (a checkpoint skipped or loaded in another
/// precision, parameters without gradients, ...) on stderr, without timestamps or targets: the
/// logging of wick's binaries and examples. Call it first in `main`. Does nothing when a global
/// subscriber is already installed.
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(std::io::stderr)
        .without_time()
        .with_target(false)
        .try_init();
}

fn number<T: std::str::FromStr>(s: &str, what: &str) -> Result<T, String> {
    s.trim()
        .parse::<T>()
        .map_err(|_| format!("expected {what}, got {s:?}"))
}

fn float(s: &str) -> Result<f64, String> {
    let v: f64 = number(s, "a number")?;
    if v.is_finite() {
        Ok(v)
    } else {
        Err(format!("must be a finite number, got {s}"))
    }
}

fn integer(s: &str) -> Result<i128, String> {
    number(s, "a whole number")
}

/// An integer ≥ 1 (steps, batch size, context length, capacities).
pub fn positive_usize(s: &str) -> Result<usize, String> {
    let v = integer(s)?;
    if v < 1 {
        return Err(format!("must be a whole number >= 1, got {v}"));
    }
    usize::try_from(v).map_err(|_| format!("{v} is too large"))
}

/// An integer ≥ 0 (counts where 0 means "none": warm-up steps, workers, saved checkpoints).
pub fn non_negative_usize(s: &str) -> Result<usize, String> {
    let v = integer(s)?;
    if v < 0 {
        return Err(format!("must be a whole number >= 0, got {v}"));
    }
    usize::try_from(v).map_err(|_| format!("{v} is too large"))
}

/// A finite number > 0 (learning rates, clipping norms, scales).
pub fn positive_f64(s: &str) -> Result<f64, String> {
    let v = float(s)?;
    if v > 0.0 {
        Ok(v)
    } else {
        Err(format!("must be a finite number > 0, got {v}"))
    }
}

/// A finite number ≥ 0 (weight decay, temperature where 0 means greedy).
pub fn non_negative_f64(s: &str) -> Result<f64, String> {
    let v = float(s)?;
    if v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("must be a finite number >= 0, got {v}"))
    }
}

/// A probability in [0, 1) (dropout).
pub fn dropout(s: &str) -> Result<f64, String> {
    let v = float(s)?;
    if (0.0..1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("must be in [0, 1), got {v}"))
    }
}

/// A fraction in (0, 1] (top-p, a share of a resource).
pub fn fraction(s: &str) -> Result<f64, String> {
    let v = float(s)?;
    if v > 0.0 && v <= 1.0 {
        Ok(v)
    } else {
        Err(format!("must be in (0, 1], got {v}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_accept_their_bounds_and_refuse_outside() {
        assert_eq!(positive_usize("1"), Ok(1));
        assert!(positive_usize("0").unwrap_err().contains(">= 1, got 0"));
        assert!(positive_usize("-1").unwrap_err().contains(">= 1, got -1"));
        assert!(positive_usize("1.5").unwrap_err().contains("whole number"));
        assert_eq!(non_negative_usize("0"), Ok(0));
        assert!(non_negative_usize("-2")
            .unwrap_err()
            .contains(">= 0, got -2"));
        assert_eq!(positive_f64("2.5e-4"), Ok(2.5e-4));
        assert!(positive_f64("0").is_err());
        assert!(positive_f64("inf").unwrap_err().contains("finite"));
        assert!(positive_f64("NaN").unwrap_err().contains("finite"));
        assert_eq!(non_negative_f64("0"), Ok(0.0));
        assert!(non_negative_f64("-1").unwrap_err().contains(">= 0, got -1"));
        assert_eq!(dropout("0"), Ok(0.0));
        assert!(dropout("1").is_err());
        assert_eq!(fraction("1"), Ok(1.0));
        assert!(fraction("0").is_err());
        assert!(fraction("1.01").is_err());
    }
}
