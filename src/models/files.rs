//! Pretrained decoder weights in and out, every family ([`Family`]): GGUF files (llama.cpp's
//! format, through candle-core's `quantized::gguf_file`, every tensor dequantized to f32) and
//! HF folders (`config.json` plus one or sharded `*.safetensors`, transformers' names), both
//! into [`DecoderWeights`]; [`save_pretrained`] writes an HF folder that transformers and
//! candle-transformers load as the family's model.
//!
//! GGUF differs from HF in up to three ways, all undone here: metadata keys
//! (`{arch}.embedding_length`, ...: [`Gguf::config`]), tensor names (`blk.3.attn_q.weight` is
//! `model.layers.3.self_attn.q_proj.weight`: [`hf_name_of`]), and two value transforms of
//! llama.cpp's converter (`convert_hf_to_gguf.py`): for Llama (and Mistral) the rows of
//! `attn_q` / `attn_k`, reordered per head (`LlamaModel.permute`) from the `rotate_half`
//! pairing `(i, i + D/2)` to the interleaved pairing `(2i, 2i + 1)` its RoPE kernel uses
//! ([`unpermute_rotary_rows`]; Qwen and Gemma files are not permuted), and for Gemma 3 every
//! RMSNorm gain stored as `1 + w` (`Gemma3Model.modify_tensors`).

use super::config::{DecoderConfig, RopeScaling, TokenIds, EMBED, FINAL_NORM, HEAD};
use super::decoder::DecoderWeights;
use super::family::{self, Activation, Family, LayerType};
use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// An opened GGUF file: its metadata and tensor directory (no tensor data read yet).
pub struct Gguf {
    /// The parsed header.
    pub content: gguf_file::Content,
    file: std::fs::File,
    path: std::path::PathBuf,
}

impl Gguf {
    /// Opens `path` and reads its header.
    ///
    /// Errors: an unreadable file or one that is not GGUF.
    pub fn open(path: &Path) -> Result<Self> {
        let mut file = std::fs::File::open(path)
            .with_context(|| format!("opening the GGUF file {}", path.display()))?;
        let content = gguf_file::Content::read(&mut file)
            .with_context(|| format!("{} is not a readable GGUF file", path.display()))?;
        Ok(Self {
            content,
            file,
            path: path.to_path_buf(),
        })
    }

    /// The file's path, as opened.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata value, or an error naming the key.
    pub fn meta(&self, key: &str) -> Result<&gguf_file::Value> {
        self.content
            .metadata
            .get(key)
            .with_context(|| format!("{}: metadata key {key:?} is missing", self.path.display()))
    }

    fn meta_usize(&self, key: &str) -> Result<usize> {
        Ok(self
            .meta(key)?
            .to_u32()
            .with_context(|| format!("{}: {key}", self.path.display()))? as usize)
    }

