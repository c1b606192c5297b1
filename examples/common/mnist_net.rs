//! The MNIST networks of `examples/mnist.rs` and `examples/serve/` (one definition, so a
//! checkpoint of the one loads into the other by parameter name): an MLP `784-H-H-10` and a
//! CNN `conv5x5(32) - pool - conv5x5(64) - pool - linear(1024, 10)`, ReLU.

use candle_core::{Module, Tensor};
use wick::{nn, ParamStore};

/// Pixels per image (28 x 28) and classes.
pub const PIXELS: usize = 784;
pub const CLASSES: usize = 10;

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Arch {
    /// 784-H-H-10, ReLU (H = 1024, or --hidden where the example has it).
    Mlp,
    /// conv5x5(32) - pool - conv5x5(64) - pool - linear(1024, 10).
    Cnn,
}

/// The network's layers (parameters `l1..l3` or `c1, c2, fc`, each `.weight` and `.bias`).
pub enum Net {
    Mlp(nn::Linear, nn::Linear, nn::Linear),
    Cnn(nn::Conv2d, nn::Conv2d, nn::Linear),
}

impl Net {
    /// The layers as parameters of `store` (`hidden`: the MLP's width).
    pub fn new(arch: Arch, hidden: usize, store: &ParamStore) -> anyhow::Result<Self> {
        Ok(match arch {
            Arch::Mlp => Net::Mlp(
                nn::Linear::new(store, "l1", PIXELS, hidden, true)?,
                nn::Linear::new(store, "l2", hidden, hidden, true)?,
                nn::Linear::new(store, "l3", hidden, CLASSES, true)?,
            ),
            Arch::Cnn => {
                let cfg = candle_nn::Conv2dConfig::default();
                Net::Cnn(
                    nn::Conv2d::new(store, "c1", 1, 32, 5, cfg, true)?,
                    nn::Conv2d::new(store, "c2", 32, 64, 5, cfg, true)?,
                    nn::Linear::new(store, "fc", 64 * 4 * 4, CLASSES, true)?,
                )
            }
        })
    }

    /// `x: (B, 784)` f32 → logits `(B, 10)`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Net::Mlp(l1, l2, l3) => l3.forward(&l2.forward(&l1.forward(x)?.relu()?)?.relu()?),
            Net::Cnn(c1, c2, fc) => {
                let b = x.dim(0)?;
                let h = c1
                    .forward(&x.reshape((b, 1, 28, 28))?)?
                    .relu()?
                    .max_pool2d(2)?;
                let h = c2.forward(&h)?.relu()?.max_pool2d(2)?;
                fc.forward(&h.flatten_from(1)?)
            }
        }
    }
}
