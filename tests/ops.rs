//! The fused ops of `wick::ops` against their composed candle-op versions
//! (`candle_nn::ops::layer_norm_slow`, `rms_norm_slow`, `softmax`): forward values and the
//! gradients of every argument, in f32, bf16 and f16, on the CPU. With `--features cuda` (on a
//! machine with a GPU) the CUDA kernels are also compared against the CPU, on shapes that take
//! every kernel path. Every comparison prints its max error (`cargo test --test ops --
//! --nocapture`); errors are relative to the reference's largest magnitude (at least 1).

mod common;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use rand::{Rng, SeedableRng};
use wick::ops::{self, Activation};

const EPS: f64 = 1e-5;

/// Uniform values in `[lo, hi)` from a seeded generator, as `dtype` on `dev`.
fn rand_t(shape: &[usize], lo: f32, hi: f32, seed: u64, dtype: DType, dev: &Device) -> Tensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(lo..hi)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.to_device(dev))
        .unwrap()
}

/// Max |a - b| over max(1, max |b|), both read back as f32 on the CPU.
fn err(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let b = b
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let diff: f32 = (&a - &b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap();
    let scale: f32 = b
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap();
    if diff.is_nan() {
        return f32::INFINITY;
    }
    diff / scale.max(1.0)
}

/// Errors as `[1.2e-6, ...]`.
fn fmt_errs(e: &[f32]) -> String {
    let v: Vec<String> = e.iter().map(|x| format!("{x:.2e}")).collect();
    format!("[{}]", v.join(", "))
}

/// `y = f(args)` and the gradients of `sum(y * r)` with respect to every argument.
fn value_and_grads(
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    args: &[Tensor],
    r: &Tensor,
) -> Result<(Tensor, Vec<Tensor>)> {
    let vars = args
        .iter()
        .map(Var::from_tensor)
        .collect::<Result<Vec<_>>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts)?;
    let loss = y.to_dtype(DType::F32)?.mul(r)?.sum_all()?;
    let g = loss.backward()?;
    let grads = vars
        .iter()
        .enumerate()
        .map(|(i, v)| {
            g.get(v)
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg(format!("argument {i} got no gradient")))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((y, grads))
}

fn ln_fused(a: &[Tensor]) -> Result<Tensor> {
    ops::layer_norm(&a[0], &a[1], &a[2], EPS)
}
fn ln_ref(a: &[Tensor]) -> Result<Tensor> {
    candle_nn::ops::layer_norm_slow(&a[0].to_dtype(DType::F32)?, &a[1], &a[2], EPS as f32)
}
fn rms_fused(a: &[Tensor]) -> Result<Tensor> {
    ops::rms_norm(&a[0], &a[1], EPS)
}
fn rms_ref(a: &[Tensor]) -> Result<Tensor> {
    candle_nn::ops::rms_norm_slow(&a[0].to_dtype(DType::F32)?, &a[1], EPS as f32)
}
fn sm_fused(a: &[Tensor]) -> Result<Tensor> {
    ops::softmax_last_dim(&a[0])
}
fn sm_ref(a: &[Tensor]) -> Result<Tensor> {
    candle_nn::ops::softmax(&a[0].to_dtype(DType::F32)?, D::Minus1)
}

fn causal_fused(a: &[Tensor]) -> Result<Tensor> {
    ops::causal_softmax_last_dim(&a[0])
}
/// softmax(x + mask) in f32 with the `(T, T)` causal mask (-inf above the diagonal).
fn causal_ref(a: &[Tensor]) -> Result<Tensor> {
    let t = a[0].dim(D::Minus1)?;
    let mask = common::causal_mask(t, a[0].device());
    candle_nn::ops::softmax(&a[0].to_dtype(DType::F32)?.broadcast_add(&mask)?, D::Minus1)
}
fn gelu_fused(a: &[Tensor]) -> Result<Tensor> {
    ops::gelu_tanh(&a[0])
}
/// candle's composed, differentiable GELU (tanh approximation), in f32.
fn gelu_ref(a: &[Tensor]) -> Result<Tensor> {
    a[0].to_dtype(DType::F32)?.gelu()
}
fn gelu_erf_fused(a: &[Tensor]) -> Result<Tensor> {
    ops::gelu_erf(&a[0])
}
/// candle's composed, differentiable exact GELU (`gelu_erf`, whose backward is built from
/// erf and exp nodes), in f32.
fn gelu_erf_ref(a: &[Tensor]) -> Result<Tensor> {
    a[0].to_dtype(DType::F32)?.gelu_erf()
}
/// Key lengths of the padding-mask tests: batch entry b has `1 + (b * 7 + 3) % tk` keys.
fn key_lengths(b: usize, tk: usize) -> Vec<usize> {
    (0..b).map(|i| 1 + (i * 7 + 3) % tk).collect()
}
fn padded_fused(a: &[Tensor]) -> Result<Tensor> {
    let b = a[0].dim(0)?;
    ops::key_padding_softmax_last_dim(&a[0], &key_lengths(b, a[0].dim(D::Minus1)?))
}
/// softmax(x + mask) in f32 with transformers' additive BERT mask (`f32::MIN` on padded keys).
fn padded_ref(a: &[Tensor]) -> Result<Tensor> {
    let dims = a[0].dims().to_vec();
    let (b, tk) = (dims[0], dims[dims.len() - 1]);
    let mut mask = Vec::with_capacity(b * tk);
    for l in key_lengths(b, tk) {
        mask.extend((0..tk).map(|j| if j < l { 0f32 } else { f32::MIN }));
    }
    let mut mshape = vec![1usize; dims.len()];
    mshape[0] = b;
    mshape[dims.len() - 1] = tk;
    let mask = Tensor::from_vec(mask, mshape, a[0].device())?;
    candle_nn::ops::softmax(&a[0].to_dtype(DType::F32)?.broadcast_add(&mask)?, D::Minus1)
}
/// Per-row cross-entropy through candle's log_softmax and gather, in f32.
fn ce_ref(x: &Tensor, t: &Tensor) -> Result<Tensor> {
    let logp = candle_nn::ops::log_softmax(&x.to_dtype(DType::F32)?, D::Minus1)?;
    logp.gather(&t.unsqueeze(1)?, 1)?.squeeze(1)?.neg()
}
/// Class indices in `0..c`, seeded.
fn targets(n: usize, c: usize, seed: u64, dev: &Device) -> Tensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let v: Vec<u32> = (0..n).map(|_| rng.random_range(0..c as u32)).collect();
    Tensor::from_vec(v, n, dev).unwrap()
}

/// Error bound relative to the reference's scale: the rounding of the storage dtype plus
/// margin for f32 summation order.
fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 2e-5,
        DType::F16 => 3e-3,
        _ => 2e-2, // bf16: 8 mantissa bits
    }
}

/// Arguments of a norm test: x (offset so that the mean matters), gains, biases, and r.
fn norm_args(shape: &[usize], dtype: DType, seed: u64, dev: &Device) -> (Vec<Tensor>, Tensor) {
    let d = *shape.last().unwrap();
    let x = rand_t(shape, 1.0, 5.0, seed, dtype, dev);
    let w = rand_t(&[d], 0.5, 1.5, seed + 1, DType::F32, dev);
    let b = rand_t(&[d], -0.5, 0.5, seed + 2, DType::F32, dev);
    let r = rand_t(shape, -1.0, 1.0, seed + 3, DType::F32, dev);
    (vec![x, w, b], r)
}

/// Compares fused and composed on one input; returns the errors (y, then each gradient).
fn compare(
    name: &str,
    fused: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    reference: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    args: &[Tensor],
    r: &Tensor,
) -> Result<Vec<f32>> {
    let (y, g) = value_and_grads(fused, args, r)?;
    let (y_ref, g_ref) = value_and_grads(reference, args, r)?;
    assert_eq!(y.dtype(), args[0].dtype(), "{name}: output dtype");
    for (gi, ai) in g.iter().zip(args) {
        assert_eq!(
            (gi.dims(), gi.dtype()),
            (ai.dims(), ai.dtype()),
            "{name}: gradient shape/dtype"
        );
    }
    let mut errs = vec![err(&y, &y_ref)];
    errs.extend(g.iter().zip(&g_ref).map(|(a, b)| err(a, b)));
    println!("{name}: max error y, grads = {}", fmt_errs(&errs));
    Ok(errs)
}

/// [`compare`] without the dtype checks (for arguments that are views or casts).
fn compare_any(
    name: &str,
    fused: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    reference: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    args: &[Tensor],
    r: &Tensor,
) -> Result<Vec<f32>> {
    let (y, g) = value_and_grads(fused, args, r)?;
    let (y_ref, g_ref) = value_and_grads(reference, args, r)?;
    let mut errs = vec![err(&y, &y_ref)];
    errs.extend(g.iter().zip(&g_ref).map(|(a, b)| err(a, b)));
    println!("{name}: max error y, grads = {}", fmt_errs(&errs));
    Ok(errs)
}

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

#[test]
fn layer_norm_matches_composed_on_cpu() -> Result<()> {
    for dtype in DTYPES {
        for (i, shape) in [&[4usize, 96][..], &[2, 3, 37], &[70, 768], &[5, 1]]
            .iter()
            .enumerate()
        {
            let (args, r) = norm_args(shape, dtype, 10 * i as u64, &Device::Cpu);
            let name = format!("layer_norm {dtype:?} {shape:?}");
            let errs = compare(&name, &ln_fused, &ln_ref, &args, &r)?;
            assert!(errs.iter().all(|e| *e <= tol(dtype)), "{name}: {errs:?}");
        }
    }
    Ok(())
}

#[test]
fn rms_norm_matches_composed_on_cpu() -> Result<()> {
    for dtype in DTYPES {
        for (i, shape) in [&[4usize, 96][..], &[2, 3, 37], &[70, 768]]
            .iter()
            .enumerate()
        {
            let (args, r) = norm_args(shape, dtype, 100 + 10 * i as u64, &Device::Cpu);
            let args = &args[..2];
            let name = format!("rms_norm {dtype:?} {shape:?}");
            let errs = compare(&name, &rms_fused, &rms_ref, args, &r)?;
            assert!(errs.iter().all(|e| *e <= tol(dtype)), "{name}: {errs:?}");
        }
    }
    Ok(())
}

#[test]
fn softmax_matches_composed_on_cpu() -> Result<()> {
    for dtype in DTYPES {
        for (i, shape) in [&[4usize, 96][..], &[2, 3, 37], &[64, 1024], &[3, 1]]
            .iter()
            .enumerate()
        {
            let x = rand_t(shape, -8.0, 8.0, 200 + i as u64, dtype, &Device::Cpu);
            let r = rand_t(shape, -1.0, 1.0, 300 + i as u64, DType::F32, &Device::Cpu);
            let name = format!("softmax {dtype:?} {shape:?}");
            let errs = compare(&name, &sm_fused, &sm_ref, &[x], &r)?;
            assert!(errs.iter().all(|e| *e <= tol(dtype)), "{name}: {errs:?}");
        }
    }
    Ok(())
}

