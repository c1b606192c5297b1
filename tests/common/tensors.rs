//! Tensor helpers of the op tests: seeded tensors, the relative error and bits of a result, a
//! value with its gradient, and a check that an op gives the same bits twice.

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::{Rng, SeedableRng};

/// Uniform values in `[lo, hi)` from a seeded generator, as `dtype` on `dev`.
pub fn rand_t(shape: &[usize], lo: f32, hi: f32, seed: u64, dtype: DType, dev: &Device) -> Tensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(lo..hi)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.to_device(dev))
        .unwrap()
}

/// Max |a - b| over max(1, max |b|), both read back as f32 on the CPU.
pub fn err(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let f = |t: &Tensor| {
        t.to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
    };
    let (a, b) = (f(a), f(b));
    let max = |t: Tensor| t.max(0).unwrap().to_scalar::<f32>().unwrap();
    max((&a - &b).unwrap().abs().unwrap()) / max(b.abs().unwrap()).max(1.0)
}

/// Bits of a tensor read back as f32 on the CPU.
pub fn bits(t: &Tensor) -> Vec<u32> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// `(y, dqkv)` of `sum(f(qkv) * r)` (the loss in f32).
pub fn value_and_grad(
    f: &dyn Fn(&Tensor) -> Result<Tensor>,
    qkv: &Tensor,
    r: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let v = Var::from_tensor(qkv)?;
    let y = f(v.as_tensor())?;
    let g = y.to_dtype(DType::F32)?.mul(r)?.sum_all()?.backward()?;
    let dq = g.get(&v).cloned().expect("qkv gets a gradient");
    Ok((y, dq))
}

/// Runs [`value_and_grad`] of `f` twice and asserts the same bits of the value and of the
/// gradient (the kernels are deterministic); `what` names the case.
pub fn assert_deterministic(
    f: &dyn Fn(&Tensor) -> Result<Tensor>,
    qkv: &Tensor,
    r: &Tensor,
    what: &str,
) {
    let (y1, g1) = value_and_grad(f, qkv, r).unwrap();
    let (y2, g2) = value_and_grad(f, qkv, r).unwrap();
    assert_eq!(bits(&y1), bits(&y2), "{what}: forward not deterministic");
    assert_eq!(bits(&g1), bits(&g2), "{what}: backward not deterministic");
}
