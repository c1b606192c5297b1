//! A GPT-2-style decoder-only transformer (Radford et al. 2019, "Language Models are
//! Unsupervised Multitask Learners"), exactly the model of `scripts/reference/torch_reference.py`
//! so that wick and PyTorch can be compared step for step:
//!
//! ```text
//! ids (B, T) ─ wte ─┐
//!                   + wpe[0..T]                     residual stream x: (B, T, C), f32
//! for each of L blocks (pre-LayerNorm):
//!   x = x + proj(causal_attention(qkv(ln1(x))))     H heads of C / H, softmax math in f32
//!   x = x + fc2(gelu_tanh(fc(ln2(x))))              MLP 4C
//! logits = lnf(x) @ wte^T                           head tied to the token embedding, (B, T, V)
//! ```
//!
//! No dropout. Initialisation as GPT-2 (and the reference): N(0, 0.02) for every linear and
//! embedding weight, zero biases, LayerNorm gain 1 and bias 0 (eps 1e-5).
//!
//! ## Precision (the autocast policy of [`crate::precision`], as `torch.autocast` runs the
//! reference)
//! - matmul-class ops (the four linear layers of a block, attention, the head) run in the compute
//!   dtype, on the parameters' working copies;
//! - LayerNorm statistics and output, the loss: f32; attention ([`crate::ops::causal_attention`]:
//!   flash attention on CUDA, on TF32 tensor cores in f32) takes q, k, v in the compute dtype,
//!   accumulates and takes its softmax in f32; on CUDA it rounds the probabilities to the
//!   compute dtype (TF32 in f32) before `@ v`, as SDPA's flash kernels do (the CPU reference
//!   keeps them in f32);
//! - fused ops (`crate::ops`): LayerNorm (writing the compute dtype for the next linear),
//!   linear (cast + GEMM + bias), attention (head split and merge included), GELU and fc2
//!   together ([`crate::ops::act_linear`], the GELU output recomputed in the backward instead
//!   of kept), the residual add, the position bias, embedding, and the tied head with the
//!   cross-entropy are one graph node each with their own backward: candle's backward costs a
//!   zero-filled buffer and an add for every stored gradient, so fewer nodes is most of the
//!   speed; under the engine's backward all L blocks are one node
//!   ([`crate::ops::pre_norm_stack`]);
//! - the token and position tables are differentiated as fp32 masters (embedding is not on
//!   autocast's cast lists, so PyTorch looks them up in f32); the tied head casts the token table
//!   to the compute dtype, differentiably, as autocast does;
//! - the residual stream stays f32 (in PyTorch a bf16 branch added to the f32 stream promotes
//!   to f32; here [`crate::ops::residual_add`] widens the branch inside the add).
//!
//! ## Parameter names
//! The names of the reference's `state_dict` (`wte.weight`, `blocks.0.qkv.weight`, ...,
//! `lnf.bias`), without the tied `head.weight`: checkpoints of one load into the other by name.
//!
//! ## Parameter count
//! `V*C + T*C + L*(12*C^2 + 13*C) + 2*C` ([`GptConfig::num_params`]): gptmini has 10,844,160,
//! gpt2_124m 124,475,904.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use wick::models::{Gpt, GptConfig};
//! use wick::{ParamStore, Precision};
//! # fn main() -> candle_core::Result<()> {
//! let config = GptConfig { vocab_size: 256, context_len: 16, n_layer: 1, n_head: 2, d_model: 32 };
//! let store = ParamStore::new(Precision::Bf16Mixed, Device::Cpu, 0);
//! let gpt = Gpt::new(&store, config)?;
//! let ids = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &Device::Cpu)?;
//! assert_eq!(gpt.forward(&ids)?.dims(), &[2, 3, 256]);
//! assert_eq!(store.num_elements(), config.num_params());
//! # Ok(()) }
//! ```

