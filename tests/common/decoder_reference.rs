//! Independent references for the shared decoder: the whole model written out in plain candle
//! ops from the HF tensors (every family's switches, transformers' semantics; differentiable
//! through candle's autograd), and candle-transformers 0.11.1's own implementation of each
//! family built on the same tensors.

use candle_core::{DType, Device, Tensor, Var, D};
use std::collections::HashMap;
use wick::models::family::{Activation, Family};
use wick::models::{DecoderConfig, DecoderWeights};

/// The tensors of `w` as Vars (to read the reference's gradients by name) and as the plain
/// tensors of those Vars (what [`logits`] and [`loss`] take).
pub fn vars(w: &DecoderWeights) -> (HashMap<String, Var>, HashMap<String, Tensor>) {
    let vars: HashMap<String, Var> = w
        .tensors
        .iter()
        .map(|(k, t)| (k.clone(), Var::from_tensor(t).unwrap()))
        .collect();
    let plain = vars
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    (vars, plain)
}

/// Random weights of `config` ([`DecoderWeights::random`], `seed`) with every 1-D tensor (norm
/// gains, biases) moved by a fixed pattern in `[-0.5, 0.5)` away from its initial value, so
/// that a dropped or misplaced gain or bias shows in the logits.
pub fn drawn_weights(config: DecoderConfig, seed: u64) -> DecoderWeights {
    let mut w = DecoderWeights::random(config, seed).unwrap();
    for (name, t) in w.tensors.iter_mut() {
        if t.rank() == 1 {
            let salt = name.bytes().map(u64::from).sum::<u64>();
            let noise: Vec<f32> = (0..t.elem_count() as u64)
                .map(|i| (((i * 7919 + salt * 104729) % 1000) as f32 / 1000.0) - 0.5)
                .collect();
            let noise = Tensor::from_vec(noise, t.dims(), &Device::Cpu).unwrap();
            *t = (&*t + noise).unwrap();
        }
    }
    w
}

