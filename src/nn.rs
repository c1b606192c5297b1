//! Layers that follow the autocast policy of [`crate::precision`].
//!
//! | layer | computes | dtype |
//! |---|---|---|
//! | [`Linear`] | `y = x @ w.t() + b`, `x: (.., in)`, `w: (out, in)`, `b: (out,)` | compute dtype |
//! | [`Conv2d`] | 2-D convolution, `x: (N, C_in, H, W)`, `w: (C_out, C_in/groups, k, k)` | compute dtype |
//! | [`Embedding`] | `y = table[ids]`, `ids: (..)` u32, `table: (vocab, dim)` | compute dtype |
//! | [`LayerNorm`] | `y = (x - mean) / sqrt(var + eps) * gamma + beta` over the last dim | f32 |
//!
//! Matmul-class weights are working copies (see [`crate::params`]); LayerNorm's gain and bias
//! are fp32 masters and its statistics run in f32, as in PyTorch's autocast, where `layer_norm`
//! is on the fp32 list. Every layer here is differentiable with respect to every parameter:
//! unlike `candle_nn::LayerNorm` (which uses the forward-only fused kernel on contiguous input
//! in candle-nn 0.11.1), wick's LayerNorm is composed of differentiable ops on the CPU; fused
//! CUDA kernels with their own backward replace it on the GPU.

use crate::params::{ParamStore, Role};
use crate::precision::{to_f32, Autocast, OpClass, Precision};
use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::Init;

fn param(
    store: &ParamStore,
    name: String,
    shape: impl Into<candle_core::Shape>,
    init: Init,
    role: Role,
) -> Result<Tensor> {
    store
        .get_or_init(&name, shape, init, role)
        .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
}

/// Fully connected layer, `y = x @ w.t() + b`, in the compute dtype. Initialised like
/// PyTorch's `nn.Linear`: `w, b ~ U(-1/sqrt(in), 1/sqrt(in))`. Parameter names:
/// `{name}.weight` `(out, in)` and `{name}.bias` `(out,)`.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
    autocast: Autocast,
}

impl Linear {
    /// Creates (or reuses) the parameters `{name}.weight` and, when `bias`, `{name}.bias`.
    pub fn new(
        store: &ParamStore,
        name: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
    ) -> Result<Self> {
        let bound = 1.0 / (in_dim.max(1) as f64).sqrt();
        let init = Init::Uniform {
            lo: -bound,
            up: bound,
        };
        let w = param(
            store,
            format!("{name}.weight"),
            (out_dim, in_dim),
            init,
            Role::Matmul,
        )?;
        let b = if bias {
            Some(param(
                store,
                format!("{name}.bias"),
                out_dim,
                init,
                Role::Matmul,
            )?)
        } else {
            None
        };
        Ok(Self {
            weight: w,
            bias: b,
            autocast: store.autocast(),
        })
    }

    /// The weight tensor that autograd differentiates, `(out, in)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias tensor that autograd differentiates, `(out,)`, if the layer has one.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// A layer over given tensors (e.g. an inference copy of a trained layer's, from
    /// [`crate::serve::copy_params`]): `weight (out, in)` and `bias (out,)`, in the compute
    /// dtype of `precision`, on one device.
    ///
    /// Errors: a weight that is not 2-D, or a bias whose length is not `out`.
    pub fn from_tensors(
        weight: Tensor,
        bias: Option<Tensor>,
        precision: Precision,
    ) -> Result<Self> {
        let (out, _) = weight.dims2()?;
        if let Some(b) = &bias {
            if b.dims() != [out] {
                candle_core::bail!(
                    "Linear::from_tensors: bias {:?} for weight {:?}",
                    b.dims(),
                    weight.dims()
                );
            }
        }
        Ok(Self {
            weight,
            bias,
            autocast: precision.autocast(),
        })
    }
}

impl Module for Linear {
    /// `x: (.., in)` of any float dtype; returns `(.., out)` in the compute dtype. One graph
    /// node, [`crate::ops::linear`]: the cast of x to the compute dtype, the GEMM and the bias
    /// add (and their backward) without the intermediate nodes of the composed ops.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // the op casts f32/bf16/f16 itself; other float dtypes (f64) take a separate cast
        let x = match x.dtype() {
            DType::F32 | DType::BF16 | DType::F16 => x.clone(),
            _ => self.autocast.cast(OpClass::Matmul, x)?,
        };
        crate::ops::linear(&x, &self.weight, self.bias.as_ref())
    }
}

/// 2-D convolution in the compute dtype, initialised like PyTorch's `nn.Conv2d`
/// (`U(-1/sqrt(fan_in), 1/sqrt(fan_in))`). Parameters `{name}.weight`
/// `(c_out, c_in/groups, k, k)` and `{name}.bias` `(c_out,)`.
#[derive(Debug, Clone)]
pub struct Conv2d {
    inner: candle_nn::Conv2d,
    autocast: Autocast,
}