    /// The model's [`DecoderConfig`] from the `{arch}.*` metadata of `general.architecture`
    /// (`llama`, `qwen2`, `qwen3`, `gemma3`: [`Family::from_gguf_architecture`]); the head is
    /// tied when the file has no `output.weight`.
    ///
    /// - `{arch}.attention.key_length` is the head width (`head_dim` when it is not
    ///   `embedding_length / head_count`: Qwen3, Gemma 3); `value_length` must equal it.
    /// - `llama.attention.sliding_window` below the context is Mistral's window
    ///   (llama.cpp writes Mistral's dense models as `llama`): model_type `mistral`.
    /// - Gemma 3, as llama.cpp's `llama-model.cpp` (`LLM_ARCH_GEMMA3`) reads it: the window
    ///   `gemma3.attention.sliding_window`; layer `i` slides unless `(i + 1) % 6 == 0` (the
    ///   pattern 6 is fixed there; `gemma3.attention.sliding_window_type`, which candle's
    ///   `quantized_gemma3` reads, or `..._pattern` override it); the sliding layers' RoPE base
    ///   `gemma3.rope.local_freq_base`, else 10000 (`rope_freq_base_train_swa`); the score
    ///   scale `1/√head_dim` except for the 27B (62 blocks), where llama.cpp (after
    ///   gemma_pytorch's config.py) uses `1/√(embedding_length / head_count)`: written as
    ///   `query_pre_attn_scalar`.
    /// - RoPE scaling as llama.cpp applies it: a linear factor from `{arch}.rope.scaling.factor`
    ///   (or the older `{arch}.rope.scale_linear`) unless `{arch}.rope.scaling.type` is `none`
    ///   (then the factor is ignored, as llama.cpp ignores it), and Llama 3's scaling from the
    ///   `rope_freqs.weight` tensor ([`RopeScaling::Llama3`]).
    ///
    /// Every other `{arch}.*` key may change the computation and is refused
    /// ([`gguf_architecture_keys`] lists those read).
    ///
    /// Errors: another architecture, a missing or mistyped key (named), an `{arch}.*` key wick
    /// does not implement (named, with its value and the file; soft-capping named as such), a
    /// RoPE scaling type other than `none` / `linear`, a rotary width other than the head
    /// width, `value_length != key_length`, `rope_freqs.weight` factors that are not Llama 3's
    /// scaling.
    pub fn config(&self) -> Result<DecoderConfig> {
        let arch = self.meta("general.architecture")?.to_string()?.clone();
        let family = Family::from_gguf_architecture(&arch)
            .with_context(|| self.path.display().to_string())?;
        let known = gguf_architecture_keys(family);
        let prefix = format!("{arch}.");
        let mut keys: Vec<&String> = self.content.metadata.keys().collect();
        keys.sort();
        if let Some(k) = keys
            .into_iter()
            .find(|k| k.starts_with(&prefix) && !known.contains(k))
        {
            let what = if k.ends_with("logit_softcapping") {
                "is logit soft-capping (Gemma 2's), which wick's decoder does not implement"
            } else {
                "is not implemented by wick's decoder (it may change the computation: \
                 soft-capping, experts, ALiBi, YaRN, ...)"
            };
            bail!(
                "{}: metadata key {k:?} = {:?} {what}, so the file is refused rather than \
                 loaded without it",
                self.path.display(),
                self.content.metadata[k]
            );
        }
        let key = |s: &str| format!("{arch}.{s}");
        let get = |s: &str| self.content.metadata.get(&key(s));
        // a mistyped value's error names the file and the key
        let at = |s: &str| format!("{}: {}", self.path.display(), key(s));
        let heads = self.meta_usize(&key("attention.head_count"))?;
        let hidden = self.meta_usize(&key("embedding_length"))?;
        let vocab = match get("vocab_size") {
            Some(v) => v.to_u32().with_context(|| at("vocab_size"))? as usize,
            None => match self.content.tensor_infos.get("token_embd.weight") {
                Some(t) => *t.shape.dims().first().with_context(|| {
                    format!(
                        "{}: token_embd.weight is a scalar; the token table is (vocab, hidden)",
                        self.path.display()
                    )
                })?,
                None => self.meta("tokenizer.ggml.tokens")?.to_vec()?.len(),
            },
        };
        let opt_u32 = |k: &str| self.content.metadata.get(k).and_then(|v| v.to_u32().ok());
        let opt_usize = |s: &str| -> Result<Option<usize>> {
            get(s)
                .map(|v| Ok(v.to_u32().with_context(|| at(s))? as usize))
                .transpose()
        };
        let plain = hidden.checked_div(heads).unwrap_or(0);
        let key_length = opt_usize("attention.key_length")?;
        if let Some(v) = opt_usize("attention.value_length")? {
            let k = key_length.unwrap_or(plain);
            if v != k {
                bail!(
                    "{}: {} = {v} differs from the key width {} = {k}; wick's decoder attends \
                     with values as wide as keys",
                    self.path.display(),
                    key("attention.value_length"),
                    key("attention.key_length")
                );
            }
        }
        let head_dim = key_length.filter(|&k| k != plain || hidden % heads.max(1) != 0);
        let context = self.meta_usize(&key("context_length"))?;
        let layers = self.meta_usize(&key("block_count"))?;
        let window = opt_usize("attention.sliding_window")?;
        let mut config = DecoderConfig {
            model_type: family,
            head_dim,
            sliding_window: None,
            layer_types: None,
            rope_local_base_freq: None,
            query_pre_attn_scalar: None,
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: self.meta_usize(&key("feed_forward_length"))?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: match get("attention.head_count_kv") {
                Some(v) => v.to_u32().with_context(|| at("attention.head_count_kv"))? as usize,
                None => heads,
            },
            rms_norm_eps: self
                .meta(&key("attention.layer_norm_rms_epsilon"))?
                .to_f32()
                .with_context(|| at("attention.layer_norm_rms_epsilon"))?
                as f64,
            rope_theta: match get("rope.freq_base") {
                Some(v) => v.to_f32().with_context(|| at("rope.freq_base"))? as f64,
                None => 10000.0,
            },
            rope_scaling: None,
            max_position_embeddings: context,
            tie_word_embeddings: !self.content.tensor_infos.contains_key("output.weight"),
            bos_token_id: opt_u32("tokenizer.ggml.bos_token_id"),
            eos_token_id: opt_u32("tokenizer.ggml.eos_token_id").map(TokenIds::One),
            other: serde_json::Map::new(),
        };
        match family {
            Family::Llama => {
                // Mistral 7B v0.1's window, as llama.cpp's converter writes it
                if let Some(w) = window.filter(|&w| w < context) {
                    config.model_type = Family::Mistral;
                    config.sliding_window = Some(w);
                }
            }
            Family::Gemma3 => {
                let w = window.with_context(|| {
                    format!(
                        "{}: metadata key {:?} is missing (Gemma 3's sliding window)",
                        self.path.display(),
                        key("attention.sliding_window")
                    )
                })?;
                let mut pattern = 6;
                for s in [
                    "attention.sliding_window_type",
                    "attention.sliding_window_pattern",
                ] {
                    if let Some(p) = get(s) {
                        pattern = p.to_u32().with_context(|| {
                            format!(
                                "{}: {} = {p:?} is not a layer period (u32); per-layer \
                                 patterns are not implemented",
                                self.path.display(),
                                key(s)
                            )
                        })? as usize;
                        if pattern == 0 {
                            bail!("{}: {} is 0", self.path.display(), key(s));
                        }
                    }
                }
                config.sliding_window = Some(w);
                config.layer_types = Some(
                    (0..layers)
                        .map(|i| {
                            if (i + 1) % pattern == 0 {
                                LayerType::Full
                            } else {
                                LayerType::Sliding
                            }
                        })
                        .collect(),
                );
                config.rope_local_base_freq = Some(match get("rope.local_freq_base") {
                    Some(v) => v.to_f32().with_context(|| at("rope.local_freq_base"))? as f64,
                    None => 10000.0,
                });
                // llama-model.cpp, LLM_ARCH_GEMMA3: f_attention_scale = type == LLM_TYPE_27B
                // (n_layer 62) ? 1/sqrt(n_embd / n_head) : 1/sqrt(n_embd_head_k)
                config.query_pre_attn_scalar = Some(if layers == 62 {
                    (hidden / heads.max(1)) as f64
                } else {
                    config.head_dim() as f64
                });
            }
            Family::Qwen2 | Family::Qwen3 | Family::Mistral => {}
        }
        config
            .validate()
            .with_context(|| format!("the config in {}", self.path.display()))?;
        config.rope_scaling = self
            .rope_scaling(&config, &arch)
            .with_context(|| format!("the RoPE of {}", self.path.display()))?;
        Ok(config)
    }

