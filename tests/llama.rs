//! wick's Llama against candle-transformers (`quantized_llama` on the same GGUF, `llama` on a
//! merged checkpoint), PyTorch transformers (tests/fixtures/smollm2_reference.json, made by
//! scripts/smollm2_fixture.py on the GPU machine) and a composition of plain candle ops (tiny
//! random configs). The real model is SmolLM2-135M-Instruct's GGUF (scripts/fetch_smollm2.sh,
//! which `.ci/run` calls).

#![cfg(feature = "tokenizers")]

mod common;
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var, D};
use common::max_abs;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;
use wick::lora::{self, LoraConfig};
use wick::models::files::{self, Gguf};
use wick::models::tokenizer::{ChatMessage, Pretokenizer, TextTokenizer};
use wick::models::{Decoder, DecoderConfig, DecoderWeights, FineTune, KvCache};
use wick::{Engine, EngineConfig, ParamStore, Precision};

fn gguf_path() -> PathBuf {
    common::data_file(
        "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "scripts/fetch_smollm2.sh",
    )
}

/// The GGUF's weights, read once per test binary (f32, CPU).
fn smollm2() -> &'static DecoderWeights {
    static W: OnceLock<DecoderWeights> = OnceLock::new();
    W.get_or_init(|| files::read_gguf(&gguf_path()).expect("reading the GGUF"))
}

fn model(weights: &DecoderWeights, precision: Precision, ft: &FineTune) -> (ParamStore, Decoder) {
    let store = ParamStore::new(precision, Device::Cpu, 7);
    let m = Decoder::new(&store, weights, ft).expect("model");
    (store, m)
}

#[test]
fn gguf_config_is_smollm2_135m() {
    let w = smollm2();
    let c = &w.config;
    assert_eq!(
        (
            c.num_hidden_layers,
            c.hidden_size,
            c.intermediate_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.vocab_size
        ),
        (30, 576, 1536, 9, 3, 49152)
    );
    assert_eq!(c.rope_theta, 100000.0);
    assert!((c.rms_norm_eps - 1e-5).abs() < 1e-12);
    assert!(c.tie_word_embeddings);
    assert_eq!(
        (c.bos_token_id, c.eos_token_id.clone()),
        (Some(1), Some(wick::models::config::TokenIds::One(2)))
    );
    assert_eq!(w.tensors.len(), 1 + 30 * 9 + 1);
    let params: usize = w.tensors.values().map(Tensor::elem_count).sum();
    assert_eq!(params, 134_515_008); // SmolLM2-135M's count (tied head counted once)
    assert_eq!(
        files::hf_name("blk.7.attn_output.weight").as_deref(),
        Some("model.layers.7.self_attn.o_proj.weight")
    );
    assert_eq!(files::hf_name("blk.7.attn_sinks"), None);
}

#[test]
fn rotary_row_permutation_is_llama_cpp_s() {
    // one head of width 4: HF rows (0, 1 | 2, 3) pair (0, 2) and (1, 3); llama.cpp interleaves
    // the pairs, so the GGUF holds HF rows 0, 2, 1, 3
    let hf = Tensor::arange(0f32, 8., &Device::Cpu)
        .unwrap()
        .reshape((4, 2))
        .unwrap();
    let gguf = files::permute_rotary_rows(&hf, 1).unwrap();
    assert_eq!(
        gguf.to_vec2::<f32>().unwrap(),
        vec![vec![0., 1.], vec![4., 5.], vec![2., 3.], vec![6., 7.]]
    );
    let w = Tensor::randn(0f32, 1., (3 * 64, 5), &Device::Cpu).unwrap();
    let back =
        files::unpermute_rotary_rows(&files::permute_rotary_rows(&w, 3).unwrap(), 3).unwrap();
    assert_eq!(max_abs(&w, &back), 0.0);
    assert!(files::unpermute_rotary_rows(&w, 5).is_err());
}

