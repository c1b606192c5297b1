//! Packed documents in the fused attention ([`ops::grouped_varlen_attention`], [`ops::Segments`]:
//! FlashAttention's varlen `cu_seqlens`): query i of document d sees keys `start(d) <= j <= i`
//! (and `i - j < W` with a window). The independent check: the packed op equals running the
//! unpacked op on each document alone and concatenating, values and gradients, on the CPU for
//! the fused op's reference and for the composition. With the `cuda` feature, the flash
//! kernels (forward, dK/dV, dQ; mma.sync, and wgmma/TMA on Hopper for bf16/f16) against the CPU
//! reference (run on a GPU machine: `cargo test --release --features cuda --test
//! varlen_attention cuda::`; on an H100/H200 again with `WICK_ATTENTION_KERNELS=mma` for the
//! mma.sync build of bf16/f16, and with `WICK_ATTENTION_LOADS=cp` for the wgmma kernels'
//! cp.async loads).

mod common;

use candle_core::{DType, Device, Result, Tensor, Var};
use common::tensors::{bits, err, rand_t, value_and_grad};
use wick::grad_sink;
use wick::ops::{self, Half, Layer, NormParams, Segments};

/// The reference: the unpacked op on each document alone (rows `cu[d]..cu[d + 1]`),
/// concatenated along the row; [`ops::window_causal_attention`] is the fused
/// [`ops::grouped_window_attention`] at the default scale and the composition at another.
fn per_document(
    qkv: &Tensor,
    h: usize,
    hkv: usize,
    window: Option<usize>,
    scale: Option<f64>,
    cu: &[usize],
) -> Result<Tensor> {
    let docs = cu
        .windows(2)
        .map(|w| {
            let doc = qkv.narrow(1, w[0], w[1] - w[0])?;
            ops::window_causal_attention(&doc, h, hkv, window, scale)
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&docs, 1)
}

/// `(cu_seqlens, H, Hkv, D, window, scale)`: documents of one token, documents crossing
/// 64-row tiles and a partial last tile, one document for the whole row, windows shorter than
/// a document and a tile, grouped, multi-query and multi-head, another scale.
type Case = (
    &'static [usize],
    usize,
    usize,
    usize,
    Option<usize>,
    Option<f64>,
);
const CPU_CASES: [Case; 8] = [
    (&[0, 1, 70, 71, 200, 300], 4, 2, 64, None, None),
    (&[0, 1, 70, 71, 200, 300], 4, 2, 64, Some(37), None),
    (&[0, 130], 4, 2, 64, None, None),
    (&[0, 130], 2, 1, 64, Some(5), None),
    (&[0, 5, 6, 40, 100], 3, 1, 16, None, None),
    (&[0, 64, 128, 129, 190], 2, 2, 64, Some(64), None),
    (&[0, 3, 67, 68, 150], 4, 2, 8, Some(7), Some(0.3)),
    (&[0, 1, 2, 3, 4, 5], 4, 1, 32, None, Some(0.05)),
];

#[test]
fn packed_matches_each_document_alone_on_cpu() -> Result<()> {
    let dev = Device::Cpu;
    for (i, &(cu, h, hkv, d, win, scale)) in CPU_CASES.iter().enumerate() {
        let n = *cu.last().unwrap();
        let seg = Segments::new(cu, &dev)?;
        let qkv = rand_t(
            &[1, n, (h + 2 * hkv) * d],
            -2.0,
            2.0,
            100 + i as u64,
            DType::F32,
            &dev,
        );
        let r = rand_t(&[1, n, h * d], -1.0, 1.0, 200 + i as u64, DType::F32, &dev);
        let reference = |x: &Tensor| per_document(x, h, hkv, win, scale, cu);
        let fused = |x: &Tensor| ops::grouped_varlen_attention(x, h, hkv, win, scale, &seg);
        let composed =
            |x: &Tensor| ops::grouped_varlen_attention_composed(x, h, hkv, win, scale, &seg);
        let (y_r, g_r) = value_and_grad(&reference, &qkv, &r)?;
        for (name, f) in [
            ("fused", &fused as &dyn Fn(&Tensor) -> Result<Tensor>),
            ("composed", &composed),
        ] {
            let (y, g) = value_and_grad(f, &qkv, &r)?;
            let (ey, eg) = (err(&y, &y_r), err(&g, &g_r));
            println!("cpu {name} case {i} {cu:?} H{h} Hkv{hkv} D{d} W{win:?} scale {scale:?}: y {ey:.2e} dqkv {eg:.2e}");
            assert!(
                ey <= 1e-5 && eg <= 1e-5,
                "{name} case {i}: y {ey:e} dqkv {eg:e}"
            );
        }
        // the documents change something, unless there is one
        if cu.len() > 2 {
            let whole = ops::window_causal_attention(&qkv, h, hkv, win, scale)?;
            assert!(
                err(&whole, &y_r) > 1e-3,
                "case {i}: documents changed nothing"
            );
        }
    }
    Ok(())
}

#[test]
fn one_document_is_the_unpacked_op_exactly() -> Result<()> {
    let (n, h, hkv, d) = (150, 4, 2, 64);
    let seg = Segments::new(&[0, n], &Device::Cpu)?;
    let qkv = rand_t(
        &[1, n, (h + 2 * hkv) * d],
        -2.0,
        2.0,
        300,
        DType::F32,
        &Device::Cpu,
    );
    let r = rand_t(&[1, n, h * d], -1.0, 1.0, 301, DType::F32, &Device::Cpu);
    for win in [None, Some(9), Some(n)] {
        let packed = |x: &Tensor| ops::grouped_varlen_attention(x, h, hkv, win, None, &seg);
        let plain = |x: &Tensor| ops::grouped_window_attention(x, h, hkv, win);
        let (y1, g1) = value_and_grad(&packed, &qkv, &r)?;
        let (y2, g2) = value_and_grad(&plain, &qkv, &r)?;
        assert_eq!(bits(&y1), bits(&y2), "window {win:?}: y");
        assert_eq!(bits(&g1), bits(&g2), "window {win:?}: dqkv");
    }
    Ok(())
}

#[test]
fn bf16_packed_matches_each_document_alone_on_cpu() -> Result<()> {
    // the CPU reference in f32 whatever the storage: bf16 storage against the per-document
    // fused op on the same bf16 input
    let cu = [0usize, 1, 70, 71, 200, 300];
    let (h, hkv, d) = (4, 2, 64);
    let seg = Segments::new(&cu, &Device::Cpu)?;
    let qkv = rand_t(
        &[1, 300, (h + 2 * hkv) * d],
        -2.0,
        2.0,
        310,
        DType::BF16,
        &Device::Cpu,
    );
    let y = ops::grouped_varlen_attention(&qkv, h, hkv, Some(50), None, &seg)?;
    let y_r = per_document(&qkv, h, hkv, Some(50), None, &cu)?;
    assert_eq!(y.dtype(), DType::BF16);
    assert_eq!(bits(&y), bits(&y_r));
    Ok(())
}

#[test]
fn segments_tables_and_positions() -> Result<()> {
    let seg = Segments::new(&[0, 3, 5, 6], &Device::Cpu)?;
    assert_eq!(seg.len(), 6);
    assert_eq!(seg.docs(), 3);
    assert_eq!(seg.cu_seqlens(), &[0, 3, 5, 6]);
    assert_eq!(seg.positions().to_vec1::<u32>()?, [0, 1, 2, 0, 1, 0]);
    assert_eq!(seg.first_key().to_vec1::<u32>()?, [0, 0, 0, 3, 3, 5]);
    assert_eq!(seg.last_query().to_vec1::<u32>()?, [2, 2, 2, 4, 4, 5]);
    assert_eq!(seg.positions().dtype(), DType::U32);
    let empty = Segments::new(&[0], &Device::Cpu)?;
    assert!(empty.is_empty());
    let qkv = Tensor::zeros((1, 0, 4 * 64), DType::F32, &Device::Cpu)?;
    let y = ops::grouped_varlen_attention(&qkv, 2, 1, None, None, &empty)?;
    assert_eq!(y.dims(), &[1, 0, 128]);
    Ok(())
}

/// Bad input is an error that names what is wrong and what to do, never a panic.
#[test]
fn bad_input_is_refused_with_a_reason() -> Result<()> {
    let dev = Device::Cpu;
    for (cu, says) in [
        (&[][..], "empty"),
        (&[1, 5][..], "start at 0"),
        (&[0, 3, 3, 5][..], "empty"),
        (&[0, 4, 2, 5][..], "not greater"),
    ] {
        let e = Segments::new(cu, &dev).unwrap_err().to_string();
        assert!(e.contains(says) && e.contains("cu_seqlens"), "{cu:?}: {e}");
    }
    let seg = Segments::new(&[0, 3, 8], &dev)?;
    let qkv = rand_t(&[1, 8, 4 * 16], -1.0, 1.0, 1, DType::F32, &dev);
    let call = |x: &Tensor, seg: &Segments, win, scale| {
        ops::grouped_varlen_attention(x, 2, 1, win, scale, seg)
            .unwrap_err()
            .to_string()
    };
    // cu_seqlens not ending at N
    let short = Segments::new(&[0, 3, 7], &dev)?;
    let e = call(&qkv, &short, None, None);
    assert!(e.contains("7 tokens") && e.contains("N = 8"), "{e}");
    // a batch other than 1
    let two = rand_t(&[2, 8, 4 * 16], -1.0, 1.0, 2, DType::F32, &dev);
    let e = call(&two, &seg, None, None);
    assert!(e.contains("batch 2") && e.contains("one row"), "{e}");
    let e = call(&qkv, &seg, Some(0), None);
    assert!(e.contains("window Some(0)"), "{e}");
    let e = call(&qkv, &seg, None, Some(f64::NAN));
    assert!(e.contains("not finite"), "{e}");
    // a width that is not (H + 2 Hkv) D; integer dtypes
    assert!(ops::grouped_varlen_attention(&qkv, 3, 1, None, None, &seg).is_err());
    let ints = Tensor::zeros((1, 8, 64), DType::U32, &dev)?;
    assert!(ops::grouped_varlen_attention(&ints, 2, 1, None, None, &seg).is_err());
    // the composition checks the same
    let e = ops::grouped_varlen_attention_composed(&two, 2, 1, None, None, &seg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("batch 2"), "{e}");
    Ok(())
}

/// `Layer::WindowAttention` with segments: one node under a sink (candle's own backward then
/// fails: the parameter gradients went to the sink), with the values and gradients of the
/// per-op composition, at the default scale and another.
#[test]
fn block_with_packed_documents_is_one_node() -> Result<()> {
    let (h, hkv, dh, c) = (4, 2, 16, 32);
    let cu = [0usize, 1, 30, 31, 90];
    let n = 90;
    let dev = Device::Cpu;
    let seg = Segments::new(&cu, &dev)?;
    let var = |shape: &[usize], lo, hi, seed| {
        Var::from_tensor(&rand_t(shape, lo, hi, seed, DType::F32, &dev))
    };
    let x = var(&[1, n, c], -2.0, 2.0, 10)?;
    let norm_w = var(&[c], 0.5, 1.5, 11)?;
    let qkv_w = var(&[(h + 2 * hkv) * dh, c], -0.4, 0.4, 12)?;
    let o_w = var(&[c, h * dh], -0.3, 0.3, 13)?;
    let r = rand_t(&[1, n, c], -1.0, 1.0, 14, DType::F32, &dev);
    // RoPE at the positions within each document
    let (cos, sin) = ops::rotary_tables(n, dh, 10000.0, 0, &dev)?;
    let (cos, sin) = (
        cos.index_select(seg.positions(), 0)?,
        sin.index_select(seg.positions(), 0)?,
    );
    for scale in [None, Some(0.3)] {
        let layers = [
            Layer::Linear {
                parts: std::slice::from_ref(qkv_w.as_tensor()),
                b: &[],
            },
            Layer::Rotary {
                cos: &cos,
                sin: &sin,
                n_head: h,
                n_kv_head: hkv,
            },
            Layer::WindowAttention {
                n_head: h,
                n_kv_head: hkv,
                window: Some(20),
                scale,
                segments: Some(&seg),
            },
            Layer::Linear {
                parts: std::slice::from_ref(o_w.as_tensor()),
                b: &[],
            },
        ];
        let norm = NormParams {
            w: norm_w.as_tensor(),
            b: None,
            eps: 1e-6,
        };
        let halves = [Half::Branch(norm, &layers)];
        let one = grad_sink::forward_for_sink(|| {
            (ops::pre_norm_stack(x.as_tensor(), &halves, DType::F32)? * &r)?.sum_all()
        })?;
        assert!(
            one.backward().is_err(),
            "{scale:?}: no block node was built"
        );
        let g1 = grad_sink::backward(&one)?;
        let composed =
            (ops::pre_norm_composed(x.as_tensor(), &halves, DType::F32)? * &r)?.sum_all()?;
        let g2 = composed.backward()?;
        assert_eq!(
            one.to_scalar::<f32>()?,
            composed.to_scalar::<f32>()?,
            "{scale:?}"
        );
        for (name, v) in [("x", &x), ("norm", &norm_w), ("qkv", &qkv_w), ("o", &o_w)] {
            let (Some(a), Some(b)) = (g1.get(v.as_tensor()), g2.get(v.as_tensor())) else {
                panic!("{scale:?}: no gradient for {name}")
            };
            assert_eq!(bits(a), bits(b), "{scale:?}: gradient of {name}");
        }
    }
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use common::tensors::assert_deterministic;

    fn gpu() -> Device {
        Device::new_cuda(0).expect("these tests need a CUDA device")
    }

    fn tol(dtype: DType) -> f32 {
        match dtype {
            DType::F32 => 2e-5,
            DType::F16 => 3e-3,
            _ => 2e-2, // bf16: 8 mantissa bits
        }
    }

    /// `(cu_seqlens, H, Hkv, window, scale)` at D = 64: N 300 (partial last tile; cp.async
    /// backward) and 256 (TMA backward on Hopper) with 5 documents (one of one token, ones
    /// crossing tiles, one starting at a tile's first row), windows, another scale, and a row
    /// shorter than a tile.
    type GpuCase = (&'static [usize], usize, usize, Option<usize>, Option<f64>);
    const CASES: [GpuCase; 8] = [
        (&[0, 1, 70, 71, 200, 300], 4, 2, None, None),
        (&[0, 1, 70, 71, 200, 300], 4, 2, Some(37), None),
        (&[0, 64, 65, 130, 190, 256], 6, 2, None, None),
        (&[0, 64, 65, 130, 190, 256], 4, 1, Some(100), None),
        (&[0, 100, 101, 102, 250, 300], 3, 3, Some(7), None),
        (&[0, 10, 11, 30, 59, 60], 4, 2, None, None),
        (&[0, 1, 70, 71, 200, 300], 4, 2, Some(80), Some(0.3)),
        (&[0, 300], 4, 2, None, None),
    ];

    #[test]
    fn varlen_attention_cuda_matches_cpu() -> Result<()> {
        let dev = gpu();
        // f32: 3xTF32 (the default; f32 GEMMs are not allowed TF32 in this process)
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for (i, &(cu, h, hkv, win, scale)) in CASES.iter().enumerate() {
                let n = *cu.last().unwrap();
                let qkv = rand_t(
                    &[1, n, (h + 2 * hkv) * 64],
                    -2.0,
                    2.0,
                    500 + i as u64,
                    dtype,
                    &Device::Cpu,
                );
                let r = rand_t(
                    &[1, n, h * 64],
                    -1.0,
                    1.0,
                    600 + i as u64,
                    DType::F32,
                    &Device::Cpu,
                );
                let (seg_g, seg_c) = (Segments::new(cu, &dev)?, Segments::new(cu, &Device::Cpu)?);
                let fg = |x: &Tensor| ops::grouped_varlen_attention(x, h, hkv, win, scale, &seg_g);
                let fc = |x: &Tensor| ops::grouped_varlen_attention(x, h, hkv, win, scale, &seg_c);
                let (y_g, g_g) = value_and_grad(&fg, &qkv.to_device(&dev)?, &r.to_device(&dev)?)?;
                assert!(y_g.device().is_cuda() && g_g.device().is_cuda());
                let (y_c, g_c) = value_and_grad(&fc, &qkv, &r)?;
                let (ey, eg) = (err(&y_g, &y_c), err(&g_g, &g_c));
                println!("cuda varlen {dtype:?} case {i} {cu:?} H{h} Hkv{hkv} W{win:?} scale {scale:?}: y {ey:.2e} dqkv {eg:.2e}");
                assert!(
                    ey <= tol(dtype) && eg <= tol(dtype),
                    "{dtype:?} case {i}: y {ey:e} dqkv {eg:e}"
                );
                // the composition on the GPU (scores materialised) agrees too
                let fm = |x: &Tensor| {
                    ops::grouped_varlen_attention_composed(x, h, hkv, win, scale, &seg_g)
                };
                let (y_m, g_m) = value_and_grad(&fm, &qkv.to_device(&dev)?, &r.to_device(&dev)?)?;
                let (ey, eg) = (err(&y_m, &y_c), err(&g_m, &g_c));
                assert!(
                    ey <= tol(dtype) && eg <= tol(dtype),
                    "composed {dtype:?} case {i}: y {ey:e} dqkv {eg:e}"
                );
            }
        }
        Ok(())
    }

    /// One document is the unpacked op bit for bit; the backward is deterministic.
    #[test]
    fn cuda_one_document_is_the_unpacked_op_and_deterministic() -> Result<()> {
        let dev = gpu();
        let (n, h, hkv) = (300, 4, 2);
        for dtype in [DType::BF16, DType::F32] {
            let qkv = rand_t(&[1, n, (h + 2 * hkv) * 64], -2.0, 2.0, 700, dtype, &dev);
            let r = rand_t(&[1, n, h * 64], -1.0, 1.0, 701, DType::F32, &dev);
            let one = Segments::new(&[0, n], &dev)?;
            let packed =
                |x: &Tensor| ops::grouped_varlen_attention(x, h, hkv, Some(40), None, &one);
            let plain = |x: &Tensor| ops::grouped_window_attention(x, h, hkv, Some(40));
            let (y1, g1) = value_and_grad(&packed, &qkv, &r)?;
            let (y2, g2) = value_and_grad(&plain, &qkv, &r)?;
            assert_eq!(bits(&y1), bits(&y2), "{dtype:?}: y");
            assert_eq!(bits(&g1), bits(&g2), "{dtype:?}: dqkv");
            let seg = Segments::new(&[0, 1, 70, 71, 200, 300], &dev)?;
            let f = |x: &Tensor| ops::grouped_varlen_attention(x, h, hkv, None, None, &seg);
            assert_deterministic(&f, &qkv, &r, &format!("{dtype:?}"));
        }
        Ok(())
    }

    /// Skipping the tiles outside each document: N = 4096 as 8 documents of 512 takes a
    /// fraction of the causal forward and backward over the whole row (printed; asserted below
    /// the causal time).
    #[test]
    fn varlen_attention_cuda_skips_tiles() -> Result<()> {
        let dev = gpu();
        let (n, h, hkv) = (4096, 8, 2);
        let qkv = rand_t(
            &[1, n, (h + 2 * hkv) * 64],
            -2.0,
            2.0,
            800,
            DType::BF16,
            &dev,
        );
        let r = rand_t(&[1, n, h * 64], -1.0, 1.0, 801, DType::F32, &dev);
        let cu: Vec<usize> = (0..=8).map(|d| d * 512).collect();
        let seg = Segments::new(&cu, &dev)?;
        let time = |f: &dyn Fn(&Tensor) -> Result<Tensor>| -> Result<f64> {
            value_and_grad(f, &qkv, &r)?; // warm-up (module load)
            dev.synchronize()?;
            let reps = 10;
            let start = std::time::Instant::now();
            for _ in 0..reps {
                value_and_grad(f, &qkv, &r)?;
            }
            dev.synchronize()?;
            Ok(start.elapsed().as_secs_f64() * 1e3 / reps as f64)
        };
        let causal = time(&|x: &Tensor| ops::grouped_causal_attention(x, h, hkv))?;
        let packed =
            time(&|x: &Tensor| ops::grouped_varlen_attention(x, h, hkv, None, None, &seg))?;
        println!(
            "bf16 N{n} H{h} Hkv{hkv}: forward+backward causal {causal:.3} ms, 8 documents of 512 \
             {packed:.3} ms ({:.2}x)",
            causal / packed
        );
        assert!(packed < causal, "packed {packed} ms, causal {causal} ms");
        Ok(())
    }

    /// Segments on the CPU for a qkv on the GPU are refused.
    #[test]
    fn cuda_segments_on_another_device_are_refused() -> Result<()> {
        let dev = gpu();
        let qkv = rand_t(&[1, 8, 4 * 64], -1.0, 1.0, 1, DType::F32, &dev);
        let seg = Segments::new(&[0, 3, 8], &Device::Cpu)?;
        let e = ops::grouped_varlen_attention(&qkv, 2, 1, None, None, &seg).unwrap_err();
        assert!(e.to_string().contains("Segments::new"), "{e}");
        Ok(())
    }
}
