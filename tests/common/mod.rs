//! Fixtures shared by the tests: a parameter list of awkward shapes, seeded random
//! gradients, comparison helpers and the causal mask of the reference compositions.
#![allow(dead_code)]

pub mod decoder_reference;
pub mod tensors;

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

/// `data/<rel>` of this checkout, which `script` fetches; a missing file fails the test,
/// naming the script (CI fetches every data set first).
pub fn data_file(rel: &str, script: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("data").join(rel);
    assert!(p.exists(), "{} is missing: run {script} first", p.display());
    p
}

/// Runs `cmd` with its stdout piped, reads its lines until one starts with `after`, sends it
/// SIGINT (Ctrl-C) and reads the rest: (lines up to and with `after`, lines after it, exit
/// code).
#[cfg(unix)]
pub fn interrupt_after(
    mut cmd: std::process::Command,
    after: &str,
) -> (Vec<String>, Vec<String>, Option<i32>) {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let go = line.starts_with(after);
        seen.push(line);
        if go {
            break;
        }
    }
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) },
        0
    );
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    (seen, rest, child.wait().unwrap().code())
}

/// candle-transformers' Llama (the reference implementation) loaded from an HF folder
/// (`config.json`, `model.safetensors`) in f32 on the CPU: the logits of `ids` `(1, T)` at the
/// last position, `(1, V)`.
pub fn candle_transformers_llama_last_logits(dir: &Path, ids: &Tensor) -> anyhow::Result<Tensor> {
    use candle_transformers::models::llama;
    let cfg: llama::LlamaConfig =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let cfg = cfg.into_config(false);
    // SAFETY: the file is not modified while mapped (a test's own folder).
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(
            &[dir.join("model.safetensors")],
            candle_core::DType::F32,
            &Device::Cpu,
        )?
    };
    let model = llama::Llama::load(vb, &cfg)?;
    let mut cache = llama::Cache::new(false, candle_core::DType::F32, &cfg, &Device::Cpu)?;
    Ok(model.forward(ids, 0, &mut cache)?)
}

/// A committed fixture, `tests/fixtures/{name}`, as JSON.
pub fn fixture(name: &str) -> serde_json::Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// A fixture's JSON list of token ids.
pub fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("a list of ids")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

/// A finished process's stdout and stderr as text.
pub fn text(o: &std::process::Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The `RESULT {json}` line of a run that succeeded (panics, with its output, otherwise).
pub fn result(o: &std::process::Output) -> serde_json::Value {
    let (out, err) = text(o);
    assert!(o.status.success(), "{out}\n{err}");
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .unwrap_or_else(|| panic!("no RESULT line in\n{out}"));
    serde_json::from_str(line).unwrap()
}
