//! `ParamStore`: fp32 master weights, their working copies, and a candle-nn `VarBuilder`
//! backend.
//!
//! Every parameter has an fp32 **master** (a candle [`Var`]) that the optimizer updates. In the
//! mixed precisions a matmul-class parameter also has a **working copy** in the compute dtype
//! (bf16/f16): that is the tensor the forward pass uses and autograd differentiates; it is
//! refreshed from the master after each optimizer step. Parameters that feed f32 ops (norm
//! gains and biases in wick's own layers) are differentiated as masters directly.
//!
//! Models written against candle-nn (`candle_nn::linear`, `conv2d`, `embedding`, ...) train
//! unchanged through [`ParamStore::var_builder`]: every parameter they ask for gets a working
//! copy in the compute dtype (apex's "O2" layout).
//!
//! Parameter groups: weight decay is off by default for tensors of rank < 2 (biases, norm
//! gains), the usual GPT/BERT practice; [`ParamStore::set_weight_decay`] overrides it by name.

pub use crate::precision::Role;
use crate::precision::{Autocast, Precision};
use anyhow::{bail, Context};
use candle_core::{DType, Device, Shape, Tensor, Var};
use candle_nn::Init;
use rand::{rngs::StdRng, SeedableRng};
use rand_distr::{Distribution, Normal, Uniform};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};

/// Per-parameter options, resolved when the parameter is created.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamOptions {
    /// Decoupled weight decay applies to this parameter.
    pub weight_decay: bool,
    /// Marked frozen on purpose: never updated, and a missing gradient is only a warning.
    pub frozen: bool,
    /// The parameter group's learning rate as a multiple of the schedule's (1.0 by default):
    /// a PyTorch parameter group with `lr = lr_scale * base_lr`, scaled by the same schedule.
    pub lr_scale: f64,
}

/// One parameter: its name, fp32 master and optional working copy.
#[derive(Debug, Clone)]
pub struct Param {
    /// The model's name for it (`"layers.0.attn.weight"`), used in checkpoints and errors.
    pub name: String,
    /// fp32 master weights.
    pub master: Var,
    /// Working copy in the compute dtype; `None` when the master is differentiated directly.
    pub working: Option<Var>,
    /// Group options.
    pub options: ParamOptions,
}

impl Param {
    /// The tensor autograd differentiates for this parameter (working copy or master).
    pub fn differentiated(&self) -> &Tensor {
        self.working.as_ref().unwrap_or(&self.master).as_tensor()
    }

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.master.elem_count()
    }

    /// Copies the master into the working copy, if there is one (cast to the working copy's
    /// dtype, round to nearest even): the one place a working copy is refreshed, after an
    /// applied update or a load of the masters.
    ///
    /// Errors: the cast or the copy (a device error).
    pub fn refresh_working_copy(&self) -> candle_core::Result<()> {
        match &self.working {
            Some(w) => w.set(&self.master.as_tensor().to_dtype(w.dtype())?),
            None => Ok(()),
        }
    }
}

struct Inner {
    params: Vec<Param>,
    by_name: HashMap<String, usize>,
    rng: StdRng,
    decay_overrides: Vec<(glob::Pattern, bool)>,
    frozen: Vec<glob::Pattern>,
    lr_scales: Vec<(glob::Pattern, f64)>,
}

/// The parameter store. Cheap to clone (shared handle).
#[derive(Clone)]
pub struct ParamStore {
    autocast: Autocast,
    device: Device,
    inner: Arc<RwLock<Inner>>,
}

/// A parameter-name pattern: a Unix shell glob (`glob` crate syntax, `*` matches any run of
/// characters, dots included): `"head.*"`, `"*.bias"`, `"*LayerNorm*"`, or an exact name.
fn pattern(p: &str) -> anyhow::Result<glob::Pattern> {
    glob::Pattern::new(p).with_context(|| {
        format!("parameter-name pattern {p:?} is not a valid glob (use `*` for any characters)")
    })
}

impl ParamStore {
    /// An empty store. `seed` drives every random initialisation, so two stores built with the
    /// same seed and the same model code hold identical weights.
    pub fn new(precision: Precision, device: Device, seed: u64) -> Self {
        Self {
            autocast: precision.autocast(),
            device,
            inner: Arc::new(RwLock::new(Inner {
                params: Vec::new(),
                by_name: HashMap::new(),
                rng: StdRng::seed_from_u64(seed),
                decay_overrides: Vec::new(),
                frozen: Vec::new(),
                lr_scales: Vec::new(),
            })),
        }
    }

    /// The precision mode.
    pub fn precision(&self) -> Precision {
        self.autocast.precision()
    }

    /// The autocast policy of the store's precision: what layers and models ask for the dtype
    /// of their ops and what decides the parameters' working copies.
    pub fn autocast(&self) -> Autocast {
        self.autocast
    }

