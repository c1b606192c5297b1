//! Learning-rate schedules, as a function of the optimizer step (0-based; the engine advances
//! it at every accumulation boundary, applied or skipped, as `scheduler.step()` in a PyTorch
//! GradScaler loop). A schedule is plain data: it serialises with serde (checkpoints, TOML
//! configs) and parses from a short spec (CLI flags), see [`LrSchedule::parse`].
//!
//! | spec                                              | variant                         |
//! |---------------------------------------------------|---------------------------------|
//! | `constant`                                        | [`LrSchedule::Constant`]        |
//! | `cosine:warmup=100,total=2000,min_lr=1e-4`        | [`LrSchedule::WarmupCosine`]    |
//! | `step:size=1000,gamma=0.5`                        | [`LrSchedule::StepDecay`]       |
//! | `linear:warmup=100,total=2000,end_lr=0`           | [`LrSchedule::LinearDecay`]     |

use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

/// A learning-rate schedule.
///
/// Serialised internally tagged: `{"kind": "warmup_cosine", "lr": 3e-4, "min_lr": 3e-5,
/// "warmup": 100, "total": 2000}` (in TOML: `kind = "step_decay"` and the fields).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LrSchedule {
    /// `lr` at every step.
    Constant {
        /// The learning rate.
        lr: f64,
    },
    /// Linear warmup from 0 to `lr` over `warmup` steps (step `s < warmup` gets
    /// `lr * (s + 1) / warmup`), then cosine decay to `min_lr` at `total` steps, constant after
    /// (nanoGPT's `get_lr`):
    /// ```text
    /// s <  warmup:          lr * (s + 1) / warmup
    /// warmup <= s < total:  min_lr + (lr - min_lr) * (1 + cos(pi * (s - warmup) / (total - warmup))) / 2
    /// s >= total:           min_lr
    /// ```
    WarmupCosine {
        /// Peak learning rate (reached at the end of the warmup).
        lr: f64,
        /// Learning rate at and after `total`.
        min_lr: f64,
        /// Warmup steps.
        warmup: u64,
        /// Step at which the cosine reaches `min_lr`.
        total: u64,
    },
    /// Step decay (`torch.optim.lr_scheduler.StepLR`): `lr * gamma^floor(s / step_size)`.
    StepDecay {
        /// Initial learning rate.
        lr: f64,
        /// Steps between decays.
        step_size: u64,
        /// Multiplier at each decay.
        gamma: f64,
    },
    /// Linear warmup (as [`LrSchedule::WarmupCosine`]), then linear decay to `end_lr` at
    /// `total` steps, constant after:
    /// ```text
    /// s <  warmup:          lr * (s + 1) / warmup
    /// warmup <= s < total:  lr + (end_lr - lr) * (s - warmup) / (total - warmup)
    /// s >= total:           end_lr
    /// ```
    LinearDecay {
        /// Peak learning rate (reached at the end of the warmup).
        lr: f64,
        /// Learning rate at and after `total`.
        end_lr: f64,
        /// Warmup steps.
        warmup: u64,
        /// Step at which the decay reaches `end_lr`.
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
            LrSchedule::StepDecay {
                lr,
                step_size,
                gamma,
            } => {
                let k = step / step_size.max(1);
                lr * gamma.powi(k.min(i32::MAX as u64) as i32)
            }
            LrSchedule::LinearDecay {
                lr,
                end_lr,
                warmup,
                total,
            } => {
                if step < warmup {
                    return lr * (step + 1) as f64 / warmup as f64;
                }
                if step >= total || total <= warmup {
                    return end_lr;
                }
                let progress = (step - warmup) as f64 / (total - warmup) as f64;
                lr + (end_lr - lr) * progress
            }
        }
    }

    /// The base (peak) learning rate.
    pub fn base_lr(&self) -> f64 {
        match *self {
            LrSchedule::Constant { lr }
            | LrSchedule::WarmupCosine { lr, .. }
            | LrSchedule::StepDecay { lr, .. }
            | LrSchedule::LinearDecay { lr, .. } => lr,
        }
    }

    /// Checks the parameters: finite, non-negative rates; the floor (`min_lr`, `end_lr`) in
    /// `[0, lr]`; `warmup <= total`; `step_size >= 1` and `gamma` finite and `> 0`.
    pub fn validate(&self) -> Result<()> {
        let lr = self.base_lr();
        anyhow::ensure!(
            lr.is_finite() && lr >= 0.0,
            "learning rate must be finite and >= 0, got {lr}"
        );
        match *self {
            LrSchedule::Constant { .. } => {}
            LrSchedule::WarmupCosine {
                min_lr: floor,
                warmup,
                total,
                ..
            }
            | LrSchedule::LinearDecay {
                end_lr: floor,
                warmup,
                total,
                ..
            } => {
                let name = if matches!(self, LrSchedule::WarmupCosine { .. }) {
                    "min_lr"
                } else {
                    "end_lr"
                };
                anyhow::ensure!(
                    floor >= 0.0 && floor <= lr,
                    "{name} must be in [0, lr = {lr}], got {floor}"
                );
                anyhow::ensure!(
                    warmup <= total,
                    "warmup ({warmup} steps) must not exceed total ({total} steps)"
                );
            }
            LrSchedule::StepDecay {
                step_size, gamma, ..
            } => {
                anyhow::ensure!(step_size >= 1, "step decay: size must be >= 1 step");
                anyhow::ensure!(
                    gamma.is_finite() && gamma > 0.0,
                    "step decay: gamma must be finite and > 0, got {gamma}"
                );
            }
        }
        Ok(())
    }

    /// Parses a schedule spec `name[:key=value,...]` with base learning rate `lr` (a `lr=` key
    /// in the spec overrides it). Names and keys (defaults in brackets):
    /// - `constant`
    /// - `cosine` (or `warmup_cosine`): `total` (required), `warmup` (default 0), `min_lr` (default 0)
    /// - `step` (or `step_decay`): `size` (or `step_size`, required), `gamma` (default 0.1, as StepLR)
    /// - `linear` (or `linear_decay`): `total` (required), `warmup` (default 0), `end_lr` (default 0)
    ///
    /// The result is validated. Errors name the unknown schedule or key, the missing key, or
    /// the value that does not parse, and list what is accepted.
    pub fn parse(spec: &str, lr: f64) -> Result<Self> {
        parse_spec(spec, Some(lr))
    }
}

