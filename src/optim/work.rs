//! The work list of an optimizer step, shared by both rule kinds' drivers: which parameters
//! are updated, each checked before anything changes, so that a step refused by validation changes nothing.

use crate::params::Param;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

/// The parameters to update this step (indices into `params`, ascending): those with a
/// gradient, trainable and (ZeRO-1, `owned[i]`) owned by this rank. One gradient slot per
/// parameter is required, and every one is checked (the
/// gradient's element count, an f32 master and a float gradient, the same device); an error
/// names the optimizer (`name`), the first bad parameter, and says nothing was updated.
pub(crate) fn work_list(
    name: &str,
    params: &[Param],
    grads: &[Option<Tensor>],
    owned: Option<&[bool]>,
) -> Result<Vec<usize>> {
    if grads.len() != params.len() {
        bail!(
            "{name}::step: {} gradient slots for {} parameters",
            grads.len(),
            params.len()
        );
    }
    let mut work = Vec::new();
    for (i, (p, g)) in params.iter().zip(grads).enumerate() {
        let Some(g) = g else { continue };
        let owned = owned.is_none_or(|o| o.get(i) == Some(&true));
        if p.options.frozen || !owned {
            continue;
        }
        if g.elem_count() != p.elem_count() {
            bail!(
                "{name}::step: the gradient of {} has shape {:?}, the parameter {:?}; nothing \
                 was updated",
                p.name,
                g.dims(),
                p.master.dims()
            );
        }
        if p.master.dtype() != DType::F32 || !g.dtype().is_float() {
            bail!(
                "{name}::step: {} needs an f32 master and a float gradient, found master \
                 {:?} and gradient {:?}; nothing was updated",
                p.name,
                p.master.dtype(),
                g.dtype()
            );
        }
        if !g.device().same_device(p.master.device()) {
            bail!(
                "{name}::step: the gradient of {} is on {:?}, the master on {:?}; nothing was \
                 updated",
                p.name,
                g.device(),
                p.master.device()
            );
        }
        work.push(i);
    }
    Ok(work)
}
