//! Pretrained Llama weights in and out: GGUF files (llama.cpp's format, through candle-core's
//! `quantized::gguf_file`, every tensor dequantized to f32) and HF folders (`config.json` plus
//! `*.safetensors`, transformers' names), both into [`DecoderWeights`]; [`save_pretrained`]
//! writes an HF folder that transformers' and candle-transformers' `llama` load.
//!
//! GGUF differs from HF in two ways, both undone here: tensor names (`blk.3.attn_q.weight` is
//! `model.layers.3.self_attn.q_proj.weight`), and the rows of `attn_q` / `attn_k`, which
//! llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) reorders per head
//! from the `rotate_half` pairing `(i, i + D/2)` to the interleaved pairing `(2i, 2i + 1)` its
//! RoPE kernel uses ([`unpermute_rotary_rows`]).

use super::config::{DecoderConfig, RopeScaling, TokenIds, EMBED, FINAL_NORM, HEAD};
use super::decoder::DecoderWeights;
use super::family::Family;
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
        Ok(self.meta(key)?.to_u32().with_context(|| key.to_string())? as usize)
    }

    /// The model's [`DecoderConfig`] from the `llama.*` metadata (`general.architecture` must be
    /// `llama`); the head is tied when the file has no `output.weight`. RoPE scaling is read
    /// as llama.cpp applies it: a linear factor from `llama.rope.scaling.factor` (or the older
    /// `llama.rope.scale_linear`) unless `llama.rope.scaling.type` is `none` (then the factor
    /// is ignored, as llama.cpp ignores it), and Llama 3's scaling from the `rope_freqs.weight`
    /// tensor ([`RopeScaling::Llama3`]). Every other `llama.*` key that changes the computation is
    /// refused ([`GGUF_LLAMA_KEYS`] lists those read).
    ///
    /// Errors: another architecture, a missing or mistyped key (named), a `llama.*` key wick
    /// does not implement (named, with its value), a RoPE scaling type other than `none` /
    /// `linear`, a sliding window shorter than the context, `rope_freqs.weight` factors that
    /// are not Llama 3's scaling.
    pub fn config(&self) -> Result<DecoderConfig> {
        let arch = self.meta("general.architecture")?.to_string()?;
        if arch != "llama" {
            bail!(
                "{}: architecture {arch:?}; wick's Llama reads \"llama\" GGUF files",
                self.path.display()
            );
        }
        let mut keys: Vec<&String> = self.content.metadata.keys().collect();
        keys.sort();
        if let Some(k) = keys
            .into_iter()
            .find(|k| k.starts_with("llama.") && !GGUF_LLAMA_KEYS.contains(&k.as_str()))
        {
            bail!(
                "{}: metadata key {k:?} = {:?} is not implemented by wick's Llama (it may change \
                 the computation: soft-capping, experts, ALiBi, YaRN, ...), so the file is \
                 refused rather than loaded without it",
                self.path.display(),
                self.content.metadata[k]
            );
        }
        let heads = self.meta_usize("llama.attention.head_count")?;
        let vocab = match self.content.metadata.get("llama.vocab_size") {
            Some(v) => v.to_u32()? as usize,
            None => self.meta("tokenizer.ggml.tokens")?.to_vec()?.len(),
        };
        let opt_u32 = |k: &str| self.content.metadata.get(k).and_then(|v| v.to_u32().ok());
        let mut config = DecoderConfig {
            model_type: Family::Llama,
            head_dim: None,
            sliding_window: None,
            layer_types: None,
            rope_local_base_freq: None,
            query_pre_attn_scalar: None,
            vocab_size: vocab,
            hidden_size: self.meta_usize("llama.embedding_length")?,
            intermediate_size: self.meta_usize("llama.feed_forward_length")?,
            num_hidden_layers: self.meta_usize("llama.block_count")?,
            num_attention_heads: heads,
            num_key_value_heads: match self.content.metadata.get("llama.attention.head_count_kv") {
                Some(v) => v.to_u32()? as usize,
                None => heads,
            },
            rms_norm_eps: self
                .meta("llama.attention.layer_norm_rms_epsilon")?
                .to_f32()? as f64,
            rope_theta: match self.content.metadata.get("llama.rope.freq_base") {
                Some(v) => v.to_f32()? as f64,
                None => 10000.0,
            },
            rope_scaling: None,
            max_position_embeddings: self.meta_usize("llama.context_length")?,
            tie_word_embeddings: !self.content.tensor_infos.contains_key("output.weight"),
            bos_token_id: opt_u32("tokenizer.ggml.bos_token_id"),
            eos_token_id: opt_u32("tokenizer.ggml.eos_token_id").map(TokenIds::One),
            other: serde_json::Map::new(),
        };
        config
            .validate()
            .with_context(|| format!("the config in {}", self.path.display()))?;
        config.rope_scaling = self
            .rope_scaling(&config)
            .with_context(|| format!("the RoPE of {}", self.path.display()))?;
        Ok(config)
    }

    /// The checks of the `llama.*` keys beyond the sizes, and the RoPE scaling.
    fn rope_scaling(&self, config: &DecoderConfig) -> Result<Option<RopeScaling>> {
        let d = config.head_dim();
        let get = |k: &str| self.content.metadata.get(k);
        for k in [
            "llama.rope.dimension_count",
            "llama.attention.key_length",
            "llama.attention.value_length",
        ] {
            if let Some(v) = get(k) {
                let n = v.to_u32().with_context(|| k.to_string())? as usize;
                if n != d {
                    bail!(
                        "{k} = {n} differs from the head width embedding_length / head_count = \
                         {d}; wick's Llama rotates and attends over whole heads of that width"
                    );
                }
            }
        }
        if let Some(v) = get("llama.attention.sliding_window") {
            let w = v.to_u32().context("llama.attention.sliding_window")? as usize;
            if w < config.max_position_embeddings {
                bail!(
                    "llama.attention.sliding_window = {w} is below the context length {}: wick \
                     has no sliding-window attention yet",
                    config.max_position_embeddings
                );
            }
        }
        for k in ["llama.expert_count", "llama.expert_used_count"] {
            if let Some(n) = get(k) {
                if n.to_u32().with_context(|| k.to_string())? != 0 {
                    bail!("{k} = {n:?}: mixture-of-experts models are not implemented");
                }
            }
        }
        // llama.cpp (llama-model.cpp `load_hparams`, llama-context.cpp): the type defaults to
        // "linear"; the factor is `llama.rope.scaling.factor`, else the older
        // `llama.rope.scale_linear`; type "none" never scales, whatever the factor
        let kind = match get("llama.rope.scaling.type") {
            Some(v) => v.to_string().context("llama.rope.scaling.type")?.as_str(),
            None => "linear",
        };
        if kind != "none" && kind != "linear" {
            bail!(
                "llama.rope.scaling.type = {kind:?} is not implemented: wick implements \
                 \"none\", \"linear\" and Llama 3's rope_freqs.weight factors"
            );
        }
        let mut factor = None;
        for k in ["llama.rope.scaling.factor", "llama.rope.scale_linear"] {
            if let (None, Some(v)) = (factor, get(k)) {
                factor = Some(v.to_f32().with_context(|| k.to_string())? as f64);
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
        let original = match get("llama.rope.scaling.original_context_length") {
            Some(v) => v.to_u32()? as usize,
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

    /// Every tensor, dequantized to f32 on the CPU (`(out, in)` for linears), by HF name, with
    /// the q/k rows put back in HF order.
    ///
    /// Errors: a tensor name wick does not know (named), unreadable data, or weights that do
    /// not fit the config ([`DecoderWeights::check`]).
    pub fn weights(&mut self) -> Result<DecoderWeights> {
        let config = self.config()?;
        let mut names: Vec<String> = self.content.tensor_infos.keys().cloned().collect();
        names.sort();
        let mut tensors = HashMap::new();
        for name in names {
            if name == ROPE_FREQS {
                continue; // read by config(): Llama 3's RoPE scaling
            }
            let hf = hf_name(&name).with_context(|| {
                format!(
                    "{}: tensor {name:?} is not part of a Llama model",
                    self.path.display()
                )
            })?;
            let q = self
                .content
                .tensor(&mut self.file, &name, &Device::Cpu)
                .with_context(|| format!("reading {name} from {}", self.path.display()))?;
            let mut t = q
                .dequantize(&Device::Cpu)
                .with_context(|| format!("dequantizing {name}"))?;
            if hf.ends_with("self_attn.q_proj.weight") {
                t = unpermute_rotary_rows(&t, config.num_attention_heads)?;
            } else if hf.ends_with("self_attn.k_proj.weight") {
                t = unpermute_rotary_rows(&t, config.num_key_value_heads)?;
            }
            tensors.insert(hf, t.to_dtype(DType::F32)?);
        }
        let w = DecoderWeights { config, tensors };
        w.check()
            .with_context(|| format!("the tensors of {}", self.path.display()))?;
        Ok(w)
    }
}

/// llama.cpp's tensor of per-frequency RoPE divisors (Llama 3.1's scaling).
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// The `llama.*` GGUF metadata keys [`Gguf::config`] reads or checks; a file with any other
/// `llama.*` key is refused (it may change the computation).
pub const GGUF_LLAMA_KEYS: &[&str] = &[
    "llama.vocab_size",
    "llama.context_length",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.block_count",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.attention.key_length",
    "llama.attention.value_length",
    "llama.attention.sliding_window",
    "llama.rope.freq_base",
    "llama.rope.dimension_count",
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
    "llama.rope.scale_linear",
    "llama.rope.scaling.original_context_length",
    "llama.rope.scaling.finetuned",
    "llama.expert_count",
    "llama.expert_used_count",
];

/// Reads a GGUF file's config and weights ([`Gguf::weights`]).
pub fn read_gguf(path: &Path) -> Result<DecoderWeights> {
    Gguf::open(path)?.weights()
}

/// The HF name of a GGUF tensor of a llama model, `None` for an unknown one.
pub fn hf_name(gguf: &str) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some(EMBED.into()),
        "output_norm.weight" => return Some(FINAL_NORM.into()),
        "output.weight" => return Some(HEAD.into()),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let hf = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
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

/// Reads an HF folder: `dir/config.json` and every `dir/*.safetensors` (sharded checkpoints
/// included), tensors cast to f32 on the CPU. Known non-parameter buffers
/// (`*.rotary_emb.inv_freq`) are skipped; with a tied config an `lm_head.weight` equal to the
/// table is dropped.
///
/// Errors: a missing or invalid config, no safetensors file, unreadable files, weights that do
/// not fit the config (every problem named).
pub fn read_safetensors(dir: &Path) -> Result<DecoderWeights> {
    let config = DecoderConfig::from_json_file(&dir.join("config.json"))?;
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("{} holds no *.safetensors file", dir.display());
    }
    let mut tensors = HashMap::new();
    for f in &files {
        for (name, t) in candle_core::safetensors::load(f, &Device::Cpu)
            .with_context(|| format!("reading {}", f.display()))?
        {
            if name.ends_with("rotary_emb.inv_freq") {
                continue;
            }
            tensors.insert(name, t.to_dtype(DType::F32)?);
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
/// `dir/config.json` (`model_type: "llama"`, `architectures: ["LlamaForCausalLM"]`), each
/// atomically.
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
        m.insert("model_type".into(), "llama".into());
        m.insert(
            "architectures".into(),
            serde_json::json!(["LlamaForCausalLM"]),
        );
        m.insert("hidden_act".into(), "silu".into());
        m.entry("torch_dtype").or_insert("float32".into());
    }
    crate::checkpoint::write_file_atomic(
        &dir.join("config.json"),
        serde_json::to_string_pretty(&json)?.as_bytes(),
    )
}
