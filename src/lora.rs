//! LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
//! arXiv:2106.09685) with the semantics and tensor names of Hugging Face PEFT's `LoraConfig` /
//! `lora.Linear`:
//!
//! ```text
//! y = x W^T + (alpha / r) · B (A dropout(x))      A: (r, in), B: (out, r)
//! ```
//! (with `use_rslora`, rank-stabilised LoRA, Kalajdzievski 2023, arXiv:2312.03732, the scale
//! is `alpha / sqrt(r)`, as PEFT's `LoraLayer.update_layer` sets it).
//! `A` starts as PyTorch's `kaiming_uniform_(a = sqrt(5))` (`U(-1/sqrt(in), 1/sqrt(in))`), `B` at
//! zero, so a fresh adapter leaves the base model's outputs unchanged. The base weight `W` is
//! frozen and held outside the [`ParamStore`] (a constant in the compute dtype: no fp32 master,
//! no moments, no gradient); `A` and `B` are store parameters with fp32 masters.
//!
//! Tensor names are PEFT's module names plus `.lora_A.weight` / `.lora_B.weight`
//! (`model.layers.0.self_attn.q_proj.lora_A.weight`). Modules that read the same input may
//! share one stacked store parameter ([`LoraAdapter::new_stacked`], named by their brace list);
//! [`save_adapter_tensors`] writes per-module tensors with PEFT's `base_model.model.` prefix and
//! an `adapter_config.json`, the layout `PeftModel.from_pretrained` reads.

use crate::params::{ParamStore, Role};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use candle_nn::Init;
use std::path::Path;

/// Which linears get adapters, and their size.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// Rank `r` of the update (`>= 1`).
    pub r: usize,
    /// Scale numerator: the update is multiplied by `alpha / r` (PEFT's `lora_alpha`).
    pub alpha: f64,
    /// Rank-stabilised LoRA (PEFT's `use_rslora`): the scale is `alpha / sqrt(r)` instead.
    pub use_rslora: bool,
    /// Dropout probability on the adapter's input during training (`0 <= p < 1`).
    pub dropout: f64,
    /// Module names (PEFT's `target_modules`): a module is adapted when its full name equals
    /// an entry or ends with `.` + the entry (`"q_proj"` matches
    /// `model.layers.3.self_attn.q_proj`); an entry with `*`, `?` or `[` is a glob over the full
    /// name instead.
    pub target_modules: Vec<String>,
}

/// PEFT's usual Llama target set: the seven block linears.
pub const ALL_LINEAR: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

impl LoraConfig {
    /// PEFT's usual Llama set: the seven block linears, rank `r`, `alpha`, no dropout.
    pub fn all_linear(r: usize, alpha: f64) -> Self {
        Self {
            r,
            alpha,
            use_rslora: false,
            dropout: 0.0,
            target_modules: ALL_LINEAR.map(String::from).to_vec(),
        }
    }