impl Conv2d {
    /// Creates the layer; `cfg` gives padding, stride, dilation and groups.
    pub fn new(
        store: &ParamStore,
        name: &str,
        c_in: usize,
        c_out: usize,
        kernel: usize,
        cfg: candle_nn::Conv2dConfig,
        bias: bool,
    ) -> Result<Self> {
        if cfg.groups == 0 || c_in % cfg.groups != 0 {
            candle_core::bail!(
                "Conv2d {name}: c_in {c_in} is not divisible by groups {}",
                cfg.groups
            );
        }
        let fan_in = (c_in / cfg.groups * kernel * kernel).max(1) as f64;
        let bound = 1.0 / fan_in.sqrt();
        let init = Init::Uniform {
            lo: -bound,
            up: bound,
        };
        let w = param(
            store,
            format!("{name}.weight"),
            (c_out, c_in / cfg.groups, kernel, kernel),
            init,
            Role::Matmul,
        )?;
        let b = if bias {
            Some(param(
                store,
                format!("{name}.bias"),
                c_out,
                init,
                Role::Matmul,
            )?)
        } else {
            None
        };
        Ok(Self {
            inner: candle_nn::Conv2d::new(w, b, cfg),
            autocast: store.autocast(),
        })
    }

    /// A layer over given tensors (e.g. an inference copy of a trained layer's, from
    /// [`crate::serve::copy_params`]): `weight (c_out, c_in/groups, k, k)` and `bias (c_out,)`
    /// in the compute dtype of `precision`.
    ///
    /// Errors: a weight that is not 4-D, or a bias whose length is not `c_out`.
    pub fn from_tensors(
        weight: Tensor,
        bias: Option<Tensor>,
        cfg: candle_nn::Conv2dConfig,
        precision: Precision,
    ) -> Result<Self> {
        let (c_out, _, _, _) = weight.dims4()?;
        if let Some(b) = &bias {
            if b.dims() != [c_out] {
                candle_core::bail!(
                    "Conv2d::from_tensors: bias {:?} for weight {:?}",
                    b.dims(),
                    weight.dims()
                );
            }
        }
        Ok(Self {
            inner: candle_nn::Conv2d::new(weight, bias, cfg),
            autocast: precision.autocast(),
        })
    }
}

impl Module for Conv2d {
    /// `x: (N, C_in, H, W)`; returns `(N, C_out, H', W')` in the compute dtype.
    ///
    /// candle 0.11.1's CPU backend has no bf16 matmul, which its convolution (and the
    /// convolution's backward) is built on. On the CPU in bf16 the layer therefore runs the
    /// convolution in f32 from the bf16 working copies and casts the result back to bf16, as an
    /// autocast would for an op without a kernel in the compute dtype; the gradient flows back
    /// through both casts to the working copies. f16 and f32 (and bf16 on CUDA) run natively.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let compute = self.autocast.dtype(OpClass::Matmul);
        if compute == DType::BF16 && x.device().is_cpu() {
            let f32 = |t: &Tensor| t.to_dtype(DType::F32);
            let conv = candle_nn::Conv2d::new(
                f32(self.inner.weight())?,
                self.inner.bias().map(f32).transpose()?,
                *self.inner.config(),
            );
            return conv.forward(&x.to_dtype(DType::F32)?)?.to_dtype(compute);
        }
        self.inner.forward(&self.autocast.cast(OpClass::Matmul, x)?)
    }
}

/// Token embedding, `y = table[ids]`, table `{name}.weight` `(vocab, dim)` in the compute
/// dtype, initialised `N(0, std)`.
#[derive(Debug, Clone)]
pub struct Embedding {
    inner: candle_nn::Embedding,
}

impl Embedding {
    /// Creates the table, `N(0, std^2)` (GPT-2 uses `std = 0.02`, PyTorch's default is 1).
    pub fn new(store: &ParamStore, name: &str, vocab: usize, dim: usize, std: f64) -> Result<Self> {
        let w = param(
            store,
            format!("{name}.weight"),
            (vocab, dim),
            Init::Randn {
                mean: 0.0,
                stdev: std,
            },
            Role::Matmul,
        )?;
        Ok(Self {
            inner: candle_nn::Embedding::new(w, dim),
        })
    }

    /// The table, `(vocab, dim)` (for weight tying).
    pub fn weight(&self) -> &Tensor {
        self.inner.embeddings()
    }
}

impl Module for Embedding {
    /// `ids`: u32 of any shape `(..)`; returns `(.., dim)`.
    /// `ids` (u32, any shape) → `(ids.dims().., dim)`; the fused [`crate::ops::embedding`]
    /// (scatter-add backward).
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        crate::ops::embedding(ids, self.inner.embeddings())
    }
}

