//! Where a GPT training step spends GPU time, op by op: each piece of one transformer block
//! (and the embedding, head and loss) is run alone at the model's real shapes, forward then
//! forward + backward, timed with CUDA events over `--iters` repetitions, and the per-step total
//! is estimated as `n_layer x block + the rest`. Compare the estimate with `wick bench step`
//! to see what the graph adds around the ops.
//!
//! ```text
//! cargo run --release --features cuda --example profile_gpt_ops -- --model gptmini
//! ```
//! Prints a table (ms per call, forward and forward + backward) and one JSON line.

#[path = "common/gpu_time.rs"]
mod gpu_time;
use gpu_time::gpu_ms;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Module, Tensor, Var};
use clap::Parser;
use wick::models::GptConfig;
use wick::{loss, nn, ops, ParamStore, Precision};

#[derive(Parser)]
struct Args {
    /// "gptmini" or "gpt2_124m".
    #[arg(long, default_value = "gptmini")]
    model: GptConfig,
    /// Sequences per step (default: the reference batch).
    #[arg(long)]
    batch: Option<usize>,
    /// Timed repetitions per op.
    #[arg(long, default_value_t = 10)]
    iters: usize,
}

fn var(shape: &[usize], dtype: DType, dev: &Device) -> Result<Var> {
    let t = Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(dtype)?;
    Ok(Var::from_tensor(&t)?)
}

struct Row {
    name: &'static str,
    /// calls per layer; 0: once per step
    per_layer: usize,
    fwd: f64,
    fwd_bwd: f64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = Device::new_cuda(0)?;
    let c = args.model;
    let (b, t, d, h) = (
        args.batch.unwrap_or_else(|| c.reference_batch_size()),
        c.context_len,
        c.d_model,
        c.n_head,
    );
    let bf = DType::BF16;
    let store = ParamStore::new(Precision::Bf16Mixed, dev.clone(), 0);
    let ln = nn::LayerNorm::new(&store, "ln", d, 1e-5)?;
    let qkv = nn::Linear::new(&store, "qkv", d, 3 * d, true)?;
    let proj = nn::Linear::new(&store, "proj", d, d, true)?;
    let fc = nn::Linear::new(&store, "fc", d, 4 * d, true)?;
    let fc2 = nn::Linear::new(&store, "fc2", 4 * d, d, true)?;
    let wte = nn::Embedding::new(&store, "wte", c.vocab_size, d, 0.02)?;
    let b2 = fc2.bias().context("fc2 has no bias")?.clone();

    let x32 = var(&[b, t, d], DType::F32, &dev)?;
    let xbf = var(&[b, t, d], bf, &dev)?;
    let qkv_out = var(&[b, t, 3 * d], bf, &dev)?;
    let scores = var(&[b, h, t, t], bf, &dev)?;
    let hidden = var(&[b, t, 4 * d], bf, &dev)?;
    let flat = var(&[b * t, d], bf, &dev)?;
    let logits = var(&[b * t, c.vocab_size], bf, &dev)?;
    let ids = Tensor::zeros((b, t), DType::U32, &dev)?;
    let targets = Tensor::zeros(b * t, DType::U32, &dev)?;

