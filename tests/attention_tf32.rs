//! f32 flash attention on CUDA in its two modes, against the f32 CPU reference: 3xTF32 (the
//! default) at f32's accuracy, and plain TF32 where candle's f32 GEMMs are allowed TF32. Its
//! own test binary because the TF32 switch is process-wide (run on a GPU machine:
//! `cargo test --release --features cuda --test attention_tf32`).
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::{Rng, SeedableRng};
use wick::ops;

/// `(y, dqkv)` of `sum(grouped_causal_attention(qkv) * r)` on qkv's device.
fn value_and_grad(qkv: &Tensor, r: &Tensor, h: usize, hkv: usize) -> Result<(Tensor, Tensor)> {
    let v = Var::from_tensor(qkv)?;
    let y = ops::grouped_causal_attention(v.as_tensor(), h, hkv)?;
    let g = y.mul(r)?.sum_all()?.backward()?;
    let dq = g.get(&v).cloned().expect("qkv gets a gradient");
    Ok((y, dq))
}

/// max |a - b| / max |b|, on the CPU.
fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_device(&Device::Cpu).unwrap();
    let diff = (&a - b).unwrap().abs().unwrap().flatten_all().unwrap();
    let scale = b.abs().unwrap().flatten_all().unwrap();
    let max = |t: Tensor| t.max(0).unwrap().to_scalar::<f32>().unwrap();
    max(diff) / max(scale)
}

fn uniform(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

#[test]
fn f32_attention_is_3xtf32_by_default_and_tf32_where_allowed() -> Result<()> {
    let dev = wick::cuda::new_device(0).expect("this test needs a CUDA device");
    // 6 query heads sharing 2 key/value heads; T = 300 ends in a partial tile
    let (b, t, h, hkv) = (2, 300, 6, 2);
    let qkv = uniform(&[b, t, (h + 2 * hkv) * 64], 11);
    let r = uniform(&[b, t, h * 64], 12);
    let (y_ref, g_ref) = value_and_grad(&qkv, &r, h, hkv)?;
    let on_gpu = || value_and_grad(&qkv.to_device(&dev)?, &r.to_device(&dev)?, h, hkv);

    candle_core::cuda::set_gemm_reduced_precision_f32(false);
    let (y3, g3) = on_gpu()?;
    candle_core::cuda::set_gemm_reduced_precision_f32(true);
    let tf32 = on_gpu();
    candle_core::cuda::set_gemm_reduced_precision_f32(false);
    let (y1, g1) = tf32?;
    assert_eq!((y3.dtype(), g3.dtype()), (DType::F32, DType::F32));

    let e3 = [rel_err(&y3, &y_ref), rel_err(&g3, &g_ref)];
    let e1 = [rel_err(&y1, &y_ref), rel_err(&g1, &g_ref)];
    println!("3xTF32 vs CPU f32: y {:.2e} dqkv {:.2e}", e3[0], e3[1]);
    println!("TF32 vs CPU f32:   y {:.2e} dqkv {:.2e}", e1[0], e1[1]);
    // 3xTF32 at f32's accuracy (the bound of the f32 op tests)
    assert!(e3.iter().all(|e| *e <= 2e-5), "3xTF32 errors {e3:?}");
    // TF32 operands (10 mantissa bits, 2^-11 relative rounding): errors of that order, and
    // visibly coarser than 3xTF32's, so the switch took effect
    assert!(e1.iter().all(|e| *e <= 5e-3), "TF32 errors {e1:?}");
    assert!(
        e1[0] > 4.0 * e3[0],
        "TF32 {e1:?} not coarser than 3xTF32 {e3:?}"
    );
    Ok(())
}
