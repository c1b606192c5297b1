//! Launcher of kernels/sgd.cu: the fused multi-tensor SGD step (momentum, dampening, Nesterov,
//! coupled weight decay; `torch.optim.SGD` semantics, see [`crate::optim::sgd`]).

use super::{addr, ptx};
use crate::multi_tensor::Row as MtRow;
use crate::optim::sgd::Coeffs;
use crate::optim::SgdConfig;
use crate::params::Param;
use anyhow::{bail, Result};
use candle_core::cuda::cudarc::driver::DeviceRepr;
use candle_core::{DType, Tensor};

/// Mirror of `SgdArgs` in kernels/sgd.cu. The coefficients are the f32 values of
/// [`Coeffs`], rounded once on the host exactly as the CPU paths round them.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct SgdArgs {
    lr: f32,
    momentum: f32,
    one_minus_dampening: f32,
    /// Weight decay of decayed groups (`tensor_group = 1`); the others use 0.
    weight_decay: f32,
    nesterov: i32,
    seed: u32,
    stochastic: i32,
}

// SAFETY: plain-old-data with the C layout of the kernel's by-value parameter.
unsafe impl DeviceRepr for SgdArgs {}

/// One parameter of the step: master, gradient (f32/bf16/f16) and, with momentum, the f32
/// momentum buffer and its `(1,)` f32 `first_at` marker (see `Buffer::Device` in
/// src/optim/sgd.rs).
pub struct Row<'a> {
    /// The parameter (its f32 master is updated, its working copy written).
    pub param: &'a Param,
    /// Its gradient buffer, contiguous.
    pub grad: &'a Tensor,
    /// The momentum buffer (f32, the parameter's shape), with momentum.
    pub buf: Option<&'a Tensor>,
    /// The `(1,)` f32 marker of the step at which the buffer starts, with momentum.
    pub first_at: Option<&'a Tensor>,
}

/// Enqueues the SGD update of every row on candle's stream: one launch per (gradient dtype,
/// working-copy dtype) group and per [`crate::multi_tensor::MAX_TENSORS`] tensors. `stats` is
/// the device `[found_inf, norm, multiplier]` (nothing is written when found_inf is set),
/// `amp_state[3]` the applied-step count (compared with each row's `first_at`). No host
/// synchronisation. `seed` seeds stochastic rounding of the working copies (when `stochastic` is set).
pub fn step(
    rows: &[Row],
    stats: &Tensor,
    amp_state: &Tensor,
    c: &SgdConfig,
    lr: f64,
    seed: u64,
    stochastic: bool,
) -> Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let dev = super::cuda_device(stats)?;
    let (stats_addr, amp_addr) = (addr(stats)?, addr(amp_state)?);

    // the multiplier is read on the device (stats[2]); the other coefficients are per step
    let k = Coeffs::new(c, lr, true, 1.0);
    let args = SgdArgs {
        lr: k.lr,
        momentum: k.momentum,
        one_minus_dampening: k.one_minus_dampening,
        weight_decay: k.weight_decay,
        nesterov: i32::from(k.nesterov),
        seed: (seed as u32) ^ ((seed >> 32) as u32).wrapping_mul(0x9E37_79B9),
        stochastic: i32::from(stochastic),
    };
    let momentum = k.momentum != 0.0;
    // keep contiguous copies of non-contiguous gradients alive until the launches are queued
    let mut keep = Vec::new();
    let mut groups: super::UpdateGroups<5> = Default::default();
    for (i, r) in rows.iter().enumerate() {
        let o = super::update_operands("SGD", r.param, r.grad, &mut keep)?;
        let (buf_addr, first_addr) = match (momentum, r.buf, r.first_at) {
            (false, _, _) => (0, 0),
            (true, Some(b), Some(f)) => {
                if b.dtype() != DType::F32 || b.elem_count() != r.param.elem_count() {
                    bail!(
                        "fused SGD: momentum buffer of {} must be f32 with {} elements",
                        r.param.name,
                        r.param.elem_count()
                    );
                }
                if f.dtype() != DType::F32 || f.elem_count() != 1 {
                    bail!("fused SGD: first_at of {} must be one f32", r.param.name);
                }
                (addr(b)?, addr(f)?)
            }
            (true, _, _) => bail!("fused SGD: {} has no momentum buffer", r.param.name),
        };
        groups
            .entry((o.grad_suffix, o.working_suffix))
            .or_default()
            .push(MtRow {
                addrs: [o.master, o.grad, buf_addr, o.working, first_addr],
                numel: r.param.elem_count(),
                group: i32::from(r.param.options.weight_decay),
                index: i as i32,
            });
    }
    super::launch_update_groups(
        &dev,
        "mt_sgd",
        "wick_sgd",
        ptx::SGD,
        groups,
        stats_addr,
        amp_addr,
        &args,
    )?;
    drop(keep);
    Ok(())
}