use crate::nn::{Embedding, LayerNorm, Linear};
use crate::ops::{Activation, Half};
use crate::params::{ParamStore, Role};
use crate::precision::{to_f32, Autocast, OpClass};
use candle_core::{bail, DType, Device, Module, Result, Tensor};
use candle_nn::Init;
use rand::{rngs::StdRng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Standard deviation of the GPT-2 initialisation of linear and embedding weights.
pub const INIT_STD: f64 = 0.02;

/// LayerNorm epsilon (PyTorch's default).
pub const LN_EPS: f64 = 1e-5;

/// The shape of a [`Gpt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GptConfig {
    /// Vocabulary size `V` (256 for bytes).
    pub vocab_size: usize,
    /// Maximum sequence length `T` (rows of the position table).
    pub context_len: usize,
    /// Number of transformer blocks `L`.
    pub n_layer: usize,
    /// Attention heads per block `H`; must divide `d_model`.
    pub n_head: usize,
    /// Width of the residual stream `C`.
    pub d_model: usize,
}

impl GptConfig {
    /// The reference's "gptmini": byte vocabulary 256, context 256, 6 layers, 6 heads,
    /// d_model 384 (10.8M parameters; trained with batch 64).
    pub fn gptmini() -> Self {
        Self {
            vocab_size: 256,
            context_len: 256,
            n_layer: 6,
            n_head: 6,
            d_model: 384,
        }
    }

    /// The reference's "gpt2_124m": vocabulary 50304 (GPT-2's 50257 padded to a multiple of
    /// 64), context 1024, 12 layers, 12 heads, d_model 768 (124.5M parameters; benchmarked with
    /// batch 16).
    pub fn gpt2_124m() -> Self {
        Self {
            vocab_size: 50304,
            context_len: 1024,
            n_layer: 12,
            n_head: 12,
            d_model: 768,
        }
    }

    /// The batch size the reference uses with this configuration: 64 for gptmini, 16 for
    /// gpt2_124m, and 64 for any other shape.
    pub fn reference_batch_size(&self) -> usize {
        if *self == Self::gpt2_124m() {
            16
        } else {
            64
        }
    }

    /// Number of scalar parameters, in closed form:
    /// `V*C + T*C + L*(12*C^2 + 13*C) + 2*C` (the tied head adds nothing).
    pub fn num_params(&self) -> usize {
        let (v, t, l, c) = (
            self.vocab_size,
            self.context_len,
            self.n_layer,
            self.d_model,
        );
        v * c + t * c + l * (12 * c * c + 13 * c) + 2 * c
    }

    /// Model FLOPs of one training step (forward and backward) on `tokens` tokens, by the
    /// `6 * parameters * tokens` rule (Kaplan et al. 2020), as used for MFU.
    pub fn train_flops(&self, tokens: usize) -> f64 {
        6.0 * self.num_params() as f64 * tokens as f64
    }

    /// Checks the shape: every size >= 1 and `n_head` divides `d_model`.
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("context_len", self.context_len),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("d_model", self.d_model),
        ];
        for (name, v) in sizes {
            if v == 0 {
                bail!("GptConfig: {name} must be >= 1, got 0");
            }
        }
        if self.d_model % self.n_head != 0 {
            bail!(
                "GptConfig: d_model {} is not divisible by n_head {}; pick a head count that divides it",
                self.d_model,
                self.n_head
            );
        }
        if self.vocab_size > u32::MAX as usize {
            bail!(
                "GptConfig: vocab_size {} exceeds the u32 token ids",
                self.vocab_size
            );
        }
        Ok(())
    }
}

impl fmt::Display for GptConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "V={} T={} L={} H={} C={}",
            self.vocab_size, self.context_len, self.n_layer, self.n_head, self.d_model
        )
    }
}

impl FromStr for GptConfig {
    type Err = anyhow::Error;

    /// `"gptmini"` or `"gpt2_124m"` (also `"gpt2-124m"`).
    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
            "gptmini" => Ok(Self::gptmini()),
            "gpt2_124m" => Ok(Self::gpt2_124m()),
            other => {
                anyhow::bail!("unknown GPT model {other:?}: expected \"gptmini\" or \"gpt2_124m\"")
            }
        }
    }
}

