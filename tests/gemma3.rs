//! wick's decoder on Gemma 3 270M's real weights (the Q4_K_M GGUF scripts/fetch_gemma3.sh
//! assembles, every tensor dequantized to f32 by `files::read_gguf`), f32 on the CPU, against
//! transformers (tests/fixtures/gemma3_270m_reference.json, made by scripts/gemma3_fixture.py
//! from the same file, dequantized by the `gguf` wheel, f32 on the CPU) and candle-transformers
//! 0.11.1 (its `gemma3` on the same dequantized tensors; its `quantized_gemma3` on the file).

mod common;
use anyhow::Result;
use candle_core::{Device, Tensor, D};
use common::max_abs;
use std::path::PathBuf;
use std::sync::OnceLock;
use wick::models::family::{Family, LayerType};
use wick::models::files;
use wick::models::{Decoder, DecoderWeights, FineTune, KvCache};
use wick::{ParamStore, Precision};

/// The GGUF (scripts/fetch_gemma3.sh).
fn gguf_path() -> PathBuf {
    common::data_file("gemma3/gemma-3-270m-q4_k_m.gguf", "scripts/fetch_gemma3.sh")
}

/// The GGUF's weights, read once per test binary (f32, CPU; about 1 GB).
fn weights() -> &'static DecoderWeights {
    static W: OnceLock<DecoderWeights> = OnceLock::new();
    W.get_or_init(|| files::read_gguf(&gguf_path()).expect("reading the GGUF"))
}

/// The model on [`weights`], built once (full fine-tuning, f32, nothing trained).
fn model() -> &'static Decoder {
    static M: OnceLock<(ParamStore, Decoder)> = OnceLock::new();
    &M.get_or_init(|| {
        let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
        let m = Decoder::new(&store, weights(), &FineTune::Full).expect("model");
        (store, m)
    })
    .1
}

fn row(ids: &[u32]) -> Tensor {
    Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
}

/// The per-token NLL of `ids[1..]` given the prefixes, from one forward.
fn nll(m: &Decoder, ids: &[u32]) -> Vec<f32> {
    let logits = m
        .forward_cached(&row(ids), &mut KvCache::default())
        .unwrap()
        .squeeze(0)
        .unwrap(); // (T, V)
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap();
    let targets = Tensor::new(&ids[1..], &Device::Cpu)
        .unwrap()
        .unsqueeze(1)
        .unwrap();
    let picked = logp
        .narrow(0, 0, ids.len() - 1)
        .unwrap()
        .gather(&targets, 1)
        .unwrap()
        .squeeze(1)
        .unwrap();
    (picked * -1.0).unwrap().to_vec1().unwrap()
}

#[test]
fn gguf_config_is_gemma3_270m() {
    let c = &weights().config;
    assert_eq!(c.model_type, Family::Gemma3);
    assert_eq!(
        (
            c.vocab_size,
            c.hidden_size,
            c.intermediate_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim()
        ),
        (262144, 640, 2048, 18, 4, 1, 256)
    );
    assert_eq!(c.sliding_window, Some(512));
    let full: Vec<usize> = (0..18)
        .filter(|&i| c.layer_types.as_ref().unwrap()[i] == LayerType::Full)
        .collect();
    assert_eq!(full, vec![5, 11, 17]);
    assert_eq!(
        (
            c.rope_theta,
            c.rope_local_base_freq,
            c.query_pre_attn_scalar
        ),
        (1e6, Some(10000.0), Some(256.0))
    );
    assert!(c.tie_word_embeddings && c.rope_scaling.is_none());
}

/// Per-token NLL on the fixture's five texts and the 8 greedy tokens of its prompt equal
/// transformers' (`Gemma3ForCausalLM`, f32, CPU, on the same dequantized weights).
#[test]
fn nll_and_greedy_tokens_equal_transformers() {
    let fx = common::fixture("gemma3_270m_reference.json");
    let m = model();
    let mut worst = 0f32;
    for (ids, want) in fx["ids"]
        .as_array()
        .unwrap()
        .iter()
        .zip(fx["nll"].as_array().unwrap())
    {
        let ids = common::ids_of(ids);
        let got = nll(m, &ids);
        let want: Vec<f32> = want
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            worst = worst.max((g - w).abs());
        }
    }
    println!("max |NLL - transformers'| = {worst:e}");
    assert!(
        worst < 1e-3,
        "per-token NLL differs from transformers' by {worst}"
    );
    let prompt = common::ids_of(&fx["prompt_ids"]);
    let want = common::ids_of(&fx["greedy"]);
    let got = m.generate(&prompt, want.len(), 0.0, 0).unwrap();
    assert_eq!(got, want, "greedy tokens");
}

