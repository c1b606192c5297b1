//! Launchers of kernels/grad_norm.cu: gradient statistics at the accumulation boundary and
//! the in-place unscale with found_inf detection.

use super::{addr, cuda_device, launch::dtype_name, mt_config, ptx};
use crate::cuda::multi_tensor::{plan, total_blocks, Row};
use anyhow::Result;
use candle_core::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda::WrapErr;
use candle_core::{DType, Storage, Tensor};
use std::collections::BTreeMap;

/// `[found_inf, norm, multiplier]` (f32, on the device) for gradient buffers `grads` (any mix of
/// f32/bf16/f16), a loss scale in `scaler[0]` (the device [`crate::amp::AmpState`]), the accumulation normaliser
/// `weight_sum = sum_w` and an optional clip threshold. found_inf is also set when the
/// `(1,)` `loss_probe` (the window's first scaled loss plus `0 * scaled_loss` of the
/// others: [`crate::grads::GradBuffers::note_scaled_loss`]) is not finite, and when the
/// multiplier's unscale factor is not a finite positive f32 (an underflowed scale). Deterministic: per-block
/// partial sums of squares in f64 in a fixed order, no float atomics. No host synchronisation.
/// `across` (flat ZeRO-1: `grads` are this rank's part of the gradient): the partial sums are
/// added up and all-reduced over its ranks (one f64, on the device) before the statistics.
pub fn grad_stats(
    grads: &[&Tensor],
    amp_state: &Tensor,
    weight_sum: f32,
    max_norm: Option<f32>,
    loss_probe: Option<&Tensor>,
    across: Option<&dyn crate::collective::Collective>,
) -> Result<Tensor> {
    let dev = cuda_device(amp_state)?;
    let mut keep = Vec::new();
    let mut groups: BTreeMap<&'static str, Vec<Row<1>>> = BTreeMap::new();
    for (i, g) in grads.iter().enumerate() {
        let g = if g.is_contiguous() {
            (*g).clone()
        } else {
            g.contiguous()?
        };
        groups
            .entry(dtype_name("wick kernel", g.dtype())?)
            .or_default()
            .push(Row {
                addrs: [addr(&g)?],
                numel: g.elem_count(),
                group: 0,
                index: i as i32,
            });
        keep.push(g);
    }
    let plans: Vec<(&str, Vec<_>)> = groups
        .into_iter()
        .map(|(k, rows)| (k, plan(&rows)))
        .collect();
    let blocks: u32 = plans.iter().map(|(_, p)| total_blocks(p)).sum();
    // Not zero-filled: every sumsq block writes its partial, finalize every stat. One block per
    // 65,536-element chunk: split into 4, 8 or 16 blocks as the update is (`mt_span`), this
    // read-only pass was slower on the H200 (results/h200-2026-12-04/call1: bf16-mixed boundary
    // 0.927/0.928 ms unsplit, 0.934 at 4, 0.955/0.956 at 8, 1.003 at 16: more partials).
    let partials = uninit(&dev, DType::F64, blocks.max(1) as usize)?;
    let stats = uninit(&dev, DType::F32, 3)?;
    let (partials_addr, amp_addr, stats_addr) = (addr(&partials)?, addr(amp_state)?, addr(&stats)?);
    let mut offset = 0i32;
    for (suffix, launches) in &plans {
        let func = dev.get_or_load_custom_func(
            &format!("mt_sumsq_{suffix}"),
            "wick_grad_norm",
            ptx::GRAD_NORM,
        )?;
        for l in launches {
            let off = offset + l.block_offset as i32;
            let mut b = func.builder();
            b.arg(&l.meta)
                .arg(&partials_addr)
                .arg(&off)
                .arg(&amp_addr)
                .arg(&weight_sum);
            // SAFETY: the table holds live addresses of `numel` elements of the suffix's dtype;
            // the launch's blocks write partials [off, off + blocks) of `partials`.
            unsafe { b.launch(mt_config(l, 1)) }.w()?;
        }
        offset += total_blocks(launches) as i32;
    }
    let (partials, blocks) = match across {
        Some(c) => (c.all_reduce_sum(&partials.sum_keepdim(0)?)?, 1),
        None => (partials, blocks),
    };
    let partials_addr = addr(&partials)?;
    let func =
        dev.get_or_load_custom_func("finalize_grad_stats", "wick_grad_norm", ptx::GRAD_NORM)?;
    let n = blocks as i32;
    let max_norm = max_norm.unwrap_or(0.0);
    let probe_addr = loss_probe.map(addr).transpose()?.unwrap_or(0);
    let mut b = func.builder();
    b.arg(&partials_addr)
        .arg(&n)
        .arg(&amp_addr)
        .arg(&weight_sum)
        .arg(&max_norm)
        .arg(&probe_addr)
        .arg(&stats_addr);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    drop((keep, partials));
    Ok(stats)
}

/// An uninitialised `(n,)` device tensor of `dtype` on `dev`, for outputs that a kernel
/// writes in full before anything reads them.
fn uninit(dev: &candle_core::cuda_backend::CudaDevice, dtype: DType, n: usize) -> Result<Tensor> {
    let s = crate::cuda::launch::alloc(dev, dtype, n)?;
    Ok(Tensor::from_storage(
        Storage::Cuda(s),
        n,
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

/// In place, `g *= inv_scale` for every contiguous gradient in `grads`, and returns a `(1,)`
/// f32 device tensor that is 1 when any element was inf/NaN (the analogue of
/// `torch._amp_foreach_non_finite_check_and_unscale_`). No host synchronisation.
///
/// Errors: a non-contiguous or non-CUDA gradient.
pub fn unscale_check(grads: &[&Tensor], inv_scale: f32) -> Result<Tensor> {
    let first = grads
        .first()
        .ok_or_else(|| anyhow::anyhow!("unscale_check: empty gradient list"))?;
    let dev = cuda_device(first)?;
    let found_inf = Tensor::zeros(1, DType::F32, first.device())?;
    let found_addr = addr(&found_inf)?;
    let mut groups: BTreeMap<&'static str, Vec<Row<1>>> = BTreeMap::new();
    for (i, g) in grads.iter().enumerate() {
        groups
            .entry(dtype_name("wick kernel", g.dtype())?)
            .or_default()
            .push(Row {
                addrs: [addr(g)?],
                numel: g.elem_count(),
                group: 0,
                index: i as i32,
            });
    }
    for (suffix, rows) in groups {
        let func = dev.get_or_load_custom_func(
            &format!("mt_unscale_check_{suffix}"),
            "wick_grad_norm",
            ptx::GRAD_NORM,
        )?;
        for l in plan(&rows) {
            let mut b = func.builder();
            b.arg(&l.meta).arg(&found_addr).arg(&inv_scale);
            unsafe { b.launch(mt_config(&l, 1)) }.w()?;
        }
    }
    Ok(found_inf)
}
