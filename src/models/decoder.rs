//! A Llama-family decoder (Touvron et al. 2023, "LLaMA"; transformers' `LlamaForCausalLM`)
//! built from wick's fused, differentiable ops, with transformers' tensor names
//! (`model.layers.{i}.self_attn.q_proj.weight`, ...), full fine-tuning or LoRA
//! ([`crate::lora`]).
//!
//! Per block (pre-RMSNorm):
//! ```text
//! qkv = rotary([Wq; Wk; Wv] · rms_norm(x))                 one GEMM, RoPE on q and k
//! x   = x + Wo · grouped_causal_attention(qkv)              H query heads share Hkv KV heads
//! x   = x + Wdown · swiglu([Wgate; Wup] · rms_norm(x))      one GEMM for gate and up
//! ```
//! then the final RMSNorm and the head (tied to the token table when the config says so),
//! with the head and the cross-entropy as one node ([`ops::linear_cross_entropy_rows`]). The
//! residual stream is f32; the GEMMs run in the compute dtype; the norms, RoPE, softmax and
//! SwiGLU compute in f32 ([`crate::precision`]). RoPE is transformers' `rotate_half` form
//! (pairs `(i, i + D/2)`); GGUF files store q/k rows permuted for llama.cpp's interleaved form,
//! which [`super::files`] undoes on load.
//!
//! Inference ([`Decoder::forward_cached`], [`Decoder::generate`]) keeps a KV cache per block.

use super::config::{DecoderConfig, EMBED, FINAL_NORM, HEAD};
use crate::lora::{LoraAdapter, LoraConfig};
use crate::ops::{self, Half, Layer, NormParams};
use crate::params::{ParamStore, Role};
use crate::precision::{to_f32, Precision};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

/// A decoder's configuration and tensors by HF name (f32 or any float dtype, on any device),
/// as read from a GGUF or safetensors file ([`super::files`]) or drawn at random.
#[derive(Debug, Clone)]
pub struct DecoderWeights {
    /// The model's sizes.
    pub config: DecoderConfig,
    /// Tensors by HF name: exactly those of [`DecoderConfig::tensor_shapes`].
    pub tensors: HashMap<String, Tensor>,
}

impl DecoderWeights {
    /// Random weights as transformers initialises a fresh `LlamaForCausalLM`: linears and the
    /// token table `N(0, 0.02)`, norm gains 1. f32 on the CPU; `seed` fixes them.
    ///
    /// Errors: an invalid config.
    pub fn random(config: DecoderConfig, seed: u64) -> Result<Self> {
        config.validate()?;
        use rand_distr::{Distribution, Normal};
        let mut rng = StdRng::seed_from_u64(seed);
        let normal = Normal::new(0.0f32, 0.02).context("N(0, 0.02)")?;
        let mut tensors = HashMap::new();
        for (name, shape) in config.tensor_shapes() {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = if shape.len() == 1 {
                vec![1.0; n]
            } else {
                (0..n).map(|_| normal.sample(&mut rng)).collect()
            };
            tensors.insert(name, Tensor::from_vec(values, shape, &Device::Cpu)?);
        }
        Ok(Self { config, tensors })
    }

    /// Checks that the tensors are exactly the model's, with the model's shapes.
    ///
    /// Errors: every missing, unexpected and mis-shaped tensor named (with both shapes) in one
    /// message.
    pub fn check(&self) -> Result<()> {
        self.config.validate()?;
        let expected = self.config.tensor_shapes();
        let mut problems = Vec::new();
        for (name, shape) in &expected {
            match self.tensors.get(name) {
                None => problems.push(format!("missing {name} (the model expects {shape:?})")),
                Some(t) if t.dims() != shape.as_slice() => problems.push(format!(
                    "{name}: the file has {:?}, the model expects {shape:?}",
                    t.dims()
                )),
                Some(_) => {}
            }
        }
        let known: std::collections::HashSet<&str> =
            expected.iter().map(|(n, _)| n.as_str()).collect();
        let mut unexpected: Vec<&String> = self
            .tensors
            .keys()
            .filter(|k| !known.contains(k.as_str()))
            .collect();
        unexpected.sort();
        for name in unexpected {
            problems.push(format!(
                "unexpected {name} {:?} (not a tensor of this config{})",
                self.tensors[name].dims(),
                if name == HEAD {
                    "; tie_word_embeddings is true"
                } else {
                    ""
                }
            ));
        }
        if !problems.is_empty() {
            bail!(
                "the weights do not fit the Llama config ({} problem(s)): {}",
                problems.len(),
                problems.join("; ")
            );
        }
        Ok(())
    }
}

/// How [`Decoder::new`] makes the model trainable.
#[derive(Debug, Clone, PartialEq)]
pub enum FineTune {
    /// Every tensor is a store parameter: an fp32 master (and a compute-dtype working copy for
    /// the linears), AdamW moments, a gradient.
    Full,
    /// The base tensors are frozen constants in the compute dtype (no master, no moments, no
    /// gradient); the adapters of the config are the only store parameters.
    Lora(LoraConfig),
}

