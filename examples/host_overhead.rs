//! Host cost of queuing GPU work through candle, per operation: what bounds a step whose
//! kernels are short (gptmini on an H200 spends as long queuing its backward as the GPU spends
//! running it). Every figure is host wall time per call on 1-element tensors (so the GPU is
//! never the bottleneck), measured after a warm-up, with one synchronisation at the end.
//!
//! ```text
//! cargo run --release --features cuda --example host_overhead [-- --iters 5000]
//! ```
//! Prints one JSON line: microseconds per call of
//! - `add`: `a + b` (allocation + one kernel launch),
//! - `zeros_add`: `zeros_like(a) + b` (what candle's `GradStore` does for each new gradient),
//! - `wick_softmax`: a wick custom op (`softmax_last_dim`, one launch through candle's
//!   `CustomOp1`),
//! - `forward_affine_per_node`: building a chain of `--chain` multiplications, per node,
//! - `backward_per_node_incl_forward`: the same chain plus `Tensor::backward`, per node.

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use clap::Parser;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Calls per measurement.
    #[arg(long, default_value_t = 5000)]
    iters: usize,
    /// Nodes in the backward chain.
    #[arg(long, default_value_t = 500)]
    chain: usize,
}

/// Mean host microseconds per call of `f` over `n` calls (after `n / 10` warm-up calls).
fn per_call(dev: &Device, n: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..n / 10 {
        f()?;
    }
    dev.synchronize()?;
    let t = Instant::now();
    for _ in 0..n {
        f()?;
    }
    let host = t.elapsed().as_secs_f64();
    dev.synchronize()?;
    Ok(host * 1e6 / n as f64)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = Device::new_cuda(0)?;
    let a = Tensor::ones(1, DType::F32, &dev)?;
    let b = Tensor::ones(1, DType::F32, &dev)?;
    let n = args.iters;

    let add = per_call(&dev, n, || {
        let _c = (&a + &b)?;
        Ok(())
    })?;
    let zeros_add = per_call(&dev, n, || {
        let _c = (a.zeros_like()? + &b)?;
        Ok(())
    })?;
    let x = Tensor::ones((1, 32), DType::F32, &dev)?;
    let wick_softmax = per_call(&dev, n, || {
        let _y = wick::ops::softmax_last_dim(&x)?;
        Ok(())
    })?;
    let v = Var::from_tensor(&a)?;
    let chain = args.chain;
    let backward = per_call(&dev, (n / chain).max(10), || {
        let mut y = v.as_tensor().clone();
        for _ in 0..chain {
            y = (y * 1.0001)?;
        }
        let _g = y.sum_all()?.backward()?;
        Ok(())
    })? / chain as f64;
    let forward_chain = per_call(&dev, (n / chain).max(10), || {
        let mut y = v.as_tensor().clone();
        for _ in 0..chain {
            y = (y * 1.0001)?;
        }
        Ok(())
    })? / chain as f64;

    let json = serde_json::json!({
        "iters": n,
        "us_per_call": {
            "add": add,
            "zeros_add": zeros_add,
            "wick_softmax": wick_softmax,
            "forward_affine_per_node": forward_chain,
            "backward_per_node_incl_forward": backward,
        },
    });
    println!("{json}");
    Ok(())
}
