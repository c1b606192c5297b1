//! Per-phase step timing: data, host-to-device, forward, backward, optimizer. On the CPU the
//! phases are timed with wall clocks around each phase; on CUDA with events on the compute
//! stream, read back in batches (see [`crate::timing`]).

use crate::throughput::Throughput;
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

/// Peak dense throughput, FLOP/s, by GPU model and compute dtype, from NVIDIA's datasheets
/// (dense, no sparsity; SXM parts). f32 means plain FP32 (no TF32; see [`peak_tf32_flops`]).
/// Returns `None` for a model not in the table.
pub fn peak_flops(gpu_name: &str, dtype: candle_core::DType) -> Option<f64> {
    use candle_core::DType::*;
    let (half, single, _) = peak_row(gpu_name)?;
    match dtype {
        BF16 | F16 => Some(half),
        F32 => Some(single),
        _ => None,
    }
}

/// Peak dense TF32 tensor-core throughput, FLOP/s (f32 work with TF32 allowed), from the same
/// datasheets as [`peak_flops`]; `None` for a model not in the table.
pub fn peak_tf32_flops(gpu_name: &str) -> Option<f64> {
    peak_row(gpu_name).map(|(_, _, tf32)| tf32)
}

/// `(bf16/f16, f32, tf32)` dense peaks of the first table entry whose name fragment is in
/// `gpu_name` (case-insensitive).
fn peak_row(gpu_name: &str) -> Option<(f64, f64, f64)> {
    let name = gpu_name.to_ascii_uppercase();
    const TABLE: [(&str, f64, f64, f64); 7] = [
        ("H200", 989e12, 67e12, 494.7e12),
        ("H100", 989e12, 67e12, 494.7e12),
        ("A100", 312e12, 19.5e12, 156e12),
        ("L40S", 362e12, 91.6e12, 183e12),
        ("L4", 121e12, 30.3e12, 60e12),
        ("A10", 125e12, 31.2e12, 62.5e12),
        ("4090", 165e12, 82.6e12, 82.6e12),
    ];
    let &(_, half, single, tf32) = TABLE.iter().find(|row| name.contains(row.0))?;
    Some((half, single, tf32))
}

/// A run's figures for the end-of-run report and bottleneck hints.
#[derive(Debug, Clone, Default)]
pub struct RunProfile {
    /// Summed phase times.
    pub phases: PhaseTimes,
    /// Optimizer steps covered.
    pub steps: u64,
    /// Samples consumed.
    pub samples: u64,
    /// Tokens per sample (for tokens/s and FLOPs), if the task has tokens.
    pub tokens_per_sample: Option<u64>,
    /// Model FLOPs per optimizer step (forward + backward, e.g. 6 × parameters × tokens).
    pub flops_per_step: Option<f64>,
    /// GPU model name (`None` on the CPU).
    pub gpu_name: Option<String>,
    /// GPU compute capability (major, minor).
    pub compute_capability: Option<(u32, u32)>,
    /// Compute dtype of the run.
    pub compute_dtype: Option<candle_core::DType>,
    /// The optimizer runs the fused implementation.
    pub fused_optimizer: bool,
    /// DataLoader worker threads.
    pub num_workers: usize,
    /// Peak device memory in bytes, where the device reports it.
    pub peak_memory: Option<u64>,
    /// Forward, backward, optimizer and host-to-device were timed with CUDA events on the
    /// compute stream (data is always the host's wait for the loader).
    pub device_timed: bool,
    /// Batches reached the GPU through the loader's pinned staging (`with_device`).
    pub staged_h2d: bool,
    /// Trained items over the wall-clock time of the steps (evaluation and hooks excluded),
    /// with its basis: the report's throughput line, and the seconds of its MFU. `None`: both
    /// use the summed phase times instead, and say so.
    pub throughput: Option<Throughput>,
}

/// One bottleneck hint: what was seen and what to change.
#[derive(Debug, Clone, PartialEq)]
pub struct Hint {
    /// The observation, with the figure.
    pub finding: String,
    /// What to do (the setting or flag).
    pub action: String,
}

impl RunProfile {
    fn share(&self, d: Duration) -> f64 {
        d.as_secs_f64() / self.phases.total().as_secs_f64().max(1e-12)
    }