/// The spec syntax of [`LrSchedule::parse`], with the learning rate as an `lr=` key; parsing
/// the output gives the same schedule back.
impl fmt::Display for LrSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            LrSchedule::Constant { lr } => write!(f, "constant:lr={lr:e}"),
            LrSchedule::WarmupCosine {
                lr,
                min_lr,
                warmup,
                total,
            } => write!(
                f,
                "cosine:lr={lr:e},warmup={warmup},total={total},min_lr={min_lr:e}"
            ),
            LrSchedule::StepDecay {
                lr,
                step_size,
                gamma,
            } => write!(f, "step:lr={lr:e},size={step_size},gamma={gamma}"),
            LrSchedule::LinearDecay {
                lr,
                end_lr,
                warmup,
                total,
            } => write!(
                f,
                "linear:lr={lr:e},warmup={warmup},total={total},end_lr={end_lr:e}"
            ),
        }
    }
}

/// Parses a spec that carries its learning rate: `"cosine:lr=3e-4,warmup=100,total=2000"`.
/// Without `lr=` this is an error; use [`LrSchedule::parse`] to give the base rate separately.
impl FromStr for LrSchedule {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        parse_spec(s, None)
    }
}

const SPEC_HELP: &str = "expected one of: constant | cosine:total=N[,warmup=N,min_lr=X] | \
     step:size=N[,gamma=X] | linear:total=N[,warmup=N,end_lr=X] (each may add lr=X)";

