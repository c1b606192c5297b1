//! cuBLASLt's DGELU epilogue (`wick::cuda::gemm_dgelu`) and act_linear's backward that uses it,
//! on the GPU (feature `cuda`), against an f64 CPU reference computed here from the operands'
//! exact values with the closed form of the tanh GELU's derivative, and against the unfused
//! path (`PerfSettings::gelu_epilogue` off).
//!
//! Tolerances. The epilogue multiplies the GEMM's f32 accumulator by the derivative and rounds
//! once to the output dtype: at most half an ulp, `2^-8 |ref|` in bf16 (8 significand bits) and
//! `2^-11 |ref|` in f16. On top, `4e-3 |dy @ w|` for the derivative as the epilogue evaluates
//! it: its tanh may be a hardware approximation (`tanh.approx.f32`, relative error about 2^-11),
//! and the derivative `0.5 (1 + t) + 0.5 h (1 - t^2) sqrt(2/pi) (1 + 3 0.044715 h^2)` moves by up
//! to about 6 times an error in t for |h| <= 3. The f32 accumulation over K <= 384 products
//! (relative 2^-24 each) stays far below both. The unfused path rounds `dy @ w` to the dtype
//! first: one more rounding, so its bound is twice the rounding term.

#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::{Rng, SeedableRng};
use wick::cuda::gemm_dgelu::{dgelu_matmul, DgeluGrads};
use wick::ops::{self, Activation};
use wick::perf::PerfSettings;

fn gpu() -> Device {
    Device::new_cuda(0).expect("these tests need a CUDA device (Device::new_cuda(0))")
}

