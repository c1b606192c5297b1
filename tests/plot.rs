//! `wick plot` writes PNGs of the requested size from small CSV files.

#![cfg(all(feature = "cli", feature = "plot"))]

use std::path::PathBuf;
use std::process::Command;
use wick::plot::png_dimensions;

fn tmpdir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("wick-plot-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn plot_command_writes_both_pngs() {
    let d = tmpdir();
    let metrics = d.join("metrics.csv");
    let mut csv = String::from("step,epoch,loss,val_loss,lr,grad_norm,loss_scale,samples_per_s\n");
    for i in 0..40 {
        let val = if i % 10 == 9 {
            format!("{}", 1.0 / (i as f64 + 2.0))
        } else {
            String::new()
        };
        csv.push_str(&format!(
            "{i},0,{},{val},{},,,\n",
            1.0 / (i as f64 + 1.0),
            1e-3
        ));
    }
    std::fs::write(&metrics, csv).unwrap();
    let phases = d.join("phases.csv");
    std::fs::write(
        &phases,
        "phase,ms_per_step\ndata,1.5\nhost-to-device,0.2\nforward,3\nbackward,6\noptimizer,1\n",
    )
    .unwrap();
    let (loss_png, phases_png) = (d.join("loss.png"), d.join("p.png"));
    let out = Command::new(env!("CARGO_BIN_EXE_wick"))
        .args(["plot"])
        .arg(&metrics)
        .arg("-o")
        .arg(&loss_png)
        .arg("--phases")
        .arg(&phases)
        .arg("--phases-out")
        .arg(&phases_png)
        .args(["--width", "640", "--height", "360"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(png_dimensions(&loss_png).unwrap(), (640, 360));
    assert_eq!(png_dimensions(&phases_png).unwrap(), (640, 360));

    // A missing file is an error that names it.
    let out = Command::new(env!("CARGO_BIN_EXE_wick"))
        .args(["plot", "/nonexistent/metrics.csv"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/metrics.csv"));
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn plot_into_a_missing_folder_is_a_clear_error() {
    let d = std::env::temp_dir().join(format!("wick-plot-missing-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let metrics = d.join("metrics.csv");
    std::fs::write(&metrics, "step,loss\n1,2.0\n2,1.5\n").unwrap();
    let target = d.join("missing/dir/x.png");
    let out = Command::new(env!("CARGO_BIN_EXE_wick"))
        .arg("plot")
        .arg(&metrics)
        .arg("-o")
        .arg(&target)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!(
            "{} does not exist",
            d.join("missing/dir").display()
        )) && stderr.contains("mkdir -p"),
        "{stderr}"
    );
    assert!(!stderr.contains("BackendError"), "{stderr}");
    assert!(!target.exists());
    std::fs::remove_dir_all(&d).unwrap();
}
