//! Deep copies of a store's weights for inference.

use crate::params::ParamStore;
use anyhow::{Context, Result};
use candle_core::Tensor;
use std::collections::HashMap;

/// Copies of the tensors a model's forward reads, by parameter name: each parameter's
/// working copy (compute dtype, e.g. bf16 under `bf16-mixed`) or its fp32 master where the
/// master is differentiated directly. Independent of the store: later optimizer steps do not
/// change it.
#[derive(Debug, Clone)]
pub struct ParamSnapshot {
    tensors: HashMap<String, Tensor>,
}

impl ParamSnapshot {
    /// The tensor of parameter `name`.
    ///
    /// Errors: no such parameter (the message names it).
    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .with_context(|| format!("the snapshot has no parameter {name:?}"))
    }

    /// Every tensor by name.
    pub fn tensors(&self) -> &HashMap<String, Tensor> {
        &self.tensors
    }

    /// The tensors as one safetensors file in memory (dtypes as held), sorted by name.
    ///
    /// Errors: a dtype safetensors cannot hold.
    pub fn to_safetensors(&self) -> Result<Vec<u8>> {
        let named = self
            .tensors
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        crate::checkpoint::safetensors_bytes(named)
    }
}

/// Deep-copies every parameter of `store` that `keep(name)` selects (all of them with
/// `|_| true`): the tensor its forward reads, detached, in new storage on the same device.
/// Call it between optimizer steps (e.g. on the trainer thread): the copy is then one
/// consistent version of the weights.
///
/// Errors: a failed copy (out of device memory).
pub fn copy_params(store: &ParamStore, keep: impl Fn(&str) -> bool) -> Result<ParamSnapshot> {
    let mut tensors = HashMap::new();
    for p in store.params().into_iter().filter(|p| keep(&p.name)) {
        let t = p
            .differentiated()
            .copy()
            .with_context(|| format!("copying parameter {:?}", p.name))?
            .detach();
        tensors.insert(p.name, t);
    }
    Ok(ParamSnapshot { tensors })
}
