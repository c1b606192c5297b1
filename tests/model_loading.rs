//! Model files that would load wrong without a word (issue 37): RoPE scaling in config.json and
//! GGUF (Llama 3's `llama3` type, `linear`, llama.cpp's `rope_freqs.weight`), keys that change
//! the math and are not implemented (refused, named), GGUF user-defined tokens and
//! `add_bos_token`, and PEFT adapter configs (`use_rslora`, `lm_head` in `target_modules`,
//! `modules_to_save`, DoRA, ...). Reference values are computed here from the published
//! formulas (transformers' `_compute_llama3_parameters`, llama.cpp's `convert_hf_to_gguf.py`,
//! PEFT's `LoraLayer.update_layer`) or taken from candle-transformers 0.11.1's `llama`.

#![cfg(feature = "tokenizers")]

mod common;
use anyhow::Result;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use common::max_abs;
use std::collections::HashMap;
use std::f64::consts::PI;
use std::path::{Path, PathBuf};
use wick::lora::{self, LoraConfig};
use wick::models::config::RopeScaling;
use wick::models::family::{Family, LayerType, LINEARS};
use wick::models::files::{self, Gguf};
use wick::models::tokenizer::TextTokenizer;
use wick::models::{Decoder, DecoderConfig, DecoderWeights, FineTune, KvCache};
use wick::{ParamStore, Precision};

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wick-loading-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The tiny config (head width 16, RoPE base 10000) with 256 positions.
fn tiny_config() -> DecoderConfig {
    DecoderConfig {
        max_position_embeddings: 256,
        ..DecoderConfig::tiny(96)
    }
}

/// Random tiny weights, q and k scaled up so that attention is sharp and positions matter.
fn tiny_weights() -> DecoderWeights {
    let mut w = DecoderWeights::random(tiny_config(), 5).unwrap();
    for (name, t) in w.tensors.iter_mut() {
        if name.ends_with("q_proj.weight") || name.ends_with("k_proj.weight") {
            *t = (&*t * 4.0).unwrap();
        }
    }
    w
}

/// An HF folder of the tiny weights whose config.json gets `edit` applied.
fn hf_folder(
    tag: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> PathBuf {
    let dir = tempdir(tag);
    files::save_pretrained(&tiny_weights(), &dir).unwrap();
    let path = dir.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(json.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    dir
}

fn ids(t: usize) -> Tensor {
    let v: Vec<u32> = (0..t as u32).map(|i| (i * 37 + 11) % 96).collect();
    Tensor::from_vec(v, (1, t), &Device::Cpu).unwrap()
}

/// wick's logits `(1, T, V)` of `ids` for `weights` (f32, CPU).
fn logits(weights: &DecoderWeights, ids: &Tensor) -> Tensor {
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
    let m = Decoder::new(&store, weights, &FineTune::Full).unwrap();
    m.forward_cached(ids, &mut KvCache::default()).unwrap()
}

/// transformers' `_compute_llama3_parameters` (and candle-transformers' `llama::Cache::new`),
/// written out here: the llama3-scaled inverse frequency of the default `f`.
fn llama3_scaled(f: f64, factor: f64, low: f64, high: f64, original: f64) -> f64 {
    let wavelen = 2.0 * PI / f;
    if wavelen < original / high {
        f
    } else if wavelen > original / low {
        f / factor
    } else {
        let s = (original / wavelen - low) / (high - low);
        (1.0 - s) * f / factor + s * f
    }
}

fn default_inv_freq(theta: f64, d: usize) -> Vec<f64> {
    (0..d / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / d as f64))
        .collect()
}

fn llama3_json(original: usize) -> serde_json::Value {
    serde_json::json!({
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    })
}

#[test]
fn llama3_rope_scaling_in_config_json_matches_candle_transformers() -> Result<()> {
    // original context 64: with head width 16 and base 10000 the wavelengths 6.3, 19.9, 62.8,
    // 199, ... fall in all three regimes (kept < 16 <= smoothed <= 64 < divided)
    let dir = hf_folder("llama3", |c| {
        c.insert("rope_scaling".into(), llama3_json(64));
    });
    let w = files::read_safetensors(&dir)?;
    assert_eq!(
        w.config.rope_scaling,
        Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        })
    );
    let want: Vec<f64> = default_inv_freq(10000.0, 16)
        .into_iter()
        .map(|f| llama3_scaled(f, 8.0, 1.0, 4.0, 64.0))
        .collect();
    let got = w.config.rope_inv_freq();
    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
        assert!((g - e).abs() <= 1e-12 * e, "inv_freq[{i}]: {g} vs {e}");
    }
    assert!(
        want[0] == default_inv_freq(10000.0, 16)[0]
            && want[7] < default_inv_freq(10000.0, 16)[7] / 7.9
    );

    let t = 48;
    let ours = logits(&w, &ids(t)).narrow(1, t - 1, 1)?.squeeze(1)?;
    let theirs = common::candle_transformers_llama_last_logits(&dir, &ids(t))?; // (1, V)
    let d = max_abs(&ours, &theirs);
    assert!(d < 1e-4, "wick and candle-transformers differ by {d}");
    // the scaling matters here: the unscaled model is far from both
    let plain = logits(&tiny_weights(), &ids(t))
        .narrow(1, t - 1, 1)?
        .squeeze(1)?;
    let gap = max_abs(&plain, &theirs);
    assert!(
        gap > 100.0 * d.max(1e-5),
        "unscaled logits only {gap} away (wick vs candle {d})"
    );
    Ok(())
}

#[test]
fn linear_rope_scaling_divides_positions() -> Result<()> {
    // the legacy `type` key, as older configs write it
    let dir = hf_folder("linear", |c| {
        c.insert(
            "rope_scaling".into(),
            serde_json::json!({"type": "linear", "factor": 4.0}),
        );
    });
    let w = files::read_safetensors(&dir)?;
    assert_eq!(
        w.config.rope_scaling,
        Some(RopeScaling::Linear { factor: 4.0 })
    );
    // position 4p with the factor is position p without it
    let (cos, sin) = w.config.rotary_tables(13, 0, &Device::Cpu)?;
    let (cos1, sin1) = tiny_config().rotary_tables(4, 0, &Device::Cpu)?;
    for p in 0..4 {
        assert!(max_abs(&cos.get(4 * p)?, &cos1.get(p)?) < 1e-6);
        assert!(max_abs(&sin.get(4 * p)?, &sin1.get(p)?) < 1e-6);
    }
    // and the model uses it: logits differ from the unscaled model's
    let gap = max_abs(&logits(&w, &ids(32)), &logits(&tiny_weights(), &ids(32)));
    assert!(
        gap > 1e-2,
        "linear scaling changed the logits by only {gap}"
    );
    // without scaling, the config's tables are ops::rotary_tables'
    let (c0, s0) = tiny_config().rotary_tables(9, 3, &Device::Cpu)?;
    let (c1, s1) = wick::ops::rotary_tables(9, 16, 10000.0, 3, &Device::Cpu)?;
    assert_eq!(max_abs(&c0, &c1) + max_abs(&s0, &s1), 0.0);
    Ok(())
}

