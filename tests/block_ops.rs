//! `wick::ops::mlp_block`, `attention_block` and `pre_norm_stack`: the one-node form (built
//! under `grad_sink::forward_for_sink`, differentiated with `grad_sink::backward`) against the
//! per-op composition it replaces (candle's backward): GPT-2's halves (LayerNorm, linear,
//! act_linear or attention and linear, residual add) and Llama's (RMSNorm, stacked linears
//! without bias, rotary embedding, grouped attention, SwiGLU; full fine-tuning and LoRA with a
//! frozen base) and BERT's post-LayerNorm feed-forward sub-block. The same kernels run in the same order, so the value and every gradient must be
//! equal exactly, on the CPU and, with the `cuda` feature, on the GPU.

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::{Rng, SeedableRng};
use wick::grad_sink;
use wick::ops::{self, Activation, AttentionParams, Half, Layer, MlpParams, NormParams};

fn uniform(shape: &[usize], lo: f32, hi: f32, seed: u64, dtype: DType, dev: &Device) -> Tensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let v: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|_| rng.random_range(lo..hi))
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .and_then(|t| t.to_device(dev))
        .expect("random tensor")
}

/// Largest |a - b| (both cast to f32); 0 means equal (signed zeros compare equal).
fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    assert_eq!(a.dims(), b.dims());
    let f = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
    let (a, b) = (f(a)?, f(b)?);
    assert!(
        a.iter().chain(&b).all(|v| v.is_finite()),
        "non-finite values"
    );
    Ok(a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max))
}

/// x `(2, 7, c)` f32, LayerNorm gain and bias f32, two linear layers `(hid, c)` and
/// `(c, hid')` in the compute dtype with f32 biases (wick's mixed-precision layout), and
/// upstream weights r.
struct Case {
    x: Var,
    params: Vec<(&'static str, Var)>,
    r: Tensor,
}

fn case(
    c: usize,
    hid: usize,
    hid2: usize,
    compute: DType,
    seed: u64,
    dev: &Device,
) -> Result<Case> {
    let var = |shape: &[usize], lo, hi, s, dtype| {
        Var::from_tensor(&uniform(shape, lo, hi, seed + s, dtype, dev))
    };
    let params = vec![
        ("ln_w", var(&[c], 0.5, 1.5, 1, DType::F32)?),
        ("ln_b", var(&[c], -0.5, 0.5, 2, DType::F32)?),
        ("w1", var(&[hid, c], -0.5, 0.5, 3, compute)?),
        ("b1", var(&[hid], -0.5, 0.5, 4, DType::F32)?),
        ("w2", var(&[c, hid2], -0.3, 0.3, 5, compute)?),
        ("b2", var(&[c], -0.5, 0.5, 6, DType::F32)?),
    ];
    Ok(Case {
        x: var(&[2, 7, c], -2.0, 2.0, 0, DType::F32)?,
        params,
        r: uniform(&[2, 7, c], -1.0, 1.0, seed + 7, DType::F32, dev),
    })
}

impl Case {
    fn p(&self, i: usize) -> &Tensor {
        self.params[i].1.as_tensor()
    }
    fn norm(&self) -> NormParams<'_> {
        NormParams {
            w: self.p(0),
            b: Some(self.p(1)),
            eps: 1e-5,
        }
    }
    fn mlp(&self, act: Activation) -> MlpParams<'_> {
        MlpParams {
            norm: self.norm(),
            fc_w: self.p(2),
            fc_b: self.p(3),
            fc2_w: self.p(4),
            fc2_b: self.p(5),
            act,
        }
    }
    fn attention(&self, n_head: usize, n_kv_head: usize) -> AttentionParams<'_> {
        AttentionParams {
            norm: self.norm(),
            qkv_w: self.p(2),
            qkv_b: self.p(3),
            proj_w: self.p(4),
            proj_b: self.p(5),
            n_head,
            n_kv_head,
        }
    }
}