    /// The checks of the `{arch}.*` keys beyond the sizes, and the RoPE scaling.
    fn rope_scaling(&self, config: &DecoderConfig, arch: &str) -> Result<Option<RopeScaling>> {
        let d = config.head_dim();
        let key = |s: &str| format!("{arch}.{s}");
        let get = |s: &str| self.content.metadata.get(&key(s));
        if let Some(v) = get("rope.dimension_count") {
            let k = key("rope.dimension_count");
            let n = v.to_u32().with_context(|| k.clone())? as usize;
            if n != d {
                bail!(
                    "{k} = {n} differs from the head width {d}; wick's decoder rotates whole \
                     heads (partial rotary embeddings are not implemented)"
                );
            }
        }
        for s in ["expert_count", "expert_used_count"] {
            if let Some(n) = get(s) {
                if n.to_u32().with_context(|| key(s))? != 0 {
                    bail!(
                        "{} = {n:?}: mixture-of-experts models are not implemented",
                        key(s)
                    );
                }
            }
        }
        // llama.cpp (llama-model.cpp `load_hparams`, llama-context.cpp): the type defaults to
        // "linear"; the factor is `{arch}.rope.scaling.factor`, else the older
        // `{arch}.rope.scale_linear`; type "none" never scales, whatever the factor
        let kind = match get("rope.scaling.type") {
            Some(v) => v
                .to_string()
                .with_context(|| key("rope.scaling.type"))?
                .as_str(),
            None => "linear",
        };
        if kind != "none" && kind != "linear" {
            bail!(
                "{} = {kind:?} is not implemented: wick implements \"none\", \"linear\" and \
                 Llama 3's rope_freqs.weight factors",
                key("rope.scaling.type")
            );
        }
        let mut factor = None;
        for s in ["rope.scaling.factor", "rope.scale_linear"] {
            if let (None, Some(v)) = (factor, get(s)) {
                factor = Some(v.to_f32().with_context(|| key(s))? as f64);
            }
        }
        if kind == "none" {
            factor = None;
        }
        let linear = match factor {
            Some(f) if f != 0.0 && f != 1.0 => {
                if !(f.is_finite() && f > 0.0) {
                    bail!("the linear RoPE scaling factor {f} must be a finite number > 0");
                }
                Some(RopeScaling::Linear { factor: f })
            }
            _ => None,
        };
        if !self.content.tensor_infos.contains_key(ROPE_FREQS) {
            return Ok(linear);
        }
        if linear.is_some() {
            bail!("both a linear RoPE factor and {ROPE_FREQS}: the combination is not implemented");
        }
        let mut reader = &self.file;
        let ff: Vec<f32> = self
            .content
            .tensor(&mut reader, ROPE_FREQS, &Device::Cpu)
            .with_context(|| format!("reading {ROPE_FREQS}"))?
            .dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1()?;
        if ff.len() != d / 2 {
            bail!(
                "{ROPE_FREQS} has {} factors; the head width {d} needs {}",
                ff.len(),
                d / 2
            );
        }
        // convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors) writes 1 / (the llama3
        // scale) per frequency, with low_freq_factor 1, high_freq_factor 4 and original context
        // 8192 unless the config says otherwise: recognise those parameters
        let original = match get("rope.scaling.original_context_length") {
            Some(v) => v.to_u32().with_context(|| {
                format!(
                    "{}: {}",
                    self.path.display(),
                    key("rope.scaling.original_context_length")
                )
            })? as usize,
            None => 8192,
        };
        let llama3 = RopeScaling::Llama3 {
            factor: *ff.last().unwrap_or(&1.0) as f64,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: original,
        };
        let plain = DecoderConfig {
            rope_scaling: None,
            ..config.clone()
        }
        .rope_inv_freq();
        let scaled = llama3.apply(&plain);
        let matches = ff
            .iter()
            .zip(plain.iter().zip(&scaled))
            .all(|(&f, (p, s))| {
                let want = p / s;
                (f as f64 - want).abs() <= 1e-5 * want
            });
        if !matches {
            bail!(
                "{ROPE_FREQS} {ff:?} is not Llama 3's RoPE scaling ({llama3:?}, as llama.cpp's \
                 converter writes it); other per-frequency factors are not implemented"
            );
        }
        Ok(Some(llama3))
    }