    /// The multiplier of `B A x`: `alpha / r`, or `alpha / sqrt(r)` with `use_rslora` (PEFT's
    /// `LoraLayer.update_layer`).
    pub fn scaling(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    /// Checks the values.
    ///
    /// Errors: `r == 0`, `alpha` not finite, dropout outside `[0, 1)`, no target module, an
    /// invalid glob, or a target that names the output head or the token table (`lm_head`,
    /// `embed_tokens`: wick adapts the block linears only, and would leave them unadapted).
    pub fn validate(&self) -> Result<()> {
        if self.r == 0 {
            bail!("LoraConfig: r is 0; the rank must be >= 1");
        }
        if !self.alpha.is_finite() {
            bail!("LoraConfig: alpha {} is not finite", self.alpha);
        }
        if !(0.0..1.0).contains(&self.dropout) {
            bail!("LoraConfig: dropout {} must be in [0, 1)", self.dropout);
        }
        if self.target_modules.is_empty() {
            bail!("LoraConfig: no target module; name at least one (e.g. \"q_proj\")");
        }
        for t in self.target_modules.iter().filter(|t| is_glob(t)) {
            glob::Pattern::new(t)
                .with_context(|| format!("LoraConfig: target module {t:?} is not a valid glob"))?;
        }
        for module in UNADAPTABLE {
            if let Some(t) = self
                .target_modules
                .iter()
                .find(|t| self.targets_by(t, module))
            {
                bail!(
                    "LoraConfig: target module {t:?} names {module}, which wick cannot adapt (it \
                     adapts the block linears q/k/v/o_proj and gate/up/down_proj only); remove \
                     it from target_modules, or train that module with a full fine-tune"
                );
            }
        }
        Ok(())
    }

    /// Whether the module called `module` (full name, no `.weight`) gets an adapter.
    pub fn targets(&self, module: &str) -> bool {
        self.target_modules
            .iter()
            .any(|t| self.targets_by(t, module))
    }

    fn targets_by(&self, t: &str, module: &str) -> bool {
        if is_glob(t) {
            glob::Pattern::new(t).is_ok_and(|p| p.matches(module))
        } else {
            module == t || module.ends_with(&format!(".{t}"))
        }
    }
}

/// Modules outside the blocks that PEFT can adapt and wick cannot: a target naming one is
/// refused ([`LoraConfig::validate`]).
const UNADAPTABLE: [&str; 2] = ["lm_head", "model.embed_tokens"];

/// `adapter_config.json` keys that do not change the adapted model (bookkeeping, or settings
/// that only matter when PEFT initialises a new adapter).
const HARMLESS_ADAPTER_KEYS: &[&str] = &[
    "task_type",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "auto_mapping",
    "peft_version",
    "megatron_config",
    "megatron_core",
    "loftq_config",
    "eva_config",
    "corda_config",
    "runtime_config",
    "qalora_group_size",
    "ensure_weight_tying",
];

/// Checks one key of an `adapter_config.json` beside the ones [`load_adapters`] reads:
/// harmless, or holding the value that leaves the math as wick computes it; else an error
/// naming the key and its value.
fn check_adapter_key(key: &str, v: &serde_json::Value) -> Result<()> {
    use serde_json::Value;
    let empty = || match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    };
    let off = || matches!(v, Value::Null | Value::Bool(false));
    let (ok, what) = match key {
        k if HARMLESS_ADAPTER_KEYS.contains(&k) => (true, ""),
        "peft_type" => (v.as_str() == Some("LORA"), "wick reads LoRA adapters"),
        "bias" => (
            matches!(v.as_str(), None | Some("none")),
            "trained biases are not implemented",
        ),
        "fan_in_fan_out" => (
            off(),
            "transposed (Conv1D) base weights are not implemented",
        ),
        "modules_to_save" => (
            empty(),
            "fully trained extra modules are not loaded; merge them into the base model",
        ),
        "use_dora" => (off(), "DoRA (weight-decomposed LoRA) is not implemented"),
        "lora_bias" => (off(), "a bias on lora_B is not implemented"),
        "use_qalora" => (off(), "QA-LoRA is not implemented"),
        "rank_pattern" | "alpha_pattern" => {
            (empty(), "per-module ranks and alphas are not implemented")
        }
        "layers_to_transform" | "layers_pattern" | "exclude_modules" | "target_parameters" => (
            empty(),
            "only target_modules selects the adapted modules in wick",
        ),
        "layer_replication" => (empty(), "replicated layers are not implemented"),
        "trainable_token_indices" => (empty(), "trainable token rows are not implemented"),
        "alora_invocation_tokens" => (empty(), "activated LoRA is not implemented"),
        "arrow_config" => (empty(), "Arrow routing is not implemented"),
        // only the initialisation of a new adapter; PiSSA, OLoRA, LoftQ, EVA and CorDA also
        // change the base weights, which a loaded adapter would then not match
        "init_lora_weights" => (
            matches!(v, Value::Bool(_) | Value::Null) || v.as_str() == Some("gaussian"),
            "this initialisation changes the base weights too; convert the adapter to a plain \
             LoRA first (PEFT's path_initial_model_for_weight_conversion)",
        ),
        _ => (
            false,
            "wick does not know this key, so it cannot tell whether it changes the adapted \
             model; delete it if it does not",
        ),
    };
    if !ok {
        bail!("key {key:?} = {v}: {what}");
    }
    Ok(())
}

