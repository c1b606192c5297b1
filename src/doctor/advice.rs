//! Recommendations from a [`super::DoctorReport`] (a pure function of the report) and the
//! verdict.

use super::*;

// ---------------------------------------------------------------------------------------------
// Recommendations
// ---------------------------------------------------------------------------------------------

/// The lowest Linux driver for a CUDA version (NVIDIA's CUDA toolkit release notes, table 3).
pub fn min_driver_for_cuda(major: u32, minor: u32) -> Option<&'static str> {
    Some(match (major, minor) {
        (13, _) => "580.65.06",
        (12, 9) => "575.51.03",
        (12, 8) => "570.26",
        (12, 6) => "560.28.03",
        (12, 5) => "555.42.02",
        (12, 4) => "550.54.14",
        (12, 3) => "545.23.06",
        (12, 2) => "535.54.03",
        (12, 1) => "530.30.02",
        (12, _) => "525.60.13",
        (11, 8) => "520.61.05",
        _ => return None,
    })
}

pub(super) fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

/// What to do about this report, most severe first. Pure: depends only on the report.
pub fn recommendations(r: &DoctorReport) -> Vec<Recommendation> {
    let mut out = Vec::new();
    let mut add = |id, severity, finding: String, reason: &str, action: String| {
        out.push(Recommendation {
            id,
            severity,
            finding,
            reason: reason.to_string(),
            action,
        })
    };
    let want_cuda = r.require == Some(Require::Cuda);
    let gpu_sev = if want_cuda {
        Severity::Blocker
    } else {
        Severity::Warning
    };
    let cuda_sees = r.cuda_driver.init.as_deref() == Some("CUDA_SUCCESS")
        && r.cuda_driver.device_count.unwrap_or(0) > 0;
    let any_gpu = !r.gpus.is_empty() || cuda_sees;

    // --- build ----------------------------------------------------------------------------
    if r.build.profile == "debug" {
        add(
            "debug-build",
            Severity::Warning,
            "this is a debug build of wick".into(),
            "unoptimised Rust is 10-50x slower on the CPU paths (data loading, fused CPU optimizer, host-side graph work)",
            "cargo build --release (and run target/release/wick)".into(),
        );
    }
    if !r.build.cuda && (want_cuda || any_gpu) {
        let found = if any_gpu {
            format!("{} NVIDIA GPU(s) present, but", r.gpus.len().max(1))
        } else {
            "".into()
        };
        add(
            "build-without-cuda",
            gpu_sev,
            format!("{found} this binary was built without the `cuda` feature").trim().to_string(),
            "a CPU-only build cannot use a GPU; candle's CUDA backend and wick's kernels are compiled only with the feature",
            "source /opt/cuda13/env.sh && cargo build --release --features cuda   (CUDA 13 toolchain: see the README)".into(),
        );
    }

    // --- no GPU / driver ---------------------------------------------------------------------
    if !any_gpu {
        let mut why = r
            .nvml
            .error
            .clone()
            .unwrap_or_else(|| "NVML lists no GPU".into());
        if let Some(init) = r
            .cuda_driver
            .init
            .as_deref()
            .filter(|i| *i != "CUDA_SUCCESS")
        {
            why.push_str(&format!("; cuInit → {init}"));
        }
        let (sev, reason) = if want_cuda {
            (
                Severity::Blocker,
                "--require cuda needs a GPU that the CUDA driver can open",
            )
        } else if r.build.cuda {
            (
                Severity::Warning,
                "this build has CUDA, but training will run on the CPU",
            )
        } else {
            (
                Severity::Tip,
                "training runs on the CPU (the fused CPU optimizer path, rayon)",
            )
        };
        add(
            "no-gpu",
            sev,
            format!("no usable NVIDIA GPU found: {why}"),
            reason,
            "for GPU training: a machine with an NVIDIA GPU and driver >= 580 (CUDA 13) and a `--features cuda` build; here: train with --device cpu".into(),
        );
    }
    if !r.gpus.is_empty() && r.cuda_driver.loaded && !cuda_sees {
        let init = r
            .cuda_driver
            .init
            .clone()
            .unwrap_or_else(|| "no answer".into());
        let hidden = r
            .env
            .get("CUDA_VISIBLE_DEVICES")
            .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v:?})"))
            .unwrap_or_default();
        add(
            "cuda-init",
            gpu_sev,
            format!(
                "NVML lists {} GPU(s) but CUDA sees none: cuInit → {init}{hidden}",
                r.gpus.len()
            ),
            "CUDA applications see only what cuInit and CUDA_VISIBLE_DEVICES allow",
            if hidden.is_empty() {
                "check the driver installation (nvidia-smi; dmesg | grep -i nvrm) and the container's GPU access (--gpus all)".into()
            } else {
                "unset CUDA_VISIBLE_DEVICES or set it to a GPU index, e.g. export CUDA_VISIBLE_DEVICES=0".into()
            },
        );
    }
    if any_gpu && !r.cuda_driver.loaded && r.build.cuda {
        add(
            "no-libcuda",
            gpu_sev,
            "libcuda.so.1 (the CUDA driver library) is not loadable".into(),
            "every CUDA program needs the driver's libcuda.so.1",
            "install the NVIDIA driver's CUDA library or add its folder to LD_LIBRARY_PATH (e.g. /usr/local/nvidia/lib64)".into(),
        );
    }
    // The driver must support the CUDA version the binary (and its PTX) was built for.
    let driver_cuda = r
        .nvml
        .cuda_driver_version
        .as_deref()
        .or(r.cuda_driver.version.as_deref())
        .and_then(parse_major_minor);
    if let (Some(built), Some(have)) = (
        r.build.cuda_version.as_deref().and_then(parse_major_minor),
        driver_cuda,
    ) {
        if have < built {
            let need = min_driver_for_cuda(built.0, built.1).unwrap_or("a newer driver");
            add(
                "driver-too-old",
                gpu_sev,
                format!(
                    "driver {} supports CUDA {}.{}, but this binary was built for CUDA {}.{}",
                    r.nvml.driver_version.as_deref().unwrap_or("?"),
                    have.0,
                    have.1,
                    built.0,
                    built.1
                ),
                "the driver rejects PTX and runtime libraries newer than the CUDA version it supports (CUDA_ERROR_UNSUPPORTED_PTX_VERSION)",
                format!(
                    "upgrade the NVIDIA driver to >= {need}, or rebuild with a CUDA {}.{} toolchain (CUDARC_CUDA_VERSION={}{:01}0)",
                    have.0, have.1, have.0, have.1
                ),
            );
        }
    }
    // candle's kernels are compiled for one compute capability (90 → sm_90a, arch-specific).
    if let Some(cap) = r
        .build
        .compute_cap
        .as_deref()
        .and_then(|c| c.parse::<u32>().ok())
    {
        for g in &r.gpus {
            let Some(cc) = g.compute_capability else {
                continue;
            };
            let v = cc.as_u32();
            let mismatch = if cap == 90 { v != 90 } else { v < cap };
            if mismatch {
                add(
                    "compute-cap-mismatch",
                    gpu_sev,
                    format!(
                        "GPU {} ({}) has compute capability {cc}, but this build's kernels target sm_{cap}{}",
                        g.index,
                        g.name.as_deref().unwrap_or("?"),
                        if cap == 90 { "a" } else { "" }
                    ),
                    "kernels compiled for another architecture fail to load (CUDA_ERROR_NO_BINARY_FOR_GPU / invalid PTX)",
                    format!(
                        "rebuild for this GPU: CUDA_COMPUTE_CAP={v} cargo build --release --features cuda"
                    ),
                );
            }
        }
    }
    // Missing runtime libraries where a CUDA build would need them.
    if r.build.cuda || any_gpu {
        for l in &r.libraries {
            let needed = l.needed_by.starts_with("cuda build")
                || (l.needed_by.starts_with("nccl build") && (r.build.nccl || r.gpus.len() > 1));
            if needed && !l.found {
                add(
                    "missing-library",
                    Severity::Warning,
                    format!("{} ({}) is not loadable", l.name, l.soname),
                    "a CUDA build of wick links it and will not start (or fail at first use) without it",
                    format!(
                        "install it (CUDA 13 toolkit, or the nvidia-* pip wheels) and add its folder to LD_LIBRARY_PATH; {}",
                        l.error.as_deref().unwrap_or("")
                    )
                    .trim_end_matches("; ")
                    .to_string(),
                );
            }
        }
    }

    // --- per GPU ----------------------------------------------------------------------------
    let me = std::process::id();
    let idle: Vec<u32> = r
        .gpus
        .iter()
        .filter(|g| g.processes.iter().all(|p| p.pid == me) && g.utilization_pct.unwrap_or(0) < 10)
        .map(|g| g.index)
        .collect();
    for g in &r.gpus {
        let label = format!("GPU {} ({})", g.index, g.name.as_deref().unwrap_or("?"));
        if g.persistence_mode == Some(false) {
            add(
                "persistence-mode",
                Severity::Warning,
                format!("{label}: persistence mode is off"),
                "without persistence the driver tears the GPU state down when the last client exits, so every run pays a 1-3 s initialisation and clocks/ECC state reset",
                format!("sudo nvidia-smi -i {} -pm 1   (or: sudo systemctl enable --now nvidia-persistenced)", g.index),
            );
        }
        let others: Vec<&GpuProcess> = g.processes.iter().filter(|p| p.pid != me).collect();
        if !others.is_empty() {
            let list = others
                .iter()
                .map(|p| {
                    format!(
                        "pid {} {}{}",
                        p.pid,
                        p.name.as_deref().unwrap_or("?"),
                        p.used_memory_bytes
                            .map(|b| format!(" {}", gib(b)))
                            .unwrap_or_default()
                    )
                })
                .collect::<Vec<_>>()
                .join(", ");
            let alt = idle
                .first()
                .map(|i| format!(", or use an idle GPU: export CUDA_VISIBLE_DEVICES={i}"))
                .unwrap_or_default();
            add(
                "gpu-busy",
                Severity::Warning,
                format!("{label} is used by {} other process(es): {list}", others.len()),
                "other processes take memory and SM time: step times become noisy and large batches may run out of memory",
                format!("stop them (kill <pid>) or wait{alt}"),
            );
        } else if let (Some(t), Some(f)) = (g.memory_total_bytes, g.memory_free_bytes) {
            // Processes of other containers are invisible: fall back to memory in use.
            if t > 0 && f < t / 2 {
                add(
                    "gpu-memory-used",
                    Severity::Warning,
                    format!(
                        "{label}: only {} of {} free, no process listed",
                        gib(f),
                        gib(t)
                    ),
                    "another container or VM is probably using this GPU",
                    "check nvidia-smi on the host; pick another GPU with CUDA_VISIBLE_DEVICES"
                        .into(),
                );
            }
        }
        if let (Some(lim), Some(def)) = (g.power_limit_w, g.default_power_limit_w) {
            if lim + 1.0 < def {
                add(
                    "power-limit",
                    Severity::Warning,
                    format!("{label}: power limit {lim:.0} W, below the default {def:.0} W"),
                    "a lowered power cap holds clocks down under load",
                    format!("sudo nvidia-smi -i {} -pl {def:.0}", g.index),
                );
            }
        }
        let bad: Vec<&String> = g
            .throttle_reasons
            .iter()
            .filter(|t| {
                t.contains("thermal") || t.contains("hw_slowdown") || t.contains("power_brake")
            })
            .collect();
        if !bad.is_empty() {
            add(
                "throttling",
                Severity::Warning,
                format!(
                    "{label}: clocks throttled ({})",
                    bad.iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                "hardware or thermal slowdown lowers throughput by up to half",
                "check cooling and power delivery: nvidia-smi -q -d PERFORMANCE,TEMPERATURE".into(),
            );
        }
        if let (Some(w), Some(mw)) = (g.pcie_width, g.pcie_max_width) {
            if w < mw {
                add(
                    "pcie-width",
                    Severity::Tip,
                    format!("{label}: PCIe link x{w} of x{mw}"),
                    "a narrow link slows host-to-device copies (the data phase of every step)",
                    "check the slot/riser; re-check under load with nvidia-smi -q -d PCIE (links may narrow at idle)".into(),
                );
            }
        }
    }
    if r.gpus.len() > 1 && r.gpus.iter().all(|g| g.nvlink_active.unwrap_or(0) == 0) {
        add(
            "no-nvlink",
            Severity::Tip,
            format!("{} GPUs without an active NVLink", r.gpus.len()),
            "data-parallel all-reduce then runs over PCIe: communication can dominate the step",
            "raise gradient accumulation to all-reduce less often, or use NVLink-connected GPUs"
                .into(),
        );
    }

    // --- precision ----------------------------------------------------------------------------
    let best = r.gpus.iter().filter_map(|g| g.compute_capability).max();
    if let Some(cc) = best {
        let caps = Capabilities::of(cc);
        match r.planned_precision {
            Some(Precision::Bf16Mixed) if !caps.bf16 => add(
                "bf16-unsupported",
                Severity::Warning,
                format!("bf16-mixed planned, but the best GPU has compute capability {cc} (< 8.0)"),
                "without bf16 tensor cores, bf16 matmuls are emulated and slow",
                "use --precision 16-mixed (f16 with dynamic loss scaling)".into(),
            ),
            Some(Precision::Bf16Mixed) => {}
            planned if caps.bf16 => add(
                "use-bf16",
                Severity::Tip,
                format!(
                    "compute capability {cc} has bf16 tensor cores{}",
                    match planned {
                        Some(p) => format!(" but the planned precision is {p}"),
                        None => String::new(),
                    }
                ),
                "bf16-mixed runs matmuls on tensor cores (H200: 4096³ matmul 785 TFLOP/s in bf16 against 51 in f32) and, unlike f16, needs no loss scaling",
                "train with --precision bf16-mixed".into(),
            ),
            _ => {}
        }
        if caps.tf32 && r.planned_precision == Some(Precision::Fp32) {
            add(
                "use-tf32",
                Severity::Tip,
                "fp32 training planned on a GPU with TF32 tensor cores".into(),
                "TF32 GEMMs keep f32 storage and accumulation with a 10-bit mantissa on the inputs (H200: 51 → 390 TFLOP/s)",
                "PerfSettings { tf32: true, .. } (candle: set_gemm_reduced_precision_f32(true))".into(),
            );
        }
    }

    // --- host -----------------------------------------------------------------------------------
    let slow: Vec<String> = r
        .cpu
        .governors
        .iter()
        .filter(|(g, _)| g.as_str() != "performance")
        .map(|(g, n)| format!("{g} on {n} CPU(s)"))
        .collect();
    if !slow.is_empty() {
        add(
            "cpu-governor",
            Severity::Warning,
            format!("CPU frequency governor: {}", slow.join(", ")),
            "a power-saving governor lowers clocks between bursts: data loading and kernel launches (host-bound in candle) slow down and step times jitter",
            "sudo cpupower frequency-set -g performance   (or: echo performance | sudo tee /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor)".into(),
        );
    }
    if let Some(q) = r.cpu.cgroup_cpu_quota {
        let q_int = q.floor().max(1.0) as usize;
        if r.cpu.rayon_threads > q_int {
            add(
                "rayon-threads",
                Severity::Warning,
                format!("rayon uses {} threads but the cgroup allows {q:.1} CPUs", r.cpu.rayon_threads),
                "oversubscribed threads are throttled by the CPU quota: the fused CPU optimizer and data workers stall",
                format!("export RAYON_NUM_THREADS={q_int}"),
            );
        }
    }

    out.sort_by_key(|r| r.severity);
    out
}