    /// Every tensor, dequantized to f32 on the CPU (`(out, in)` for linears), by HF name
    /// ([`hf_name_of`]), with the q/k rows put back in HF order where llama.cpp permuted them
    /// ([`family::Switches::gguf_permuted_qk`]: Llama, Mistral) and the `1 + w` gains of llama.cpp's
    /// Gemma converters put back to `w` ([`family::Switches::gguf_norm_plus_one`]: every
    /// `*norm.weight`, the final and q/k norms included; candle-transformers'
    /// `quantized_gemma3` applies the stored gain as is, which confirms the file holds `1 + w`).
    ///
    /// Errors: a tensor name the family does not have (named), unreadable data, or weights
    /// that do not fit the config ([`DecoderWeights::check`]).
    pub fn weights(&mut self) -> Result<DecoderWeights> {
        let config = self.config()?;
        let family = config.model_type;
        let switches = family.switches();
        let mut names: Vec<String> = self.content.tensor_infos.keys().cloned().collect();
        names.sort();
        let mut tensors = HashMap::new();
        for name in names {
            if name == ROPE_FREQS {
                continue; // read by config(): Llama 3's RoPE scaling
            }
            let hf = hf_name_of(family, &name).with_context(|| {
                format!(
                    "{}: tensor {name:?} is not part of a {} model as wick implements it",
                    self.path.display(),
                    family.model_type()
                )
            })?;
            let q = self
                .content
                .tensor(&mut self.file, &name, &Device::Cpu)
                .with_context(|| format!("reading {name} from {}", self.path.display()))?;
            let mut t = q
                .dequantize(&Device::Cpu)
                .with_context(|| format!("dequantizing {name}"))?
                .to_dtype(DType::F32)?;
            if switches.gguf_permuted_qk {
                if hf.ends_with("self_attn.q_proj.weight") {
                    t = unpermute_rotary_rows(&t, config.num_attention_heads)?;
                } else if hf.ends_with("self_attn.k_proj.weight") {
                    t = unpermute_rotary_rows(&t, config.num_key_value_heads)?;
                }
            }
            if switches.gguf_norm_plus_one && name.ends_with("norm.weight") {
                t = (t - 1.0)?;
            }
            tensors.insert(hf, t);
        }
        let w = DecoderWeights { config, tensors };
        w.check()
            .with_context(|| format!("the tensors of {}", self.path.display()))?;
        Ok(w)
    }
}

