//! The shared decoder of the Llama, Mistral, Qwen2, Qwen3 and Gemma 3 families
//! (transformers' `*ForCausalLM`) built from wick's fused, differentiable ops, with
//! transformers' tensor names (`model.layers.{i}.self_attn.q_proj.weight`, ...), full
//! fine-tuning or LoRA ([`crate::lora`]). The block is [`super::block`]'s, one description run
//! by training, cached inference and generation alike; a family is its config
//! ([`DecoderConfig::model_type`]) plus the switches of [`super::family`].
//!
//! After the blocks: the final RMSNorm and the head (tied to the token table when the config
//! says so), with the head and the cross-entropy as one node computed in chunks of rows
//! ([`ops::linear_cross_entropy_sum`]: the `(tokens, vocabulary)` logits never exist whole).
//! The residual stream is f32; the GEMMs run in the compute dtype; the norms, RoPE, softmax
//! and the gated activations compute in f32 ([`crate::precision`]). RoPE is transformers'
//! `rotate_half` form (pairs `(i, i + D/2)`); GGUF files of the `llama` architecture store q/k
//! rows permuted for llama.cpp's interleaved form, which [`super::files`] undoes on load.
//!
//! Inference ([`Decoder::forward_cached`], [`Decoder::generate`]) keeps a KV cache per block.