/// `config.json` edits that change the computation and are not implemented: each refused,
/// the error naming the key and the file.
#[test]
fn config_json_keys_that_change_the_math_are_refused() {
    let cases: Vec<(&str, serde_json::Value, &str)> = vec![
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
            "yarn",
        ),
        (
            "rope_scaling",
            serde_json::json!({"type": "dynamic", "factor": 2.0}),
            "dynamic",
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}),
            "longrope",
        ),
        ("rope_scaling", serde_json::json!({"type": "su"}), "\"su\""),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "llama3", "factor": 8.0}),
            "low_freq_factor",
        ),
        ("sliding_window", serde_json::json!(32), "sliding_window"),
        (
            "sliding_window",
            serde_json::json!("full"),
            "neither null nor",
        ),
        (
            "sliding_window",
            serde_json::json!(300.5),
            "neither null nor",
        ),
        ("sliding_window", serde_json::json!(-1), "neither null nor"),
        ("attention_bias", serde_json::json!(true), "attention_bias"),
        ("mlp_bias", serde_json::json!(true), "mlp_bias"),
        ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
        ("model_type", serde_json::json!("gemma3"), "model_type"),
        ("model_type", serde_json::json!("phi3"), "model_type"),
        ("head_dim", serde_json::json!(15), "head_dim"),
        (
            "attn_logit_softcapping",
            serde_json::json!(50.0),
            "attn_logit_softcapping",
        ),
        (
            "query_pre_attn_scalar",
            serde_json::json!(256),
            "query_pre_attn_scalar",
        ),
    ];
    for (i, (key, value, needle)) in cases.into_iter().enumerate() {
        let dir = hf_folder(&format!("refuse{i}"), |c| {
            c.insert(key.into(), value.clone());
        });
        let path = dir.join("config.json");
        let err = format!("{:#}", DecoderConfig::from_json_file(&path).unwrap_err());
        assert!(
            err.contains(needle),
            "{key} = {value}: {needle:?} not in {err}"
        );
        assert!(err.contains(key), "{key} = {value}: key not named in {err}");
        assert!(
            err.contains(&path.display().to_string()),
            "file not named: {err}"
        );
        assert!(files::read_safetensors(&dir).is_err());
    }
}

/// The real key sets of SmolLM2-135M-Instruct's, Llama-3.2-1B-Instruct's and Mistral-7B-v0.3's
/// config.json (sizes replaced by the tiny model's) load.
#[test]
fn real_config_json_key_sets_are_accepted() {
    let smollm2 = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "initializer_range": 0.041666666666666664,
        "is_llama_config": true, "mlp_bias": false, "model_type": "llama", "pad_token_id": 2,
        "pretraining_tp": 1, "rope_interleaved": false, "rope_scaling": null, "rope_theta": 100000,
        "torch_dtype": "bfloat16", "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}},
        "transformers_version": "4.42.3", "use_cache": true
    });
    let llama32 = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 16, "hidden_act": "silu",
        "initializer_range": 0.02, "mlp_bias": false, "model_type": "llama", "pretraining_tp": 1,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0",
        "use_cache": true
    });
    let mistral = serde_json::json!({
        "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "initializer_range": 0.02, "model_type": "mistral",
        "rope_theta": 1000000.0, "sliding_window": null, "torch_dtype": "bfloat16",
        "transformers_version": "4.42.0.dev0", "use_cache": true
    });
    for (name, keys) in [
        ("smollm2", smollm2),
        ("llama32", llama32),
        ("mistral", mistral),
    ] {
        let dir = hf_folder(name, |c| {
            for (k, v) in keys.as_object().unwrap() {
                c.insert(k.clone(), v.clone());
            }
        });
        let c = DecoderConfig::from_json_file(&dir.join("config.json"))
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert_eq!(c.rope_scaling.is_some(), name == "llama32", "{name}");
    }
    // transformers 5 writes rope_theta and the scaling as one rope_parameters object
    let dir = hf_folder("ropeparams", |c| {
        c.remove("rope_theta");
        let mut p = llama3_json(64);
        p["rope_theta"] = 20000.0.into();
        c.insert("rope_parameters".into(), p);
    });
    let c = DecoderConfig::from_json_file(&dir.join("config.json")).unwrap();
    assert_eq!(c.rope_theta, 20000.0);
    assert!(matches!(
        c.rope_scaling,
        Some(RopeScaling::Llama3 {
            original_max_position_embeddings: 64,
            ..
        })
    ));
    // a sliding window as long as the context changes nothing
    let dir = hf_folder("window", |c| {
        c.insert("sliding_window".into(), 256.into());
    });
    assert!(DecoderConfig::from_json_file(&dir.join("config.json")).is_ok());
}

/// Writes a GGUF file of `weights` as llama.cpp's converter (`convert_hf_to_gguf.py`) lays out
/// the family (f32): `general.architecture` and the `{arch}.*` keys, GGUF tensor names, q/k
/// rows permuted for Llama and Mistral only (`LlamaModel.permute`), Gemma's norm gains stored
/// as `1 + w` (`Gemma3Model.modify_tensors`), Mistral's window as `llama.attention.sliding_window`,
/// Gemma 3 without `gemma3.vocab_size` (its converter writes none), with `extra` metadata
/// (replacing a default key of the same name) and tensors.
fn write_gguf(
    path: &Path,
    weights: &DecoderWeights,
    extra_meta: Vec<(&str, gguf_file::Value)>,
    extra_tensors: Vec<(&str, Tensor)>,
) {
    use gguf_file::Value as V;
    let c = &weights.config;
    let family = c.model_type;
    let arch = family.gguf_architecture();
    let k = |s: &str| format!("{arch}.{s}");
    let mut meta: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(arch.into())),
        (k("block_count"), V::U32(c.num_hidden_layers as u32)),
        (
            k("context_length"),
            V::U32(c.max_position_embeddings as u32),
        ),
        (k("embedding_length"), V::U32(c.hidden_size as u32)),
        (k("feed_forward_length"), V::U32(c.intermediate_size as u32)),
        (
            k("attention.head_count"),
            V::U32(c.num_attention_heads as u32),
        ),
        (
            k("attention.head_count_kv"),
            V::U32(c.num_key_value_heads as u32),
        ),
        (
            k("attention.layer_norm_rms_epsilon"),
            V::F32(c.rms_norm_eps as f32),
        ),
        (k("rope.freq_base"), V::F32(c.rope_theta as f32)),
        (k("rope.dimension_count"), V::U32(c.head_dim() as u32)),
    ];
    if family != Family::Gemma3 {
        meta.push((k("vocab_size"), V::U32(c.vocab_size as u32)));
    }
    if family != Family::Llama {
        meta.push((k("attention.key_length"), V::U32(c.head_dim() as u32)));
        meta.push((k("attention.value_length"), V::U32(c.head_dim() as u32)));
    }
    if let Some(w) = c.sliding_window {
        meta.push((k("attention.sliding_window"), V::U32(w as u32)));
    }
    if family == Family::Gemma3 {
        let period = (0..c.num_hidden_layers)
            .position(|i| !c.layer_is_sliding(i))
            .unwrap()
            + 1;
        if period != 6 {
            meta.push((k("attention.sliding_window_type"), V::U32(period as u32)));
        }
        if let Some(b) = c.rope_local_base_freq.filter(|&b| b != 10000.0) {
            meta.push((k("rope.local_freq_base"), V::F32(b as f32)));
        }
    }
    meta.retain(|(k, _)| !extra_meta.iter().any(|(e, _)| e == k));
    meta.extend(extra_meta.into_iter().map(|(k, v)| (k.to_string(), v)));
    let mut gguf_names: HashMap<String, String> = HashMap::new();
    for g in ["token_embd.weight", "output_norm.weight", "output.weight"] {
        gguf_names.insert(files::hf_name_of(family, g).unwrap(), g.into());
    }
    let suffixes: Vec<String> = LINEARS
        .iter()
        .flat_map(|(_, g)| [format!("{g}.weight"), format!("{g}.bias")])
        .chain(family.block_norms().iter().map(|(_, g, _)| g.to_string()))
        .collect();
    for i in 0..c.num_hidden_layers {
        for s in &suffixes {
            let g = format!("blk.{i}.{s}");
            if let Some(h) = files::hf_name_of(family, &g) {
                gguf_names.insert(h, g);
            }
        }
    }
    let s = family.switches();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (hf, t) in &weights.tensors {
        let mut t = t.clone();
        if s.gguf_permuted_qk && hf.ends_with("q_proj.weight") {
            t = files::permute_rotary_rows(&t, c.num_attention_heads).unwrap();
        } else if s.gguf_permuted_qk && hf.ends_with("k_proj.weight") {
            t = files::permute_rotary_rows(&t, c.num_key_value_heads).unwrap();
        }
        if s.gguf_norm_plus_one && hf.ends_with("norm.weight") {
            t = (t + 1.0).unwrap();
        }
        tensors.push((
            gguf_names[hf].clone(),
            QTensor::quantize(&t, GgmlDType::F32).unwrap(),
        ));
    }
    for (name, t) in extra_tensors {
        tensors.push((name.into(), QTensor::quantize(&t, GgmlDType::F32).unwrap()));
    }
    let meta_refs: Vec<(&str, &V)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &meta_refs, &tensor_refs).unwrap();
}

/// llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel.generate_extra_tensors`): the
/// `rope_freqs.weight` divisors of Llama 3's scaling (original context 8192).
fn convert_rope_factors(theta: f64, d: usize, factor: f64) -> Vec<f32> {
    let (low, high, old) = (1.0, 4.0, 8192.0);
    default_inv_freq(theta, d)
        .into_iter()
        .map(|freq| {
            let wavelen = 2.0 * PI / freq;
            if wavelen < old / high {
                1.0
            } else if wavelen > old / low {
                factor as f32
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
            }
        })
        .collect()
}

#[test]
fn gguf_rope_freqs_tensor_is_applied_as_llama3_scaling() -> Result<()> {
    // base 1e6, head width 16: wavelengths 6.3 ... 2π·5623 span the kept, smoothed
    // (2048..8192) and divided regimes of the 8192-token original context
    let mut w = tiny_weights();
    w.config.rope_theta = 1e6;
    let dir = tempdir("gguf-rope");
    let ff = convert_rope_factors(1e6, 16, 32.0);
    assert!(ff[0] == 1.0 && ff[7] == 32.0 && ff.iter().any(|&f| f > 1.0 && f < 32.0));
    let path = dir.join("llama3.gguf");
    let rope = Tensor::new(ff.as_slice(), &Device::Cpu)?;
    write_gguf(&path, &w, vec![], vec![("rope_freqs.weight", rope)]);
    let back = files::read_gguf(&path)?;
    assert_eq!(
        back.config.rope_scaling,
        Some(RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        })
    );
    // llama.cpp divides each frequency by its factor (ggml's rope: `theta / freq_factors[i]`)
    for ((g, f), d) in back
        .config
        .rope_inv_freq()
        .iter()
        .zip(&ff)
        .zip(default_inv_freq(1e6, 16))
    {
        assert!(
            (g - d / *f as f64).abs() <= 1e-6 * g,
            "{g} vs {}",
            d / *f as f64
        );
    }
    // and it saves as an HF folder whose config.json says llama3
    let out = dir.join("hf");
    files::save_pretrained(&back, &out)?;
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json"))?)?;
    assert_eq!(cfg["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(cfg["rope_scaling"]["factor"], 32.0);
    let d = max_abs(
        &logits(&back, &ids(20)),
        &logits(&files::read_safetensors(&out)?, &ids(20)),
    );
    assert!(d < 1e-5, "GGUF and saved folder differ by {d}");

    // factors that are not Llama 3's scaling: refused, naming the tensor
    let bad = dir.join("bad.gguf");
    write_gguf(
        &bad,
        &w,
        vec![],
        vec![("rope_freqs.weight", Tensor::new(&[2f32; 8], &Device::Cpu)?)],
    );
    let err = format!("{:#}", files::read_gguf(&bad).unwrap_err());
    assert!(
        err.contains("rope_freqs.weight") && err.contains("bad.gguf"),
        "{err}"
    );
    // a plain file still reads, and its logits are the weights'
    let plain = dir.join("plain.gguf");
    write_gguf(&plain, &w, vec![], vec![]);
    let p = files::read_gguf(&plain)?;
    assert_eq!(p.config.rope_scaling, None);
    assert!(max_abs(&logits(&p, &ids(20)), &logits(&w, &ids(20))) < 1e-5);
    Ok(())
}

#[test]
fn gguf_metadata_that_changes_the_math_is_implemented_or_refused() -> Result<()> {
    use gguf_file::Value as V;
    let w = tiny_weights();
    let dir = tempdir("gguf-keys");
    // linear scaling as llama.cpp writes it
    let path = dir.join("linear.gguf");
    write_gguf(
        &path,
        &w,
        vec![
            ("llama.rope.scaling.type", V::String("linear".into())),
            ("llama.rope.scaling.factor", V::F32(4.0)),
        ],
        vec![],
    );
    assert_eq!(
        files::read_gguf(&path)?.config.rope_scaling,
        Some(RopeScaling::Linear { factor: 4.0 })
    );
    let cases: Vec<(&str, V)> = vec![
        ("llama.rope.scaling.type", V::String("yarn".into())),
        ("llama.attn_logit_softcapping", V::F32(50.0)),
        ("llama.final_logit_softcapping", V::F32(30.0)),
        ("llama.expert_count", V::U32(8)),
        ("llama.rope.dimension_count", V::U32(8)),
        ("llama.attention.value_length", V::U32(32)),
    ];
    for (i, (key, value)) in cases.into_iter().enumerate() {
        let path = dir.join(format!("refused{i}.gguf"));
        let mut extra = vec![(key, value)];
        if key == "llama.expert_count" {
            extra.push(("llama.expert_used_count", V::U32(2)));
        }
        write_gguf(&path, &w, extra, vec![]);
        let err = format!("{:#}", files::read_gguf(&path).unwrap_err());
        assert!(err.contains(key), "{key}: not named in {err}");
        assert!(
            err.contains(&path.display().to_string()),
            "{key}: file not named in {err}"
        );
    }
    Ok(())
}

fn smollm2_gguf() -> PathBuf {
    common::data_file(
        "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "scripts/fetch_smollm2.sh",
    )
}

/// SmolLM2's tokenizer and general metadata (no tensors), for [`tokenizer_gguf`] to edit.
fn smollm2_tokenizer_meta() -> Vec<(String, gguf_file::Value)> {
    Gguf::open(&smollm2_gguf())
        .unwrap()
        .content
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer.") || k.starts_with("general."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Writes `meta` as a tensor-less GGUF `dir/name` and opens it.
fn tokenizer_gguf(dir: &Path, name: &str, meta: &[(String, gguf_file::Value)]) -> Gguf {
    let path = dir.join(name);
    let refs: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::fs::File::create(&path).unwrap(), &refs, &[]).unwrap();
    Gguf::open(&path).unwrap()
}

/// SmolLM2's tokenizer metadata with a user-defined token `<think>` (type 4, as Qwen3's GGUF
/// has it) appended and `add_bos_token` true (as Llama 3's and Gemma 3's files say), written
/// as a tensor-less GGUF.
#[test]
fn gguf_user_defined_tokens_are_atomic_and_add_bos_token_is_honoured() -> Result<()> {
    use gguf_file::Value as V;
    let base = TextTokenizer::from_gguf(&Gguf::open(&smollm2_gguf())?)?;
    assert!(!base.add_bos_token);
    let mut meta = smollm2_tokenizer_meta();
    let think_id = 49152u32;
    for (k, v) in meta.iter_mut() {
        match k.as_str() {
            "tokenizer.ggml.tokens" => {
                let mut t = v.to_vec()?.clone();
                assert_eq!(t.len(), think_id as usize);
                t.push(V::String("<think>".into()));
                *v = V::Array(t);
            }
            "tokenizer.ggml.token_type" => {
                let mut t = v.to_vec()?.clone();
                t.push(V::I32(4));
                *v = V::Array(t);
            }
            "tokenizer.ggml.add_bos_token" => *v = V::Bool(true),
            _ => {}
        }
    }
    let dir = tempdir("tokenizer");
    let tok = TextTokenizer::from_gguf(&tokenizer_gguf(&dir, "tok.gguf", &meta))?;
    assert!(tok.add_bos_token && !tok.add_eos_token);
    let bos = 1u32; // tokenizer.ggml.bos_token_id
    assert_eq!(tok.bos_token.as_deref(), Some("<|im_start|>"));

    // byte-level BPE alone splits the tag into pieces
    assert!(base.encode("<think>")?.len() > 1);
    let text = "Hello<think>so, 2+2 is 4</think>";
    let mut want = vec![bos];
    want.extend(base.encode("Hello")?);
    want.push(think_id);
    want.extend(base.encode("so, 2+2 is 4</think>")?);
    assert_eq!(tok.encode(text)?, want);
    assert_eq!(tok.encode_with(text, false)?, want[1..].to_vec());
    // a long text encoded in pieces gets one BOS, at the start
    let long = "line one<think>\n".repeat(10_000);
    let (prefix, used) = tok.encode_prefix(&long, usize::MAX)?;
    assert_eq!(used, long.len());
    assert_eq!(prefix, tok.encode(&long)?);
    assert_eq!(prefix.iter().filter(|&&i| i == bos).count(), 1);
    // user-defined, not control: kept when decoding skips special tokens
    assert_eq!(
        tok.tokenizer.decode(&[bos, think_id], true).unwrap(),
        "<think>"
    );
    assert_eq!(tok.decode(&[think_id])?, "<think>");
    Ok(())
}

/// A feedback example (prompt, then completion) gets one BOS, at the start, and the EOS only
/// at the end, when the file's flags ask for them; each part's ids are its own.
#[test]
fn prompt_completion_pairs_get_one_bos_at_the_start() -> Result<()> {
    use gguf_file::Value as V;
    let base = TextTokenizer::from_gguf(&Gguf::open(&smollm2_gguf())?)?;
    let (prompt, completion) = ("The capital of Wick is", " Candleburg, by the sea.");
    let (p, c) = (base.encode(prompt)?, base.encode(completion)?);
    let (bos, eos) = (1u32, 2u32); // tokenizer.ggml.bos_token_id / eos_token_id
    assert!(!p.contains(&bos) && !c.contains(&bos) && !c.contains(&eos));
    // SmolLM2's own flags: no BOS, no EOS
    assert_eq!(
        base.encode_prompt_completion(prompt, completion)?,
        [p.clone(), c.clone()].concat()
    );
    let dir = tempdir("pair");
    for (add_eos, name) in [(false, "bos.gguf"), (true, "bos-eos.gguf")] {
        let mut meta = smollm2_tokenizer_meta();
        for (k, v) in meta.iter_mut() {
            match k.as_str() {
                "tokenizer.ggml.add_bos_token" => *v = V::Bool(true),
                "tokenizer.ggml.add_eos_token" => *v = V::Bool(add_eos),
                _ => {}
            }
        }
        if !meta
            .iter()
            .any(|(k, _)| k == "tokenizer.ggml.add_eos_token")
        {
            meta.push(("tokenizer.ggml.add_eos_token".into(), V::Bool(add_eos)));
        }
        let tok = TextTokenizer::from_gguf(&tokenizer_gguf(&dir, name, &meta))?;
        assert!(tok.add_bos_token && tok.add_eos_token == add_eos);
        let mut want = vec![bos];
        want.extend(&p);
        want.extend(&c);
        if add_eos {
            want.push(eos);
        }
        let got = tok.encode_prompt_completion(prompt, completion)?;
        assert_eq!(got, want, "add_eos_token {add_eos}");
        // what concatenating two encode() calls gave: a BOS in the middle
        let mut two = tok.encode(prompt)?;
        two.extend(tok.encode(completion)?);
        assert_eq!(two.iter().filter(|&&i| i == bos).count(), 2);
        assert_eq!(got.iter().filter(|&&i| i == bos).count(), 1);
    }
    Ok(())
}

/// `tokenizer.ggml.pre`: `gpt2` and `smollm` are implemented exactly (Llama 3's `llama-bpe`
/// and Qwen2's `qwen2` too: tests/tokenizers.rs); another value (llama.cpp's `default`,
/// `deepseek-llm`) is refused naming the key, the value and the file; an absent key is transformers' GPT-2 regex, refused for llama.cpp's
/// pre-tokenization (its `default` regexes).
#[test]
fn gguf_pre_tokenizers_are_implemented_or_refused() -> Result<()> {
    use gguf_file::Value as V;
    use wick::models::tokenizer::Pretokenizer;
    let smollm = Gguf::open(&smollm2_gguf())?;
    // a space run before a digit: GPT-2's regex keeps " 7" together, the digit split does not
    let text = "x  7 apples and 1234 pears";
    let transformers = TextTokenizer::from_gguf(&smollm)?.encode(text)?;
    let digits = TextTokenizer::from_gguf_with(&smollm, Pretokenizer::LlamaCpp)?.encode(text)?;
    assert_ne!(transformers, digits);
    let dir = tempdir("pre");
    let with_pre = |name: &str, pre: Option<&str>| {
        let mut meta = smollm2_tokenizer_meta();
        meta.retain(|(k, _)| k != "tokenizer.ggml.pre");
        if let Some(p) = pre {
            meta.push(("tokenizer.ggml.pre".into(), V::String(p.into())));
        }
        tokenizer_gguf(&dir, name, &meta)
    };
    // gpt2: GPT-2's regex alone, in both modes (no digit split)
    let gpt2 = with_pre("gpt2.gguf", Some("gpt2"));
    for mode in [Pretokenizer::Transformers, Pretokenizer::LlamaCpp] {
        assert_eq!(
            TextTokenizer::from_gguf_with(&gpt2, mode)?.encode(text)?,
            transformers,
            "{mode:?}"
        );
    }
    // absent: transformers' loader (GPT-2's regex); llama.cpp would use its "default"
    let absent = with_pre("absent.gguf", None);
    assert_eq!(
        TextTokenizer::from_gguf(&absent)?.encode(text)?,
        transformers
    );
    let err = format!(
        "{:#}",
        TextTokenizer::from_gguf_with(&absent, Pretokenizer::LlamaCpp)
            .err()
            .unwrap()
    );
    assert!(
        err.contains("tokenizer.ggml.pre") && err.contains("absent.gguf"),
        "{err}"
    );
    for pre in ["default", "deepseek-llm"] {
        let name = format!("{pre}.gguf");
        let g = with_pre(&name, Some(pre));
        for mode in [Pretokenizer::Transformers, Pretokenizer::LlamaCpp] {
            let err = format!(
                "{:#}",
                TextTokenizer::from_gguf_with(&g, mode).err().unwrap()
            );
            assert!(
                err.contains("tokenizer.ggml.pre")
                    && err.contains(&format!("{pre:?}"))
                    && err.contains(&name),
                "{pre} {mode:?}: {err}"
            );
        }
    }
    Ok(())
}

/// Llama 3.1 / 3.2 Instruct's `eos_token_id` list loads, is saved as a list, and generation
/// stops at any of its ids; one id stays one id; anything else is refused naming the key.
#[test]
fn eos_token_id_lists_load_stop_generation_and_save_as_read() -> Result<()> {
    use wick::models::config::TokenIds;
    // greedy ids of the tiny model without an EOS
    let w = tiny_weights();
    let prompt = [5u32, 17, 3];
    let free = {
        let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
        Decoder::new(&store, &w, &FineTune::Full)?.generate(&prompt, 6, 0.0, 0)?
    };
    assert_eq!(free.len(), 6);
    let stop = free[2];
    let first = free.iter().position(|&i| i == stop).unwrap();
    let dir = hf_folder("eos-list", |c| {
        c.insert("eos_token_id".into(), serde_json::json!([95, stop, 94]));
    });
    let back = files::read_safetensors(&dir)?;
    assert_eq!(
        back.config.eos_token_id,
        Some(TokenIds::Many(vec![95, stop, 94]))
    );
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
    let got = Decoder::new(&store, &back, &FineTune::Full)?.generate(&prompt, 6, 0.0, 0)?;
    assert_eq!(got, free[..=first].to_vec(), "stops after {stop}");
    let out = dir.join("saved");
    files::save_pretrained(&back, &out)?;
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json"))?)?;
    assert_eq!(saved["eos_token_id"], serde_json::json!([95, stop, 94]));
    // one id: read and written as a number
    let one = hf_folder("eos-one", |c| {
        c.insert("eos_token_id".into(), 2.into());
    });
    let c = DecoderConfig::from_json_file(&one.join("config.json"))?;
    assert_eq!(c.eos_token_id, Some(TokenIds::One(2)));
    assert_eq!(serde_json::to_value(&c)?["eos_token_id"], 2);
    for bad in [serde_json::json!("2"), serde_json::json!([2, -1])] {
        let d = hf_folder("eos-bad", |c| {
            c.insert("eos_token_id".into(), bad.clone());
        });
        let err = format!(
            "{:#}",
            DecoderConfig::from_json_file(&d.join("config.json")).unwrap_err()
        );
        assert!(err.contains("eos_token_id"), "{bad}: {err}");
    }
    Ok(())
}

/// transformers 5's `rope_parameters` is read however the config is deserialized, and a
/// `rope_theta` or `rope_scaling` beside it that differs is refused.
#[test]
fn rope_parameters_are_read_at_deserialization_and_conflicts_refused() -> Result<()> {
    let base = serde_json::to_value(tiny_config())?;
    let with = |edit: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)| {
        let mut v = base.clone();
        edit(v.as_object_mut().unwrap());
        serde_json::from_value::<DecoderConfig>(v)
    };
    let mut params = llama3_json(64);
    params["rope_theta"] = 20000.0.into();
    let c = with(&|m| {
        m.remove("rope_theta");
        m.insert("rope_parameters".into(), params.clone());
    })?;
    c.validate()?;
    assert_eq!(c.rope_theta, 20000.0);
    assert_eq!(
        c.rope_scaling,
        Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        })
    );
    assert!(!c.other.contains_key("rope_parameters"));
    // saved as rope_theta + rope_scaling, and read back the same
    let saved = serde_json::to_value(&c)?;
    assert_eq!(saved["rope_theta"], 20000.0);
    assert_eq!(saved["rope_scaling"]["rope_type"], "llama3");
    assert_eq!(serde_json::from_value::<DecoderConfig>(saved)?, c);
    // the default type with a theta; the same theta beside it is fine
    let c = with(&|m| {
        m.insert("rope_theta".into(), 500000.0.into());
        m.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "default", "rope_theta": 500000.0}),
        );
    })?;
    assert_eq!((c.rope_theta, c.rope_scaling), (500000.0, None));
    // a different top-level theta: refused, both named
    let err = with(&|m| {
        m.insert("rope_theta".into(), 10000.0.into());
        m.insert("rope_parameters".into(), params.clone());
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("rope_theta") && err.contains("10000") && err.contains("20000"),
        "{err}"
    );
    // a different rope_scaling beside it: refused
    let err = with(&|m| {
        m.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "linear", "factor": 2.0}),
        );
        m.insert("rope_parameters".into(), params.clone());
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("rope_parameters") && err.contains("rope_scaling"),
        "{err}"
    );
    Ok(())
}