/// llama.cpp's tensor of per-frequency RoPE divisors (Llama 3.1's scaling).
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// The `{arch}.*` key suffixes [`Gguf::config`] reads or checks for every architecture.
const GGUF_COMMON_KEYS: &[&str] = &[
    "vocab_size",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "block_count",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "attention.key_length",
    "attention.value_length",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scale_linear",
    "rope.scaling.original_context_length",
    "rope.scaling.finetuned",
    "expert_count",
    "expert_used_count",
];

/// The `{arch}.*` GGUF metadata keys [`Gguf::config`] reads or checks for `family`'s GGUF
/// architecture ([`Family::gguf_architecture`]); a file with any other key of its prefix is
/// refused (it may change the computation). Beyond the common ones: `llama` reads
/// `attention.sliding_window` (Mistral), `gemma3` the window, its layer period
/// (`attention.sliding_window_type` / `_pattern`) and `rope.local_freq_base`.
pub fn gguf_architecture_keys(family: Family) -> Vec<String> {
    let arch = family.gguf_architecture();
    let extra: &[&str] = match family {
        Family::Llama | Family::Mistral => &["attention.sliding_window"],
        Family::Gemma3 => &[
            "attention.sliding_window",
            "attention.sliding_window_type",
            "attention.sliding_window_pattern",
            "rope.local_freq_base",
        ],
        Family::Qwen2 | Family::Qwen3 => &[],
    };
    GGUF_COMMON_KEYS
        .iter()
        .chain(extra)
        .map(|s| format!("{arch}.{s}"))
        .collect()
}

/// Reads a GGUF file's config and weights ([`Gguf::weights`]).
pub fn read_gguf(path: &Path) -> Result<DecoderWeights> {
    Gguf::open(path)?.weights()
}

