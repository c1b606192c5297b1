//! Launcher of kernels/accumulate.cu: fp32 accumulation of (half) gradients with a weight.

use super::{addr, cuda_device, launch::dtype_name, mt_config, ptx};
use crate::cuda::multi_tensor::{plan, Row};
use anyhow::Result;
use candle_core::cuda::cudarc::driver::PushKernelArg;
use candle_core::cuda::WrapErr;
use candle_core::{DType, Tensor};
use std::collections::BTreeMap;

/// For every `incoming[i]`, `pool[i] = (bufs[i] is None ? 0 : pool[i]) + weight * incoming[i]`
/// in f32 (pool buffers are allocated on first use and reused across steps), then
/// `bufs[i] = pool[i]`. One launch per gradient dtype; no host synchronisation.
pub fn accumulate(
    pool: &mut [Option<Tensor>],
    bufs: &mut [Option<Tensor>],
    incoming: &[Option<Tensor>],
    weight: f32,
) -> Result<()> {
    let mut keep = Vec::new();
    let mut groups: BTreeMap<&'static str, Vec<Row<2>>> = BTreeMap::new();
    let mut dev = None;
    for (i, g) in incoming.iter().enumerate() {
        let Some(g) = g else { continue };
        let g = if g.is_contiguous() {
            g.clone()
        } else {
            g.contiguous()?
        };
        if pool[i].as_ref().is_none_or(|p| p.dims() != g.dims()) {
            pool[i] = Some(Tensor::zeros(g.shape(), DType::F32, g.device())?);
        }
        let acc = pool[i].as_ref().expect("allocated above");
        let first = bufs[i].is_none();
        groups
            .entry(dtype_name("wick kernel", g.dtype())?)
            .or_default()
            .push(Row {
                addrs: [addr(acc)?, addr(&g)?],
                numel: g.elem_count(),
                group: i32::from(first),
                index: i as i32,
            });
        bufs[i] = Some(acc.clone());
        dev.get_or_insert(cuda_device(&g)?);
        keep.push(g);
    }
    let Some(dev) = dev else { return Ok(()) };
    for (suffix, rows) in groups {
        let func = dev.get_or_load_custom_func(
            &format!("mt_accumulate_{suffix}"),
            "wick_accumulate",
            ptx::ACCUMULATE,
        )?;
        for l in plan(&rows) {
            let mut b = func.builder();
            b.arg(&l.meta).arg(&weight);
            unsafe { b.launch(mt_config(&l, 1)) }.w()?;
        }
    }
    drop(keep);
    Ok(())
}
