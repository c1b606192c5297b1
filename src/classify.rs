//! Classification scores: accuracy and macro-F1 from predicted and true class indices, as
//! scikit-learn's `accuracy_score` and `f1_score(labels=range(classes), average="macro",
//! zero_division=0)` compute them: every one of the `classes` counts in the mean, and a class
//! with no true and no predicted examples scores F1 = 0. (Without `labels`, sklearn averages
//! over the classes present in either list only.)

use anyhow::{bail, Result};

/// Scores of one evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassificationReport {
    /// Fraction of examples predicted right.
    pub accuracy: f64,
    /// Unweighted mean of the per-class F1 scores.
    pub macro_f1: f64,
    /// F1 of each class, `2 tp / (2 tp + fp + fn)` (0 when the denominator is 0).
    pub f1: Vec<f64>,
    /// `confusion[true][predicted]` counts.
    pub confusion: Vec<Vec<usize>>,
}

impl ClassificationReport {
    /// Scores `predicted` against `truth` over `classes` classes.
    ///
    /// Errors: lengths that differ, no examples, or an index `>= classes`.
    pub fn new(predicted: &[u32], truth: &[u32], classes: usize) -> Result<Self> {
        if predicted.len() != truth.len() || truth.is_empty() {
            bail!(
                "ClassificationReport: {} predictions for {} labels (need the same, non-zero number)",
                predicted.len(),
                truth.len()
            );
        }
        let mut confusion = vec![vec![0usize; classes]; classes];
        for (&p, &t) in predicted.iter().zip(truth) {
            if p as usize >= classes || t as usize >= classes {
                bail!(
                    "ClassificationReport: class index {} or {} is >= {classes}",
                    p,
                    t
                );
            }
            confusion[t as usize][p as usize] += 1;
        }
        let f1: Vec<f64> = (0..classes)
            .map(|c| {
                let tp = confusion[c][c];
                let fp: usize = (0..classes).map(|t| confusion[t][c]).sum::<usize>() - tp;
                let fneg: usize = confusion[c].iter().sum::<usize>() - tp;
                let den = 2 * tp + fp + fneg;
                if den == 0 {
                    0.0
                } else {
                    2.0 * tp as f64 / den as f64
                }
            })
            .collect();
        let correct: usize = (0..classes).map(|c| confusion[c][c]).sum();
        Ok(Self {
            accuracy: correct as f64 / truth.len() as f64,
            macro_f1: f1.iter().sum::<f64>() / classes.max(1) as f64,
            f1,
            confusion,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_sklearn_on_a_small_case() {
        // sklearn 1.5: f1_score([0,0,1,1,2], [0,1,1,1,0], average=None) = [0.5, 0.8, 0.0]
        let r = ClassificationReport::new(&[0, 1, 1, 1, 0], &[0, 0, 1, 1, 2], 3).unwrap();
        assert!((r.accuracy - 0.6).abs() < 1e-12);
        let want = [0.5, 0.8, 0.0];
        for (g, w) in r.f1.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{:?}", r.f1);
        }
        assert!((r.macro_f1 - 1.3 / 3.0).abs() < 1e-12);
        assert!(ClassificationReport::new(&[3], &[0], 3).is_err());
    }
}
