//! Fixtures shared by the tests: a parameter list of awkward shapes, seeded random
//! gradients, comparison helpers and the causal mask of the reference compositions.
#![allow(dead_code)]

use candle_core::{Device, Tensor};
use candle_nn::Init;
use rand::Rng;
use std::path::{Path, PathBuf};
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

/// Largest `|a - b|` over all elements, compared in f32 (any float dtypes, same shape).
pub fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    let f = |t: &Tensor| t.to_dtype(candle_core::DType::F32).expect("f32 cast");
    (f(a) - f(b))
        .and_then(|d| d.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
        .expect("max |a - b|")
}

/// The additive causal mask `(t, t)` f32: 0 on and below the diagonal, -inf above.
pub fn causal_mask(t: usize, device: &Device) -> Tensor {
    let mask: Vec<f32> = (0..t * t)
        .map(|k| {
            if k % t > k / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(mask, (t, t), device).expect("mask")
}

/// A fresh, empty folder `wick-test-{name}-{pid}` under the system's temp dir (an older one of
/// the same name is removed first).
pub fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wick-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("creating a temp folder");
    d
}

/// Newest modification time of the files under `dir` (recursively).
pub fn newest(dir: &Path) -> std::time::SystemTime {
    let mut t = std::time::UNIX_EPOCH;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        let m = if p.is_dir() {
            newest(&p)
        } else {
            e.metadata().and_then(|m| m.modified()).unwrap_or(t)
        };
        t = t.max(m);
    }
    t
}

/// The example binary that `cargo test` built beside this test (`cargo test` builds the
/// examples; a targeted `cargo test --test examples_cli` does not, so it checks that the
/// binary is newer than its sources and the library's).
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let bin = profile_dir.join("examples").join(name);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let built = std::fs::metadata(&bin).and_then(|m| m.modified());
    // an example is examples/NAME.rs or a folder examples/NAME/ (main.rs and its modules)
    let sources = newest(&root.join("src"))
        .max(
            std::fs::metadata(root.join("examples").join(format!("{name}.rs")))
                .and_then(|m| m.modified())
                .unwrap_or(std::time::UNIX_EPOCH),
        )
        .max(newest(&root.join("examples").join(name)));
    assert!(
        built.as_ref().is_ok_and(|b| *b >= sources),
        "{} is missing or older than its sources: run `cargo build --release --examples` \
         (or the whole `cargo test --release`, which builds them) first",
        bin.display()
    );
    bin
}

/// The engine's path (`loss` built under `wick::grad_sink::forward_for_sink` and differentiated
/// with `wick::grad_sink::backward`, where wick's block ops are one graph node each) against the
/// per-op graph under candle's own backward. The same kernels run in the same order, so the
/// loss and every gradient of `store`'s parameters must be equal exactly, and the one-node form
/// must have been built (candle's backward cannot carry its parameters). `what` names the case
/// in failures. Returns the engine path's gradients by parameter name, in store order.
pub fn assert_sink_matches_per_op(
    store: &ParamStore,
    what: &str,
    loss: impl Fn() -> anyhow::Result<Tensor>,
) -> anyhow::Result<Vec<(String, Tensor)>> {
    let one = wick::grad_sink::forward_for_sink(&loss)?;
    let g1 = wick::grad_sink::backward(&one)?;
    let per_op = loss()?;
    let g2 = per_op.backward()?;
    assert_eq!(
        one.to_scalar::<f32>()?,
        per_op.to_scalar::<f32>()?,
        "{what}: loss"
    );
    let again = wick::grad_sink::forward_for_sink(&loss)?;
    assert!(again.backward().is_err(), "{what}: no block node was built");
    let mut out = Vec::new();
    for p in store.params() {
        let t = p.differentiated();
        let (Some(a), Some(b)) = (g1.get(t), g2.get(t)) else {
            panic!("{what}: no gradient for {}", p.name)
        };
        assert_eq!(max_abs(a, b), 0.0, "{what}: gradient of {}", p.name);
        out.push((p.name.clone(), a.clone()));
    }
    Ok(out)
}
