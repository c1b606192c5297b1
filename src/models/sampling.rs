//! Token sampling for the models' `generate` and the service's scheduler: argument checks and
//! one draw from `softmax(logits / temperature)`, optionally restricted by top-p.

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

/// Draws a token id from `logits` (one row, f32): argmax at temperature 0 (the first of
/// equal maxima), else from `softmax(logits / temperature)` restricted to the smallest set
/// of most probable tokens whose mass reaches `top_p` (ties in probability broken by the
/// lower id). One uniform draw from `rng` per sampled token.
///
/// Errors: non-finite logits; an empty row.
pub fn sample(logits: &[f32], temperature: f64, top_p: f64, rng: &mut StdRng) -> Result<u32> {
    if logits.is_empty() {
        bail!("sample: the logits row is empty");
    }
    if logits.iter().any(|v| !v.is_finite()) {
        bail!("sample: the model produced non-finite logits");
    }
    let (argmax, max) =
        logits
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
        return Ok(argmax as u32);
    }
    let mut weighted: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &v)| (i as u32, ((v as f64 - max as f64) / temperature).exp()))
        .collect();
    let total: f64 = weighted.iter().map(|w| w.1).sum();
    if top_p < 1.0 {
        weighted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let (mut mass, mut keep) = (0.0, 0);
        for (_, w) in &weighted {
            mass += w / total;
            keep += 1;
            if mass >= top_p {
                break;
            }
        }
        weighted.truncate(keep);
    }
    let kept: f64 = weighted.iter().map(|w| w.1).sum();
    let mut u = rng.random::<f64>() * kept;
    for (id, w) in &weighted {
        if u < *w {
            return Ok(*id);
        }
        u -= w;
    }
    Ok(weighted.last().map_or(argmax as u32, |w| w.0)) // rounding at the end of the sum
}
