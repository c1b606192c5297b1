//! `wick bench optim` and `wick bench step` live in the library (`wick::bench`); the binary
//! parses and calls them.

#![cfg(feature = "cli")]

use std::process::Command;
use wick::bench::optim::{OptimArgs, ParamSpec};
use wick::Precision;

#[test]
fn bench_optim_runs_from_the_library() -> anyhow::Result<()> {
    wick::bench::optim::run(&OptimArgs {
        params: ParamSpec::Flat(1000),
        iters: 2,
        precision: Precision::Bf16Mixed,
    })
}

#[test]
fn bench_subcommands_run_through_the_binary() -> anyhow::Result<()> {
    let wick = env!("CARGO_BIN_EXE_wick");
    let out = Command::new(wick)
        .args(["bench", "optim", "--params", "1000", "--iters", "2"])
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("speedup (reference / fused)"), "{stdout}");

    let out = Command::new(wick)
        .args([
            "bench", "step", "--model", "gptmini", "--device", "cpu", "--batch", "1",
        ])
        .args(["--steps", "1", "--warmup", "0"])
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ms/step"), "{stdout}");
    let json: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or(""))?;
    assert_eq!(json["batch"], 1);
    assert!(
        json["gptmini_bf16_ms"].as_f64().is_some_and(|ms| ms > 0.0),
        "{json}"
    );
    Ok(())
}

#[test]
fn bench_step_runs_the_reference_mlp() -> anyhow::Result<()> {
    let out = Command::new(env!("CARGO_BIN_EXE_wick"))
        .args([
            "bench",
            "step",
            "--model",
            "mlp",
            "--device",
            "cpu",
            "--precision",
            "32",
        ])
        .args(["--batch", "8", "--steps", "2", "--warmup", "1"])
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 784*1024 + 1024 + 1024*1024 + 1024 + 1024*10 + 10 parameters, as torch_reference's mlp
    assert!(
        stdout.contains("MLP 784-1024-1024-10 (1863690 parameters)"),
        "{stdout}"
    );
    let json: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or(""))?;
    assert!(
        json["mlp_fp32_ms"].as_f64().is_some_and(|ms| ms > 0.0),
        "{json}"
    );
    assert_eq!(json["batch"], 8);
    let out = Command::new(env!("CARGO_BIN_EXE_wick"))
        .args(["bench", "step", "--model", "mpl"])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("expected \"mlp\", \"gptmini\" or \"gpt2_124m\""),
        "{stderr}"
    );
    Ok(())
}