/// llama.cpp's RoPE scaling keys as it reads them: the type defaults to linear, the factor is
/// `llama.rope.scaling.factor` or the older `llama.rope.scale_linear`, and type `none` never
/// scales (llama-context.cpp: "never scale if scaling type is none").
#[test]
fn gguf_rope_scaling_type_none_ignores_the_factor() -> Result<()> {
    use gguf_file::Value as V;
    let w = tiny_weights();
    let dir = tempdir("gguf-none");
    let read = |name: &str, meta: Vec<(&str, V)>| {
        let path = dir.join(name);
        write_gguf(&path, &w, meta, vec![]);
        files::read_gguf(&path).unwrap()
    };
    let none = read(
        "none.gguf",
        vec![
            ("llama.rope.scaling.type", V::String("none".into())),
            ("llama.rope.scaling.factor", V::F32(4.0)),
        ],
    );
    assert_eq!(none.config.rope_scaling, None);
    assert!(max_abs(&logits(&none, &ids(32)), &logits(&w, &ids(32))) < 1e-5);
    let none_legacy = read(
        "none-legacy.gguf",
        vec![
            ("llama.rope.scaling.type", V::String("none".into())),
            ("llama.rope.scale_linear", V::F32(4.0)),
        ],
    );
    assert_eq!(none_legacy.config.rope_scaling, None);
    let linear = Some(RopeScaling::Linear { factor: 4.0 });
    for (name, key) in [
        ("legacy.gguf", "llama.rope.scale_linear"),
        ("factor.gguf", "llama.rope.scaling.factor"),
    ] {
        let g = read(name, vec![(key, V::F32(4.0))]);
        assert_eq!(g.config.rope_scaling, linear, "{key} without a type");
    }
    Ok(())
}

