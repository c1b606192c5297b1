//! The chunked head + cross-entropy ([`ops::linear_cross_entropy_sum`]) against the composed
//! unfused path `cross_entropy_rows(h.matmul(w.t()), t).sum()` over the trained rows: loss and
//! the gradients of `h` and `w`, chunk sizes 1, a non-divisor of N, N and over N, ignore-index
//! rows in the middle, an upstream gradient other than 1, a tied head (the table used by an
//! embedding too, under candle's backward and the engine's gradient sink), errors, and a
//! memory bound that a full `N x V` logits tensor would break. With `--features cuda` (on a GPU
//! machine) the CUDA path against the CPU reference:
//! `cargo test --release --features cuda --test linear_cross_entropy -- --nocapture`.

mod common;

use candle_core::{DType, Device, Result, Tensor, Var};
use common::tensors::rand_t;
use rand::{Rng, SeedableRng};
use wick::ops::{self, IGNORE_INDEX};

/// `n` targets in `0..v` with [`IGNORE_INDEX`] at `ignored` rows, as i64.
fn targets(n: usize, v: usize, ignored: &[usize], seed: u64) -> Vec<i64> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|r| match ignored.contains(&r) {
            true => IGNORE_INDEX,
            false => rng.random_range(0..v as i64),
        })
        .collect()
}

/// The same targets as u32 (the ignore index as `u32::MAX`).
fn as_u32(t: &[i64]) -> Vec<u32> {
    t.iter()
        .map(|&k| {
            if k == IGNORE_INDEX {
                u32::MAX
            } else {
                k as u32
            }
        })
        .collect()
}

/// Max |a - b| over max |b| (at least `f32::MIN_POSITIVE`), read back as f32 on the CPU.
fn rel(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let f = |t: &Tensor| -> Vec<f32> {
        t.to_device(&Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1())
            .unwrap()
    };
    let (a, b) = (f(a), f(b));
    let d = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(
            0f32,
            |m, x| {
                if x.is_nan() {
                    f32::INFINITY
                } else {
                    m.max(x)
                }
            },
        );
    d / b
        .iter()
        .fold(0f32, |m, x| m.max(x.abs()))
        .max(f32::MIN_POSITIVE)
}

/// Errors as `[1.2e-6, ...]`.
fn fmt(e: &[f32]) -> String {
    let v: Vec<String> = e.iter().map(|x| format!("{x:.2e}")).collect();
    format!("[{}]", v.join(", "))
}

type HeadLoss<'a> = &'a dyn Fn(&Tensor, &Tensor) -> Result<Tensor>;

/// `(loss, dh, dw)` of `f(h, w)` under candle's backward, scaled by `scale` before it.
fn loss_and_grads(
    f: HeadLoss,
    h: &Tensor,
    w: &Tensor,
    scale: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (hv, wv) = (Var::from_tensor(h)?, Var::from_tensor(w)?);
    let loss = f(hv.as_tensor(), wv.as_tensor())?;
    let grads = (&loss * scale)?.backward()?;
    let g = |v: &Var| grads.get(v).expect("a gradient").clone();
    Ok((loss, g(&hv), g(&wv)))
}

/// The composed reference: the trained rows gathered, then candle's matmul and wick's
/// cross-entropy rows, summed (computed in `dtype`).
fn composed(t: &[i64], dtype: DType) -> impl Fn(&Tensor, &Tensor) -> Result<Tensor> + '_ {
    move |h: &Tensor, w: &Tensor| {
        let dev = h.device();
        let keep: Vec<u32> = (0..t.len() as u32)
            .filter(|&r| t[r as usize] != IGNORE_INDEX)
            .collect();
        let tk: Vec<u32> = keep.iter().map(|&r| t[r as usize] as u32).collect();
        let (keep, tk) = (
            Tensor::new(keep.as_slice(), dev)?,
            Tensor::new(tk.as_slice(), dev)?,
        );
        let (h, w) = (h.to_dtype(dtype)?, w.to_dtype(dtype)?);
        let logits = h.index_select(&keep, 0)?.matmul(&w.t()?)?;
        ops::cross_entropy_rows(&logits, &tk)?.sum_all()
    }
}