fn parse_spec(spec: &str, lr: Option<f64>) -> Result<LrSchedule> {
    let spec = spec.trim();
    let (name, rest) = spec.split_once(':').unwrap_or((spec, ""));
    let name = name.trim().to_ascii_lowercase();
    let mut keys = BTreeMap::new();
    for item in rest.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let Some((k, v)) = item.split_once('=') else {
            bail!("schedule {spec:?}: {item:?} is not key=value; {SPEC_HELP}");
        };
        let k = k.trim().to_ascii_lowercase();
        if keys.insert(k.clone(), v.trim().to_string()).is_some() {
            bail!("schedule {spec:?}: key {k:?} given twice");
        }
    }
    let mut keys = Keys { spec, keys };
    let lr = match keys.f64("lr")? {
        Some(v) => v,
        None => lr.ok_or_else(|| {
            anyhow::anyhow!(
                "schedule {spec:?} has no lr=...; add one, or use LrSchedule::parse(spec, lr)"
            )
        })?,
    };
    let s = match name.as_str() {
        "constant" | "const" => LrSchedule::Constant { lr },
        "cosine" | "warmup_cosine" => LrSchedule::WarmupCosine {
            lr,
            warmup: keys.u64("warmup")?.unwrap_or(0),
            total: keys.required_u64("total")?,
            min_lr: keys.f64("min_lr")?.unwrap_or(0.0),
        },
        "step" | "step_decay" => {
            let size = match (keys.u64("size")?, keys.u64("step_size")?) {
                (Some(_), Some(_)) => bail!("schedule {spec:?}: give size or step_size, not both"),
                (Some(v), None) | (None, Some(v)) => v,
                (None, None) => bail!("schedule {spec:?}: step decay needs size=N (steps)"),
            };
            LrSchedule::StepDecay {
                lr,
                step_size: size,
                gamma: keys.f64("gamma")?.unwrap_or(0.1),
            }
        }
        "linear" | "linear_decay" => LrSchedule::LinearDecay {
            lr,
            warmup: keys.u64("warmup")?.unwrap_or(0),
            total: keys.required_u64("total")?,
            end_lr: keys.f64("end_lr")?.unwrap_or(0.0),
        },
        other => bail!("unknown schedule {other:?} in {spec:?}; {SPEC_HELP}"),
    };
    if let Some(k) = keys.keys.keys().next() {
        bail!(
            "schedule {spec:?}: unknown key {k:?} for {name}; {SPEC_HELP}",
            name = name
        );
    }
    s.validate()
        .with_context(|| format!("schedule {spec:?} is out of range"))?;
    Ok(s)
}

/// The `key=value` pairs of a spec; each getter removes its key, so what is left is unknown.
struct Keys<'a> {
    spec: &'a str,
    keys: BTreeMap<String, String>,
}