/// `ops::rotary_tables_from_inv_freq`: the tables of the given frequencies, written out here,
/// and its argument checks.
#[test]
fn rotary_tables_from_inv_freq_values_and_checks() -> Result<()> {
    let inv = [0.5, 0.125, 1e-3];
    let (cos, sin) = wick::ops::rotary_tables_from_inv_freq(&inv, 4, 3, &Device::Cpu)?;
    assert_eq!(cos.dims(), &[4, 3]);
    let (cos, sin) = (cos.to_vec2::<f32>()?, sin.to_vec2::<f32>()?);
    for t in 0..4 {
        for (i, f) in inv.iter().enumerate() {
            let a = (t + 3) as f64 * f;
            assert!((cos[t][i] as f64 - a.cos()).abs() < 1e-7);
            assert!((sin[t][i] as f64 - a.sin()).abs() < 1e-7);
        }
    }
    let err = |inv: &[f64], start| {
        wick::ops::rotary_tables_from_inv_freq(inv, 2, start, &Device::Cpu)
            .unwrap_err()
            .to_string()
    };
    assert!(err(&[], 0).contains("no inverse frequencies"));
    assert!(err(&[0.5, f64::NAN], 0).contains("finite and positive"));
    assert!(err(&[0.0], 0).contains("finite and positive"));
    assert!(err(&[0.5], usize::MAX).contains("overflow"));
    Ok(())
}

