//! Whole training steps as CUDA graphs: [`Engine::capture_step`] records one steady-state step
//! (forward, backward, the boundary's norm, update and scaler) with CUDA stream capture, and
//! [`Engine::replay`] launches it again as one graph: the host queues one launch per step
//! instead of a few hundred kernels.
//!
//! The semantics are those of PyTorch's whole-network capture (`torch.cuda.graph`, "CUDA Graphs"
//! in the PyTorch notes): a replay runs exactly the captured kernels on exactly the captured
//! addresses, so the inputs live in static tensors the caller refills between replays
//! (`Tensor::slice_set`, PyTorch's `static_input.copy_(batch)`), and every host-side value baked
//! into a kernel argument must stay what it was at capture. That is why capture needs the fused
//! CUDA path with everything on the device (loss scale, found_inf, step counts), one
//! micro-batch per step, one process, and no stochastic rounding (its seed is a kernel argument
//! that changes every step); the learning rate is a kernel argument too, so a replay checks
//! that the schedule still gives the captured rate and errors when it does not (capture again).
//! Memory allocated by the captured step comes from the driver's graph pool
//! (`cuMemAllocAsync` under capture becomes an allocation node): the graph keeps it for its
//! lifetime at fixed addresses, which the replays reuse (`CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`).

use super::{Engine, StepCtx, StepReport};
use anyhow::{bail, Result};
use candle_core::Tensor;
#[cfg(feature = "cuda")]
use {
    crate::amp::ScaleValue,
    crate::grads::GradStats,
    crate::optim::Impl,
    crate::timing::{Mark, StepSpans},
    anyhow::Context,
    candle_core::cuda::cudarc::driver::{sys, CudaGraph},
    candle_core::Device,
    std::marker::PhantomData,
};

/// One training step captured as a CUDA graph ([`Engine::capture_step`]); replay it with
/// [`Engine::replay`]. It belongs to the engine and the thread that captured it (it is not
/// `Send`: the capture used the thread's default stream and candle's thread-local cache of
/// small uploads, which the graph reads), and it stays valid until that engine's state is
/// replaced ([`Engine::load_state`], [`Engine::with_collective`]). Parameter options changed
/// after the capture (frozen parameters, weight decay, learning-rate scales) are not seen by
/// replays: capture again after changing them. In a build without the `cuda` feature none can
/// exist ([`Engine::capture_step`] errors).
#[cfg(feature = "cuda")]
pub struct CapturedStep {
    // outputs of the captured step: graph allocations at fixed addresses, rewritten by every
    // replay (declared before the graph, so they are freed while it exists)
    loss: Tensor,
    stats: Option<GradStats>,
    loss_scale: ScaleValue,
    graph: CudaGraph,
    engine: u64,
    generation: u64,
    lr: f64,
    _thread: PhantomData<*const ()>,
}

/// See the `cuda` build's documentation: without CUDA no step can be captured.
#[cfg(not(feature = "cuda"))]
#[derive(Debug)]
pub struct CapturedStep {
    never: std::convert::Infallible,
}