    /// The device the parameters live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Overrides weight decay for parameters whose name matches the glob `pattern` (`"*.bias"`,
    /// `"encoder.*"`, an exact name). Applies to existing and future parameters; later calls
    /// win. By default rank >= 2 parameters decay and the others (biases, norm gains) do not.
    ///
    /// Errors (nothing changed): an invalid glob.
    pub fn set_weight_decay(&self, pattern: &str, decay: bool) -> anyhow::Result<()> {
        let pat = self::pattern(pattern)?;
        let mut inner = self.write();
        for p in inner.params.iter_mut().filter(|p| pat.matches(&p.name)) {
            p.options.weight_decay = decay;
        }
        inner.decay_overrides.push((pat, decay));
        Ok(())
    }

    /// Marks parameters matching the glob `pattern` (as in [`Self::set_weight_decay`]) frozen
    /// on purpose: the optimizer leaves them alone and gradient coverage only warns about them
    /// ([`crate::Engine::coverage`]). Applies to existing and future parameters. Returns how
    /// many existing parameters it froze: 0 means the pattern matched none yet (a typo, or
    /// parameters created later).
    ///
    /// Errors (nothing changed): an invalid glob.
    pub fn freeze(&self, pattern: &str) -> anyhow::Result<usize> {
        let pat = self::pattern(pattern)?;
        let mut inner = self.write();
        let mut n = 0;
        for p in inner.params.iter_mut().filter(|p| pat.matches(&p.name)) {
            p.options.frozen = true;
            n += 1;
        }
        inner.frozen.push(pat);
        Ok(n)
    }

    /// Puts parameters matching the glob `pattern` in a learning-rate group: their learning
    /// rate is `scale` times the schedule's at every step (PyTorch: a parameter group whose
    /// `lr` is `scale * base_lr`, with the same `LambdaLR`-style schedule on every group; the
    /// decoupled weight decay uses the group's rate, `1 - scale * lr * wd`). Applies to
    /// existing and future parameters; later calls win.
    ///
    /// Errors (nothing changed): an invalid glob, or `scale` negative or not finite.
    pub fn set_lr_scale(&self, pattern: &str, scale: f64) -> anyhow::Result<()> {
        let pat = self::pattern(pattern)?;
        if !(scale.is_finite() && scale >= 0.0) {
            bail!("learning-rate scale {scale} for {pattern:?} must be finite and >= 0");
        }
        let mut inner = self.write();
        for p in inner.params.iter_mut().filter(|p| pat.matches(&p.name)) {
            p.options.lr_scale = scale;
        }
        inner.lr_scales.push((pat, scale));
        Ok(())
    }

    /// Returns the differentiated tensor of parameter `name`, creating it with `init` on first
    /// use. `shape` must match an existing parameter of that name.
    ///
    /// Errors: shape mismatch with an existing parameter (names both shapes).
    pub fn get_or_init(
        &self,
        name: &str,
        shape: impl Into<Shape>,
        init: Init,
        role: Role,
    ) -> anyhow::Result<Tensor> {
        let shape = shape.into();
        let mut inner = self.write();
        if let Some(&i) = inner.by_name.get(name) {
            let p = &inner.params[i];
            if p.master.shape() != &shape {
                bail!(
                    "parameter {name:?} exists with shape {:?} but shape {:?} was requested; \
                     two layers probably share a name",
                    p.master.shape(),
                    shape
                );
            }
            return Ok(p.differentiated().clone());
        }
        let values = sample_init(&init, &shape, &mut inner.rng)
            .with_context(|| format!("initialising parameter {name:?}"))?;
        if shape.elem_count() == 0 && self.device.is_cuda() {
            bail!(
                "parameter {name:?} has shape {shape:?} with no elements: candle cannot allocate \
                 zero-size CUDA tensors (cuMemAlloc rejects 0 bytes); drop it from the model"
            );
        }
        let master = Var::from_vec(values, shape.clone(), &self.device).with_context(|| {
            format!(
                "creating parameter {name:?} of shape {shape:?} on {:?}",
                self.device
            )
        })?;
        Ok(self.push(&mut inner, name, master, role)?)
    }