/// A linear layer of one or more HF modules stacked along the output (`[Wq; Wk; Wv]`,
/// `[Wgate; Wup]`): one GEMM for all of them, plus the LoRA updates of the adapted parts.
struct Proj {
    /// The parts' base weights `(out_i, in)`, trainable or frozen.
    parts: Vec<Tensor>,
    /// The stacked weight, made once when the parts are frozen constants.
    stacked: Option<Tensor>,
    /// Per part, its adapter (LoRA mode, targeted modules): views of `lora`'s stacks.
    adapters: Vec<Option<LoraAdapter>>,
    /// The adapted parts' adapters stacked (`A (P r, in)`, `B (sum out_i, r)`) under their
    /// brace-list name: one store parameter each, read by the forward as they are.
    lora: Option<(String, LoraAdapter)>,
    scaling: f64,
    dropout: f64,
    /// `(out_i, r_i)` per part (rank 0 without an adapter), as `ops::lora_linear_grouped` takes.
    ranks: Vec<(usize, usize)>,
}

impl Proj {
    /// `adapted[i]`: whether part i has an adapter in `lora`'s stacks (in order).
    fn new(
        parts: Vec<Tensor>,
        frozen: bool,
        lora: Option<(String, LoraAdapter)>,
        adapted: &[bool],
    ) -> Result<Self> {
        let stacked = if frozen && parts.len() > 1 {
            Some(Tensor::cat(&parts, 0)?)
        } else {
            None
        };
        let outs = adapted_outs(&parts, adapted.iter().copied());
        let mut adapters = Vec::with_capacity(parts.len());
        let mut j = 0;
        for &on in adapted {
            adapters.push(match (&lora, on) {
                (Some((_, stack)), true) => {
                    j += 1;
                    Some(stack.part(&outs, j - 1)?)
                }
                _ => None,
            });
        }
        let ranks = parts
            .iter()
            .zip(&adapters)
            .map(|(w, ad)| (w.dims()[0], ad.as_ref().map_or(0, |ad| ad.a.dims()[0])))
            .collect();
        Ok(Self {
            parts,
            stacked,
            adapters,
            lora,
            scaling: 1.0,
            dropout: 0.0,
            ranks,
        })
    }

    /// The projection as one layer of a block op, or `None` where its forward is more than one
    /// op (LoRA dropout in training).
    fn layer(&self, train: bool) -> Option<Layer<'_>> {
        let parts = match &self.stacked {
            Some(w) => std::slice::from_ref(w),
            None => self.parts.as_slice(),
        };
        match (&self.lora, parts) {
            (None, parts) => Some(Layer::Linear { parts, b: &[] }),
            (Some(_), _) if train && self.dropout > 0.0 => None,
            (Some((_, LoraAdapter { a, b })), [w]) => Some(Layer::LoraLinear {
                w,
                a,
                b,
                parts: &self.ranks,
                scale: self.scaling,
            }),
            // adapted parts are frozen, so stacked once: not reached
            (Some(_), _) => None,
        }
    }

    /// `x: (.., in)` in the compute dtype → `(.., sum out_i)`.
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let w = match (&self.stacked, self.parts.as_slice()) {
            (Some(w), _) => w.clone(),
            (None, [w]) => w.clone(),
            (None, parts) => Tensor::cat(parts, 0)?,
        };
        let Some((_, LoraAdapter { a, b })) = &self.lora else {
            return Ok(ops::linear(x, &w, None)?);
        };
        let parts = &self.ranks;
        if train && self.dropout > 0.0 {
            // PEFT's order: dropout on the adapters' input only, so the updates are separate
            // nodes: u = dropout(x) [A_1; ..]^T, then u times the block-diagonal [B_1 0; 0 B_2]
            let b_bd = ops::lora_block_diagonal(b, parts)?.affine(self.scaling, 0.0)?;
            let xd = candle_nn::ops::dropout(x, self.dropout as f32)?;
            let y = ops::linear(x, &w, None)?;
            return Ok((y + ops::linear(&ops::linear(&xd, a, None)?, &b_bd, None)?)?);
        }
        // base GEMM and every part's update in one node: no (.., out) update tensor kept, and
        // the adapters' tensors enter as the two stacks they are stored as
        Ok(ops::lora_linear_grouped(x, &w, a, b, parts, self.scaling)?)
    }
}

/// The output rows of the adapted parts, in order: the `outs` of their adapter stack.
fn adapted_outs(parts: &[Tensor], adapted: impl Iterator<Item = bool>) -> Vec<usize> {
    parts
        .iter()
        .zip(adapted)
        .filter(|(_, on)| *on)
        .map(|(w, _)| w.dims()[0])
        .collect()
}

struct Block {
    attn_norm: Tensor,
    qkv: Proj,
    o: Proj,
    mlp_norm: Tensor,
    gate_up: Proj,
    down: Proj,
    dims: Dims,
}

/// What a block's forward needs of the config.
#[derive(Debug, Clone, Copy)]
struct Dims {
    heads: usize,
    kv_heads: usize,
    eps: f64,
    compute: DType,
}

