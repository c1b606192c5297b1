//! Fixtures shared by the CPU optimizer tests: a parameter list of awkward shapes, seeded
//! random gradients, and comparison helpers.
#![allow(dead_code)]

use candle_core::{Device, Tensor};
use candle_nn::Init;
use rand::Rng;
use wick::params::{Param, ParamStore, Role};
use wick::Precision;

/// An fp32 store with one parameter `p{i}` per shape, initialised `U(-1, 1)` from `seed`.
pub fn store(seed: u64, shapes: &[&[usize]]) -> anyhow::Result<ParamStore> {
    let s = ParamStore::new(Precision::Fp32, Device::Cpu, seed);
    for (i, shape) in shapes.iter().enumerate() {
        s.get_or_init(
            &format!("p{i}"),
            shape.to_vec(),
            Init::Uniform { lo: -1.0, up: 1.0 },
            Role::Matmul,
        )?;
    }
    Ok(s)
}

/// One gradient per parameter, `U(-scale, scale)`.
pub fn random_grads(
    params: &[Param],
    rng: &mut rand::rngs::StdRng,
    scale: f32,
) -> anyhow::Result<Vec<Option<Tensor>>> {
    params
        .iter()
        .map(|p| {
            let v: Vec<f32> = (0..p.elem_count())
                .map(|_| rng.random_range(-1.0f32..1.0) * scale)
                .collect();
            Ok(Some(Tensor::from_vec(v, p.master.shape(), &Device::Cpu)?))
        })
        .collect()
}

/// The values of a tensor (any dtype; step counts are i64), flattened, as f32.
pub fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .unwrap()
        .to_dtype(candle_core::DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Largest `|a - b| / max(|b|, 1e-3)`.
pub fn max_rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y).abs() as f64) / (y.abs() as f64).max(1e-3))
        .fold(0.0, f64::max)
}
