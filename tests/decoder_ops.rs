//! The decoder ops of issue 37 (`wick::ops::grouped_attention`, `window_causal_attention`,
//! `qk_rms_norm`, `geglu_tanh`) against values computed independently (host loops in f64, or a
//! composition of plain candle ops in f64 with the key/value heads repeated), and the new
//! [`Layer`] variants inside `pre_norm_stack` (outside and inside a gradient sink) against the
//! manual composition of the same ops; the KV-cached attention layer run in one call and in
//! two. CPU.

mod common;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use rand::{Rng, SeedableRng};
use std::sync::Mutex;
use wick::grad_sink;
use wick::ops::{self, Half, Layer, NormParams};

const H: usize = 4;
const HKV: usize = 2;
const DH: usize = 8;

fn rand_t(shape: &[usize], lo: f32, hi: f32, seed: u64) -> Tensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let v: Vec<f32> = (0..shape.iter().product::<usize>())
        .map(|_| rng.random_range(lo..hi))
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).expect("random tensor")
}

fn host(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .and_then(|t| t.flatten_all()?.to_vec1())
        .expect("host copy")
}

fn max_abs_vec(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// The naive attention on host vectors: q `(B, H, T, D)`, k/v `(B, Hkv, S, D)` → `(B, T, H D)`,
/// each query head with its key/value head `h / (H / Hkv)`, softmax in f64 over the keys
/// `j <= p` (and `p - j < W` with a window) of query position `p = start + i`.
#[allow(clippy::too_many_arguments)]
fn naive(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    (b, h, hkv, t, s, d): (usize, usize, usize, usize, usize, usize),
    start: usize,
    window: Option<usize>,
    scale: f64,
) -> Vec<f64> {
    let mut out = vec![0.0; b * t * h * d];
    for bi in 0..b {
        for hi in 0..h {
            let kh = hi / (h / hkv);
            for i in 0..t {
                let p = start + i;
                let qrow = &q[((bi * h + hi) * t + i) * d..][..d];
                let keys: Vec<usize> = (0..s)
                    .filter(|&j| j <= p && window.is_none_or(|w| p - j < w))
                    .collect();
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        let krow = &k[((bi * hkv + kh) * s + j) * d..][..d];
                        qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>() * scale
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (&j, w) in keys.iter().zip(&e) {
                    let vrow = &v[((bi * hkv + kh) * s + j) * d..][..d];
                    for c in 0..d {
                        out[((bi * t + i) * h + hi) * d + c] += w / z * vrow[c];
                    }
                }
            }
        }
    }
    out
}

/// q `(B, H, T, D)`, k and v `(B, Hkv, T, D)` of a fused qkv, as host-side splits (plain candle
/// ops).
fn split(qkv: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, _) = qkv.dims3()?;
    let part = |first: usize, heads: usize| {
        qkv.narrow(2, first * DH, heads * DH)?
            .reshape((b, t, heads, DH))?
            .transpose(1, 2)?
            .contiguous()
    };
    Ok((part(0, H)?, part(H, HKV)?, part(H + HKV, HKV)?))
}

#[test]
fn grouped_attention_matches_naive() -> Result<()> {
    let (b, t) = (2, 7);
    for start in [0, 5] {
        let s = start + t;
        let q = rand_t(&[b, H, t, DH], -1.5, 1.5, 1);
        let k = rand_t(&[b, HKV, s, DH], -1.5, 1.5, 2);
        let v = rand_t(&[b, HKV, s, DH], -1.0, 1.0, 3);
        for window in [None, Some(3)] {
            let scale = 0.3;
            let got = ops::grouped_attention(&q, &k, &v, start, window, scale)?;
            assert_eq!(got.dims(), [b, t, H * DH]);
            assert_eq!(got.dtype(), DType::F32);
            let want = naive(
                &host(&q),
                &host(&k),
                &host(&v),
                (b, H, HKV, t, s, DH),
                start,
                window,
                scale,
            );
            let err = max_abs_vec(&host(&got), &want);
            println!("grouped_attention start {start} window {window:?}: max err {err:.2e}");
            assert!(err <= 1e-5, "start {start} window {window:?}: {err}");
        }
        // bf16 k/v/q: the output takes v's dtype
        let y = ops::grouped_attention(
            &q.to_dtype(DType::BF16)?,
            &k.to_dtype(DType::BF16)?,
            &v.to_dtype(DType::BF16)?,
            start,
            Some(3),
            0.3,
        )?;
        assert_eq!(y.dtype(), DType::BF16);
    }
    Ok(())
}