impl Block {
    /// The training forward, `x: (B, T, C)` f32 → f32; `cos`/`sin` the RoPE tables of 0..T.
    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, train: bool) -> Result<Tensor> {
        let Dims {
            heads,
            kv_heads,
            eps,
            compute,
        } = self.dims;
        let n = ops::rms_norm_with_dtype(x, &self.attn_norm, eps, compute)?;
        let qkv = ops::rotary_qkv(&self.qkv.forward(&n, train)?, cos, sin, heads, kv_heads)?;
        let a = ops::grouped_causal_attention(&qkv, heads, kv_heads)?;
        let x = ops::residual_add(x, &self.o.forward(&a, train)?)?;
        let n = ops::rms_norm_with_dtype(&x, &self.mlp_norm, eps, compute)?;
        let m = ops::swiglu(&self.gate_up.forward(&n, train)?)?;
        Ok(ops::residual_add(&x, &self.down.forward(&m, train)?)?)
    }

    /// The block's two halves as block-op layers (`[qkv, rotary, attention, o]`, `[gate_up,
    /// swiglu, down]`; [`ops::pre_norm_stack`] runs them as [`Block::forward`] does), or `None`
    /// where a projection is more than one op (LoRA dropout in training).
    fn layers<'a>(
        &'a self,
        cos: &'a Tensor,
        sin: &'a Tensor,
        train: bool,
    ) -> Option<[Vec<Layer<'a>>; 2]> {
        let (n_head, n_kv_head) = (self.dims.heads, self.dims.kv_heads);
        let attention = vec![
            self.qkv.layer(train)?,
            Layer::Rotary {
                cos,
                sin,
                n_head,
                n_kv_head,
            },
            Layer::Attention { n_head, n_kv_head },
            self.o.layer(train)?,
        ];
        let mlp = vec![
            self.gate_up.layer(train)?,
            Layer::SwiGlu,
            self.down.layer(train)?,
        ];
        Some([attention, mlp])
    }

    /// The halves of [`Block::layers`] with their RMSNorms.
    fn halves<'a>(&'a self, layers: &'a [Vec<Layer<'a>>; 2]) -> [Half<'a>; 2] {
        let norm = |w| NormParams {
            w,
            b: None,
            eps: self.dims.eps,
        };
        [
            Half::Branch(norm(&self.attn_norm), &layers[0]),
            Half::Branch(norm(&self.mlp_norm), &layers[1]),
        ]
    }

    /// Every tensor the block's forward reads (for [`crate::recompute::checkpoint`]).
    fn tensors(&self) -> Vec<Tensor> {
        let mut out = vec![self.attn_norm.clone(), self.mlp_norm.clone()];
        for p in [&self.qkv, &self.o, &self.gate_up, &self.down] {
            out.extend(p.parts.iter().cloned());
            if let Some((_, stack)) = &p.lora {
                out.extend([stack.a.clone(), stack.b.clone()]);
            }
        }
        out
    }
}

/// The decoder. Build it with [`Decoder::new`] from [`DecoderWeights`].
pub struct Decoder {
    config: DecoderConfig,
    precision: Precision,
    device: Device,
    /// The token table `(V, C)`: an fp32 master (full) or a compute-dtype constant (LoRA).
    embed: Tensor,
    /// An untied head `(V, C)`.
    head: Option<Tensor>,
    blocks: Vec<Arc<Block>>,
    norm: Tensor,
    /// LoRA mode: the frozen base tensors by HF name, and the adapters by module name.
    frozen: HashMap<String, Tensor>,
    adapters: Vec<(String, LoraAdapter)>,
    lora: Option<LoraConfig>,
    checkpointing: bool,
    /// RoPE tables of positions `0..T` for the last training length `T`, made once and reused
    /// by every step of that length (no host computation and upload per step).
    rope: std::sync::Mutex<Option<(usize, Tensor, Tensor)>>,
}

/// The seven linears of a block, by HF module name, in their stacking order.
const QKV: [&str; 3] = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"];
const GATE_UP: [&str; 2] = ["mlp.gate_proj", "mlp.up_proj"];

