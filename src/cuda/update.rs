//! Launchers of the fused optimizer updates (kernels/adamw.cu, kernels/sgd.cu, one per
//! [`crate::optim::UpdateRule`]) and of the per-parameter step counter (kernels/scaler.cu).
//!
//! Every update kernel has the signature `{prefix}_{grad}_{working}(TensorListMeta<5> meta,
//! const float* stats, const long long* steps, Args args)` and the lists `0` master (f32),
//! `1` gradient, `2` and `3` the rule's state tensors (f32; 0 where absent), `4` the working
//! copy (0 where absent); `tensor_index` is the parameter's index in the store, into `steps`.

use super::{addr, cuda_device, mt_config, update_operands, UpdateGroups};
use crate::cuda::multi_tensor::Row as MtRow;
use crate::params::Param;
use anyhow::{bail, Result};
use candle_core::cuda::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda::WrapErr;
use candle_core::{DType, Tensor};

/// Where a rule's update kernel lives: `mt_{name}_{grad}_{working}` (kernels/multi_tensor.cuh's
/// `MT_UPDATE_KERNELS`) in `ptx`, loaded as module `wick_{name}`.
#[derive(Debug, Clone, Copy)]
pub struct Kernel {
    /// The rule's kernel name (`"adamw"`).
    pub name: &'static str,
    /// The PTX source ([`super::ptx`]).
    pub ptx: &'static str,
}

/// The stochastic-rounding fields every update kernel's argument struct ends with (`seed`,
/// `stochastic` in kernels/adamw.cu and kernels/sgd.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Rounding {
    /// Seed of this step (mixed with the tensor index in the kernel).
    pub seed: u32,
    /// 1: stochastic rounding of the working copy; 0: round to nearest even.
    pub stochastic: i32,
}

/// Declares a rule's kernel argument struct, `#[repr(C)]` with the fields given and
/// [`Rounding`] last, as the kernel's by-value parameter.
macro_rules! kernel_args {
    ($(#[$m:meta])* pub struct $name:ident { $($(#[$fm:meta])* $f:ident: $t:ty,)* }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug)]
        pub struct $name {
            $($(#[$fm])* $f: $t,)*
            rounding: $crate::cuda::update::Rounding,
        }
        // SAFETY: plain-old-data with the C layout of the kernel's by-value parameter.
        unsafe impl candle_core::cuda::cudarc::driver::DeviceRepr for $name {}
    };
}
pub(crate) use kernel_args;

/// One parameter of a fused update.
pub struct Row<'a> {
    /// The parameter (its f32 master is updated, its working copy written).
    pub param: &'a Param,
    /// Its gradient buffer (f32/bf16/f16; converted or made contiguous where needed).
    pub grad: &'a Tensor,
    /// The rule's state tensors (f32, the parameter's shape), in the rule's order.
    pub states: [Option<&'a Tensor>; 2],
    /// The parameter's index in the store (into the step counts).
    pub index: usize,
}

/// Enqueues `kernel` for every row on candle's stream: one launch per (gradient dtype,
/// working-copy dtype) group and per [`crate::cuda::multi_tensor::MAX_TENSORS`] tensors. `stats` is
/// the device `[found_inf, norm, multiplier]` (nothing is written when found_inf is set),
/// `steps` the `(n,)` i64 per-parameter step counts. No host synchronisation.
pub fn launch<A: DeviceRepr>(
    kernel: &Kernel,
    rows: &[Row],
    stats: &Tensor,
    steps: &Tensor,
    args: &A,
) -> Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let dev = cuda_device(stats)?;
    let (stats_addr, steps_addr) = (addr(stats)?, addr(steps)?);
    // keep contiguous copies of non-contiguous gradients alive until the launches are queued
    let mut keep = Vec::new();
    let mut groups: UpdateGroups<5> = Default::default();
    for r in rows {
        let o = update_operands(kernel.name, r.param, r.grad, &mut keep)?;
        let mut st = [0u64; 2];
        for (a, s) in st.iter_mut().zip(&r.states) {
            if let Some(s) = s {
                if s.dtype() != DType::F32 || s.elem_count() != r.param.elem_count() {
                    bail!(
                        "fused update: a state tensor of {} must be f32 with {} elements",
                        r.param.name,
                        r.param.elem_count()
                    );
                }
                *a = addr(s)?;
            }
        }
        groups
            .entry((o.grad_suffix, o.working_suffix))
            .or_default()
            .push(MtRow {
                addrs: [o.master, o.grad, st[0], st[1], o.working],
                numel: r.param.elem_count(),
                group: i32::from(r.param.options.weight_decay),
                index: r.index as i32,
            });
    }
    let split = update_split();
    let module = format!("wick_{}", kernel.name);
    for ((gs, ws), list) in groups {
        let name = format!("mt_{}_{gs}_{ws}", kernel.name);
        let func = dev.get_or_load_custom_func(&name, &module, kernel.ptx)?;
        for l in crate::cuda::multi_tensor::plan(&list) {
            let mut b = func.builder();
            b.arg(&l.meta)
                .arg(&split)
                .arg(&stats_addr)
                .arg(&steps_addr)
                .arg(args);
            // SAFETY: the table holds live device addresses of `numel` elements per list, of
            // the dtypes the kernel's suffixes name; stats is f32, steps i64 with an element
            // per parameter index; `split` divides the chunk into parts of whole vectors.
            unsafe { b.launch(mt_config(&l, split as u32)) }.w()?;
        }
    }
    drop(keep);
    Ok(())
}

/// Blocks per chunk of the update launches (`mt_span` in kernels/multi_tensor.cuh): 4,096
/// elements per block. On the H200 (results/h200-2026-12-03-optimizer-split/call1, GPT-2-124M
/// shapes, two runs each) AdamW took 0.887/0.880 ms at 1, 0.863/0.862 at 4, 0.838/0.843 at 16;
/// the bf16-mixed boundary 0.990/0.995, 0.970/0.979, 0.955/0.953. `WICK_MT_SPLIT` (a power of
/// two up to 64) overrides it, for measuring; read once per process (not on every step).
fn update_split() -> i32 {
    static SPLIT: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *SPLIT.get_or_init(|| {
        std::env::var("WICK_MT_SPLIT")
            .ok()
            .and_then(|v| v.parse::<i32>().ok())
            .filter(|s| (1..=64).contains(s) && s.count_ones() == 1)
            .unwrap_or(16)
    })
}

/// Enqueues `steps[index[i]] += 1` for every `i` unless `stats[0]` (found_inf) is set.
/// `steps`: `(n,)` i64; `index`: `(k,)` u32 of distinct entries `< n`.
pub fn count_steps(steps: &Tensor, index: &Tensor, stats: &Tensor) -> Result<()> {
    let k = index.elem_count();
    if k == 0 {
        return Ok(());
    }
    if steps.dtype() != DType::I64 || index.dtype() != DType::U32 {
        bail!("count_steps: steps must be i64 and index u32");
    }
    let dev = cuda_device(steps)?;
    let func = dev.get_or_load_custom_func("count_steps", "wick_scaler", super::ptx::SCALER)?;
    let (s, i, st) = (addr(steps)?, addr(index)?, addr(stats)?);
    let n = k as i32;
    let mut b = func.builder();
    b.arg(&s).arg(&i).arg(&n).arg(&st);
    let cfg = LaunchConfig {
        grid_dim: (k.div_ceil(256).min(64) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: steps holds an i64 per parameter, index k distinct u32 entries below that count.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}
