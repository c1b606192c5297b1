//! Gradient buffers: fp32 accumulation over micro-batches, and the boundary pass that unscales,
//! detects inf/NaN (`found_inf`) and measures the global L2 norm for clipping.
//!
//! Accumulation with weights: micro-batch `i` with weight `w_i` (e.g. its sample or token
//! count) adds `w_i * g_i` to the fp32 buffer; at the accumulation boundary the buffer is
//! divided by `sum_i w_i`. When each micro-batch loss is a mean over its `w_i` samples, the
//! result is exactly the gradient of the mean loss over the full batch.
//!
//! The divide, the loss-scale unscale and the clip factor are folded into one multiplier that
//! the optimizer applies in its update pass, so the buffers are read once per step.

use crate::collective::Collective;
use crate::params::Param;
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Storage, Tensor};
use rayon::prelude::*;

/// fp32 gradient accumulation buffers, one per parameter (`None` until a gradient arrives).
///
/// With a single micro-batch per step the raw gradients are kept as they are (any float
/// dtype, no copy); the fused CUDA kernels read bf16/f16 gradients directly.
#[derive(Debug, Default)]
pub struct GradBuffers {
    bufs: Vec<Option<Tensor>>,
    /// Persistent f32 allocations reused by the CUDA accumulation kernel.
    pool: Vec<Option<Tensor>>,
    /// What the buffers are divided by at the boundary: the window's weight, or 1 when they
    /// hold a single micro-batch's raw gradient or the reduced (already normalised) gradient.
    weight_sum: f64,
    /// The window's weight `sum_i w_i` (this rank's share of the global normaliser under data
    /// parallelism); the one place it is kept.
    window_weight: f64,
    micro_steps: usize,
    /// The window's first scaled loss plus `0 * scaled_loss` of each later one: not finite
    /// exactly when some scaled loss was inf or NaN.
    loss_probe: Option<Tensor>,
}

/// found_inf, norm and multiplier as host values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostStats {
    /// Some gradient element is inf or NaN (GradScaler's `found_inf`).
    pub found_inf: bool,
    /// Global L2 norm of the unscaled, weight-normalised gradients, before clipping.
    pub norm: f64,
    /// What turns buffer values into the applied gradient: `clip / (loss_scale * sum_w)`.
    pub multiplier: f64,
}

/// What the boundary pass found: on the host (CPU paths) or in a `(3,)` f32 device tensor
/// `[found_inf, norm, multiplier]` (fused CUDA path), read only when asked.
#[derive(Debug, Clone)]
pub enum GradStats {
    /// Known on the host.
    Host(HostStats),
    /// `[found_inf (0/1), norm, multiplier]`, f32, on the device.
    Device(Tensor),
}

impl GradStats {
    /// Stats known on the host.
    pub fn host(stats: HostStats) -> Self {
        Self::Host(stats)
    }

    /// Finite gradients to be multiplied by `multiplier` (benchmarks, direct optimizer use).
    pub fn clean(multiplier: f64) -> Self {
        Self::Host(HostStats {
            found_inf: false,
            norm: f64::NAN,
            multiplier,
        })
    }

    /// Stats living in a `(3,)` f32 device tensor `[found_inf, norm, multiplier]`.
    pub fn device(t: Tensor) -> Self {
        Self::Device(t)
    }

    /// The device tensor, when the stats live on the device.
    pub fn tensor(&self) -> Option<&Tensor> {
        match self {
            Self::Device(t) => Some(t),
            Self::Host(_) => None,
        }
    }

    /// The values; reads them back from the device when they live there (a synchronisation).
    pub fn read(&self) -> Result<HostStats> {
        match self {
            Self::Host(h) => Ok(*h),
            Self::Device(t) => {
                let v: Vec<f32> = t.to_vec1()?;
                let [inf, norm, mult] = v[..] else {
                    bail!("device gradient stats have {} values, expected 3", v.len())
                };
                Ok(HostStats {
                    found_inf: inf != 0.0,
                    norm: norm as f64,
                    multiplier: mult as f64,
                })
            }
        }
    }