/// The HF name of a GGUF tensor of `family` (`token_embd`, `output_norm`, `output` and the
/// block tensors of [`family::hf_block_suffix`]), `None` for one the family does not have.
pub fn hf_name_of(family: Family, gguf: &str) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some(EMBED.into()),
        "output_norm.weight" => return Some(FINAL_NORM.into()),
        "output.weight" => return Some(HEAD.into()),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let layer: usize = layer.parse().ok()?;
    let hf = family::hf_block_suffix(family, part)?;
    Some(format!("model.layers.{layer}.{hf}"))
}

/// The HF name of a GGUF tensor of a llama model, `None` for an unknown one
/// ([`hf_name_of`] of [`Family::Llama`]).
pub fn hf_name(gguf: &str) -> Option<String> {
    hf_name_of(Family::Llama, gguf)
}

/// Undoes llama.cpp's q/k row permutation: GGUF row `2i + h` of a head (interleaved pairs) is
/// HF row `h * D/2 + i` (`rotate_half` pairs). `w: (n_heads * D, in)`; returns the same shape.
///
/// Errors: rows not a multiple of `2 * n_heads`.
pub fn unpermute_rotary_rows(w: &Tensor, n_heads: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    if n_heads == 0 || rows % (2 * n_heads) != 0 {
        bail!("unpermute_rotary_rows: {rows} rows do not split into {n_heads} heads of pairs");
    }
    let half = rows / n_heads / 2;
    Ok(w.reshape((n_heads, half, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))?)
}

/// llama.cpp's permutation (the inverse of [`unpermute_rotary_rows`]): HF row `h * D/2 + i`
/// goes to row `2i + h` of its head.
///
/// Errors: rows not a multiple of `2 * n_heads`.
pub fn permute_rotary_rows(w: &Tensor, n_heads: usize) -> Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    if n_heads == 0 || rows % (2 * n_heads) != 0 {
        bail!("permute_rotary_rows: {rows} rows do not split into {n_heads} heads of pairs");
    }
    let half = rows / n_heads / 2;
    Ok(w.reshape((n_heads, 2, half, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))?)
}