    /// The seconds throughput and MFU are computed over: [`RunProfile::throughput`]'s wall
    /// clock, else the summed phase time.
    fn secs(&self) -> f64 {
        match &self.throughput {
            Some(t) => t.secs,
            None => self.phases.total().as_secs_f64(),
        }
    }

    /// Model FLOP utilisation: achieved model FLOP/s over the GPU's peak for the compute dtype
    /// (PaLM, Chowdhery et al. 2022, appendix B), over the same seconds as the throughput
    /// ([`RunProfile::throughput`]'s wall clock; the summed phase time without it). `None`
    /// without FLOPs, GPU or table entry.
    pub fn mfu(&self) -> Option<f64> {
        let peak = peak_flops(self.gpu_name.as_deref()?, self.compute_dtype?)?;
        let secs = self.secs();
        let flops = self.flops_per_step?;
        (secs > 0.0).then(|| flops * self.steps as f64 / secs / peak)
    }

    /// Hints for the largest bottlenecks, in order of importance.
    pub fn hints(&self) -> Vec<Hint> {
        let mut h = Vec::new();
        let data = self.share(self.phases.data);
        if data > 0.15 {
            h.push(Hint {
                finding: format!("data loading takes {:.0}% of the step", 100.0 * data),
                action: format!(
                    "raise LoaderConfig::with_workers (now {}; --workers in the examples) and keep prefetch_factor >= 2{}",
                    self.num_workers,
                    if self.gpu_name.is_some() && !self.staged_h2d {
                        "; pass with_device so batches are staged in pinned memory"
                    } else {
                        ""
                    }
                ),
            });
        }
        let h2d = self.share(self.phases.h2d);
        if h2d > 0.10 {
            h.push(Hint {
                finding: format!("host-to-device copies take {:.0}% of the step", 100.0 * h2d),
                action: "let the DataLoader copy batches (LoaderConfig::with_device): pinned staging overlaps the copy with compute".into(),
            });
        }
        let opt = self.share(self.phases.optimizer);
        if opt > 0.20 && !self.fused_optimizer {
            h.push(Hint {
                finding: format!(
                    "the optimizer takes {:.0}% of the step on the unfused path",
                    100.0 * opt
                ),
                action: "use the fused implementation: EngineConfig { path: OptimPath::Fused, .. }"
                    .into(),
            });
        }
        if let (Some((major, _)), Some(dt)) = (self.compute_capability, self.compute_dtype) {
            if major >= 8 && dt == candle_core::DType::F32 {
                h.push(Hint {
                    finding: format!("training in f32 on a compute capability {major}.x GPU, which has bf16 tensor cores"),
                    action: "use --precision bf16-mixed (Precision::Bf16Mixed): fp32 master weights, no loss scaling needed".into(),
                });
            }
        }
        if self.gpu_name.is_some() && self.steps > 0 {
            let ms = self.phases.total().as_secs_f64() * 1e3 / self.steps as f64;
            if ms < 5.0 {
                h.push(Hint {
                    finding: format!("steps take {ms:.2} ms: too little work per step to keep the GPU busy"),
                    action: "raise the batch size, or keep it and accumulate fewer, larger micro-batches".into(),
                });
            }
        }
        h
    }