/// Whether nothing blocks training on the required device.
pub fn ready(recs: &[Recommendation]) -> bool {
    recs.iter().all(|r| r.severity != Severity::Blocker)
}

/// One line saying what this machine can train on.
pub fn verdict(r: &DoctorReport, recs: &[Recommendation]) -> String {
    let gpus = r.usable_gpus();
    let blockers: Vec<&str> = recs
        .iter()
        .filter(|x| x.severity == Severity::Blocker)
        .map(|x| x.finding.as_str())
        .collect();
    if !blockers.is_empty() {
        return format!(
            "NOT READY for {}: {}",
            match r.require {
                Some(Require::Cuda) => "CUDA training",
                _ => "training",
            },
            blockers.join("; ")
        );
    }
    if r.build.cuda && gpus > 0 {
        format!("ready: CUDA training on {gpus} GPU(s) (and CPU)")
    } else if gpus > 0 || !r.gpus.is_empty() {
        "ready for CPU training; GPUs are present but this build has no `cuda` feature".into()
    } else {
        "ready for CPU training; no NVIDIA GPU on this machine".into()
    }
}

/// Everything `--json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct DoctorOutput<'a> {
    /// The facts.
    pub report: &'a DoctorReport,
    /// What to do, most severe first.
    pub recommendations: &'a [Recommendation],
    /// No blocker.
    pub ready: bool,
    /// One-line summary.
    pub verdict: String,
}