fn is_glob(t: &str) -> bool {
    t.contains(['*', '?', '['])
}

/// One adapter's differentiated tensors: `A: (r, in)` and `B: (out, r)`, in the compute dtype
/// (working copies of fp32 masters in `store`).
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    /// Down projection `(r, in)`.
    pub a: Tensor,
    /// Up projection `(out, r)`.
    pub b: Tensor,
}

impl LoraAdapter {
    /// Creates (or finds) the parameters `{module}.lora_A.weight` and `{module}.lora_B.weight`
    /// of an adapter for a linear `(out, in)`, initialised as PEFT does.
    ///
    /// Errors: a parameter of that name with another shape.
    pub fn new(
        store: &ParamStore,
        module: &str,
        in_dim: usize,
        out_dim: usize,
        r: usize,
    ) -> Result<Self> {
        Self::new_stacked(store, module, in_dim, &[out_dim], r)
    }

    /// The adapters of several linears that read the same input (`q_proj`, `k_proj`, `v_proj`)
    /// as one pair of parameters: A `(P r, in)` with module i's down projection at rows
    /// `i r..(i + 1) r`, and B `(sum out_i, r)` with module i's up projection at its rows, in
    /// order. Named `{name}.lora_A.weight` / `{name}.lora_B.weight`, where `name` is the
    /// modules' brace list (`model.layers.0.self_attn.{q_proj,k_proj,v_proj}`, see
    /// [`stacked_modules`]), and initialised as PEFT initialises each module's (A uniform in
    /// `±1/sqrt(in)`, B zero). A stacked projection reads them as they are: no concatenation
    /// per step, and one gradient and one optimizer entry per stack instead of per module.
    /// [`LoraAdapter::part`] gives each module's views.
    ///
    /// Errors: no modules, a zero size, a parameter of that name with another shape.
    pub fn new_stacked(
        store: &ParamStore,
        name: &str,
        in_dim: usize,
        outs: &[usize],
        r: usize,
    ) -> Result<Self> {
        if outs.is_empty() || in_dim == 0 || r == 0 || outs.contains(&0) {
            bail!(
                "LoraAdapter {name}: in {in_dim}, outs {outs:?}, rank {r}: every size must be > 0"
            );
        }
        let bound = 1.0 / (in_dim as f64).sqrt();
        let a = store.get_or_init(
            &format!("{name}.lora_A.weight"),
            (outs.len() * r, in_dim),
            Init::Uniform {
                lo: -bound,
                up: bound,
            },
            Role::Matmul,
        )?;
        let b = store.get_or_init(
            &format!("{name}.lora_B.weight"),
            (outs.iter().sum::<usize>(), r),
            Init::Const(0.0),
            Role::Matmul,
        )?;
        Ok(Self { a, b })
    }

    /// Module `i`'s adapter in a stack made by [`LoraAdapter::new_stacked`] with these `outs`:
    /// views of the stacks (A rows `i r..`, B rows after the earlier modules' outputs) that
    /// share their storage, so they follow the stacks' updates.
    ///
    /// Errors: `i` out of range, or stacks whose shapes do not match `outs`.
    pub fn part(&self, outs: &[usize], i: usize) -> Result<LoraAdapter> {
        let (pr, _) = self.a.dims2()?;
        let (n, r) = self.b.dims2()?;
        if i >= outs.len() || pr != outs.len() * r || n != outs.iter().sum::<usize>() {
            bail!(
                "LoraAdapter::part: module {i} of outs {outs:?} does not fit stacks A {:?}, B {:?}",
                self.a.dims(),
                self.b.dims()
            );
        }
        let row: usize = outs[..i].iter().sum();
        Ok(LoraAdapter {
            a: self.a.narrow(0, i * r, r)?,
            b: self.b.narrow(0, row, outs[i])?,
        })
    }

