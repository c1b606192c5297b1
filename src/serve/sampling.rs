//! Per-request sampling for the scheduler: temperature and nucleus (top-p) sampling with a
//! generator of the request's own (so a request's draws depend on its seed and its logits
//! only, never on its batch neighbours), and stop strings held back from a stream until
//! they can no longer start one (OpenAI's `stop`).

use anyhow::{bail, Result};

/// How one request draws its tokens and when it stops.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Most new tokens (>= 1).
    pub max_tokens: usize,
    /// Softmax temperature, finite and >= 0; 0 is greedy (argmax).
    pub temperature: f64,
    /// Nucleus sampling (Holtzman et al. 2020): draw among the most probable tokens whose
    /// probabilities add up to at least `top_p`, in `(0, 1]`; 1 keeps every token.
    pub top_p: f64,
    /// Seed of the request's generator.
    pub seed: u64,
    /// Strings that end the answer (not included in it); at most 4, each non-empty.
    pub stop: Vec<String>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            stop: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Checks the fields (the message names the field and its range).
    ///
    /// Errors: `max_tokens` 0; a temperature negative or not finite; `top_p` outside
    /// `(0, 1]`; more than 4 stop strings or an empty one.
    pub fn validate(&self) -> Result<()> {
        if self.max_tokens == 0 {
            bail!("max_tokens must be >= 1");
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            bail!(
                "temperature {} must be finite and >= 0 (0: greedy)",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top_p {} must be in (0, 1]", self.top_p);
        }
        if self.stop.len() > 4 || self.stop.iter().any(String::is_empty) {
            bail!("stop takes at most 4 strings, each non-empty");
        }
        Ok(())
    }
}

pub use crate::models::sampling::sample;

/// Where a stream of generated text may be cut: `Stop(i)` when a stop string starts at byte
/// `i` (the answer is `text[..i]`), else `Hold(j)`: `text[..j]` can be sent, the rest could
/// still become a stop string (or is an unfinished UTF-8 character, decoded as U+FFFD).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// A stop string starts here.
    Stop(usize),
    /// Safe to send up to here.
    Hold(usize),
}

/// [`Cut`] of `text` against `stop`.
pub fn cut(text: &str, stop: &[String]) -> Cut {
    if let Some(i) = stop.iter().filter_map(|s| text.find(s.as_str())).min() {
        return Cut::Stop(i);
    }
    let mut safe = text.trim_end_matches('\u{FFFD}').len();
    for s in stop {
        // the longest proper prefix of s that ends the text
        for (k, _) in s.char_indices().skip(1) {
            if text.ends_with(&s[..k]) {
                safe = safe.min(text.len() - k);
            }
        }
    }
    Cut::Hold(safe)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, SeedableRng};

    #[test]
    fn top_p_keeps_the_nucleus_and_greedy_takes_the_first_maximum() {
        let logits = [0.0f32, 3.0, 3.0, 1.0];
        let mut rng = StdRng::seed_from_u64(1);
        assert_eq!(sample(&logits, 0.0, 1.0, &mut rng).unwrap(), 1);
        // p = softmax = (0.023, 0.458, 0.458, 0.062): top_p 0.45 keeps id 1 (the lower of
        // the tie) alone
        for _ in 0..50 {
            assert_eq!(sample(&logits, 1.0, 0.45, &mut rng).unwrap(), 1);
        }
        // top_p 0.9 keeps ids 1 and 2 (mass 0.915), top_p 0.95 adds id 3 (0.977), never id 0
        let seen: std::collections::BTreeSet<u32> = (0..400)
            .map(|_| sample(&logits, 1.0, 0.9, &mut rng).unwrap())
            .collect();
        assert_eq!(seen, [1, 2].into());
        let seen: std::collections::BTreeSet<u32> = (0..400)
            .map(|_| sample(&logits, 1.0, 0.95, &mut rng).unwrap())
            .collect();
        assert_eq!(seen, [1, 2, 3].into());
        assert!(sample(&[f32::NAN], 1.0, 1.0, &mut rng).is_err());
    }

    #[test]
    fn stop_strings_cut_and_hold_back_their_prefixes() {
        let stop = vec!["\n\n".to_string(), "END".to_string()];
        assert_eq!(cut("hello", &stop), Cut::Hold(5));
        assert_eq!(cut("hello\n", &stop), Cut::Hold(5));
        assert_eq!(cut("hello EN", &stop), Cut::Hold(6));
        assert_eq!(cut("hello END more", &stop), Cut::Stop(6));
        assert_eq!(cut("a\n\nb END", &stop), Cut::Stop(1));
        assert_eq!(cut("caf\u{FFFD}", &[]), Cut::Hold(3));
    }
}
