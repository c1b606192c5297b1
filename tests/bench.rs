//! `wick bench optim` and `wick bench step` live in the library (`wick::bench`); the binary
//! parses and calls them.

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