/// Uniform values in `[lo, hi)` rounded to `dtype`, as a tensor on `dev` and as the exact f64
/// values it holds.
fn uniform(
    n: &[usize],
    lo: f32,
    hi: f32,
    seed: u64,
    dtype: DType,
    dev: &Device,
) -> (Tensor, Vec<f64>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let v: Vec<f32> = (0..n.iter().product::<usize>())
        .map(|_| rng.random_range(lo..hi))
        .collect();
    let t = Tensor::from_vec(v, n, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("random tensor");
    (t.to_device(dev).expect("upload"), values(&t))
}

fn values(t: &Tensor) -> Vec<f64> {
    let v = t
        .to_dtype(DType::F32)
        .and_then(|t| t.flatten_all()?.to_vec1::<f32>());
    v.expect("download").into_iter().map(f64::from).collect()
}

const K0: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
const K1: f64 = 0.044_715;

/// d/dx of `0.5 x (1 + tanh(K0 (x + K1 x^3)))`.
fn gelu_tanh_grad(x: f64) -> f64 {
    let t = (K0 * (x + K1 * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * K0 * (1.0 + 3.0 * K1 * x * x)
}

/// d/dx of `x Phi(x)`: `Phi(x) + x phi(x)` (the exact GELU's), with erf from Abramowitz and
/// Stegun 7.1.26 (absolute error below 1.5e-7, far below what it is compared with).
fn gelu_erf_grad(x: f64) -> f64 {
    let erf = |z: f64| {
        let s = z.signum();
        let z = z.abs();
        let t = 1.0 / (1.0 + 0.327_591_1 * z);
        let p = t
            * (0.254_829_592
                + t * (-0.284_496_736
                    + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
        s * (1.0 - p * (-z * z).exp())
    };
    let cdf = 0.5 * (1.0 + erf(x / std::f64::consts::SQRT_2));
    cdf + x * (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

/// `dg = dy @ w` for `dy: (m, k)`, `w: (k, n)` row-major.
fn matmul(dy: &[f64], w: &[f64], (m, n, k): (usize, usize, usize)) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for c in 0..k {
            let a = dy[i * k + c];
            for j in 0..n {
                out[i * n + j] += a * w[c * n + j];
            }
        }
    }
    out
}

/// Half an ulp, relative: the one rounding to `dtype`.
fn rounding(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-8),
        _ => 2f64.powi(-11),
    }
}

/// The derivative's evaluation slack, relative to `|dy @ w|` (module docs).
const DERIV: f64 = 4e-3;

struct Problem {
    dy: Tensor,
    w: Tensor,
    h: Tensor,
    dg: Vec<f64>,
    hv: Vec<f64>,
}

/// `dy: (m, k)` in [-1, 1), `w: (k, n)` in [-0.5, 0.5), `h: (m, n)` in [-3, 3) (GELU's inputs
/// where its forms differ most), all in `dtype` on the GPU, with the exact `dy @ w`.
fn problem((m, n, k): (usize, usize, usize), dtype: DType, seed: u64) -> Problem {
    let dev = gpu();
    let (dy, dyv) = uniform(&[m, k], -1.0, 1.0, seed, dtype, &dev);
    let (w, wv) = uniform(&[k, n], -0.5, 0.5, seed + 1, dtype, &dev);
    let (h, hv) = uniform(&[m, n], -3.0, 3.0, seed + 2, dtype, &dev);
    let dg = matmul(&dyv, &wv, (m, n, k));
    Problem { dy, w, h, dg, hv }
}

/// Largest `|got - ref| / (rel |ref| + DERIV |dg|)` over the elements, with `ref = dg *
/// gelu_tanh'(h)`: at most 1 within the bound.
fn worst(got: &[f64], dg: &[f64], hv: &[f64], rel: f64) -> f64 {
    got.iter()
        .zip(dg.iter().zip(hv))
        .map(|(g, (dg, h))| {
            let r = dg * gelu_tanh_grad(*h);
            (g - r).abs() / (rel * r.abs() + DERIV * dg.abs() + 1e-30)
        })
        .fold(0.0, f64::max)
}

/// GPT-2's MLP at a few rows (K = 384 in, N = 1536 hidden), a small odd row count, and one
/// row of 8 (cuBLASLt may offer no algorithm for it: then the fallback must be `None`).
const SHAPES: [(usize, usize, usize); 3] = [(256, 1536, 384), (37, 136, 64), (1, 8, 8)];

/// Runs the epilogue on `SHAPES` in bf16 and f16 and checks dh against the reference; `more`
/// checks the rest. Only the last shape may be declined.
fn each_case(bias_grad: bool, more: &dyn Fn(&str, &DgeluGrads, &Problem, DType)) -> Result<()> {
    for (i, &(m, n, k)) in SHAPES.iter().enumerate() {
        for dtype in [DType::BF16, DType::F16] {
            let p = problem((m, n, k), dtype, 10 * i as u64);
            let name = format!(
                "dgelu {dtype:?} (m, n, k) = {:?} bias_grad {bias_grad}",
                (m, n, k)
            );
            let Some(out) = dgelu_matmul(&p.dy, &p.w, &p.h, bias_grad)? else {
                assert!(m == 1, "{name}: the epilogue was not taken");
                println!("{name}: declined (no cuBLASLt algorithm): the unfused path runs");
                continue;
            };
            assert_eq!(out.dh.dims(), &[m, n], "{name}");
            assert_eq!(out.dh.dtype(), dtype, "{name}");
            let e = worst(&values(&out.dh), &p.dg, &p.hv, rounding(dtype));
            println!("{name}: dh worst error / bound {e:.3}");
            assert!(
                e <= 1.0,
                "{name}: dh off the f32 reference by {e} x the bound"
            );
            more(&name, &out, &p, dtype);
        }
    }
    Ok(())
}

#[test]
fn dgelu_epilogue_matches_the_f32_reference_and_is_the_tanh_gelu() -> Result<()> {
    each_case(false, &|name, out, p, dtype| {
        assert!(out.db.is_none(), "{name}: a bias gradient nobody asked for");
        if dtype == DType::F16 && p.hv.len() > 8 {
            which_gelu(name, &values(&out.dh), p);
        }
    })
}

#[test]
fn dgelu_bgrad_epilogue_gives_the_bias_gradient() -> Result<()> {
    each_case(true, &|name, out, p, dtype| {
        let Some(db) = &out.db else {
            panic!("{name}: no bias gradient")
        };
        assert_eq!(db.dtype(), dtype, "{name}: db's dtype");
        let (m, n) = (p.dy.dim(0).expect("rows"), p.h.dim(1).expect("width"));
        check_bias_grad(name, &values(db), p, (m, n), dtype);
    })
}

/// `db[j] = Σ_i dh[i, j]` within the rounding of db plus, per summed element, its own bound
/// (the epilogue may sum the rounded or the unrounded dh).
fn check_bias_grad(name: &str, db: &[f64], p: &Problem, (m, n): (usize, usize), dtype: DType) {
    assert_eq!(db.len(), n, "{name}: db's length");
    for (j, got) in db.iter().enumerate() {
        let (mut sum, mut bound) = (0.0, 0.0);
        for i in 0..m {
            let (dg, h) = (p.dg[i * n + j], p.hv[i * n + j]);
            let r = dg * gelu_tanh_grad(h);
            sum += r;
            bound += 2.0 * rounding(dtype) * r.abs() + DERIV * dg.abs();
        }
        let bound = bound + rounding(dtype) * sum.abs() + 1e-30;
        let e = (got - sum).abs();
        assert!(
            e <= bound,
            "{name}: db[{j}] = {got} vs {sum}: error {e} above {bound}"
        );
    }
}

/// Where the tanh and erf forms differ most (|h| in [1.5, 2.5], up to 8.7e-4 |dg| apart), the
/// epilogue's dh is closer to the tanh form's, in RMS relative to |dg| (f16: its rounding,
/// about 2.4e-4 |dh|, is below the gap).
fn which_gelu(name: &str, got: &[f64], p: &Problem) {
    let (mut tanh, mut erf, mut count) = (0.0, 0.0, 0usize);
    for (g, (dg, h)) in got.iter().zip(p.dg.iter().zip(&p.hv)) {
        if !(1.5..=2.5).contains(&h.abs()) || dg.abs() < 1e-3 {
            continue;
        }
        tanh += ((g - dg * gelu_tanh_grad(*h)) / dg).powi(2);
        erf += ((g - dg * gelu_erf_grad(*h)) / dg).powi(2);
        count += 1;
    }
    let (tanh, erf) = ((tanh / count as f64).sqrt(), (erf / count as f64).sqrt());
    println!("{name}: RMS |dh - ref| / |dg| over {count} elements: tanh form {tanh:.2e}, erf form {erf:.2e}");
    assert!(
        count > 0 && tanh < erf,
        "{name}: the epilogue's GELU is closer to the erf form ({erf:e}) than to the tanh form ({tanh:e})"
    );
}

/// act_linear's gradients of `h`, `w` and `b` on the GPU (upstream weights `r`), with the
/// DGELU epilogue switched on or off.
fn act_linear_grads(
    act: Activation,
    args: &[Tensor; 3],
    r: &Tensor,
    epilogue: bool,
) -> Result<[Tensor; 3]> {
    let dev = r.device().clone();
    let perf = PerfSettings {
        gelu_epilogue: epilogue,
        ..PerfSettings::default()
    };
    perf.apply(&dev).expect("perf settings");
    let vars: Vec<Var> = args.iter().map(Var::from_tensor).collect::<Result<_>>()?;
    let y = ops::act_linear(
        vars[0].as_tensor(),
        vars[1].as_tensor(),
        vars[2].as_tensor(),
        act,
    )?;
    let g = (y.to_dtype(DType::F32)? * r)?.sum_all()?.backward()?;
    let grad = |v: &Var| g.get(v.as_tensor()).cloned().expect("a gradient");
    Ok([grad(&vars[0]), grad(&vars[1]), grad(&vars[2])])
}

#[test]
fn act_linear_backward_with_and_without_the_epilogue() -> Result<()> {
    // h (2, 64, 1536) -> 384: the op's dh through the epilogue against the reference and the
    // unfused path; w's and b's gradients do not involve it (bitwise equal either way)
    let (rows, n, k) = (128usize, 1536usize, 384usize);
    let dev = gpu();
    for dtype in [DType::BF16, DType::F16] {
        let (h, hv) = uniform(&[2, rows / 2, n], -3.0, 3.0, 70, dtype, &dev);
        let (w, _) = uniform(&[k, n], -0.05, 0.05, 71, dtype, &dev);
        let (b, _) = uniform(&[k], -0.5, 0.5, 72, DType::F32, &dev);
        let (r, _) = uniform(&[2, rows / 2, k], -1.0, 1.0, 73, DType::F32, &dev);
        let args = [h, w.clone(), b];
        let on = act_linear_grads(Activation::GeluTanh, &args, &r, true)?;
        let off = act_linear_grads(Activation::GeluTanh, &args, &r, false)?;
        // the upstream gradient of y is r rounded to the dtype (y's gradient through the cast)
        let dy = values(&r.to_dtype(dtype)?);
        let dg = matmul(&dy, &values(&w), (rows, n, k));
        let (e_on, e_off) = (
            worst(&values(&on[0]), &dg, &hv, rounding(dtype)),
            worst(&values(&off[0]), &dg, &hv, 2.0 * rounding(dtype)),
        );
        let name = format!("act_linear gelu_tanh {dtype:?}");
        println!("{name}: dh worst error / bound: epilogue {e_on:.3}, unfused {e_off:.3}");
        assert!(e_on <= 1.0 && e_off <= 1.0, "{name}: dh off the reference");
        let differ = values(&on[0]) != values(&off[0]);
        assert!(
            differ,
            "{name}: the switch changed nothing (was the epilogue taken?)"
        );
        for (i, what) in [(1, "w"), (2, "b")] {
            assert_eq!(values(&on[i]), values(&off[i]), "{name}: {what}'s gradient");
        }
        // the exact GELU and ReLU keep their path whatever the switch
        for act in [Activation::GeluErf, Activation::Relu] {
            let on = act_linear_grads(act, &args, &r, true)?;
            let off = act_linear_grads(act, &args, &r, false)?;
            for i in 0..3 {
                assert_eq!(
                    values(&on[i]),
                    values(&off[i]),
                    "{act:?} {dtype:?}: gradient {i}"
                );
            }
        }
    }
    PerfSettings::default().apply(&dev).expect("perf settings");
    Ok(())
}

#[test]
fn dgelu_matmul_declines_what_it_cannot_take() -> Result<()> {
    let dev = gpu();
    let p = problem((16, 64, 32), DType::BF16, 90);
    assert!(dgelu_matmul(&p.dy, &p.w, &p.h, false)?.is_some());
    // N not a multiple of 8 (the aux leading dimension), K not one, f32, the CPU, a dtype mix
    let odd = problem((16, 60, 32), DType::BF16, 91);
    assert!(dgelu_matmul(&odd.dy, &odd.w, &odd.h, false)?.is_none());
    let odd_k = problem((16, 64, 30), DType::BF16, 92);
    assert!(dgelu_matmul(&odd_k.dy, &odd_k.w, &odd_k.h, true)?.is_none());
    let f32s = problem((16, 64, 32), DType::F32, 93);
    assert!(dgelu_matmul(&f32s.dy, &f32s.w, &f32s.h, false)?.is_none());
    let cpu = |t: &Tensor| t.to_device(&Device::Cpu);
    assert!(dgelu_matmul(&cpu(&p.dy)?, &cpu(&p.w)?, &cpu(&p.h)?, false)?.is_none());
    assert!(dgelu_matmul(&p.dy.to_dtype(DType::F16)?, &p.w, &p.h, false)?.is_none());
    // h one element off a 16-byte boundary; shapes that do not match
    let flat = Tensor::cat(
        &[Tensor::zeros(1, DType::BF16, &dev)?, p.h.flatten_all()?],
        0,
    )?;
    let shifted = flat.narrow(0, 1, 16 * 64)?.reshape((16, 64))?;
    assert!(dgelu_matmul(&p.dy, &p.w, &shifted, false)?.is_none());
    assert!(dgelu_matmul(&p.dy, &p.w, &p.h.narrow(0, 0, 8)?, false)?.is_none());
    // w as a transposed view (not contiguous)
    let w_view = p.w.t()?.contiguous()?.t()?;
    assert!(dgelu_matmul(&p.dy, &w_view, &p.h, false)?.is_none());
    Ok(())
}

/// Not a check: times act_linear's forward and backward (candle's backward from a ones
/// gradient) at GPT-2-124M's MLP shapes, 16 x 1024 rows, h (.., 3072) -> 768, bf16, with the
/// epilogue off and on, alternated (`--ignored --nocapture`).
#[test]
#[ignore]
fn time_act_linear_at_gpt2_shapes() -> Result<()> {
    let dev = gpu();
    let (rows, n, k) = (16 * 1024, 3072, 768);
    let (h, _) = uniform(&[rows, n], -3.0, 3.0, 80, DType::BF16, &dev);
    let (w, _) = uniform(&[k, n], -0.02, 0.02, 81, DType::BF16, &dev);
    let (b, _) = uniform(&[k], -0.1, 0.1, 82, DType::F32, &dev);
    let vars: Vec<Var> = [h, w, b]
        .iter()
        .map(Var::from_tensor)
        .collect::<Result<_>>()?;
    let step = || -> Result<()> {
        let y = ops::act_linear(
            vars[0].as_tensor(),
            vars[1].as_tensor(),
            vars[2].as_tensor(),
            Activation::GeluTanh,
        )?;
        y.backward()?;
        Ok(())
    };
    for round in 0..2 {
        for epilogue in [false, true] {
            PerfSettings {
                gelu_epilogue: epilogue,
                ..PerfSettings::default()
            }
            .apply(&dev)
            .expect("perf settings");
            for _ in 0..5 {
                step()?;
            }
            dev.synchronize()?;
            let t = std::time::Instant::now();
            let iters = 50;
            for _ in 0..iters {
                step()?;
            }
            dev.synchronize()?;
            let ms = t.elapsed().as_secs_f64() * 1e3 / iters as f64;
            println!(
                "round {round}: act_linear forward + backward, epilogue {epilogue}: {ms:.3} ms"
            );
        }
    }
    PerfSettings::default().apply(&dev).expect("perf settings");
    Ok(())
}