/// Logits `(B, T, V)` f32 of `ids: (B, T)` by the decoder written out in plain candle ops on
/// the HF tensors `w` (f32, CPU; `Var`s for gradients), with LoRA `(A, B)` by module name
/// scaled by `scaling`. Sliding windows keep `W` keys (transformers' mask); attention scale
/// `query_pre_attn_scalar^-1/2` when set.
pub fn logits(
    cfg: &DecoderConfig,
    w: &HashMap<String, Tensor>,
    adapters: &HashMap<String, (Tensor, Tensor)>,
    scaling: f64,
    ids: &Tensor,
) -> Tensor {
    let (b, t) = ids.dims2().unwrap();
    let (c, h, hkv, d) = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim(),
    );
    let s = cfg.model_type.switches();
    let rms = |x: &Tensor, g: &Tensor| -> Tensor {
        let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        let g = (g + s.norm_offset).unwrap();
        x.broadcast_div(&(ms + cfg.rms_norm_eps).unwrap().sqrt().unwrap())
            .unwrap()
            .broadcast_mul(&g)
            .unwrap()
    };
    let lin = |x: &Tensor, module: &str| -> Tensor {
        let mut y = x
            .broadcast_matmul(&w[&format!("{module}.weight")].t().unwrap())
            .unwrap();
        if let Some(bias) = w.get(&format!("{module}.bias")) {
            y = y.broadcast_add(bias).unwrap();
        }
        match adapters.get(module) {
            Some((a, bm)) => {
                let u = x.broadcast_matmul(&a.t().unwrap()).unwrap();
                (y + (u.broadcast_matmul(&bm.t().unwrap()).unwrap() * scaling).unwrap()).unwrap()
            }
            None => y,
        }
    };
    let tables = |sliding: bool| {
        let inv = cfg.rope_inv_freq_of(sliding);
        let ang: Vec<f32> = (0..t)
            .flat_map(|p| inv.iter().map(move |f| (p as f64 * f) as f32))
            .collect();
        let ang = Tensor::from_vec(ang, (t, d / 2), &Device::Cpu).unwrap();
        (ang.cos().unwrap(), ang.sin().unwrap())
    };
    let rope = |x: &Tensor, (cos, sin): &(Tensor, Tensor)| -> Tensor {
        // x: (B, heads, T, D)
        let x1 = x.narrow(D::Minus1, 0, d / 2).unwrap();
        let x2 = x.narrow(D::Minus1, d / 2, d / 2).unwrap();
        let a = (x1.broadcast_mul(cos).unwrap() - x2.broadcast_mul(sin).unwrap()).unwrap();
        let bb = (x2.broadcast_mul(cos).unwrap() + x1.broadcast_mul(sin).unwrap()).unwrap();
        Tensor::cat(&[a, bb], D::Minus1).unwrap()
    };
    let heads = |x: Tensor, n: usize| {
        x.reshape((b, t, n, d))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    let repeat = |x: Tensor| {
        x.unsqueeze(2)
            .unwrap()
            .broadcast_as((b, hkv, h / hkv, t, d))
            .unwrap()
            .reshape((b, h, t, d))
            .unwrap()
    };
    let mask = |window: Option<usize>| {
        let m: Vec<f32> = (0..t * t)
            .map(|k| {
                let (i, j) = (k / t, k % t);
                let seen = j <= i && window.is_none_or(|w| i - j < w);
                if seen {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        Tensor::from_vec(m, (t, t), &Device::Cpu).unwrap()
    };
    let scale = cfg.query_pre_attn_scalar.unwrap_or(d as f64).sqrt();
    let embed = &w["model.embed_tokens.weight"];
    let mut x = embed
        .index_select(&ids.flatten_all().unwrap(), 0)
        .unwrap()
        .reshape((b, t, c))
        .unwrap();
    if s.embed_scale {
        x = (x * (c as f64).sqrt()).unwrap();
    }
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let g = |name: &str| &w[&format!("{p}.{name}.weight")];
        let n = rms(&x, g("input_layernorm"));
        let mut q = heads(lin(&n, &format!("{p}.self_attn.q_proj")), h);
        let mut k = heads(lin(&n, &format!("{p}.self_attn.k_proj")), hkv);
        if s.qk_norm {
            q = rms(&q, g("self_attn.q_norm"));
            k = rms(&k, g("self_attn.k_norm"));
        }
        let table = tables(cfg.layer_is_sliding(i) && cfg.rope_local_base_freq.is_some());
        let q = rope(&q, &table);
        let k = repeat(rope(&k, &table));
        let v = repeat(heads(lin(&n, &format!("{p}.self_attn.v_proj")), hkv));
        let sc = (q.matmul(&k.t().unwrap()).unwrap() / scale).unwrap();
        let sc = sc.broadcast_add(&mask(cfg.layer_window(i))).unwrap();
        let pr = candle_nn::ops::softmax(&sc, D::Minus1).unwrap();
        let a = pr
            .matmul(&v)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b, t, h * d))
            .unwrap();
        let mut y = lin(&a, &format!("{p}.self_attn.o_proj"));
        let mlp_norm = if s.sandwich_norms {
            y = rms(&y, g("post_attention_layernorm"));
            "pre_feedforward_layernorm"
        } else {
            "post_attention_layernorm"
        };
        x = (x + y).unwrap();
        let n = rms(&x, g(mlp_norm));
        let gate = lin(&n, &format!("{p}.mlp.gate_proj"));
        let up = lin(&n, &format!("{p}.mlp.up_proj"));
        let act = match s.activation {
            Activation::SwiGlu => gate.silu().unwrap(),
            Activation::GeGluTanh => gate.gelu().unwrap(),
        };
        let mut m = lin(&(act * up).unwrap(), &format!("{p}.mlp.down_proj"));
        if s.sandwich_norms {
            m = rms(&m, g("post_feedforward_layernorm"));
        }
        x = (x + m).unwrap();
    }
    let head = w.get("lm_head.weight").unwrap_or(embed);
    rms(&x, &w["model.norm.weight"])
        .broadcast_matmul(&head.t().unwrap())
        .unwrap()
}