/// The block under the sink (one node) and its composition under candle's backward: the value
/// and the gradients of x and of every parameter equal exactly.
fn same(name: &str, k: &Case, block: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<()> {
    let x = k.x.as_tensor();
    let one = grad_sink::forward_for_sink(|| block(x))?;
    let g1 = grad_sink::backward(&(&one * &k.r)?.sum_all()?)?;
    let per_op = block(x)?;
    let g2 = (&per_op * &k.r)?.sum_all()?.backward()?;
    assert_eq!(max_diff(&one, &per_op)?, 0.0, "{name}: value");
    let all = std::iter::once(("x", &k.x)).chain(k.params.iter().map(|(n, v)| (*n, v)));
    for (what, v) in all {
        let (Some(a), Some(b)) = (g1.get(v.as_tensor()), g2.get(v.as_tensor())) else {
            panic!("{name}: no gradient for {what}")
        };
        assert_eq!(a.dtype(), b.dtype(), "{name}: {what}'s gradient dtype");
        assert_eq!(max_diff(a, b)?, 0.0, "{name}: gradient of {what}");
    }
    Ok(())
}

/// `f` under the sink (one node, differentiated with `grad_sink::backward`) and as the
/// composition under candle's backward, each weighted by `r`: the values, and the gradients
/// (dtype and value) of every tensor in `trained`, equal exactly; and the one-node form was
/// built (candle's own backward cannot carry its parameters). Returns the sink's gradients.
fn one_node_matches(
    name: &str,
    f: &dyn Fn() -> Result<Tensor>,
    trained: &[&Tensor],
    r: &Tensor,
) -> Result<candle_core::backprop::GradStore> {
    let one = grad_sink::forward_for_sink(f)?;
    let g1 = grad_sink::backward(&(&one * r)?.sum_all()?)?;
    let per_op = f()?;
    let g2 = (&per_op * r)?.sum_all()?.backward()?;
    assert_eq!(max_diff(&one, &per_op)?, 0.0, "{name}: value");
    for (i, t) in trained.iter().enumerate() {
        let (Some(a), Some(b)) = (g1.get(t), g2.get(t)) else {
            panic!("{name}: no gradient for tensor {i}")
        };
        assert_eq!(a.dtype(), b.dtype(), "{name}: tensor {i}'s gradient dtype");
        assert_eq!(max_diff(a, b)?, 0.0, "{name}: gradient of tensor {i}");
    }
    let again = grad_sink::forward_for_sink(f)?;
    assert!(
        (&again * r)?.sum_all()?.backward().is_err(),
        "{name}: no node was built"
    );
    Ok(g1)
}

fn check_against_composition(dev: &Device) -> Result<()> {
    let acts = [Activation::GeluTanh, Activation::GeluErf, Activation::Relu];
    for (i, compute) in [DType::F32, DType::BF16, DType::F16]
        .into_iter()
        .enumerate()
    {
        for (j, act) in acts.into_iter().enumerate() {
            let k = case(16, 40, 40, compute, 100 * (3 * i + j) as u64, dev)?;
            let f = |x: &Tensor| ops::mlp_block(x, &k.mlp(act), compute);
            same(&format!("mlp_block {compute:?} {act:?}"), &k, &f)?;
        }
        // attention over heads of width 64: multi-head, and grouped-query (3 query heads per
        // key/value head)
        for (h, hkv) in [(2, 2), (3, 1)] {
            let (c, w) = (h * 64, (h + 2 * hkv) * 64);
            let k = case(c, w, c, compute, 50 + 10 * (h + i) as u64, dev)?;
            let f = |x: &Tensor| ops::attention_block(x, &k.attention(h, hkv), compute);
            same(
                &format!("attention_block {compute:?} H{h} Hkv{hkv}"),
                &k,
                &f,
            )?;
        }
    }
    Ok(())
}

/// Two GPT-like blocks (`[Attention, Mlp, Attention, Mlp]`, C = 128, two heads, hidden 256) as
/// one stack node under the sink against the four halves' compositions under candle's
/// backward: the value and the gradients of x and of all 24 parameters equal exactly.
fn check_stack(dev: &Device, compute: DType) -> Result<()> {
    let (c, hid) = (128, 256);
    let cases = [
        case(c, 3 * c, c, compute, 3000, dev)?,
        case(c, hid, hid, compute, 3100, dev)?,
        case(c, 3 * c, c, compute, 3200, dev)?,
        case(c, hid, hid, compute, 3300, dev)?,
    ];
    let halves = [
        Half::Attention(cases[0].attention(2, 2)),
        Half::Mlp(cases[1].mlp(Activation::GeluTanh)),
        Half::Attention(cases[2].attention(2, 2)),
        Half::Mlp(cases[3].mlp(Activation::GeluTanh)),
    ];
    let (x, r) = (cases[0].x.as_tensor(), &cases[0].r);
    let params = cases
        .iter()
        .flat_map(|k| k.params.iter().map(|(_, v)| v.as_tensor()));
    let trained: Vec<&Tensor> = std::iter::once(x).chain(params).collect();
    let f = || ops::pre_norm_stack(x, &halves, compute);
    one_node_matches(&format!("pre_norm_stack {compute:?}"), &f, &trained, r)?;
    Ok(())
}

/// A Llama-like block's tensors (C = 128, two query heads sharing one key/value head of width
/// 64, SwiGLU width 96): full fine-tuning (every tensor a variable: norm gains f32, linears in
/// the compute dtype, q/k/v and gate/up as separate parts) or LoRA (the base frozen constants
/// in the compute dtype, rank-4 adapters on q, v, o and down as variables).
struct LlamaBlock {
    norms: [Tensor; 2],
    qkv: Vec<Tensor>,
    o: Vec<Tensor>,
    gate_up: Vec<Tensor>,
    down: Vec<Tensor>,
    /// LoRA: `(a, b)` of qkv (q and v adapted), o and down; their `(rows, rank)` parts.
    lora: Option<[(Var, Var); 3]>,
    vars: Vec<Var>,
}

const QKV_PARTS: [(usize, usize); 3] = [(128, 4), (64, 0), (64, 4)];
const O_PARTS: [(usize, usize); 1] = [(128, 4)];

fn llama_block(compute: DType, lora: bool, seed: u64, dev: &Device) -> Result<LlamaBlock> {
    let mut vars = Vec::new();
    let mut n = 0;
    let mut t = |shape: &[usize], lo: f32, hi: f32, dtype: DType, trained: bool| {
        n += 1;
        let t = uniform(shape, lo, hi, seed + n, dtype, dev);
        if !trained {
            return Ok(t);
        }
        let v = Var::from_tensor(&t)?;
        vars.push(v.clone());
        Ok::<_, candle_core::Error>(v.as_tensor().clone())
    };
    let full = !lora;
    let norm_dtype = if lora { compute } else { DType::F32 };
    let norms = [
        t(&[128], 0.5, 1.5, norm_dtype, full)?,
        t(&[128], 0.5, 1.5, norm_dtype, full)?,
    ];
    let mut linear = |rows: &[usize], cols: usize| -> Result<Vec<Tensor>> {
        let parts: Vec<Tensor> = rows
            .iter()
            .map(|&r| t(&[r, cols], -0.2, 0.2, compute, full))
            .collect::<Result<_>>()?;
        // LoRA: the frozen parts stacked once, as the model keeps them
        Ok(if lora && parts.len() > 1 {
            vec![Tensor::cat(&parts, 0)?]
        } else {
            parts
        })
    };
    let (qkv, o) = (linear(&[128, 64, 64], 128)?, linear(&[128], 128)?);
    let (gate_up, down) = (linear(&[96, 96], 128)?, linear(&[128], 96)?);
    let lora = if lora {
        let mut adapter = |r_sum: usize, k: usize, rows: usize| -> Result<(Var, Var)> {
            let a = Var::from_tensor(&t(&[r_sum, k], -0.3, 0.3, compute, false)?)?;
            let b = Var::from_tensor(&t(&[rows, 4], -0.3, 0.3, compute, false)?)?;
            Ok((a, b))
        };
        let adapters = [
            adapter(8, 128, 192)?,
            adapter(4, 128, 128)?,
            adapter(4, 96, 128)?,
        ];
        vars.extend(adapters.iter().flat_map(|(a, b)| [a.clone(), b.clone()]));
        Some(adapters)
    } else {
        None
    };
    Ok(LlamaBlock {
        norms,
        qkv,
        o,
        gate_up,
        down,
        lora,
        vars,
    })
}

impl LlamaBlock {
    /// The block's two halves' layers: `[qkv, rotary, attention, o]` and `[gate_up, swiglu,
    /// down]`.
    fn layers<'a>(&'a self, cos: &'a Tensor, sin: &'a Tensor) -> [Vec<Layer<'a>>; 2] {
        let plain = |parts: &'a [Tensor]| Layer::Linear { parts, b: &[] };
        let adapted = |parts: &'a [Tensor], i: usize, rows: &'a [(usize, usize)]| match &self.lora {
            Some(ad) => Layer::LoraLinear {
                w: &parts[0],
                a: ad[i].0.as_tensor(),
                b: ad[i].1.as_tensor(),
                parts: rows,
                scale: 2.0,
                dropout: 0.0,
            },
            None => plain(parts),
        };
        let rotary = Layer::Rotary {
            cos,
            sin,
            n_head: 2,
            n_kv_head: 1,
        };
        let attention = Layer::Attention {
            n_head: 2,
            n_kv_head: 1,
        };
        [
            vec![
                adapted(&self.qkv, 0, &QKV_PARTS),
                rotary,
                attention,
                adapted(&self.o, 1, &O_PARTS),
            ],
            vec![
                plain(&self.gate_up),
                Layer::SwiGlu,
                adapted(&self.down, 2, &O_PARTS),
            ],
        ]
    }
}