    let cases: Vec<(&'static str, usize, Op)> = vec![
        (
            "layernorm (f32 in, bf16 out; 2 per layer)",
            2,
            Box::new(|| ln.forward_to(x32.as_tensor(), bf)),
        ),
        (
            "qkv linear (wick::ops::linear, bf16 in)",
            1,
            Box::new(|| qkv.forward(xbf.as_tensor())),
        ),
        (
            "causal attention (wick::ops::causal_attention)",
            1,
            Box::new(|| ops::causal_attention(qkv_out.as_tensor(), h)),
        ),
        ("proj linear", 1, Box::new(|| proj.forward(xbf.as_tensor()))),
        (
            "residual add (wick::ops::residual_add; 2 per layer)",
            2,
            Box::new(|| ops::residual_add(x32.as_tensor(), xbf.as_tensor())),
        ),
        ("fc linear", 1, Box::new(|| fc.forward(xbf.as_tensor()))),
        (
            "gelu + fc2 (wick::ops::act_linear, one node)",
            1,
            Box::new(|| {
                ops::act_linear(
                    hidden.as_tensor(),
                    fc2.weight(),
                    &b2,
                    ops::Activation::GeluTanh,
                )
            }),
        ),
        (
            "embedding + positions",
            0,
            Box::new(|| {
                wte.forward(&ids)?
                    .to_dtype(DType::F32)?
                    .broadcast_add(&x32.narrow(0, 0, 1)?)
            }),
        ),
        (
            "tied head + cross-entropy (wick::ops::linear_cross_entropy_rows)",
            0,
            Box::new(|| {
                ops::linear_cross_entropy_rows(flat.as_tensor(), &wte_weight(&store)?, &targets)
            }),
        ),
    ];
    // printed for comparison, not part of the step estimate
    let comparisons: Vec<(&'static str, usize, Op)> = vec![
        (
            "gelu alone (wick::ops::gelu_tanh)",
            1,
            Box::new(|| ops::gelu_tanh(hidden.as_tensor())),
        ),
        (
            "fc2 linear alone",
            1,
            Box::new(|| fc2.forward(hidden.as_tensor())),
        ),
        (
            "tied head matmul",
            0,
            Box::new(|| flat.matmul(&wte_weight(&store)?.t()?)),
        ),
        (
            "cross-entropy",
            0,
            Box::new(|| loss::cross_entropy(logits.as_tensor(), &targets)),
        ),
        (
            "residual composed (bf16 -> f32 cast + add)",
            2,
            Box::new(|| x32.as_tensor() + xbf.to_dtype(DType::F32)?),
        ),
        (
            "attention composed (split, q k^T, causal softmax, @ v, merge)",
            1,
            Box::new(|| ops::causal_attention_composed(qkv_out.as_tensor(), h)),
        ),
        (
            "  of which causal softmax on (B, H, T, T)",
            1,
            Box::new(|| ops::causal_softmax_last_dim(scores.as_tensor())),
        ),
        (
            "bias-style sum over rows (candle sum_keepdim(0))",
            1,
            Box::new(|| qkv_out.reshape((b * t, 3 * d))?.sum_keepdim(0)),
        ),
        (
            "the same sum as a matmul (ones @ x)",
            1,
            Box::new(|| {
                let ones = Tensor::ones((1, b * t), bf, &dev)?;
                ones.matmul(&qkv_out.reshape((b * t, 3 * d))?)
            }),
        ),
    ];

    let rows = measure(&dev, args.iters, &cases)?;
    let extra = measure(&dev, args.iters, &comparisons)?;
    println!(
        "GPT {c}, batch {b} x {t}, bf16-mixed; GPU ms per call (CUDA events, {} calls)",
        args.iters
    );
    println!(
        "{:<48}{:>10}{:>12}{:>14}",
        "op", "fwd", "fwd+bwd", "per step"
    );
    let per_step = |r: &Row| {
        r.fwd_bwd
            * if r.per_layer > 0 {
                (r.per_layer * c.n_layer) as f64
            } else {
                1.0
            }
    };
    let print = |r: &Row| {
        println!(
            "{:<48}{:>10.3}{:>12.3}{:>14.3}",
            r.name,
            r.fwd,
            r.fwd_bwd,
            per_step(r)
        )
    };
    rows.iter().for_each(print);
    let total: f64 = rows.iter().map(per_step).sum();
    println!("{:<48}{:>36.3}", "estimated step (ops alone)", total);
    println!("for comparison (not in the estimate):");
    extra.iter().for_each(print);
    let json = serde_json::json!({
        "model": c,
        "batch": b,
        "ops_ms": rows.iter().map(|r| serde_json::json!({
            "op": r.name, "per_layer": r.per_layer, "fwd": r.fwd, "fwd_bwd": r.fwd_bwd
        })).collect::<Vec<_>>(),
        "estimated_step_ms": total,
        "comparisons_ms": extra.iter().map(|r| serde_json::json!({
            "op": r.name, "per_layer": r.per_layer, "fwd": r.fwd, "fwd_bwd": r.fwd_bwd
        })).collect::<Vec<_>>(),
    });
    println!("{json}");
    Ok(())
}

type Op<'a> = Box<dyn Fn() -> candle_core::Result<Tensor> + 'a>;

/// Forward and forward+backward time of each op.
fn measure(dev: &Device, iters: usize, ops: &[(&'static str, usize, Op)]) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (name, per_layer, op) in ops {
        let fwd = gpu_ms(dev, 2, iters, &|| {
            op()?;
            Ok(())
        })?;
        let fwd_bwd = gpu_ms(dev, 2, iters, &|| {
            // backward from y itself (candle seeds it with ones): no reduction to a scalar,
            // whose one-block candle kernel would dominate the figures
            let _g = op()?.backward()?;
            Ok(())
        })?;
        rows.push(Row {
            name,
            per_layer: *per_layer,
            fwd,
            fwd_bwd,
        });
    }
    Ok(rows)
}

/// The embedding table's working copy (bf16), as the tied head uses it.
fn wte_weight(store: &ParamStore) -> candle_core::Result<Tensor> {
    let p = store
        .get("wte.weight")
        .ok_or_else(|| candle_core::Error::Msg("wte.weight missing".into()))?;
    Ok(p.differentiated().clone())
}