    /// Adds parameter `name` with the given values (a pretrained tensor: any float dtype, any
    /// device; copied to an fp32 master on the store's device) and returns its differentiated
    /// tensor. The pretrained-weights counterpart of [`Self::get_or_init`], without drawing
    /// an initialisation that would be overwritten.
    ///
    /// Errors (nothing added): a parameter of that name exists, `values` is not a float
    /// tensor, or it has no elements on CUDA.
    pub fn insert(&self, name: &str, values: &Tensor, role: Role) -> anyhow::Result<Tensor> {
        let mut inner = self.write();
        if inner.by_name.contains_key(name) {
            bail!("parameter {name:?} exists already; two tensors of the model share a name");
        }
        if !values.dtype().is_float() {
            bail!(
                "parameter {name:?}: values have dtype {:?}; expected a float tensor",
                values.dtype()
            );
        }
        if values.elem_count() == 0 && self.device.is_cuda() {
            bail!("parameter {name:?} has shape {:?} with no elements: candle cannot allocate zero-size CUDA tensors", values.dims());
        }
        let master = values
            .to_dtype(DType::F32)
            .and_then(|t| t.to_device(&self.device))
            .and_then(|t| Var::from_tensor(&t))
            .with_context(|| format!("copying parameter {name:?} to {:?}", self.device))?;
        Ok(self.push(&mut inner, name, master, role)?)
    }

    /// Resolves the group options of a new parameter, makes its working copy and records it.
    fn push(
        &self,
        inner: &mut Inner,
        name: &str,
        master: Var,
        role: Role,
    ) -> candle_core::Result<Tensor> {
        let working = match self.autocast.working_dtype(role) {
            Some(dtype) => Some(Var::from_tensor(&master.as_tensor().to_dtype(dtype)?)?),
            None => None,
        };
        let mut options = ParamOptions {
            weight_decay: master.rank() >= 2,
            frozen: inner.frozen.iter().any(|p| p.matches(name)),
            lr_scale: 1.0,
        };
        for (pat, decay) in &inner.decay_overrides {
            if pat.matches(name) {
                options.weight_decay = *decay;
            }
        }
        for (pat, scale) in &inner.lr_scales {
            if pat.matches(name) {
                options.lr_scale = *scale;
            }
        }
        let param = Param {
            name: name.to_string(),
            master,
            working,
            options,
        };
        let t = param.differentiated().clone();
        let idx = inner.params.len();
        inner.params.push(param);
        inner.by_name.insert(name.to_string(), idx);
        Ok(t)
    }

    /// All parameters in creation order (cheap clones of shared handles).
    pub fn params(&self) -> Vec<Param> {
        self.read().params.clone()
    }

    /// Number of parameters (tensors).
    pub fn len(&self) -> usize {
        self.read().params.len()
    }

    /// True when no parameter has been created.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Total number of scalar parameters.
    pub fn num_elements(&self) -> usize {
        self.read().params.iter().map(Param::elem_count).sum()
    }

    /// The parameter called `name`, if any.
    pub fn get(&self, name: &str) -> Option<Param> {
        let inner = self.read();
        inner.by_name.get(name).map(|&i| inner.params[i].clone())
    }

    /// Copies every master into its working copy (cast to the compute dtype, round to nearest
    /// even). Called by the engine after each applied optimizer step.
    pub fn refresh_working_copies(&self) -> candle_core::Result<()> {
        self.read()
            .params
            .iter()
            .try_for_each(Param::refresh_working_copy)
    }

    /// The fp32 masters by the model's names (what `model.safetensors` holds).
    pub fn masters(&self) -> Vec<(String, Tensor)> {
        self.read()
            .params
            .iter()
            .map(|p| (p.name.clone(), p.master.as_detached_tensor()))
            .collect()
    }

    /// Overwrites every master with the tensor of the same name from `tensors` (any float dtype,
    /// any device) and refreshes the working copies. All names and shapes are checked before
    /// anything is written: on error the store is unchanged and the message names the tensor.
    /// Extra tensors in `tensors` are ignored.
    pub fn load_masters(&self, tensors: &HashMap<String, Tensor>) -> anyhow::Result<()> {
        let params = self.params();
        let mut staged = Vec::with_capacity(params.len());
        for p in &params {
            let t = tensors
                .get(&p.name)
                .ok_or_else(|| anyhow::anyhow!("tensor {:?} is missing", p.name))?;
            if t.shape() != p.master.shape() {
                bail!(
                    "tensor {:?} has shape {:?}, the model expects {:?}",
                    p.name,
                    t.dims(),
                    p.master.dims()
                );
            }
            staged.push(t.to_dtype(DType::F32)?.to_device(&self.device)?);
        }
        for (p, t) in params.iter().zip(staged) {
            p.master.set(&t)?;
        }
        self.refresh_working_copies()?;
        Ok(())
    }

    /// A candle-nn `VarBuilder` over this store, so candle-nn models train unchanged. Tensors
    /// it hands out are working copies in the compute dtype (masters in fp32 mode).
    pub fn var_builder(&self) -> candle_nn::VarBuilder<'static> {
        candle_nn::VarBuilder::from_backend(
            Box::new(StoreBackend(self.clone())),
            self.autocast.compute_dtype(),
            self.device.clone(),
        )
    }
}