/// Reads an HF folder: `dir/config.json` and its safetensors, tensors cast to f32 on the
/// CPU. With `model.safetensors.index.json` exactly the shards its `weight_map` names are
/// read, and every tensor of the map must be found in the shard it names; without it every
/// `dir/*.safetensors`. Known non-parameter buffers (`*.rotary_emb.inv_freq`) are skipped;
/// with a tied config an `lm_head.weight` equal to the table is dropped.
///
/// Errors: a missing or invalid config, no safetensors file, an unreadable or malformed
/// index, tensors of the index missing from their shards (named), a multimodal checkpoint
/// (`language_model.` names: Gemma 3's `Gemma3ForConditionalGeneration`), unreadable files,
/// weights that do not fit the config (every problem named).
pub fn read_safetensors(dir: &Path) -> Result<DecoderWeights> {
    let config = DecoderConfig::from_json_file(&dir.join("config.json"))?;
    let index_path = dir.join("model.safetensors.index.json");
    let index: Option<HashMap<String, String>> = if index_path.exists() {
        let text = std::fs::read_to_string(&index_path)
            .with_context(|| format!("reading {}", index_path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {}", index_path.display()))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{} has no \"weight_map\" object", index_path.display()))?;
        let mut out = HashMap::new();
        for (name, file) in map {
            let file = file.as_str().with_context(|| {
                format!(
                    "{}: weight_map[{name:?}] = {file} is not a file name",
                    index_path.display()
                )
            })?;
            if file.contains('/') || file.contains('\\') || file == ".." {
                bail!(
                    "{}: weight_map[{name:?}] = {file:?} is not a file of the folder",
                    index_path.display()
                );
            }
            out.insert(name.clone(), file.to_string());
        }
        Some(out)
    } else {
        None
    };
    let mut files: Vec<std::path::PathBuf> = match &index {
        Some(map) => {
            let mut names: Vec<&String> = map.values().collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        }
        None => std::fs::read_dir(dir)
            .with_context(|| format!("listing {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect(),
    };
    files.sort();
    if files.is_empty() {
        bail!("{} holds no *.safetensors file", dir.display());
    }
    let mut tensors = HashMap::new();
    let mut found: HashMap<String, String> = HashMap::new();
    for f in &files {
        let file_name = f
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        for (name, t) in candle_core::safetensors::load(f, &Device::Cpu)
            .with_context(|| format!("reading {}", f.display()))?
        {
            found.insert(name.clone(), file_name.clone());
            if name.starts_with("language_model.") || name.starts_with("model.language_model.") {
                bail!(
                    "{}: tensor {name:?} is a multimodal checkpoint's (Gemma 3's \
                     Gemma3ForConditionalGeneration); wick's decoder reads the text model's \
                     names (Gemma3ForCausalLM: model.embed_tokens.weight, ...): extract the \
                     language model first",
                    f.display()
                );
            }
            if name.ends_with("rotary_emb.inv_freq") {
                continue;
            }
            let t = t
                .to_dtype(DType::F32)
                .with_context(|| format!("{}: casting {name} to f32", f.display()))?;
            tensors.insert(name, t);
        }
    }
    if let Some(map) = &index {
        let mut missing: Vec<String> = map
            .iter()
            .filter(|(name, file)| found.get(*name) != Some(*file))
            .map(|(name, file)| format!("{name} (in {file})"))
            .collect();
        if !missing.is_empty() {
            missing.sort();
            bail!(
                "{}: {} tensor(s) of the weight_map are not in the shard it names: {}",
                index_path.display(),
                missing.len(),
                missing.join(", ")
            );
        }
    }
    if config.tie_word_embeddings {
        if let (Some(head), Some(embed)) = (tensors.get(HEAD), tensors.get(EMBED)) {
            let same = head.dims() == embed.dims()
                && (head - embed)?.abs()?.max_all()?.to_scalar::<f32>()? == 0.0;
            if same {
                tensors.remove(HEAD);
            }
        }
    }
    let w = DecoderWeights { config, tensors };
    w.check()
        .with_context(|| format!("the checkpoint in {}", dir.display()))?;
    Ok(w)
}

/// Writes `weights` as an HF folder: `dir/model.safetensors` (f32, transformers' names) and
/// `dir/config.json` (the family's `model_type` and `architectures`, its activation as
/// `hidden_act: "silu"` or Gemma's `hidden_activation: "gelu_pytorch_tanh"`, and
/// `attention_bias`), each atomically.
///
/// Errors: weights that do not fit their config, an I/O failure (naming the file).
pub fn save_pretrained(weights: &DecoderWeights, dir: &Path) -> Result<()> {
    weights.check()?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut tensors: Vec<(String, Tensor)> = weights
        .tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.to_dtype(DType::F32)?)))
        .collect::<Result<_>>()?;
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    crate::checkpoint::save_safetensors_atomic(&dir.join("model.safetensors"), tensors)?;
    let mut json = serde_json::to_value(&weights.config)?;
    if let Some(m) = json.as_object_mut() {
        let family = weights.config.model_type;
        m.insert("model_type".into(), family.model_type().into());
        m.insert(
            "architectures".into(),
            serde_json::json!([family.architecture()]),
        );
        match family.switches().activation {
            Activation::SwiGlu => {
                m.insert("hidden_act".into(), "silu".into());
            }
            Activation::GeGluTanh => {
                m.remove("hidden_act");
                m.insert("hidden_activation".into(), "gelu_pytorch_tanh".into());
            }
        }
        m.entry("attention_bias")
            .or_insert(family.switches().qkv_bias.into());
        m.entry("torch_dtype").or_insert("float32".into());
    }
    crate::checkpoint::write_file_atomic(
        &dir.join("config.json"),
        serde_json::to_string_pretty(&json)?.as_bytes(),
    )
}