/// Errors of the chunked op against `reference`: `[loss, dh, dw]`.
fn errors(
    fused: HeadLoss,
    reference: HeadLoss,
    h: &Tensor,
    w: &Tensor,
    ref_dtype: DType,
) -> Result<[f32; 3]> {
    let (l, dh, dw) = loss_and_grads(fused, h, w, 1.0)?;
    let (hr, wr) = (h.to_dtype(ref_dtype)?, w.to_dtype(ref_dtype)?);
    let (lr, dhr, dwr) = loss_and_grads(reference, &hr, &wr, 1.0)?;
    assert_eq!(dh.dtype(), h.dtype());
    assert_eq!(dw.dtype(), w.dtype());
    assert_eq!(l.dims(), &[] as &[usize]);
    Ok([rel(&l, &lr), rel(&dh, &dhr), rel(&dw, &dwr)])
}

const CPU_CHUNKS: [Option<usize>; 5] = [Some(1), Some(5), Some(37), Some(64), None];

#[test]
fn f32_equals_the_composed_path_for_every_chunk_size_and_target_dtype() -> Result<()> {
    let dev = Device::Cpu;
    let (n, c, v) = (37, 24, 50);
    let h = rand_t(&[n, c], -1.0, 1.0, 1, DType::F32, &dev);
    let w = rand_t(&[v, c], -1.0, 1.0, 2, DType::F32, &dev);
    let t = targets(n, v, &[0, 11, 12, 30], 3);
    let reference = composed(&t, DType::F32);
    let ti64 = Tensor::new(t.as_slice(), &dev)?;
    let tu32 = Tensor::new(as_u32(&t).as_slice(), &dev)?;
    for chunk in CPU_CHUNKS {
        for tt in [&ti64, &tu32] {
            let fused = |h: &Tensor, w: &Tensor| ops::linear_cross_entropy_sum(h, w, tt, chunk);
            let e = errors(&fused, &reference, &h, &w, DType::F32)?;
            println!(
                "f32 chunk {chunk:?} {:?}: [loss, dh, dw] {}",
                tt.dtype(),
                fmt(&e)
            );
            assert!(e.iter().all(|e| *e <= 1e-5), "chunk {chunk:?}: {e:?}");
        }
    }
    // u8 targets (no ignore index): every row trained
    let t8: Vec<i64> = targets(n, v, &[], 4);
    let tu8 = Tensor::new(
        t8.iter().map(|&k| k as u8).collect::<Vec<_>>().as_slice(),
        &dev,
    )?;
    let fused = |h: &Tensor, w: &Tensor| ops::linear_cross_entropy_sum(h, w, &tu8, Some(8));
    let e = errors(&fused, &composed(&t8, DType::F32), &h, &w, DType::F32)?;
    assert!(e.iter().all(|e| *e <= 1e-5), "u8: {e:?}");
    // ignored rows get exactly zero gradient
    let (_, dh, _) = loss_and_grads(
        &|h, w| ops::linear_cross_entropy_sum(h, w, &ti64, Some(5)),
        &h,
        &w,
        1.0,
    )?;
    for r in [0, 11, 12, 30] {
        let row: Vec<f32> = dh.get(r)?.to_vec1()?;
        assert!(row.iter().all(|x| *x == 0.0), "row {r}: {row:?}");
    }
    Ok(())
}

