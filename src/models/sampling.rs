//! Token sampling for the models' `generate`: argument checks and one draw from
//! `softmax(logits / temperature)`.

use candle_core::{bail, Result};
use rand::{rngs::StdRng, Rng};

/// Checks `generate`'s arguments for model `who`: a non-empty prompt of ids below `vocab`
/// and a temperature that is finite and `>= 0`.
pub(crate) fn check_generation(
    who: &str,
    prompt: &[u32],
    vocab: usize,
    temperature: f64,
) -> Result<()> {
    if prompt.is_empty() {
        bail!("{who}::generate: the prompt is empty; give at least one token");
    }
    if let Some(bad) = prompt.iter().find(|&&id| id as usize >= vocab) {
        bail!("{who}::generate: prompt id {bad} is outside the vocabulary of {vocab}");
    }
    if !(temperature.is_finite() && temperature >= 0.0) {
        bail!("{who}::generate: temperature must be finite and >= 0, got {temperature}");
    }
    Ok(())
}

/// Draws an index from `softmax(logits / temperature)` (greedy when `temperature == 0`).
pub(crate) fn sample(logits: &[f32], temperature: f64, rng: &mut StdRng) -> Result<u32> {
    if logits.iter().any(|v| !v.is_finite()) {
        bail!("generate: the model produced non-finite logits");
    }
    let argmax = logits
        .iter()
        .enumerate()
        .fold((0usize, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 {
                (i, v)
            } else {
                best
            }
        });
    if temperature == 0.0 {
        return Ok(argmax.0 as u32);
    }
    let max = argmax.1 as f64;
    let weights: Vec<f64> = logits
        .iter()
        .map(|&v| ((v as f64 - max) / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.random::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return Ok(i as u32);
        }
        u -= w;
    }
    Ok(argmax.0 as u32) // rounding at the end of the cumulative sum
}
