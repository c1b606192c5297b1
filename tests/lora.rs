//! LoRA pieces on their own: `ops::lora_linear` against the composition of plain candle ops
//! (forward and the gradients of x, A and B; on the CPU and on CUDA), and `LoraConfig`'s
//! PEFT-style target matching and checks.

mod common;
use candle_core::{DType, Device, Tensor, Var};
use common::max_abs;
use wick::lora::LoraConfig;

fn values(shape: (usize, usize), scale: f64, phase: f64) -> Tensor {
    let n = shape.0 * shape.1;
    let t = Tensor::arange(0u32, n as u32, &Device::Cpu).unwrap();
    let t = t.to_dtype(DType::F32).unwrap().affine(0.37, phase).unwrap();
    (t.sin().unwrap() * scale).unwrap().reshape(shape).unwrap()
}

/// Loss `sum(y * g)` of the fused op and of `x W^T + (x A^T) B^T` composed, with the gradients
/// of x, A and B; `dtype` is the compute dtype of W, A, B (x stays f32 and is cast inside).
fn compare(device: &Device, dtype: DType, tol: f32) {
    let (m, k, n, r) = (70, 48, 40, 6);
    let x = Var::from_tensor(&values((m, k), 1.0, 0.1).to_device(device).unwrap()).unwrap();
    let w = values((n, k), 0.2, 0.7)
        .to_dtype(dtype)
        .unwrap()
        .to_device(device)
        .unwrap();
    let mk = |shape, s, p| {
        Var::from_tensor(
            &values(shape, s, p)
                .to_dtype(dtype)
                .unwrap()
                .to_device(device)
                .unwrap(),
        )
        .unwrap()
    };
    let (a, b) = (mk((r, k), 0.3, 1.3), mk((n, r), 0.3, 2.1));
    let g = values((m, n), 1.0, 0.5).to_device(device).unwrap();

    let y = wick::ops::lora_linear(x.as_tensor(), &w, a.as_tensor(), b.as_tensor(), 1.0).unwrap();
    assert_eq!((y.dims(), y.dtype()), (&[m, n][..], dtype));
    let gy = (y.to_dtype(DType::F32).unwrap() * &g)
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = gy.backward().unwrap();

    let xc = x.as_tensor().to_dtype(dtype).unwrap();
    let y_ref = (xc.matmul(&w.t().unwrap()).unwrap()
        + xc.matmul(&a.t().unwrap())
            .unwrap()
            .matmul(&b.t().unwrap())
            .unwrap())
    .unwrap();
    let gr = (y_ref.to_dtype(DType::F32).unwrap() * &g)
        .unwrap()
        .sum_all()
        .unwrap();
    let ref_grads = gr.backward().unwrap();

    let scale = |t: &Tensor| max_abs(t, &t.zeros_like().unwrap()).max(1e-3);
    assert!(max_abs(&y, &y_ref) / scale(&y_ref) < tol, "forward");
    for (name, v) in [("x", &x), ("a", &a), ("b", &b)] {
        let (ours, theirs) = (
            grads.get(v.as_tensor()).expect("grad"),
            ref_grads.get(v.as_tensor()).expect("ref grad"),
        );
        let d = max_abs(ours, theirs) / scale(theirs);
        assert!(d < tol, "{dtype:?} d{name}: relative error {d}");
    }
    assert!(grads.get(&w).is_none(), "the frozen W must get no gradient");
}

#[test]
fn lora_linear_matches_the_composition_on_cpu() {
    compare(&Device::Cpu, DType::F32, 1e-5);
    compare(&Device::Cpu, DType::BF16, 2e-2);
}

#[cfg(feature = "cuda")]
#[test]
fn lora_linear_matches_the_composition_on_cuda() {
    let dev = Device::new_cuda(0).unwrap();
    compare(&dev, DType::F32, 1e-3); // TF32 may be on for f32 GEMMs
    compare(&dev, DType::BF16, 2e-2);
    // x in the compute dtype: the fused cuBLAS path (batched adjacent parts), with the
    // unmerged forward (9 rows) and the merged one (40 rows >= 2 K)
    for mk in [(9, 16), (9, 8), (40, 16), (40, 8)] {
        grouped(&dev, DType::F32, 1e-3, mk);
        grouped(&dev, DType::BF16, 0.1, mk);
    }
}

