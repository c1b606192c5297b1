//! Launcher of kernels/adamw.cu: the fused multi-tensor AdamW step.

use super::{addr, ptx};
use crate::multi_tensor::Row as MtRow;
use crate::optim::AdamWConfig;
use crate::params::Param;
use anyhow::Result;
use candle_core::cuda::cudarc::driver::DeviceRepr;
use candle_core::Tensor;

/// Mirror of `AdamWArgs` in kernels/adamw.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AdamWArgs {
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    seed: u32,
    stochastic: i32,
}

// SAFETY: plain-old-data with the C layout of the kernel's by-value parameter.
unsafe impl DeviceRepr for AdamWArgs {}

/// One parameter of the step: master, gradient (f32/bf16/f16) and the two f32 moments.
pub struct Row<'a> {
    /// The parameter (its f32 master is updated, its working copy written).
    pub param: &'a Param,
    /// Its gradient buffer, contiguous.
    pub grad: &'a Tensor,
    /// First moment (`exp_avg`), f32, the parameter's shape.
    pub m: &'a Tensor,
    /// Second moment (`exp_avg_sq`), f32, the parameter's shape.
    pub v: &'a Tensor,
}

/// Enqueues the AdamW update of every row on candle's stream: one launch per (gradient dtype,
/// working-copy dtype) group and per [`crate::multi_tensor::MAX_TENSORS`] tensors. `stats` is
/// the device `[found_inf, norm, multiplier]`, `amp_state[3]` the applied-step count. No host
/// synchronisation. `seed` seeds stochastic rounding (when `stochastic` is set).
pub fn step(
    rows: &[Row],
    stats: &Tensor,
    amp_state: &Tensor,
    c: &AdamWConfig,
    lr: f64,
    seed: u64,
    stochastic: bool,
) -> Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let dev = super::cuda_device(stats)?;
    let (stats_addr, amp_addr) = (addr(stats)?, addr(amp_state)?);

    let args = AdamWArgs {
        lr,
        beta1: c.beta1,
        beta2: c.beta2,
        eps: c.eps,
        weight_decay: c.weight_decay,
        seed: (seed as u32) ^ ((seed >> 32) as u32).wrapping_mul(0x9E37_79B9),
        stochastic: i32::from(stochastic),
    };
    // keep contiguous copies of non-contiguous gradients alive until the launches are queued
    let mut keep = Vec::new();
    let mut groups: super::UpdateGroups<5> = Default::default();
    for (i, r) in rows.iter().enumerate() {
        let o = super::update_operands("AdamW", r.param, r.grad, &mut keep)?;
        groups
            .entry((o.grad_suffix, o.working_suffix))
            .or_default()
            .push(MtRow {
                addrs: [o.master, o.grad, addr(r.m)?, addr(r.v)?, o.working],
                numel: r.param.elem_count(),
                group: i32::from(r.param.options.weight_decay),
                index: i as i32,
            });
    }
    super::launch_update_groups(
        &dev,
        "mt_adamw",
        "wick_adamw",
        ptx::ADAMW,
        groups,
        stats_addr,
        amp_addr,
        &args,
    )?;
    drop(keep);
    Ok(())
}