#[test]
fn half_dtypes_are_within_their_rounding_of_an_f32_computation() -> Result<()> {
    // The reference is the composed path in f32 on the same (rounded) half values, so only the
    // op's own roundings count: the logits, dlogits and each GEMM output are rounded to the
    // half dtype once (unit roundoff u = 2^-9 for bf16, 2^-12 for f16), dW once per chunk, and
    // a logit error of |logit| u moves the softmax by about that much relatively. With logits
    // up to ~6 here that is a few tens of u: the bounds are 16 u for the loss and 32 u for
    // the gradients, relative to their largest magnitude.
    let dev = Device::Cpu;
    let (n, c, v) = (45, 32, 70);
    let t = targets(n, v, &[3, 4, 40], 5);
    let ti64 = Tensor::new(t.as_slice(), &dev)?;
    let reference = composed(&t, DType::F32);
    for (dtype, u) in [(DType::BF16, 2f32.powi(-9)), (DType::F16, 2f32.powi(-12))] {
        let h = rand_t(&[n, c], -1.0, 1.0, 6, dtype, &dev);
        let w = rand_t(&[v, c], -1.0, 1.0, 7, dtype, &dev);
        for chunk in [Some(1), Some(7), None] {
            let fused = |h: &Tensor, w: &Tensor| ops::linear_cross_entropy_sum(h, w, &ti64, chunk);
            let e = errors(&fused, &reference, &h, &w, DType::F32)?;
            println!(
                "{dtype:?} chunk {chunk:?}: [loss, dh, dw] {} (u = {u:.1e})",
                fmt(&e)
            );
            assert!(e[0] <= 16.0 * u, "{dtype:?} {chunk:?} loss: {e:?}");
            assert!(
                e[1] <= 32.0 * u && e[2] <= 32.0 * u,
                "{dtype:?} {chunk:?}: {e:?}"
            );
        }
    }
    Ok(())
}

#[test]
fn the_sum_over_n_is_the_rows_op_mean() -> Result<()> {
    // what Decoder::loss computes: sum / N, against linear_cross_entropy_rows(..).mean_all()
    let dev = Device::Cpu;
    let (n, c, v) = (33, 16, 40);
    let h = rand_t(&[n, c], -1.0, 1.0, 8, DType::F32, &dev);
    let w = rand_t(&[v, c], -1.0, 1.0, 9, DType::F32, &dev);
    let t = Tensor::new(as_u32(&targets(n, v, &[], 10)).as_slice(), &dev)?;
    let fused =
        |h: &Tensor, w: &Tensor| ops::linear_cross_entropy_sum(h, w, &t, Some(4))? / n as f64;
    let rows = |h: &Tensor, w: &Tensor| ops::linear_cross_entropy_rows(h, w, &t)?.mean_all();
    let (a, b) = (
        loss_and_grads(&fused, &h, &w, 1.0)?,
        loss_and_grads(&rows, &h, &w, 1.0)?,
    );
    let e = [rel(&a.0, &b.0), rel(&a.1, &b.1), rel(&a.2, &b.2)];
    println!("sum / N vs rows mean: {}", fmt(&e));
    assert!(e.iter().all(|e| *e <= 1e-5), "{e:?}");
    Ok(())
}

#[test]
fn an_upstream_gradient_scales_both_gradients() -> Result<()> {
    let dev = Device::Cpu;
    let (n, c, v) = (20, 8, 30);
    let h = rand_t(&[n, c], -1.0, 1.0, 11, DType::F32, &dev);
    let w = rand_t(&[v, c], -1.0, 1.0, 12, DType::F32, &dev);
    let t = Tensor::new(targets(n, v, &[7], 13).as_slice(), &dev)?;
    let f = |h: &Tensor, w: &Tensor| ops::linear_cross_entropy_sum(h, w, &t, Some(6));
    let (l1, dh1, dw1) = loss_and_grads(&f, &h, &w, 1.0)?;
    let (l2, dh2, dw2) = loss_and_grads(&f, &h, &w, 3.5)?;
    assert_eq!(l1.to_scalar::<f32>()?, l2.to_scalar::<f32>()?);
    assert!(rel(&dh2, &(dh1 * 3.5)?) <= 1e-6);
    assert!(rel(&dw2, &(dw1 * 3.5)?) <= 1e-6);
    // the same in bf16: g applied in f32, then one rounding, against a rounding, the product
    // and a second rounding: at most 2 bf16 ulps (2^-6 of the value) apart
    let (hb, wb) = (h.to_dtype(DType::BF16)?, w.to_dtype(DType::BF16)?);
    let (_, dh1, dw1) = loss_and_grads(&f, &hb, &wb, 1.0)?;
    let (_, dh2, dw2) = loss_and_grads(&f, &hb, &wb, 3.5)?;
    let e = [rel(&dh2, &(dh1 * 3.5)?), rel(&dw2, &(dw1 * 3.5)?)];
    println!(
        "bf16, upstream 3.5 vs 3.5 x upstream 1: [dh, dw] {}",
        fmt(&e)
    );
    assert!(e.iter().all(|e| *e <= 2f32.powi(-6)), "{e:?}");
    Ok(())
}