    /// `self` with found_inf also set where `earlier` found it: the stats of value-clipped
    /// gradients keep the overflow seen before the clamp (PyTorch: `unscale_` finds the inf,
    /// then `clip_grad_value_`, then the step is skipped). No device read.
    pub fn with_found_inf_of(self, earlier: &GradStats) -> Result<GradStats> {
        Ok(match (self, earlier) {
            (Self::Host(h), Self::Host(e)) => Self::Host(HostStats {
                found_inf: h.found_inf || e.found_inf,
                ..h
            }),
            (Self::Device(t), Self::Device(e)) => {
                let inf = t.narrow(0, 0, 1)?.maximum(&e.narrow(0, 0, 1)?)?;
                Self::Device(Tensor::cat(&[&inf, &t.narrow(0, 1, 2)?], 0)?)
            }
            _ => bail!("gradient stats on the host and on the device cannot be combined"),
        })
    }
}

/// A clamp bound per loss-scale unit: a host value or a `(1,)` f32 device tensor.
#[derive(Debug, Clone)]
pub enum Limit {
    /// Known on the host.
    Host(f64),
    /// On the device (fused CUDA path, where the loss scale lives there).
    Device(Tensor),
}

impl GradBuffers {
    /// Clamps every buffer element to `±limit * sum_w` (with `limit = v * loss_scale`, this is
    /// `clip_grad_value_(v)` on the true gradients). Candle ops, any device, no device read.
    pub fn clamp(&mut self, limit: &Limit) -> Result<()> {
        let w = self.weight_sum;
        for buf in self.bufs.iter_mut().flatten() {
            *buf = match limit {
                Limit::Host(l) => buf.clamp(-l * w, l * w)?,
                Limit::Device(t) => {
                    let hi = (t * w)?.to_dtype(buf.dtype())?;
                    buf.broadcast_minimum(&hi)?.broadcast_maximum(&hi.neg()?)?
                }
            };
        }
        Ok(())
    }

    /// Empty buffers for `n` parameters.
    pub fn new(n: usize) -> Self {
        Self {
            bufs: vec![None; n],
            pool: vec![None; n],
            weight_sum: 0.0,
            window_weight: 0.0,
            micro_steps: 0,
            loss_probe: None,
        }
    }

    /// Records this micro-batch's scaled loss (a scalar f32 tensor): a window in which one is
    /// inf or NaN is skipped whatever its gradients. No device read. The window's first loss is
    /// kept as a view of `scaled_loss`'s storage until the boundary, so that storage must not
    /// be written in place meanwhile (nothing in wick does).
    ///
    /// Errors: `scaled_loss` not a one-element f32 tensor.
    pub fn note_scaled_loss(&mut self, scaled_loss: &Tensor) -> Result<()> {
        if scaled_loss.dtype() != DType::F32 || scaled_loss.elem_count() != 1 {
            bail!(
                "note_scaled_loss: the scaled loss must be one f32 element, found {:?} {:?}",
                scaled_loss.dtype(),
                scaled_loss.dims()
            );
        }
        // detached, so the probe does not keep the forward graph alive across the window. The
        // first loss is kept as it is (a view, no launch): it is finite iff `0 * loss` is; the
        // later ones add `0 * loss`, so a sum of finite losses cannot overflow into a false inf
        let l = scaled_loss.detach().reshape(1)?;
        self.loss_probe = Some(match self.loss_probe.take() {
            Some(p) => (p + l.affine(0.0, 0.0)?)?,
            None => l,
        });
        Ok(())
    }

    /// Replaces the gradients of the parameters where `reduced[i]` is set by the global
    /// (all-reduced, weight-normalised) gradient, and the normaliser by 1: what data
    /// parallelism writes back before the boundary pass. Other buffers keep their values.
    pub fn set_reduced(&mut self, reduced: Vec<Option<Tensor>>) -> Result<()> {
        if reduced.len() != self.bufs.len() {
            bail!(
                "set_reduced: {} gradients for {} buffers",
                reduced.len(),
                self.bufs.len()
            );
        }
        for (b, r) in self.bufs.iter_mut().zip(reduced) {
            if let Some(r) = r {
                *b = Some(r);
            }
        }
        self.weight_sum = 1.0;
        Ok(())
    }