impl Decoder {
    /// Builds the decoder on `store` from `weights` (checked first: names and shapes).
    ///
    /// - [`FineTune::Full`]: every tensor becomes a store parameter with the HF name (norm
    ///   gains and the token table differentiated as fp32 masters, the linears through
    ///   compute-dtype working copies).
    /// - [`FineTune::Lora`]: the tensors become frozen constants in the store's compute dtype
    ///   (bf16 under bf16-mixed) on its device; adapters are created in the store for every
    ///   block linear the config targets, named `{module}.lora_A.weight` /
    ///   `{module}.lora_B.weight`.
    ///
    /// Errors: weights that do not fit their config (every problem named); a name already in
    /// the store; an invalid LoRA config or one that targets no module of the model.
    pub fn new(store: &ParamStore, weights: &DecoderWeights, fine_tune: &FineTune) -> Result<Self> {
        weights.check()?;
        let config = weights.config.clone();
        let precision = store.precision();
        let compute = precision.compute_dtype();
        let lora = match fine_tune {
            FineTune::Full => None,
            FineTune::Lora(l) => {
                l.validate()?;
                Some(l.clone())
            }
        };
        let mut frozen = HashMap::new();
        let mut take = |name: &str, role: Role| -> Result<Tensor> {
            let t = &weights.tensors[name];
            if lora.is_some() {
                let c = t.to_dtype(compute)?.to_device(store.device())?;
                frozen.insert(name.to_string(), c.clone());
                Ok(c)
            } else {
                store.insert(name, t, role)
            }
        };
        let embed = take(EMBED, Role::Fp32)?;
        let dims = Dims {
            heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            eps: config.rms_norm_eps,
            compute,
        };
        let mut blocks = Vec::with_capacity(config.num_hidden_layers);
        let mut adapters = Vec::new();
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let attn_norm = take(&format!("{p}.input_layernorm.weight"), Role::Fp32)?;
            let mlp_norm = take(&format!("{p}.post_attention_layernorm.weight"), Role::Fp32)?;
            let mut proj = |modules: &[&str]| -> Result<Proj> {
                let mut parts = Vec::new();
                let mut adapted = Vec::new();
                let mut targeted = Vec::new();
                for m in modules {
                    let module = format!("{p}.{m}");
                    let w = take(&format!("{module}.weight"), Role::Matmul)?;
                    let on = lora.as_ref().is_some_and(|l| l.targets(&module));
                    if on {
                        targeted.push((module, w.dims2()?));
                    }
                    parts.push(w);
                    adapted.push(on);
                }
                // the targeted modules' adapters as one stack (they read the same input)
                let stack = match (&lora, targeted.first()) {
                    (Some(l), Some(&(_, (_, inp)))) => {
                        let names: Vec<String> = targeted.iter().map(|t| t.0.clone()).collect();
                        let outs: Vec<usize> = targeted.iter().map(|t| t.1 .0).collect();
                        let name = crate::lora::stacked_name(&names);
                        let stack = LoraAdapter::new_stacked(store, &name, inp, &outs, l.r)?;
                        Some((name, stack))
                    }
                    _ => None,
                };
                let mut proj = Proj::new(parts, lora.is_some(), stack, &adapted)?;
                let modules = targeted.iter().map(|t| t.0.clone());
                adapters.extend(modules.zip(proj.adapters.iter().flatten().cloned()));
                if let Some(l) = &lora {
                    proj.scaling = l.scaling();
                    proj.dropout = l.dropout;
                }
                Ok(proj)
            };
            let qkv = proj(&QKV)?;
            let o = proj(&["self_attn.o_proj"])?;
            let gate_up = proj(&GATE_UP)?;
            let down = proj(&["mlp.down_proj"])?;
            blocks.push(Arc::new(Block {
                attn_norm,
                qkv,
                o,
                mlp_norm,
                gate_up,
                down,
                dims,
            }));
        }
        let norm = take(FINAL_NORM, Role::Fp32)?;
        let head = if config.tie_word_embeddings {
            None
        } else {
            Some(take(HEAD, Role::Matmul)?)
        };
        if let Some(l) = &lora {
            if adapters.is_empty() {
                bail!(
                    "LoRA target modules {:?} match no linear of the model (its modules are \
                     model.layers.N.self_attn.{{q,k,v,o}}_proj and model.layers.N.mlp.{{gate,up,down}}_proj)",
                    l.target_modules
                );
            }
        }
        Ok(Self {
            config,
            precision,
            device: store.device().clone(),
            embed,
            head,
            blocks,
            norm,
            frozen,
            adapters,
            lora,
            checkpointing: false,
            rope: std::sync::Mutex::new(None),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// The device the model's tensors live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The LoRA configuration, in LoRA mode.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// Recomputes each block's activations in the backward instead of keeping them
    /// ([`crate::recompute`]): the forward keeps only each block's input. Off by default.
    /// Errors with LoRA dropout (the recomputation would draw another mask).
    pub fn set_checkpointing(&mut self, on: bool) -> Result<()> {
        if on && self.lora.as_ref().is_some_and(|l| l.dropout > 0.0) {
            bail!("activation checkpointing with LoRA dropout > 0 is not supported: the recomputed block would draw a different dropout mask; set dropout to 0");
        }
        self.checkpointing = on;
        Ok(())
    }

    /// Bytes of the frozen base tensors (LoRA mode; 0 in full fine-tuning).
    pub fn frozen_bytes(&self) -> usize {
        self.frozen
            .values()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    fn compute(&self) -> DType {
        self.precision.compute_dtype()
    }

    /// The head weight `(V, C)` in the compute dtype (the token table's, when tied).
    fn head_weight(&self) -> Result<Tensor> {
        let w = self.head.as_ref().unwrap_or(&self.embed);
        Ok(self.precision.to_compute(w)?)
    }

    fn check_ids(&self, ids: &Tensor, what: &str) -> Result<(usize, usize)> {
        let (b, t) = match ids.dims() {
            &[b, t] if b > 0 && t > 0 => (b, t),
            d => bail!("Decoder::{what}: ids must be (B, T) with B, T >= 1, found shape {d:?}"),
        };
        if !matches!(ids.dtype(), DType::U32 | DType::I64 | DType::U8) {
            bail!(
                "Decoder::{what}: ids must be integer token ids (u32), found {:?}",
                ids.dtype()
            );
        }
        Ok((b, t))
    }

    /// RoPE `(cos, sin)` of positions `0..t`, from the cache when the length repeats.
    fn rope_tables(&self, t: usize) -> Result<(Tensor, Tensor)> {
        let mut cached = self.rope.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((len, cos, sin)) = cached.as_ref() {
            if *len == t {
                return Ok((cos.clone(), sin.clone()));
            }
        }
        let (cos, sin) = self.config.rotary_tables(t, 0, &self.device)?;
        *cached = Some((t, cos.clone(), sin.clone()));
        Ok((cos, sin))
    }

    /// The residual stream `(B, T, C)` f32 of the token ids.
    fn embed_ids(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(to_f32(&ops::embedding(ids, &self.embed)?)?)
    }

    /// Mean next-token cross-entropy (f32 scalar) of `ids: (B, T)` against `targets: (B, T)`
    /// (transformers' `cross_entropy(logits.float().view(-1, V), y.view(-1))`), the model in
    /// training mode (LoRA dropout on). The head and the loss are one node: backpropagate
    /// through the result once.
    ///
    /// Errors: ids not `(B, T)` integers, `T` over `max_position_embeddings`, targets of
    /// another shape, ids or targets outside the vocabulary (CPU), a failing op.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (b, t) = self.check_ids(ids, "loss")?;
        if targets.dims() != ids.dims() {
            bail!(
                "Decoder::loss: targets have shape {:?} but ids have {:?}; both must be (B, T)",
                targets.dims(),
                ids.dims()
            );
        }
        if t > self.config.max_position_embeddings {
            bail!(
                "Decoder::loss: sequence length {t} exceeds max_position_embeddings {}",
                self.config.max_position_embeddings
            );
        }
        let (cos, sin) = self.rope_tables(t)?;
        let mut x = self.embed_ids(ids)?;
        // the L blocks as one stack: one graph node under the engine's backward
        let layers: Option<Vec<_>> = match self.checkpointing {
            true => None,
            false => self
                .blocks
                .iter()
                .map(|b| b.layers(&cos, &sin, true))
                .collect(),
        };
        match &layers {
            Some(layers) => {
                let halves: Vec<Half<'_>> = self
                    .blocks
                    .iter()
                    .zip(layers)
                    .flat_map(|(b, l)| b.halves(l))
                    .collect();
                x = ops::pre_norm_stack(&x, &halves, self.compute())?;
            }
            // LoRA dropout or checkpointing: the blocks one by one, per op
            None => {
                for block in &self.blocks {
                    x = if self.checkpointing {
                        let (l, cos, sin) = (block.clone(), cos.clone(), sin.clone());
                        let segment: crate::recompute::SegmentFn = Arc::new(move |x: &Tensor| {
                            l.forward(x, &cos, &sin, true)
                                .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
                        });
                        crate::recompute::checkpoint(&x, &block.tensors(), segment)?
                    } else {
                        block.forward(&x, &cos, &sin, true)?
                    };
                }
            }
        }
        let c = self.config.hidden_size;
        let h = ops::rms_norm_with_dtype(&x, &self.norm, self.config.rms_norm_eps, self.compute())?
            .reshape((b * t, c))?;
        let y = targets.flatten_all()?;
        Ok(ops::linear_cross_entropy_rows(&h, &self.head_weight()?, &y)?.mean_all()?)
    }

    /// Logits `(B, T, V)` f32 of `ids: (B, T)` at positions `cache.len()..`, appending the
    /// blocks' keys and values to `cache` (inference: no dropout, nothing kept for a backward).
    /// With an empty cache this is the plain forward of `LlamaForCausalLM`.
    ///
    /// Errors: ids not `(B, T)` integers; a cache of another batch size or model; positions past
    /// `max_position_embeddings`.
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let (b, t) = self.check_ids(ids, "forward_cached")?;
        if cache.layers.is_empty() {
            cache.layers = vec![None; self.blocks.len()];
        }
        if cache.layers.len() != self.blocks.len() || (cache.len > 0 && cache.batch != b) {
            bail!(
                "Decoder::forward_cached: the cache holds {} block(s) of batch {}, the model has {} \
                 block(s) and the ids batch {b}; use a fresh KvCache",
                cache.layers.len(),
                cache.batch,
                self.blocks.len()
            );
        }
        let start = cache.len;
        if start + t > self.config.max_position_embeddings {
            bail!(
                "Decoder::forward_cached: positions {start}..{} exceed max_position_embeddings {}",
                start + t,
                self.config.max_position_embeddings
            );
        }
        let cfg = &self.config;
        let (h, hkv, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim(),
        );
        let (cos, sin) = cfg.rotary_tables(t, start, &self.device)?;
        let mask = causal_mask(t, start, h / hkv, &self.device)?;
        let mut x = self.embed_ids(&ids.detach())?.detach();
        for (l, kv) in self.blocks.iter().zip(cache.layers.iter_mut()) {
            let n = ops::rms_norm_with_dtype(&x, &l.attn_norm, cfg.rms_norm_eps, self.compute())?;
            let qkv = ops::rotary_qkv(&l.qkv.forward(&n, false)?, &cos, &sin, h, hkv)?.detach();
            let heads = |from: usize, count: usize| -> Result<Tensor> {
                Ok(qkv
                    .narrow(2, from * d, count * d)?
                    .reshape((b, t, count, d))?
                    .transpose(1, 2)?
                    .contiguous()?)
            };
            let (q, k, v) = (heads(0, h)?, heads(h, hkv)?, heads(h + hkv, hkv)?);
            let (k, v) = match kv.take() {
                Some((k0, v0)) => (Tensor::cat(&[&k0, &k], 2)?, Tensor::cat(&[&v0, &v], 2)?),
                None => (k, v),
            };
            let a = cached_attention(&q, &k, &v, &mask, hkv)?; // (B, T, H*D)
            *kv = Some((k, v));
            x = ops::residual_add(&x, &l.o.forward(&a, false)?)?.detach();
            let n = ops::rms_norm_with_dtype(&x, &l.mlp_norm, cfg.rms_norm_eps, self.compute())?;
            let m = ops::swiglu(&l.gate_up.forward(&n, false)?)?;
            x = ops::residual_add(&x, &l.down.forward(&m, false)?)?.detach();
        }
        cache.len = start + t;
        cache.batch = b;
        let hn = ops::rms_norm_with_dtype(&x, &self.norm, cfg.rms_norm_eps, self.compute())?;
        let logits = hn.broadcast_matmul(&self.head_weight()?.detach().t()?)?;
        Ok(to_f32(&logits)?.detach())
    }

    /// Generates up to `max_new_tokens` ids after `prompt` with a KV cache: the prompt in one
    /// forward, then one token per forward. Each id is drawn from `softmax(logits /
    /// temperature)` (seeded by `seed`); `temperature == 0` is greedy. Stops after the config's
    /// `eos_token_id` (any of them; included). Returns the new ids.
    ///
    /// Errors: an empty prompt, an id outside the vocabulary, a temperature that is negative or
    /// not finite, a prompt plus new tokens past `max_position_embeddings`, non-finite logits.
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        temperature: f64,
        seed: u64,
    ) -> Result<Vec<u32>> {
        self.generate_with(prompt, max_new_tokens, temperature, seed, |_| true)
    }