    /// `scaling · B A` as an `(out, in)` f32 tensor: what merging adds to the base weight.
    pub fn delta(&self, scaling: f64) -> Result<Tensor> {
        let a = self.a.detach().to_dtype(DType::F32)?;
        let b = self.b.detach().to_dtype(DType::F32)?;
        Ok(b.matmul(&a)?.affine(scaling, 0.0)?)
    }
}

/// The prefix PEFT puts before module names in saved adapter files.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// Writes adapter tensors by wick's per-module names (`{module}.lora_A.weight`, any float
/// dtype and device, stored as they are: e.g. the fp32 masters from
/// [`crate::models::Decoder::adapter_masters`], or a served snapshot's
/// [`crate::models::Decoder::adapter_tensors`]) to `dir/adapter_model.safetensors` with PEFT's
/// names (`base_model.model.{module}.lora_A.weight`) and `dir/adapter_config.json` (PEFT's
/// LoRA fields, `task_type` `CAUSAL_LM`), each atomically. `base_model` names the base model
/// in the config (`base_model_name_or_path`).
///
/// Errors: no tensors, a name that is not an adapter's, an I/O failure (naming the file).
pub fn save_adapter_tensors(
    tensors: Vec<(String, Tensor)>,
    config: &LoraConfig,
    base_model: &str,
    dir: &Path,
) -> Result<()> {
    if tensors.is_empty() {
        bail!("save_adapter_tensors: no tensors to save");
    }
    if let Some((n, _)) = tensors.iter().find(|(n, _)| !is_adapter(n)) {
        bail!("save_adapter_tensors: {n:?} is not a LoRA tensor (*.lora_A.* / *.lora_B.*)");
    }
    let tensors = tensors
        .into_iter()
        .map(|(n, t)| (format!("{PEFT_PREFIX}{n}"), t))
        .collect();
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    crate::checkpoint::save_safetensors_atomic(&dir.join("adapter_model.safetensors"), tensors)?;
    let json = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.r,
        "lora_alpha": config.alpha,
        "use_rslora": config.use_rslora,
        "lora_dropout": config.dropout,
        "target_modules": config.target_modules,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "modules_to_save": null,
    });
    crate::checkpoint::write_file_atomic(
        &dir.join("adapter_config.json"),
        serde_json::to_string_pretty(&json)?.as_bytes(),
    )
}

