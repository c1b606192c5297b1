//! The text form of `wick doctor`.

use super::advice::gib;
use super::*;

// ---------------------------------------------------------------------------------------------
// Text
// ---------------------------------------------------------------------------------------------

pub(super) fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref()
        .map(|x| x.to_string())
        .unwrap_or_else(|| "?".into())
}

/// The human-readable report: facts, then recommendations, then the verdict.
pub fn render_text(r: &DoctorReport, recs: &[Recommendation]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "wick doctor (wick {}, candle {})",
        r.build.wick_version, r.build.candle_version
    );
    let _ = writeln!(s, "\nsystem");
    let _ = writeln!(
        s,
        "  os        {}, kernel {}, {}{}",
        r.host.os,
        opt(&r.host.kernel),
        r.host.arch,
        r.host
            .hostname
            .as_ref()
            .map(|h| format!(", host {h}"))
            .unwrap_or_default()
    );
    let gov = if r.cpu.governors.is_empty() {
        "n/a (no cpufreq in /sys: VM or container)".to_string()
    } else {
        r.cpu
            .governors
            .iter()
            .map(|(g, n)| format!("{g} x{n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(
        s,
        "  cpu       {}, {} logical / {} physical cores{}, rayon {} threads",
        opt(&r.cpu.model),
        r.cpu.logical_cores,
        opt(&r.cpu.physical_cores),
        r.cpu
            .cgroup_cpu_quota
            .map(|q| format!(" (cgroup quota {q:.1})"))
            .unwrap_or_default(),
        r.cpu.rayon_threads
    );
    let _ = writeln!(
        s,
        "  governor  {gov}{}{}",
        r.cpu
            .scaling_driver
            .as_ref()
            .map(|d| format!(" ({d})"))
            .unwrap_or_default(),
        r.cpu
            .max_mhz
            .map(|m| format!(", max {m:.0} MHz"))
            .unwrap_or_default()
    );
    let _ = writeln!(
        s,
        "  memory    {} total, {} available{}",
        r.memory.total_bytes.map(gib).unwrap_or_else(|| "?".into()),
        r.memory
            .available_bytes
            .map(gib)
            .unwrap_or_else(|| "?".into()),
        r.memory
            .cgroup_limit_bytes
            .map(|b| format!(", cgroup limit {}", gib(b)))
            .unwrap_or_default()
    );
    let on = |b: bool| if b { "on" } else { "off" };
    let _ = writeln!(s, "\nbuild");
    let _ = writeln!(
        s,
        "  {} build, features: cuda {}, nccl {}{}{}",
        r.build.profile,
        on(r.build.cuda),
        on(r.build.nccl),
        r.build
            .cuda_version
            .as_ref()
            .map(|v| format!(", built for CUDA {v}"))
            .unwrap_or_default(),
        r.build
            .compute_cap
            .as_ref()
            .map(|c| format!(", kernels for sm_{c}"))
            .unwrap_or_default()
    );

    let _ = writeln!(s, "\nGPUs");
    if r.nvml.loaded {
        let _ = writeln!(
            s,
            "  driver {}, supports CUDA {}, NVML {}",
            opt(&r.nvml.driver_version),
            opt(&r.nvml.cuda_driver_version),
            opt(&r.nvml.nvml_version)
        );
    }
    if r.gpus.is_empty() {
        let _ = writeln!(
            s,
            "  none found: {}",
            r.nvml.error.as_deref().unwrap_or("NVML lists no GPU")
        );
    }
    for g in &r.gpus {
        let cc = g
            .compute_capability
            .map(|c| c.to_string())
            .unwrap_or_else(|| "?".into());
        let _ = writeln!(
            s,
            "  [{}] {} (cc {cc}){}",
            g.index,
            opt(&g.name),
            g.pci_bus_id
                .as_ref()
                .map(|b| format!(" at {b}"))
                .unwrap_or_default()
        );
        let _ = writeln!(
            s,
            "      memory {} free of {}; persistence {}; util {}%; {} °C",
            g.memory_free_bytes.map(gib).unwrap_or_else(|| "?".into()),
            g.memory_total_bytes.map(gib).unwrap_or_else(|| "?".into()),
            g.persistence_mode.map(on).unwrap_or("?"),
            opt(&g.utilization_pct),
            opt(&g.temperature_c)
        );
        let _ = writeln!(
            s,
            "      clocks SM {}/{} MHz, mem {}/{} MHz; power {} W of {} W limit (default {})",
            opt(&g.sm_clock_mhz),
            opt(&g.max_sm_clock_mhz),
            opt(&g.mem_clock_mhz),
            opt(&g.max_mem_clock_mhz),
            g.power_usage_w
                .map(|w| format!("{w:.0}"))
                .unwrap_or_else(|| "?".into()),
            g.power_limit_w
                .map(|w| format!("{w:.0}"))
                .unwrap_or_else(|| "?".into()),
            g.default_power_limit_w
                .map(|w| format!("{w:.0}"))
                .unwrap_or_else(|| "?".into()),
        );
        let _ = writeln!(
            s,
            "      PCIe gen {}/{} x{}/x{}; NVLink {}; bf16 {}, tf32 {}, fp8 {}",
            opt(&g.pcie_gen),
            opt(&g.pcie_max_gen),
            opt(&g.pcie_width),
            opt(&g.pcie_max_width),
            match (g.nvlink_active, g.nvlink_links) {
                (Some(a), Some(n)) => format!("{a}/{n} links active"),
                _ => "n/a".into(),
            },
            on(g.capabilities.bf16),
            on(g.capabilities.tf32),
            on(g.capabilities.fp8)
        );
        if !g.throttle_reasons.is_empty() {
            let _ = writeln!(s, "      clock limits: {}", g.throttle_reasons.join(", "));
        }
        if g.processes.is_empty() {
            let _ = writeln!(s, "      processes: none");
        }
        for p in &g.processes {
            let _ = writeln!(
                s,
                "      process {} {} ({}){}",
                p.pid,
                opt(&p.name),
                p.kind,
                p.used_memory_bytes
                    .map(|b| format!(" {}", gib(b)))
                    .unwrap_or_default()
            );
        }
        for e in &g.errors {
            let _ = writeln!(s, "      (could not read {e})");
        }
    }
    let d = &r.cuda_driver;
    let _ = writeln!(
        s,
        "  CUDA driver API (libcuda.so.1): {}",
        if d.loaded {
            format!(
                "CUDA {}, cuInit {}, {} device(s) visible",
                opt(&d.version),
                opt(&d.init),
                opt(&d.device_count)
            )
        } else {
            format!("not loadable ({})", d.error.as_deref().unwrap_or("?"))
        }
    );
    for (k, v) in &r.env {
        let _ = writeln!(s, "  {k}={v}");
    }

    let _ = writeln!(s, "\nCUDA libraries");
    for l in &r.libraries {
        let _ = writeln!(
            s,
            "  {:<13} {:<18} {}",
            l.name,
            l.soname,
            if l.found {
                format!(
                    "found{}{}",
                    l.version
                        .as_ref()
                        .map(|v| format!(" {v}"))
                        .unwrap_or_default(),
                    l.path
                        .as_ref()
                        .map(|p| format!("  {p}"))
                        .unwrap_or_default()
                )
            } else {
                format!("not found  [{}]", l.needed_by)
            }
        );
    }

    let _ = writeln!(s, "\nrecommendations");
    if recs.is_empty() {
        let _ = writeln!(s, "  none");
    }
    for x in recs {
        let tag = match x.severity {
            Severity::Blocker => "BLOCKER",
            Severity::Warning => "warning",
            Severity::Tip => "tip",
        };
        let _ = writeln!(s, "  [{tag}] {}", x.finding);
        let _ = writeln!(s, "      why: {}", x.reason);
        let _ = writeln!(s, "      do:  {}", x.action);
    }
    let _ = writeln!(s, "\n{}", verdict(r, recs));
    s
}