/// An adapter folder: `adapter_config.json` from `config` and a one-tensor
/// `adapter_model.safetensors`.
fn adapter_dir(tag: &str, config: &serde_json::Value) -> PathBuf {
    let dir = tempdir(tag);
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
    let t = Tensor::zeros((2, 64), DType::F32, &Device::Cpu).unwrap();
    candle_core::safetensors::save(
        &HashMap::from([(
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight".to_string(),
            t,
        )]),
        dir.join("adapter_model.safetensors"),
    )
    .unwrap();
    dir
}

/// PEFT 0.13's `adapter_config.json` of `LoraConfig(r=16, lora_alpha=32, ...)`, every field.
fn peft_config() -> serde_json::Value {
    serde_json::json!({
        "alpha_pattern": {}, "auto_mapping": null, "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "bias": "none", "fan_in_fan_out": false, "inference_mode": true, "init_lora_weights": true,
        "layer_replication": null, "layers_pattern": null, "layers_to_transform": null,
        "loftq_config": {}, "lora_alpha": 32, "lora_dropout": 0.05, "megatron_config": null,
        "megatron_core": "megatron.core", "modules_to_save": null, "peft_type": "LORA", "r": 16,
        "rank_pattern": {}, "revision": null, "target_modules": ["q_proj", "v_proj"],
        "task_type": "CAUSAL_LM", "use_dora": false, "use_rslora": false
    })
}

#[test]
fn peft_use_rslora_scales_by_alpha_over_sqrt_r() -> Result<()> {
    let (cfg, _) = lora::load_adapters(&adapter_dir("plain", &peft_config()))?;
    assert_eq!(cfg.scaling(), 32.0 / 16.0);
    let mut c = peft_config();
    c["use_rslora"] = true.into();
    let (cfg, _) = lora::load_adapters(&adapter_dir("rslora", &c))?;
    // PEFT: scaling = lora_alpha / math.sqrt(r)
    assert_eq!(cfg.scaling(), 32.0 / 4.0);

    // saved back with use_rslora, and read the same
    let out = tempdir("rslora-save");
    let t = Tensor::zeros((16, 64), DType::F32, &Device::Cpu)?;
    lora::save_adapter_tensors(
        vec![("model.layers.0.self_attn.q_proj.lora_A.weight".into(), t)],
        &cfg,
        "base",
        &out,
    )?;
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json"))?)?;
    assert_eq!(json["use_rslora"], true);
    assert_eq!(lora::load_adapters(&out)?.0.scaling(), 8.0);

    // the model applies it: merging adds alpha / sqrt(r) · B A
    let w = tiny_weights();
    let l = LoraConfig {
        use_rslora: true,
        ..LoraConfig::all_linear(4, 8.0)
    };
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 3);
    let m = Decoder::new(&store, &w, &FineTune::Lora(l))?;
    for p in store.params().iter().filter(|p| p.name.contains("lora_B")) {
        let n = p.master.shape().elem_count() as u32;
        let v = (Tensor::arange(0u32, n, &Device::Cpu)?
            .to_dtype(DType::F32)?
            .sin()?
            * 0.05)?;
        p.master.set(&v.reshape(p.master.shape())?)?;
    }
    let masters: HashMap<String, Tensor> = m.adapter_masters(&store)?.into_iter().collect();
    let merged = m.merged_weights(&store)?;
    let q = "model.layers.1.self_attn.q_proj";
    let delta = (&merged.tensors[&format!("{q}.weight")] - &w.tensors[&format!("{q}.weight")])?;
    let ba =
        masters[&format!("{q}.lora_B.weight")].matmul(&masters[&format!("{q}.lora_A.weight")])?;
    let want = (ba * (8.0 / 2.0))?;
    assert!(max_abs(&want, &want.zeros_like()?) > 1e-3);
    let d = max_abs(&delta, &want);
    assert!(
        d < 1e-5,
        "merged delta differs from alpha/sqrt(r) B A by {d}"
    );
    Ok(())
}

#[test]
fn peft_keys_that_change_the_adapter_are_refused() {
    let cases: Vec<(&str, serde_json::Value)> = vec![
        (
            "target_modules",
            serde_json::json!(["q_proj", "v_proj", "lm_head"]),
        ),
        (
            "target_modules",
            serde_json::json!(["q_proj", "embed_tokens"]),
        ),
        ("target_modules", serde_json::json!(".*\\.(q_proj|v_proj)")),
        ("modules_to_save", serde_json::json!(["lm_head"])),
        ("use_dora", serde_json::json!(true)),
        ("lora_bias", serde_json::json!(true)),
        ("rank_pattern", serde_json::json!({"q_proj": 8})),
        ("alpha_pattern", serde_json::json!({"v_proj": 64})),
        ("layers_to_transform", serde_json::json!([0, 1])),
        ("bias", serde_json::json!("all")),
        ("fan_in_fan_out", serde_json::json!(true)),
        ("init_lora_weights", serde_json::json!("pissa")),
        ("exclude_modules", serde_json::json!(["o_proj"])),
        ("layer_replication", serde_json::json!([[0, 2]])),
        ("some_future_key", serde_json::json!(1)),
    ];
    for (i, (key, value)) in cases.into_iter().enumerate() {
        let mut c = peft_config();
        c[key] = value.clone();
        let dir = adapter_dir(&format!("refuse{i}"), &c);
        let err = format!("{:#}", lora::load_adapters(&dir).unwrap_err());
        let needle = match value.as_array().and_then(|a| a.last()) {
            Some(serde_json::Value::String(m)) if key == "target_modules" => m.clone(),
            _ => key.to_string(),
        };
        assert!(
            err.contains(&needle),
            "{key} = {value}: {needle:?} not in {err}"
        );
        assert!(
            err.contains("adapter_config.json"),
            "{key}: file not named in {err}"
        );
    }
    // the same check for a config built in code (the examples' --targets)
    let mut c = LoraConfig::all_linear(8, 16.0);
    c.target_modules.push("lm_head".into());
    let err = format!("{:#}", c.validate().unwrap_err());
    assert!(err.contains("lm_head"), "{err}");
    // PEFT's "all-linear" is the block linears
    let mut c = peft_config();
    c["target_modules"] = "all-linear".into();
    let (cfg, _) = lora::load_adapters(&adapter_dir("all-linear", &c)).unwrap();
    assert_eq!(
        cfg.target_modules,
        LoraConfig::all_linear(1, 1.0).target_modules
    );
}

/// `family`'s tiny config (vocabulary 96, 256 positions; Gemma's score scale `1/√head_dim`,
/// which is what llama.cpp derives for every Gemma 3 but the 27B) with random weights, every
/// 1-D tensor (norm gains, biases) drawn away from its initial value, as tests/families.rs
/// draws them.
fn family_weights(family: Family, tied: bool) -> DecoderWeights {
    let mut config = DecoderConfig::tiny_family(family, 96);
    config.max_position_embeddings = 256;
    config.tie_word_embeddings = tied;
    if family == Family::Gemma3 {
        config.query_pre_attn_scalar = Some(config.head_dim() as f64);
    }
    common::decoder_reference::drawn_weights(config, 23)
}

/// Every tensor of `a` is in `b` within `tol` (and `b` has no other).
fn assert_same_tensors(what: &str, a: &DecoderWeights, b: &DecoderWeights, tol: f32) {
    let mut names: Vec<&String> = a.tensors.keys().collect();
    names.sort();
    let mut theirs: Vec<&String> = b.tensors.keys().collect();
    theirs.sort();
    assert_eq!(names, theirs, "{what}: tensor names");
    for n in names {
        let (x, y) = (&a.tensors[n], &b.tensors[n]);
        assert_eq!(x.dims(), y.dims(), "{what}: {n}");
        let d = max_abs(x, y);
        assert!(d <= tol, "{what}: {n} differs by {d}");
    }
}

