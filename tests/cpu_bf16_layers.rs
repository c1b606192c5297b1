//! bf16-mixed (the default precision) trains every layer wick ships on the CPU, where candle
//! 0.11.1 has no bf16 matmul: forward values near the fp32 run, and a gradient for every
//! parameter through an optimizer step.

use candle_core::{DType, Device, Module, Tensor};
use wick::{loss, nn, Engine, EngineConfig, ParamStore, Precision};

/// The MNIST example's CNN plus an embedding and a LayerNorm: every layer of `wick::nn`.
struct Net {
    emb: nn::Embedding,
    c1: nn::Conv2d,
    c2: nn::Conv2d,
    norm: nn::LayerNorm,
    fc: nn::Linear,
}

impl Net {
    fn new(store: &ParamStore) -> anyhow::Result<Self> {
        let cfg = candle_nn::Conv2dConfig::default();
        Ok(Self {
            emb: nn::Embedding::new(store, "emb", 4, 28 * 28, 0.1)?,
            c1: nn::Conv2d::new(store, "c1", 1, 4, 5, cfg, true)?,
            c2: nn::Conv2d::new(store, "c2", 4, 8, 5, cfg, true)?,
            norm: nn::LayerNorm::new(store, "norm", 8 * 4 * 4, 1e-5)?,
            fc: nn::Linear::new(store, "fc", 8 * 4 * 4, 3, true)?,
        })
    }

    fn forward(&self, x: &Tensor, ids: &Tensor) -> candle_core::Result<Tensor> {
        let b = x.dim(0)?;
        let e = self.emb.forward(ids)?.to_dtype(DType::F32)?;
        let x = (x + e)?.reshape((b, 1, 28, 28))?;
        let h = self.c1.forward(&x)?.relu()?.max_pool2d(2)?;
        let h = self.c2.forward(&h)?.relu()?.max_pool2d(2)?;
        self.fc.forward(&self.norm.forward(&h.flatten_from(1)?)?)
    }
}

fn inputs() -> anyhow::Result<(Tensor, Tensor, Tensor)> {
    let x = Tensor::arange(0u32, 2 * 784, &Device::Cpu)?
        .to_dtype(DType::F32)?
        .reshape((2, 784))?
        .affine(0.01, 0.0)?
        .sin()?;
    let ids = Tensor::new(&[1u32, 3], &Device::Cpu)?;
    let y = Tensor::new(&[0u32, 2], &Device::Cpu)?;
    Ok((x, ids, y))
}

#[test]
fn bf16_mixed_runs_every_layer_on_the_cpu() -> anyhow::Result<()> {
    let (x, ids, y) = inputs()?;
    let mut logits = Vec::new();
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        let store = ParamStore::new(precision, Device::Cpu, 5);
        let net = Net::new(&store)?;
        let out = net.forward(&x, &ids)?;
        assert_eq!(out.dtype(), precision.compute_dtype(), "{precision}");
        logits.push(out.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);

        let before = store
            .masters()
            .into_iter()
            .map(|(n, t)| Ok((n, t.copy()?)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut engine = Engine::new(store.clone(), EngineConfig::sgd(0.1, 0.0))?;
        let report = engine.step(|_| loss::cross_entropy(&net.forward(&x, &ids)?, &y))?;
        assert!(report.boundary && !report.skipped()?, "{precision}");
        // the coverage check ran on this first step: every parameter got a gradient; and
        // every parameter moved
        for ((name, old), (_, new)) in before.iter().zip(store.masters()) {
            let moved = (old - &new)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(moved > 0.0, "{precision}: {name} did not change");
        }
    }
    for (a, b) in logits[0].iter().zip(&logits[1]) {
        assert!(
            (a - b).abs() <= 0.05 * a.abs().max(1.0),
            "fp32 {a} vs bf16-mixed {b}: {:?} vs {:?}",
            logits[0],
            logits[1]
        );
    }
    Ok(())
}