/// candle-transformers 0.11.1's `gemma3::Model` on the tensors `w` of the 270M, with the MLP
/// activation `act` (`gelu_pytorch_tanh` is Gemma's): the last logits of `ids`, fed one token at
/// a time as `common::decoder_reference` feeds it.
fn candle_gemma3_last_logits(w: &DecoderWeights, act: &str, ids: &[u32]) -> Result<Tensor> {
    use candle_transformers::models::gemma3;
    let c = &w.config;
    let cfg: gemma3::Config = serde_json::from_value(serde_json::json!({
        "attention_bias": false, "head_dim": c.head_dim(), "hidden_activation": act,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_hidden_layers": c.num_hidden_layers,
        "num_key_value_heads": c.num_key_value_heads, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "rope_local_base_freq": c.rope_local_base_freq.unwrap(),
        "vocab_size": c.vocab_size, "final_logit_softcapping": null,
        "attn_logit_softcapping": null, "query_pre_attn_scalar": c.head_dim(),
        "sliding_window": c.sliding_window.unwrap(), "sliding_window_pattern": 6,
        "max_position_embeddings": c.max_position_embeddings,
    }))?;
    let vb = candle_nn::VarBuilder::from_tensors(
        w.tensors.clone(),
        candle_core::DType::F32,
        &Device::Cpu,
    );
    let mut m = gemma3::Model::new(false, &cfg, vb)?;
    let mut last = None;
    for (i, &id) in ids.iter().enumerate() {
        last = Some(m.forward(&row(&[id]), i)?);
    }
    Ok(last.unwrap().flatten_all()?)
}

/// The prompt's last logits equal candle-transformers' `gemma3` built on the same dequantized
/// tensors (f32; relative tolerance 1e-5 of the largest logit: the two differ only in the
/// order of f32 sums). candle-transformers 0.11.1's `quantized_gemma3` on the file (every
/// weight dequantized, `CANDLE_DEQUANTIZE_ALL`) is not Gemma 3: its `Mlp::forward` applies
/// `silu` to the gate where Gemma 3 (transformers' `hidden_activation: "gelu_pytorch_tanh"`,
/// llama.cpp's `LLM_FFN_GELU`) applies tanh-GELU. It is checked to equal candle's own `gemma3`
/// with a SiLU MLP on our tensors (so the file is read the same, gains, window and RoPE
/// included) and to be far from Gemma 3's logits.
#[test]
fn last_logits_equal_candle_transformers() -> Result<()> {
    let fx = common::fixture("gemma3_270m_reference.json");
    let prompt = common::ids_of(&fx["prompt_ids"]);
    let t = prompt.len();
    let ours = model()
        .forward_cached(&row(&prompt), &mut KvCache::default())?
        .narrow(1, t - 1, 1)?
        .flatten_all()?;
    let scale = max_abs(&ours, &ours.zeros_like()?);
    let w = weights();
    let theirs = candle_gemma3_last_logits(w, "gelu_pytorch_tanh", &prompt)?;
    let d = max_abs(&ours, &theirs);
    println!("wick vs candle gemma3: max |Δ| = {d:e} (max |logit| {scale})");
    assert!(
        d < 1e-5 * scale,
        "candle-transformers' gemma3 differs by {d}"
    );

    // read by QMatMul on each thread's first use: set before the model is built
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let mut f = std::fs::File::open(gguf_path())?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut f)?;
    let mut q = candle_transformers::models::quantized_gemma3::ModelWeights::from_gguf(
        content,
        &mut f,
        &Device::Cpu,
    )?;
    let quant = q.forward(&row(&prompt), 0)?.flatten_all()?;
    let silu = candle_gemma3_last_logits(w, "silu", &prompt)?;
    let ds = max_abs(&silu, &quant);
    let dq = max_abs(&ours, &quant);
    println!(
        "quantized_gemma3 vs candle gemma3 with a SiLU MLP: max |Δ| = {ds:e}; vs wick: {dq:e}"
    );
    assert!(
        ds < 1e-4 * scale,
        "quantized_gemma3 differs from candle's SiLU gemma3 by {ds}"
    );
    assert!(
        dq > 1.0,
        "quantized_gemma3's SiLU MLP changes the logits by only {dq}"
    );
    Ok(())
}