impl Keys<'_> {
    fn f64(&mut self, k: &str) -> Result<Option<f64>> {
        self.keys
            .remove(k)
            .map(|v| {
                v.parse::<f64>().map_err(|_| {
                    anyhow::anyhow!("schedule {:?}: {k}={v:?} is not a number", self.spec)
                })
            })
            .transpose()
    }

    fn u64(&mut self, k: &str) -> Result<Option<u64>> {
        self.keys
            .remove(k)
            .map(|v| {
                v.parse::<u64>().map_err(|_| {
                    anyhow::anyhow!(
                        "schedule {:?}: {k}={v:?} is not a whole number of steps",
                        self.spec
                    )
                })
            })
            .transpose()
    }

    fn required_u64(&mut self, k: &str) -> Result<u64> {
        self.u64(k)?.ok_or_else(|| {
            anyhow::anyhow!("schedule {:?} needs {k}=N (steps); {SPEC_HELP}", self.spec)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    #[test]
    fn constant_closed_form() {
        let s = LrSchedule::Constant { lr: 0.3 };
        for step in [0, 1, 1000, u64::MAX] {
            assert_eq!(s.lr(step), 0.3);
        }
    }

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
        // a quarter of the way: min + (lr - min) * (1 + cos(pi/4)) / 2
        let q = 0.1 + 0.9 * (1.0 + std::f64::consts::FRAC_1_SQRT_2) / 2.0;
        assert!(close(s.lr(35), q));
        assert!((s.lr(110) - 0.1).abs() < 1e-12);
        assert!((s.lr(10_000) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn step_decay_closed_form() {
        // torch StepLR(step_size=3, gamma=0.5): 1, 1, 1, .5, .5, .5, .25, ...
        let s = LrSchedule::StepDecay {
            lr: 1.0,
            step_size: 3,
            gamma: 0.5,
        };
        let want = [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125];
        for (step, w) in want.iter().enumerate() {
            assert_eq!(s.lr(step as u64), *w, "step {step}");
        }
        assert!(close(s.lr(3 * 20), 0.5f64.powi(20)));
        assert!(s.lr(u64::MAX).is_finite());
    }

    #[test]
    fn linear_decay_closed_form() {
        let s = LrSchedule::LinearDecay {
            lr: 1.0,
            end_lr: 0.2,
            warmup: 4,
            total: 104,
        };
        assert!(close(s.lr(0), 0.25));
        assert!(close(s.lr(1), 0.5));
        assert!(close(s.lr(3), 1.0));
        assert!(close(s.lr(4), 1.0));
        assert!(close(s.lr(54), 0.6)); // halfway: (1 + 0.2) / 2
        assert!(close(s.lr(29), 0.8)); // a quarter: 1 - 0.8 / 4
        assert!(close(s.lr(103), 1.0 - 0.8 * 99.0 / 100.0));
        assert!(close(s.lr(104), 0.2));
        assert!(close(s.lr(1_000_000), 0.2));
        // no warmup: starts at lr
        let s = LrSchedule::LinearDecay {
            lr: 2.0,
            end_lr: 0.0,
            warmup: 0,
            total: 10,
        };
        assert!(close(s.lr(0), 2.0));
        assert!(close(s.lr(5), 1.0));
        assert_eq!(s.lr(10), 0.0);
    }

    #[test]
    fn parse_specs() -> Result<()> {
        assert_eq!(
            LrSchedule::parse("constant", 0.1)?,
            LrSchedule::Constant { lr: 0.1 }
        );
        assert_eq!(
            LrSchedule::parse("cosine:warmup=100,total=2000,min_lr=1e-4", 1e-3)?,
            LrSchedule::WarmupCosine {
                lr: 1e-3,
                min_lr: 1e-4,
                warmup: 100,
                total: 2000
            }
        );
        assert_eq!(
            LrSchedule::parse("step:size=1000,gamma=0.5", 0.1)?,
            LrSchedule::StepDecay {
                lr: 0.1,
                step_size: 1000,
                gamma: 0.5
            }
        );
        assert_eq!(
            LrSchedule::parse(" linear: warmup=100, total=2000, end_lr=0 ", 0.1)?,
            LrSchedule::LinearDecay {
                lr: 0.1,
                end_lr: 0.0,
                warmup: 100,
                total: 2000
            }
        );
        // defaults, aliases and an lr override
        assert_eq!(
            LrSchedule::parse("step:step_size=10", 0.1)?,
            LrSchedule::StepDecay {
                lr: 0.1,
                step_size: 10,
                gamma: 0.1
            }
        );
        assert_eq!(
            LrSchedule::parse("warmup_cosine:total=50,lr=0.5", 0.1)?,
            LrSchedule::WarmupCosine {
                lr: 0.5,
                min_lr: 0.0,
                warmup: 0,
                total: 50
            }
        );
        Ok(())
    }

    #[test]
    fn parse_errors_are_clear() {
        let err = |spec: &str| format!("{:#}", LrSchedule::parse(spec, 0.1).unwrap_err());
        assert!(err("exponential:gamma=0.9").contains("unknown schedule \"exponential\""));
        assert!(err("cosine:warmup=10").contains("needs total=N"));
        assert!(err("cosine:total=10,min=0.1").contains("unknown key \"min\""));
        assert!(err("step:size=ten").contains("size=\"ten\" is not a whole number"));
        assert!(err("step:gamma=0.5").contains("needs size=N"));
        assert!(err("step:size=0").contains("size must be >= 1"));
        assert!(err("linear:total=10,end_lr=abc").contains("end_lr=\"abc\" is not a number"));
        assert!(err("linear:total=10,end_lr=1").contains("end_lr must be in [0, lr"));
        assert!(err("linear:warmup=20,total=10").contains("must not exceed total"));
        assert!(err("cosine:total").contains("is not key=value"));
        assert!(err("cosine:total=1,total=2").contains("given twice"));
        assert!(err("constant:lr=-1").contains("learning rate must be finite and >= 0"));
        let e = "constant".parse::<LrSchedule>().unwrap_err().to_string();
        assert!(e.contains("no lr="), "{e}");
    }

    #[test]
    fn display_and_from_str_round_trip() -> Result<()> {
        for s in [
            LrSchedule::Constant { lr: 3e-4 },
            LrSchedule::WarmupCosine {
                lr: 6e-4,
                min_lr: 6e-5,
                warmup: 700,
                total: 19_073,
            },
            LrSchedule::StepDecay {
                lr: 0.1,
                step_size: 30,
                gamma: 0.1,
            },
            LrSchedule::LinearDecay {
                lr: 1e-3,
                end_lr: 0.0,
                warmup: 10,
                total: 100,
            },
        ] {
            assert_eq!(s.to_string().parse::<LrSchedule>()?, s, "{s}");
            let json = serde_json::to_string(&s)?;
            assert_eq!(serde_json::from_str::<LrSchedule>(&json)?, s, "{json}");
        }
        let json = r#"{"kind":"step_decay","lr":0.1,"step_size":5,"gamma":0.5}"#;
        assert_eq!(
            serde_json::from_str::<LrSchedule>(json)?,
            LrSchedule::StepDecay {
                lr: 0.1,
                step_size: 5,
                gamma: 0.5
            }
        );
        assert!(serde_json::from_str::<LrSchedule>(r#"{"kind":"constant","lr":1,"x":2}"#).is_err());
        Ok(())
    }
}