/// A stack of 11 parts, 10 adapted (more blocks than one launch of the CUDA merge kernel
/// takes) and one not: CUDA (merged forward, f32) against the CPU (widened GEMM), forward and
/// every gradient.
#[cfg(feature = "cuda")]
#[test]
fn lora_linear_with_many_parts_matches_the_cpu_on_cuda() {
    let dev = Device::new_cuda(0).unwrap();
    let (m, k, r, s) = (64, 8, 2, 0.75);
    let mut parts = vec![(3, r); 10];
    parts.insert(4, (5, 0));
    let n: usize = parts.iter().map(|p| p.0).sum();
    let run = |device: &Device| {
        let x = Var::from_tensor(&values((m, k), 1.0, 0.3).to_device(device).unwrap()).unwrap();
        let w = values((n, k), 0.2, 0.9).to_device(device).unwrap();
        let a =
            Var::from_tensor(&values((10 * r, k), 0.3, 1.7).to_device(device).unwrap()).unwrap();
        let b = Var::from_tensor(&values((30, r), 0.3, 2.9).to_device(device).unwrap()).unwrap();
        let y = wick::ops::lora_linear_grouped(
            x.as_tensor(),
            &w,
            a.as_tensor(),
            b.as_tensor(),
            &parts,
            s,
        )
        .unwrap();
        let g = values((m, n), 1.0, 0.4).to_device(device).unwrap();
        let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
        let mut out = vec![cpu(&y)];
        for v in [&x, &a, &b] {
            out.push(cpu(grads.get(v.as_tensor()).expect("grad")));
        }
        out
    };
    for (name, (ours, theirs)) in ["y", "dx", "dA", "dB"]
        .iter()
        .zip(run(&dev).iter().zip(&run(&Device::Cpu)))
    {
        let scale = max_abs(theirs, &theirs.zeros_like().unwrap()).max(1e-3);
        let d = max_abs(ours, theirs) / scale;
        assert!(d < 1e-3, "{name}: relative error {d}"); // TF32 may be on for f32 GEMMs
    }
}

#[test]
fn lora_linear_rejects_shapes_that_do_not_chain() {
    let x = Tensor::zeros((4, 8), DType::F32, &Device::Cpu).unwrap();
    let w = Tensor::zeros((6, 8), DType::F32, &Device::Cpu).unwrap();
    let a = Tensor::zeros((2, 8), DType::F32, &Device::Cpu).unwrap();
    let b_bad = Tensor::zeros((6, 3), DType::F32, &Device::Cpu).unwrap();
    let e = wick::ops::lora_linear(&x, &w, &a, &b_bad, 1.0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("do not chain"), "{e}");
    let a16 = a.to_dtype(DType::BF16).unwrap();
    let b = Tensor::zeros((6, 2), DType::F32, &Device::Cpu).unwrap();
    assert!(wick::ops::lora_linear(&x, &w, &a16, &b, 1.0).is_err());
}