/// The GGUF of each family, written as llama.cpp's converter writes it, reads back to the
/// same config (the eps through f32, as GGUF stores it) and tensors, and the same logits.
#[test]
fn every_family_round_trips_through_gguf() -> Result<()> {
    let dir = tempdir("gguf-families");
    for family in Family::ALL {
        for tied in [true, false] {
            let w = family_weights(family, tied);
            let path = dir.join(format!("{}-{tied}.gguf", family.model_type()));
            write_gguf(&path, &w, vec![], vec![]);
            let back =
                files::read_gguf(&path).unwrap_or_else(|e| panic!("{family:?} tied {tied}: {e:#}"));
            let mut want = w.config.clone();
            want.rms_norm_eps = want.rms_norm_eps as f32 as f64;
            if family == Family::Gemma3 {
                // the GGUF has no layer_types: the reader writes out the period's pattern
                assert_eq!(
                    back.config.layer_types,
                    Some(vec![
                        LayerType::Sliding,
                        LayerType::Sliding,
                        LayerType::Full
                    ])
                );
                want.layer_types = back.config.layer_types.clone();
            }
            if family == Family::Qwen3 || family == Family::Gemma3 {
                assert_eq!(
                    back.config.head_dim,
                    Some(32),
                    "{family:?}: key_length read"
                );
            }
            assert_eq!(back.config, want, "{family:?} tied {tied}: config");
            // f32 storage; Gemma's gains go through 1 + w and back
            assert_same_tensors(&format!("{family:?} tied {tied}"), &w, &back, 1e-6);
            let d = max_abs(&logits(&w, &ids(12)), &logits(&back, &ids(12)));
            assert!(d < 1e-4, "{family:?}: logits differ by {d}");
        }
    }
    Ok(())
}

/// `save_pretrained` writes each family's model_type, architectures and activation, and
/// `read_safetensors` reads the folder back to the same config and tensors.
#[test]
fn every_family_round_trips_through_save_pretrained() -> Result<()> {
    for family in Family::ALL {
        let w = family_weights(family, family == Family::Gemma3);
        let dir = tempdir(&format!("save-{}", family.model_type()));
        files::save_pretrained(&w, &dir)?;
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
        assert_eq!(json["model_type"], family.model_type());
        assert_eq!(
            json["architectures"],
            serde_json::json!([family.architecture()])
        );
        if family == Family::Gemma3 {
            assert_eq!(json["hidden_activation"], "gelu_pytorch_tanh");
            assert!(json.get("hidden_act").is_none());
        } else {
            assert_eq!(json["hidden_act"], "silu");
        }
        assert_eq!(json["attention_bias"], family == Family::Qwen2);
        let back = files::read_safetensors(&dir).unwrap_or_else(|e| panic!("{family:?}: {e:#}"));
        let mut got = back.config.clone();
        for k in [
            "architectures",
            "hidden_act",
            "hidden_activation",
            "attention_bias",
            "torch_dtype",
        ] {
            got.other.remove(k);
        }
        assert_eq!(got, w.config, "{family:?}: config");
        assert_same_tensors(&format!("{family:?}"), &w, &back, 0.0);
    }
    Ok(())
}

/// Mistral's GGUF (architecture `llama`, `llama.attention.sliding_window` below the context)
/// loads as Mistral with its window; a window as long as the context is plain Llama.
#[test]
fn gguf_llama_sliding_window_is_mistral() -> Result<()> {
    use gguf_file::Value as V;
    let dir = tempdir("gguf-mistral");
    let w = family_weights(Family::Mistral, false);
    let path = dir.join("mistral.gguf");
    write_gguf(&path, &w, vec![], vec![]);
    let g = Gguf::open(&path)?;
    assert_eq!(g.meta("general.architecture")?.to_string()?, "llama");
    let back = files::read_gguf(&path)?;
    assert_eq!(back.config.model_type, Family::Mistral);
    assert_eq!(back.config.sliding_window, Some(5));
    assert!(max_abs(&logits(&w, &ids(20)), &logits(&back, &ids(20))) < 1e-4);
    let llama = dir.join("llama.gguf");
    write_gguf(
        &llama,
        &tiny_weights(),
        vec![("llama.attention.sliding_window", V::U32(256))],
        vec![],
    );
    let back = files::read_gguf(&llama)?;
    assert_eq!(
        (back.config.model_type, back.config.sliding_window),
        (Family::Llama, None)
    );
    Ok(())
}

/// Gemma 3 as llama.cpp reads it: the fixed period 6, the local base 10000 by default, the
/// score scale 1/√head_dim but for the 27B's 62 blocks (hidden / heads), linear RoPE scaling
/// (the 4B+ files') on the global layers only.
#[test]
fn gguf_gemma3_layer_pattern_rope_bases_and_scale() -> Result<()> {
    use gguf_file::Value as V;
    let dir = tempdir("gguf-gemma3");
    let mut w = family_weights(Family::Gemma3, true);
    w.config.num_hidden_layers = 7;
    w.config.layer_types = None; // the default period 6
    let w = DecoderWeights::random(w.config, 3)?;
    let path = dir.join("period6.gguf");
    write_gguf(
        &path,
        &w,
        vec![
            ("gemma3.rope.scaling.type", V::String("linear".into())),
            ("gemma3.rope.scaling.factor", V::F32(8.0)),
        ],
        vec![],
    );
    let c = files::read_gguf(&path)?.config;
    let full: Vec<usize> = (0..7).filter(|&i| !c.layer_is_sliding(i)).collect();
    assert_eq!(full, vec![5]);
    assert_eq!(c.rope_local_base_freq, Some(10000.0));
    assert_eq!(c.query_pre_attn_scalar, Some(32.0));
    assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 8.0 }));
    let (local, global) = (c.rope_inv_freq_of(true), c.rope_inv_freq_of(false));
    let want = default_inv_freq(10000.0, 32);
    assert!(local.iter().zip(&want).all(|(l, p)| (l - p).abs() <= 1e-15));
    let plain = default_inv_freq(1e6, 32);
    assert!(global
        .iter()
        .zip(&plain)
        .all(|(g, p)| (g - p / 8.0).abs() <= 1e-15));
    // candle-transformers' quantized_gemma3 key for the period, and a local base
    let path = dir.join("period2.gguf");
    write_gguf(
        &path,
        &w,
        vec![
            ("gemma3.attention.sliding_window_type", V::U32(2)),
            ("gemma3.rope.local_freq_base", V::F32(20000.0)),
        ],
        vec![],
    );
    let c = files::read_gguf(&path)?.config;
    let full: Vec<usize> = (0..7).filter(|&i| !c.layer_is_sliding(i)).collect();
    assert_eq!(full, vec![1, 3, 5]);
    assert_eq!(c.rope_local_base_freq, Some(20000.0));
    // the 27B's shape (62 blocks, 5376 / 32 = 168 ≠ key_length 128): only the config is
    // read, from a tensor-less file
    let path = dir.join("27b.gguf");
    let meta: Vec<(&str, V)> = vec![
        ("general.architecture", V::String("gemma3".into())),
        ("gemma3.block_count", V::U32(62)),
        ("gemma3.context_length", V::U32(131072)),
        ("gemma3.embedding_length", V::U32(5376)),
        ("gemma3.feed_forward_length", V::U32(21504)),
        ("gemma3.attention.head_count", V::U32(32)),
        ("gemma3.attention.head_count_kv", V::U32(16)),
        ("gemma3.attention.key_length", V::U32(128)),
        ("gemma3.attention.value_length", V::U32(128)),
        ("gemma3.attention.layer_norm_rms_epsilon", V::F32(1e-6)),
        ("gemma3.attention.sliding_window", V::U32(1024)),
        ("gemma3.rope.freq_base", V::F32(1e6)),
        ("gemma3.vocab_size", V::U32(262208)),
    ];
    let refs: Vec<(&str, &V)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    gguf_file::write(&mut std::fs::File::create(&path)?, &refs, &[])?;
    let c = Gguf::open(&path)?.config()?;
    assert_eq!((c.head_dim(), c.query_pre_attn_scalar), (128, Some(168.0)));
    assert_eq!(c.attention_scale(), Some(1.0 / 168f64.sqrt()));
    Ok(())
}