/// candle-transformers' quantized_llama on the same GGUF, every weight dequantized to f32.
fn quantized_reference() -> candle_transformers::models::quantized_llama::ModelWeights {
    // read by QMatMul on each thread's first use: set before any model is built
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let mut f = std::fs::File::open(gguf_path()).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
    candle_transformers::models::quantized_llama::ModelWeights::from_gguf(
        content,
        &mut f,
        &Device::Cpu,
    )
    .unwrap()
}

/// The prompt of scripts/reference/torch_llama.py, tokenized by the GGUF's tokenizer.
fn prompt() -> Vec<u32> {
    let tok = TextTokenizer::from_gguf(&Gguf::open(&gguf_path()).unwrap()).unwrap();
    tok.encode("ROMEO:\nO, she doth teach the torches to burn bright!")
        .unwrap()
}

#[test]
fn logits_and_greedy_tokens_match_candle_quantized_llama() {
    let mut reference = quantized_reference();
    let (_s, wick) = model(smollm2(), Precision::Fp32, &FineTune::Full);
    let prompt = prompt();
    let x = Tensor::new(&prompt[..], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let theirs = reference.forward(&x, 0).unwrap(); // (1, V): the last position
    let ours = wick.forward_cached(&x, &mut KvCache::default()).unwrap();
    let ours_last = ours
        .narrow(1, prompt.len() - 1, 1)
        .unwrap()
        .squeeze(1)
        .unwrap();
    let d = max_abs(&theirs, &ours_last);
    assert!(d < 2e-3, "last-position logits differ by {d}");

    // greedy with a KV cache on both sides
    let ours = wick.generate(&prompt, 12, 0.0, 0).unwrap();
    let mut theirs = Vec::new();
    reference.clear_kv_cache();
    let mut input = prompt.clone();
    let mut pos = 0;
    for _ in 0..ours.len() {
        let x = Tensor::new(&input[..], &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = reference.forward(&x, pos).unwrap().squeeze(0).unwrap();
        pos += input.len();
        let next = logits.argmax(0).unwrap().to_scalar::<u32>().unwrap();
        theirs.push(next);
        input = vec![next];
    }
    assert_eq!(ours, theirs);
}

#[test]
fn logits_and_tokenizer_match_transformers_fixture() {
    let fx = common::fixture("smollm2_reference.json");
    let tok = TextTokenizer::from_gguf(&Gguf::open(&gguf_path()).unwrap()).unwrap();
    for (text, ids) in fx["texts"]
        .as_array()
        .unwrap()
        .iter()
        .zip(fx["ids"].as_array().unwrap())
    {
        let text = text.as_str().unwrap();
        assert_eq!(
            tok.encode(text).unwrap(),
            common::ids_of(ids),
            "ids of {text:?}"
        );
        assert_eq!(
            tok.decode(&common::ids_of(ids)).unwrap(),
            text,
            "round trip"
        );
    }
    let chat: Vec<ChatMessage> =
        serde_json::from_value::<Vec<HashMap<String, String>>>(fx["chat"].clone())
            .unwrap()
            .into_iter()
            .map(|m| ChatMessage {
                role: m["role"].clone(),
                content: m["content"].clone(),
            })
            .collect();
    assert_eq!(
        tok.apply_chat_template(&chat, true).unwrap(),
        fx["chat_rendered"].as_str().unwrap()
    );
    let prompt_ids = common::ids_of(&fx["prompt_ids"]);
    assert_eq!(
        tok.encode(fx["prompt"].as_str().unwrap()).unwrap(),
        prompt_ids
    );
    // llama.cpp's pre-tokenization splits digits first: a newline run before a digit is one
    // piece there, while GPT-2's regex leaves the last newline to the text after it
    let g = Gguf::open(&gguf_path()).unwrap();
    let cpp = TextTokenizer::from_gguf_with(&g, Pretokenizer::LlamaCpp).unwrap();
    let t = "ACT I\n\n\n1";
    let (a, b) = (tok.encode(t).unwrap(), cpp.encode(t).unwrap());
    assert_ne!(a, b, "{a:?}");
    assert_eq!(tok.decode(&a).unwrap(), t);
    assert_eq!(cpp.decode(&b).unwrap(), t);

    let (_s, wick) = model(smollm2(), Precision::Fp32, &FineTune::Full);
    let x = Tensor::new(&prompt_ids[..], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = wick
        .forward_cached(&x, &mut KvCache::default())
        .unwrap()
        .squeeze(0)
        .unwrap();
    let first16: Vec<Vec<f32>> = logits.narrow(1, 0, 16).unwrap().to_vec2().unwrap();
    let theirs: Vec<Vec<f32>> = serde_json::from_value(fx["logits"]["first16"].clone()).unwrap();
    let mut d = 0f32;
    for (a, b) in first16.iter().zip(&theirs) {
        for (x, y) in a.iter().zip(b) {
            d = d.max((x - y).abs());
        }
    }
    assert!(d < 2e-3, "logits differ from transformers' by {d}");
    let lse: Vec<f32> = candle_nn::ops::log_softmax(&logits, D::Minus1)
        .unwrap()
        .neg()
        .unwrap()
        .add(&logits)
        .unwrap()
        .narrow(1, 0, 1)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let theirs: Vec<f32> = serde_json::from_value(fx["logits"]["logsumexp"].clone()).unwrap();
    for (a, b) in lse.iter().zip(&theirs) {
        assert!((a - b).abs() < 2e-3, "log-sum-exp {a} vs {b}");
    }
    let greedy = wick.generate(&prompt_ids, 16, 0.0, 0).unwrap();
    assert_eq!(greedy, common::ids_of(&fx["greedy16"]));
}

fn tiny() -> DecoderWeights {
    DecoderWeights::random(DecoderConfig::tiny(96), 3).unwrap()
}

fn batch(b: usize, t: usize, seed: u64) -> (Tensor, Tensor) {
    let n = b * (t + 1);
    let ids: Vec<u32> = (0..n as u64)
        .map(|i| ((i * 31 + seed * 17 + i * i * 7) % 96) as u32)
        .collect();
    let all = Tensor::from_vec(ids, (b, t + 1), &Device::Cpu).unwrap();
    (
        all.narrow(1, 0, t).unwrap().contiguous().unwrap(),
        all.narrow(1, 1, t).unwrap().contiguous().unwrap(),
    )
}

#[test]
fn kv_cache_decoding_equals_the_full_forward() {
    let (_s, m) = model(&tiny(), Precision::Fp32, &FineTune::Full);
    let (ids, _) = batch(2, 12, 1);
    let full = m.forward_cached(&ids, &mut KvCache::default()).unwrap();
    let mut cache = KvCache::default();
    let mut parts = vec![m
        .forward_cached(&ids.narrow(1, 0, 5).unwrap(), &mut cache)
        .unwrap()];
    for i in 5..12 {
        parts.push(
            m.forward_cached(&ids.narrow(1, i, 1).unwrap(), &mut cache)
                .unwrap(),
        );
    }
    assert_eq!(cache.len(), 12);
    let inc = Tensor::cat(&parts, 1).unwrap();
    let d = max_abs(&full, &inc);
    assert!(d < 1e-5, "incremental logits differ by {d}");
    assert!(m
        .forward_cached(&ids.narrow(0, 0, 1).unwrap(), &mut cache)
        .is_err()); // batch 1 vs 2
}

#[test]
fn tiny_full_gradients_match_the_composition() {
    let weights = tiny();
    let (store, m) = model(&weights, Precision::Fp32, &FineTune::Full);
    let (ids, targets) = batch(2, 10, 2);
    let loss = m.loss(&ids, &targets).unwrap();
    let grads = loss.backward().unwrap();
    let (vars, plain) = common::decoder_reference::vars(&weights);
    let ref_loss = common::decoder_reference::loss(
        &weights.config,
        &plain,
        &HashMap::new(),
        1.0,
        &ids,
        &targets,
    );
    let ref_grads = ref_loss.backward().unwrap();
    let dl = (loss.to_scalar::<f32>().unwrap() - ref_loss.to_scalar::<f32>().unwrap()).abs();
    assert!(dl < 1e-5, "loss differs by {dl}");
    assert_eq!(store.len(), weights.tensors.len());
    for p in store.params() {
        let ours = grads.get(p.differentiated()).expect("gradient");
        let theirs = ref_grads
            .get(vars[&p.name].as_tensor())
            .expect("reference gradient");
        let scale = max_abs(theirs, &theirs.zeros_like().unwrap()).max(1e-3);
        let d = max_abs(ours, theirs) / scale;
        assert!(d < 1e-4, "{}: relative gradient error {d}", p.name);
    }
}

#[test]
fn block_ops_under_grad_sink_give_the_per_op_loss_and_gradients() -> Result<()> {
    // the engine's path (the blocks as one wick::ops::pre_norm_stack node) against the per-op
    // graph under candle's backward: the same kernels in the same order, so equal exactly; full
    // fine-tuning, and LoRA on q and v only (k, o and the MLP frozen: the node hangs on an
    // adapter, since the frozen embedding's output is not tracked)
    let weights = tiny();
    let mut qv = LoraConfig::all_linear(4, 8.0);
    qv.target_modules = vec!["q_proj".into(), "v_proj".into()];
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        for ft in [FineTune::Full, FineTune::Lora(qv.clone())] {
            let (store, m) = model(&weights, precision, &ft);
            for p in store.params().iter().filter(|p| p.name.contains("lora_B")) {
                p.master.set(&fixed_values(p.master.shape(), 0.05))?;
            }
            store.refresh_working_copies()?;
            let (ids, targets) = batch(2, 10, 5);
            let what = format!("{precision} {ft:?}");
            let loss = || m.loss(&ids, &targets);
            for (name, g) in common::assert_sink_matches_per_op(&store, &what, loss)? {
                let zero = g.zeros_like()?;
                assert!(
                    max_abs(&g, &zero) > 0.0,
                    "{what}: {name} has a zero gradient"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn checkpointing_gives_the_same_gradients() {
    let weights = tiny();
    let (ids, targets) = batch(2, 9, 3);
    let run = |ckpt: bool, ft: &FineTune| {
        let (store, mut m) = model(&weights, Precision::Fp32, ft);
        m.set_checkpointing(ckpt).unwrap();
        let loss = m.loss(&ids, &targets).unwrap();
        let g = loss.backward().unwrap();
        let grads: Vec<(String, Tensor)> = store
            .params()
            .into_iter()
            .map(|p| {
                (
                    p.name.clone(),
                    g.get(p.differentiated()).expect("grad").clone(),
                )
            })
            .collect();
        (loss.to_scalar::<f32>().unwrap(), grads)
    };
    let lora = FineTune::Lora(LoraConfig::all_linear(4, 8.0));
    for ft in [FineTune::Full, lora] {
        let (l0, g0) = run(false, &ft);
        let (l1, g1) = run(true, &ft);
        assert_eq!(l0, l1);
        assert!(!g0.is_empty());
        for ((n, a), (_, b)) in g0.iter().zip(&g1) {
            assert!(
                max_abs(a, b) < 1e-6,
                "{n}: gradient changed by checkpointing"
            );
        }
    }
}

#[test]
fn lora_freezes_the_base_and_matches_the_composition() {
    let weights = tiny();
    let cfg = LoraConfig::all_linear(4, 8.0);
    let (store, m) = model(&weights, Precision::Fp32, &FineTune::Lora(cfg.clone()));
    // only adapters in the store: 4 stacks (qkv, o, gate/up, down) x 2 blocks x (A, B)
    assert_eq!(store.len(), 4 * 2 * 2);
    assert!(store.params().iter().all(|p| lora::is_adapter(&p.name)));
    assert!(store
        .get("model.layers.1.self_attn.{q_proj,k_proj,v_proj}.lora_A.weight")
        .is_some());
    let base_elems: usize = weights.tensors.values().map(Tensor::elem_count).sum();
    assert_eq!(m.frozen_bytes(), base_elems * 4); // f32 store: the base kept in f32
    let (ids, targets) = batch(2, 8, 4);
    // B starts at zero: the adapted model is the base model
    let (_s, base) = model(&weights, Precision::Fp32, &FineTune::Full);
    let l_base = base
        .loss(&ids, &targets)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let l_fresh = m.loss(&ids, &targets).unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(l_base, l_fresh);
    // random B: loss and adapter gradients against the composition with explicit B A
    for p in store.params().iter().filter(|p| p.name.contains("lora_B")) {
        p.master.set(&fixed_values(p.master.shape(), 0.05)).unwrap();
    }
    let loss = m.loss(&ids, &targets).unwrap();
    let grads = loss.backward().unwrap();
    // the reference differentiates one variable per stack, as the model does, and reads each
    // module's adapter as rows of it (A: r rows per module, B: the module's output rows)
    let mut adapters = HashMap::new();
    let mut vars = HashMap::new();
    for p in store.params() {
        let v = Var::from_tensor(&p.master.as_detached_tensor()).unwrap();
        vars.insert(p.name.clone(), v);
    }
    for p in store.params().iter().filter(|p| p.name.contains("lora_A")) {
        let stack = p.name.trim_end_matches(".lora_A.weight").to_string();
        let a = vars[&p.name].as_tensor().clone();
        let b = vars[&format!("{stack}.lora_B.weight")].as_tensor().clone();
        let mut row = 0;
        for (i, module) in lora::stacked_modules(&stack).into_iter().enumerate() {
            let out = weights.tensors[&format!("{module}.weight")].dims()[0];
            let pair = (
                a.narrow(0, i * 4, 4).unwrap(),
                b.narrow(0, row, out).unwrap(),
            );
            row += out;
            adapters.insert(module, pair);
        }
    }
    assert_eq!(adapters.len(), 7 * 2);
    let ref_loss = common::decoder_reference::loss(
        &weights.config,
        &weights.tensors,
        &adapters,
        cfg.scaling(),
        &ids,
        &targets,
    );
    let ref_grads = ref_loss.backward().unwrap();
    let dl = (loss.to_scalar::<f32>().unwrap() - ref_loss.to_scalar::<f32>().unwrap()).abs();
    assert!(dl < 1e-5, "loss differs by {dl}");
    for p in store.params() {
        let ours = grads.get(p.differentiated()).expect("adapter gradient");
        let theirs = ref_grads.get(vars[&p.name].as_tensor()).unwrap();
        let scale = max_abs(theirs, &theirs.zeros_like().unwrap()).max(1e-3);
        assert!(max_abs(ours, theirs) / scale < 1e-4, "{}", p.name);
    }
}

#[test]
fn lora_training_saves_peft_adapters_and_merges() -> Result<()> {
    let weights = tiny();
    let cfg = LoraConfig::all_linear(4, 8.0);
    let store = ParamStore::new(Precision::Bf16Mixed, Device::Cpu, 11);
    let m = Decoder::new(&store, &weights, &FineTune::Lora(cfg.clone()))?;
    assert_eq!(
        m.frozen_bytes(),
        weights
            .tensors
            .values()
            .map(Tensor::elem_count)
            .sum::<usize>()
            * 2
    );
    let mut engine = Engine::new(store.clone(), EngineConfig::adamw(1e-2))?;
    let (ids, targets) = batch(4, 16, 5);
    let first = engine.step(|_| m.loss(&ids, &targets))?.loss()?;
    for _ in 0..20 {
        engine.step(|_| m.loss(&ids, &targets))?;
    }
    let last = engine.step(|_| m.loss(&ids, &targets))?.loss()?;
    assert!(last < first * 0.9, "LoRA did not learn: {first} -> {last}");

    let dir = tempdir("lora");
    let masters = m.adapter_masters(&store)?;
    lora::save_adapter_tensors(masters.clone(), &cfg, "SmolLM2-135M-Instruct", &dir)?;
    let (back_cfg, tensors) = lora::load_adapters(&dir)?;
    assert_eq!(back_cfg, cfg);
    assert_eq!(tensors.len(), 7 * 2 * 2);
    let raw = candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu)?;
    assert!(raw.contains_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
    let masters: HashMap<String, Tensor> = masters.into_iter().collect();
    for (name, t) in &tensors {
        assert_eq!(max_abs(t, &masters[name]), 0.0, "{name}");
    }
    // the per-module masters are rows of the stacks: k_proj's B follows q_proj's 64 rows
    let stack = store
        .get("model.layers.0.self_attn.{q_proj,k_proj,v_proj}.lora_B.weight")
        .expect("stack")
        .master
        .as_detached_tensor();
    let k_b = &masters["model.layers.0.self_attn.k_proj.lora_B.weight"];
    let rows = k_b.dims()[0];
    assert_eq!(max_abs(k_b, &stack.narrow(0, 64, rows)?), 0.0);

    // merged weights: an HF folder that candle-transformers' llama and wick both read back
    let merged = m.merged_weights(&store)?;
    let out = tempdir("merged");
    files::save_pretrained(&merged, &out)?;
    let back = files::read_safetensors(&out)?;
    let (_s, reloaded) = model(&back, Precision::Fp32, &FineTune::Full);
    let ours = m.forward_cached(&ids, &mut KvCache::default())?;
    let theirs = reloaded.forward_cached(&ids, &mut KvCache::default())?;
    // the LoRA model runs its GEMMs in bf16, the merged one in f32
    let d = max_abs(&ours, &theirs);
    assert!(d < 0.1, "merged model's logits differ by {d}");

    let row = ids.narrow(0, 0, 1)?;
    let theirs = common::candle_transformers_llama_last_logits(&out, &row)?; // (1, V)
    let mine = reloaded.forward_cached(&row, &mut KvCache::default())?;
    let mine = mine.narrow(1, 15, 1)?.squeeze(1)?;
    let d = max_abs(&theirs, &mine);
    assert!(
        d < 1e-4,
        "candle-transformers' llama on the merged folder differs by {d}"
    );
    Ok(())
}

/// `scale * sin(i)` over the elements: the same values on every device and run.
fn fixed_values(shape: &candle_core::Shape, scale: f64) -> Tensor {
    let n = shape.elem_count() as u32;
    let t = Tensor::arange(0u32, n, &Device::Cpu).unwrap();
    (t.to_dtype(DType::F32).unwrap().sin().unwrap() * scale)
        .unwrap()
        .reshape(shape)
        .unwrap()
}

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wick-llama-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn bad_weights_name_every_tensor_and_shape() {
    let mut w = tiny();
    w.tensors.remove("model.layers.1.mlp.up_proj.weight");
    w.tensors.insert(
        "model.layers.0.self_attn.k_proj.weight".into(),
        Tensor::zeros((8, 64), DType::F32, &Device::Cpu).unwrap(),
    );
    w.tensors.insert(
        "lm_head.weight".into(),
        Tensor::zeros((96, 64), DType::F32, &Device::Cpu).unwrap(),
    );
    let store = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
    let err = format!(
        "{:#}",
        Decoder::new(&store, &w, &FineTune::Full).err().unwrap()
    );
    for needle in [
        "missing model.layers.1.mlp.up_proj.weight",
        "model.layers.0.self_attn.k_proj.weight: the file has [8, 64], the model expects [32, 64]",
        "unexpected lm_head.weight [96, 64]",
        "3 problem(s)",
    ] {
        assert!(err.contains(needle), "{needle:?} not in {err}");
    }
    assert!(store.is_empty(), "nothing may be added on error");
    let bad = LoraConfig {
        target_modules: vec!["nothing".into()],
        ..LoraConfig::all_linear(2, 4.0)
    };
    assert!(Decoder::new(&store, &tiny(), &FineTune::Lora(bad)).is_err());
}

/// The decoder on CUDA against the same decoder on the CPU: a config with head width 64 (the
/// flash-attention path, 4 query / 2 KV heads), T = 80 (not a tile multiple), loss and every
/// gradient in f32 and bf16-mixed, with and without checkpointing, full and LoRA.
#[cfg(feature = "cuda")]
#[test]
fn cuda_loss_and_gradients_match_the_cpu() {
    let dev = Device::new_cuda(0).unwrap();
    let mut cfg = DecoderConfig::tiny(96);
    cfg.hidden_size = 256;
    cfg.intermediate_size = 384;
    cfg.max_position_embeddings = 128;
    let weights = DecoderWeights::random(cfg, 9).unwrap();
    let (ids, targets) = batch(2, 80, 6);
    let lora = FineTune::Lora(LoraConfig::all_linear(8, 16.0));
    for precision in [Precision::Fp32, Precision::Bf16Mixed] {
        for ft in [FineTune::Full, lora.clone()] {
            for ckpt in [false, true] {
                let run = |device: &Device| {
                    let store = ParamStore::new(precision, device.clone(), 1);
                    let mut m = Decoder::new(&store, &weights, &ft).unwrap();
                    m.set_checkpointing(ckpt).unwrap();
                    if matches!(ft, FineTune::Lora(_)) {
                        for p in store.params().iter().filter(|p| p.name.contains("lora_B")) {
                            let b = fixed_values(p.master.shape(), 0.05);
                            p.master.set(&b.to_device(device).unwrap()).unwrap();
                        }
                        store.refresh_working_copies().unwrap();
                    }
                    let (x, y) = (
                        ids.to_device(device).unwrap(),
                        targets.to_device(device).unwrap(),
                    );
                    let loss = m.loss(&x, &y).unwrap();
                    let g = loss.backward().unwrap();
                    let grads: Vec<(String, Tensor)> = store
                        .params()
                        .into_iter()
                        .map(|p| {
                            let t = g.get(p.differentiated()).expect("grad");
                            (p.name.clone(), t.to_device(&Device::Cpu).unwrap())
                        })
                        .collect();
                    (loss.to_scalar::<f32>().unwrap(), grads)
                };
                let (l_cpu, g_cpu) = run(&Device::Cpu);
                let (l_gpu, g_gpu) = run(&dev);
                let tol = if precision == Precision::Fp32 {
                    1e-4
                } else {
                    3e-2
                };
                assert!(
                    (l_cpu - l_gpu).abs() < tol * l_cpu.abs(),
                    "{precision:?} {ft:?} ckpt {ckpt}: loss {l_cpu} vs {l_gpu}"
                );
                for ((n, a), (_, b)) in g_cpu.iter().zip(&g_gpu) {
                    let scale = max_abs(a, &a.zeros_like().unwrap()).max(1e-4);
                    let d = max_abs(a, b) / scale;
                    assert!(
                        d < tol * 3.0,
                        "{precision:?} ckpt {ckpt} {n}: relative error {d}"
                    );
                }
            }
        }
    }
}

/// LoRA dropout (PEFT's: on the adapters' input only) changes the training loss, trains every
/// adapter, leaves inference alone, and refuses checkpointing (a recomputation would draw
/// another mask).
#[test]
fn lora_dropout_applies_in_training_only() {
    let weights = tiny();
    let cfg = LoraConfig {
        dropout: 0.5,
        ..LoraConfig::all_linear(4, 8.0)
    };
    let (store, mut m) = model(&weights, Precision::Fp32, &FineTune::Lora(cfg.clone()));
    for p in store.params().iter().filter(|p| p.name.contains("lora_B")) {
        p.master.set(&fixed_values(p.master.shape(), 0.05)).unwrap();
    }
    let (store0, m0) = model(
        &weights,
        Precision::Fp32,
        &FineTune::Lora(LoraConfig {
            dropout: 0.0,
            ..cfg
        }),
    );
    for (p, q) in store.params().iter().zip(store0.params()) {
        q.master.set(&p.master.as_detached_tensor()).unwrap();
    }
    let (ids, targets) = batch(2, 8, 7);
    let l = m.loss(&ids, &targets).unwrap();
    let l0 = m0.loss(&ids, &targets).unwrap();
    assert_ne!(
        l.to_scalar::<f32>().unwrap(),
        l0.to_scalar::<f32>().unwrap()
    );
    let g = l.backward().unwrap();
    assert!(store
        .params()
        .iter()
        .all(|p| g.get(p.differentiated()).is_some()));
    let e = m.forward_cached(&ids, &mut KvCache::default()).unwrap();
    let e0 = m0.forward_cached(&ids, &mut KvCache::default()).unwrap();
    assert!(max_abs(&e, &e0) < 1e-5, "inference must not drop");
    assert!(m.set_checkpointing(true).is_err());
}