/// Layer normalisation over the last dimension (Ba et al. 2016, "Layer Normalization"),
/// statistics and affine transform in f32 with fp32 master gain `{name}.weight` (ones) and bias
/// `{name}.bias` (zeros), both `(dim,)`. Biased variance, as PyTorch's `nn.LayerNorm`.
/// Differentiable with respect to the input, gain and bias.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    /// Creates the layer; PyTorch's default `eps` is `1e-5`.
    pub fn new(store: &ParamStore, name: &str, dim: usize, eps: f64) -> Result<Self> {
        let weight = param(
            store,
            format!("{name}.weight"),
            dim,
            Init::Const(1.0),
            Role::Fp32,
        )?;
        let bias = param(
            store,
            format!("{name}.bias"),
            dim,
            Init::Const(0.0),
            Role::Fp32,
        )?;
        Ok(Self { weight, bias, eps })
    }

    /// The gain `(dim,)` f32 (an fp32 master), the tensor autograd differentiates.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias `(dim,)` f32 (an fp32 master), the tensor autograd differentiates.
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }

    /// The layer as a block op's norm ([`crate::ops::mlp_block`], [`crate::ops::post_norm_block`],
    /// [`crate::ops::attention_block`]).
    pub fn norm_params(&self) -> crate::ops::NormParams<'_> {
        crate::ops::NormParams {
            w: &self.weight,
            b: Some(&self.bias),
            eps: self.eps,
        }
    }
}

impl LayerNorm {
    /// The normalisation with its output stored in `dtype`: f32 (what [`Module::forward`]
    /// returns, the autocast policy), or the compute dtype when the next op is a matmul that
    /// would cast it anyway (the statistics and the affine map are f32 either way; the output is
    /// rounded once, bit-identical to casting the f32 output, without the f32 tensor and the
    /// cast node). `x: (.., dim)` of any float dtype.
    ///
    /// Errors: a last dimension other than `dim`; a `dtype` other than f32, or x's dtype, or
    /// bf16/f16 for an f32 x.
    pub fn forward_to(&self, x: &Tensor, dtype: candle_core::DType) -> Result<Tensor> {
        let dim = x.dim(D::Minus1)?;
        if dim != self.weight.dim(0)? {
            candle_core::bail!(
                "LayerNorm: input last dimension {dim} != normalized size {}",
                self.weight.dim(0)?
            );
        }
        // The fused kernels take f32/bf16/f16; other float dtypes (f64) are cast to f32 first.
        let x = match x.dtype() {
            DType::F32 | DType::BF16 | DType::F16 => x.clone(),
            _ => to_f32(x)?,
        };
        // One fused, differentiable op (crate::ops): statistics in f32, output rounded once.
        crate::ops::layer_norm_with_dtype(&x, &self.weight, &self.bias, self.eps, dtype)
    }
}

impl Module for LayerNorm {
    /// `x: (.., dim)` of any float dtype; returns `(.., dim)` in f32.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_to(x, candle_core::DType::F32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn layer_norm_matches_closed_form_and_is_differentiable() -> anyhow::Result<()> {
        let store = ParamStore::new(Precision::Bf16Mixed, Device::Cpu, 0);
        let ln = LayerNorm::new(&store, "ln", 4, 1e-5)?;
        let x = Tensor::new(&[[1f32, 2., 3., 4.]], &Device::Cpu)?.to_dtype(DType::BF16)?;
        let y = ln.forward(&x)?;
        assert_eq!(y.dtype(), DType::F32);
        // mean 2.5, biased var 1.25
        let want: Vec<f32> = [1f32, 2., 3., 4.]
            .iter()
            .map(|v| (v - 2.5) / (1.25f32 + 1e-5).sqrt())
            .collect();
        let got: Vec<f32> = y.flatten_all()?.to_vec1()?;
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
        }
        let grads = (y * Tensor::new(&[[1f32, 0., 0., 0.]], &Device::Cpu)?)?
            .sum_all()?
            .backward()?;
        for p in store.params() {
            assert!(
                grads.get(p.differentiated()).is_some(),
                "{} got no gradient",
                p.name
            );
        }
        Ok(())
    }

    #[test]
    fn linear_runs_in_compute_dtype() -> anyhow::Result<()> {
        let store = ParamStore::new(Precision::Bf16Mixed, Device::Cpu, 0);
        let l = Linear::new(&store, "l", 3, 2, true)?;
        let y = l.forward(&Tensor::ones((5, 3), DType::F32, &Device::Cpu)?)?;
        assert_eq!((y.dims(), y.dtype()), (&[5usize, 2][..], DType::BF16));
        Ok(())
    }
}