#[test]
fn softmax_handles_masked_entries() -> Result<()> {
    // An attention-style mask: -inf in part of each row (never a whole row).
    let x = rand_t(&[6, 40], -3.0, 3.0, 7, DType::F32, &Device::Cpu);
    let mask: Vec<f32> = (0..6 * 40)
        .map(|i| {
            if i % 40 > 5 + i / 40 {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    let x = (x + Tensor::from_vec(mask, (6, 40), &Device::Cpu)?)?;
    let r = rand_t(&[6, 40], -1.0, 1.0, 8, DType::F32, &Device::Cpu);
    let errs = compare("softmax masked", &sm_fused, &sm_ref, &[x], &r)?;
    assert!(errs.iter().all(|e| *e <= 1e-5), "{errs:?}");
    Ok(())
}

#[test]
fn causal_softmax_matches_masked_composed_on_cpu() -> Result<()> {
    for dtype in DTYPES {
        for (i, shape) in [&[2usize, 3, 16, 16][..], &[1, 37, 37], &[64, 64], &[1, 1]]
            .iter()
            .enumerate()
        {
            let x = rand_t(shape, -8.0, 8.0, 400 + i as u64, dtype, &Device::Cpu);
            let r = rand_t(shape, -1.0, 1.0, 500 + i as u64, DType::F32, &Device::Cpu);
            let name = format!("causal softmax {dtype:?} {shape:?}");
            let errs = compare(
                &name,
                &causal_fused,
                &causal_ref,
                std::slice::from_ref(&x),
                &r,
            )?;
            assert!(errs.iter().all(|e| *e <= tol(dtype)), "{name}: {errs:?}");
            // above the diagonal: exactly 0 (never read)
            let y = ops::causal_softmax_last_dim(&x)?.to_dtype(DType::F32)?;
            let t = shape[shape.len() - 1];
            let rows: Vec<Vec<f32>> = y.reshape(((), t))?.to_vec2()?;
            for (r, row) in rows.iter().enumerate() {
                assert!(
                    row[r % t + 1..].iter().all(|v| *v == 0.0),
                    "{name}: row {r}"
                );
                let s: f32 = row.iter().sum();
                assert!((s - 1.0).abs() < 1e-2, "{name}: row {r} sums to {s}");
            }
        }
    }
    let bad = Tensor::zeros((3, 4), DType::F32, &Device::Cpu)?;
    let e = ops::causal_softmax_last_dim(&bad).unwrap_err().to_string();
    assert!(e.contains("(.., T, T)"), "{e}");
    Ok(())
}

#[test]
fn gelu_matches_candles_composed_gelu_on_cpu() -> Result<()> {
    for dtype in DTYPES {
        for (i, shape) in [&[4usize, 96][..], &[3, 37], &[1]].iter().enumerate() {
            let x = rand_t(shape, -6.0, 6.0, 900 + i as u64, dtype, &Device::Cpu);
            let r = rand_t(shape, -1.0, 1.0, 950 + i as u64, DType::F32, &Device::Cpu);
            let name = format!("gelu {dtype:?} {shape:?}");
            let errs = compare(&name, &gelu_fused, &gelu_ref, &[x], &r)?;
            assert!(errs.iter().all(|e| *e <= tol(dtype)), "{name}: {errs:?}");
        }
    }
    // closed form: gelu(0) = 0, gelu'(0) = 0.5; large |x|: x or 0
    let x = Var::new(&[0f32, 10.0, -10.0], &Device::Cpu)?;
    let y = ops::gelu_tanh(x.as_tensor())?;
    assert_eq!(y.to_vec1::<f32>()?, vec![0.0, 10.0, -0.0]);
    let g = y.sum_all()?.backward()?;
    let dx = g.get(&x).unwrap().to_vec1::<f32>()?;
    assert_eq!(dx, vec![0.5, 1.0, 0.0]);
    Ok(())
}

#[test]
fn gelu_erf_matches_candles_composed_gelu_erf_on_cpu() -> Result<()> {
    for dtype in DTYPES {
        for (i, shape) in [&[4usize, 96][..], &[3, 37], &[1]].iter().enumerate() {
            let x = rand_t(shape, -6.0, 6.0, 960 + i as u64, dtype, &Device::Cpu);
            let r = rand_t(shape, -1.0, 1.0, 970 + i as u64, DType::F32, &Device::Cpu);
            let name = format!("gelu_erf {dtype:?} {shape:?}");
            let errs = compare(&name, &gelu_erf_fused, &gelu_erf_ref, &[x], &r)?;
            assert!(errs.iter().all(|e| *e <= tol(dtype)), "{name}: {errs:?}");
        }
    }
    // closed form: gelu(1) = Phi(1) = 0.8413447, gelu'(1) = Phi(1) + phi(1) = 0.8413447 + 0.2419707
    let x = Var::new(&[1f32, 0.0], &Device::Cpu)?;
    let y = ops::gelu_erf(x.as_tensor())?;
    let yv = y.to_vec1::<f32>()?;
    assert!((yv[0] - 0.841_344_7).abs() < 1e-6 && yv[1] == 0.0, "{yv:?}");
    let dx = y.sum_all()?.backward()?.get(&x).unwrap().to_vec1::<f32>()?;
    assert!(
        (dx[0] - 1.083_315_4).abs() < 1e-6 && (dx[1] - 0.5).abs() < 1e-7,
        "{dx:?}"
    );
    Ok(())
}

#[test]
fn key_padding_softmax_matches_the_additive_mask_on_cpu() -> Result<()> {
    for dtype in DTYPES {
        for (i, shape) in [&[3usize, 2, 5, 16][..], &[4, 3, 37], &[2, 1]]
            .iter()
            .enumerate()
        {
            let x = rand_t(shape, -8.0, 8.0, 1400 + i as u64, dtype, &Device::Cpu);
            let r = rand_t(shape, -1.0, 1.0, 1500 + i as u64, DType::F32, &Device::Cpu);
            let name = format!("key-padding softmax {dtype:?} {shape:?}");
            let errs = compare(
                &name,
                &padded_fused,
                &padded_ref,
                std::slice::from_ref(&x),
                &r,
            )?;
            assert!(errs.iter().all(|e| *e <= tol(dtype)), "{name}: {errs:?}");
            // padded keys: exactly 0
            let tk = shape[shape.len() - 1];
            let lens = key_lengths(shape[0], tk);
            let y = padded_fused(std::slice::from_ref(&x))?.to_dtype(DType::F32)?;
            let rows: Vec<Vec<f32>> = y.reshape(((), tk))?.to_vec2()?;
            let per_entry = rows.len() / shape[0];
            for (r, row) in rows.iter().enumerate() {
                assert!(
                    row[lens[r / per_entry]..].iter().all(|v| *v == 0.0),
                    "{name}: row {r}"
                );
            }
        }
    }
    let x = Tensor::zeros((2, 3, 4), DType::F32, &Device::Cpu)?;
    let e = ops::key_padding_softmax_last_dim(&x, &[4])
        .unwrap_err()
        .to_string();
    assert!(e.contains("1 key lengths for a batch of 2"), "{e}");
    let e = ops::key_padding_softmax_last_dim(&x, &[4, 5])
        .unwrap_err()
        .to_string();
    assert!(e.contains("key_lengths[1] = 5"), "{e}");
    let e = ops::key_padding_softmax_last_dim(&x, &[0, 1])
        .unwrap_err()
        .to_string();
    assert!(e.contains("key_lengths[0] = 0"), "{e}");
    Ok(())
}

fn bias_fused(a: &[Tensor]) -> Result<Tensor> {
    ops::bias_add(&a[0], &a[1])
}
fn bias_ref(a: &[Tensor]) -> Result<Tensor> {
    a[0].to_dtype(DType::F32)?
        .broadcast_add(&a[1].to_dtype(DType::F32)?)
}

#[test]
fn bias_add_matches_broadcast_add_on_cpu() -> Result<()> {
    for dtype in DTYPES {
        for (i, shape) in [&[4usize, 96][..], &[2, 3, 37], &[1, 8]].iter().enumerate() {
            let c = *shape.last().unwrap();
            let x = rand_t(shape, -2.0, 2.0, 1100 + i as u64, dtype, &Device::Cpu);
            let b = rand_t(&[c], -2.0, 2.0, 1150 + i as u64, dtype, &Device::Cpu);
            let r = rand_t(shape, -1.0, 1.0, 1180 + i as u64, DType::F32, &Device::Cpu);
            let name = format!("bias_add {dtype:?} {shape:?}");
            let errs = compare(&name, &bias_fused, &bias_ref, &[x, b], &r)?;
            // db sums up to 6 rows of bf16 gradients: allow the sum's rounding
            assert!(
                errs.iter().all(|e| *e <= 2.0 * tol(dtype)),
                "{name}: {errs:?}"
            );
        }
    }
    let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?;
    let e = ops::bias_add(&x, &Tensor::zeros(4, DType::F32, &Device::Cpu)?)
        .unwrap_err()
        .to_string();
    assert!(e.contains("b must be (C,)"), "{e}");
    Ok(())
}

#[test]
fn embedding_matches_index_select_on_cpu() -> Result<()> {
    for dtype in DTYPES {
        // repeated ids: the scatter-add must sum them
        let ids = Tensor::new(&[[3u32, 1, 3, 0], [2, 3, 3, 1]], &Device::Cpu)?;
        let table = rand_t(&[5, 8], -1.0, 1.0, 1200, dtype, &Device::Cpu);
        let r = rand_t(&[2, 4, 8], -1.0, 1.0, 1201, DType::F32, &Device::Cpu);
        let name = format!("embedding {dtype:?}");
        let fused = |a: &[Tensor]| ops::embedding(&ids, &a[0]);
        let reference = |a: &[Tensor]| {
            let flat = ids.flatten_all()?;
            a[0].to_dtype(DType::F32)?
                .index_select(&flat, 0)?
                .reshape((2, 4, 8))
        };
        let errs = compare_any(&name, &fused, &reference, &[table], &r)?;
        assert!(errs.iter().all(|e| *e <= tol(dtype)), "{name}: {errs:?}");
    }
    let table = Tensor::zeros((3, 2), DType::F32, &Device::Cpu)?;
    let e = ops::embedding(&Tensor::new(&[0u32, 3], &Device::Cpu)?, &table)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("id 3 at position 1") && e.contains("3 rows"),
        "{e}"
    );
    Ok(())
}

/// `act_linear(h, w, b, act)` against its two-op composition `linear(act(h), w, b)` (the same
/// kernels: equal bit for bit, value and every gradient) and against candle's composed
/// activation and matmul in f32 (an independent reference, within the dtype's rounding).
/// The inputs never hold an exact 0, where ReLU's gradient conventions differ (tested below).
fn act_linear_args(
    n: usize,
    k: usize,
    o: usize,
    dtype: DType,
    dev: &Device,
) -> (Vec<Tensor>, Tensor) {
    let h = rand_t(&[2, n, k], -4.0, 4.0, 1400 + n as u64, dtype, dev);
    let w = rand_t(&[o, k], -0.3, 0.3, 1401, dtype, dev);
    let b = rand_t(&[o], -0.5, 0.5, 1402, dtype, dev);
    let r = rand_t(&[2, n, o], -1.0, 1.0, 1403, DType::F32, dev);
    (vec![h, w, b], r)
}
const ACTIVATIONS: [Activation; 3] = [Activation::GeluTanh, Activation::GeluErf, Activation::Relu];
fn act_linear_fused(act: Activation) -> impl Fn(&[Tensor]) -> Result<Tensor> {
    move |a: &[Tensor]| ops::act_linear(&a[0], &a[1], &a[2], act)
}
/// wick's activation op, then wick's linear: the two-op composition.
fn act_linear_two_ops(act: Activation) -> impl Fn(&[Tensor]) -> Result<Tensor> {
    move |a: &[Tensor]| {
        let g = match act {
            Activation::GeluTanh => ops::gelu_tanh(&a[0])?,
            Activation::GeluErf => ops::gelu_erf(&a[0])?,
            Activation::Relu => a[0].relu()?,
        };
        ops::linear(&g, &a[1], Some(&a[2]))
    }
}
/// candle's own activation and matmul, in f32.
fn act_linear_ref(act: Activation) -> impl Fn(&[Tensor]) -> Result<Tensor> {
    move |a: &[Tensor]| {
        let f = |t: &Tensor| t.to_dtype(DType::F32);
        let h = f(&a[0])?;
        let g = match act {
            Activation::GeluTanh => h.gelu()?,
            Activation::GeluErf => h.gelu_erf()?,
            Activation::Relu => h.relu()?,
        };
        g.broadcast_matmul(&f(&a[1])?.t()?)?
            .broadcast_add(&f(&a[2])?)
    }
}
fn gelu_linear_fused(a: &[Tensor]) -> Result<Tensor> {
    ops::gelu_linear(&a[0], &a[1], &a[2])
}

#[test]
fn act_linear_equals_its_composition_and_candles_ops_on_cpu() -> Result<()> {
    for act in ACTIVATIONS {
        for dtype in DTYPES {
            for &(n, k, o) in &[(5usize, 64usize, 16usize), (1, 7, 3)] {
                let (args, r) = act_linear_args(n, k, o, dtype, &Device::Cpu);
                let name = format!("act_linear {act:?} {dtype:?} ({n}, {k}) -> {o}");
                let fused = act_linear_fused(act);
                let exact = compare(&name, &fused, &act_linear_two_ops(act), &args, &r)?;
                assert!(
                    exact.iter().all(|e| *e == 0.0),
                    "{name} vs two ops: {exact:?}"
                );
                let errs = compare_any(&name, &fused, &act_linear_ref(act), &args, &r)?;
                assert!(
                    errs.iter().all(|e| *e <= 2.0 * tol(dtype)),
                    "{name}: {errs:?}"
                );
            }
        }
    }
    // gelu_linear is act_linear with the exact GELU
    let (args, r) = act_linear_args(5, 64, 16, DType::F32, &Device::Cpu);
    let same = compare(
        "gelu_linear",
        &gelu_linear_fused,
        &act_linear_fused(Activation::GeluErf),
        &args,
        &r,
    )?;
    assert!(same.iter().all(|e| *e == 0.0), "{same:?}");
    Ok(())
}

/// ReLU's gradient at exactly 0 is 0, as PyTorch's `threshold_backward` (closed form: with
/// w = I and b = 0, y = relu(h), dL/dh = r where h > 0, else 0, and dL/db = r).
#[test]
fn act_linear_relu_gradient_is_zero_at_zero() -> Result<()> {
    let h = Var::new(&[[-1f32, 0.0, 2.0, 0.0]], &Device::Cpu)?;
    let w = Var::new(
        &[
            [1f32, 0., 0., 0.],
            [0., 1., 0., 0.],
            [0., 0., 1., 0.],
            [0., 0., 0., 1.],
        ],
        &Device::Cpu,
    )?;
    let b = Var::zeros(4, DType::F32, &Device::Cpu)?;
    let r = Tensor::new(&[[3f32, 5.0, 7.0, 11.0]], &Device::Cpu)?;
    let y = ops::act_linear(
        h.as_tensor(),
        w.as_tensor(),
        b.as_tensor(),
        Activation::Relu,
    )?;
    assert_eq!(y.to_vec2::<f32>()?, vec![vec![0.0, 0.0, 2.0, 0.0]]);
    let g = wick::grad_sink::backward(&(y * &r)?.sum_all()?)?;
    assert_eq!(
        g.get(&h).unwrap().to_vec2::<f32>()?,
        vec![vec![0.0, 0.0, 7.0, 0.0]]
    );
    assert_eq!(
        g.get(&b).unwrap().to_vec1::<f32>()?,
        vec![3.0, 5.0, 7.0, 11.0]
    );
    Ok(())
}

#[test]
fn gelu_linear_errors_and_empty_shapes() -> Result<()> {
    let (args, _) = act_linear_args(3, 8, 4, DType::F32, &Device::Cpu);
    let e = ops::gelu_linear(&args[0], &args[1].t()?.contiguous()?, &args[2])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("gelu_linear(h, w, b)") && e.contains("[8, 4]"),
        "{e}"
    );
    // empty inner dimension: the composition's special case, zeros plus the bias, no panic
    let h = Var::zeros((2, 3, 0), DType::F32, &Device::Cpu)?;
    let w = Var::zeros((4, 0), DType::F32, &Device::Cpu)?;
    let b = Var::new(&[1f32, 2., 3., 4.], &Device::Cpu)?;
    let y = ops::gelu_linear(h.as_tensor(), w.as_tensor(), b.as_tensor())?;
    assert_eq!(y.dims(), &[2, 3, 4]);
    assert_eq!(y.sum_all()?.to_scalar::<f32>()?, 60.0);
    let g = wick::grad_sink::backward(&y.sum_all()?)?;
    assert_eq!(g.get(&b).unwrap().to_vec1::<f32>()?, vec![6.0; 4]);
    Ok(())
}

/// `wick::grad_sink::backward` (the engine's backward) gives every leaf the gradient candle's
/// own backward gives: a table both looked up and tied to an output matmul (its two
/// contributions summed), a table looked up twice, the weights and biases of a linear layer
/// used twice, a LayerNorm's gain and bias, and a weight only candle's own ops touch.
#[test]
fn grad_sink_backward_equals_candles_backward() -> Result<()> {
    let dev = Device::Cpu;
    let ids = Tensor::new(&[[3u32, 1, 3, 0], [2, 4, 4, 1]], &dev)?;
    let var =
        |shape: &[usize], seed| Var::from_tensor(&rand_t(shape, -1.0, 1.0, seed, DType::F32, &dev));
    let (tied, pos) = (var(&[5, 8], 1300)?, var(&[5, 8], 1301)?);
    let (w, b, m) = (var(&[8, 8], 1302)?, var(&[8], 1304)?, var(&[8, 8], 1305)?);
    let (gain, shift) = (var(&[8], 1306)?, var(&[8], 1307)?);
    let r = rand_t(&[2, 4, 5], -1.0, 1.0, 1303, DType::F32, &dev);
    let loss = || -> Result<Tensor> {
        let p_ids = Tensor::new(&[[0u32, 1, 2, 3], [0, 1, 2, 3]], &dev)?;
        let x = (ops::embedding(&ids, tied.as_tensor())?
            + ops::embedding(&p_ids, pos.as_tensor())?
            + ops::embedding(&ids, pos.as_tensor())?)?;
        let x = ops::layer_norm(&x, gain.as_tensor(), shift.as_tensor(), 1e-5)?;
        let h = ops::linear(&x, w.as_tensor(), Some(b.as_tensor()))?.tanh()?;
        let h = ops::linear(&h, w.as_tensor(), Some(b.as_tensor()))?;
        let h = h.broadcast_matmul(m.as_tensor())?;
        let logits = h.broadcast_matmul(&tied.as_tensor().t()?)?;
        (logits * &r)?.sum_all()
    };
    let want = loss()?.backward()?;
    let got = wick::grad_sink::backward(&loss()?)?;
    let all = [
        ("tied", &tied),
        ("pos", &pos),
        ("w", &w),
        ("b", &b),
        ("m", &m),
        ("gain", &gain),
        ("shift", &shift),
    ];
    for (name, v) in all {
        let (a, b) = (want.get(v).unwrap(), got.get(v).expect(name));
        let d = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = a.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            scale > 0.0 && d <= 1e-6 * scale,
            "{name}: max |diff| {d} (scale {scale})"
        );
    }
    Ok(())
}