    /// [`Decoder::generate`] that hands each new id to `on_token` as soon as it is drawn (e.g.
    /// to stream it); generation stops early when `on_token` returns false (the id is kept).
    /// The KV cache lives for this call only, so every id comes from this model's weights.
    ///
    /// Errors: as [`Decoder::generate`].
    pub fn generate_with(
        &self,
        prompt: &[u32],
        max_new_tokens: usize,
        temperature: f64,
        seed: u64,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<Vec<u32>> {
        super::sampling::check_generation("Llama", prompt, self.config.vocab_size, temperature)?;
        let mut rng = StdRng::seed_from_u64(seed);
        let mut cache = KvCache::default();
        let mut out = Vec::with_capacity(max_new_tokens);
        let mut next_input = prompt.to_vec();
        for _ in 0..max_new_tokens {
            let x = Tensor::from_slice(&next_input, (1, next_input.len()), &self.device)?;
            let logits = self.forward_cached(&x, &mut cache)?;
            let last: Vec<f32> = logits
                .narrow(1, next_input.len() - 1, 1)?
                .flatten_all()?
                .to_vec1()?;
            let id = super::sampling::sample(&last, temperature, &mut rng)?;
            out.push(id);
            if !on_token(id) || self.config.is_eos(id) {
                break;
            }
            next_input = vec![id];
        }
        Ok(out)
    }

    /// An inference copy of this model that later training steps do not change: the
    /// trainable tensors (the LoRA adapters; in full fine-tuning every tensor) are deep-copied
    /// and detached, the frozen base tensors are shared (no copy). Cheap in LoRA mode: the
    /// adapters only. Take it between optimizer steps, on the thread that trains.
    ///
    /// Errors: a failed copy (out of device memory).
    pub fn snapshot(&self) -> Result<Decoder> {
        let copy = |t: &Tensor| -> Result<Tensor> { Ok(t.copy()?.detach()) };
        self.rebuild(&|_, t| copy(t))
    }

    /// The adapters' tensors by parameter name (`{module}.lora_A.weight` `(r, in)`,
    /// `{module}.lora_B.weight` `(out, r)`), as the forward reads them (compute dtype); empty
    /// in full fine-tuning. Shared handles: copy them (or take a [`Decoder::snapshot`] first)
    /// to keep a version.
    pub fn adapter_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (module, ad) in &self.adapters {
            out.push((format!("{module}.lora_A.weight"), ad.a.clone()));
            out.push((format!("{module}.lora_B.weight"), ad.b.clone()));
        }
        out
    }