    /// Flat ZeRO-1: replaces every buffer by this rank's segments of the global gradient (one
    /// per segment, in the order of the flat layout's segments, which the optimizer then
    /// updates), normaliser 1. [`Self::clear`] ends it; the next accumulation
    /// uses the parameters' buffers again.
    pub fn set_segments(&mut self, segments: Vec<Option<Tensor>>) -> Result<()> {
        self.bufs = segments;
        self.weight_sum = 1.0;
        Ok(())
    }

    /// Adds `weight * grad` for every parameter that received a gradient (frozen parameters
    /// are skipped). With `keep_raw` (a single micro-batch per step) the raw gradient is kept
    /// as is and the weight only enters the normaliser. `weight` must be finite and > 0.
    pub fn accumulate(
        &mut self,
        params: &[Param],
        grads: &GradStore,
        weight: f64,
        keep_raw: bool,
    ) -> Result<()> {
        if !(weight.is_finite() && weight > 0.0) {
            bail!("micro-batch weight must be finite and > 0, got {weight}");
        }
        if self.bufs.len() != params.len() {
            self.bufs.resize(params.len(), None);
            self.pool.resize(params.len(), None);
        }
        let incoming: Vec<Option<Tensor>> = params
            .iter()
            .map(|p| {
                if p.options.frozen {
                    None
                } else {
                    // detached: a gradient's op history reaches back into the forward graph
                    // (dW = dy^T x holds x), which must not outlive the backward
                    grads.get(p.differentiated()).map(Tensor::detach)
                }
            })
            .collect();
        if keep_raw && self.micro_steps == 0 {
            self.bufs = incoming;
            self.weight_sum = 1.0;
            self.window_weight = weight;
            self.micro_steps = 1;
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        if params.first().is_some_and(|p| p.master.device().is_cuda()) {
            crate::cuda::accumulate::accumulate(
                &mut self.pool,
                &mut self.bufs,
                &incoming,
                weight as f32,
            )?;
            self.weight_sum += weight;
            self.window_weight += weight;
            self.micro_steps += 1;
            return Ok(());
        }
        for (buf, g) in self.bufs.iter_mut().zip(incoming) {
            let Some(g) = g else { continue };
            let g = if g.dtype() == DType::F32 {
                g
            } else {
                g.to_dtype(DType::F32)?
            };
            let g = if weight == 1.0 { g } else { (g * weight)? };
            *buf = Some(match buf.take() {
                Some(acc) => (acc + g)?,
                None => g,
            });
        }
        self.weight_sum += weight;
        self.window_weight += weight;
        self.micro_steps += 1;
        Ok(())
    }

    /// The weight of the window so far: the sum of the accumulated micro-batches' weights
    /// (0 after [`Self::clear`]). Data parallelism weights this rank's contribution by it.
    pub fn window_weight(&self) -> f64 {
        self.window_weight
    }

    /// Micro-batches accumulated since the last [`Self::clear`].
    pub fn micro_steps(&self) -> usize {
        self.micro_steps
    }

    /// The buffers, aligned with the store's parameters.
    pub fn buffers(&self) -> &[Option<Tensor>] {
        &self.bufs
    }

    /// Starts a new accumulation window (the CUDA pool stays allocated).
    pub fn clear(&mut self) {
        self.bufs.iter_mut().for_each(|b| *b = None);
        self.weight_sum = 0.0;
        self.window_weight = 0.0;
        self.micro_steps = 0;
        self.loss_probe = None;
    }

    /// The boundary pass: `found_inf`, the global norm of the true gradients for a loss scaled
    /// by `loss_scale`, and the multiplier `clip / (loss_scale * sum_w)` with the clip factor of
    /// `max_norm`. `fused`: a single rayon pass over the f32 data (CPU); otherwise candle ops.
    /// `across`: the buffers hold this rank's part of the gradient (flat ZeRO-1), so the sum
    /// of squares and the non-finite flag are summed over its ranks first (one all-reduce of
    /// two f64).
    pub fn unscale_and_check(
        &self,
        loss_scale: f32,
        max_norm: Option<f64>,
        fused: bool,
        across: Option<&dyn Collective>,
    ) -> Result<GradStats> {
        if self.weight_sum <= 0.0 {
            bail!("unscale_and_check called with no accumulated micro-batch");
        }
        let unscale = 1.0 / (loss_scale as f64 * self.weight_sum);
        let bufs: Vec<&Tensor> = self.bufs.iter().flatten().collect();
        let (mut sumsq, mut grads_bad) = if fused {
            fused_sumsq(&bufs)?
        } else {
            reference_sumsq(&bufs)?
        };
        if let Some(c) = across {
            let dev = self
                .loss_probe
                .as_ref()
                .map_or(Device::Cpu, |p| p.device().clone());
            let t = Tensor::new(&[sumsq, f64::from(u8::from(grads_bad))], &dev)?;
            let v = c.all_reduce_sum(&t)?.to_vec1::<f64>()?;
            (sumsq, grads_bad) = (v[0], v[1] != 0.0);
        }
        let loss_bad = match &self.loss_probe {
            Some(p) => !p.to_vec1::<f32>()?[0].is_finite(),
            None => false,
        };
        let norm = sumsq.sqrt() * unscale;
        // GradScaler checks the reciprocal of the scale: a multiplier that is not finite in
        // f32 (an underflowed scale) would write 0 * inf = NaN into every weight
        let mult_bad = !((unscale as f32).is_finite() && unscale > 0.0);
        let found_inf = grads_bad || loss_bad || mult_bad;
        let clip = if found_inf {
            1.0
        } else {
            clip_factor(norm, max_norm)
        };
        Ok(GradStats::host(HostStats {
            found_inf,
            norm,
            multiplier: unscale * clip,
        }))
    }

    /// The boundary pass on the device (fused CUDA path): reads the loss scale from
    /// `scaler[0]` (the device [`crate::amp::AmpState`]) and returns stats in a device tensor,
    /// without synchronisation. `across`: as for [`Self::unscale_and_check`] (the sum of
    /// squares, non-finite elements included, all-reduced on the device).
    #[cfg(feature = "cuda")]
    pub fn unscale_and_check_on_device(
        &self,
        scaler: &Tensor,
        max_norm: Option<f64>,
        across: Option<&dyn Collective>,
    ) -> Result<GradStats> {
        if self.weight_sum <= 0.0 {
            bail!("unscale_and_check called with no accumulated micro-batch");
        }
        let bufs: Vec<&Tensor> = self.bufs.iter().flatten().collect();
        let t = crate::cuda::grad_norm::grad_stats(
            &bufs,
            scaler,
            self.weight_sum as f32,
            max_norm.map(|m| m as f32),
            self.loss_probe.as_ref(),
            across,
        )?;
        Ok(GradStats::device(t))
    }
}

/// Clip factor of `torch.nn.utils.clip_grad_norm_`: `min(1, max_norm / (norm + 1e-6))`.
pub fn clip_factor(norm: f64, max_norm: Option<f64>) -> f64 {
    match max_norm {
        Some(max) if norm.is_finite() => (max / (norm + 1e-6)).min(1.0),
        _ => 1.0,
    }
}

/// Sum of squares and non-finite detection in candle ops. `0 * x` is NaN exactly where `x` is
/// inf or NaN, so its sum detects non-finite elements without overflow false positives.
fn reference_sumsq(bufs: &[&Tensor]) -> Result<(f64, bool)> {
    let mut sumsq = 0f64;
    let mut found_inf = false;
    for g in bufs {
        if g.elem_count() == 0 {
            continue;
        }
        let g = g.to_dtype(DType::F32)?;
        let nan_probe = g.affine(0.0, 0.0)?.sum_all()?.to_scalar::<f32>()?;
        found_inf |= !nan_probe.is_finite();
        // squares summed in f64, as the fused paths do
        sumsq += g
            .to_dtype(DType::F64)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f64>()?;
    }
    Ok((sumsq, found_inf))
}

/// One pass over every element of every buffer (f64 accumulation, rayon across chunks).
fn fused_sumsq(bufs: &[&Tensor]) -> Result<(f64, bool)> {
    let mut total = 0f64;
    let mut found_inf = false;
    for g in bufs {
        let (s, inf) = with_cpu_f32(g, |x| {
            x.par_chunks(1 << 14)
                .map(|c| {
                    let mut s = 0f64;
                    let mut bad = false;
                    for &v in c {
                        bad |= !v.is_finite();
                        s += (v as f64) * (v as f64);
                    }
                    (s, bad)
                })
                .reduce(|| (0.0, false), |a, b| (a.0 + b.0, a.1 | b.1))
        })?;
        total += s;
        found_inf |= inf;
    }
    Ok((total, found_inf))
}

/// Runs `f` on the contiguous f32 data of a CPU tensor (copying to contiguous first if needed).
pub(crate) fn with_cpu_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let t = if t.dtype() != DType::F32 {
        t.to_dtype(DType::F32)?
    } else if t.is_contiguous() {
        t.clone()
    } else {
        t.contiguous()?
    };
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!(
            "the fused CPU path got a tensor on {:?}; use the reference path on this device",
            t.device()
        )
    };
    let data = cpu.as_slice::<f32>()?;
    let (a, b) = layout
        .contiguous_offsets()
        .ok_or_else(|| anyhow::anyhow!("tensor is not contiguous"))?;
    Ok(f(&data[a..b]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn fused_and_reference_norms_agree_and_detect_inf() -> Result<()> {
        let a = Tensor::new(&[3f32, 4.0], &Device::Cpu)?;
        let e = Tensor::zeros(0, DType::F32, &Device::Cpu)?;
        let bufs = GradBuffers {
            bufs: vec![Some(a.clone()), Some(e)],
            pool: vec![],
            weight_sum: 2.0,
            window_weight: 2.0,
            micro_steps: 1,
            loss_probe: None,
        };
        for fused in [false, true] {
            let s = bufs
                .unscale_and_check(4.0, Some(0.25), fused, None)?
                .read()?;
            assert!(!s.found_inf);
            assert!((s.norm - 5.0 / 8.0).abs() < 1e-12, "{s:?}");
            let clip = 0.25 / (5.0 / 8.0 + 1e-6);
            assert!((s.multiplier - clip / 8.0).abs() < 1e-12, "{s:?}");
        }
        let inf = Tensor::new(&[1f32, f32::INFINITY], &Device::Cpu)?;
        let bufs = GradBuffers {
            bufs: vec![Some(a), Some(inf)],
            pool: vec![],
            weight_sum: 1.0,
            window_weight: 1.0,
            micro_steps: 1,
            loss_probe: None,
        };
        assert!(
            bufs.unscale_and_check(1.0, None, true, None)?
                .read()?
                .found_inf
        );
        assert!(
            bufs.unscale_and_check(1.0, None, false, None)?
                .read()?
                .found_inf
        );
        assert_eq!(clip_factor(10.0, Some(1.0)), 1.0 / (10.0 + 1e-6));
        assert_eq!(clip_factor(0.5, Some(1.0)), 1.0);
        Ok(())
    }

    #[test]
    fn a_non_finite_scaled_loss_anywhere_in_the_window_is_found() -> Result<()> {
        let grads = Tensor::new(&[3f32, 4.0], &Device::Cpu)?;
        let scalar = |v: f32| Tensor::new(v, &Device::Cpu);
        // (window's scaled losses, found_inf): finite losses whose sum overflows f32 are not an
        // overflow; an inf or NaN first, middle or last one is
        let cases: [(&[f32], bool); 6] = [
            (&[2.5], false),
            (&[3e38, 3e38, 3e38], false),
            (&[f32::INFINITY], true),
            (&[f32::NAN, 1.0], true),
            (&[1.0, f32::NEG_INFINITY, 1.0], true),
            (&[1.0, 2.0, f32::NAN], true),
        ];
        for (losses, want) in cases {
            let mut bufs = GradBuffers {
                bufs: vec![Some(grads.clone())],
                pool: vec![],
                weight_sum: 1.0,
                window_weight: 1.0,
                micro_steps: 1,
                loss_probe: None,
            };
            for &l in losses {
                bufs.note_scaled_loss(&scalar(l)?)?;
            }
            for fused in [false, true] {
                let s = bufs.unscale_and_check(1.0, None, fused, None)?.read()?;
                assert_eq!(s.found_inf, want, "{losses:?} (fused {fused})");
            }
        }
        // a loss that is not one f32 element is refused
        let mut bufs = GradBuffers::default();
        assert!(bufs
            .note_scaled_loss(&Tensor::new(&[1f32, 2.0], &Device::Cpu)?)
            .is_err());
        assert!(bufs
            .note_scaled_loss(&scalar(1.0)?.to_dtype(DType::F16)?)
            .is_err());
        assert!(bufs.loss_probe.is_none());
        Ok(())
    }
}