/// A tied head: the table `e` is looked up by an embedding and is the head's weight; its
/// gradient is the sum of both uses. Against the composed path, under candle's backward and
/// under the engine's gradient sink (which takes the head's `dW` directly).
#[test]
fn a_tied_head_gets_the_summed_gradient() -> Result<()> {
    let dev = Device::Cpu;
    let (n, c, v) = (24, 16, 40);
    let e = Var::from_tensor(&rand_t(&[v, c], -1.0, 1.0, 14, DType::F32, &dev))?;
    let ids = Tensor::new(as_u32(&targets(n, v, &[], 15)).as_slice(), &dev)?;
    let t = targets(n, v, &[2, 9], 16);
    let tt = Tensor::new(t.as_slice(), &dev)?;
    let x = rand_t(&[n, c], -0.5, 0.5, 17, DType::F32, &dev);
    let run = |dtype: DType, fused: bool, sink: bool| -> Result<(f32, Tensor)> {
        let forward = || -> Result<Tensor> {
            let h = (ops::embedding(&ids, e.as_tensor())? * 0.5 + &x)?.to_dtype(dtype)?;
            let w = e.as_tensor().to_dtype(dtype)?; // the table's working copy (f32: itself)
            match fused {
                true => ops::linear_cross_entropy_sum(&h, &w, &tt, Some(5)),
                false => composed(&t, DType::F32)(&h, &w),
            }
        };
        let (loss, grads) = match sink {
            true => {
                let loss = wick::grad_sink::forward_for_sink(forward)?;
                let g = wick::grad_sink::backward(&loss)?;
                (loss, g)
            }
            false => {
                let loss = forward()?;
                let g = loss.backward()?;
                (loss, g)
            }
        };
        Ok((loss.to_scalar::<f32>()?, grads.get(&e).expect("dE").clone()))
    };
    let (lr, der) = run(DType::F32, false, false)?;
    for (dtype, sink, bound) in [
        (DType::F32, false, 1e-5),
        (DType::F32, true, 1e-5),
        (DType::BF16, false, 2e-2),
        (DType::BF16, true, 2e-2),
    ] {
        let (l, de) = run(dtype, true, sink)?;
        let (el, ee) = ((l - lr).abs() / lr.abs(), rel(&de, &der));
        println!("tied {dtype:?} sink {sink}: loss {el:.2e} dE {ee:.2e}");
        assert!(
            el <= bound && ee <= bound,
            "{dtype:?} sink {sink}: {el} {ee}"
        );
    }
    Ok(())
}

#[test]
fn untracked_operands_cost_no_gradient_and_a_second_backward_errors() -> Result<()> {
    let dev = Device::Cpu;
    let (n, c, v) = (10, 8, 12);
    let h = rand_t(&[n, c], -1.0, 1.0, 18, DType::F32, &dev);
    let w = rand_t(&[v, c], -1.0, 1.0, 19, DType::F32, &dev);
    let t = Tensor::new(targets(n, v, &[1], 20).as_slice(), &dev)?;
    let full = ops::linear_cross_entropy_sum(&h, &w, &t, Some(3))?; // constants: no node
    let want = composed(&targets(n, v, &[1], 20), DType::F32)(&h, &w)?;
    assert!(rel(&full, &want) <= 1e-6);
    // a frozen head: only dh
    let hv = Var::from_tensor(&h)?;
    let loss = ops::linear_cross_entropy_sum(hv.as_tensor(), &w, &t, Some(3))?;
    let g = loss.backward()?;
    let (_, dh, _) = loss_and_grads(
        &|h, w| ops::linear_cross_entropy_sum(h, w, &t, None),
        &h,
        &w,
        1.0,
    )?;
    assert!(rel(g.get(&hv).unwrap(), &dh) <= 1e-6);
    let again = loss.backward().unwrap_err().to_string();
    assert!(again.contains("already ran"), "{again}");
    // no rows: a zero loss outside the graph; every row ignored: zero loss and gradients
    let none = ops::linear_cross_entropy_sum(&h.narrow(0, 0, 0)?, &w, &t.narrow(0, 0, 0)?, None)?;
    assert_eq!(
        (none.dims(), none.to_scalar::<f32>()?),
        (&[] as &[usize], 0.0)
    );
    let all = Tensor::new(&[IGNORE_INDEX, IGNORE_INDEX], &dev)?;
    let (l, dh, dw) = loss_and_grads(
        &|h, w| ops::linear_cross_entropy_sum(h, w, &all, Some(1)),
        &h.narrow(0, 0, 2)?,
        &w,
        1.0,
    )?;
    assert_eq!(l.to_scalar::<f32>()?, 0.0);
    let zero = |t: &Tensor| t.abs()?.sum_all()?.to_scalar::<f32>();
    assert_eq!((zero(&dh)?, zero(&dw)?), (0.0, 0.0));
    Ok(())
}

