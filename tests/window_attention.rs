//! Sliding windows in the fused attention op ([`ops::grouped_window_attention`]): query i sees
//! key j iff `j <= i` and `i - j < W`. On the CPU the op's reference implementation against the
//! composition [`ops::grouped_attention`] (values and gradients), a window of at least T against
//! the causal op bit for bit, and the dispatch of [`ops::window_causal_attention`]. With the
//! `cuda` feature, the flash kernels (forward, dK/dV, dQ; mma.sync, and wgmma/TMA on Hopper for
//! bf16/f16) against the CPU reference (run on a GPU machine:
//! `cargo test --release --features cuda --test window_attention`; on an H100/H200 run it again
//! with `WICK_ATTENTION_KERNELS=mma` for the mma.sync build of bf16/f16, and with
//! `WICK_ATTENTION_LOADS=cp` for the wgmma kernels' cp.async loads).

mod common;

use candle_core::{DType, Device, Result, Tensor};
use common::tensors::{bits, err, rand_t, value_and_grad};
use wick::ops;

/// The composition: q, k, v split from qkv, [`ops::grouped_attention`] with the window and the
/// default scale.
fn composed(qkv: &Tensor, h: usize, hkv: usize, window: Option<usize>) -> Result<Tensor> {
    let (b, t, w) = qkv.dims3()?;
    let d = w / (h + 2 * hkv);
    let part = |first: usize, heads: usize| {
        qkv.narrow(2, first * d, heads * d)?
            .reshape((b, t, heads, d))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (q, k, v) = (part(0, h)?, part(h, hkv)?, part(h + hkv, hkv)?);
    ops::grouped_attention(&q, &k, &v, 0, window, 1.0 / (d as f64).sqrt())
}

/// `(B, T, H, Hkv, W, D)`: windows of one key, less than a tile, a tile and more, partial last
/// tiles, grouped, multi-query and multi-head.
const CPU_CASES: [(usize, usize, usize, usize, usize, usize); 7] = [
    (2, 100, 4, 2, 7, 16),
    (1, 130, 3, 3, 64, 64),
    (2, 70, 6, 2, 1, 8),
    (1, 256, 2, 1, 100, 64),
    (1, 300, 2, 2, 7, 64),
    (2, 60, 4, 1, 5, 32),
    (1, 65, 2, 1, 64, 64),
];

#[test]
fn windowed_fused_op_matches_the_composition_on_cpu() -> Result<()> {
    for (i, &(b, t, h, hkv, win, d)) in CPU_CASES.iter().enumerate() {
        let qkv = rand_t(
            &[b, t, (h + 2 * hkv) * d],
            -2.0,
            2.0,
            100 + i as u64,
            DType::F32,
            &Device::Cpu,
        );
        let r = rand_t(
            &[b, t, h * d],
            -1.0,
            1.0,
            200 + i as u64,
            DType::F32,
            &Device::Cpu,
        );
        let fused = |x: &Tensor| ops::grouped_window_attention(x, h, hkv, Some(win));
        let reference = |x: &Tensor| composed(x, h, hkv, Some(win));
        let (y_f, g_f) = value_and_grad(&fused, &qkv, &r)?;
        let (y_r, g_r) = value_and_grad(&reference, &qkv, &r)?;
        let (ey, eg) = (err(&y_f, &y_r), err(&g_f, &g_r));
        println!(
            "cpu window {win} {:?}: y {ey:.2e} dqkv {eg:.2e}",
            (b, t, h, hkv, d)
        );
        assert!(ey <= 2e-5 && eg <= 2e-5, "case {i}: y {ey:e} dqkv {eg:e}");
        // the window binds: the causal op differs
        let causal = ops::grouped_causal_attention(&qkv, h, hkv)?;
        assert!(
            err(&causal, &y_r) > 1e-3,
            "case {i}: the window changed nothing"
        );
        // window_causal_attention with the default scale is this very op
        let dispatched = ops::window_causal_attention(&qkv, h, hkv, Some(win), None)?;
        assert_eq!(
            bits(&dispatched),
            bits(&y_f),
            "case {i}: window_causal_attention"
        );
    }
    Ok(())
}

#[test]
fn window_of_at_least_t_is_the_causal_op_exactly() -> Result<()> {
    for (i, &(b, t, h, hkv)) in [
        (2usize, 100usize, 4usize, 2usize),
        (1, 64, 3, 3),
        (1, 1, 2, 1),
    ]
    .iter()
    .enumerate()
    {
        let d = 64;
        let qkv = rand_t(
            &[b, t, (h + 2 * hkv) * d],
            -2.0,
            2.0,
            300 + i as u64,
            DType::F32,
            &Device::Cpu,
        );
        let r = rand_t(
            &[b, t, h * d],
            -1.0,
            1.0,
            310 + i as u64,
            DType::F32,
            &Device::Cpu,
        );
        let causal = |x: &Tensor| ops::grouped_causal_attention(x, h, hkv);
        let (y_c, g_c) = value_and_grad(&causal, &qkv, &r)?;
        for win in [None, Some(t), Some(t + 1), Some(usize::MAX)] {
            let f = |x: &Tensor| ops::grouped_window_attention(x, h, hkv, win);
            let (y, g) = value_and_grad(&f, &qkv, &r)?;
            assert_eq!(bits(&y), bits(&y_c), "case {i} window {win:?}: y");
            assert_eq!(bits(&g), bits(&g_c), "case {i} window {win:?}: dqkv");
        }
    }
    Ok(())
}

#[test]
fn window_one_is_v_and_zero_is_refused() -> Result<()> {
    // a window of one key: each query sees only its own, y = its v head (bf16 too)
    let (b, t, h, hkv, d) = (2, 50, 4, 2, 64);
    for dtype in [DType::F32, DType::BF16] {
        let qkv = rand_t(
            &[b, t, (h + 2 * hkv) * d],
            -2.0,
            2.0,
            400,
            dtype,
            &Device::Cpu,
        );
        let y = ops::grouped_window_attention(&qkv, h, hkv, Some(1))?;
        let v = qkv
            .narrow(2, (h + hkv) * d, hkv * d)?
            .reshape((b, t, hkv, 1, d))?;
        let v = v
            .broadcast_as((b, t, hkv, h / hkv, d))?
            .reshape((b, t, h * d))?;
        assert_eq!(err(&y, &v), 0.0, "{dtype:?}");
    }
    let qkv = rand_t(&[1, 4, 4 * 64], -1.0, 1.0, 401, DType::F32, &Device::Cpu);
    let e = ops::grouped_window_attention(&qkv, 2, 1, Some(0)).unwrap_err();
    assert!(e.to_string().contains("window Some(0)"), "{e}");
    // layouts as grouped_causal_attention: a bad width is refused the same way
    assert!(ops::grouped_window_attention(&qkv, 3, 1, Some(2)).is_err());
    // empty
    let empty = Tensor::zeros((2, 0, 4 * 64), DType::F32, &Device::Cpu)?;
    assert_eq!(
        ops::grouped_window_attention(&empty, 2, 1, Some(3))?.dims(),
        &[2, 0, 128]
    );
    Ok(())
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use common::tensors::assert_deterministic;
    use std::time::Instant;

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

    /// `(B, T, H, Hkv, W)` at D = 64: windows 1, 7, 64, 100 at T 256 (TMA backward on Hopper)
    /// and 300 (partial last tile; cp.async backward), grouped, multi-query, multi-head, and a
    /// sequence shorter than a tile.
    const CASES: [(usize, usize, usize, usize, usize); 10] = [
        (2, 256, 4, 2, 1),
        (2, 256, 4, 2, 7),
        (1, 256, 6, 2, 64),
        (2, 256, 4, 1, 100),
        (2, 300, 4, 2, 1),
        (1, 300, 6, 3, 7),
        (2, 300, 4, 2, 64),
        (1, 300, 3, 3, 100),
        (2, 60, 4, 2, 5),
        (1, 1000, 2, 1, 129),
    ];

    #[test]
    fn windowed_attention_cuda_matches_cpu() -> Result<()> {
        let dev = gpu();
        // f32: 3xTF32 (the default; f32 GEMMs are not allowed TF32 in this process)
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for (i, &(b, t, h, hkv, win)) in CASES.iter().enumerate() {
                let qkv = rand_t(
                    &[b, t, (h + 2 * hkv) * 64],
                    -2.0,
                    2.0,
                    500 + i as u64,
                    dtype,
                    &Device::Cpu,
                );
                let r = rand_t(
                    &[b, t, h * 64],
                    -1.0,
                    1.0,
                    600 + i as u64,
                    DType::F32,
                    &Device::Cpu,
                );
                let f = |x: &Tensor| ops::grouped_window_attention(x, h, hkv, Some(win));
                let (y_g, g_g) = value_and_grad(&f, &qkv.to_device(&dev)?, &r.to_device(&dev)?)?;
                assert!(y_g.device().is_cuda() && g_g.device().is_cuda());
                let (y_c, g_c) = value_and_grad(&f, &qkv, &r)?;
                let (ey, eg) = (err(&y_g, &y_c), err(&g_g, &g_c));
                println!(
                    "cuda window {win} {dtype:?} {:?}: y {ey:.2e} dqkv {eg:.2e}",
                    (b, t, h, hkv)
                );
                assert!(
                    ey <= tol(dtype) && eg <= tol(dtype),
                    "{dtype:?} case {i} {:?} window {win}: y {ey:e} dqkv {eg:e}",
                    (b, t, h, hkv)
                );
            }
        }
        Ok(())
    }

    #[test]
    fn cuda_window_of_at_least_t_is_the_causal_op_and_backward_is_deterministic() -> Result<()> {
        let dev = gpu();
        let (b, t, h, hkv) = (2, 300, 4, 2);
        for dtype in [DType::BF16, DType::F32] {
            let qkv = rand_t(&[b, t, (h + 2 * hkv) * 64], -2.0, 2.0, 700, dtype, &dev);
            let r = rand_t(&[b, t, h * 64], -1.0, 1.0, 701, DType::F32, &dev);
            let causal = |x: &Tensor| ops::grouped_causal_attention(x, h, hkv);
            let (y_c, g_c) = value_and_grad(&causal, &qkv, &r)?;
            for win in [Some(t), Some(t + 5)] {
                let f = |x: &Tensor| ops::grouped_window_attention(x, h, hkv, win);
                let (y, g) = value_and_grad(&f, &qkv, &r)?;
                assert_eq!(bits(&y), bits(&y_c), "{dtype:?} window {win:?}: y");
                assert_eq!(bits(&g), bits(&g_c), "{dtype:?} window {win:?}: dqkv");
            }
            let f = |x: &Tensor| ops::grouped_window_attention(x, h, hkv, Some(37));
            assert_deterministic(&f, &qkv, &r, &format!("{dtype:?}"));
        }
        Ok(())
    }

    /// Skipping the tiles outside the window: at T = 4096 with W = 512 the windowed forward and
    /// backward take a fraction of the causal ones (printed; asserted below the causal time).
    #[test]
    fn windowed_attention_cuda_skips_tiles() -> Result<()> {
        let dev = gpu();
        let (b, t, h, hkv, win) = (4, 4096, 8, 2, 512);
        let qkv = rand_t(
            &[b, t, (h + 2 * hkv) * 64],
            -2.0,
            2.0,
            800,
            DType::BF16,
            &dev,
        );
        let r = rand_t(&[b, t, h * 64], -1.0, 1.0, 801, DType::F32, &dev);
        let time = |window: Option<usize>| -> Result<f64> {
            let f = |x: &Tensor| ops::grouped_window_attention(x, h, hkv, window);
            value_and_grad(&f, &qkv, &r)?; // warm-up (module load)
            dev.synchronize()?;
            let n = 10;
            let start = Instant::now();
            for _ in 0..n {
                value_and_grad(&f, &qkv, &r)?;
            }
            dev.synchronize()?;
            Ok(start.elapsed().as_secs_f64() * 1e3 / n as f64)
        };
        let causal = time(None)?;
        let windowed = time(Some(win))?;
        println!(
            "bf16 B{b} T{t} H{h} Hkv{hkv}: forward+backward causal {causal:.3} ms, window {win} \
             {windowed:.3} ms ({:.2}x)",
            causal / windowed
        );
        assert!(
            windowed < causal,
            "windowed {windowed} ms, causal {causal} ms"
        );
        Ok(())
    }
}
