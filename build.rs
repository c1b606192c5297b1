// With the `cuda` feature, compiles every kernels/*.cu to PTX with nvcc and writes
// $OUT_DIR/kernels.rs, which embeds each as `pub const <STEM>: &str` (e.g. kernels/adamw.cu ->
// ADAMW). nvcc comes from $NVCC (else `nvcc` on PATH), the target from $CUDA_COMPUTE_CAP
// (default 90); a file named *_sm90a.cu (Hopper-only instructions such as wgmma) is always built
// for sm_90a, and its launcher loads it only on compute capability 9.0. Without the feature
// this does nothing, so CPU builds need no CUDA toolchain.
use std::{env, fs, path::PathBuf, process::Command};

fn main() {
    println!("cargo:rerun-if-changed=kernels");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    let nvcc = env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap: String = env::var("CUDA_COMPUTE_CAP")
        .unwrap_or_else(|_| "90".into())
        .chars()
        .filter(|c| c.is_ascii_digit())
        .collect();
    let mut sources: Vec<PathBuf> = fs::read_dir("kernels")
        .expect("kernels/ folder")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    let mut consts = String::new();
    for src in sources {
        let stem = src.file_stem().unwrap().to_string_lossy().to_string();
        let ptx = out.join(format!("{stem}.ptx"));
        let arch = if stem.ends_with("_sm90a") {
            "sm_90a".to_string()
        } else {
            format!("sm_{cap}")
        };
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", "-Ikernels"])
            .arg(format!("-arch={arch}"))
            .arg("-o")
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {nvcc}: {e}; source /opt/cuda13/env.sh (see README) before building with --features cuda"));
        assert!(status.success(), "nvcc failed on {}", src.display());
        consts.push_str(&format!(
            "/// PTX of kernels/{stem}.cu\npub const {}: &str = include_str!(concat!(env!(\"OUT_DIR\"), \"/{stem}.ptx\"));\n",
            stem.to_uppercase()
        ));
    }
    fs::write(out.join("kernels.rs"), consts).expect("write kernels.rs");
}