#[test]
fn bad_arguments_are_errors() -> Result<()> {
    let dev = Device::Cpu;
    let h = rand_t(&[4, 8], -1.0, 1.0, 21, DType::F32, &dev);
    let w = rand_t(&[5, 8], -1.0, 1.0, 22, DType::F32, &dev);
    let t = Tensor::new(&[0u32, 1, 2, 3], &dev)?;
    let msg = |r: Result<Tensor>| r.unwrap_err().to_string();
    let f = ops::linear_cross_entropy_sum;
    assert!(msg(f(&h, &w, &t, Some(0))).contains("chunk_rows"));
    assert!(msg(f(&h.to_dtype(DType::BF16)?, &w, &t, None)).contains("cast both"));
    assert!(msg(f(&h, &w.t()?, &t, None)).contains("(V, C)"));
    assert!(msg(f(&h.reshape((2, 2, 8))?, &w, &t, None)).contains("(N, C)"));
    assert!(msg(f(&h, &w, &t.narrow(0, 0, 3)?, None)).contains("targets must be (N,)"));
    assert!(msg(f(&h, &w, &t.to_dtype(DType::F32)?, None)).contains("integer"));
    let ints = h.to_dtype(DType::U32)?;
    assert!(msg(f(&ints, &w.to_dtype(DType::U32)?, &t, None)).contains("f32, bf16 or f16"));
    let oob = Tensor::new(&[0u32, 5, 2, 3], &dev)?;
    assert!(msg(f(&h, &w, &oob, None)).contains("target 5 at row 1"));
    let neg = Tensor::new(&[0i64, 1, -3, IGNORE_INDEX], &dev)?;
    assert!(msg(f(&h, &w, &neg, None)).contains("target -3 at row 2"));
    Ok(())
}