/// candle's composition for the heads: narrow, reshape, transpose, contiguous.
fn split_ref(qkv: &Tensor, h: usize) -> Result<Tensor> {
    let (b, t, c3) = qkv.dims3()?;
    let c = c3 / 3;
    let parts = (0..3)
        .map(|i| {
            qkv.narrow(2, i * c, c)?
                .reshape((b, t, h, c / h))?
                .transpose(1, 2)?
                .contiguous()
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::stack(&parts, 0)
}
fn merge_ref(y: &Tensor) -> Result<Tensor> {
    let (b, h, t, dh) = y.dims4()?;
    y.transpose(1, 2)?.reshape((b, t, h * dh))
}

#[test]
fn split_and_merge_heads_match_the_composed_copies_on_cpu() -> Result<()> {
    for dtype in DTYPES {
        for &(b, t, h, dh) in &[
            (2usize, 5usize, 3usize, 4usize),
            (1, 1, 1, 1),
            (3, 7, 2, 64),
        ] {
            let qkv = rand_t(&[b, t, 3 * h * dh], -1.0, 1.0, 11, dtype, &Device::Cpu);
            let r = rand_t(&[3, b, h, t, dh], -1.0, 1.0, 12, DType::F32, &Device::Cpu);
            let name = format!("split_heads {dtype:?} ({b}, {t}, 3x{h}x{dh})");
            let fused = |a: &[Tensor]| ops::split_heads(&a[0], h);
            let reference = |a: &[Tensor]| split_ref(&a[0], h);
            let errs = compare(&name, &fused, &reference, &[qkv], &r)?;
            assert!(
                errs.iter().all(|e| *e == 0.0),
                "{name}: a copy must be exact: {errs:?}"
            );
            let y = rand_t(&[b, h, t, dh], -1.0, 1.0, 13, dtype, &Device::Cpu);
            let r = rand_t(&[b, t, h * dh], -1.0, 1.0, 14, DType::F32, &Device::Cpu);
            let name = format!("merge_heads {dtype:?} ({b}, {h}, {t}, {dh})");
            let fused = |a: &[Tensor]| ops::merge_heads(&a[0]);
            let errs = compare(&name, &fused, &|a: &[Tensor]| merge_ref(&a[0]), &[y], &r)?;
            assert!(
                errs.iter().all(|e| *e == 0.0),
                "{name}: a copy must be exact: {errs:?}"
            );
        }
    }
    let bad = Tensor::zeros((2, 3, 10), DType::F32, &Device::Cpu)?;
    assert!(ops::split_heads(&bad, 2).is_err());
    assert!(ops::merge_heads(&bad).is_err());
    Ok(())
}

#[test]
fn cross_entropy_matches_log_softmax_gather_on_cpu() -> Result<()> {
    for dtype in DTYPES {
        for (i, &(n, c)) in [(8usize, 256usize), (5, 37), (3, 5000), (1, 1)]
            .iter()
            .enumerate()
        {
            let x = rand_t(&[n, c], -6.0, 6.0, 600 + i as u64, dtype, &Device::Cpu);
            let t = targets(n, c, 700 + i as u64, &Device::Cpu);
            let r = rand_t(&[n], 0.0, 2.0, 800 + i as u64, DType::F32, &Device::Cpu);
            let name = format!("cross_entropy {dtype:?} ({n}, {c})");
            let fused = |a: &[Tensor]| ops::cross_entropy_rows(&a[0], &t);
            let reference = |a: &[Tensor]| ce_ref(&a[0], &t);
            let errs = compare_any(&name, &fused, &reference, std::slice::from_ref(&x), &r)?;
            assert!(errs.iter().all(|e| *e <= tol(dtype)), "{name}: {errs:?}");
            let (y, g) = value_and_grads(&fused, &[x], &r)?;
            assert_eq!((y.dtype(), y.dims()), (DType::F32, &[n][..]), "{name}");
            assert_eq!(g[0].dtype(), dtype, "{name}: gradient dtype");
        }
    }
    // closed form: uniform logits give ln(C) for every target
    let x = Tensor::zeros((4, 10), DType::F32, &Device::Cpu)?;
    let l: Vec<f32> = ops::cross_entropy_rows(&x, &targets(4, 10, 1, &Device::Cpu))?.to_vec1()?;
    assert!(l.iter().all(|v| (v - 10f32.ln()).abs() < 1e-6), "{l:?}");
    // bad input
    let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?;
    let oob = Tensor::new(&[0u32, 3], &Device::Cpu)?;
    let e = ops::cross_entropy_rows(&x, &oob).unwrap_err().to_string();
    assert!(
        e.contains("target 3 at row 1") && e.contains("3 classes"),
        "{e}"
    );
    let e = ops::cross_entropy_rows(&x, &Tensor::new(&[0u32], &Device::Cpu)?)
        .unwrap_err()
        .to_string();
    assert!(e.contains("targets must be (N,)"), "{e}");
    Ok(())
}

#[test]
fn cross_entropy_mean_is_the_rows_mean_in_one_node() -> Result<()> {
    for dtype in DTYPES {
        for (i, &(n, c)) in [(8usize, 256usize), (5, 37), (1300, 10), (1, 1)]
            .iter()
            .enumerate()
        {
            let x = rand_t(&[n, c], -6.0, 6.0, 610 + i as u64, dtype, &Device::Cpu);
            let t = targets(n, c, 710 + i as u64, &Device::Cpu);
            let name = format!("cross_entropy_mean {dtype:?} ({n}, {c})");
            let r = Tensor::new(1.75f32, &Device::Cpu)?;
            let fused = |a: &[Tensor]| ops::cross_entropy_mean(&a[0], &t);
            let composed = |a: &[Tensor]| ops::cross_entropy_rows(&a[0], &t)?.mean_all();
            let reference = |a: &[Tensor]| ce_ref(&a[0], &t)?.mean_all();
            let errs = compare_any(&name, &fused, &reference, std::slice::from_ref(&x), &r)?;
            assert!(errs.iter().all(|e| *e <= tol(dtype)), "{name}: {errs:?}");
            let (y, g) = value_and_grads(&fused, std::slice::from_ref(&x), &r)?;
            let (y_c, g_c) = value_and_grads(&composed, std::slice::from_ref(&x), &r)?;
            assert_eq!((y.dtype(), y.dims()), (DType::F32, &[][..]), "{name}");
            assert_eq!(g[0].dtype(), dtype, "{name}: gradient dtype");
            // the gradient is the composition's bit for bit (g / N inside the kernel), the
            // value up to the order of the f32 sum
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                Ok(v.iter().map(|x| x.to_bits()).collect())
            };
            assert_eq!(bits(&g[0])?, bits(&g_c[0])?, "{name}: gradient bits");
            let (a, b) = (y.to_scalar::<f32>()?, y_c.to_scalar::<f32>()?);
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1.0),
                "{name}: {a} vs {b}"
            );
        }
    }
    // closed form: uniform logits give ln(C)
    let x = Tensor::zeros((4, 10), DType::F32, &Device::Cpu)?;
    let l = ops::cross_entropy_mean(&x, &targets(4, 10, 1, &Device::Cpu))?.to_scalar::<f32>()?;
    assert!((l - 10f32.ln()).abs() < 1e-6, "{l}");
    // bad input: an empty batch, an out-of-range target, mismatched shapes
    let e = ops::cross_entropy_mean(
        &Tensor::zeros((0, 3), DType::F32, &Device::Cpu)?,
        &Tensor::zeros(0, DType::U32, &Device::Cpu)?,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("batch is empty"), "{e}");
    let x = Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?;
    let e = ops::cross_entropy_mean(&x, &Tensor::new(&[0u32, 3], &Device::Cpu)?)
        .unwrap_err()
        .to_string();
    assert!(e.contains("target 3 at row 1"), "{e}");
    let e = ops::cross_entropy_mean(&x, &Tensor::new(&[0u32], &Device::Cpu)?)
        .unwrap_err()
        .to_string();
    assert!(e.contains("targets must be (N,)"), "{e}");
    Ok(())
}

#[test]
fn norms_can_return_f32_for_half_inputs() -> Result<()> {
    let (args, r) = norm_args(&[8, 64], DType::BF16, 400, &Device::Cpu);
    let f = |a: &[Tensor]| ops::layer_norm_with_dtype(&a[0], &a[1], &a[2], EPS, DType::F32);
    let (y, g) = value_and_grads(&f, &args, &r)?;
    let (y_ref, g_ref) = value_and_grads(&ln_ref, &args, &r)?;
    assert_eq!((y.dtype(), g[0].dtype()), (DType::F32, DType::BF16));
    let e = [
        err(&y, &y_ref),
        err(&g[0], &g_ref[0]),
        err(&g[1], &g_ref[1]),
        err(&g[2], &g_ref[2]),
    ];
    println!("layer_norm bf16 -> f32: {}", fmt_errs(&e));
    // y is not rounded to bf16 here: only the f32 arithmetic differs.
    assert!(
        e[0] <= 1e-5 && e.iter().all(|v| *v <= tol(DType::BF16)),
        "{e:?}"
    );

    let f = |a: &[Tensor]| ops::rms_norm_with_dtype(&a[0], &a[1], EPS, DType::F32);
    let (y, _) = value_and_grads(&f, &args[..2], &r)?;
    let (y_ref, _) = value_and_grads(&rms_ref, &args[..2], &r)?;
    assert_eq!(y.dtype(), DType::F32);
    assert!(err(&y, &y_ref) <= 1e-5);
    Ok(())
}

/// Views taken inside the differentiated function (a `Var` is always a contiguous copy):
/// `x.t()` (strided) and `flat.narrow(0, 1, n).reshape(..)` (contiguous, one element into its
/// buffer, so not 16-byte aligned on CUDA).
fn strided(x: &Tensor) -> Result<Tensor> {
    x.t()
}
fn offset(flat: &Tensor, rows: usize, cols: usize) -> Result<Tensor> {
    flat.narrow(0, 1, rows * cols)?.reshape((rows, cols))
}

#[test]
fn non_contiguous_inputs_and_half_gains() -> Result<()> {
    // x transposed (strided) or offset; gains in bf16 (cast to f32 inside, gradient in bf16).
    let cpu = &Device::Cpu;
    let x = rand_t(&[48, 6], 0.0, 2.0, 500, DType::F32, cpu);
    let w = rand_t(&[48], 0.5, 1.5, 501, DType::BF16, cpu);
    let b = rand_t(&[48], -0.5, 0.5, 502, DType::BF16, cpu);
    let r = rand_t(&[6, 48], -1.0, 1.0, 503, DType::F32, cpu);
    let fused = |a: &[Tensor]| ops::layer_norm(&strided(&a[0])?, &a[1], &a[2], EPS);
    let reference = |a: &[Tensor]| {
        let (w, b) = (a[1].to_dtype(DType::F32)?, a[2].to_dtype(DType::F32)?);
        candle_nn::ops::layer_norm_slow(&strided(&a[0])?, &w, &b, EPS as f32)
    };
    let args = [x, w, b];
    let errs = compare_any(
        "layer_norm strided x, bf16 gains",
        &fused,
        &reference,
        &args,
        &r,
    )?;
    assert!(errs.iter().all(|v| *v <= 1e-2), "{errs:?}");

    let flat = rand_t(&[1 + 6 * 48], 0.0, 2.0, 504, DType::F32, cpu);
    let fused = |a: &[Tensor]| ops::rms_norm(&offset(&a[0], 6, 48)?, &a[1], EPS);
    let reference = |a: &[Tensor]| {
        candle_nn::ops::rms_norm_slow(
            &offset(&a[0], 6, 48)?,
            &a[1].to_dtype(DType::F32)?,
            EPS as f32,
        )
    };
    let errs = compare_any(
        "rms_norm offset x",
        &fused,
        &reference,
        &[flat, args[1].clone()],
        &r,
    )?;
    assert!(errs.iter().all(|v| *v <= 1e-2), "{errs:?}");

    let x = rand_t(&[48, 6], -3.0, 3.0, 505, DType::F32, cpu);
    let fused = |a: &[Tensor]| ops::softmax_last_dim(&strided(&a[0])?);
    let reference = |a: &[Tensor]| candle_nn::ops::softmax(&strided(&a[0])?, D::Minus1);
    let errs = compare_any("softmax strided x", &fused, &reference, &[x], &r)?;
    assert!(errs.iter().all(|v| *v <= 1e-5), "{errs:?}");
    Ok(())
}

#[test]
fn parameter_gradients_are_deterministic() -> Result<()> {
    let (args, r) = norm_args(&[301, 33], DType::F32, 600, &Device::Cpu);
    let (_, g1) = value_and_grads(&ln_fused, &args, &r)?;
    let (_, g2) = value_and_grads(&ln_fused, &args, &r)?;
    for (a, b) in g1.iter().zip(&g2) {
        let (a, b): (Vec<f32>, Vec<f32>) =
            (a.flatten_all()?.to_vec1()?, b.flatten_all()?.to_vec1()?);
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
    Ok(())
}

#[test]
fn empty_rows_give_empty_outputs_and_zero_parameter_gradients() -> Result<()> {
    let (args, r) = norm_args(&[0, 16], DType::F32, 700, &Device::Cpu);
    let (y, g) = value_and_grads(&ln_fused, &args, &r)?;
    assert_eq!(y.dims(), &[0, 16]);
    assert_eq!(g[1].to_vec1::<f32>()?, vec![0f32; 16]);
    let s = ops::softmax_last_dim(&Tensor::zeros((3, 0), DType::F32, &Device::Cpu)?)?;
    assert_eq!(s.dims(), &[3, 0]);
    Ok(())
}

#[test]
fn bad_inputs_give_clear_errors() -> Result<()> {
    let cpu = &Device::Cpu;
    let x = Tensor::zeros((4, 8), DType::F32, cpu)?;
    let w = Tensor::ones(8, DType::F32, cpu)?;
    let b = Tensor::zeros(8, DType::F32, cpu)?;
    let msg = |r: Result<Tensor>| r.expect_err("expected an error").to_string();

    let m = msg(ops::layer_norm(
        &x,
        &Tensor::ones(7, DType::F32, cpu)?,
        &b,
        EPS,
    ));
    assert!(m.contains("w has shape [7]") && m.contains("(8,)"), "{m}");
    let m = msg(ops::layer_norm(
        &x,
        &w,
        &Tensor::ones((1, 8), DType::F32, cpu)?,
        EPS,
    ));
    assert!(m.contains("b has shape [1, 8]"), "{m}");
    let m = msg(ops::layer_norm(&x.to_dtype(DType::U32)?, &w, &b, EPS));
    assert!(m.contains("U32") && m.contains("f32, bf16 or f16"), "{m}");
    let m = msg(ops::layer_norm(&Tensor::new(1f32, cpu)?, &w, &b, EPS));
    assert!(m.contains("scalar"), "{m}");
    let m = msg(ops::layer_norm(
        &Tensor::zeros((4, 0), DType::F32, cpu)?,
        &w,
        &b,
        EPS,
    ));
    assert!(m.contains("empty"), "{m}");
    let m = msg(ops::layer_norm(&x, &w, &b, -1.0));
    assert!(m.contains("eps"), "{m}");
    let m = msg(ops::layer_norm_with_dtype(
        &x.to_dtype(DType::BF16)?,
        &w,
        &b,
        EPS,
        DType::F16,
    ));
    assert!(m.contains("output dtype F16"), "{m}");
    let m = msg(ops::rms_norm(&x, &Tensor::ones(9, DType::F32, cpu)?, EPS));
    assert!(
        m.contains("rms_norm") && m.contains("w has shape [9]"),
        "{m}"
    );
    let m = msg(ops::rms_norm(&x.to_dtype(DType::F64)?, &w, EPS));
    assert!(m.contains("F64"), "{m}");
    let m = msg(ops::softmax_last_dim(&x.to_dtype(DType::U8)?));
    assert!(m.contains("softmax_last_dim") && m.contains("U8"), "{m}");
    let m = msg(ops::softmax_last_dim(&Tensor::new(1f32, cpu)?));
    assert!(m.contains("scalar"), "{m}");
    Ok(())
}

#[test]
fn nn_layer_norm_uses_the_fused_op_and_trains_every_parameter() -> anyhow::Result<()> {
    use candle_core::Module;
    let store = wick::ParamStore::new(wick::Precision::Bf16Mixed, Device::Cpu, 0);
    let ln = wick::nn::LayerNorm::new(&store, "ln", 37, 1e-5)?;
    let x = rand_t(&[3, 37], 0.0, 4.0, 800, DType::BF16, &Device::Cpu);
    let y = ln.forward(&x)?;
    assert_eq!(y.dtype(), DType::F32);
    let y_ref = candle_nn::ops::layer_norm_slow(
        &x.to_dtype(DType::F32)?,
        &Tensor::ones(37, DType::F32, &Device::Cpu)?,
        &Tensor::zeros(37, DType::F32, &Device::Cpu)?,
        1e-5,
    )?;
    assert!(err(&y, &y_ref) <= 1e-5);
    let grads = (y * rand_t(&[3, 37], -1.0, 1.0, 801, DType::F32, &Device::Cpu))?
        .sum_all()?
        .backward()?;
    for p in store.params() {
        assert!(
            grads.get(p.differentiated()).is_some(),
            "{} got no gradient",
            p.name
        );
    }
    Ok(())
}

/// The CUDA kernels against the CPU implementation and the composed reference. Needs a GPU:
/// `cargo test --release --features cuda --test ops -- --nocapture`.
/// Causal attention of `qkv: (B, T, 3C)` composed of candle ops in f32, independent of wick's
/// ops: narrow/transpose to heads, `q k^T / sqrt(Dh)`, `-inf` above the diagonal, candle-nn's
/// softmax, `@ v`, transpose back.
fn attn_ref(qkv: &Tensor, h: usize) -> Result<Tensor> {
    let qkv = qkv.to_dtype(DType::F32)?;
    let (b, t, c3) = qkv.dims3()?;
    let (c, dh) = (c3 / 3, c3 / 3 / h);
    let part = |i: usize| {
        qkv.narrow(2, i * c, c)?
            .reshape((b, t, h, dh))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (q, k, v) = (part(0)?, part(1)?, part(2)?);
    let mask = common::causal_mask(t, qkv.device());
    let s = (q.matmul(&k.t()?)? / (dh as f64).sqrt())?.broadcast_add(&mask)?;
    let p = candle_nn::ops::softmax(&s, D::Minus1)?;
    p.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))
}