    /// The end-of-run report: phase table, throughput, MFU, peak memory and hints.
    pub fn report(&self) -> String {
        let mut s = self.phases.table(self.steps);
        let _ = writeln!(
            s,
            "timing: {}",
            if self.device_timed {
                "CUDA events on the compute stream (data: host wait for the loader)"
            } else {
                "host wall clock"
            }
        );
        let secs = self.secs().max(1e-12);
        let basis = match &self.throughput {
            Some(t) => {
                let _ = write!(s, "throughput: {t}, {secs:.1} s");
                if t.unit == crate::throughput::Unit::Tokens {
                    let _ = write!(s, ", {:.1} samples/s", self.samples as f64 / secs);
                }
                "the throughput's wall clock"
            }
            None => {
                let _ = write!(
                    s,
                    "throughput: {:.0} samples/s (trained samples / summed phase time of {} steps, \
                     {secs:.1} s)",
                    self.samples as f64 / secs,
                    self.steps
                );
                "summed phase time"
            }
        };
        s.push('\n');
        if let Some(m) = self.mfu() {
            let _ = writeln!(s, "MFU: {:.1}% (model FLOPs / {basis})", 100.0 * m);
        }
        if let Some(b) = self.peak_memory {
            let _ = writeln!(
                s,
                "peak device memory: {:.2} GiB",
                b as f64 / (1u64 << 30) as f64
            );
        }
        for hint in self.hints() {
            let _ = writeln!(s, "hint: {} -> {}", hint.finding, hint.action);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn mfu_and_hints_from_hand_made_figures() {
        // 10 steps of 100 ms: 40 data, 0 h2d, 20 fwd, 30 bwd, 10 opt (per step)
        let p = RunProfile {
            phases: PhaseTimes {
                data: ms(400),
                h2d: ms(0),
                forward: ms(200),
                backward: ms(300),
                optimizer: ms(100),
            },
            steps: 10,
            samples: 640,
            flops_per_step: Some(49.45e12),
            gpu_name: Some("NVIDIA H200".into()),
            compute_capability: Some((9, 0)),
            compute_dtype: Some(DType::F32),
            ..Default::default()
        };
        // 49.45 TFLOP per 0.1 s step on a 67 TFLOP/s f32 peak: 494.5 / 67 = 7.38
        assert!((p.mfu().unwrap() - 49.45e12 / 0.1 / 67e12).abs() < 1e-9);
        assert!(p.report().contains("(model FLOPs / summed phase time)"));
        // with a wall clock (2 s for the 10 steps, more than the 1 s of phases), MFU and the
        // throughput line use its seconds
        let walled = RunProfile {
            throughput: Some(Throughput {
                items: 640,
                unit: crate::throughput::Unit::Samples,
                secs: 2.0,
                steps: (1, 10),
                excluded: "evaluation",
            }),
            ..p.clone()
        };
        assert!((walled.mfu().unwrap() - 49.45e12 * 10.0 / 2.0 / 67e12).abs() < 1e-9);
        let report = walled.report();
        assert!(
            report.contains(
                "throughput: 320 samples/s (trained samples / wall-clock s of steps 1-10; \
                 evaluation excluded), 2.0 s\nMFU: 369.0% (model FLOPs / the throughput's wall clock)"
            ),
            "{report}"
        );
        let hints = p.hints();
        assert!(
            hints[0].finding.contains("40%") && hints[0].action.contains("with_workers"),
            "{hints:?}"
        );
        assert!(hints.iter().any(|h| h.action.contains("bf16-mixed")));
        // pinned staging is suggested only when batches did not come through it
        assert!(hints[0].action.contains("with_device"), "{hints:?}");
        let staged = RunProfile {
            staged_h2d: true,
            ..p.clone()
        };
        assert!(!staged.hints()[0].action.contains("with_device"));
        assert!(
            !hints.iter().any(|h| h.action.contains("OptimPath::Fused")),
            "optimizer share is 10%"
        );
        let slow_opt = RunProfile {
            phases: PhaseTimes {
                optimizer: ms(50),
                forward: ms(50),
                ..Default::default()
            },
            steps: 1,
            ..Default::default()
        };
        assert!(slow_opt
            .hints()
            .iter()
            .any(|h| h.action.contains("OptimPath::Fused")));
        let fused = RunProfile {
            fused_optimizer: true,
            ..slow_opt
        };
        assert!(fused.hints().is_empty());
        assert_eq!(
            peak_flops("NVIDIA A100-SXM4-80GB", DType::BF16),
            Some(312e12)
        );
        assert_eq!(peak_flops("Tesla T4", DType::BF16), None);
        // NVIDIA's H100/H200 SXM datasheet: FP32 67, TF32 tensor core 989 with sparsity, so
        // 494.7 dense
        assert_eq!(peak_flops("NVIDIA H200", DType::F32), Some(67e12));
        assert_eq!(peak_tf32_flops("NVIDIA H200"), Some(494.7e12));
        assert_eq!(peak_tf32_flops("Tesla T4"), None);
    }
}