/// Two Llama-like blocks as one stack under the sink against their compositions under candle's
/// backward: the value and the gradients of x (when trained) and of every variable equal
/// exactly. With LoRA, x is a constant (a frozen embedding's output), so the node hangs on a
/// parameter.
fn check_llama_stack(dev: &Device, compute: DType, lora: bool) -> Result<()> {
    let blocks = [
        llama_block(compute, lora, 7000, dev)?,
        llama_block(compute, lora, 7100, dev)?,
    ];
    let (cos, sin) = ops::rotary_tables(7, 64, 10000.0, 0, dev)?;
    let layers: Vec<[Vec<Layer<'_>>; 2]> = blocks.iter().map(|b| b.layers(&cos, &sin)).collect();
    let mut halves = Vec::new();
    for (b, [attn, mlp]) in blocks.iter().zip(&layers) {
        let norm = |w| NormParams {
            w,
            b: None,
            eps: 1e-5,
        };
        halves.push(Half::Branch(norm(&b.norms[0]), attn));
        halves.push(Half::Branch(norm(&b.norms[1]), mlp));
    }
    let x = Var::from_tensor(&uniform(&[2, 7, 128], -2.0, 2.0, 7200, DType::F32, dev))?;
    let x = if lora {
        x.as_tensor().detach()
    } else {
        x.as_tensor().clone()
    };
    let r = uniform(&[2, 7, 128], -1.0, 1.0, 7300, DType::F32, dev);
    let name = format!("Llama stack {compute:?} lora {lora}");
    let vars = blocks
        .iter()
        .flat_map(|b| b.vars.iter().map(Var::as_tensor));
    let trained: Vec<&Tensor> = (!lora).then_some(&x).into_iter().chain(vars).collect();
    assert_eq!(trained.len(), if lora { 12 } else { 19 });
    let f = || ops::pre_norm_stack(&x, &halves, compute);
    one_node_matches(&name, &f, &trained, &r)?;
    Ok(())
}

/// BERT's post-LayerNorm feed-forward sub-block (and the RMSNorm variant) under the sink
/// against its composition: the value and every gradient equal exactly; with x a constant,
/// the node hangs on a parameter.
fn check_post_norm(dev: &Device) -> Result<()> {
    for (i, compute) in [DType::F32, DType::BF16, DType::F16]
        .into_iter()
        .enumerate()
    {
        let k = case(32, 64, 64, compute, 8000 + 10 * i as u64, dev)?;
        let layers = [
            Layer::Linear {
                parts: std::slice::from_ref(k.p(2)),
                b: std::slice::from_ref(k.p(3)),
            },
            Layer::ActLinear {
                w: k.p(4),
                b: k.p(5),
                act: Activation::GeluErf,
            },
        ];
        let ln = k.norm();
        let f = |x: &Tensor| ops::post_norm_block(x, &layers, &ln);
        same(&format!("post_norm_block {compute:?}"), &k, &f)?;
        // the RMSNorm variant (the LayerNorm's bias left out: it gets no gradient)
        let rms = NormParams { b: None, ..ln };
        let x = k.x.as_tensor();
        let f = || ops::post_norm_block(x, &layers, &rms);
        let trained = [x, k.p(0), k.p(2), k.p(3), k.p(4), k.p(5)];
        one_node_matches(&format!("RMS post-norm {compute:?}"), &f, &trained, &k.r)?;
        // x a constant: the parameters' gradients still equal, x gets none
        let c = x.detach();
        let f = || ops::post_norm_block(&c, &layers, &ln);
        let trained: Vec<&Tensor> = k.params.iter().map(|(_, v)| v.as_tensor()).collect();
        let g1 = one_node_matches(&format!("constant x {compute:?}"), &f, &trained, &k.r)?;
        assert!(g1.get(&c).is_none());
        check_bert_attention(&k, compute, 8200 + 10 * i as u64, dev)?;
    }
    let k = case(8, 16, 16, DType::F32, 8100, dev)?;
    let e = ops::post_norm_block(k.x.as_tensor(), &[], &k.norm()).unwrap_err();
    assert!(e.to_string().contains("no layers"), "{e}");
    Ok(())
}

/// BERT's attention sub-block as a post-norm node: q, k and v projections stacked as parts
/// with their biases, bidirectional attention of 2 heads over right-padded rows (lengths 7 and
/// 4 of 7), the output projection; value and every gradient equal to the composition's.
fn check_bert_attention(k: &Case, compute: DType, seed: u64, dev: &Device) -> Result<()> {
    let c = k.x.as_tensor().dim(2)?;
    let var = |shape: &[usize], lo, hi, s, dtype| {
        Var::from_tensor(&uniform(shape, lo, hi, seed + s, dtype, dev))
    };
    let mut vars = Vec::new();
    for j in 0..3 {
        vars.push(var(&[c, c], -0.5, 0.5, j, compute)?);
    }
    for j in 0..3 {
        vars.push(var(&[c], -0.5, 0.5, 3 + j, DType::F32)?);
    }
    vars.push(var(&[c, c], -0.3, 0.3, 6, compute)?);
    vars.push(var(&[c], -0.5, 0.5, 7, DType::F32)?);
    let t: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let layers = [
        Layer::Linear {
            parts: &t[0..3],
            b: &t[3..6],
        },
        Layer::PaddedAttention {
            n_head: 2,
            key_lengths: &[7, 4],
        },
        Layer::Linear {
            parts: &t[6..7],
            b: &t[7..8],
        },
    ];
    let (x, ln) = (k.x.as_tensor(), k.norm());
    let f = || ops::post_norm_block(x, &layers, &ln);
    let trained: Vec<&Tensor> = [x, k.p(0), k.p(1)].into_iter().chain(&t).collect();
    one_node_matches(&format!("BERT attention {compute:?}"), &f, &trained, &k.r)?;
    // the padded keys get no weight: the rows of batch entry 1 do not change when its keys
    // 4.. change
    let y = ops::key_padding_attention(
        &ops::linear(
            x,
            &Tensor::cat(&t[0..3], 0)?,
            Some(&Tensor::cat(&t[3..6], 0)?),
        )?,
        2,
        &[7, 4],
    )?;
    let x2 = x.slice_assign(
        &[1..2, 4..7, 0..c],
        &x.narrow(1, 4, 3)?.narrow(0, 1, 1)?.affine(3.0, 1.0)?,
    )?;
    let y2 = ops::key_padding_attention(
        &ops::linear(
            &x2,
            &Tensor::cat(&t[0..3], 0)?,
            Some(&Tensor::cat(&t[3..6], 0)?),
        )?,
        2,
        &[7, 4],
    )?;
    let rows = |y: &Tensor| y.narrow(0, 1, 1).and_then(|r| r.narrow(1, 0, 4));
    assert_eq!(
        max_diff(&rows(&y)?, &rows(&y2)?)?,
        0.0,
        "BERT attention {compute:?}: padding"
    );
    Ok(())
}

#[test]
fn post_norm_blocks_equal_their_composition_on_cpu() -> Result<()> {
    check_post_norm(&Device::Cpu)
}

#[test]
fn llama_blocks_equal_their_composition_on_cpu() -> Result<()> {
    for compute in [DType::F32, DType::BF16] {
        check_llama_stack(&Device::Cpu, compute, false)?;
        check_llama_stack(&Device::Cpu, compute, true)?;
    }
    Ok(())
}

#[test]
fn block_ops_equal_the_per_op_composition_on_cpu() -> Result<()> {
    check_against_composition(&Device::Cpu)
}

#[test]
fn a_stack_of_two_blocks_equals_its_halves_on_cpu() -> Result<()> {
    check_stack(&Device::Cpu, DType::F32)?;
    check_stack(&Device::Cpu, DType::BF16)
}

#[test]
fn block_ops_need_grad_sinks_backward_and_handle_frozen_parameters() -> Result<()> {
    let dev = Device::Cpu;
    let k = case(8, 16, 16, DType::F32, 900, &dev)?;
    let x = k.x.as_tensor();
    // built as one node, then differentiated with candle's own backward: a clear error
    let y = grad_sink::forward_for_sink(|| {
        ops::mlp_block(x, &k.mlp(Activation::GeluTanh), DType::F32)
    })?;
    let e = (&y * &k.r)?
        .sum_all()?
        .backward()
        .expect_err("parameter gradients have no sink");
    assert!(e.to_string().contains("wick::grad_sink::backward"), "{e}");
    let a = case(64, 192, 64, DType::F32, 901, &dev)?;
    let y = grad_sink::forward_for_sink(|| {
        ops::attention_block(a.x.as_tensor(), &a.attention(1, 1), DType::F32)
    })?;
    let e = (&y * &a.r)?
        .sum_all()?
        .backward()
        .expect_err("parameter gradients have no sink");
    assert!(e.to_string().contains("wick::grad_sink::backward"), "{e}");
    // a LayerNorm gain computed from a variable (not one itself: no sink could take its
    // gradient): the per-op composition, which candle's backward differentiates (the one-node
    // form would have failed as above)
    let computed = k.p(0).affine(1.0, 0.0)?;
    let mut p = k.mlp(Activation::GeluTanh);
    p.norm.w = &computed;
    let y = grad_sink::forward_for_sink(|| ops::mlp_block(x, &p, DType::F32))?;
    let g = (&y * &k.r)?.sum_all()?.backward()?;
    assert!(g.get(x).is_some() && g.get(k.p(2)).is_some());
    // a frozen LayerNorm bias and fc bias (untracked constants) keep the one-node form, whose
    // backward drops their gradients as the composition leaves them unused
    let (lb, fb) = (k.p(1).detach(), k.p(3).detach());
    let mut p = k.mlp(Activation::GeluTanh);
    (p.norm.b, p.fc_b) = (Some(&lb), &fb);
    let one = grad_sink::forward_for_sink(|| ops::mlp_block(x, &p, DType::F32))?;
    let again = grad_sink::forward_for_sink(|| ops::mlp_block(x, &p, DType::F32))?;
    assert!(
        (&again * &k.r)?.sum_all()?.backward().is_err(),
        "no node was built"
    );
    let g1 = grad_sink::backward(&(&one * &k.r)?.sum_all()?)?;
    let g2 = (&ops::mlp_block(x, &p, DType::F32)? * &k.r)?
        .sum_all()?
        .backward()?;
    for t in [x, k.p(0), k.p(2), k.p(4), k.p(5)] {
        let (Some(a), Some(b)) = (g1.get(t), g2.get(t)) else {
            panic!("frozen biases: a tracked tensor lost its gradient")
        };
        assert_eq!(max_diff(a, b)?, 0.0);
    }
    assert!(g1.get(&lb).is_none() && g1.get(&fb).is_none());
    let p = k.mlp(Activation::GeluTanh);
    // bad input: the composition's errors, named after the op that raised them
    let bf16_x = x.to_dtype(DType::BF16)?;
    let e = grad_sink::forward_for_sink(|| ops::mlp_block(&bf16_x, &p, DType::F32)).unwrap_err();
    assert!(e.to_string().contains("residual_add"), "{e}");
    let e = grad_sink::forward_for_sink(|| {
        ops::attention_block(a.x.as_tensor(), &a.attention(5, 1), DType::F32)
    })
    .unwrap_err();
    assert!(e.to_string().contains("attention"), "{e}");
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::{DType, Device, Result};

    #[test]
    fn block_ops_equal_the_per_op_composition_on_cuda() -> Result<()> {
        super::check_against_composition(&Device::new_cuda(0)?)
    }

    #[test]
    fn post_norm_blocks_equal_their_composition_on_cuda() -> Result<()> {
        super::check_post_norm(&Device::new_cuda(0)?)
    }

    #[test]
    fn llama_blocks_equal_their_composition_on_cuda() -> Result<()> {
        let dev = Device::new_cuda(0)?;
        // f32: RMSNorm's fused residual backward without a low copy, f32 flash attention
        for compute in [DType::BF16, DType::F16, DType::F32] {
            super::check_llama_stack(&dev, compute, false)?;
            super::check_llama_stack(&dev, compute, true)?;
        }
        Ok(())
    }

    #[test]
    fn a_stack_of_two_blocks_equals_its_halves_on_cuda() -> Result<()> {
        let dev = Device::new_cuda(0)?;
        super::check_stack(&dev, DType::BF16)?;
        super::check_stack(&dev, DType::F16)?;
        // the f32 one-node stack (f32 flash attention; no low copy of the stream's gradient)
        super::check_stack(&dev, DType::F32)
    }
}
