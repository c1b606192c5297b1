//! Times `wick::ops::lora_linear_grouped` against `wick::ops::linear` on the four projections
//! of a SmolLM2-135M block at the fine-tuning shape (16 x 1024 tokens, bf16, rank 16): the
//! frozen base with its LoRA updates, the frozen base alone (no dW) and a trainable linear
//! (dW too, as in full fine-tuning). CUDA only.
//!
//! For each: forward alone and forward + backward (`y.backward()`, so `dy = 1`), as device
//! milliseconds per call (synchronised loop) and host milliseconds per call (the time to queue
//! the same loop, before the final synchronisation): when the host figure reaches the device
//! one, the step is launch-bound.
//!
//! ```text
//! cargo run --release --features cuda --example bench_lora [-- --iters 50] [--event-tracking]
//! ```
//! The device comes from `wick::cuda::new_device` (no per-allocation CUDA events);
//! `--event-tracking` uses candle's `Device::new_cuda` as is, to show what those events cost.
//! Last, the adapter-gradient GEMMs with a long inner dimension (`du^T x`, `(R, K)` over the
//! M tokens) are timed as one GEMM and as S = 16 batched GEMMs over M / S tokens each (split-K
//! by hand, before the sum of the partial products).

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use std::time::Instant;

/// `(device ms, host ms)` per call of `f` over `iters` calls, after 3 warm-up calls.
fn time_ms(dev: &Device, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<(f64, f64)> {
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    let host = t.elapsed().as_secs_f64();
    dev.synchronize()?;
    let all = t.elapsed().as_secs_f64();
    Ok((all * 1e3 / iters as f64, host * 1e3 / iters as f64))
}

fn var(shape: (usize, usize), dev: &Device) -> Result<Var> {
    let t = (Tensor::randn(0f32, 1.0, shape, dev)? / (shape.1 as f64).sqrt())?;
    Ok(Var::from_tensor(&t.to_dtype(DType::BF16)?)?)
}

/// Flags.
#[derive(clap::Parser, Debug)]
struct Args {
    /// Timed calls per measurement (after 3 warm-up calls).
    #[arg(long, default_value_t = 50)]
    iters: usize,
    /// Use candle's `Device::new_cuda` as is (cudarc's per-allocation events on).
    #[arg(long)]
    event_tracking: bool,
}

fn main() -> Result<()> {
    let a = <Args as clap::Parser>::parse();
    let iters = a.iters.max(1);
    let dev = if a.event_tracking {
        Device::new_cuda(0)?
    } else {
        wick::cuda::new_device(0)?
    };
    let (m, r) = (16 * 1024, 16);
    // (name, K, output rows of each stacked module)
    let projs: [(&str, usize, &[usize]); 4] = [
        ("qkv", 576, &[576, 192, 192]),
        ("o", 576, &[576]),
        ("gate_up", 576, &[1536, 1536]),
        ("down", 1536, &[576]),
    ];
    println!("M = {m} tokens, bf16, rank {r}, {iters} iterations; ms per call: device / host");
    let (mut sum_lora, mut sum_frozen, mut sum_full) = (0.0, 0.0, 0.0);
    for (name, k, rows) in projs {
        let n: usize = rows.iter().sum();
        let parts: Vec<(usize, usize)> = rows.iter().map(|&o| (o, r)).collect();
        let x = var((m, k), &dev)?;
        let w = var((n, k), &dev)?;
        let a = var((r * rows.len(), k), &dev)?;
        let b = var((n, r), &dev)?;
        let wc = w.as_tensor().detach();
        let (xt, at, bt) = (x.as_tensor(), a.as_tensor(), b.as_tensor());
        let lora = |bwd: bool| -> Result<()> {
            let y = wick::ops::lora_linear_grouped(xt, &wc, at, bt, &parts, 2.0)?;
            if bwd {
                let g = y.backward()?;
                anyhow::ensure!(g.get(xt).is_some() && g.get(at).is_some() && g.get(bt).is_some());
            }
            Ok(())
        };
        let frozen = |bwd: bool| -> Result<()> {
            let y = wick::ops::linear(xt, &wc, None)?;
            if bwd {
                anyhow::ensure!(y.backward()?.get(xt).is_some());
            }
            Ok(())
        };
        let full = |bwd: bool| -> Result<()> {
            let y = wick::ops::linear(xt, w.as_tensor(), None)?;
            if bwd {
                let g = y.backward()?;
                anyhow::ensure!(g.get(xt).is_some() && g.get(w.as_tensor()).is_some());
            }
            Ok(())
        };
        println!("{name}: x ({m}, {k}), W ({n}, {k}), parts {rows:?}");
        for (label, f, sum) in [
            ("LoRA", &lora as &dyn Fn(bool) -> Result<()>, &mut sum_lora),
            ("frozen linear", &frozen, &mut sum_frozen),
            ("trainable linear", &full, &mut sum_full),
        ] {
            let (fd, fh) = time_ms(&dev, iters, || f(false))?;
            let (bd, bh) = time_ms(&dev, iters, || f(true))?;
            *sum += bd;
            println!(
                "  {label:<17} forward {fd:7.3} / {fh:7.3}   forward+backward {bd:7.3} / {bh:7.3}"
            );
        }
    }
    println!(
        "one block, forward+backward device ms: LoRA {sum_lora:.3}, frozen {sum_frozen:.3}, trainable {sum_full:.3}"
    );
    // the long-inner-dimension GEMMs of the adapter gradients, whole and split over tokens
    for (r_sum, k) in [
        (48, 576),
        (32, 576),
        (16, 576),
        (16, 1536),
        (576, 16),
        (1536, 16),
    ] {
        let du = var((m, r_sum), &dev)?.as_tensor().detach();
        let x = var((m, k), &dev)?.as_tensor().detach();
        let (one, _) = time_ms(&dev, iters, || {
            du.t()?.matmul(&x)?;
            Ok(())
        })?;
        let mut line = format!("({r_sum}, {m})x({m}, {k}): one GEMM {one:.4} ms");
        for s in [16, 64, 128] {
            let (dus, xs) = (du.reshape((s, m / s, r_sum))?, x.reshape((s, m / s, k))?);
            let (split, _) = time_ms(&dev, iters, || {
                dus.transpose(1, 2)?.matmul(&xs)?;
                Ok(())
            })?;
            line += &format!(", {s} batched partials {split:.4}");
        }
        println!("{line}");
    }
    Ok(())
}