/// `(B, T, n_head, Dh)` cases: a partial tile, Dh 64 over two tiles, one position.
const ATTN_CASES: &[(usize, usize, usize, usize)] = &[(2, 37, 2, 16), (1, 70, 2, 64), (3, 1, 4, 8)];

#[test]
fn causal_attention_matches_composed_on_cpu() -> Result<()> {
    for dtype in DTYPES {
        for (i, &(b, t, h, dh)) in ATTN_CASES.iter().enumerate() {
            let dev = Device::Cpu;
            let qkv = rand_t(&[b, t, 3 * h * dh], -2.0, 2.0, 3700 + i as u64, dtype, &dev);
            let r = rand_t(
                &[b, t, h * dh],
                -1.0,
                1.0,
                3710 + i as u64,
                DType::F32,
                &dev,
            );
            let name = format!("causal attention {dtype:?} {:?}", (b, t, h, dh));
            let fused = |a: &[Tensor]| ops::causal_attention(&a[0], h);
            let reference = |a: &[Tensor]| attn_ref(&a[0], h);
            let e = compare_any(&name, &fused, &reference, std::slice::from_ref(&qkv), &r)?;
            assert!(e.iter().all(|e| *e <= tol(dtype)), "{name}: {e:?}");
            // the composed fallback (wick's split/softmax/merge ops) agrees as well
            let composed = |a: &[Tensor]| ops::causal_attention_composed(&a[0], h);
            let e = compare_any(
                &format!("{name} composed"),
                &composed,
                &reference,
                &[qkv],
                &r,
            )?;
            assert!(e.iter().all(|e| *e <= tol(dtype)), "{name} composed: {e:?}");
        }
    }
    Ok(())
}

#[test]
fn causal_attention_is_causal_and_checks_its_input() -> Result<()> {
    let dev = Device::Cpu;
    let (b, t, h, dh) = (1, 9, 3, 4);
    let qkv = rand_t(&[b, t, 3 * h * dh], -2.0, 2.0, 3720, DType::F32, &dev);
    let y = ops::causal_attention(&qkv, h)?;
    // changing the last position's q, k, v leaves every earlier output unchanged
    let last = rand_t(&[b, 1, 3 * h * dh], -2.0, 2.0, 3721, DType::F32, &dev);
    let qkv2 = Tensor::cat(&[qkv.narrow(1, 0, t - 1)?, last], 1)?;
    let y2 = ops::causal_attention(&qkv2, h)?;
    assert_eq!(err(&y.narrow(1, 0, t - 1)?, &y2.narrow(1, 0, t - 1)?), 0.0);
    assert!(err(&y.narrow(1, t - 1, 1)?, &y2.narrow(1, t - 1, 1)?) > 1e-3);
    // position 0 sees only itself: its output is its own v
    let v0 = qkv.narrow(1, 0, 1)?.narrow(2, 2 * h * dh, h * dh)?;
    assert!(err(&y.narrow(1, 0, 1)?, &v0) <= 1e-6);
    let msg = |r: Result<Tensor>| r.unwrap_err().to_string();
    assert!(msg(ops::causal_attention(&qkv, 5)).contains("3 * n_head * head_dim"));
    assert!(msg(ops::causal_attention(&qkv, 0)).contains("n_head = 0"));
    assert!(msg(ops::causal_attention(&qkv.flatten_all()?, h)).contains("(B, T, 3C)"));
    let ids = Tensor::zeros((1, 2, 3), DType::U32, &dev)?;
    assert!(msg(ops::causal_attention(&ids, 1)).contains("U32"));
    let empty = Tensor::zeros((0, 4, 3 * h * dh), DType::F32, &dev)?;
    assert_eq!(ops::causal_attention(&empty, h)?.dims(), &[0, 4, h * dh]);
    Ok(())
}

/// Rotary embedding of `qkv: (B, T, (H + 2 Hkv) D)` composed of candle ops in f32, independent
/// of wick's: each head split into halves with `narrow`, `x1 cos - x2 sin` and
/// `x2 cos + x1 sin` by broadcast multiplies, `cat` back; the v columns passed through.
fn rotary_ref(qkv: &Tensor, cos: &Tensor, sin: &Tensor, h: usize, hkv: usize) -> Result<Tensor> {
    let x = qkv.to_dtype(DType::F32)?;
    let (b, t, w) = x.dims3()?;
    let d = w / (h + 2 * hkv);
    let half = d / 2;
    let c = cos.reshape((1, t, 1, half))?;
    let s = sin.reshape((1, t, 1, half))?;
    let rot = |first: usize, n: usize| -> Result<Tensor> {
        let x = x.narrow(2, first * d, n * d)?.reshape((b, t, n, d))?;
        let (x1, x2) = (x.narrow(3, 0, half)?, x.narrow(3, half, half)?);
        let y1 = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
        let y2 = (x2.broadcast_mul(&c)? + x1.broadcast_mul(&s)?)?;
        Tensor::cat(&[y1, y2], 3)?.reshape((b, t, n * d))
    };
    let v = x.narrow(2, (h + hkv) * d, hkv * d)?;
    Tensor::cat(&[rot(0, h)?, rot(h, hkv)?, v], 2)
}

/// `(B, T, H, Hkv, D)` cases of the rotary and grouped-attention tests: GQA with T not a
/// multiple of 64, multi-head, multi-query over two tiles, one position, SmolLM2's heads.
const GQA_CASES: &[(usize, usize, usize, usize, usize)] = &[
    (2, 70, 6, 2, 16),
    (1, 70, 6, 6, 16),
    (2, 37, 4, 1, 8),
    (1, 1, 6, 2, 8),
    (1, 20, 9, 3, 64),
];

#[test]
fn rotary_qkv_matches_composed_on_cpu() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in DTYPES {
        for (i, &(b, t, h, hkv, d)) in GQA_CASES.iter().enumerate() {
            let w = (h + 2 * hkv) * d;
            let qkv = rand_t(&[b, t, w], -2.0, 2.0, 5000 + i as u64, dtype, &dev);
            let r = rand_t(&[b, t, w], -1.0, 1.0, 5010 + i as u64, DType::F32, &dev);
            // positions 3.. with SmolLM2's base: large angles in every frequency
            let (cos, sin) = ops::rotary_tables(t, d, 1e5, 3, &dev)?;
            let name = format!("rotary {dtype:?} {:?}", (b, t, h, hkv, d));
            let fused = |a: &[Tensor]| ops::rotary_qkv(&a[0], &cos, &sin, h, hkv);
            let reference = |a: &[Tensor]| rotary_ref(&a[0], &cos, &sin, h, hkv);
            let e = compare(&name, &fused, &reference, std::slice::from_ref(&qkv), &r)?;
            assert!(e.iter().all(|e| *e <= tol(dtype)), "{name}: {e:?}");
        }
    }
    // the tables are constants: no gradient reaches them even when they are variables
    let (cos, sin) = ops::rotary_tables(5, 8, 1e4, 0, &dev)?;
    let (cos, sin) = (Var::from_tensor(&cos)?, Var::from_tensor(&sin)?);
    let x = Var::from_tensor(&rand_t(&[1, 5, 5 * 8], -1.0, 1.0, 5020, DType::F32, &dev))?;
    let g = ops::rotary_qkv(&x, &cos, &sin, 3, 1)?
        .sum_all()?
        .backward()?;
    assert!(g.get(&x).is_some() && g.get(&cos).is_none() && g.get(&sin).is_none());
    Ok(())
}

#[test]
fn rotary_closed_forms_on_cpu() -> Result<()> {
    let dev = Device::Cpu;
    let (h, hkv, d, t) = (3, 1, 8, 6);
    let w = (h + 2 * hkv) * d;
    let x = rand_t(&[2, t, w], -2.0, 2.0, 5100, DType::F32, &dev);
    let (cos, sin) = ops::rotary_tables(t, d, 1e4, 0, &dev)?;
    let y = ops::rotary_qkv(&x, &cos, &sin, h, hkv)?;
    // position 0 is the identity, exactly; the v columns are copied at every position
    assert_eq!(err(&y.narrow(1, 0, 1)?, &x.narrow(1, 0, 1)?), 0.0);
    let v = |a: &Tensor| a.narrow(2, (h + hkv) * d, hkv * d);
    assert_eq!(err(&v(&y)?, &v(&x)?), 0.0);
    // a rotation keeps each pair's norm, so it changes later positions without scaling them
    assert!(err(&y.narrow(1, 1, t - 1)?, &x.narrow(1, 1, t - 1)?) > 1e-2);
    let norm = |a: &Tensor| -> Result<f32> { a.sqr()?.sum_all()?.to_scalar() };
    assert!((norm(&y)? - norm(&x)?).abs() <= 1e-4 * norm(&x)?);
    // the backward is the rotation by -angle: the gradient of sum(y^2) / 2 is R^T y = x
    let xv = Var::from_tensor(&x)?;
    let yv = ops::rotary_qkv(&xv, &cos, &sin, h, hkv)?;
    let g = (yv.sqr()?.sum_all()? * 0.5)?.backward()?;
    let e = err(g.get(&xv).unwrap(), &x);
    assert!(e <= 1e-6, "R^T R x vs x: {e:e}");

    // head_dim 2, one frequency (inv_freq = 1): the angle is the position, here 1 rad
    let (c1, s1) = ops::rotary_tables(1, 2, 1e4, 1, &dev)?;
    let (c, s) = (1f32.cos(), 1f32.sin());
    assert_eq!(c1.to_vec2::<f32>()?, [[c]]);
    assert_eq!(s1.to_vec2::<f32>()?, [[s]]);
    // q = (1, 0) -> (cos 1, sin 1); k = (0, 2) -> (-2 sin 1, 2 cos 1); v = (5, -3) copied
    let qkv = Tensor::new(&[[[1f32, 0., 0., 2., 5., -3.]]], &dev)?;
    let got = ops::rotary_qkv(&qkv, &c1, &s1, 1, 1)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let want = [c, s, -2.0 * s, 2.0 * c, 5.0, -3.0];
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= 1e-6, "{got:?} vs {want:?}");
    }
    // head_dim 4, base 100: inv_freq = [1, 0.1]; position 3 has angles 3 and 0.3
    let (c4, s4) = ops::rotary_tables(2, 4, 100.0, 2, &dev)?;
    assert_eq!(c4.dims(), &[2, 2]);
    let (c4, s4) = (c4.to_vec2::<f32>()?, s4.to_vec2::<f32>()?);
    for (got, want) in [
        (c4[1][0], 3f64.cos()),
        (c4[1][1], 0.3f64.cos()),
        (s4[1][0], 3f64.sin()),
        (s4[1][1], 0.3f64.sin()),
        (s4[0][1], 0.2f64.sin()),
    ] {
        assert!((f64::from(got) - want).abs() <= 1e-7, "{got} vs {want}");
    }
    Ok(())
}

#[test]
fn rotary_checks_its_inputs() -> Result<()> {
    let dev = Device::Cpu;
    let msg = |r: Result<(Tensor, Tensor)>| r.unwrap_err().to_string();
    assert!(msg(ops::rotary_tables(4, 7, 1e4, 0, &dev)).contains("head_dim must be even"));
    assert!(msg(ops::rotary_tables(4, 0, 1e4, 0, &dev)).contains("head_dim must be even"));
    for base in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(msg(ops::rotary_tables(4, 8, base, 0, &dev)).contains("base must be finite"));
    }
    assert!(msg(ops::rotary_tables(4, 8, 1e4, usize::MAX, &dev)).contains("overflow"));
    let (cos, sin) = ops::rotary_tables(0, 8, 1e4, 0, &dev)?;
    assert_eq!((cos.dims(), sin.dims()), (&[0, 4][..], &[0, 4][..]));

    let (h, hkv, d, t) = (3, 1, 8, 4);
    let qkv = Tensor::zeros((2, t, (h + 2 * hkv) * d), DType::F32, &dev)?;
    let (cos, sin) = ops::rotary_tables(t, d, 1e4, 0, &dev)?;
    let msg = |r: Result<Tensor>| r.unwrap_err().to_string();
    let rot = |x: &Tensor, c: &Tensor, s: &Tensor, h, hkv| ops::rotary_qkv(x, c, s, h, hkv);
    assert!(msg(rot(&qkv, &cos, &sin, 4, 1)).contains("(n_head + 2 * n_kv_head) * head_dim"));
    assert!(msg(rot(&qkv, &cos, &sin, h, 0)).contains("n_kv_head = 0"));
    assert!(msg(rot(&qkv.flatten_from(1)?, &cos, &sin, h, hkv)).contains("must be (B, T"));
    let odd = Tensor::zeros((1, t, 5 * 3), DType::F32, &dev)?; // head_dim 3
    assert!(msg(rot(&odd, &cos, &sin, h, hkv)).contains("head_dim even"));
    let (c9, s9) = ops::rotary_tables(t + 1, d, 1e4, 0, &dev)?;
    assert!(msg(rot(&qkv, &c9, &s9, h, hkv)).contains("cos must be (T, head_dim / 2)"));
    assert!(msg(rot(&qkv, &cos, &s9, h, hkv)).contains("sin must be (T, head_dim / 2)"));
    let c16 = cos.to_dtype(DType::F16)?;
    assert!(msg(rot(&qkv, &c16, &sin, h, hkv)).contains("cos must be f32"));
    let ids = Tensor::zeros((2, t, (h + 2 * hkv) * d), DType::U32, &dev)?;
    assert!(msg(rot(&ids, &cos, &sin, h, hkv)).contains("U32"));
    let empty = Tensor::zeros((0, t, (h + 2 * hkv) * d), DType::BF16, &dev)?;
    assert_eq!(rot(&empty, &cos, &sin, h, hkv)?.dims(), empty.dims());
    Ok(())
}

fn swiglu_fused(a: &[Tensor]) -> Result<Tensor> {
    ops::swiglu(&a[0])
}
/// `silu(g) * u` in f32 with candle's silu and mul on the two `narrow`ed halves.
fn swiglu_ref(a: &[Tensor]) -> Result<Tensor> {
    let x = a[0].to_dtype(DType::F32)?;
    let f = x.dim(D::Minus1)? / 2;
    x.narrow(D::Minus1, 0, f)?
        .silu()?
        .mul(&x.narrow(D::Minus1, f, f)?)
}

#[test]
fn swiglu_matches_silu_times_up_on_cpu() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in DTYPES {
        for (i, shape) in [
            &[2usize, 3, 2 * 48][..],
            &[5, 2 * 37],
            &[1, 2],
            &[4, 2 * 1536],
        ]
        .iter()
        .enumerate()
        {
            let x = rand_t(shape, -6.0, 6.0, 5200 + i as u64, dtype, &dev);
            let mut out = shape.to_vec();
            *out.last_mut().unwrap() /= 2;
            let r = rand_t(&out, -1.0, 1.0, 5210 + i as u64, DType::F32, &dev);
            let name = format!("swiglu {dtype:?} {shape:?}");
            let e = compare(&name, &swiglu_fused, &swiglu_ref, &[x], &r)?;
            assert!(e.iter().all(|e| *e <= tol(dtype)), "{name}: {e:?}");
        }
    }
    // a strided input (a transposed view) is made contiguous first
    let x = rand_t(&[16, 6], -3.0, 3.0, 5220, DType::F32, &dev).t()?;
    assert!(err(&ops::swiglu(&x)?, &swiglu_ref(&[x])?) <= 1e-6);
    let msg = |r: Result<Tensor>| r.unwrap_err().to_string();
    let odd = Tensor::zeros((2, 7), DType::F32, &dev)?;
    assert!(msg(ops::swiglu(&odd)).contains("must be even"));
    let ids = Tensor::zeros((2, 8), DType::U32, &dev)?;
    assert!(msg(ops::swiglu(&ids)).contains("U32"));
    assert!(msg(ops::swiglu(&Tensor::new(1f32, &dev)?)).contains("scalar"));
    let empty = Tensor::zeros((0, 3, 8), DType::BF16, &dev)?;
    assert_eq!(ops::swiglu(&empty)?.dims(), &[0, 3, 4]);
    Ok(())
}

