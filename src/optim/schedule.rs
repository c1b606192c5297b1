//! Learning-rate schedules, as a function of the optimizer step (0-based, counting applied
//! steps only).

/// A learning-rate schedule.
#[derive(Debug, Clone, PartialEq)]
pub enum LrSchedule {
    /// `lr` at every step.
    Constant { lr: f64 },
    /// Linear warmup from 0 to `lr` over `warmup` steps (step `s < warmup` gets
    /// `lr * (s + 1) / warmup`), then cosine decay to `min_lr` at `total` steps, constant after
    /// (nanoGPT's `get_lr`).
    WarmupCosine {
        lr: f64,
        min_lr: f64,
        warmup: u64,
        total: u64,
    },
}

impl LrSchedule {
    /// Learning rate for optimizer step `step`.
    pub fn lr(&self, step: u64) -> f64 {
        match *self {
            LrSchedule::Constant { lr } => lr,
            LrSchedule::WarmupCosine {
                lr,
                min_lr,
                warmup,
                total,
            } => {
                if step < warmup {
                    return lr * (step + 1) as f64 / warmup as f64;
                }
                if step >= total || total <= warmup {
                    return min_lr;
                }
                let progress = (step - warmup) as f64 / (total - warmup) as f64;
                min_lr + 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()) * (lr - min_lr)
            }
        }
    }

    /// Checks the parameters (finite, non-negative rates, `min_lr <= lr`).
    pub fn validate(&self) -> anyhow::Result<()> {
        let (lr, min_lr) = match *self {
            LrSchedule::Constant { lr } => (lr, 0.0),
            LrSchedule::WarmupCosine { lr, min_lr, .. } => (lr, min_lr),
        };
        anyhow::ensure!(
            lr.is_finite() && lr >= 0.0,
            "learning rate must be finite and >= 0, got {lr}"
        );
        anyhow::ensure!(
            min_lr >= 0.0 && min_lr <= lr,
            "min_lr must be in [0, lr], got {min_lr}"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_cosine_closed_form() {
        let s = LrSchedule::WarmupCosine {
            lr: 1.0,
            min_lr: 0.1,
            warmup: 10,
            total: 110,
        };
        assert!((s.lr(0) - 0.1).abs() < 1e-12);
        assert!((s.lr(9) - 1.0).abs() < 1e-12);
        assert!((s.lr(10) - 1.0).abs() < 1e-12);
        assert!((s.lr(60) - 0.55).abs() < 1e-12);
        assert!((s.lr(110) - 0.1).abs() < 1e-12);
    }
}