    /// The adapters' fp32 masters from `store` (the store the model was built on) by wick's
    /// per-module names, as [`Decoder::adapter_tensors`] names them: views of the stacked store
    /// parameters (`{prefix}.{q_proj,k_proj,v_proj}.lora_A.weight`, see
    /// [`crate::lora::LoraAdapter::new_stacked`]), for
    /// [`crate::lora::save_adapter_tensors`]. Empty in full fine-tuning.
    ///
    /// Errors: a stack missing from `store` or of another shape (another store than the
    /// model's).
    pub fn adapter_masters(&self, store: &ParamStore) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for b in &self.blocks {
            for p in [&b.qkv, &b.o, &b.gate_up, &b.down] {
                let Some((name, _)) = &p.lora else { continue };
                let master = |kind: &str| -> Result<Tensor> {
                    let n = format!("{name}.lora_{kind}.weight");
                    Ok(store
                        .get(&n)
                        .with_context(|| format!("adapter_masters: {n} is not in the store"))?
                        .master
                        .as_detached_tensor())
                };
                let stack = LoraAdapter {
                    a: master("A")?,
                    b: master("B")?,
                };
                let outs = adapted_outs(&p.parts, p.adapters.iter().map(Option::is_some));
                for (i, module) in crate::lora::stacked_modules(name).iter().enumerate() {
                    let ad = stack.part(&outs, i)?;
                    out.push((format!("{module}.lora_A.weight"), ad.a));
                    out.push((format!("{module}.lora_B.weight"), ad.b));
                }
            }
        }
        Ok(out)
    }

    /// An inference copy of this LoRA model with other adapters: `tensors` by parameter name
    /// (as [`crate::lora::load_adapters`] returns them: any float dtype, any device), cast to
    /// the compute dtype on the model's device. The base is shared. The scaling stays this
    /// model's (`alpha / r` of its config).
    ///
    /// Errors: not a LoRA model; an adapter of the model missing from `tensors`, a shape that
    /// differs, or a tensor that is not an adapter of the model (every problem named).
    pub fn with_adapters(&self, tensors: &HashMap<String, Tensor>) -> Result<Decoder> {
        if self.lora.is_none() {
            bail!("Decoder::with_adapters: the model was built without LoRA (FineTune::Full)");
        }
        let mut problems = Vec::new();
        let mine: HashMap<String, Tensor> = self.adapter_tensors().into_iter().collect();
        for (name, t) in &mine {
            match tensors.get(name) {
                None => problems.push(format!("missing {name} {:?}", t.dims())),
                Some(x) if x.dims() != t.dims() => problems.push(format!(
                    "{name}: given {:?}, the model has {:?}",
                    x.dims(),
                    t.dims()
                )),
                Some(x) if !x.dtype().is_float() => {
                    problems.push(format!("{name}: dtype {:?} is not a float", x.dtype()))
                }
                Some(_) => {}
            }
        }
        let mut unknown: Vec<&String> = tensors.keys().filter(|k| !mine.contains_key(*k)).collect();
        unknown.sort();
        problems.extend(unknown.iter().map(|k| format!("unexpected {k}")));
        if !problems.is_empty() {
            bail!(
                "the adapters do not fit the model ({} problem(s)): {}",
                problems.len(),
                problems.join("; ")
            );
        }
        let compute = self.compute();
        self.rebuild(&|name, t| match name {
            Some(n) => Ok(tensors[n]
                .to_dtype(compute)?
                .to_device(&self.device)?
                .detach()),
            None => Ok(t.clone()),
        })
    }

    /// A copy of the model's structure with each tensor passed through `f(name, t)`: `name`
    /// is the adapter parameter's name for LoRA tensors, `None` for the others. Frozen base
    /// tensors (LoRA mode) are never passed to `f`: they are shared.
    fn rebuild(&self, f: &dyn Fn(Option<&str>, &Tensor) -> Result<Tensor>) -> Result<Decoder> {
        let lora = self.lora.is_some();
        let base = |t: &Tensor| -> Result<Tensor> {
            if lora {
                Ok(t.clone())
            } else {
                f(None, t)
            }
        };
        let mut names = self.adapters.iter().map(|(m, _)| m.as_str());
        let mut adapters = Vec::with_capacity(self.adapters.len());
        let mut blocks = Vec::with_capacity(self.blocks.len());
        for b in &self.blocks {
            let mut proj = |p: &Proj| -> Result<Proj> {
                let mut ads = Vec::with_capacity(p.adapters.len());
                let mut stacked: Vec<LoraAdapter> = Vec::new();
                for ad in &p.adapters {
                    ads.push(match ad {
                        None => None,
                        Some(ad) => {
                            let module = names.next().context("adapter list out of step")?;
                            let new = LoraAdapter {
                                a: f(Some(&format!("{module}.lora_A.weight")), &ad.a)?,
                                b: f(Some(&format!("{module}.lora_B.weight")), &ad.b)?,
                            };
                            adapters.push((module.to_string(), new.clone()));
                            stacked.push(new.clone());
                            Some(new)
                        }
                    });
                }
                // the stacks the forward reads, from the new per-module tensors
                let lora = match &p.lora {
                    Some((name, _)) => {
                        let cat = |f: fn(&LoraAdapter) -> &Tensor| {
                            Tensor::cat(&stacked.iter().map(f).collect::<Vec<_>>(), 0)
                        };
                        let stack = LoraAdapter {
                            a: cat(|ad| &ad.a)?,
                            b: cat(|ad| &ad.b)?,
                        };
                        Some((name.clone(), stack))
                    }
                    None => None,
                };
                Ok(Proj {
                    parts: p.parts.iter().map(&base).collect::<Result<_>>()?,
                    stacked: p.stacked.clone(),
                    adapters: ads,
                    lora,
                    scaling: p.scaling,
                    dropout: p.dropout,
                    ranks: p.ranks.clone(),
                })
            };
            let (qkv, o, gate_up, down) = (
                proj(&b.qkv)?,
                proj(&b.o)?,
                proj(&b.gate_up)?,
                proj(&b.down)?,
            );
            blocks.push(Arc::new(Block {
                attn_norm: base(&b.attn_norm)?,
                qkv,
                o,
                mlp_norm: base(&b.mlp_norm)?,
                gate_up,
                down,
                dims: b.dims,
            }));
        }
        Ok(Decoder {
            config: self.config.clone(),
            precision: self.precision,
            device: self.device.clone(),
            embed: base(&self.embed)?,
            head: self.head.as_ref().map(&base).transpose()?,
            blocks,
            norm: base(&self.norm)?,
            frozen: self.frozen.clone(),
            adapters,
            lora: self.lora.clone(),
            checkpointing: false,
            rope: std::sync::Mutex::new(None),
        })
    }

    /// The model's current weights by HF name, f32 on the CPU, with every LoRA update merged
    /// into its base weight (`W + (alpha/r) B A`, PEFT's `merge_and_unload`): what
    /// [`super::files::save_pretrained`] writes. In full fine-tuning these are the store's
    /// fp32 masters; in LoRA mode the frozen base as held (compute dtype, widened to f32).
    ///
    /// Errors: a full-mode tensor missing from `store` (another store than the model's).
    pub fn merged_weights(&self, store: &ParamStore) -> Result<DecoderWeights> {
        let mut tensors = HashMap::new();
        for (name, _) in self.config.tensor_shapes() {
            let t = match self.frozen.get(&name) {
                Some(t) => t.to_dtype(DType::F32)?,
                None => store
                    .get(&name)
                    .with_context(|| format!("merged_weights: {name} is not in the store"))?
                    .master
                    .as_detached_tensor(),
            };
            tensors.insert(name, t.to_device(&Device::Cpu)?);
        }
        if let Some(l) = &self.lora {
            for (module, ad) in &self.adapters {
                let name = format!("{module}.weight");
                let merged = (&tensors[&name] + ad.delta(l.scaling())?.to_device(&Device::Cpu)?)?;
                tensors.insert(name, merged);
            }
        }
        Ok(DecoderWeights {
            config: self.config.clone(),
            tensors,
        })
    }
}