#[test]
fn grouped_attention_errors() -> Result<()> {
    let q = rand_t(&[1, H, 3, DH], -1.0, 1.0, 1);
    let k = rand_t(&[1, HKV, 5, DH], -1.0, 1.0, 2);
    let err = |r: Result<Tensor>| r.expect_err("should fail").to_string();
    assert!(err(ops::grouped_attention(&q, &k, &k, 0, None, 0.3)).contains("start + T"));
    assert!(err(ops::grouped_attention(&q, &k, &k, 2, Some(0), 0.3)).contains("window"));
    let k3 = rand_t(&[1, 3, 5, DH], -1.0, 1.0, 2);
    assert!(err(ops::grouped_attention(&q, &k3, &k3, 2, None, 0.3)).contains("multiple"));
    let qkv = rand_t(&[1, 3, 7 * DH + 1], -1.0, 1.0, 1);
    assert!(err(ops::window_causal_attention(&qkv, H, HKV, Some(2), None)).contains("(B, T,"));
    Ok(())
}

#[test]
fn window_causal_attention_values() -> Result<()> {
    let (b, t) = (2, 7);
    let qkv = rand_t(&[b, t, (H + 2 * HKV) * DH], -1.5, 1.5, 11);
    let (q, k, v) = split(&qkv)?;
    let (hq, hk, hv) = (host(&q), host(&k), host(&v));
    let dims = (b, H, HKV, t, t, DH);
    let default = 1.0 / (DH as f64).sqrt();
    for (window, scale) in [
        (Some(3), None),
        (Some(3), Some(0.7 * default)),
        (None, Some(0.2)),
    ] {
        let got = ops::window_causal_attention(&qkv, H, HKV, window, scale)?;
        let want = naive(&hq, &hk, &hv, dims, 0, window, scale.unwrap_or(default));
        let err = max_abs_vec(&host(&got), &want);
        println!("window_causal_attention {window:?} {scale:?}: max err {err:.2e}");
        assert!(err <= 1e-5, "{window:?} {scale:?}: {err}");
    }
    // a window that does not bind with the default scale is the fused op, bit for bit
    let fused = ops::grouped_causal_attention(&qkv, H, HKV)?;
    for (window, scale) in [(None, None), (Some(7), None), (Some(100), Some(default))] {
        let got = ops::window_causal_attention(&qkv, H, HKV, window, scale)?;
        assert_eq!(common::max_abs(&got, &fused), 0.0, "{window:?} {scale:?}");
    }
    Ok(())
}