/// The reference's optimizer: AdamW, lr 1e-3, betas (0.9, 0.99), eps 1e-8, weight decay 0.1
/// (applied to tensors of rank >= 2 only: [`ParamStore`]'s default groups).
pub fn reference_adamw() -> crate::optim::AdamWConfig {
    crate::optim::AdamWConfig {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

/// The reference's schedule over `total` steps: linear warmup for `warmup` steps from
/// `lr / warmup` to `lr`, then cosine to `min_lr` at `total` (`train-char`'s `lr_at`:
/// `warmup` 100, `lr` 1e-3, `min_lr` 1e-4).
pub fn reference_schedule(
    lr: f64,
    min_lr: f64,
    warmup: u64,
    total: u64,
) -> crate::optim::LrSchedule {
    crate::optim::LrSchedule::WarmupCosine {
        lr,
        min_lr,
        warmup,
        total,
    }
}

/// Creates `{name}.weight` `(out, in)` ~ N(0, 0.02) and `{name}.bias` = 0 before
/// [`Linear::new`] asks for them, so that the layer uses GPT-2's initialisation instead of
/// `nn.Linear`'s uniform default (the store hands an existing parameter back unchanged).
fn gpt2_linear(store: &ParamStore, name: &str, in_dim: usize, out_dim: usize) -> Result<Linear> {
    let normal = Init::Randn {
        mean: 0.0,
        stdev: INIT_STD,
    };
    param(
        store,
        &format!("{name}.weight"),
        (out_dim, in_dim),
        normal,
        Role::Matmul,
    )?;
    param(
        store,
        &format!("{name}.bias"),
        out_dim,
        Init::Const(0.0),
        Role::Matmul,
    )?;
    Linear::new(store, name, in_dim, out_dim, true)
}

/// An embedding table `(rows, dim)` ~ N(0, 0.02), differentiated as its fp32 master (see the
/// module docs on precision).
fn gpt2_embedding(store: &ParamStore, name: &str, rows: usize, dim: usize) -> Result<Embedding> {
    let normal = Init::Randn {
        mean: 0.0,
        stdev: INIT_STD,
    };
    param(
        store,
        &format!("{name}.weight"),
        (rows, dim),
        normal,
        Role::Fp32,
    )?;
    Embedding::new(store, name, rows, dim, INIT_STD)
}

fn param(
    store: &ParamStore,
    name: &str,
    shape: impl Into<candle_core::Shape>,
    init: Init,
    role: Role,
) -> Result<Tensor> {
    store
        .get_or_init(name, shape, init, role)
        .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
}

/// One pre-LayerNorm transformer block.
#[derive(Debug, Clone)]
struct Block {
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc: Linear,
    fc2: Linear,
    n_head: usize,
}

impl Block {
    fn new(store: &ParamStore, name: &str, c: usize, n_head: usize) -> Result<Self> {
        Ok(Self {
            ln1: LayerNorm::new(store, &format!("{name}.ln1"), c, LN_EPS)?,
            ln2: LayerNorm::new(store, &format!("{name}.ln2"), c, LN_EPS)?,
            qkv: gpt2_linear(store, &format!("{name}.qkv"), c, 3 * c)?,
            proj: gpt2_linear(store, &format!("{name}.proj"), c, c)?,
            fc: gpt2_linear(store, &format!("{name}.fc"), c, 4 * c)?,
            fc2: gpt2_linear(store, &format!("{name}.fc2"), 4 * c, c)?,
            n_head,
        })
    }

    /// The block as two halves of a pre-norm stack ([`crate::ops::pre_norm_stack`]), `x:
    /// (B, T, C)` f32 → `(B, T, C)` f32: LayerNorm statistics in f32 with the output rounded
    /// once to the compute dtype, the fused projection, flash attention with merged heads, the
    /// residual add of the bf16 branch into the f32 stream; then fc2(gelu_tanh(fc(..))) with the
    /// GELU output recomputed in the backward.
    fn halves(&self) -> Result<[Half<'_>; 2]> {
        fn bias(l: &Linear) -> Result<&Tensor> {
            match l.bias() {
                Some(b) => Ok(b),
                None => bail!("GPT block: a linear layer has no bias (internal error)"),
            }
        }
        let attention = crate::ops::AttentionParams {
            norm: self.ln1.norm_params(),
            qkv_w: self.qkv.weight(),
            qkv_b: bias(&self.qkv)?,
            proj_w: self.proj.weight(),
            proj_b: bias(&self.proj)?,
            n_head: self.n_head,
            n_kv_head: self.n_head,
        };
        let mlp = crate::ops::MlpParams {
            norm: self.ln2.norm_params(),
            fc_w: self.fc.weight(),
            fc_b: bias(&self.fc)?,
            fc2_w: self.fc2.weight(),
            fc2_b: bias(&self.fc2)?,
            act: Activation::GeluTanh,
        };
        Ok([Half::Attention(attention), Half::Mlp(mlp)])
    }
}

/// The GPT model (see the module docs). Build it on a [`ParamStore`], then train it with
/// [`crate::Engine`] through [`Gpt::loss`].
#[derive(Debug, Clone)]
pub struct Gpt {
    config: GptConfig,
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    lnf: LayerNorm,
    /// The store's device.
    device: Device,
    autocast: Autocast,
}

impl Gpt {
    /// Creates the parameters in `store` (GPT-2 initialisation, drawn from the store's seeded
    /// generator).
    ///
    /// Errors: an invalid `config` ([`GptConfig::validate`]); a parameter of the same name with
    /// another shape already in the store; device allocation failures.
    pub fn new(store: &ParamStore, config: GptConfig) -> Result<Self> {
        config.validate()?;
        let c = config.d_model;
        let wte = gpt2_embedding(store, "wte", config.vocab_size, c)?;
        let wpe = gpt2_embedding(store, "wpe", config.context_len, c)?;
        let blocks = (0..config.n_layer)
            .map(|i| Block::new(store, &format!("blocks.{i}"), c, config.n_head))
            .collect::<Result<Vec<_>>>()?;
        let lnf = LayerNorm::new(store, "lnf", c, LN_EPS)?;
        Ok(Self {
            config,
            wte,
            wpe,
            blocks,
            lnf,
            device: store.device().clone(),
            autocast: store.autocast(),
        })
    }

    /// The shape of the model.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// Logits `(B, T, V)` in the compute dtype for token ids `ids: (B, T)` (u32, or i64/u8),
    /// `1 <= T <= context_len`. Position `t`'s logits depend on `ids[.., ..=t]` only.
    ///
    /// Errors: `ids` not rank 2, not integer, empty, or longer than the context; an id
    /// `>= vocab_size` (an error on the CPU; on CUDA, where checking would need a device read,
    /// that position's embedding row is NaN, and so is the loss).
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let logits = self.logits_rows(ids)?; // validates ids
        let (b, t) = ids.dims2()?;
        logits.reshape((b, t, self.config.vocab_size))
    }

    /// [`Gpt::forward`]'s logits as `(B*T, V)` rows.
    fn logits_rows(&self, ids: &Tensor) -> Result<Tensor> {
        let h = self.hidden_rows(ids)?;
        h.matmul(&self.head_weight()?.t()?)
    }

    /// The tied head's weight: the token table's working copy in the compute dtype, `(V, C)`.
    fn head_weight(&self) -> Result<Tensor> {
        self.autocast.cast(OpClass::Matmul, self.wte.weight())
    }

    /// The final LayerNorm's output as `(B*T, C)` rows in the compute dtype (validates `ids`).
    fn hidden_rows(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = match ids.dims() {
            &[b, t] => (b, t),
            d => bail!("Gpt::forward: ids must be (B, T), found shape {d:?}"),
        };
        if !matches!(ids.dtype(), DType::U32 | DType::I64 | DType::U8) {
            bail!(
                "Gpt::forward: ids must be integer token ids (u32), found {:?}",
                ids.dtype()
            );
        }
        if b == 0 || t == 0 {
            bail!("Gpt::forward: ids has shape ({b}, {t}); B and T must be >= 1");
        }
        if t > self.config.context_len {
            bail!(
                "Gpt::forward: sequence length {t} exceeds the context length {}; crop the input \
                 to its last {} tokens",
                self.config.context_len,
                self.config.context_len
            );
        }
        // token rows plus position rows: the positions are a bias over the flattened (T*C)
        let c = self.config.d_model;
        let pos = to_f32(&self.wpe.weight().narrow(0, 0, t)?)?.flatten_all()?;
        let tok = to_f32(&self.wte.forward(ids)?)?.reshape((b, t * c))?;
        let x = crate::ops::bias_add(&tok, &pos)?.reshape((b, t, c))?;
        // the L blocks: one graph node under the engine's backward (ops::pre_norm_stack)
        let halves = self
            .blocks
            .iter()
            .map(Block::halves)
            .collect::<Result<Vec<_>>>()?
            .concat();
        let compute = self.autocast.dtype(OpClass::Matmul);
        let x = crate::ops::pre_norm_stack(&x, &halves, compute)?;
        self.lnf.forward_to(&x, compute)?.reshape((b * t, c))
    }

    /// Mean next-token cross-entropy (f32 scalar) of `ids: (B, T)` against `targets: (B, T)`,
    /// as the reference computes it: `cross_entropy(logits.float().view(-1, V), y.view(-1))`.
    ///
    /// The head and the loss are one graph node ([`crate::ops::linear_cross_entropy_rows`]),
    /// which frees the logits in the backward: backpropagate through the result once.
    ///
    /// Errors: as [`Gpt::forward`], and `targets` of another shape or a non-integer dtype.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        if targets.dims() != ids.dims() {
            bail!(
                "Gpt::loss: targets have shape {:?} but ids have {:?}; both must be (B, T)",
                targets.dims(),
                ids.dims()
            );
        }
        // head and loss as one node (ops::linear_cross_entropy_rows; the GPT benchmarks were
        // measured with it, the chunked linear_cross_entropy_sum not yet on a GPU): the (B*T, V)
        // logits are never a graph tensor, so their gradient needs no zero-filled buffer and add
        // (4 x 1.6 GB of traffic at gpt2_124m's 16384 x 50304 bf16 logits) and is freed after use
        let h = self.hidden_rows(ids)?;
        let t = targets.flatten_all()?;
        crate::ops::linear_cross_entropy_rows(&h, &self.head_weight()?, &t)?.mean_all()
    }

    /// Generates `max_new_tokens` ids after `prompt`, one at a time (no KV cache: each step
    /// runs the model on the last `context_len` ids). Each id is drawn from
    /// `softmax(logits / temperature)` with a generator seeded by `seed`; `temperature == 0`
    /// picks the most likely id (greedy). Returns the new ids only.
    ///
    /// Errors: an empty prompt, an id `>= vocab_size`, a temperature that is negative or not
    /// finite, non-finite logits, or a forward error.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        temperature: f64,
        seed: u64,
    ) -> Result<Vec<u32>> {
        super::sampling::check_generation("Gpt", prompt, self.config.vocab_size, temperature)?;
        let device = self.device.clone();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut ids = prompt.to_vec();
        let mut out = Vec::with_capacity(max_new_tokens);
        for _ in 0..max_new_tokens {
            let start = ids.len().saturating_sub(self.config.context_len);
            let window = &ids[start..];
            let x = Tensor::from_slice(window, (1, window.len()), &device)?;
            let logits: Vec<f32> = to_f32(
                &self
                    .forward(&x)?
                    .detach()
                    .narrow(1, window.len() - 1, 1)?
                    .flatten_all()?,
            )?
            .to_vec1()?;
            let next = super::sampling::sample(&logits, temperature, 1.0, &mut rng)?;
            ids.push(next);
            out.push(next);
        }
        Ok(out)
    }
}