/// Reads an adapter folder written by [`save_adapter_tensors`] (or by PEFT's `save_pretrained`):
/// its config and its tensors by wick's names (the `base_model.model.` prefix removed).
///
/// `use_rslora` is honoured (the scale `alpha / sqrt(r)`); `target_modules` may be a list or
/// PEFT's `"all-linear"` (the seven block linears). Every other key is checked: a key that
/// would change the adapted model and that wick does not implement (`use_dora`, `lora_bias`,
/// `modules_to_save`, `rank_pattern`, `layers_to_transform`, `bias` other than `"none"`, ...)
/// or does not know is refused, naming it, rather than ignored.
///
/// Errors: unreadable or malformed files; a config without `r` or `lora_alpha`; a key as
/// above; `target_modules` a regular expression, or naming `lm_head` / `embed_tokens`.
pub fn load_adapters(dir: &Path) -> Result<(LoraConfig, Vec<(String, Tensor)>)> {
    let cfg_path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&cfg_path)
        .with_context(|| format!("reading {}", cfg_path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", cfg_path.display()))?;
    let field = |k: &str| {
        v.get(k)
            .with_context(|| format!("{}: field {k:?} is missing", cfg_path.display()))
    };
    let read = [
        "r",
        "lora_alpha",
        "lora_dropout",
        "target_modules",
        "use_rslora",
    ];
    let obj = v
        .as_object()
        .with_context(|| format!("{}: not a JSON object", cfg_path.display()))?;
    for (key, value) in obj.iter().filter(|(k, _)| !read.contains(&k.as_str())) {
        check_adapter_key(key, value)
            .with_context(|| format!("the adapter config {}", cfg_path.display()))?;
    }
    let target_modules = match v.get("target_modules") {
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str().map(String::from).with_context(|| {
                    format!(
                        "{}: target_modules entry {s} is not a string",
                        cfg_path.display()
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?,
        Some(serde_json::Value::String(s)) if s == "all-linear" => {
            LoraConfig::all_linear(1, 1.0).target_modules
        }
        Some(serde_json::Value::String(s)) => bail!(
            "{}: target_modules is the regular expression {s:?}; wick reads a list of module \
             names (or \"all-linear\"): list the adapted modules instead",
            cfg_path.display()
        ),
        _ => Vec::new(),
    };
    let config = LoraConfig {
        r: field("r")?.as_u64().context("r must be an integer")? as usize,
        alpha: field("lora_alpha")?
            .as_f64()
            .context("lora_alpha must be a number")?,
        use_rslora: match v.get("use_rslora") {
            None | Some(serde_json::Value::Null) => false,
            Some(b) => b.as_bool().with_context(|| {
                format!("{}: use_rslora {b} is not a boolean", cfg_path.display())
            })?,
        },
        dropout: v
            .get("lora_dropout")
            .and_then(|d| d.as_f64())
            .unwrap_or(0.0),
        target_modules,
    };
    config
        .validate()
        .with_context(|| format!("the adapter config {}", cfg_path.display()))?;
    let st = dir.join("adapter_model.safetensors");
    let tensors = candle_core::safetensors::load(&st, &candle_core::Device::Cpu)
        .with_context(|| format!("reading {}", st.display()))?
        .into_iter()
        .map(|(k, t)| match k.strip_prefix(PEFT_PREFIX) {
            Some(rest) => (rest.to_string(), t),
            None => (k, t),
        })
        .collect();
    Ok((config, tensors))
}

/// The module names a (possibly stacked) adapter name stands for: `prefix.{a,b}` gives
/// `prefix.a`, `prefix.b`; a name without a brace list stands for itself.
pub fn stacked_modules(name: &str) -> Vec<String> {
    match (name.find('{'), name.strip_suffix('}')) {
        (Some(open), Some(body)) => body[open + 1..]
            .split(',')
            .map(|m| format!("{}{m}", &name[..open]))
            .collect(),
        _ => vec![name.to_string()],
    }
}

/// The brace-list name of a stack of modules: `[p.q_proj, p.k_proj]` gives `p.{q_proj,k_proj}`
/// (the prefix up to the last `.` when every module shares it, else none); one module is named
/// as it is. [`stacked_modules`] inverts it.
pub fn stacked_name(modules: &[String]) -> String {
    if let [one] = modules {
        return one.clone();
    }
    let prefix_of = |m: &String| m.rfind('.').map_or("", |i| &m[..=i]).to_string();
    let prefix = modules.first().map(prefix_of).unwrap_or_default();
    let shared = modules.iter().all(|m| prefix_of(m) == prefix);
    let names: Vec<&str> = modules
        .iter()
        .map(|m| {
            if shared {
                &m[prefix.len()..]
            } else {
                m.as_str()
            }
        })
        .collect();
    let prefix = if shared { prefix.as_str() } else { "" };
    format!("{prefix}{{{}}}", names.join(","))
}

/// Whether a parameter name is a LoRA tensor.
pub fn is_adapter(name: &str) -> bool {
    name.contains(".lora_A.") || name.contains(".lora_B.")
}