/// The attention as plain candle ops in qkv's dtype (f64 here): key/value heads repeated,
/// explicit additive mask, `candle_nn::ops::softmax`.
fn reference_attention(qkv: &Tensor, window: Option<usize>, scale: f64) -> Result<Tensor> {
    let (b, t, _) = qkv.dims3()?;
    let part = |first: usize, heads: usize| {
        qkv.narrow(2, first * DH, heads * DH)?
            .reshape((b, t, heads, DH))?
            .transpose(1, 2)
    };
    let idx: Vec<u32> = (0..H).map(|h| (h / (H / HKV)) as u32).collect();
    let idx = Tensor::new(idx.as_slice(), qkv.device())?;
    let q = part(0, H)?.contiguous()?;
    let k = part(H, HKV)?.contiguous()?.index_select(&idx, 1)?;
    let v = part(H + HKV, HKV)?.contiguous()?.index_select(&idx, 1)?;
    let mask: Vec<f64> = (0..t * t)
        .map(|r| {
            let (i, j) = (r / t, r % t);
            match j <= i && window.is_none_or(|w| i - j < w) {
                true => 0.0,
                false => f64::NEG_INFINITY,
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), qkv.device())?.to_dtype(qkv.dtype())?;
    let s = (q.matmul(&k.t()?)? * scale)?.broadcast_add(&mask)?;
    let p = candle_nn::ops::softmax(&s, D::Minus1)?;
    p.matmul(&v)?.transpose(1, 2)?.reshape((b, t, H * DH))
}

#[test]
fn window_causal_attention_gradients() -> Result<()> {
    let (b, t) = (2, 7);
    let x = rand_t(&[b, t, (H + 2 * HKV) * DH], -1.5, 1.5, 21);
    let r = rand_t(&[b, t, H * DH], -1.0, 1.0, 22);
    let default = 1.0 / (DH as f64).sqrt();
    for (window, scale) in [(None, 0.7 * default), (Some(3), default), (Some(2), 0.4)] {
        let qkv = Var::from_tensor(&x)?;
        let y = ops::window_causal_attention(qkv.as_tensor(), H, HKV, window, Some(scale))?;
        let g = (&y * &r)?.sum_all()?.backward()?;
        let got = g.get(qkv.as_tensor()).expect("gradient of qkv");

        let qkv64 = Var::from_tensor(&x.to_dtype(DType::F64)?)?;
        let y64 = reference_attention(qkv64.as_tensor(), window, scale)?;
        let g64 = (&y64 * &r.to_dtype(DType::F64)?)?.sum_all()?.backward()?;
        let want = g64.get(qkv64.as_tensor()).expect("reference gradient");

        let ev = max_abs_vec(&host(&y), &host(&y64));
        let eg = max_abs_vec(&host(got), &host(want));
        println!("gradient {window:?} scale {scale:.4}: value err {ev:.2e}, dqkv err {eg:.2e}");
        assert!(ev <= 1e-5 && eg <= 1e-5, "{window:?} {scale}: {ev} {eg}");
        // the v columns got a gradient too (not an all-zero placeholder)
        assert!(host(&got.narrow(2, (H + HKV) * DH, HKV * DH)?)
            .iter()
            .any(|v| v.abs() > 1e-3));
    }
    Ok(())
}

#[test]
fn qk_rms_norm_matches_host() -> Result<()> {
    let (b, t, eps) = (2, 3, 1e-6);
    let c = (H + 2 * HKV) * DH;
    let qkv = rand_t(&[b, t, c], -2.0, 2.0, 31);
    let qw = rand_t(&[DH], 0.5, 1.5, 32);
    let kw = rand_t(&[DH], 0.5, 1.5, 33);
    let got = ops::qk_rms_norm(&qkv, &qw, &kw, eps, H, HKV)?;
    assert_eq!(got.dims(), qkv.dims());
    let (x, qw, kw) = (host(&qkv), host(&qw), host(&kw));
    let mut want = x.clone();
    for row in want.chunks_mut(c) {
        for (head, seg) in row.chunks_mut(DH).enumerate().take(H + HKV) {
            let w = if head < H { &qw } else { &kw };
            let rstd = 1.0 / (seg.iter().map(|v| v * v).sum::<f64>() / DH as f64 + eps).sqrt();
            for (v, g) in seg.iter_mut().zip(w) {
                *v *= rstd * g;
            }
        }
    }
    let err = max_abs_vec(&host(&got), &want);
    println!("qk_rms_norm: max err {err:.2e}");
    assert!(err <= 1e-5, "{err}");
    // v untouched, bit for bit; bf16 in, bf16 out
    let v = |t: &Tensor| t.narrow(2, (H + HKV) * DH, HKV * DH);
    assert_eq!(common::max_abs(&v(&got)?, &v(&qkv)?), 0.0);
    let q16 = qkv.to_dtype(DType::BF16)?;
    let (qw, kw) = (
        Tensor::new(&[1f32; DH], &Device::Cpu)?,
        Tensor::ones(DH, DType::F32, &Device::Cpu)?,
    );
    assert_eq!(
        ops::qk_rms_norm(&q16, &qw, &kw, eps, H, HKV)?.dtype(),
        DType::BF16
    );
    assert!(ops::qk_rms_norm(&qkv, &qw.narrow(0, 0, 4)?, &kw, eps, H, HKV).is_err());
    Ok(())
}

#[test]
fn geglu_tanh_matches_host() -> Result<()> {
    let x = rand_t(&[3, 5, 2 * 6], -3.0, 3.0, 41);
    let got = ops::geglu_tanh(&x)?;
    assert_eq!(got.dims(), [3, 5, 6]);
    let hx = host(&x);
    let want: Vec<f64> = hx
        .chunks(12)
        .flat_map(|row| {
            (0..6).map(move |i| {
                let (g, u) = (row[i], row[6 + i]);
                let c = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * g * (1.0 + (c * (g + 0.044715 * g * g * g)).tanh()) * u
            })
        })
        .collect();
    let err = max_abs_vec(&host(&got), &want);
    println!("geglu_tanh: max err {err:.2e}");
    assert!(err <= 1e-5, "{err}");
    assert_eq!(
        ops::geglu_tanh(&x.to_dtype(DType::BF16)?)?.dtype(),
        DType::BF16
    );
    assert!(ops::geglu_tanh(&rand_t(&[2, 5], -1.0, 1.0, 1)).is_err());
    // differentiable
    let v = Var::from_tensor(&x)?;
    let g = ops::geglu_tanh(v.as_tensor())?.sum_all()?.backward()?;
    assert!(g.get(v.as_tensor()).is_some());
    Ok(())
}

/// A Gemma-3-like decoder layer's parameters: pre-norms, fused qkv (no bias), q/k norms,
/// output projection, post-norms, gate|up and down; the input x and upstream weights r.
struct Block {
    x: Var,
    p: Vec<(&'static str, Var)>,
    cos: Tensor,
    sin: Tensor,
    r: Tensor,
}

const C: usize = 16;
const F: usize = 24;

fn block(t: usize) -> Result<Block> {
    let var = |shape: &[usize], lo, hi, s: u64| Var::from_tensor(&rand_t(shape, lo, hi, 100 + s));
    let p = vec![
        ("attn_norm", var(&[C], 0.5, 1.5, 1)?),
        ("qkv", var(&[(H + 2 * HKV) * DH, C], -0.4, 0.4, 2)?),
        ("q_norm", var(&[DH], 0.5, 1.5, 3)?),
        ("k_norm", var(&[DH], 0.5, 1.5, 4)?),
        ("o", var(&[C, H * DH], -0.3, 0.3, 5)?),
        ("post_attn_norm", var(&[C], 0.5, 1.5, 6)?),
        ("mlp_norm", var(&[C], 0.5, 1.5, 7)?),
        ("gate_up", var(&[2 * F, C], -0.4, 0.4, 8)?),
        ("down", var(&[C, F], -0.3, 0.3, 9)?),
        ("post_mlp_norm", var(&[C], 0.5, 1.5, 10)?),
    ];
    let (cos, sin) = ops::rotary_tables(t, DH, 10000.0, 0, &Device::Cpu)?;
    Ok(Block {
        x: var(&[2, t, C], -2.0, 2.0, 0)?,
        p,
        cos,
        sin,
        r: rand_t(&[2, t, C], -1.0, 1.0, 99),
    })
}

impl Block {
    fn w(&self, i: usize) -> &Tensor {
        self.p[i].1.as_tensor()
    }
    fn norm(&self, i: usize) -> NormParams<'_> {
        NormParams {
            w: self.w(i),
            b: None,
            eps: 1e-6,
        }
    }
}

const EPS: f64 = 1e-6;

/// The two halves by hand, op by op.
fn manual(k: &Block, window: Option<usize>, scale: Option<f64>) -> Result<Tensor> {
    let x = k.x.as_tensor();
    let a = ops::rms_norm_with_dtype(x, k.w(0), EPS, DType::F32)?;
    let qkv = ops::linear(&a, k.w(1), None)?;
    let qkv = ops::qk_rms_norm(&qkv, k.w(2), k.w(3), EPS, H, HKV)?;
    let qkv = ops::rotary_qkv(&qkv, &k.cos, &k.sin, H, HKV)?;
    let y = ops::window_causal_attention(&qkv, H, HKV, window, scale)?;
    let m = ops::rms_norm(&ops::linear(&y, k.w(4), None)?, k.w(5), EPS)?;
    let x = ops::residual_add(x, &m)?;
    let a = ops::rms_norm_with_dtype(&x, k.w(6), EPS, DType::F32)?;
    let h = ops::geglu_tanh(&ops::linear(&a, k.w(7), None)?)?;
    let m = ops::rms_norm(&ops::linear(&h, k.w(8), None)?, k.w(9), EPS)?;
    ops::residual_add(&x, &m)
}

/// The same through `pre_norm_stack` with the new layers.
fn stacked(k: &Block, window: Option<usize>, scale: Option<f64>) -> Result<Tensor> {
    let attn = [
        Layer::Linear {
            parts: std::slice::from_ref(k.w(1)),
            b: &[],
        },
        Layer::QkNorm {
            q_w: k.w(2),
            k_w: k.w(3),
            eps: EPS,
            n_head: H,
            n_kv_head: HKV,
        },
        Layer::Rotary {
            cos: &k.cos,
            sin: &k.sin,
            n_head: H,
            n_kv_head: HKV,
        },
        Layer::WindowAttention {
            n_head: H,
            n_kv_head: HKV,
            window,
            scale,
            segments: None,
        },
        Layer::Linear {
            parts: std::slice::from_ref(k.w(4)),
            b: &[],
        },
        Layer::Norm(k.norm(5)),
    ];
    let mlp = [
        Layer::Linear {
            parts: std::slice::from_ref(k.w(7)),
            b: &[],
        },
        Layer::GeGlu,
        Layer::Linear {
            parts: std::slice::from_ref(k.w(8)),
            b: &[],
        },
        Layer::Norm(k.norm(9)),
    ];
    let halves = [
        Half::Branch(k.norm(0), &attn),
        Half::Branch(k.norm(6), &mlp),
    ];
    ops::pre_norm_stack(k.x.as_tensor(), &halves, DType::F32)
}

/// Values and the gradients of x and every parameter equal exactly between `a`'s graph under
/// `a_sink` (sink: built under `forward_for_sink`, `grad_sink::backward`) and `b`'s under
/// candle's backward.
fn same_grads(
    what: &str,
    k: &Block,
    a: &dyn Fn() -> Result<Tensor>,
    a_sink: bool,
    b: &dyn Fn() -> Result<Tensor>,
) -> Result<()> {
    let (ya, ga) = match a_sink {
        true => {
            let y = grad_sink::forward_for_sink(a)?;
            let g = grad_sink::backward(&(&y * &k.r)?.sum_all()?)?;
            (y, g)
        }
        false => {
            let y = a()?;
            let g = (&y * &k.r)?.sum_all()?.backward()?;
            (y, g)
        }
    };
    let yb = b()?;
    let gb = (&yb * &k.r)?.sum_all()?.backward()?;
    assert_eq!(common::max_abs(&ya, &yb), 0.0, "{what}: value");
    for (name, v) in std::iter::once(("x", &k.x)).chain(k.p.iter().map(|(n, v)| (*n, v))) {
        let (Some(ga), Some(gb)) = (ga.get(v.as_tensor()), gb.get(v.as_tensor())) else {
            panic!("{what}: no gradient for {name}")
        };
        assert_eq!(common::max_abs(ga, gb), 0.0, "{what}: gradient of {name}");
    }
    Ok(())
}

#[test]
fn stack_with_new_layers_equals_manual() -> Result<()> {
    let k = block(7)?;
    let default = 1.0 / (DH as f64).sqrt();
    for (window, scale) in [
        (Some(3), Some(0.7 * default)),
        (None, None),
        (Some(9), Some(default)),
    ] {
        let what = format!("window {window:?} scale {scale:?}");
        let st = || stacked(&k, window, scale);
        let man = || manual(&k, window, scale);
        same_grads(&format!("{what}, no sink"), &k, &st, false, &man)?;
        same_grads(&format!("{what}, sink"), &k, &st, true, &man)?;
    }
    Ok(())
}

/// A WindowAttention whose window does not bind, default scale, is one node under a sink (as
/// `Layer::Attention`); a binding one goes to the composition (candle's backward works).
#[test]
fn non_binding_window_is_one_node() -> Result<()> {
    let k = block(7)?;
    let branch = |window: Option<usize>, scale: Option<f64>| {
        [
            Layer::Linear {
                parts: std::slice::from_ref(k.w(1)),
                b: &[],
            },
            Layer::Rotary {
                cos: &k.cos,
                sin: &k.sin,
                n_head: H,
                n_kv_head: HKV,
            },
            Layer::WindowAttention {
                n_head: H,
                n_kv_head: HKV,
                window,
                scale,
                segments: None,
            },
            Layer::Linear {
                parts: std::slice::from_ref(k.w(4)),
                b: &[],
            },
        ]
    };
    let run = |window, scale| {
        let layers = branch(window, scale);
        ops::pre_norm_stack(
            k.x.as_tensor(),
            &[Half::Branch(k.norm(0), &layers)],
            DType::F32,
        )
    };
    let plain = || {
        let layers = [
            Layer::Linear {
                parts: std::slice::from_ref(k.w(1)),
                b: &[],
            },
            Layer::Rotary {
                cos: &k.cos,
                sin: &k.sin,
                n_head: H,
                n_kv_head: HKV,
            },
            Layer::Attention {
                n_head: H,
                n_kv_head: HKV,
            },
            Layer::Linear {
                parts: std::slice::from_ref(k.w(4)),
                b: &[],
            },
        ];
        ops::pre_norm_stack(
            k.x.as_tensor(),
            &[Half::Branch(k.norm(0), &layers)],
            DType::F32,
        )
    };
    let default = 1.0 / (DH as f64).sqrt();
    for (window, scale) in [(None, None), (Some(7), Some(default))] {
        let loss = || (run(window, scale)? * &k.r)?.sum_all();
        let one = grad_sink::forward_for_sink(loss)?;
        assert!(
            one.backward().is_err(),
            "{window:?}: no block node was built"
        );
        let by_attention = grad_sink::forward_for_sink(|| (plain()? * &k.r)?.sum_all())?;
        let (g1, g2) = (
            grad_sink::backward(&one)?,
            grad_sink::backward(&by_attention)?,
        );
        assert_eq!(one.to_scalar::<f32>()?, by_attention.to_scalar::<f32>()?);
        for (name, v) in
            k.p.iter()
                .take(5)
                .filter(|(n, _)| *n != "q_norm" && *n != "k_norm")
        {
            let t = v.as_tensor();
            let (Some(a), Some(b)) = (g1.get(t), g2.get(t)) else {
                panic!("no gradient for {name}")
            };
            assert_eq!(common::max_abs(a, b), 0.0, "{window:?}: gradient of {name}");
        }
    }
    // a binding window with another scale: composition (candle's own backward
    // differentiates it); with the default scale it is the fused windowed node
    // (tests/window_attention.rs)
    let loss = grad_sink::forward_for_sink(|| (run(Some(3), Some(0.3))? * &k.r)?.sum_all())?;
    assert!(
        loss.backward().is_ok(),
        "a binding window at another scale should take the composition"
    );
    Ok(())
}

/// The attention branch with a KV cache: `[Linear, Rotary (positions start..), CachedAttention,
/// Linear]` on x's rows `from..from + n`.
fn cached_rows(
    k: &Block,
    kv: &Mutex<Option<(Tensor, Tensor)>>,
    from: usize,
    n: usize,
    window: Option<usize>,
) -> Result<Tensor> {
    let x = k.x.as_tensor().detach().narrow(1, from, n)?;
    let (cos, sin) = (k.cos.narrow(0, from, n)?, k.sin.narrow(0, from, n)?);
    let layers = [
        Layer::Linear {
            parts: std::slice::from_ref(k.w(1)),
            b: &[],
        },
        Layer::Rotary {
            cos: &cos,
            sin: &sin,
            n_head: H,
            n_kv_head: HKV,
        },
        Layer::CachedAttention {
            kv,
            start: from,
            n_head: H,
            n_kv_head: HKV,
            window,
            scale: Some(0.3),
        },
        Layer::Linear {
            parts: std::slice::from_ref(k.w(4)),
            b: &[],
        },
    ];
    ops::pre_norm_stack(&x, &[Half::Branch(k.norm(0), &layers)], DType::F32)
}

#[test]
fn cached_attention_in_one_call_and_two() -> Result<()> {
    let k = block(6)?;
    for window in [None, Some(3)] {
        let whole = cached_rows(&k, &Mutex::new(None), 0, 6, window)?;
        let kv = Mutex::new(None);
        let first = cached_rows(&k, &kv, 0, 4, window)?;
        let second = cached_rows(&k, &kv, 4, 2, window)?;
        let e1 = common::max_abs(&first, &whole.narrow(1, 0, 4)?);
        let e2 = common::max_abs(&second, &whole.narrow(1, 4, 2)?);
        println!("cached attention {window:?}: first rows {e1:.2e}, last rows {e2:.2e}");
        assert!(e1 <= 1e-5 && e2 <= 1e-5, "{window:?}: {e1} {e2}");
        let cache = kv.lock().unwrap();
        let (ck, cv) = cache.as_ref().expect("a filled cache");
        // a sliding window of W keys keeps the last W - 1 positions (those a later query sees)
        let held = window.map_or(6, |w| w - 1);
        assert_eq!(ck.dims(), [2, HKV, held, DH]);
        assert_eq!(cv.dims(), [2, HKV, held, DH]);
        assert!(!ck.track_op() && !cv.track_op());
        // the uncached window attention of the same rows
        let layers = [
            Layer::Linear {
                parts: std::slice::from_ref(k.w(1)),
                b: &[],
            },
            Layer::Rotary {
                cos: &k.cos,
                sin: &k.sin,
                n_head: H,
                n_kv_head: HKV,
            },
            Layer::WindowAttention {
                n_head: H,
                n_kv_head: HKV,
                window,
                scale: Some(0.3),
                segments: None,
            },
            Layer::Linear {
                parts: std::slice::from_ref(k.w(4)),
                b: &[],
            },
        ];
        let x = k.x.as_tensor().detach();
        let plain = ops::pre_norm_stack(&x, &[Half::Branch(k.norm(0), &layers)], DType::F32)?;
        assert!(common::max_abs(&plain, &whole) <= 1e-5);
    }
    // a cache of the wrong length is refused
    let kv = Mutex::new(None);
    cached_rows(&k, &kv, 0, 4, None)?;
    let err = cached_rows(&k, &kv, 3, 2, None).expect_err("start 3 with 4 cached");
    assert!(err.to_string().contains("start"), "{err}");
    let err = cached_rows(&k, &Mutex::new(None), 2, 2, None).expect_err("empty cache, start 2");
    assert!(err.to_string().contains("empty"), "{err}");
    Ok(())
}

#[test]
fn bias_layer_is_bias_add() -> Result<()> {
    let x = Var::from_tensor(&rand_t(&[2, 3, C], -2.0, 2.0, 51))?;
    let w = rand_t(&[C, C], -0.4, 0.4, 52);
    let b = [
        Var::from_tensor(&rand_t(&[6], -1.0, 1.0, 53))?,
        Var::from_tensor(&rand_t(&[10], -1.0, 1.0, 54))?,
    ];
    let bs = [b[0].as_tensor().clone(), b[1].as_tensor().clone()];
    let norm = NormParams {
        w: &Tensor::ones(C, DType::F32, &Device::Cpu)?,
        b: None,
        eps: EPS,
    };
    let layers = [
        Layer::Linear {
            parts: std::slice::from_ref(&w),
            b: &[],
        },
        Layer::Bias { b: &bs },
    ];
    let y = grad_sink::forward_for_sink(|| {
        ops::pre_norm_stack(x.as_tensor(), &[Half::Branch(norm, &layers)], DType::F32)
    })?;
    let g = grad_sink::backward(&y.sum_all()?)?;
    let a = ops::rms_norm_with_dtype(x.as_tensor(), norm.w, EPS, DType::F32)?;
    let full = Tensor::cat(&bs, 0)?;
    let want = ops::residual_add(
        x.as_tensor(),
        &ops::bias_add(&ops::linear(&a, &w, None)?, &full)?,
    )?;
    assert_eq!(common::max_abs(&y, &want), 0.0);
    let gb = g.get(b[1].as_tensor()).expect("bias part gradient");
    // d(sum)/db = the number of rows
    assert!(host(gb).iter().all(|v| (v - 6.0).abs() < 1e-6));
    Ok(())
}
