//! Causal attention alone, forward and forward + backward, in the units of
//! `scripts/reference/torch_sdpa.py` so the two can be read side by side: GPU ms per call
//! (CUDA events over `--iters` calls after warm-up) and TFLOP/s counted as FlashAttention does
//! for causal attention (forward `2 * 2*B*H*T*T*D / 2` FLOPs, backward 2.5 times that).
//!
//! `qkv: (B, T, (H + 2 Hkv) * 64)` is random in `--dtype` (bf16, f16 or f32: 3xTF32, or TF32
//! with `--tf32`, which allows f32 GEMMs TF32 as `PerfSettings::tf32` does); the backward is
//! seeded by candle with ones (`y.backward()`), so its figure includes that fill and candle's
//! gradient store, as PyTorch's includes autograd's. CUDA only.
//!
//! ```text
//! cargo run --release --features cuda --example bench_attention [-- --b 16 --h 12 --t 1024]
//! ```
//! Prints one line per figure and one JSON line.

#[path = "common/gpu_time.rs"]
mod gpu_time;
use gpu_time::gpu_ms;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use clap::Parser;
use wick::ops;

#[derive(Parser)]
struct Args {
    /// Batch rows.
    #[arg(long, default_value_t = 16)]
    b: usize,
    /// Query heads.
    #[arg(long, default_value_t = 12)]
    h: usize,
    /// Key/value heads (default: `--h`, multi-head attention).
    #[arg(long)]
    hkv: Option<usize>,
    /// Sequence length.
    #[arg(long, default_value_t = 1024)]
    t: usize,
    /// "bf16", "f16" or "f32".
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// f32 on plain TF32 operands (candle's `set_gemm_reduced_precision_f32`), else 3xTF32.
    #[arg(long)]
    tf32: bool,
    /// Timed calls per figure.
    #[arg(long, default_value_t = 50)]
    iters: usize,
}

fn main() -> Result<()> {
    let a = Args::parse();
    let dtype = match a.dtype.as_str() {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "f32" => DType::F32,
        d => anyhow::bail!("--dtype {d}: expected bf16, f16 or f32"),
    };
    anyhow::ensure!(
        !a.tf32 || dtype == DType::F32,
        "--tf32 selects the f32 kernels' mode; use it with --dtype f32"
    );
    candle_core::cuda::set_gemm_reduced_precision_f32(a.tf32);
    let label = match (dtype, a.tf32) {
        (DType::F32, true) => "f32 (TF32)".to_string(),
        (DType::F32, false) => "f32 (3xTF32)".to_string(),
        _ => a.dtype.clone(),
    };
    let hkv = a.hkv.unwrap_or(a.h);
    anyhow::ensure!(
        hkv > 0 && a.h % hkv == 0,
        "--hkv {hkv} must divide --h {}",
        a.h
    );
    let dev = Device::new_cuda(0)?;
    let d = 64;
    let w = (a.h + 2 * hkv) * d;
    let qkv = Var::from_tensor(&Tensor::randn(0f32, 1.0, (a.b, a.t, w), &dev)?.to_dtype(dtype)?)?;
    let x = qkv.as_tensor();
    let fwd = gpu_ms(&dev, 5, a.iters, &|| {
        ops::grouped_causal_attention(x, a.h, hkv)?;
        Ok(())
    })?;
    let fwd_bwd = gpu_ms(&dev, 5, a.iters, &|| {
        let _g = ops::grouped_causal_attention(x, a.h, hkv)?.backward()?;
        Ok(())
    })?;
    let flop = 2.0 * 2.0 * (a.b * a.h * a.t * a.t * d) as f64 / 2.0;
    let (fwd_tf, bwd_tf) = (flop / fwd / 1e9, 2.5 * flop / (fwd_bwd - fwd) / 1e9);
    println!(
        "causal attention B{} H{} Hkv{hkv} T{} D{d} {label}, {} calls",
        a.b, a.h, a.t, a.iters
    );
    println!("forward            {fwd:8.4} ms  {fwd_tf:6.1} TFLOP/s");
    println!(
        "backward           {:8.4} ms  {bwd_tf:6.1} TFLOP/s",
        fwd_bwd - fwd
    );
    println!("forward + backward {fwd_bwd:8.4} ms");
    let json = serde_json::json!({
        "shape": [a.b, a.h, hkv, a.t, d], "dtype": label,
        "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "fwd_TFLOPs": fwd_tf, "bwd_TFLOPs": bwd_tf,
    });
    println!("{json}");
    Ok(())
}