/// Grouped-query causal attention of `qkv: (B, T, (H + 2 Hkv) D)` as multi-head attention in
/// f32: every key and value head repeated for the `H / Hkv` query heads of its group with
/// `narrow` and `cat` (the gradients of the copies sum back), then [`attn_ref`].
fn gqa_ref(qkv: &Tensor, h: usize, hkv: usize) -> Result<Tensor> {
    let x = qkv.to_dtype(DType::F32)?;
    let d = x.dim(2)? / (h + 2 * hkv);
    let mut parts = vec![x.narrow(2, 0, h * d)?];
    for first in [h, h + hkv] {
        for qh in 0..h {
            parts.push(x.narrow(2, (first + qh / (h / hkv)) * d, d)?);
        }
    }
    attn_ref(&Tensor::cat(&parts, 2)?, h)
}

#[test]
fn grouped_causal_attention_matches_repeated_kv_on_cpu() -> Result<()> {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (i, &(b, t, h, hkv, d)) in GQA_CASES.iter().enumerate() {
            let qkv = rand_t(
                &[b, t, (h + 2 * hkv) * d],
                -2.0,
                2.0,
                5300 + i as u64,
                dtype,
                &dev,
            );
            let r = rand_t(&[b, t, h * d], -1.0, 1.0, 5310 + i as u64, DType::F32, &dev);
            let name = format!("grouped attention {dtype:?} {:?}", (b, t, h, hkv, d));
            let fused = |a: &[Tensor]| ops::grouped_causal_attention(&a[0], h, hkv);
            let composed = |a: &[Tensor]| ops::grouped_causal_attention_composed(&a[0], h, hkv);
            let reference = |a: &[Tensor]| gqa_ref(&a[0], h, hkv);
            let args = std::slice::from_ref(&qkv);
            for (what, f) in [
                ("fused", &fused as &dyn Fn(&[Tensor]) -> _),
                ("composed", &composed),
            ] {
                let e = compare_any(&format!("{name} {what}"), f, &reference, args, &r)?;
                assert!(e.iter().all(|e| *e <= tol(dtype)), "{name} {what}: {e:?}");
            }
            // the fused op against wick's composed fallback (K/V repeated in the graph)
            let e = compare_any(
                &format!("{name} fused vs composed"),
                &fused,
                &composed,
                args,
                &r,
            )?;
            assert!(
                e.iter().all(|e| *e <= tol(dtype)),
                "{name} fused vs composed: {e:?}"
            );
            if h == hkv {
                // causal_attention is the Hkv == H case, bit for bit
                let y = ops::grouped_causal_attention(&qkv, h, h)?;
                assert_eq!(err(&ops::causal_attention(&qkv, h)?, &y), 0.0);
            }
        }
    }
    Ok(())
}

#[test]
fn grouped_causal_attention_is_deterministic_causal_and_checks_its_input() -> Result<()> {
    let dev = Device::Cpu;
    let (b, t, h, hkv, d) = (2, 33, 6, 2, 8);
    let w = (h + 2 * hkv) * d;
    let qkv = rand_t(&[b, t, w], -2.0, 2.0, 5400, DType::BF16, &dev);
    let r = rand_t(&[b, t, h * d], -1.0, 1.0, 5401, DType::F32, &dev);
    let f = |a: &[Tensor]| ops::grouped_causal_attention(&a[0], h, hkv);
    let (y1, g1) = value_and_grads(&f, std::slice::from_ref(&qkv), &r)?;
    let (y2, g2) = value_and_grads(&f, std::slice::from_ref(&qkv), &r)?;
    let bits = |t: &Tensor| t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>();
    assert_eq!(bits(&y1)?, bits(&y2)?);
    assert_eq!(bits(&g1[0])?, bits(&g2[0])?);
    // changing the last position's q, k, v leaves every earlier output unchanged
    let last = rand_t(&[b, 1, w], -2.0, 2.0, 5402, DType::BF16, &dev);
    let qkv2 = Tensor::cat(&[qkv.narrow(1, 0, t - 1)?, last], 1)?;
    let y3 = ops::grouped_causal_attention(&qkv2, h, hkv)?;
    assert_eq!(err(&y1.narrow(1, 0, t - 1)?, &y3.narrow(1, 0, t - 1)?), 0.0);
    // position 0 sees only itself: query head qh's output is v head qh / 3
    let y0 = y1.narrow(1, 0, 1)?;
    for qh in 0..h {
        let v = qkv.narrow(1, 0, 1)?.narrow(2, (h + hkv + qh / 3) * d, d)?;
        assert_eq!(err(&y0.narrow(2, qh * d, d)?, &v), 0.0);
    }
    let msg = |r: Result<Tensor>| r.unwrap_err().to_string();
    let gqa = |x: &Tensor, h, hkv| ops::grouped_causal_attention(x, h, hkv);
    assert!(msg(gqa(&qkv, 6, 4)).contains("multiple of n_kv_head"));
    assert!(msg(gqa(&qkv, 6, 0)).contains("n_kv_head = 0"));
    assert!(msg(gqa(&qkv, 0, 1)).contains("n_head = 0"));
    assert!(msg(gqa(&qkv, 7, 7)).contains("(n_head + 2 * n_kv_head) * head_dim"));
    assert!(msg(gqa(&qkv.flatten_all()?, h, hkv)).contains("must be (B, T"));
    let composed = ops::grouped_causal_attention_composed(&qkv, 6, 4);
    assert!(msg(composed).contains("multiple of n_kv_head"));
    let ids = Tensor::zeros((1, 2, w), DType::U32, &dev)?;
    assert!(msg(gqa(&ids, h, hkv)).contains("U32"));
    let empty = Tensor::zeros((0, 4, w), DType::F32, &dev)?;
    assert_eq!(gqa(&empty, h, hkv)?.dims(), &[0, 4, h * d]);
    Ok(())
}

#[test]
fn residual_add_is_the_cast_and_add_composition_bitwise() -> Result<()> {
    for dtype in DTYPES {
        let dev = Device::Cpu;
        let x = rand_t(&[3, 5, 8], -4.0, 4.0, 3900, DType::F32, &dev);
        let y = rand_t(&[3, 5, 8], -4.0, 4.0, 3901, dtype, &dev);
        let r = rand_t(&[3, 5, 8], -1.0, 1.0, 3902, DType::F32, &dev);
        let fused = |a: &[Tensor]| ops::residual_add(&a[0], &a[1]);
        let composed = |a: &[Tensor]| &a[0] + a[1].to_dtype(DType::F32)?;
        let e = compare_any(
            &format!("residual add {dtype:?}"),
            &fused,
            &composed,
            &[x, y],
            &r,
        )?;
        assert!(e.iter().all(|e| *e == 0.0), "{dtype:?}: {e:?}");
    }
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 3), DType::F32, &dev)?;
    let msg = |r: Result<Tensor>| r.unwrap_err().to_string();
    assert!(msg(ops::residual_add(&x.to_dtype(DType::BF16)?, &x)).contains("must be f32"));
    assert!(msg(ops::residual_add(&x, &x.t()?)).contains("must match"));
    assert!(msg(ops::residual_add(&x, &x.to_dtype(DType::U32)?)).contains("U32"));
    Ok(())
}

/// f32 x normalised straight into a half dtype equals the f32 output cast afterwards, bit for
/// bit, with the gradients of the f32-output path fed the same (half) output gradient.
fn check_norm_to_half(dev: &Device, shape: &[usize]) -> Result<()> {
    for dtype in [DType::BF16, DType::F16] {
        let (args, r) = norm_args(shape, DType::F32, 410, &Device::Cpu);
        let args: Vec<Tensor> = args.iter().map(|t| t.to_device(dev).unwrap()).collect();
        let r = r.to_device(dev)?;
        let f = |a: &[Tensor]| ops::layer_norm_with_dtype(&a[0], &a[1], &a[2], EPS, dtype);
        let c = |a: &[Tensor]| ops::layer_norm(&a[0], &a[1], &a[2], EPS)?.to_dtype(dtype);
        let (y, g) = value_and_grads(&f, &args, &r)?;
        let (y_c, g_c) = value_and_grads(&c, &args, &r)?;
        assert_eq!((y.dtype(), g[0].dtype()), (dtype, DType::F32));
        let mut e = vec![err(&y, &y_c)];
        e.extend(g.iter().zip(&g_c).map(|(a, b)| err(a, b)));
        println!("layer_norm f32 -> {dtype:?} on {dev:?}: {}", fmt_errs(&e));
        assert!(e[0] == 0.0 && e.iter().all(|v| *v <= 1e-5), "{e:?}");
        let f = |a: &[Tensor]| ops::rms_norm_with_dtype(&a[0], &a[1], EPS, dtype);
        let c = |a: &[Tensor]| ops::rms_norm(&a[0], &a[1], EPS)?.to_dtype(dtype);
        let (y, _) = value_and_grads(&f, &args[..2], &r)?;
        let (y_c, _) = value_and_grads(&c, &args[..2], &r)?;
        assert_eq!(err(&y, &y_c), 0.0);
    }
    Ok(())
}

#[test]
fn norms_can_return_half_for_f32_inputs() -> Result<()> {
    check_norm_to_half(&Device::Cpu, &[8, 64])
}

fn head_loss_fused(a: &[Tensor], t: &Tensor) -> Result<Tensor> {
    ops::linear_cross_entropy_rows(&a[0], &a[1], t)
}
fn head_loss_composed(a: &[Tensor], t: &Tensor) -> Result<Tensor> {
    ops::cross_entropy_rows(&a[0].matmul(&a[1].t()?)?, t)
}