/// Mean next-token cross-entropy of [`logits`] against `targets: (B, T)`.
pub fn loss(
    cfg: &DecoderConfig,
    w: &HashMap<String, Tensor>,
    adapters: &HashMap<String, (Tensor, Tensor)>,
    scaling: f64,
    ids: &Tensor,
    targets: &Tensor,
) -> Tensor {
    let l = logits(cfg, w, adapters, scaling, ids);
    let v = cfg.vocab_size;
    candle_nn::loss::cross_entropy(
        &l.reshape(((), v)).unwrap(),
        &targets.flatten_all().unwrap(),
    )
    .unwrap()
}

/// candle-transformers 0.11.1's model of `cfg`'s family built on the HF tensors `w` (f32,
/// CPU): the logits of `ids: (1, T)` at the last position, `(V,)`. Its Mistral mask keeps
/// `W + 1` keys, so it is given `sliding_window - 1` to mean transformers' `W`; its Gemma 3
/// cannot prefill past its rotating cache's window, so it is fed one token at a time (its
/// cache of `W` positions then holds transformers' `W` keys), and it ignores
/// `query_pre_attn_scalar` (it scales by `head_dim^-1/2`).
pub fn candle_transformers_last_logits(
    cfg: &DecoderConfig,
    w: &HashMap<String, Tensor>,
    ids: &Tensor,
) -> anyhow::Result<Tensor> {
    use anyhow::Context;
    use candle_transformers::models::{gemma3, mistral, qwen2, qwen3};
    let vb = candle_nn::VarBuilder::from_tensors(w.clone(), DType::F32, &Device::Cpu);
    let mut json = serde_json::to_value(cfg)?;
    let m = json.as_object_mut().unwrap();
    let d = cfg.head_dim();
    let window = cfg.sliding_window.map(|w| w - 1);
    let set =
        |m: &mut serde_json::Map<String, serde_json::Value>, k: &str, v: serde_json::Value| {
            m.insert(k.into(), v);
        };
    set(m, "hidden_act", "silu".into());
    set(m, "head_dim", d.into());
    set(m, "attention_bias", false.into());
    set(m, "use_sliding_window", false.into());
    set(m, "max_window_layers", cfg.num_hidden_layers.into());
    let last = match cfg.model_type {
        Family::Qwen2 => {
            // its mask always applies sliding_window: make it not bind
            set(m, "sliding_window", 1_000_000.into());
            let c: qwen2::Config = serde_json::from_value(json)?;
            qwen2::ModelForCausalLM::new(&c, vb)?.forward(ids, 0)?
        }
        Family::Qwen3 => {
            let c: qwen3::Config = serde_json::from_value(json)?;
            qwen3::ModelForCausalLM::new(&c, vb)?.forward(ids, 0)?
        }
        Family::Mistral => {
            set(m, "sliding_window", window.into());
            let c: mistral::Config = serde_json::from_value(json)?;
            mistral::Model::new(&c, vb)?.forward(ids, 0)?
        }
        Family::Gemma3 => {
            set(m, "hidden_activation", "gelu_pytorch_tanh".into());
            set(
                m,
                "sliding_window",
                cfg.sliding_window.unwrap_or(1_000_000).into(),
            );
            set(m, "final_logit_softcapping", serde_json::Value::Null);
            set(m, "attn_logit_softcapping", serde_json::Value::Null);
            let pattern = (0..cfg.num_hidden_layers)
                .position(|i| !cfg.layer_is_sliding(i))
                .map_or(cfg.num_hidden_layers + 1, |i| i + 1);
            set(m, "sliding_window_pattern", pattern.into());
            set(m, "query_pre_attn_scalar", d.into());
            let c: gemma3::Config = serde_json::from_value(json)?;
            let mut model = gemma3::Model::new(false, &c, vb)?;
            let mut last = None;
            for i in 0..ids.dims2()?.1 {
                last = Some(model.forward(&ids.narrow(1, i, 1)?, i)?);
            }
            last.context("no ids")?
        }
        Family::Llama => anyhow::bail!("use common::candle_transformers_llama_last_logits"),
    };
    Ok(last.flatten_all()?)
}