/// Peak resident memory of this process so far, bytes (`VmHWM`).
fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// N = 4096 rows, V = 50000 classes, f32: the full logits are 819 MB (the unfused path holds
/// them and their gradient). In chunks of 64 rows the op must stay far below: the process's
/// peak resident memory may grow by at most a quarter of one full logits tensor (205 MB;
/// expected: ~13 MB a chunk for the logits and as much for their gradient, 3.2 MB for each of
/// w, dW and a chunk's dW product).
#[test]
fn memory_does_not_grow_with_rows_times_vocabulary() -> Result<()> {
    let Some(before) = peak_rss() else {
        println!("no /proc/self/status: skipped");
        return Ok(());
    };
    let dev = Device::Cpu;
    let (n, c, v) = (4096, 16, 50_000);
    let full = (n * v * 4) as u64;
    let h = Var::from_tensor(&rand_t(&[n, c], -1.0, 1.0, 23, DType::F32, &dev))?;
    let w = Var::from_tensor(&rand_t(&[v, c], -0.5, 0.5, 24, DType::F32, &dev))?;
    let t = Tensor::new(targets(n, v, &[5, 4000], 25).as_slice(), &dev)?;
    let loss = ops::linear_cross_entropy_sum(h.as_tensor(), w.as_tensor(), &t, Some(64))?;
    let grads = loss.backward()?;
    let l = loss.to_scalar::<f32>()?;
    let dh = grads
        .get(&h)
        .unwrap()
        .sqr()?
        .sum_all()?
        .to_scalar::<f32>()?;
    let after = peak_rss().unwrap();
    let grew = after.saturating_sub(before);
    println!(
        "N {n} V {v} C {c} chunk 64: loss {l:.1}, |dh|^2 {dh:.3e}; peak RSS grew {:.1} MB \
         (full logits {:.0} MB)",
        grew as f64 / 1e6,
        full as f64 / 1e6
    );
    assert!(l.is_finite() && dh.is_finite() && dh > 0.0);
    assert!(
        grew < full / 4,
        "peak RSS grew {grew} bytes; full logits are {full}"
    );
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;

    fn gpu() -> Device {
        Device::new_cuda(0).expect("these tests need a CUDA device (Device::new_cuda(0))")
    }

    /// The CUDA op (i64 and u32 targets with ignored rows, several chunk sizes) against the
    /// composed path on the CPU in f32: f32 within 1e-4 (cuBLAS and the kernels sum in other
    /// orders), bf16 / f16 within 32 unit roundoffs (as the CPU half test).
    #[test]
    fn cuda_matches_the_cpu_reference() -> Result<()> {
        let dev = gpu();
        let (n, c, v) = (300, 64, 1000);
        let t = targets(n, v, &[0, 150, 151, 299], 30);
        let reference = composed(&t, DType::F32);
        let ti64 = Tensor::new(t.as_slice(), &dev)?;
        let tu32 = Tensor::new(as_u32(&t).as_slice(), &dev)?;
        for (dtype, bound) in [
            (DType::F32, 1e-4),
            (DType::BF16, 32.0 * 2f32.powi(-9)),
            (DType::F16, 32.0 * 2f32.powi(-12)),
        ] {
            let h = rand_t(&[n, c], -1.0, 1.0, 31, dtype, &Device::Cpu);
            let w = rand_t(&[v, c], -1.0, 1.0, 32, dtype, &Device::Cpu);
            let (hg, wg) = (h.to_device(&dev)?, w.to_device(&dev)?);
            let (lr, dhr, dwr) = loss_and_grads(
                &reference,
                &h.to_dtype(DType::F32)?,
                &w.to_dtype(DType::F32)?,
                1.0,
            )?;
            for chunk in [Some(1), Some(37), Some(300), None] {
                for tt in [&ti64, &tu32] {
                    let f = |h: &Tensor, w: &Tensor| ops::linear_cross_entropy_sum(h, w, tt, chunk);
                    let (l, dh, dw) = loss_and_grads(&f, &hg, &wg, 1.0)?;
                    assert!(dh.device().is_cuda() && dw.dtype() == dtype);
                    let e = [rel(&l, &lr), rel(&dh, &dhr), rel(&dw, &dwr)];
                    println!(
                        "cuda {dtype:?} chunk {chunk:?} {:?}: {}",
                        tt.dtype(),
                        fmt(&e)
                    );
                    assert!(e.iter().all(|e| *e <= bound), "{dtype:?} {chunk:?}: {e:?}");
                    // ignored rows: exactly zero gradient on the device too
                    let row0: Vec<f32> = dh.get(150)?.to_dtype(DType::F32)?.to_vec1()?;
                    assert!(row0.iter().all(|x| *x == 0.0));
                }
            }
        }
        Ok(())
    }

    /// A tied bf16 head on the GPU under the engine's gradient sink, against the CPU f32
    /// composed path; and the chunked op against `linear_cross_entropy_rows` at a GPT-2 head
    /// shape (8192 rows, C 768, V 50304, bf16), with their times.
    #[test]
    fn cuda_tied_head_and_gpt2_shape() -> Result<()> {
        let dev = gpu();
        let (n, c, v) = (128, 64, 500);
        let e_cpu = rand_t(&[v, c], -1.0, 1.0, 33, DType::F32, &Device::Cpu);
        let ids: Vec<u32> = as_u32(&targets(n, v, &[], 34));
        let t = targets(n, v, &[5, 6], 35);
        let run = |dev: &Device, dtype: DType, fused: bool| -> Result<(f32, Tensor)> {
            let e = Var::from_tensor(&e_cpu.to_device(dev)?)?;
            let (ids, tt) = (
                Tensor::new(ids.as_slice(), dev)?,
                Tensor::new(t.as_slice(), dev)?,
            );
            let forward = || -> Result<Tensor> {
                let h = ops::embedding(&ids, e.as_tensor())?.to_dtype(dtype)?;
                let w = e.as_tensor().to_dtype(dtype)?;
                match fused {
                    true => ops::linear_cross_entropy_sum(&h, &w, &tt, Some(48)),
                    false => composed(&t, DType::F32)(&h, &w),
                }
            };
            let loss = wick::grad_sink::forward_for_sink(forward)?;
            let g = wick::grad_sink::backward(&loss)?;
            Ok((loss.to_scalar::<f32>()?, g.get(&e).expect("dE").clone()))
        };
        let (lr, der) = run(&Device::Cpu, DType::F32, false)?;
        let (l, de) = run(&dev, DType::BF16, true)?;
        let (el, ee) = ((l - lr).abs() / lr.abs(), rel(&de, &der));
        println!("cuda tied bf16 (sink): loss {el:.2e} dE {ee:.2e}");
        assert!(el <= 2e-2 && ee <= 2e-2, "{el} {ee}");

        let (n, c, v) = (8192, 768, 50304);
        let h = rand_t(&[n, c], -1.0, 1.0, 36, DType::BF16, &dev);
        let w = rand_t(&[v, c], -0.05, 0.05, 37, DType::BF16, &dev);
        let tt = Tensor::new(as_u32(&targets(n, v, &[], 38)).as_slice(), &dev)?;
        let rows = |h: &Tensor, w: &Tensor| ops::linear_cross_entropy_rows(h, w, &tt)?.sum_all();
        let time = |f: HeadLoss| -> Result<(f64, (Tensor, Tensor, Tensor))> {
            let r = loss_and_grads(f, &h, &w, 1.0)?; // warm-up
            dev.synchronize()?;
            let t0 = std::time::Instant::now();
            for _ in 0..5 {
                loss_and_grads(f, &h, &w, 1.0)?;
            }
            dev.synchronize()?;
            Ok((t0.elapsed().as_secs_f64() / 5.0 * 1e3, r))
        };
        let (t_rows, a) = time(&rows)?;
        println!("cuda head bf16 ({n}, {c}) x {v}, fwd + bwd: rows op {t_rows:.2} ms");
        for chunk in [Some(256), None, Some(2048)] {
            let sum = |h: &Tensor, w: &Tensor| ops::linear_cross_entropy_sum(h, w, &tt, chunk);
            let (t_sum, b) = time(&sum)?;
            let e = [rel(&b.0, &a.0), rel(&b.1, &a.1), rel(&b.2, &a.2)];
            println!(
                "  chunked {chunk:?} (default {}): {t_sum:.2} ms; vs rows op [loss, dh, dw] {}",
                ops::default_chunk_rows(n, v),
                fmt(&e)
            );
            assert!(e.iter().all(|e| *e <= 32.0 * 2f32.powi(-9)), "{e:?}");
        }
        Ok(())
    }

    #[test]
    fn cuda_devices_must_match() -> Result<()> {
        let dev = gpu();
        let h = rand_t(&[4, 8], -1.0, 1.0, 39, DType::F32, &dev);
        let w = rand_t(&[5, 8], -1.0, 1.0, 40, DType::F32, &dev);
        let t = Tensor::new(&[0u32, 1, 2, 3], &dev)?;
        let f = ops::linear_cross_entropy_sum;
        let e = f(&h, &w.to_device(&Device::Cpu)?, &t, None).unwrap_err();
        assert!(e.to_string().contains("same device"), "{e}");
        let e = f(&h, &w, &t.to_device(&Device::Cpu)?, None).unwrap_err();
        assert!(e.to_string().contains("same device"), "{e}");
        Ok(())
    }
}