#[test]
fn linear_cross_entropy_matches_matmul_then_cross_entropy_on_cpu() -> Result<()> {
    for dtype in DTYPES {
        let dev = Device::Cpu;
        let (n, c, v) = (37, 24, 50);
        let h = rand_t(&[n, c], -1.0, 1.0, 3950, dtype, &dev);
        let w = rand_t(&[v, c], -1.0, 1.0, 3951, dtype, &dev);
        let t = targets(n, v, 3952, &dev);
        let r = rand_t(&[n], 0.0, 1.0, 3953, DType::F32, &dev);
        let fused = |a: &[Tensor]| head_loss_fused(a, &t);
        let composed = |a: &[Tensor]| head_loss_composed(a, &t);
        let e = compare_any(
            &format!("linear cross-entropy {dtype:?}"),
            &fused,
            &composed,
            &[h, w],
            &r,
        )?;
        assert!(e.iter().all(|e| *e <= tol(dtype)), "{dtype:?}: {e:?}");
    }
    // the logits are freed by the first backward; a second one says so
    let dev = Device::Cpu;
    let h = Var::from_tensor(&rand_t(&[4, 8], -1.0, 1.0, 3954, DType::F32, &dev))?;
    let w = rand_t(&[5, 8], -1.0, 1.0, 3955, DType::F32, &dev);
    let t = targets(4, 5, 3956, &dev);
    let loss = ops::linear_cross_entropy_rows(h.as_tensor(), &w, &t)?.sum_all()?;
    loss.backward()?;
    let again = loss.backward().unwrap_err().to_string();
    assert!(again.contains("already ran"), "{again}");
    let msg = |r: Result<Tensor>| r.unwrap_err().to_string();
    let hb = h.to_dtype(DType::BF16)?;
    assert!(msg(ops::linear_cross_entropy_rows(&hb, &w, &t)).contains("cast both"));
    assert!(msg(ops::linear_cross_entropy_rows(h.as_tensor(), &w.t()?, &t)).contains("(V, C)"));
    assert!(msg(ops::linear_cross_entropy_rows(
        h.as_tensor(),
        &w,
        &t.narrow(0, 0, 3)?
    ))
    .contains("targets must be (N,)"));
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;

    fn gpu() -> Device {
        Device::new_cuda(0).expect("these tests need a CUDA device (Device::new_cuda(0))")
    }

    fn to(args: &[Tensor], dev: &Device) -> Vec<Tensor> {
        args.iter().map(|t| t.to_device(dev).unwrap()).collect()
    }

    /// Fused op on the GPU against the fused op on the CPU (same algorithm) and against the
    /// composed reference on the CPU; returns the larger error of each output.
    fn check(
        name: &str,
        fused: &dyn Fn(&[Tensor]) -> Result<Tensor>,
        reference: &dyn Fn(&[Tensor]) -> Result<Tensor>,
        args: &[Tensor],
        r: &Tensor,
        bound: f32,
    ) -> Result<()> {
        let dev = gpu();
        let (y_g, g_g) = value_and_grads(fused, &to(args, &dev), &r.to_device(&dev)?)?;
        let (y_c, g_c) = value_and_grads(fused, args, r)?;
        let (y_r, g_r) = value_and_grads(reference, args, r)?;
        assert!(y_g.device().is_cuda() && g_g.iter().all(|g| g.device().is_cuda()));
        let mut vs_cpu = vec![err(&y_g, &y_c)];
        vs_cpu.extend(g_g.iter().zip(&g_c).map(|(a, b)| err(a, b)));
        let mut vs_ref = vec![err(&y_g, &y_r)];
        vs_ref.extend(g_g.iter().zip(&g_r).map(|(a, b)| err(a, b)));
        println!(
            "{name}: cuda vs cpu fused {}; cuda vs composed {}",
            fmt_errs(&vs_cpu),
            fmt_errs(&vs_ref)
        );
        assert!(
            vs_cpu.iter().chain(&vs_ref).all(|e| *e <= bound),
            "{name}: errors above {bound:e}: vs cpu {vs_cpu:?}, vs composed {vs_ref:?}"
        );
        Ok(())
    }

    /// Shapes that take every kernel path: 16-byte vectors (D % 8 == 0), the scalar path
    /// (D = 37), more rows than 8 * 1024 (several rows per backward block), one row, D = 1,
    /// and D large enough that the backward accumulates dw/db in global memory.
    const NORM_SHAPES: &[&[usize]] = &[
        &[2, 3, 768],
        &[7, 37],
        &[9000, 64],
        &[1, 1024],
        &[5, 1],
        &[20, 5000],
        &[3, 12288],
    ];

    #[test]
    fn layer_norm_cuda_matches_cpu() -> Result<()> {
        for dtype in DTYPES {
            for (i, shape) in NORM_SHAPES.iter().enumerate() {
                let (args, r) = norm_args(shape, dtype, 1000 + 10 * i as u64, &Device::Cpu);
                let name = format!("cuda layer_norm {dtype:?} {shape:?}");
                check(&name, &ln_fused, &ln_ref, &args, &r, tol(dtype))?;
            }
        }
        Ok(())
    }

    #[test]
    fn rms_norm_cuda_matches_cpu() -> Result<()> {
        for dtype in DTYPES {
            for (i, shape) in NORM_SHAPES.iter().enumerate() {
                let (args, r) = norm_args(shape, dtype, 2000 + 10 * i as u64, &Device::Cpu);
                let name = format!("cuda rms_norm {dtype:?} {shape:?}");
                check(&name, &rms_fused, &rms_ref, &args[..2], &r, tol(dtype))?;
            }
        }
        Ok(())
    }

    #[test]
    fn softmax_cuda_matches_cpu() -> Result<()> {
        for dtype in DTYPES {
            for (i, shape) in [
                &[4usize, 1024][..],
                &[3, 5, 37],
                &[300, 2048],
                &[2, 1],
                &[2, 40000],
            ]
            .iter()
            .enumerate()
            {
                let x = rand_t(shape, -8.0, 8.0, 3000 + i as u64, dtype, &Device::Cpu);
                let r = rand_t(shape, -1.0, 1.0, 3100 + i as u64, DType::F32, &Device::Cpu);
                let name = format!("cuda softmax {dtype:?} {shape:?}");
                check(&name, &sm_fused, &sm_ref, &[x], &r, tol(dtype))?;
            }
        }
        Ok(())
    }

    #[test]
    fn causal_softmax_cuda_matches_cpu() -> Result<()> {
        for dtype in DTYPES {
            for (i, shape) in [&[2usize, 3, 64, 64][..], &[1, 37, 37], &[1, 2, 1024, 1024]]
                .iter()
                .enumerate()
            {
                let x = rand_t(shape, -8.0, 8.0, 3300 + i as u64, dtype, &Device::Cpu);
                let r = rand_t(shape, -1.0, 1.0, 3400 + i as u64, DType::F32, &Device::Cpu);
                let name = format!("cuda causal softmax {dtype:?} {shape:?}");
                check(&name, &causal_fused, &causal_ref, &[x], &r, tol(dtype))?;
            }
        }
        Ok(())
    }

    #[test]
    fn causal_attention_cuda_matches_cpu() -> Result<()> {
        // exact tiles, partial tiles, one position, GPT-2's sequence length, and less than a
        // tile with T % 4 == 0 (the TMA backward's boxes reach past the tensor)
        let cases = [
            (2usize, 64usize, 2usize),
            (2, 300, 3),
            (1, 1, 1),
            (2, 1024, 4),
            (1, 32, 2),
        ];
        // f32: 3xTF32 (the default; f32 GEMMs are not allowed TF32 in this process)
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for (i, &(b, t, h)) in cases.iter().enumerate() {
                let qkv = rand_t(
                    &[b, t, 3 * h * 64],
                    -2.0,
                    2.0,
                    3800 + i as u64,
                    dtype,
                    &Device::Cpu,
                );
                let r = rand_t(
                    &[b, t, h * 64],
                    -1.0,
                    1.0,
                    3810 + i as u64,
                    DType::F32,
                    &Device::Cpu,
                );
                let name = format!("cuda causal attention {dtype:?} {:?}", (b, t, h));
                let fused = |a: &[Tensor]| ops::causal_attention(&a[0], h);
                let reference = |a: &[Tensor]| attn_ref(&a[0], h);
                check(&name, &fused, &reference, &[qkv], &r, tol(dtype))?;
            }
        }
        // an input that starts off a 16-byte boundary is copied, not misread
        for dtype in [DType::BF16, DType::F32] {
            let (b, t, h) = (1, 100, 2);
            let n = b * t * 3 * h * 64;
            let flat = rand_t(&[n + 1], -2.0, 2.0, 3820, dtype, &Device::Cpu);
            let qkv = flat.narrow(0, 1, n)?.reshape((b, t, 3 * h * 64))?;
            let y_g = ops::causal_attention(&qkv.to_device(&gpu())?.narrow(0, 0, b)?, h)?;
            let flat_g = flat.to_device(&gpu())?;
            let y_off =
                ops::causal_attention(&flat_g.narrow(0, 1, n)?.reshape((b, t, 3 * h * 64))?, h)?;
            let y_c = ops::causal_attention(&qkv, h)?;
            let (e1, e2) = (err(&y_g, &y_c), err(&y_off, &y_c));
            println!("cuda causal attention misaligned {dtype:?}: {e1:.2e} {e2:.2e}");
            assert!(e1 <= tol(dtype) && e2 <= tol(dtype));
        }
        Ok(())
    }

    #[test]
    fn residual_add_cuda_matches_cpu() -> Result<()> {
        for dtype in DTYPES {
            let x = rand_t(&[16, 1024, 24], -4.0, 4.0, 3910, DType::F32, &Device::Cpu);
            let y = rand_t(&[16, 1024, 24], -4.0, 4.0, 3911, dtype, &Device::Cpu);
            let r = rand_t(&[16, 1024, 24], -1.0, 1.0, 3912, DType::F32, &Device::Cpu);
            let fused = |a: &[Tensor]| ops::residual_add(&a[0], &a[1]);
            let composed = |a: &[Tensor]| &a[0] + a[1].to_dtype(DType::F32)?;
            check(
                &format!("cuda residual add {dtype:?}"),
                &fused,
                &composed,
                &[x, y],
                &r,
                0.0,
            )?;
        }
        Ok(())
    }

    #[test]
    fn cuda_norms_can_return_half_for_f32_inputs() -> Result<()> {
        check_norm_to_half(&gpu(), &[33, 768])?;
        check_norm_to_half(&gpu(), &[5, 37])
    }

    #[test]
    fn linear_cross_entropy_cuda_matches_cpu() -> Result<()> {
        for dtype in DTYPES {
            let (n, c, v) = (300, 64, 1000);
            let h = rand_t(&[n, c], -1.0, 1.0, 3960, dtype, &Device::Cpu);
            let w = rand_t(&[v, c], -1.0, 1.0, 3961, dtype, &Device::Cpu);
            let t = targets(n, v, 3962, &Device::Cpu);
            let r = rand_t(&[n], 0.0, 1.0, 3963, DType::F32, &Device::Cpu);
            let dev = gpu(); // one device: each Device::new_cuda is a distinct device
            let (hg, wg, tg) = (h.to_device(&dev)?, w.to_device(&dev)?, t.to_device(&dev)?);
            let (y_g, g_g) =
                value_and_grads(&|a| head_loss_fused(a, &tg), &[hg, wg], &r.to_device(&dev)?)?;
            let (y_c, g_c) = value_and_grads(&|a| head_loss_composed(a, &t), &[h, w], &r)?;
            let mut e = vec![err(&y_g, &y_c)];
            e.extend(g_g.iter().zip(&g_c).map(|(a, b)| err(a, b)));
            println!(
                "cuda linear cross-entropy {dtype:?}: vs cpu composed {}",
                fmt_errs(&e)
            );
            let bound = if dtype == DType::F32 {
                1e-4
            } else {
                2.0 * tol(dtype)
            };
            assert!(e.iter().all(|x| *x <= bound), "{dtype:?}: {e:?}");
        }
        Ok(())
    }

    #[test]
    fn split_and_merge_heads_cuda_match_cpu() -> Result<()> {
        for dtype in DTYPES {
            // Dh 64 (16-byte units), Dh 3 (2-byte units for half, 4 for f32), GPT-2 shapes
            for &(b, t, h, dh) in &[
                (2usize, 5usize, 3usize, 64usize),
                (3, 7, 2, 3),
                (4, 1024, 12, 64),
            ] {
                let qkv = rand_t(&[b, t, 3 * h * dh], -1.0, 1.0, 21, dtype, &Device::Cpu);
                let r = rand_t(&[3, b, h, t, dh], -1.0, 1.0, 22, DType::F32, &Device::Cpu);
                let name = format!("cuda split_heads {dtype:?} ({b}, {t}, 3x{h}x{dh})");
                let fused = |a: &[Tensor]| ops::split_heads(&a[0], h);
                check(
                    &name,
                    &fused,
                    &|a: &[Tensor]| split_ref(&a[0], h),
                    &[qkv],
                    &r,
                    0.0,
                )?;
                let y = rand_t(&[b, h, t, dh], -1.0, 1.0, 23, dtype, &Device::Cpu);
                let r = rand_t(&[b, t, h * dh], -1.0, 1.0, 24, DType::F32, &Device::Cpu);
                let name = format!("cuda merge_heads {dtype:?} ({b}, {h}, {t}, {dh})");
                let fused = |a: &[Tensor]| ops::merge_heads(&a[0]);
                check(
                    &name,
                    &fused,
                    &|a: &[Tensor]| merge_ref(&a[0]),
                    &[y],
                    &r,
                    0.0,
                )?;
            }
        }
        Ok(())
    }

    #[test]
    fn bias_add_cuda_matches_cpu() -> Result<()> {
        for dtype in DTYPES {
            // db: 16384 rows (16 chunks and the finishing pass), 4097 (two chunks, one of a
            // single row), 4096 (one chunk), a column count that is no multiple of 32, one row
            for (i, shape) in [
                &[16384usize, 1152][..],
                &[4097, 33],
                &[4096, 10],
                &[7, 37],
                &[3, 5, 8],
                &[1, 1],
            ]
            .iter()
            .enumerate()
            {
                let c = *shape.last().unwrap();
                let x = rand_t(shape, -2.0, 2.0, 4100 + i as u64, dtype, &Device::Cpu);
                let b = rand_t(&[c], -2.0, 2.0, 4150 + i as u64, dtype, &Device::Cpu);
                let r = rand_t(shape, -1.0, 1.0, 4180 + i as u64, DType::F32, &Device::Cpu);
                let name = format!("cuda bias_add {dtype:?} {shape:?}");
                // db of 16384 rows: relative to its scale, the half dtypes' rounding of the sum
                let bound = if dtype == DType::F32 {
                    1e-4
                } else {
                    tol(dtype)
                };
                check(&name, &bias_fused, &bias_ref, &[x, b], &r, bound)?;
            }
        }
        Ok(())
    }

    #[test]
    fn embedding_cuda_matches_cpu() -> Result<()> {
        for dtype in DTYPES {
            for &(v, c, n) in &[
                (256usize, 384usize, 4096usize),
                (50304, 64, 1000),
                (7, 3, 50),
            ] {
                let mut rng = rand::rngs::StdRng::seed_from_u64(v as u64);
                // few distinct ids in the small table: many atomic adds into one row
                let ids: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
                let ids = Tensor::from_vec(ids, n, &Device::Cpu)?;
                let table = rand_t(&[v, c], -1.0, 1.0, 4300, dtype, &Device::Cpu);
                let r = rand_t(&[n, c], -1.0, 1.0, 4301, DType::F32, &Device::Cpu);
                let name = format!("cuda embedding {dtype:?} ({v}, {c}) x {n}");
                let fused = |a: &[Tensor]| ops::embedding(&ids.to_device(a[0].device())?, &a[0]);
                let reference = |a: &[Tensor]| a[0].to_dtype(DType::F32)?.index_select(&ids, 0);
                check(&name, &fused, &reference, &[table], &r, tol(dtype))?;
            }
        }
        Ok(())
    }

    #[test]
    fn act_linear_cuda_matches_cpu() -> Result<()> {
        for act in ACTIVATIONS {
            for dtype in DTYPES {
                for &(n, k, o) in &[(512usize, 1536usize, 384usize), (3, 7, 5)] {
                    let (args, r) = act_linear_args(n, k, o, dtype, &Device::Cpu);
                    let name = format!("cuda act_linear {act:?} {dtype:?} ({n}, {k}) -> {o}");
                    check(
                        &name,
                        &act_linear_fused(act),
                        &act_linear_ref(act),
                        &args,
                        &r,
                        2.0 * tol(dtype),
                    )?;
                }
            }
        }
        Ok(())
    }

    #[test]
    fn gelu_cuda_matches_cpu() -> Result<()> {
        for dtype in DTYPES {
            for (i, shape) in [&[64usize, 256, 1536][..], &[7, 37], &[1]]
                .iter()
                .enumerate()
            {
                let x = rand_t(shape, -6.0, 6.0, 3800 + i as u64, dtype, &Device::Cpu);
                let r = rand_t(shape, -1.0, 1.0, 3900 + i as u64, DType::F32, &Device::Cpu);
                let name = format!("cuda gelu {dtype:?} {shape:?}");
                check(&name, &gelu_fused, &gelu_ref, &[x], &r, tol(dtype))?;
            }
        }
        Ok(())
    }

    #[test]
    fn gelu_erf_cuda_matches_cpu() -> Result<()> {
        for dtype in DTYPES {
            for (i, shape) in [&[64usize, 64, 1536][..], &[7, 37], &[1]]
                .iter()
                .enumerate()
            {
                let x = rand_t(shape, -6.0, 6.0, 3850 + i as u64, dtype, &Device::Cpu);
                let r = rand_t(shape, -1.0, 1.0, 3950 + i as u64, DType::F32, &Device::Cpu);
                let name = format!("cuda gelu_erf {dtype:?} {shape:?}");
                check(&name, &gelu_erf_fused, &gelu_erf_ref, &[x], &r, tol(dtype))?;
            }
        }
        Ok(())
    }

    #[test]
    fn key_padding_softmax_cuda_matches_cpu() -> Result<()> {
        for dtype in DTYPES {
            for (i, shape) in [&[64usize, 12, 48, 48][..], &[5, 3, 37], &[3, 2, 8, 1024]]
                .iter()
                .enumerate()
            {
                let x = rand_t(shape, -8.0, 8.0, 3700 + i as u64, dtype, &Device::Cpu);
                let r = rand_t(shape, -1.0, 1.0, 3750 + i as u64, DType::F32, &Device::Cpu);
                let name = format!("cuda key-padding softmax {dtype:?} {shape:?}");
                check(&name, &padded_fused, &padded_ref, &[x], &r, tol(dtype))?;
            }
        }
        Ok(())
    }

    #[test]
    fn cross_entropy_cuda_matches_cpu() -> Result<()> {
        for dtype in DTYPES {
            for (i, &(n, c)) in [(64usize, 256usize), (7, 37), (33, 50304), (2, 1)]
                .iter()
                .enumerate()
            {
                let x = rand_t(&[n, c], -6.0, 6.0, 3500 + i as u64, dtype, &Device::Cpu);
                let t = targets(n, c, 3600 + i as u64, &Device::Cpu);
                let r = rand_t(&[n], 0.0, 2.0, 3700 + i as u64, DType::F32, &Device::Cpu);
                let name = format!("cuda cross_entropy {dtype:?} ({n}, {c})");
                // the targets follow the logits (each Device::new_cuda is a distinct device)
                let fused =
                    |a: &[Tensor]| ops::cross_entropy_rows(&a[0], &t.to_device(a[0].device())?);
                let reference = |a: &[Tensor]| ce_ref(&a[0], &t);
                check(&name, &fused, &reference, &[x], &r, tol(dtype))?;
            }
        }
        // an out-of-range target gives NaN on the GPU (no device read to raise an error)
        let dev = gpu();
        let x = Tensor::zeros((2, 3), DType::F32, &dev)?;
        let l: Vec<f32> =
            ops::cross_entropy_rows(&x, &Tensor::new(&[0u32, 3], &dev)?)?.to_vec1()?;
        assert!((l[0] - 3f32.ln()).abs() < 1e-6 && l[1].is_nan(), "{l:?}");
        // masked classes (-inf logits) get probability 0: finite losses and gradients equal
        // to the CPU's. Rows of 6000 with the first 4200 masked: every thread's first loaded
        // vectors are -inf, so its own running maximum starts at -inf (512 threads x 4 f32 =
        // 2048 columns a pass)
        let (n, c) = (5, 6000);
        let mut v = rand_t(&[n, c], -6.0, 6.0, 3710, DType::F32, &Device::Cpu)
            .flatten_all()?
            .to_vec1::<f32>()?;
        for (i, x) in v.iter_mut().enumerate() {
            if i % c < 4200 {
                *x = f32::NEG_INFINITY;
            }
        }
        let x = Tensor::from_vec(v, (n, c), &Device::Cpu)?;
        let t = Tensor::new(&[4200u32, 5000, 5999, 4321, 4201], &Device::Cpu)?;
        let r = rand_t(&[n], 0.0, 2.0, 3711, DType::F32, &Device::Cpu);
        let f = |a: &[Tensor]| ops::cross_entropy_rows(&a[0], &t.to_device(a[0].device())?);
        let (y_g, g_g) = value_and_grads(&f, &[x.to_device(&dev)?], &r.to_device(&dev)?)?;
        let (y_c, g_c) = value_and_grads(&f, &[x], &r)?;
        let e = [err(&y_g, &y_c), err(&g_g[0], &g_c[0])];
        println!("cuda cross_entropy with -inf logits: {e:?}");
        assert!(e.iter().all(|e| *e <= tol(DType::F32)), "{e:?}");
        Ok(())
    }

    #[test]
    fn cross_entropy_mean_cuda_matches_cpu() -> Result<()> {
        // 1300 rows: more than the mean kernel's 512 threads (each sums several rows)
        for dtype in DTYPES {
            for (i, &(n, c)) in [(512usize, 10usize), (1300, 37), (33, 50304), (2, 1)]
                .iter()
                .enumerate()
            {
                let x = rand_t(&[n, c], -6.0, 6.0, 3800 + i as u64, dtype, &Device::Cpu);
                let t = targets(n, c, 3850 + i as u64, &Device::Cpu);
                let r = Tensor::new(0.75f32, &Device::Cpu)?;
                let name = format!("cuda cross_entropy_mean {dtype:?} ({n}, {c})");
                let fused =
                    |a: &[Tensor]| ops::cross_entropy_mean(&a[0], &t.to_device(a[0].device())?);
                let reference = |a: &[Tensor]| ce_ref(&a[0], &t)?.mean_all();
                check(&name, &fused, &reference, &[x], &r, tol(dtype))?;
            }
        }
        // an out-of-range target makes the mean NaN on the GPU
        let dev = gpu();
        let x = Tensor::zeros((2, 3), DType::F32, &dev)?;
        let l = ops::cross_entropy_mean(&x, &Tensor::new(&[0u32, 3], &dev)?)?;
        assert!(l.to_scalar::<f32>()?.is_nan());
        Ok(())
    }

    #[test]
    fn cuda_masked_softmax_and_f32_output_norms() -> Result<()> {
        let x = rand_t(&[6, 40], -3.0, 3.0, 7, DType::F32, &Device::Cpu);
        let mask: Vec<f32> = (0..6 * 40)
            .map(|i| {
                if i % 40 > 5 + i / 40 {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let x = (x + Tensor::from_vec(mask, (6, 40), &Device::Cpu)?)?;
        let r = rand_t(&[6, 40], -1.0, 1.0, 8, DType::F32, &Device::Cpu);
        check("cuda softmax masked", &sm_fused, &sm_ref, &[x], &r, 1e-5)?;

        for dtype in [DType::BF16, DType::F16] {
            let (args, r) = norm_args(&[33, 256], dtype, 4000, &Device::Cpu);
            let f = |a: &[Tensor]| ops::layer_norm_with_dtype(&a[0], &a[1], &a[2], EPS, DType::F32);
            let dev = gpu();
            let (y, g) = value_and_grads(&f, &to(&args, &dev), &r.to_device(&dev)?)?;
            let (y_c, g_c) = value_and_grads(&f, &args, &r)?;
            assert_eq!((y.dtype(), g[0].dtype()), (DType::F32, dtype));
            let e: Vec<f32> = std::iter::once(err(&y, &y_c))
                .chain(g.iter().zip(&g_c).map(|(a, b)| err(a, b)))
                .collect();
            println!("cuda layer_norm {dtype:?} -> f32: vs cpu {}", fmt_errs(&e));
            assert!(e[0] <= 1e-5 && e.iter().all(|v| *v <= tol(dtype)), "{e:?}");
            let f = |a: &[Tensor]| ops::rms_norm_with_dtype(&a[0], &a[1], EPS, DType::F32);
            let (y, _) = value_and_grads(&f, &to(&args[..2], &dev), &r.to_device(&dev)?)?;
            let (y_c, _) = value_and_grads(&f, &args[..2], &r)?;
            assert!(err(&y, &y_c) <= 1e-5);
        }
        Ok(())
    }

    #[test]
    fn cuda_misaligned_and_strided_inputs() -> Result<()> {
        // x one element into its buffer: not 16-byte aligned, so the scalar kernels must run
        // (forward and backward); x transposed: made contiguous first.
        let cpu = &Device::Cpu;
        for dtype in DTYPES {
            let flat = rand_t(&[1 + 16 * 64], 0.0, 3.0, 5000, dtype, cpu);
            let (args, r) = norm_args(&[16, 64], dtype, 5001, cpu);
            let fused = |a: &[Tensor]| ops::layer_norm(&offset(&a[0], 16, 64)?, &a[1], &a[2], EPS);
            let reference =
                |a: &[Tensor]| ln_ref(&[offset(&a[0], 16, 64)?, a[1].clone(), a[2].clone()]);
            let name = format!("cuda layer_norm offset x {dtype:?}");
            let args = [flat, args[1].clone(), args[2].clone()];
            check(&name, &fused, &reference, &args, &r, tol(dtype))?;

            let xs = rand_t(&[64, 16], -2.0, 2.0, 5002, dtype, cpu);
            let fused = |a: &[Tensor]| ops::softmax_last_dim(&strided(&a[0])?);
            let reference = |a: &[Tensor]| sm_ref(&[strided(&a[0])?]);
            check(
                &format!("cuda softmax strided x {dtype:?}"),
                &fused,
                &reference,
                &[xs],
                &r,
                tol(dtype),
            )?;

            let flat = rand_t(&[1 + 16 * 64], -2.0, 2.0, 5003, dtype, cpu);
            let fused = |a: &[Tensor]| ops::softmax_last_dim(&offset(&a[0], 16, 64)?);
            let reference = |a: &[Tensor]| sm_ref(&[offset(&a[0], 16, 64)?]);
            check(
                &format!("cuda softmax offset x {dtype:?}"),
                &fused,
                &reference,
                &[flat],
                &r,
                tol(dtype),
            )?;
        }
        Ok(())
    }

    #[test]
    fn cuda_parameter_gradients_are_deterministic() -> Result<()> {
        let dev = gpu();
        let (args, r) = norm_args(&[20000, 96], DType::BF16, 6000, &Device::Cpu);
        let (args, r) = (to(&args, &dev), r.to_device(&dev)?);
        let (_, g1) = value_and_grads(&ln_fused, &args, &r)?;
        let (_, g2) = value_and_grads(&ln_fused, &args, &r)?;
        for (a, b) in g1.iter().zip(&g2) {
            let a: Vec<f32> = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            let b: Vec<f32> = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "not bitwise equal"
            );
        }
        println!("cuda layer_norm backward: bitwise reproducible over 2 runs (20000 x 96 bf16)");
        Ok(())
    }

    #[test]
    fn cuda_device_mismatch_is_an_error() -> Result<()> {
        let dev = gpu();
        let x = Tensor::zeros((4, 8), DType::F32, &dev)?;
        let w = Tensor::ones(8, DType::F32, &Device::Cpu)?;
        let m = ops::rms_norm(&x, &w, EPS)
            .expect_err("device mismatch")
            .to_string();
        assert!(m.contains("w is on") && m.contains("same device"), "{m}");
        Ok(())
    }

    #[test]
    fn linear_cuda_matches_cpu() -> Result<()> {
        use DType::{BF16, F16, F32};
        // GPT-like shapes (the attention input projection in wick's mixed mode: f32 x from a
        // norm, bf16 working weight, f32 bias master), f32 throughout, and small odd shapes
        let cases: [(&[usize], usize, LinearDtypes); 5] = [
            (&[4, 128, 384], 1152, (F32, BF16, Some(F32))),
            (&[4, 128, 384], 1152, (F32, F32, Some(F32))),
            (&[4, 128, 384], 1536, (BF16, BF16, Some(BF16))),
            (&[7, 37], 24, (F16, F16, Some(F16))),
            (&[3, 5, 40], 24, (F32, BF16, None)),
        ];
        // the composed path Linear ran before (its bias column sum is f32, as the fused op's;
        // candle's CPU broadcast_add backward sums 512 rows in bf16)
        let before = |a: &[Tensor]| {
            let w = &a[1];
            let lin = candle_nn::Linear::new(w.clone(), None);
            let y = candle_core::Module::forward(&lin, &a[0].to_dtype(w.dtype())?)?;
            match a.get(2) {
                Some(b) => ops::bias_add(&y, b),
                None => Ok(y),
            }
        };
        for (i, (shape, out, dtypes)) in cases.iter().enumerate() {
            let (args, r) = linear_args(shape, *out, *dtypes, 9500 + 10 * i as u64);
            let name = format!("cuda linear {dtypes:?} x {shape:?} out {out}");
            // f32: sums of up to 1152 products in a different order; half: the output rounding
            let bound = if dtypes.1 == F32 {
                1e-4
            } else {
                2.0 * tol(dtypes.1)
            };
            check(&name, &linear_fused, &before, &args, &r, bound)?;
        }
        // strided x (cast from the view) and transposed w (the other cuBLAS operand layout)
        // x is stored (64, 384) and used as its (384, 64) transpose; w (96, 64) as a transpose
        let (args, _) = linear_args(&[384, 64], 96, (F32, BF16, Some(F32)), 9560);
        let x = rand_t(&[64, 384], -1.0, 1.0, 9561, F32, &Device::Cpu);
        let args = [x, args[1].t()?.contiguous()?, args[2].clone()];
        let r = rand_t(&[384, 96], -1.0, 1.0, 9565, F32, &Device::Cpu);
        let fused = |a: &[Tensor]| linear_fused(&[strided(&a[0])?, a[1].t()?, a[2].clone()]);
        let reference = |a: &[Tensor]| before(&[strided(&a[0])?, a[1].t()?, a[2].clone()]);
        check(
            "cuda linear strided x, transposed w",
            &fused,
            &reference,
            &args,
            &r,
            tol(BF16),
        )?;

        let dev = gpu();
        let x = Tensor::zeros((4, 8), F32, &dev)?;
        let w = Tensor::zeros((3, 8), BF16, &Device::Cpu)?;
        let m = ops::linear(&x, &w, None)
            .expect_err("device mismatch")
            .to_string();
        assert!(m.contains("w is on") && m.contains("same device"), "{m}");
        Ok(())
    }

    #[test]
    fn linear_bias_epilogue_takes_offset_and_misaligned_operands() -> Result<()> {
        // bf16 x at a row offset (16-byte aligned: cuBLASLt's bias epilogue) and one element
        // off a 16-byte boundary (the unfused path): both give the CPU's forward (the
        // epilogue's order) within one bf16 rounding of the output
        let dev = gpu();
        let dtypes = (DType::BF16, DType::BF16, Some(DType::F32));
        let (args, _) = linear_args(&[64, 384], 1152, dtypes, 9700);
        let cpu = linear_epilogue_ref(&args)?;
        let scale = err(&cpu, &cpu.zeros_like()?);
        let big = Tensor::cat(&[&args[0], &args[0]], 0)?.to_device(&dev)?;
        let (w, b) = (args[1].to_device(&dev)?, args[2].to_device(&dev)?);
        for (what, x) in [
            ("row offset", big.narrow(0, 64, 64)?),
            ("misaligned", misaligned(&args[0], &dev)?),
        ] {
            let e = err(&ops::linear(&x, &w, Some(&b))?, &cpu) / scale;
            assert!(e <= 2.0 * 2f32.powi(-8), "{what}: relative error {e}");
        }
        Ok(())
    }

    /// `x` with its elements moved one place along a fresh buffer, so that its first element is
    /// off a 16-byte boundary (the kernels' vector paths must not apply).
    fn misaligned(x: &Tensor, dev: &Device) -> Result<Tensor> {
        let n = x.elem_count();
        let pad = Tensor::zeros(1, x.dtype(), &Device::Cpu)?;
        let flat = Tensor::cat(&[pad, x.flatten_all()?], 0)?.to_device(dev)?;
        flat.narrow(0, 1, n)?.reshape(x.dims())
    }

    #[test]
    fn rotary_qkv_cuda_matches_cpu() -> Result<()> {
        // SmolLM2's heads at T = 200 (16-byte vectors), a half width of 6 (the scalar kernel
        // for every dtype), one position
        let cases = [
            (2usize, 200usize, 9usize, 3usize, 64usize),
            (1, 70, 6, 2, 12),
            (3, 1, 4, 4, 32),
        ];
        for dtype in DTYPES {
            for (i, &(b, t, h, hkv, d)) in cases.iter().enumerate() {
                let w = (h + 2 * hkv) * d;
                let qkv = rand_t(&[b, t, w], -2.0, 2.0, 5500 + i as u64, dtype, &Device::Cpu);
                let r = rand_t(
                    &[b, t, w],
                    -1.0,
                    1.0,
                    5510 + i as u64,
                    DType::F32,
                    &Device::Cpu,
                );
                let (cos, sin) = ops::rotary_tables(t, d, 1e5, 7, &Device::Cpu)?;
                let fused = |a: &[Tensor]| {
                    let dev = a[0].device();
                    ops::rotary_qkv(&a[0], &cos.to_device(dev)?, &sin.to_device(dev)?, h, hkv)
                };
                let reference = |a: &[Tensor]| rotary_ref(&a[0], &cos, &sin, h, hkv);
                let name = format!("cuda rotary {dtype:?} {:?}", (b, t, h, hkv, d));
                check(&name, &fused, &reference, &[qkv], &r, tol(dtype))?;
            }
        }
        // tables made for the GPU are the CPU's; a misaligned qkv takes the scalar kernel
        let (b, t, h, hkv, d) = (2, 50, 9, 3, 64);
        let qkv = rand_t(
            &[b, t, (h + 2 * hkv) * d],
            -2.0,
            2.0,
            5520,
            DType::BF16,
            &Device::Cpu,
        );
        let dev = gpu();
        let (cos, sin) = ops::rotary_tables(t, d, 1e5, 0, &Device::Cpu)?;
        let (cos_g, sin_g) = ops::rotary_tables(t, d, 1e5, 0, &dev)?;
        assert_eq!(err(&cos_g, &cos), 0.0);
        assert_eq!(err(&sin_g, &sin), 0.0);
        let y_c = ops::rotary_qkv(&qkv, &cos, &sin, h, hkv)?;
        let y_g = ops::rotary_qkv(&misaligned(&qkv, &dev)?, &cos_g, &sin_g, h, hkv)?;
        let e = err(&y_g, &y_c);
        println!("cuda rotary misaligned: {e:.2e}");
        assert!(e <= tol(DType::BF16));
        // tables on the CPU for a GPU qkv: an error naming the device
        let m = ops::rotary_qkv(&qkv.to_device(&dev)?, &cos, &sin, h, hkv)
            .expect_err("device mismatch")
            .to_string();
        assert!(m.contains("cos is on"), "{m}");
        Ok(())
    }

    #[test]
    fn swiglu_cuda_matches_cpu() -> Result<()> {
        for dtype in DTYPES {
            // SmolLM2's MLP width 1536 (16-byte vectors), F = 37 (scalar), F = 4 (vectors for
            // f32 only), one pair
            for (i, shape) in [
                &[4usize, 128, 2 * 1536][..],
                &[7, 2 * 37],
                &[3, 2 * 4],
                &[1, 2],
            ]
            .iter()
            .enumerate()
            {
                let x = rand_t(shape, -6.0, 6.0, 5600 + i as u64, dtype, &Device::Cpu);
                let mut out = shape.to_vec();
                *out.last_mut().unwrap() /= 2;
                let r = rand_t(&out, -1.0, 1.0, 5610 + i as u64, DType::F32, &Device::Cpu);
                let name = format!("cuda swiglu {dtype:?} {shape:?}");
                check(&name, &swiglu_fused, &swiglu_ref, &[x], &r, tol(dtype))?;
            }
        }
        let x = rand_t(&[5, 2 * 64], -6.0, 6.0, 5620, DType::BF16, &Device::Cpu);
        let e = err(&ops::swiglu(&misaligned(&x, &gpu())?)?, &ops::swiglu(&x)?);
        println!("cuda swiglu misaligned: {e:.2e}");
        assert!(e <= tol(DType::BF16));
        Ok(())
    }

    #[test]
    fn grouped_causal_attention_cuda_matches_cpu() -> Result<()> {
        // SmolLM2's 9 query / 3 key-value heads at T = 200 (a partial last tile), exact tiles,
        // one position, multi-query over a partial tile, multi-head
        let cases = [
            (2usize, 200usize, 9usize, 3usize),
            (2, 128, 6, 2),
            (1, 1, 9, 3),
            (2, 70, 4, 1),
            (1, 130, 3, 3),
            // shorter than one tile, T % 4 == 0: on Hopper the TMA kernels' boxes reach past
            // the tensor in every map (qkv, dO, L and D rows)
            (2, 60, 4, 2),
        ];
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for (i, &(b, t, h, hkv)) in cases.iter().enumerate() {
                let w = (h + 2 * hkv) * 64;
                let qkv = rand_t(&[b, t, w], -2.0, 2.0, 5700 + i as u64, dtype, &Device::Cpu);
                let r = rand_t(
                    &[b, t, h * 64],
                    -1.0,
                    1.0,
                    5710 + i as u64,
                    DType::F32,
                    &Device::Cpu,
                );
                let name = format!("cuda grouped attention {dtype:?} {:?}", (b, t, h, hkv));
                let fused = |a: &[Tensor]| ops::grouped_causal_attention(&a[0], h, hkv);
                let reference = |a: &[Tensor]| gqa_ref(&a[0], h, hkv);
                check(&name, &fused, &reference, &[qkv], &r, tol(dtype))?;
            }
        }
        // the flash backward is deterministic: two backward passes agree bit for bit
        let dev = gpu();
        let (b, t, h, hkv) = (2, 200, 9, 3);
        let qkv = rand_t(
            &[b, t, (h + 2 * hkv) * 64],
            -2.0,
            2.0,
            5720,
            DType::BF16,
            &dev,
        );
        let r = rand_t(&[b, t, h * 64], -1.0, 1.0, 5721, DType::F32, &dev);
        let f = |a: &[Tensor]| ops::grouped_causal_attention(&a[0], h, hkv);
        let (_, g1) = value_and_grads(&f, std::slice::from_ref(&qkv), &r)?;
        let (_, g2) = value_and_grads(&f, std::slice::from_ref(&qkv), &r)?;
        let bits = |t: &Tensor| t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>();
        assert_eq!(bits(&g1[0])?, bits(&g2[0])?);
        // a misaligned qkv is copied, not misread
        let qkv_c = qkv.to_device(&Device::Cpu)?;
        let y_c = ops::grouped_causal_attention(&qkv_c, h, hkv)?;
        let y_g = ops::grouped_causal_attention(&misaligned(&qkv_c, &dev)?, h, hkv)?;
        let e = err(&y_g, &y_c);
        println!("cuda grouped attention misaligned: {e:.2e}");
        assert!(e <= tol(DType::BF16));
        // the composed path on CUDA: a head width of 32
        for (dtype, d) in [(DType::F32, 32usize), (DType::BF16, 32)] {
            let (b, t, h, hkv) = (2, 70, 6, 2);
            let qkv = rand_t(
                &[b, t, (h + 2 * hkv) * d],
                -2.0,
                2.0,
                5730,
                dtype,
                &Device::Cpu,
            );
            let r = rand_t(&[b, t, h * d], -1.0, 1.0, 5731, DType::F32, &Device::Cpu);
            let name = format!("cuda grouped attention {dtype:?} head width {d} (composed)");
            let fused = |a: &[Tensor]| ops::grouped_causal_attention(&a[0], h, hkv);
            let reference = |a: &[Tensor]| gqa_ref(&a[0], h, hkv);
            check(&name, &fused, &reference, &[qkv], &r, tol(dtype))?;
        }
        Ok(())
    }
}

