//! Times the fused differentiable ops of `wick::ops` against candle's composed versions on
//! GPT-2-124M shapes (CUDA only):
//!
//! - LayerNorm, x `(16, 1024, 768)` bf16, w/b `(768,)` f32: `wick::ops::layer_norm` vs
//!   `candle_nn::ops::layer_norm_slow` (with bf16 copies of w and b, as that function needs);
//! - softmax, x `(16, 12, 1024, 1024)` bf16: `wick::ops::softmax_last_dim` vs
//!   `candle_nn::ops::softmax(x, D::Minus1)`.
//!
//! Each is timed forward only and forward + backward (`y.backward()`, i.e. `dy = 1`, which
//! includes one fill of `dy`), after warm-up, with `Device::synchronize` around the timed loop;
//! candle-nn's forward-only fused kernels are shown for reference.
//!
//! ```text
//! cargo run --release --features cuda --example bench_ops [-- --iters 20]
//! ```

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var, D};
use std::time::Instant;

/// Mean milliseconds per call of `f` over `iters` calls, after 3 warm-up calls.
fn time_ms(dev: &Device, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    dev.synchronize()?;
    Ok(t.elapsed().as_secs_f64() * 1e3 / iters as f64)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let iters = args
        .iter()
        .position(|a| a == "--iters")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(20);
    let dev = Device::new_cuda(0)?;
    let eps = 1e-5;

    // LayerNorm at GPT-2-124M shapes.
    let x =
        Var::from_tensor(&Tensor::randn(0f32, 1., (16, 1024, 768), &dev)?.to_dtype(DType::BF16)?)?;
    let w = Var::from_tensor(&Tensor::ones(768, DType::F32, &dev)?)?;
    let b = Var::from_tensor(&Tensor::zeros(768, DType::F32, &dev)?)?;
    let (xt, wt, bt) = (x.as_tensor(), w.as_tensor(), b.as_tensor());
    println!("LayerNorm, x (16, 1024, 768) bf16, w/b (768,) f32, {iters} iterations");
    let fused_fwd = time_ms(&dev, iters, || {
        wick::ops::layer_norm(xt, wt, bt, eps)?;
        Ok(())
    })?;
    let fused = time_ms(&dev, iters, || {
        let g = wick::ops::layer_norm(xt, wt, bt, eps)?.backward()?;
        anyhow::ensure!(g.get(xt).is_some() && g.get(wt).is_some() && g.get(bt).is_some());
        Ok(())
    })?;
    let candle_fwd = time_ms(&dev, iters, || {
        let (w16, b16) = (wt.to_dtype(DType::BF16)?, bt.to_dtype(DType::BF16)?);
        candle_nn::ops::layer_norm(xt, &w16, &b16, eps as f32)?;
        Ok(())
    })?;
    let composed = time_ms(&dev, iters, || {
        let (w16, b16) = (wt.to_dtype(DType::BF16)?, bt.to_dtype(DType::BF16)?);
        let g = candle_nn::ops::layer_norm_slow(xt, &w16, &b16, eps as f32)?.backward()?;
        anyhow::ensure!(g.get(xt).is_some() && g.get(wt).is_some() && g.get(bt).is_some());
        Ok(())
    })?;
    println!("  wick fused      forward {fused_fwd:8.3} ms   forward+backward {fused:8.3} ms");
    println!("  candle-nn fused forward {candle_fwd:8.3} ms   (no backward)");
    println!(
        "  candle composed                      forward+backward {composed:8.3} ms  ({:.1}x)",
        composed / fused
    );
    drop((x, w, b));

    // Softmax over attention scores at GPT-2-124M shapes.
    let x = Var::from_tensor(
        &Tensor::randn(0f32, 1., (16, 12, 1024, 1024), &dev)?.to_dtype(DType::BF16)?,
    )?;
    let xt = x.as_tensor();
    println!("softmax, x (16, 12, 1024, 1024) bf16, {iters} iterations");
    let fused_fwd = time_ms(&dev, iters, || {
        wick::ops::softmax_last_dim(xt)?;
        Ok(())
    })?;
    let fused = time_ms(&dev, iters, || {
        let g = wick::ops::softmax_last_dim(xt)?.backward()?;
        anyhow::ensure!(g.get(xt).is_some());
        Ok(())
    })?;
    let candle_fwd = time_ms(&dev, iters, || {
        candle_nn::ops::softmax_last_dim(xt)?;
        Ok(())
    })?;
    let composed = time_ms(&dev, iters, || {
        let g = candle_nn::ops::softmax(xt, D::Minus1)?.backward()?;
        anyhow::ensure!(g.get(xt).is_some());
        Ok(())
    })?;
    println!("  wick fused      forward {fused_fwd:8.3} ms   forward+backward {fused:8.3} ms");
    println!("  candle-nn fused forward {candle_fwd:8.3} ms   (no backward)");
    println!(
        "  candle composed                      forward+backward {composed:8.3} ms  ({:.1}x)",
        composed / fused
    );
    Ok(())
}
