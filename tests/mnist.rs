//! Real MNIST (scripts/fetch_mnist.sh fetches it into data/mnist): bf16-mixed and fp32 train
//! the MLP on a fixed slice to final losses within 1%; broken data files are clear errors.

use candle_core::{Device, Module, Tensor};
use std::path::{Path, PathBuf};
use wick::{loss, nn, Engine, EngineConfig, ParamStore, Precision};

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/mnist")
}

struct Mlp(nn::Linear, nn::Linear, nn::Linear);

impl Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.0.forward(x)?.relu()?;
        self.2.forward(&self.1.forward(&h)?.relu()?)
    }
}

/// Trains on the first 2048 training images (16 full-batch-ordered steps of 128, 3 epochs)
/// and returns (first loss, mean loss over the slice after training).
fn train(precision: Precision, x: &Tensor, y: &Tensor) -> anyhow::Result<(f32, f32)> {
    let store = ParamStore::new(precision, Device::Cpu, 42);
    let m = Mlp(
        nn::Linear::new(&store, "l1", 784, 1024, true)?,
        nn::Linear::new(&store, "l2", 1024, 1024, true)?,
        nn::Linear::new(&store, "l3", 1024, 10, true)?,
    );
    let mut engine = Engine::new(store, EngineConfig::adamw(1e-3))?;
    let mut first = None;
    for _epoch in 0..3 {
        for start in (0..2048).step_by(128) {
            let (xb, yb) = (x.narrow(0, start, 128)?, y.narrow(0, start, 128)?);
            let r = engine.step(|_| loss::cross_entropy(&m.forward(&xb)?, &yb))?;
            first.get_or_insert(r.loss()?);
        }
    }
    let final_loss = loss::cross_entropy(&m.forward(x)?, y)?.to_scalar::<f32>()?;
    Ok((first.unwrap(), final_loss))
}

#[test]
fn bf16_mixed_and_fp32_reach_the_same_loss() -> anyhow::Result<()> {
    let data = wick::data::mnist::load_dir(data_dir()).map_err(|e| {
        anyhow::anyhow!("{e:#}\n(this test needs the real data: run scripts/fetch_mnist.sh)")
    })?;
    let x = data.train_images.narrow(0, 0, 2048)?;
    let y = data.train_labels.narrow(0, 0, 2048)?;
    let (first32, final32) = train(Precision::Fp32, &x, &y)?;
    let (first16, final16) = train(Precision::Bf16Mixed, &x, &y)?;
    eprintln!("fp32: {first32} -> {final32}; bf16-mixed: {first16} -> {final16}");
    // both actually learn: ln(10) = 2.30 at the start, far lower at the end
    assert!(first32 > 2.0 && first16 > 2.0);
    assert!(
        final32 < 0.3 && final16 < 0.3,
        "fp32 {final32}, bf16 {final16}"
    );
    let rel = (final16 - final32).abs() / final32;
    assert!(
        rel <= 0.01,
        "final losses differ by {:.2}%: fp32 {final32}, bf16-mixed {final16}",
        100.0 * rel
    );
    Ok(())
}

fn write_idx(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn truncated_and_empty_files_are_clear_errors() {
    let dir = std::env::temp_dir().join(format!("wick-mnist-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let header = |magic: u32, dims: &[u32]| {
        let mut v = magic.to_be_bytes().to_vec();
        for d in dims {
            v.extend(d.to_be_bytes());
        }
        v
    };
    // a train-images file that declares 2 images but holds 1.5
    let mut imgs = header(2051, &[2, 28, 28]);
    imgs.extend(vec![0u8; 784 + 392]);
    write_idx(&dir.join("train-images-idx3-ubyte"), &imgs);
    let mut labels = header(2049, &[2]);
    labels.extend([1u8, 2]);
    write_idx(&dir.join("train-labels-idx1-ubyte"), &labels);
    write_idx(
        &dir.join("t10k-images-idx3-ubyte"),
        &header(2051, &[0, 28, 28]),
    );
    write_idx(&dir.join("t10k-labels-idx1-ubyte"), &header(2049, &[0]));
    let err = format!(
        "{:#}",
        wick::data::mnist::load_dir(&dir).expect_err("truncated file must fail")
    );
    assert!(
        err.contains("train-images-idx3-ubyte") && err.contains("truncated"),
        "{err}"
    );

    // fix the train split: now the empty test split is the error
    let mut imgs = header(2051, &[2, 28, 28]);
    imgs.extend(vec![0u8; 2 * 784]);
    write_idx(&dir.join("train-images-idx3-ubyte"), &imgs);
    let err = format!(
        "{:#}",
        wick::data::mnist::load_dir(&dir).expect_err("empty split must fail")
    );
    assert!(
        err.contains("t10k-images-idx3-ubyte") && err.contains("empty"),
        "{err}"
    );

    let err = format!(
        "{:#}",
        wick::data::mnist::load_dir(dir.join("nope")).err().unwrap()
    );
    assert!(err.contains("scripts/fetch_mnist.sh"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