/// Keys and values of the positions seen so far, per block: `(B, Hkv, S, D)` each, in the
/// compute dtype. Start with `KvCache::default()`; one cache per sequence batch. Drop it (or
/// [`KvCache::clear`]) when the weights change: its keys came from the old ones.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
    batch: usize,
}

impl KvCache {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every position.
    pub fn clear(&mut self) {
        *self = Self::default();
    }
}

/// Additive mask `(G*T, start+T)` f32 for `G` query heads of a group stacked along the rows:
/// row `g*T + i` (query position `start + i`) sees keys `0..=start+i`.
fn causal_mask(t: usize, start: usize, g: usize, device: &Device) -> Result<Tensor> {
    let s = start + t;
    let mut m = vec![0f32; g * t * s];
    for r in 0..g * t {
        let i = r % t;
        for j in (start + i + 1)..s {
            m[r * s + j] = f32::NEG_INFINITY;
        }
    }
    Ok(Tensor::from_vec(m, (g * t, s), device)?)
}

/// Grouped-query attention of new queries against cached keys, inference only: `q: (B, H, T,
/// D)`, `k, v: (B, Hkv, S, D)` → `(B, T, H*D)` in q's dtype; the `G = H/Hkv` query heads of a
/// group are stacked along the rows so K and V are not repeated; softmax in f32.
fn cached_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    hkv: usize,
) -> Result<Tensor> {
    let (b, h, t, d) = q.dims4()?;
    let g = h / hkv;
    let q = q.reshape((b, hkv, g * t, d))?;
    let scores = (to_f32(&q.matmul(&k.t()?)?)? / (d as f64).sqrt())?;
    let p = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(mask)?)?;
    let y = p.to_dtype(v.dtype())?.matmul(v)?; // (B, Hkv, G*T, D)
    Ok(y.reshape((b, h, t, d))?
        .transpose(1, 2)?
        .reshape((b, t, h * d))?)
}
