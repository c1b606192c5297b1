//! GPU optimizer-step benchmark on GPT-2-124M parameter shapes (the shapes of
//! scripts/reference/torch_reference.py `optim`, so the PyTorch figures of the same run compare
//! directly): candle-nn's AdamW, wick's reference path, wick's fused multi-tensor kernel, and the
//! whole fused boundary (unscale + inf check + global norm + clip + AdamW + scaler update).
//!
//! `cargo run --release --features cuda --example bench_optim_cuda [-- --fused-only]`
//! (`--fused-only`: skip the candle-nn and reference rows).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, Optimizer as _};
use std::time::Instant;
use wick::grads::GradStats;
use wick::optim::{AdamW, AdamWConfig, Impl, Optimizer, StepInputs};
use wick::params::{Param, Role};
use wick::scaler::ScalerConfig;
use wick::{ParamStore, Precision};

fn shapes() -> Vec<Vec<usize>> {
    let (l, d, v, t) = (12, 768, 50257, 1024);
    let mut s = vec![vec![v, d], vec![t, d]];
    for _ in 0..l {
        for sh in [
            vec![d],
            vec![d],
            vec![3 * d, d],
            vec![3 * d],
            vec![d, d],
            vec![d],
            vec![d],
            vec![d],
            vec![4 * d, d],
            vec![4 * d],
            vec![d, 4 * d],
            vec![d],
        ] {
            s.push(sh);
        }
    }
    s.push(vec![d]);
    s.push(vec![d]);
    s
}

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

fn store(precision: Precision, dev: &Device) -> Result<(ParamStore, Vec<Param>)> {
    let s = ParamStore::new(precision, dev.clone(), 0);
    for (i, sh) in shapes().iter().enumerate() {
        s.get_or_init(
            &format!("p{i}"),
            sh.clone(),
            Init::Const(0.01),
            Role::Matmul,
        )?;
    }
    let p = s.params();
    Ok((s, p))
}

fn main() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    let iters = 20;
    let fused_only = std::env::args().any(|a| a == "--fused-only");
    let cfg = AdamWConfig {
        lr: 1e-4,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let (_, params) = store(Precision::Fp32, &dev)?;
    let n: usize = params.iter().map(|p| p.elem_count()).sum();
    let gb = |ms: f64| 28.0 * n as f64 / ms / 1e6;
    println!(
        "GPT-2-124M shapes: {} tensors, {n} parameters; 28 bytes/parameter for GB/s",
        params.len()
    );
    let grads: Vec<Option<Tensor>> = params
        .iter()
        .map(|p| Tensor::randn(0f32, 1.0, p.master.shape(), &dev).map(Some))
        .collect::<candle_core::Result<_>>()?;

    // candle-nn's AdamW (moments in the parameter dtype, ~18 kernels per tensor)
    if !fused_only {
        let vars: Vec<candle_core::Var> = params.iter().map(|p| p.master.clone()).collect();
        let mut store = candle_core::backprop::GradStore::default();
        for (p, g) in params.iter().zip(&grads) {
            store.insert(p.master.as_tensor(), g.clone().expect("grad"));
        }
        let mut opt = candle_nn::AdamW::new(
            vars,
            candle_nn::ParamsAdamW {
                lr: 1e-4,
                weight_decay: 0.1,
                ..Default::default()
            },
        )?;
        let ms = time_ms(&dev, iters, || Ok(opt.step(&store)?))?;
        println!(
            "candle-nn AdamW                          {ms:8.3} ms  {:7.1} GB/s",
            gb(ms)
        );
    }
    // wick reference path (candle tensor ops)
    if !fused_only {
        let mut opt = AdamW::new(cfg.clone(), Impl::Reference)?;
        let stats = GradStats::clean(1.0);
        let ms = time_ms(&dev, iters, || {
            opt.step(&params, &grads, StepInputs::host(&stats, 1e-4))
                .map(|_| ())
        })?;
        println!(
            "wick AdamW reference (unfused)           {ms:8.3} ms  {:7.1} GB/s",
            gb(ms)
        );
    }
    // wick fused multi-tensor kernel, update only
    let amp = Tensor::new(&[1f32, 0.0, 1.0], &dev)?; // [scale, growth_tracker, hysteresis_left]
    let applied = Tensor::new(&[0i64], &dev)?;
    {
        let mut opt = AdamW::new(cfg.clone(), Impl::FusedCuda)?;
        let stats = GradStats::device(Tensor::new(&[0f32, 0.0, 1.0], &dev)?);
        let inputs = StepInputs {
            stats: &stats,
            lr: 1e-4,
            seed: 0,
            stochastic_rounding: false,
        };
        let ms = time_ms(&dev, iters, || {
            opt.step(&params, &grads, inputs).map(|_| ())
        })?;
        println!(
            "wick AdamW fused (update only)           {ms:8.3} ms  {:7.1} GB/s",
            gb(ms)
        );
    }
    // the whole fused boundary, fp32 and bf16-mixed (bf16 grads in, bf16 working copies out)
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        let (_, params) = store(precision, &dev)?;
        let dt = precision.compute_dtype();
        let grads: Vec<Option<Tensor>> = params
            .iter()
            .map(|p| {
                Ok(Some(
                    Tensor::randn(0f32, 1.0, p.master.shape(), &dev)?
                        .to_dtype(if p.working.is_some() { dt } else { DType::F32 })?,
                ))
            })
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = grads.iter().flatten().collect();
        let mut opt = AdamW::new(cfg.clone(), Impl::FusedCuda)?;
        let scaler = ScalerConfig::default();
        let ms = time_ms(&dev, iters, || {
            let stats = GradStats::device(wick::cuda::grad_norm::grad_stats(
                &refs,
                &amp,
                1.0,
                Some(1.0),
                None,
                None,
            )?);
            opt.step(
                &params,
                &grads,
                StepInputs {
                    stats: &stats,
                    lr: 1e-4,
                    seed: 0,
                    stochastic_rounding: false,
                },
            )?;
            let t = stats.tensor().expect("device stats");
            wick::cuda::scaler::update_scale(&amp, &applied, t, &scaler)
        })?;
        println!(
            "wick fused boundary {:<11} (norm+clip+AdamW+scaler) {ms:8.3} ms",
            precision.name()
        );
    }
    Ok(())
}