#[cfg(feature = "cuda")]
impl std::fmt::Debug for CapturedStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedStep")
            .field("engine", &self.engine)
            .field("lr", &self.lr)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Runs one ordinary step of `forward` (its report is the first value returned), then
    /// captures the next one as a CUDA graph without running it: the second value is the
    /// [`CapturedStep`], or the reason capture failed, in which case nothing else changed and
    /// [`Engine::step`] goes on as before (the fallback). Replaying it with
    /// [`Engine::replay`] is then the same as calling `step(forward)` again, with the tensors
    /// `forward` reads at the addresses they had: refill inputs in place between replays.
    ///
    /// `forward` is called twice, so it is `Fn`; it must do the same work each time (no
    /// host reads of device values, no new small host uploads; candle keeps the ones of the
    /// first call for the capture).
    ///
    /// Errors (nothing runs): no CUDA device (or a build without the `cuda` feature); not the
    /// fused CUDA path; `accumulation_steps` > 1; a process group is attached; stochastic
    /// rounding is on. An error of the ordinary step is returned
    /// as [`Engine::step`] returns it.
    pub fn capture_step<F, E>(
        &mut self,
        forward: F,
    ) -> Result<(StepReport, std::result::Result<CapturedStep, anyhow::Error>)>
    where
        F: Fn(&StepCtx) -> std::result::Result<Tensor, E>,
        E: Into<anyhow::Error>,
    {
        #[cfg(not(feature = "cuda"))]
        {
            let _ = forward;
            bail!(
                "Engine::capture_step: CUDA graphs need a build with the `cuda` feature and a \
                 CUDA device; use Engine::step"
            )
        }
        #[cfg(feature = "cuda")]
        {
            let Device::Cuda(dev) = self.store.device().clone() else {
                bail!("Engine::capture_step: CUDA graphs need a CUDA device; use Engine::step");
            };
            let why_not = if self.imp != Impl::FusedCuda {
                Some("the fused CUDA path (OptimPath::Auto or Fused)")
            } else if self.config.accumulation_steps != 1 {
                Some("accumulation_steps = 1 (every step an accumulation boundary)")
            } else if self.sync.collective().is_some() {
                Some("one process (no collective attached)")
            } else if self.config.stochastic_rounding {
                Some("stochastic_rounding off (its seed changes every step)")
            } else {
                None
            };
            if let Some(need) = why_not {
                bail!("Engine::capture_step needs {need}; use Engine::step");
            }
            // both calls upload their small host constants through candle's cache, so the
            // capture finds them on the device
            let _cache = dev.enable_cuda_graph_htod_cache();
            let report = self.step(&forward)?;
            let captured = self.capture(&dev, &forward);
            Ok((report, captured))
        }
    }

    #[cfg(feature = "cuda")]
    fn capture<F, E>(&mut self, dev: &candle_core::CudaDevice, forward: &F) -> Result<CapturedStep>
    where
        F: Fn(&StepCtx) -> std::result::Result<Tensor, E>,
        E: Into<anyhow::Error>,
    {
        let stream = dev.cuda_stream();
        let boundaries = self.boundaries;
        let lr = self.config.schedule.lr(boundaries);
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .context("cuStreamBeginCapture")?;
        let step = self.step(forward);
        let graph = stream.end_capture(
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        );
        // the capture ran the step's host code but none of its device work
        self.boundaries = boundaries;
        let captured = match (step, graph) {
            (Ok(r), Ok(Some(graph))) => Ok((r, graph)),
            (Err(e), _) => Err(e),
            (Ok(_), Err(e)) => Err(anyhow::Error::from(e)),
            (Ok(_), Ok(None)) => Err(anyhow::anyhow!("the capture recorded no work")),
        };
        let (report, graph) = match captured {
            Ok(c) => c,
            Err(e) => {
                // drop what the failed capture left (frees of addresses that never were), and
                // the errors those frees recorded in the context
                self.grads.clear();
                let _ = stream.context().check_err();
                return Err(e.context("CUDA graph capture of the step failed"));
            }
        };
        if let Err(e) = graph.upload() {
            drop(report);
            let _ = stream.context().check_err();
            return Err(anyhow::Error::from(e).context("cuGraphUpload of the captured step"));
        }
        Ok(CapturedStep {
            loss: report.loss,
            stats: report.stats,
            loss_scale: report.loss_scale,
            graph,
            engine: self.id,
            generation: self.generation,
            lr,
            _thread: PhantomData,
        })
    }

    /// Runs `step` again: one graph launch on candle's stream, no host synchronisation. The
    /// report is the one [`Engine::step`] would give (loss, found_inf, norm and loss scale
    /// copied out of the graph's buffers, so it stays valid after later replays), except that
    /// its spans put the whole step in `forward`: a graph runs as one launch.
    ///
    /// Errors (nothing runs): `step` was captured by another engine, or before
    /// [`Engine::load_state`]; the learning-rate schedule no longer gives the rate that was
    /// captured (capture again); a CUDA driver error.
    pub fn replay(&mut self, step: &CapturedStep) -> Result<StepReport> {
        #[cfg(not(feature = "cuda"))]
        match step.never {}
        #[cfg(feature = "cuda")]
        {
            if step.engine != self.id || step.generation != self.generation {
                bail!(
                    "Engine::replay: this CapturedStep belongs to another engine or to state that \
                     was replaced since (load_state); capture again"
                );
            }
            let lr = self.config.schedule.lr(self.boundaries);
            if lr != step.lr {
                bail!(
                    "Engine::replay: the schedule's learning rate at boundary {} is {lr}, the \
                     captured step applies {}; capture again where the rate changes",
                    self.boundaries,
                    step.lr
                );
            }
            let device = self.store.device().clone();
            let m0 = Mark::now(&device)?;
            step.graph.launch().context("cuGraphLaunch")?;
            let m1 = Mark::now(&device)?;
            let report = StepReport {
                loss: step.loss.copy()?,
                stats: match &step.stats {
                    Some(GradStats::Device(t)) => Some(GradStats::Device(t.copy()?)),
                    other => other.clone(),
                },
                loss_scale: match &step.loss_scale {
                    ScaleValue::Device(t) => ScaleValue::Device(t.copy()?),
                    host => host.clone(),
                },
                boundary: true,
                lr,
                spans: StepSpans::from_marks([m0, m1.clone(), m1.clone(), m1]),
            };
            self.boundaries += 1;
            Ok(report)
        }
    }
}