use super::block::{self, adapted_outs, Attend, Block, Norms, Proj, Spec};
use super::config::{DecoderConfig, EMBED, FINAL_NORM, HEAD};
use super::family::LINEARS;
use super::paged::{BlockTable, PagedKvCache};
use crate::data::packing::TrainBatch;
use crate::lora::{LoraAdapter, LoraConfig};
use crate::ops;
use crate::params::{ParamStore, Role};
use crate::precision::{to_f32, Autocast, OpClass};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, SeedableRng};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

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
    /// Random weights as transformers initialises a fresh model of the family: linears and
    /// the token table `N(0, 0.02)`, biases 0, norm gains 1 (Gemma's `1 + w` gains: `w = 0`).
    /// f32 on the CPU; `seed` fixes them.
    ///
    /// Errors: an invalid config.
    pub fn random(config: DecoderConfig, seed: u64) -> Result<Self> {
        config.validate()?;
        use rand_distr::{Distribution, Normal};
        let mut rng = StdRng::seed_from_u64(seed);
        let normal = Normal::new(0.0f32, 0.02).context("N(0, 0.02)")?;
        let mut tensors = HashMap::new();
        let gain = 1.0 - config.model_type.switches().norm_offset as f32;
        for (name, shape) in config.tensor_shapes() {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = if name.ends_with(".bias") {
                vec![0.0; n]
            } else if shape.len() == 1 {
                vec![gain; n]
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
                "the weights do not fit the {} config ({} problem(s)): {}",
                self.config.model_type.model_type(),
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

/// The decoder. Build it with [`Decoder::new`] from [`DecoderWeights`].
pub struct Decoder {
    config: DecoderConfig,
    autocast: Autocast,
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
    rope: std::sync::Mutex<Option<(usize, Arc<Ropes>)>>,
    /// RoPE tables of positions `0..N` whose rows cached forwards take
    /// ([`Decoder::position_tables`]).
    rope_positions: std::sync::Mutex<Option<(usize, Arc<Ropes>)>>,
}

/// The RoPE tables `(cos, sin)`, each `(T, D/2)` f32, of a run of positions: the full
/// layers' and, for Gemma 3, the sliding layers' (another base).
struct Ropes {
    global: (Tensor, Tensor),
    local: Option<(Tensor, Tensor)>,
}

impl Ropes {
    fn new(config: &DecoderConfig, t: usize, start: usize, device: &Device) -> Result<Self> {
        let table = |sliding: bool| config.rotary_tables_of(sliding, t, start, device);
        Ok(Self {
            global: table(false)?,
            local: match config.rope_local_base_freq {
                Some(_) => Some(table(true)?),
                None => None,
            },
        })
    }

    /// The rows of positions `start..start + t` (views, no copy).
    fn rows(&self, start: usize, t: usize) -> Result<Self> {
        let rows = |(c, s): &(Tensor, Tensor)| -> Result<(Tensor, Tensor)> {
            Ok((c.narrow(0, start, t)?, s.narrow(0, start, t)?))
        };
        Ok(Self {
            global: rows(&self.global)?,
            local: self.local.as_ref().map(rows).transpose()?,
        })
    }

    /// The rows of `positions` (`(N,)` u32, e.g. a packed batch's restarting positions),
    /// gathered: `(N, D/2)` each.
    fn gather(&self, positions: &Tensor) -> Result<Self> {
        let rows = |(c, s): &(Tensor, Tensor)| -> Result<(Tensor, Tensor)> {
            Ok((c.index_select(positions, 0)?, s.index_select(positions, 0)?))
        };
        Ok(Self {
            global: rows(&self.global)?,
            local: self.local.as_ref().map(rows).transpose()?,
        })
    }

    /// Block `b`'s table.
    fn of(&self, b: &Block) -> &(Tensor, Tensor) {
        match (&self.local, b.spec.local_rope) {
            (Some(local), true) => local,
            _ => &self.global,
        }
    }
}

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
        let autocast = store.autocast();
        let compute = autocast.dtype(OpClass::Matmul);
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
        let family = config.model_type;
        let switches = family.switches();
        let mut blocks = Vec::with_capacity(config.num_hidden_layers);
        let mut adapters = Vec::new();
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}");
            // the gains of the family's block_norms, in its order
            let gains = family
                .block_norms()
                .iter()
                .map(|(name, _, _)| take(&format!("{p}.{name}"), Role::Fp32))
                .collect::<Result<Vec<_>>>()?;
            let norms = Norms::from_block_order(gains, &switches)?;
            let mut proj = |modules: &[(&str, &str)]| -> Result<Proj> {
                let mut parts = Vec::new();
                let mut bias = Vec::new();
                let mut adapted = Vec::new();
                let mut targeted = Vec::new();
                for (m, _) in modules {
                    let module = format!("{p}.{m}");
                    let w = take(&format!("{module}.weight"), Role::Matmul)?;
                    let b = format!("{module}.bias");
                    if weights.tensors.contains_key(&b) {
                        bias.push(take(&b, Role::Fp32)?);
                    }
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
                let mut proj = Proj::new(parts, bias, lora.is_some(), stack, &adapted)?;
                let modules = targeted.iter().map(|t| t.0.clone());
                adapters.extend(modules.zip(proj.adapters.iter().flatten().cloned()));
                if let Some(l) = &lora {
                    proj.scaling = l.scaling();
                    proj.dropout = l.dropout;
                }
                Ok(proj)
            };
            let qkv = proj(&LINEARS[0..3])?;
            let o = proj(&LINEARS[3..4])?;
            let gate_up = proj(&LINEARS[4..6])?;
            let down = proj(&LINEARS[6..7])?;
            let spec = Spec {
                heads: config.num_attention_heads,
                kv_heads: config.num_key_value_heads,
                eps: config.rms_norm_eps,
                switches,
                window: config.layer_window(i),
                scale: config.attention_scale(),
                local_rope: config.layer_is_sliding(i),
            };
            blocks.push(Arc::new(Block {
                norms,
                qkv,
                o,
                gate_up,
                down,
                spec,
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
            autocast,
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
            rope_positions: std::sync::Mutex::new(None),
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
        self.autocast.dtype(OpClass::Matmul)
    }

    /// The head weight `(V, C)` in the compute dtype (the token table's, when tied).
    fn head_weight(&self) -> Result<Tensor> {
        let w = self.head.as_ref().unwrap_or(&self.embed);
        Ok(self.autocast.cast(OpClass::Matmul, w)?)
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

    /// The RoPE tables of positions `0..t`, from the cache when the length repeats.
    fn rope_tables(&self, t: usize) -> Result<Arc<Ropes>> {
        let mut cached = self.rope.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((len, ropes)) = cached.as_ref() {
            if *len == t {
                return Ok(ropes.clone());
            }
        }
        let ropes = Arc::new(Ropes::new(&self.config, t, 0, &self.device)?);
        *cached = Some((t, ropes.clone()));
        Ok(ropes)
    }

    /// RoPE tables of positions `0..n` or more (cached forwards take their rows): made for a
    /// power-of-two count of positions (at most `max_position_embeddings`) and reused while
    /// the positions fit, so generation computes them on the host a few times, not per token.
    fn position_tables(&self, n: usize) -> Result<Arc<Ropes>> {
        let mut cached = self
            .rope_positions
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some((len, ropes)) = cached.as_ref() {
            if *len >= n {
                return Ok(ropes.clone());
            }
        }
        let len = n
            .next_power_of_two()
            .max(64)
            .min(self.config.max_position_embeddings)
            .max(n);
        let ropes = Arc::new(Ropes::new(&self.config, len, 0, &self.device)?);
        *cached = Some((len, ropes.clone()));
        Ok(ropes)
    }

    /// The residual stream `(B, T, C)` f32 of the token ids: the table's rows, times
    /// `√hidden_size` rounded to the table's dtype for Gemma (transformers'
    /// `Gemma3TextScaledWordEmbedding`).
    fn embed_ids(&self, ids: &Tensor) -> Result<Tensor> {
        let x = to_f32(&ops::embedding(ids, &self.embed)?)?;
        if !self.config.model_type.switches().embed_scale {
            return Ok(x);
        }
        let scale = (self.config.hidden_size as f64).sqrt();
        let scale = match self.embed.dtype() {
            DType::BF16 => half::bf16::from_f64(scale).to_f64(),
            DType::F16 => half::f16::from_f64(scale).to_f64(),
            _ => scale as f32 as f64,
        };
        Ok(x.affine(scale, 0.0)?)
    }

    /// The final norm of the f32 stream, output in the compute dtype.
    fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        let g = block::applied_gain(&self.norm, self.config.model_type.switches().norm_offset)?;
        Ok(ops::rms_norm_with_dtype(
            x,
            &g,
            self.config.rms_norm_eps,
            self.compute(),
        )?)
    }

    /// Mean next-token cross-entropy (f32 scalar) of `ids: (B, T)` against `targets: (B, T)`
    /// (transformers' `cross_entropy(logits.float().view(-1, V), y.view(-1))`), the model in
    /// training mode (LoRA dropout on). The head and the loss are one node: backpropagate
    /// through the result once. A target equal to [`ops::IGNORE_INDEX`] (i64 `-100`; u32
    /// `u32::MAX`) adds zero loss and gradient but still counts in the `B * T` of the mean
    /// (transformers divides by the trained targets: use [`Decoder::batch_loss`] for that).
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
        let h = self.hidden(ids, self.rope_tables(t)?, None, true)?;
        let h = h.reshape((b * t, self.config.hidden_size))?;
        let y = targets.flatten_all()?;
        let sum = ops::linear_cross_entropy_sum(&h, &self.head_weight()?, &y, None)?;
        Ok(sum.affine(1.0 / (b * t) as f64, 0.0)?)
    }

    /// Mean cross-entropy (f32 scalar) over the trained targets of `batch` (packed without
    /// padding, or padded: [`crate::data::packing`]), transformers' loss of a batch whose
    /// labels are `-100` outside the trained tokens. Only the rows of trained targets reach
    /// the head. Training mode, as [`Decoder::loss`].
    ///
    /// Errors: a batch with no trained target; a document or row longer than
    /// `max_position_embeddings`; ids outside the vocabulary (CPU); a failing op.
    pub fn batch_loss(&self, batch: &TrainBatch) -> Result<Tensor> {
        self.trained_targets_loss(batch, true)
    }

    /// [`Decoder::batch_loss`] in evaluation mode (transformers' `model.eval()` under
    /// `torch.no_grad()`): no LoRA dropout, no activation checkpointing, and the head + loss
    /// node makes no gradients (its operands detached). A rank-0 f32 tensor outside any
    /// backward. Errors: as [`Decoder::batch_loss`].
    pub fn eval_loss(&self, batch: &TrainBatch) -> Result<Tensor> {
        Ok(self.trained_targets_loss(batch, false)?.detach())
    }

    /// [`Decoder::batch_loss`] (`train`) or [`Decoder::eval_loss`].
    fn trained_targets_loss(&self, batch: &TrainBatch, train: bool) -> Result<Tensor> {
        let (_, t) = self.check_ids(batch.ids(), "batch_loss")?;
        let n = batch.trained_targets();
        if n == 0 {
            bail!("Decoder::batch_loss: the batch has no trained target; nothing to learn from")
        }
        let longest = match batch.segments() {
            Some(s) => s
                .cu_seqlens()
                .windows(2)
                .map(|w| w[1] - w[0])
                .max()
                .unwrap_or(0),
            None => t,
        };
        if longest > self.config.max_position_embeddings {
            bail!(
                "Decoder::batch_loss: an example of {longest} tokens exceeds \
                 max_position_embeddings {}; lower the maximum example length",
                self.config.max_position_embeddings
            );
        }
        let ropes = match batch.segments() {
            Some(s) => Arc::new(self.position_tables(longest)?.gather(s.positions())?),
            None => self.rope_tables(t)?,
        };
        let h = self.hidden(batch.ids(), ropes, batch.shared_segments(), train)?;
        let (mut h, mut w) = (
            h.flatten(0, 1)?.index_select(batch.rows(), 0)?,
            self.head_weight()?,
        );
        if !train {
            // detached operands: the node skips its gradient GEMMs
            (h, w) = (h.detach(), w.detach());
        }
        let sum = ops::linear_cross_entropy_sum(&h, &w, batch.targets(), None)?;
        Ok(sum.affine(1.0 / n as f64, 0.0)?)
    }

    /// The blocks and the final norm of `ids: (B, T)`: `(B, T, C)` in the compute dtype.
    /// `segments`: the documents of a packed row (attention inside each). `train`: LoRA
    /// dropout and activation checkpointing as configured; else neither.
    fn hidden(
        &self,
        ids: &Tensor,
        ropes: Arc<Ropes>,
        segments: Option<Arc<ops::Segments>>,
        train: bool,
    ) -> Result<Tensor> {
        let mut x = self.embed_ids(ids)?;
        let compute = self.compute();
        if self.checkpointing && train {
            // each block a segment recomputed in the backward, run as its per-op composition
            for b in &self.blocks {
                let (block, ropes, docs) = (b.clone(), ropes.clone(), segments.clone());
                let segment: crate::recompute::SegmentFn = Arc::new(move |x: &Tensor| {
                    let attend = Attend::over(docs.as_deref());
                    let one = std::iter::once((&*block, ropes.of(&block), attend));
                    block::run(x, one, true, true, compute)
                        .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
                });
                x = crate::recompute::checkpoint(&x, &b.tensors(), segment)?;
            }
        } else {
            // the L blocks as one stack: one graph node under the engine's backward
            let attend = Attend::over(segments.as_deref());
            let all = self.blocks.iter().map(|b| (&**b, ropes.of(b), attend));
            x = block::run(&x, all, train, false, compute)?;
        }
        self.final_norm(&x)
    }

    /// Logits `(B, T, V)` f32 of `ids: (B, T)` at positions `cache.len()..`, appending the
    /// blocks' keys and values to `cache` (inference: no dropout, nothing kept for a backward).
    /// With an empty cache this is the plain forward of the family's `*ForCausalLM`. All or
    /// nothing: a forward that fails leaves the cache as it was.
    ///
    /// Errors: ids not `(B, T)` integers; a cache of another batch size or model (a block's
    /// cache of another shape or length); positions past `max_position_embeddings`.
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let (b, t) = self.check_ids(ids, "forward_cached")?;
        let fresh = cache.layers.is_empty();
        if !fresh
            && (cache.layers.len() != self.blocks.len() || (cache.len > 0 && cache.batch != b))
        {
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
        let ropes = self.position_tables(start + t)?.rows(start, t)?;
        let x = self.embed_ids(&ids.detach())?.detach();
        // the blocks extend copies of the cache's handles (no tensor copied), which replace
        // the cache only once the whole forward succeeded: a failure leaves it as it was
        let staged: Vec<Mutex<Option<(Tensor, Tensor)>>> = match fresh {
            true => (0..self.blocks.len()).map(|_| Mutex::new(None)).collect(),
            false => cache
                .layers
                .iter()
                .map(|l| Mutex::new(l.lock().unwrap_or_else(|e| e.into_inner()).clone()))
                .collect(),
        };
        let all = self
            .blocks
            .iter()
            .zip(&staged)
            .map(|(b, kv)| (&**b, ropes.of(b), Attend::Cached { kv, start }));
        let x = block::run(&x, all, false, true, self.compute())?.detach();
        let logits = self
            .final_norm(&x)?
            .broadcast_matmul(&self.head_weight()?.detach().t()?)?;
        let logits = to_f32(&logits)?.detach();
        cache.layers = staged;
        cache.len = start + t;
        cache.batch = b;
        Ok(logits)
    }

    /// A paged KV cache for this model ([`PagedKvCache::new`] in its compute dtype on its
    /// device): `num_blocks` blocks of `block_size` positions per layer.
    ///
    /// Errors: as [`PagedKvCache::new`].
    pub fn paged_cache(&self, block_size: usize, num_blocks: usize) -> Result<PagedKvCache> {
        PagedKvCache::new(
            &self.config,
            self.compute(),
            &self.device,
            block_size,
            num_blocks,
        )
    }

    /// Next-token logits `(B, V)` f32 of a batch of `B` sequences, each at its own
    /// positions over the paged `cache` (continuous batching): sequence i brings
    /// `seqs[i].ids` (>= 1 token: a prefill chunk or one decode token) at positions
    /// `start..start + len`, its keys and values of positions `0..start` already in the
    /// blocks of its table. The new tokens of all sequences run as one packed row (one GEMM
    /// per projection for the whole batch, RoPE at each token's own position), the attention
    /// of each sequence reads its keys through its table ([`ops::paged_attention`]), and
    /// the new keys and values are written into its blocks. Row i of the result is the
    /// logits after sequence i's last new token. Inference only.
    ///
    /// The caller commits the positions (`start += len`) only after a successful call; a
    /// failed one may have written slots of the uncommitted positions, which the retry
    /// overwrites.
    ///
    /// Errors: no sequences, a sequence without ids or with an id outside the vocabulary,
    /// positions past `max_position_embeddings`, a table without room for `start + len`
    /// positions, a cache made for another model (layers, key/value heads, head width,
    /// dtype).
    pub fn forward_paged(
        &self,
        seqs: &[PagedBatchEntry<'_>],
        cache: &PagedKvCache,
    ) -> Result<Tensor> {
        let who = "Decoder::forward_paged";
        let (hkv, d) = (self.config.num_key_value_heads, self.config.head_dim());
        if cache.layers().len() != self.blocks.len()
            || cache.kv_shape() != (hkv, d)
            || cache.dtype() != self.compute()
        {
            bail!(
                "{who}: the cache holds {} layer(s) of (Hkv, D) = {:?} in {:?}; the model has {} \
                 of {:?} in {:?}; make it with Decoder::paged_cache",
                cache.layers().len(),
                cache.kv_shape(),
                cache.dtype(),
                self.blocks.len(),
                (hkv, d),
                self.compute()
            );
        }
        if seqs.is_empty() {
            bail!("{who}: no sequences; pass at least one");
        }
        let (mut ids, mut positions, mut paged, mut last) = (vec![], vec![], vec![], vec![]);
        for (i, s) in seqs.iter().enumerate() {
            let (start, len) = (s.start, s.ids.len());
            if len == 0 {
                bail!("{who}: sequence {i} brings no ids; give each at least one");
            }
            if let Some(bad) = s
                .ids
                .iter()
                .find(|&&id| id as usize >= self.config.vocab_size)
            {
                bail!(
                    "{who}: sequence {i} has id {bad}, outside the vocabulary of {}",
                    self.config.vocab_size
                );
            }
            if start + len > self.config.max_position_embeddings {
                bail!(
                    "{who}: sequence {i} reaches position {} past max_position_embeddings {}",
                    start + len,
                    self.config.max_position_embeddings
                );
            }
            let slots = cache
                .slots(s.table, 0..start + len)
                .with_context(|| format!("{who}: sequence {i}"))?;
            paged.push(ops::PagedSeq {
                start,
                len,
                offset: ids.len(),
                new_slots: slots[start..].to_vec(),
                slots: Tensor::from_vec(slots, start + len, &self.device)?,
            });
            ids.extend_from_slice(s.ids);
            positions.extend((start..start + len).map(|p| p as u32));
            last.push((ids.len() - 1) as u32);
        }
        let n = ids.len();
        let end = seqs
            .iter()
            .map(|s| s.start + s.ids.len())
            .max()
            .unwrap_or(0);
        let positions = Tensor::from_vec(positions, n, &self.device)?;
        let ropes = self.position_tables(end)?.gather(&positions)?;
        let x = self.embed_ids(&Tensor::from_vec(ids, (1, n), &self.device)?)?;
        let all = self.blocks.iter().zip(cache.layers()).map(|(b, pools)| {
            let attend = Attend::Paged {
                pools,
                seqs: &paged,
            };
            (&**b, ropes.of(b), attend)
        });
        let x = block::run(&x, all, false, true, self.compute())?;
        let last = Tensor::from_vec(last, seqs.len(), &self.device)?;
        let h = self.final_norm(&x.squeeze(0)?.index_select(&last, 0)?)?;
        let logits = h.matmul(&self.head_weight()?.t()?)?;
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
        super::sampling::check_generation("Decoder", prompt, self.config.vocab_size, temperature)?;
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
            let id = super::sampling::sample(&last, temperature, 1.0, &mut rng)?;
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
            for p in b.projs() {
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
                    bias: p.bias.iter().map(&base).collect::<Result<_>>()?,
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
            let norms = b.norms.map(base)?;
            blocks.push(Arc::new(Block {
                norms,
                qkv,
                o,
                gate_up,
                down,
                spec: b.spec,
            }));
        }
        Ok(Decoder {
            config: self.config.clone(),
            autocast: self.autocast,
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
            rope_positions: std::sync::Mutex::new(None),
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
/// compute dtype, `S` every position for a full-attention block and the last `W - 1` for a
/// sliding window of `W` keys (the ones a later query sees: the cache stays bounded). Start with `KvCache::default()`; one cache per sequence batch. Drop it (or
/// [`KvCache::clear`]) when the weights change: its keys came from the old ones.
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<Mutex<Option<(Tensor, Tensor)>>>,
    len: usize,
    batch: usize,
}

impl Clone for KvCache {
    fn clone(&self) -> Self {
        let layers = self
            .layers
            .iter()
            .map(|l| Mutex::new(l.lock().unwrap_or_else(|e| e.into_inner()).clone()));
        Self {
            layers: layers.collect(),
            len: self.len,
            batch: self.batch,
        }
    }
}

impl KvCache {
    /// Positions seen (the absolute position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Positions each block holds ([`Self::len`], or at most `W - 1` for a block with a
    /// sliding window of `W` keys); empty before the first forward.
    pub fn block_positions(&self) -> Vec<usize> {
        self.layers
            .iter()
            .map(|l| {
                let kv = l.lock().unwrap_or_else(|e| e.into_inner());
                kv.as_ref()
                    .map_or(0, |(k, _)| k.dims().get(2).copied().unwrap_or(0))
            })
            .collect()
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

/// One sequence of a [`Decoder::forward_paged`] batch: its new token ids at positions
/// `start..start + ids.len()`, and the table of its blocks in the cache (with room for them).
#[derive(Debug, Clone, Copy)]
pub struct PagedBatchEntry<'a> {
    /// The new ids (a prefill chunk, or the last sampled token).
    pub ids: &'a [u32],
    /// Positions already in the cache.
    pub start: usize,
    /// The sequence's blocks.
    pub table: &'a BlockTable,
}