/// Draws initial values on the host with the store's seeded RNG (candle's CPU RNG cannot be
/// seeded). Follows candle-nn's `Init` semantics, including Kaiming's gain and fan.
fn sample_init(init: &Init, shape: &Shape, rng: &mut StdRng) -> anyhow::Result<Vec<f32>> {
    let n = shape.elem_count();
    let uniform = |lo: f64, up: f64, rng: &mut StdRng| -> anyhow::Result<Vec<f32>> {
        if lo == up {
            return Ok(vec![lo as f32; n]);
        }
        let d = Uniform::new(lo, up).context("invalid uniform bounds")?;
        Ok((0..n).map(|_| d.sample(rng) as f32).collect())
    };
    let normal = |mean: f64, std: f64, rng: &mut StdRng| -> anyhow::Result<Vec<f32>> {
        let d = Normal::new(mean, std).context("invalid normal std")?;
        Ok((0..n).map(|_| d.sample(rng) as f32).collect())
    };
    match init {
        Init::Const(c) => Ok(vec![*c as f32; n]),
        Init::Uniform { lo, up } => uniform(*lo, *up, rng),
        Init::Randn { mean, stdev } => normal(*mean, *stdev, rng),
        Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let fan = fan.for_shape(shape).max(1) as f64;
            let std = non_linearity.gain() / fan.sqrt();
            match dist {
                candle_nn::init::NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    uniform(-bound, bound, rng)
                }
                candle_nn::init::NormalOrUniform::Normal => normal(0.0, std, rng),
            }
        }
    }
}

struct StoreBackend(ParamStore);

impl candle_nn::var_builder::SimpleBackend for StoreBackend {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self
            .0
            .get_or_init(name, s, h, Role::Matmul)
            .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))?;
        if t.dtype() == dtype {
            Ok(t)
        } else {
            t.to_dtype(dtype)
        }
    }

    fn get_unchecked(
        &self,
        name: &str,
        dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        match self.0.get(name) {
            Some(p) => p.differentiated().to_dtype(dtype),
            None => Err(candle_core::Error::Msg(format!(
                "parameter {name:?} does not exist in the ParamStore and no shape was given to create it"
            ))),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.get(name).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_weights_and_decay_groups() -> anyhow::Result<()> {
        let a = ParamStore::new(Precision::Bf16Mixed, Device::Cpu, 7);
        let b = ParamStore::new(Precision::Bf16Mixed, Device::Cpu, 7);
        for s in [&a, &b] {
            let vb = s.var_builder();
            candle_nn::linear(4, 3, vb.pp("l"))?;
        }
        let (pa, pb) = (a.params(), b.params());
        assert_eq!(pa.len(), 2);
        let wa: Vec<f32> = pa[0].master.flatten_all()?.to_vec1()?;
        let wb: Vec<f32> = pb[0].master.flatten_all()?.to_vec1()?;
        assert_eq!(wa, wb);
        assert_eq!(pa[0].working.as_ref().unwrap().dtype(), DType::BF16);
        assert!(
            pa[0].options.weight_decay,
            "rank-2 weight decays by default"
        );
        assert!(
            !pa[1].options.weight_decay,
            "rank-1 bias does not decay by default"
        );
        a.set_weight_decay("l.bias", true)?;
        assert!(a.get("l.bias").unwrap().options.weight_decay);
        Ok(())
    }

    #[test]
    fn shape_mismatch_is_an_error() {
        let s = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
        s.get_or_init("w", (2, 2), Init::Const(0.), Role::Matmul)
            .unwrap();
        let err = s
            .get_or_init("w", (3, 2), Init::Const(0.), Role::Matmul)
            .unwrap_err();
        assert!(format!("{err}").contains("\"w\""), "{err}");
    }
}

#[cfg(test)]
mod group_tests {
    use super::*;

    #[test]
    fn globs_select_groups_for_existing_and_future_parameters() -> anyhow::Result<()> {
        let s = ParamStore::new(Precision::Fp32, Device::Cpu, 0);
        let vb = s.var_builder();
        candle_nn::linear(4, 3, vb.pp("encoder.layer.0.dense"))?;
        s.set_weight_decay("*.bias", false)?;
        s.set_lr_scale("head.*", 10.0)?;
        candle_nn::linear(3, 2, vb.pp("head"))?;
        let opt = |n: &str| s.get(n).unwrap().options;
        assert_eq!(opt("head.weight").lr_scale, 10.0);
        assert_eq!(opt("head.bias").lr_scale, 10.0);
        assert_eq!(opt("encoder.layer.0.dense.weight").lr_scale, 1.0);
        assert!(!opt("head.bias").weight_decay && opt("head.weight").weight_decay);
        assert!(s.set_lr_scale("[", 1.0).is_err());
        assert!(s.set_lr_scale("head.*", f64::NAN).is_err());
        assert_eq!(
            opt("head.weight").lr_scale,
            10.0,
            "a refused call changes nothing"
        );
        Ok(())
    }
}
