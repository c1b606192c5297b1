//! The two kinds of optimizer rule, the vocabulary the drivers and the fused CPU pass share
//! (in a file of its own, so that none of them imports another's):
//!
//! - [`UpdateRule`], element-wise: the same arithmetic at every element, run by
//!   [`super::Driver`] over chunks (16K elements per rayon task on the CPU, a multi-tensor
//!   kernel on CUDA). AdamW and SGD.
//! - [`TensorRule`], whole-tensor: the update of a parameter needs all of it at once (Muon's
//!   Newton–Schulz orthogonalisation of a matrix), run by [`super::TensorDriver`] one whole
//!   parameter at a time in candle ops, on the parameter's device.

use crate::params::Param;
use anyhow::Result;
use candle_core::Tensor;

/// An optimizer's arithmetic; see [`super::driver`] for what the driver adds.
///
/// Every implementation (reference, host, kernel) must perform the same f32 operations in the
/// same order on the same f32 coefficients, so that the paths agree bit for bit where the
/// tests say they do.
pub trait UpdateRule: Clone + Send + Sync + std::fmt::Debug + 'static {
    /// The optimizer's name in errors (`"AdamW"`).
    const NAME: &'static str;
    /// Per-parameter scalars of one step, rounded to f32 once on the host.
    type Coeffs: Copy + Send + Sync;

    /// Checks the hyper-parameters (errors name the field and its range).
    fn validate(&self) -> Result<()>;

    /// Suffixes of the state tensors each stepped parameter keeps (f32, the parameter's
    /// shape), in the order [`Self::update_host`], [`Self::update_reference`] and the kernel
    /// take them (at most 2). SGD without momentum keeps none.
    fn state_names(&self) -> &'static [&'static str];

    /// The coefficients of a parameter at its step `t` (1-based: this step included), at
    /// learning rate `lr`, in a weight-decay group or not, with gradient multiplier `mult`
    /// (unscale × clip).
    fn coeffs(&self, t: u64, lr: f64, decayed: bool, mult: f64) -> Self::Coeffs;

    /// The element update over one chunk of a parameter: `p` (f32 master), `g` (f32
    /// gradient buffer, to be multiplied by the coefficients' multiplier), `states` (the same
    /// range of each state tensor). `first`: this is the parameter's first applied step.
    fn update_host(
        k: &Self::Coeffs,
        p: &mut [f32],
        g: &[f32],
        states: &mut [&mut [f32]],
        first: bool,
    );

    /// The same update in candle tensor ops (the correctness oracle): returns the new master
    /// and replaces `states` with their new values. `g` is f32.
    fn update_reference(
        k: &Self::Coeffs,
        p: &Tensor,
        g: &Tensor,
        states: &mut [Tensor],
        first: bool,
    ) -> Result<Tensor>;

    /// The CUDA kernel of this rule.
    #[cfg(feature = "cuda")]
    const KERNEL: crate::cuda::update::Kernel;

    /// The kernel's by-value argument for a step at `lr` (the kernel computes what depends
    /// on each parameter's step count and group itself, as [`Self::coeffs`] does).
    #[cfg(feature = "cuda")]
    fn kernel_args(&self, lr: f64, rounding: crate::cuda::update::Rounding) -> Self::KernelArgs;

    /// The by-value argument struct of the kernel (C layout).
    #[cfg(feature = "cuda")]
    type KernelArgs: candle_core::cuda::cudarc::driver::DeviceRepr + Copy;
}

/// A whole-tensor optimizer rule: the update of one parameter from its whole gradient and its
/// whole state tensors, in candle tensor ops on the parameter's device (no host read, so it
/// queues behind the backward like the fused kernels). [`super::TensorDriver`] adds the work
/// list, found_inf (a skipped step leaves everything as it was, decided on the device when the
/// statistics are there), the gradient multiplier, state creation, working copies, save/load
/// and ZeRO-1 ownership (whole parameters only: a rule of this kind is refused under the flat
/// ZeRO-1 layout, which splits parameters).
pub trait TensorRule: Clone + Send + Sync + std::fmt::Debug + 'static {
    /// The optimizer's name in errors (`"Muon"`).
    const NAME: &'static str;

    /// Checks the hyper-parameters (errors name the field and its range).
    fn validate(&self) -> Result<()>;

    /// Refuses a parameter this rule cannot update (Muon: anything but a 2-D matrix), with an
    /// error naming the parameter and its shape. Checked for every parameter of a step before
    /// anything changes.
    fn check(&self, param: &Param) -> Result<()>;

    /// Suffixes of the f32 state tensors each stepped parameter keeps (the parameter's shape),
    /// in the order [`Self::update`] takes them; saved as `"{param}.{suffix}"`.
    fn state_names(&self) -> &'static [&'static str];

    /// One step of one parameter: `master` (f32, the parameter's shape), `grad` (f32, the
    /// same shape, already multiplied by unscale × clip), `states` (f32, replaced by their new
    /// values), `lr` (this parameter's rate: schedule × group scale × parameter scale),
    /// `decayed` (the parameter is in a weight-decay group). Returns the new f32 master.
    fn update(
        &self,
        master: &Tensor,
        grad: &Tensor,
        states: &mut [Tensor],
        lr: f64,
        decayed: bool,
    ) -> Result<Tensor>;
}