#[test]
fn lora_config_targets_modules_as_peft_does() {
    let c = LoraConfig::all_linear(8, 16.0);
    assert_eq!(c.scaling(), 2.0);
    assert!(c.targets("model.layers.3.self_attn.q_proj"));
    assert!(c.targets("model.layers.3.mlp.down_proj"));
    assert!(!c.targets("model.layers.3.self_attn.q_projection"));
    let g = LoraConfig {
        target_modules: vec!["model.layers.1[0-9].*".into()],
        ..c.clone()
    };
    assert!(g.targets("model.layers.12.mlp.up_proj"));
    assert!(!g.targets("model.layers.2.mlp.up_proj"));
    for bad in [
        LoraConfig { r: 0, ..c.clone() },
        LoraConfig {
            dropout: 1.0,
            ..c.clone()
        },
        LoraConfig {
            alpha: f64::NAN,
            ..c.clone()
        },
        LoraConfig {
            target_modules: vec![],
            ..c.clone()
        },
        LoraConfig {
            target_modules: vec!["[".into()],
            ..c.clone()
        },
    ] {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
}

/// Three stacked modules, the middle one without an adapter (`q_proj, v_proj` targets on a
/// fused qkv): the grouped op against the per-module composition, forward and gradients.
/// The grouped op on `device` in `dtype` (x, W, A and B all in it, so CUDA takes its fused
/// GEMM path) against the per-module composition in f32 on the CPU from the same rounded
/// values: forward and every gradient, relative to the reference's largest magnitude. The
/// parts are `[(8, r), (4, 0), (6, r), (6, r)]`: an unadapted part between adapted ones, and
/// two adjacent equal parts (one batched GEMM on CUDA), for `m` rows of input width `k` (on
/// CUDA, `m >= 2 k` takes the forward that merges the adapters into W, fewer rows the unmerged
/// one; the backward always uses the merged weight).
fn grouped(
    device: &Device,
    dtype: DType,
    tol: f32,
    (m, k): (usize, usize),
) -> (Var, Tensor, Tensor, Vec<(usize, usize)>) {
    let (r, s) = (3, 0.5);
    let on = |t: Tensor| t.to_dtype(dtype).unwrap().to_device(device).unwrap();
    let back = |t: &Tensor| {
        t.to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
    };
    let x = Var::from_tensor(&on(values((m, k), 1.0, 0.2))).unwrap();
    let ws: Vec<Tensor> = [(8, 0.3), (4, 0.9), (6, 1.7), (6, 2.0)]
        .iter()
        .map(|&(n, p)| on(values((n, k), 0.2, p)))
        .collect();
    let w = Tensor::cat(&ws, 0).unwrap();
    let adapted = [(8, 0), (6, 2), (6, 3)]; // (rows, index of the part)
    let av: Vec<Var> = (0..3)
        .map(|i| Var::from_tensor(&on(values((r, k), 0.3, 2.3 + 0.6 * i as f64))).unwrap())
        .collect();
    let bv: Vec<Var> = adapted
        .iter()
        .enumerate()
        .map(|(i, &(n, _))| {
            Var::from_tensor(&on(values((n, r), 0.3, 3.1 + 0.6 * i as f64))).unwrap()
        })
        .collect();
    let a = Tensor::cat(&av.iter().map(|v| v.as_tensor()).collect::<Vec<_>>(), 0).unwrap();
    let b = Tensor::cat(&bv.iter().map(|v| v.as_tensor()).collect::<Vec<_>>(), 0).unwrap();
    let parts = vec![(8, r), (4, 0), (6, r), (6, r)];
    let y = wick::ops::lora_linear_grouped(x.as_tensor(), &w, &a, &b, &parts, s).unwrap();
    assert_eq!((y.dims(), y.dtype()), (&[m, 24][..], dtype));
    let g = values((m, 24), 1.0, 0.4);
    let grads = (y.to_dtype(DType::F32).unwrap() * on(g.clone()).to_dtype(DType::F32).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();

    // the reference: f32 on the CPU from the same (rounded) values
    let xr = Var::from_tensor(&back(x.as_tensor())).unwrap();
    let ar: Vec<Var> = av
        .iter()
        .map(|v| Var::from_tensor(&back(v.as_tensor())).unwrap())
        .collect();
    let br: Vec<Var> = bv
        .iter()
        .map(|v| Var::from_tensor(&back(v.as_tensor())).unwrap())
        .collect();
    let lin = |w: &Tensor| xr.as_tensor().matmul(&w.t().unwrap()).unwrap();
    let mut cols = Vec::new();
    for (i, w_i) in ws.iter().enumerate() {
        let base = lin(&back(w_i));
        cols.push(match adapted.iter().position(|&(_, p)| p == i) {
            Some(j) => (base
                + (lin(ar[j].as_tensor())
                    .matmul(&br[j].as_tensor().t().unwrap())
                    .unwrap()
                    * s)
                    .unwrap())
            .unwrap(),
            None => base,
        });
    }
    let y_ref = Tensor::cat(&cols, 1).unwrap();
    let ref_grads = (&y_ref * &g)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let scale = |t: &Tensor| max_abs(t, &t.zeros_like().unwrap()).max(1e-3);
    let d = max_abs(&back(&y), &y_ref) / scale(&y_ref);
    assert!(d < tol, "{dtype:?} forward: relative error {d}");
    let mut pairs = vec![("x".to_string(), &x, &xr)];
    for (j, (v, vr)) in av.iter().zip(&ar).enumerate() {
        pairs.push((format!("a{j}"), v, vr));
    }
    for (j, (v, vr)) in bv.iter().zip(&br).enumerate() {
        pairs.push((format!("b{j}"), v, vr));
    }
    for (name, v, vr) in pairs {
        let ours = back(grads.get(v.as_tensor()).expect("grad"));
        let theirs = ref_grads.get(vr.as_tensor()).expect("ref");
        let d = max_abs(&ours, theirs) / scale(theirs);
        assert!(d < tol, "{dtype:?} d{name}: relative error {d}");
    }
    (x, w, a, parts)
}

#[test]
fn grouped_lora_linear_with_an_unadapted_part_matches_the_composition() {
    let (x, w, a, _) = grouped(&Device::Cpu, DType::F32, 1e-5, (9, 16));
    // bf16: u (or du) is rounded before the second product, and these small sums cancel:
    // a few percent of the largest entry (7.4% for dA of the first part on the CPU)
    grouped(&Device::Cpu, DType::BF16, 0.1, (9, 16));
    let (r, s) = (3, 0.5);
    let b = Tensor::zeros((20, r), DType::F32, &Device::Cpu).unwrap();
    // parts that do not add up to w's rows are an error, not a panic
    assert!(
        wick::ops::lora_linear_grouped(x.as_tensor(), &w, &a, &b, &[(8, r), (6, r)], s).is_err()
    );
}

#[test]
fn stacked_adapter_names_round_trip() {
    use wick::lora::{stacked_modules, stacked_name};
    let qkv: Vec<String> = ["q_proj", "k_proj", "v_proj"]
        .iter()
        .map(|m| format!("model.layers.3.self_attn.{m}"))
        .collect();
    let name = stacked_name(&qkv);
    assert_eq!(name, "model.layers.3.self_attn.{q_proj,k_proj,v_proj}");
    assert_eq!(stacked_modules(&name), qkv);
    let one = vec!["model.layers.3.mlp.down_proj".to_string()];
    assert_eq!(stacked_name(&one), one[0]);
    assert_eq!(stacked_modules(&one[0]), one);
    // modules without a shared prefix keep their full names inside the braces
    let mixed = vec!["a.x".to_string(), "b.y".to_string()];
    assert_eq!(stacked_name(&mixed), "{a.x,b.y}");
    assert_eq!(stacked_modules(&stacked_name(&mixed)), mixed);
}