// ---- linear: the fused op against the composed path it replaces ----

fn linear_fused(a: &[Tensor]) -> Result<Tensor> {
    ops::linear(&a[0], &a[1], a.get(2))
}
/// The composed path: x cast to w's dtype, candle-nn's Linear without bias (reshape, matmul
/// with `w.t()`, reshape), then `broadcast_add` of the bias cast to the output dtype.
fn linear_ref(a: &[Tensor]) -> Result<Tensor> {
    let w = &a[1];
    let lin = candle_nn::Linear::new(w.clone(), None);
    let y = candle_core::Module::forward(&lin, &a[0].to_dtype(w.dtype())?)?;
    match a.get(2) {
        Some(b) => y.broadcast_add(&b.to_dtype(y.dtype())?),
        None => Ok(y),
    }
}

/// linear's forward in the order of a GEMM with the bias in its epilogue (cuBLASLt's, which
/// the CPU path follows) for bf16/f16 weights with a bias: x and w in w's dtype, the product
/// in f32 over all rows at once, plus the bias rounded to w's dtype, then one rounding; other
/// cases: [`linear_ref`].
fn linear_epilogue_ref(a: &[Tensor]) -> Result<Tensor> {
    let (x, w) = (&a[0], &a[1]);
    let (wd, f32) = (w.dtype(), DType::F32);
    let Some(b) = a.get(2).filter(|_| matches!(wd, DType::BF16 | DType::F16)) else {
        return linear_ref(a);
    };
    let (n, k) = w.dims2()?;
    let mut out = x.dims().to_vec();
    *out.last_mut().unwrap() = n;
    let x32 = x.to_dtype(wd)?.to_dtype(f32)?.reshape(((), k))?;
    let y = x32.matmul(&w.to_dtype(f32)?.t()?)?;
    let y = y.broadcast_add(&b.to_dtype(wd)?.to_dtype(f32)?)?;
    y.to_dtype(wd)?.reshape(out)
}