/// Keys of each architecture that wick does not implement, Gemma 2's soft-capping, value
/// widths other than key widths, and tensors a family does not have: each refused, named
/// with the file.
#[test]
fn gguf_family_keys_and_tensors_that_are_not_implemented_are_refused() -> Result<()> {
    use gguf_file::Value as V;
    let dir = tempdir("gguf-family-refusals");
    let cases: Vec<(Family, &str, V, &str)> = vec![
        (
            Family::Qwen2,
            "qwen2.attention.sliding_window",
            V::U32(4),
            "not implemented",
        ),
        (
            Family::Qwen2,
            "qwen2.pooling_type",
            V::U32(1),
            "not implemented",
        ),
        (
            Family::Qwen3,
            "qwen3.attention.causal",
            V::Bool(false),
            "not implemented",
        ),
        (Family::Qwen3, "qwen3.expert_count", V::U32(8), "experts"),
        (
            Family::Gemma3,
            "gemma3.attention.shared_kv_layers",
            V::U32(2),
            "not implemented",
        ),
        (
            Family::Gemma3,
            "gemma3.final_logit_softcapping",
            V::F32(30.0),
            "soft-capping",
        ),
        (
            Family::Gemma3,
            "gemma3.attn_logit_softcapping",
            V::F32(50.0),
            "soft-capping",
        ),
        (
            Family::Gemma3,
            "gemma3.attention.value_length",
            V::U32(16),
            "value",
        ),
        (
            Family::Qwen3,
            "qwen3.attention.value_length",
            V::U32(64),
            "value",
        ),
        (
            Family::Qwen2,
            "qwen2.rope.scaling.type",
            V::String("yarn".into()),
            "yarn",
        ),
        (
            Family::Gemma3,
            "gemma3.rope.dimension_count",
            V::U32(16),
            "partial",
        ),
    ];
    for (i, (family, key, value, needle)) in cases.into_iter().enumerate() {
        let path = dir.join(format!("refused{i}.gguf"));
        let w = family_weights(family, true);
        let mut extra = vec![(key, value)];
        if key == "qwen3.expert_count" {
            extra.push(("qwen3.expert_used_count", V::U32(2)));
        }
        write_gguf(&path, &w, extra, vec![]);
        let err = format!("{:#}", files::read_gguf(&path).unwrap_err());
        assert!(err.contains(key), "{key}: not named in {err}");
        assert!(err.contains(needle), "{key}: {needle:?} not in {err}");
        assert!(
            err.contains(&path.display().to_string()),
            "{key}: file not named in {err}"
        );
    }
    // tensors the family does not have: q/k norms in Qwen2, biases in Qwen3 and Llama,
    // Gemma's sandwich norms in Llama, something unknown
    let zeros = |n: usize| Tensor::zeros(n, DType::F32, &Device::Cpu).unwrap();
    for (i, (family, name, n)) in [
        (Family::Qwen2, "blk.0.attn_q_norm.weight", 16),
        (Family::Qwen3, "blk.1.attn_q.bias", 128),
        (Family::Llama, "blk.0.attn_k.bias", 32),
        (Family::Llama, "blk.0.post_ffw_norm.weight", 64),
        (Family::Gemma3, "blk.0.attn_sinks.weight", 4),
        (Family::Gemma3, "blk.x.attn_norm.weight", 64),
        (Family::Gemma3, "vision.patch_embd.weight", 4),
    ]
    .into_iter()
    .enumerate()
    {
        let path = dir.join(format!("tensor{i}.gguf"));
        write_gguf(
            &path,
            &family_weights(family, true),
            vec![],
            vec![(name, zeros(n))],
        );
        let err = format!("{:#}", files::read_gguf(&path).unwrap_err());
        assert!(err.contains(name), "{name}: not named in {err}");
        assert!(
            err.contains(&path.display().to_string()),
            "{name}: file not named in {err}"
        );
    }
    Ok(())
}

/// A sharded HF folder: exactly the shards of `model.safetensors.index.json` are read (a
/// stray `*.safetensors` beside them is not), a tensor the map names but its shard lacks is
/// refused by name; a multimodal Gemma 3 checkpoint is refused.
#[test]
fn sharded_folders_follow_the_index_and_multimodal_checkpoints_are_refused() -> Result<()> {
    let w = family_weights(Family::Qwen3, false);
    let dir = tempdir("sharded");
    files::save_pretrained(&w, &dir)?;
    std::fs::remove_file(dir.join("model.safetensors"))?;
    let mut names: Vec<&String> = w.tensors.keys().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (shard, part) in [
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ] {
        let ts: HashMap<String, Tensor> = part
            .iter()
            .map(|n| ((*n).clone(), w.tensors[*n].clone()))
            .collect();
        candle_core::safetensors::save(&ts, dir.join(shard))?;
        for n in part.iter() {
            map.insert((*n).clone(), shard.into());
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string(&index)?,
    )?;
    // a stray file the index does not name (an old consolidated copy, a different model)
    let stray: HashMap<String, Tensor> = [(
        "stray.weight".to_string(),
        Tensor::zeros(3, DType::F32, &Device::Cpu)?,
    )]
    .into();
    candle_core::safetensors::save(&stray, dir.join("consolidated.safetensors"))?;
    let back = files::read_safetensors(&dir)?;
    assert_same_tensors("sharded", &w, &back, 0.0);

    // the map names a tensor its shard lacks
    let mut bad = index.clone();
    bad["weight_map"]["model.layers.0.mlp.extra.weight"] =
        "model-00002-of-00002.safetensors".into();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string(&bad)?,
    )?;
    let err = format!("{:#}", files::read_safetensors(&dir).unwrap_err());
    assert!(
        err.contains("model.layers.0.mlp.extra.weight") && err.contains("index.json"),
        "{err}"
    );
    // a missing shard
    let mut bad = index.clone();
    bad["weight_map"][a[0].as_str()] = "model-00003-of-00003.safetensors".into();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string(&bad)?,
    )?;
    let err = format!("{:#}", files::read_safetensors(&dir).unwrap_err());
    assert!(err.contains("model-00003-of-00003.safetensors"), "{err}");

    // Gemma3ForConditionalGeneration's names under a text config
    let g = family_weights(Family::Gemma3, true);
    let dir = tempdir("multimodal");
    files::save_pretrained(&g, &dir)?;
    let ts: HashMap<String, Tensor> = g
        .tensors
        .iter()
        .map(|(n, t)| (format!("language_model.{n}"), t.clone()))
        .collect();
    candle_core::safetensors::save(&ts, dir.join("model.safetensors"))?;
    let err = format!("{:#}", files::read_safetensors(&dir).unwrap_err());
    assert!(
        err.contains("multimodal") && err.contains("language_model."),
        "{err}"
    );
    // and the multimodal config itself
    let path = dir.join("config.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    json["model_type"] = "gemma3".into();
    std::fs::write(&path, serde_json::to_string(&json)?)?;
    let err = format!("{:#}", files::read_safetensors(&dir).unwrap_err());
    assert!(
        err.contains("gemma3") && err.contains("text_config"),
        "{err}"
    );
    Ok(())
}
