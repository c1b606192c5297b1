//! `wick doctor` as a user runs it: on a machine without a GPU it must say so, exit 0, and
//! exit non-zero with `--require cuda`; its JSON must carry every field.

#![cfg(all(feature = "cli", feature = "nvml"))]

use std::process::Command;

fn wick(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_wick"))
        .args(args)
        .output()
        .expect("running the wick binary")
}

#[test]
fn json_parses_and_has_every_field() {
    let out = wick(&["doctor", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("doctor --json is JSON");
    for k in ["report", "recommendations", "ready", "verdict"] {
        assert!(v.get(k).is_some(), "missing top-level {k}");
    }
    let r = &v["report"];
    let fields: &[(&str, &[&str])] = &[
        ("host", &["hostname", "os", "kernel", "arch"]),
        (
            "cpu",
            &[
                "model",
                "logical_cores",
                "physical_cores",
                "cgroup_cpu_quota",
                "governors",
                "scaling_driver",
                "max_mhz",
                "rayon_threads",
            ],
        ),
        (
            "memory",
            &[
                "total_bytes",
                "available_bytes",
                "swap_total_bytes",
                "cgroup_limit_bytes",
            ],
        ),
        (
            "build",
            &[
                "wick_version",
                "candle_version",
                "profile",
                "cuda",
                "nccl",
                "cuda_version",
                "compute_cap",
            ],
        ),
        (
            "nvml",
            &[
                "loaded",
                "error",
                "driver_version",
                "cuda_driver_version",
                "nvml_version",
            ],
        ),
        (
            "cuda_driver",
            &["loaded", "version", "init", "device_count", "error"],
        ),
    ];
    for (section, keys) in fields {
        for k in *keys {
            assert!(r[section].get(k).is_some(), "missing report.{section}.{k}");
        }
    }
    for k in ["gpus", "libraries", "env", "planned_precision", "require"] {
        assert!(r.get(k).is_some(), "missing report.{k}");
    }
    assert_eq!(r["build"]["candle_version"], "0.11.1");
    assert_eq!(r["build"]["cuda"], cfg!(feature = "cuda"));
    let libs = r["libraries"].as_array().unwrap();
    let names: Vec<&str> = libs.iter().map(|l| l["soname"].as_str().unwrap()).collect();
    for so in [
        "libcudart.so.13",
        "libcublas.so.13",
        "libnvrtc.so.13",
        "libnccl.so.2",
        "libcudnn.so.9",
    ] {
        assert!(names.contains(&so), "{so} not probed: {names:?}");
    }
    for l in libs {
        for k in [
            "name",
            "soname",
            "found",
            "path",
            "version",
            "error",
            "needed_by",
        ] {
            assert!(l.get(k).is_some(), "library entry without {k}");
        }
    }
    // Every GPU entry has the same keys as the struct (checked on a default one, since CI has
    // no GPU).
    let g = serde_json::to_value(wick::doctor::GpuInfo::default()).unwrap();
    for k in [
        "index",
        "name",
        "compute_capability",
        "capabilities",
        "memory_total_bytes",
        "memory_free_bytes",
        "persistence_mode",
        "sm_clock_mhz",
        "power_limit_w",
        "pcie_gen",
        "pcie_width",
        "nvlink_active",
        "processes",
    ] {
        assert!(g.get(k).is_some(), "GpuInfo without {k}");
    }
    for rec in v["recommendations"].as_array().unwrap() {
        for k in ["id", "severity", "finding", "reason", "action"] {
            assert!(rec.get(k).is_some(), "recommendation without {k}");
        }
    }
}

#[test]
fn without_a_gpu_the_text_says_so_and_require_cuda_fails() {
    let out = wick(&["doctor"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let gpu_here = text.contains("\n  [0] ");
    if gpu_here {
        return; // a GPU machine: the rest is about machines without one.
    }
    assert!(text.contains("none found"), "{text}");
    assert!(text.contains("no usable NVIDIA GPU found"), "{text}");
    assert!(text.contains("ready for CPU training"), "{text}");

    assert!(wick(&["doctor", "--require", "cpu"]).status.success());
    let out = wick(&["doctor", "--require", "cuda"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("NOT READY for CUDA training"), "{err}");
    assert!(err.contains("no usable NVIDIA GPU found"), "{err}");
}

#[test]
fn bad_require_value_is_a_usage_error() {
    let out = wick(&["doctor", "--require", "tpu"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected \"cuda\" or \"cpu\""));
}