/// The dtypes of linear's x, w and b (None: no bias).
type LinearDtypes = (DType, DType, Option<DType>);

/// x `(.., in)`, w `(out, in)`, b `(out,)` when `b` names a dtype, and r shaped like y.
fn linear_args(
    x_shape: &[usize],
    out: usize,
    dtypes: LinearDtypes,
    seed: u64,
) -> (Vec<Tensor>, Tensor) {
    let cpu = &Device::Cpu;
    let k = *x_shape.last().unwrap();
    let bound = 1.0 / (k.max(1) as f32).sqrt();
    let mut args = vec![
        rand_t(x_shape, -2.0, 2.0, seed, dtypes.0, cpu),
        rand_t(&[out, k], -bound, bound, seed + 1, dtypes.1, cpu),
    ];
    if let Some(bd) = dtypes.2 {
        args.push(rand_t(&[out], -1.0, 1.0, seed + 2, bd, cpu));
    }
    let mut y_shape = x_shape.to_vec();
    *y_shape.last_mut().unwrap() = out;
    (args, rand_t(&y_shape, -1.0, 1.0, seed + 3, DType::F32, cpu))
}

/// Values and gradients of fused and composed linear; checks the output dtype (w's) and that
/// every gradient has its argument's shape and dtype; returns the errors (y, then dx, dw, db).
fn compare_linear(
    name: &str,
    fused: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    args: &[Tensor],
    r: &Tensor,
) -> Result<Vec<f32>> {
    let (y, g) = value_and_grads(fused, args, r)?;
    assert_eq!(y.dtype(), args[1].dtype(), "{name}: output dtype");
    for (gi, ai) in g.iter().zip(args) {
        assert_eq!(
            (gi.dims(), gi.dtype()),
            (ai.dims(), ai.dtype()),
            "{name}: gradient shape/dtype"
        );
    }
    compare_any(name, fused, &linear_ref, args, r)
}

/// (x, w, b) dtypes: all f32; wick's mixed case (f32 x from a norm, bf16 working weight, f32
/// bias master); all-half; no bias.
const LINEAR_DTYPES: [LinearDtypes; 6] = [
    (DType::F32, DType::F32, Some(DType::F32)),
    (DType::F32, DType::BF16, Some(DType::F32)),
    (DType::BF16, DType::BF16, Some(DType::BF16)),
    (DType::F16, DType::F16, Some(DType::F16)),
    (DType::F32, DType::BF16, None),
    (DType::F32, DType::F32, None),
];

#[test]
fn linear_matches_composed_on_cpu() -> Result<()> {
    for (j, dtypes) in LINEAR_DTYPES.iter().enumerate() {
        for (i, shape) in [&[6usize, 40][..], &[2, 5, 40], &[2, 2, 3, 17], &[1, 8]]
            .iter()
            .enumerate()
        {
            let seed = 9000 + 100 * j as u64 + 10 * i as u64;
            let (args, r) = linear_args(shape, 24, *dtypes, seed);
            let name = format!("linear {dtypes:?} x {shape:?}");
            let errs = compare_linear(&name, &linear_fused, &args, &r)?;
            // the same cast, GEMM and bias rounding as the epilogue-order reference (the
            // composed ops' when w is f32 or there is no bias): identical values; against the
            // composed ops, one rounding of the output apart
            let y = linear_fused(&args)?;
            assert_eq!(
                err(&y, &linear_epilogue_ref(&args)?),
                0.0,
                "{name}: forward"
            );
            assert!(
                errs[0] <= tol(dtypes.1),
                "{name}: forward differs: {errs:?}"
            );
            // gradients: GEMM summation order (dy^T x against (x^T dy)^T) and the rounding of
            // half-dtype column sums
            let bound = 2.0 * tol(dtypes.1);
            assert!(errs.iter().all(|e| *e <= bound), "{name}: {errs:?}");
        }
    }
    Ok(())
}

#[test]
fn linear_takes_strided_offset_and_transposed_arguments() -> Result<()> {
    let cpu = &Device::Cpu;
    for (j, wd) in [DType::F32, DType::BF16].into_iter().enumerate() {
        let seed = 9700 + 10 * j as u64;
        let bound = 2.0 * tol(wd);
        let (args, _) = linear_args(&[6, 40], 24, (DType::F32, wd, Some(DType::F32)), seed);
        let (w, b) = (args[1].clone(), args[2].clone());
        let x_t = rand_t(&[40, 6], -2.0, 2.0, seed + 4, DType::F32, cpu);
        let args = [x_t, w.clone(), b.clone()];
        let r = rand_t(&[6, 24], -1.0, 1.0, seed + 5, DType::F32, cpu);

        // x transposed: cast straight from the strided view (bf16 w) or made contiguous (f32 w)
        let fused = |a: &[Tensor]| linear_fused(&[strided(&a[0])?, a[1].clone(), a[2].clone()]);
        let reference = |a: &[Tensor]| linear_ref(&[strided(&a[0])?, a[1].clone(), a[2].clone()]);
        let name = format!("linear strided x, {wd:?} w");
        let errs = compare_any(&name, &fused, &reference, &args, &r)?;
        assert!(errs.iter().all(|e| *e <= bound), "{name}: {errs:?}");

        // x one element into its buffer (a start offset)
        let flat = rand_t(&[1 + 6 * 40], -2.0, 2.0, seed + 6, DType::F32, cpu);
        let fused =
            |a: &[Tensor]| linear_fused(&[offset(&a[0], 6, 40)?, a[1].clone(), a[2].clone()]);
        let reference =
            |a: &[Tensor]| linear_ref(&[offset(&a[0], 6, 40)?, a[1].clone(), a[2].clone()]);
        let name = format!("linear offset x, {wd:?} w");
        let args = [flat, w.clone(), b.clone()];
        let errs = compare_any(&name, &fused, &reference, &args, &r)?;
        assert!(errs.iter().all(|e| *e <= bound), "{name}: {errs:?}");

        // w stored (in, out) and passed as its transpose: read as a transposed operand
        let x = rand_t(&[6, 40], -2.0, 2.0, seed + 7, DType::F32, cpu);
        let fused = |a: &[Tensor]| linear_fused(&[a[0].clone(), a[1].t()?, a[2].clone()]);
        let reference = |a: &[Tensor]| linear_ref(&[a[0].clone(), a[1].t()?, a[2].clone()]);
        let name = format!("linear transposed w, {wd:?}");
        let args = [x, w.t()?.contiguous()?, b];
        let errs = compare_any(&name, &fused, &reference, &args, &r)?;
        assert!(errs.iter().all(|e| *e <= bound), "{name}: {errs:?}");
    }
    Ok(())
}

#[test]
fn linear_rank_one_and_empty_shapes() -> Result<()> {
    let cpu = &Device::Cpu;
    let mixed = (DType::F32, DType::BF16, Some(DType::F32));
    // x (in,) -> (out,), as torch.nn.functional.linear
    let (args, _) = linear_args(&[1, 40], 24, mixed, 9800);
    let y1 = ops::linear(&args[0].squeeze(0)?, &args[1], Some(&args[2]))?;
    let y2 = ops::linear(&args[0], &args[1], Some(&args[2]))?.squeeze(0)?;
    assert_eq!(y1.dims(), &[24]);
    assert_eq!(err(&y1, &y2), 0.0);

    // no rows: (0, in) -> (0, out); x and the weight still get gradients (zero)
    let (args, r) = linear_args(&[0, 40], 24, mixed, 9810);
    let b = args[2].clone();
    let f = |a: &[Tensor]| ops::linear(&a[0], &a[1], Some(&b));
    let (y, g) = value_and_grads(&f, &args[..2], &r)?;
    assert_eq!(y.dims(), &[0, 24]);
    assert_eq!(
        (g[0].dims(), g[1].dims()),
        (&[0usize, 40][..], &[24usize, 40][..])
    );
    let s = g[1].to_dtype(DType::F32)?.abs()?.sum_all()?;
    assert_eq!(s.to_scalar::<f32>()?, 0.0);

    // in = 0: y is the bias on every row
    let x = Tensor::zeros((3, 0), DType::F32, cpu)?;
    let w = Tensor::zeros((4, 0), DType::F32, cpu)?;
    let b = Tensor::new(&[1f32, 2., 3., 4.], cpu)?;
    let y = ops::linear(&x, &w, Some(&b))?;
    assert_eq!(y.to_vec2::<f32>()?, vec![vec![1f32, 2., 3., 4.]; 3]);
    Ok(())
}

#[test]
fn linear_bad_inputs_give_clear_errors() -> Result<()> {
    let cpu = &Device::Cpu;
    let x = Tensor::zeros((4, 8), DType::F32, cpu)?;
    let w = Tensor::zeros((3, 8), DType::BF16, cpu)?;
    let b = Tensor::zeros(3, DType::F32, cpu)?;
    let msg = |r: Result<Tensor>| r.expect_err("expected an error").to_string();

    let w7 = Tensor::zeros((3, 7), DType::BF16, cpu)?;
    let m = msg(ops::linear(&x, &w7, Some(&b)));
    let named = m.contains("[4, 8]") && m.contains("[3, 7]") && m.contains("transpose w");
    assert!(named, "{m}");
    let m = msg(ops::linear(
        &x,
        &w,
        Some(&Tensor::zeros(4, DType::F32, cpu)?),
    ));
    assert!(m.contains("b has shape [4]") && m.contains("(3,)"), "{m}");
    let m = msg(ops::linear(&x, &Tensor::zeros(8, DType::BF16, cpu)?, None));
    assert!(
        m.contains("w has shape [8]") && m.contains("(out, in)"),
        "{m}"
    );
    let m = msg(ops::linear(&Tensor::new(1f32, cpu)?, &w, None));
    assert!(m.contains("scalar"), "{m}");
    let m = msg(ops::linear(&x.to_dtype(DType::U32)?, &w, None));
    assert!(m.contains("linear") && m.contains("U32"), "{m}");
    let m = msg(ops::linear(&x, &w.to_dtype(DType::F64)?, None));
    assert!(m.contains("w has dtype F64"), "{m}");
    let m = msg(ops::linear(&x, &w, Some(&b.to_dtype(DType::U8)?)));
    assert!(m.contains("b has dtype U8"), "{m}");
    Ok(())
}

#[test]
fn nn_linear_is_one_graph_node() -> anyhow::Result<()> {
    use candle_core::Module;
    let store = wick::ParamStore::new(wick::Precision::Bf16Mixed, Device::Cpu, 0);
    let l = wick::nn::Linear::new(&store, "l", 16, 12, true)?;
    let x = rand_t(&[2, 3, 16], -1.0, 1.0, 9900, DType::F32, &Device::Cpu);
    let x = Var::from_tensor(&x)?;
    let y = l.forward(x.as_tensor())?;
    assert_eq!((y.dims(), y.dtype()), (&[2usize, 3, 12][..], DType::BF16));
    // y itself and its three leaves (x, the weight and the bias working copies)
    assert_eq!(y.sorted_nodes().len(), 4);
    // the composed path it replaces: the same values, through more nodes
    let bias = store.params().into_iter().find(|p| p.name == "l.bias");
    let (w, b) = (l.weight().clone(), bias.unwrap().differentiated().clone());
    let lin = candle_nn::Linear::new(w, None);
    let y_old = ops::bias_add(&lin.forward(&x.as_tensor().to_dtype(DType::BF16)?)?, &b)?;
    // the bias added before the output's one rounding: one bf16 rounding apart from the
    // composition, which rounds the GEMM's output, then the sum
    let args = [x.as_tensor().clone(), l.weight().clone(), b.clone()];
    assert_eq!(err(&y, &linear_epilogue_ref(&args)?), 0.0);
    assert!(err(&y, &y_old) <= tol(DType::BF16));
    println!(
        "nn::Linear graph nodes: {} fused, {} composed",
        y.sorted_nodes().len(),
        y_old.sorted_nodes().len()
    );
    let grads = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
    let dx = grads.get(x.as_tensor()).map(|g| g.dtype());
    assert_eq!(dx, Some(DType::F32));
    for p in store.params() {
        assert!(
            grads.get(p.differentiated()).is_some(),
            "{} got no gradient",
            p.name
        );
    }
    Ok(())
}
