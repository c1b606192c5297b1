//! `wick bench step`: full training steps of torch_reference.py's models (its `mlp` and
//! [`crate::models::gpt`]'s GPTs) on random data, the train-step benchmark of the team's
//! `torch_reference.py step`, in wick.

use crate::throughput::{Throughput, Unit};
use crate::{ParamStore, Precision};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, SeedableRng};
use std::time::Instant;

/// Device `wick bench step` uses unless `--device` says otherwise.
const BENCH_STEP_DEVICE: &str = if cfg!(feature = "cuda") {
    "cuda"
} else {
    "cpu"
};

/// `wick bench step --model mlp|gptmini|gpt2_124m [--precision 32|bf16-mixed|16-mixed]
/// [--device cpu|cuda] [--steps N] [--batch B]`: the train-step benchmark of
/// `torch_reference.py step`, in wick.
///
/// Builds the model (GPT-2 init for the GPTs, PyTorch's `nn.Linear` init for the MLP), an
/// Engine with the reference's AdamW (lr 1e-3, betas 0.9/0.99, eps 1e-8, weight decay 0.1 on
/// rank >= 2; constant lr, no clipping, as the reference's `step`), one batch as the reference
/// draws it (GPT: random tokens `x: (B, T)` with targets `y = x`; MLP: `x ~ N(0, 1)` of
/// `(B, 784)` and random labels in `0..10`), runs `--warmup` untimed steps, then times
/// `--steps` steps between two device synchronisations. Steps that take a second or more (the
/// GPTs on a CPU) print a progress line each, with an estimate of the time left. Reports
/// ms/step, tokens/s for the GPTs (samples/s for the MLP; both trained items / wall-clock s of
/// the timed steps), peak device memory (the CUDA pool's high-water
/// mark since before the model was built, like `torch.cuda.max_memory_allocated`; n/a on the
/// CPU), MFU (6 × parameters × tokens per step over the GPU's peak for the compute dtype, from
/// `crate::profile::peak_flops`), the host time per phase (on CUDA the time to queue the work,
/// which includes waits on a full launch queue when the GPU runs behind: a small `--batch`
/// leaves the same graph and launches with little GPU work, so there it is the host's own
/// cost), and one JSON line with the
/// reference's keys (`gptmini_bf16_ms`, `..._tok_per_s`, `..._peak_GB`; the MLP's
/// throughput as `mlp_..._samples_per_s`, where the reference calls it `_tok_per_s`) and a
/// `tokens_per_s_basis` (MLP: `samples_per_s_basis`) saying how the throughput is computed.
/// The loss printed is the last step's: every step trains on the same batch, so it falls as the
/// model memorises it (random labels: ln 10 = 2.303 at the start for the MLP). On CUDA, TF32 is on
/// for f32 matmuls (the reference sets `allow_tf32`).
#[derive(clap::Args, Debug)]
pub struct StepArgs {
    /// Model: "mlp" (784-1024-1024-10, ReLU, batch 512), "gptmini" (V 256, T 256, 6 x 384)
    /// or "gpt2_124m" (V 50304, T 1024, 12 x 768).
    #[arg(long, default_value = "gptmini")]
    pub model: BenchModel,
    /// Precision: "32", "bf16-mixed" or "16-mixed".
    #[arg(long, default_value = "bf16-mixed")]
    pub precision: Precision,
    /// cpu or cuda (the default is cuda in builds with the cuda feature, cpu otherwise).
    #[arg(long, default_value = BENCH_STEP_DEVICE)]
    pub device: String,
    /// Timed steps (>= 1).
    #[arg(long, default_value_t = 20, allow_negative_numbers = true, value_parser = crate::cli::positive_usize)]
    pub steps: usize,
    /// Untimed warm-up steps before timing (the first CUDA steps JIT-compile kernels).
    #[arg(long, default_value_t = 3, allow_negative_numbers = true, value_parser = crate::cli::non_negative_usize)]
    pub warmup: usize,
    /// Sequences (MLP: samples) per step (default: the reference's: 512 for mlp, 64 for
    /// gptmini, 16 for gpt2_124m).
    #[arg(long, allow_negative_numbers = true, value_parser = crate::cli::positive_usize)]
    pub batch: Option<usize>,
    /// Seed of the initialisation and of the random tokens.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub seed: u64,
    /// Under `wick launch`: ZeRO-1 (optimizer state partitioned over the ranks) instead of
    /// plain DDP.
    #[arg(long)]
    pub zero1: bool,
    /// With `--zero1`: partition by equal ranges of the flattened parameters (reduce-scatter,
    /// all-gather; `Zero1Layout::Flat`) instead of whole parameters.
    #[arg(long, requires = "zero1")]
    pub flat: bool,
    /// Under `wick launch`: all-reduce every gradient bucket after the backward instead of
    /// starting each one during it (`DdpConfig::overlap = false`).
    #[arg(long)]
    pub no_overlap: bool,
    /// Under `wick launch`: sum the gradients across ranks in bf16 (`DdpConfig::reduce_dtype`).
    #[arg(long)]
    pub reduce_bf16: bool,
    /// CUDA: capture the step as a CUDA graph after the warm-up ([`crate::Engine::capture_step`],
    /// whose ordinary step is the last warm-up step) and time its replays; when capture fails the
    /// report says why and times ordinary steps.
    #[arg(long)]
    pub cuda_graph: bool,
}

/// What `wick bench step` trains.
#[derive(Debug, Clone, PartialEq)]
pub enum BenchModel {
    /// torch_reference.py's `mlp`: `Linear(784, 1024)`, ReLU, `Linear(1024, 1024)`, ReLU,
    /// `Linear(1024, 10)`, cross-entropy.
    Mlp,
    /// A GPT of [`crate::models::gpt`].
    Gpt(crate::models::GptConfig),
}

impl std::str::FromStr for BenchModel {
    type Err = anyhow::Error;

    /// `"mlp"`, or a [`crate::models::GptConfig`] name (`"gptmini"`, `"gpt2_124m"`).
    fn from_str(s: &str) -> Result<Self> {
        if s.trim().eq_ignore_ascii_case("mlp") {
            return Ok(Self::Mlp);
        }
        s.parse().map(Self::Gpt).map_err(|_| {
            anyhow::anyhow!("unknown model {s:?}: expected \"mlp\", \"gptmini\" or \"gpt2_124m\"")
        })
    }
}

/// The reference's MLP, sizes of its three layers.
const MLP_SIZES: [(usize, usize); 3] = [(784, 1024), (1024, 1024), (1024, 10)];

/// The model under test with its loss.
enum Net {
    Mlp(Vec<crate::nn::Linear>),
    Gpt(crate::models::Gpt),
}

impl Net {
    fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        use candle_core::Module;
        match self {
            Net::Gpt(g) => g.loss(x, y),
            Net::Mlp(layers) => {
                // Linear, then (ReLU, Linear) pairs, each pair one node (ops::act_linear)
                let Some((first, rest)) = layers.split_first() else {
                    candle_core::bail!("bench mlp: no layers (internal error)")
                };
                let mut h = first.forward(x)?;
                for l in rest {
                    let Some(b) = l.bias() else {
                        candle_core::bail!("bench mlp: a layer without bias (internal error)")
                    };
                    h = crate::ops::act_linear(&h, l.weight(), b, crate::ops::Activation::Relu)?;
                }
                crate::loss::cross_entropy(&h, y)
            }
        }
    }
}

/// Runs the benchmark and prints its report and JSON line.
pub fn run(args: &StepArgs) -> Result<()> {
    use crate::engine::OptimizerConfig;
    use crate::models::{gpt::reference_adamw, Gpt};
    use crate::perf::PerfSettings;
    use crate::profile::PhaseTimes;
    use crate::{Engine, EngineConfig};
    use rand::Rng;

    // under `wick launch` (torchrun's variables): one rank per GPU, DDP over the collective
    let dist = crate::dist::DistEnv::from_env()?;
    let (rank, world) = dist.as_ref().map_or((0, 1), |e| (e.rank, e.world_size));
    let dev = match args.device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => crate::cuda::new_device(dist.as_ref().map_or(0, |e| e.local_rank)).context(
            "--device cuda: no CUDA device (build with --features cuda on a GPU machine)",
        )?,
        other => anyhow::bail!("--device must be cpu or cuda, got {other:?}"),
    };
    let perf = PerfSettings {
        seed: args.seed,
        tf32: dev.is_cuda(),
        ..PerfSettings::default()
    };
    perf.apply(&dev)?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = &dev {
        crate::cuda::memory::reset_peak(d)?;
    }

    let (default_batch, t, name) = match &args.model {
        BenchModel::Mlp => (512, 1, "mlp"),
        BenchModel::Gpt(c) => (
            c.reference_batch_size(),
            c.context_len,
            if *c == crate::models::GptConfig::gpt2_124m() {
                "gpt2_124m"
            } else {
                "gptmini"
            },
        ),
    };
    let batch = args.batch.unwrap_or(default_batch);
    let store = ParamStore::new(args.precision, dev.clone(), args.seed);
    let net = match &args.model {
        BenchModel::Mlp => Net::Mlp(
            MLP_SIZES
                .iter()
                .enumerate()
                .map(|(i, &(a, b))| crate::nn::Linear::new(&store, &format!("l{i}"), a, b, true))
                .collect::<candle_core::Result<_>>()?,
        ),
        BenchModel::Gpt(c) => Net::Gpt(Gpt::new(&store, *c)?),
    };
    let params = store.num_elements();
    let mut ec = EngineConfig::adamw(1e-3);
    ec.optimizer = OptimizerConfig::AdamW(reference_adamw());
    let mut engine = Engine::new(store, ec)?;
    if dist.is_some() {
        let c = crate::dist::init(&dev).context("joining the process group")?;
        let ddp = crate::dist::DdpConfig {
            zero1: args.zero1,
            zero1_layout: match args.flat {
                true => crate::dist::Zero1Layout::Flat,
                false => crate::dist::Zero1Layout::Parameters,
            },
            overlap: !args.no_overlap,
            reduce_dtype: match args.reduce_bf16 {
                true => DType::BF16,
                false => DType::F32,
            },
            ..crate::dist::DdpConfig::default()
        };
        engine = engine.with_collective(c, ddp)?;
    }

    let mut rng = StdRng::seed_from_u64(args.seed + rank as u64);
    let (x, y) = match &args.model {
        BenchModel::Mlp => {
            let normal = rand_distr::Normal::new(0f32, 1.0)?;
            let xs: Vec<f32> = (0..batch * 784)
                .map(|_| rand_distr::Distribution::sample(&normal, &mut rng))
                .collect();
            let ys: Vec<u32> = (0..batch).map(|_| rng.random_range(0..10u32)).collect();
            (
                Tensor::from_vec(xs, (batch, 784), &dev)?,
                Tensor::from_vec(ys, batch, &dev)?,
            )
        }
        BenchModel::Gpt(c) => {
            let ids: Vec<u32> = (0..batch * t)
                .map(|_| rng.random_range(0..c.vocab_size as u32))
                .collect();
            let x = Tensor::from_vec(ids, (batch, t), &dev)?;
            (x.clone(), x)
        }
    };

    if rank != 0 {
        // other ranks run the same steps and stay quiet
        for _ in 0..args.warmup + args.steps {
            engine.step(|_| net.loss(&x, &y))?;
        }
        dev.synchronize()?;
        return Ok(());
    }
    let (what, per_rank) = match &args.model {
        BenchModel::Mlp => (
            "MLP 784-1024-1024-10".to_string(),
            format!("{batch} samples"),
        ),
        BenchModel::Gpt(c) => (format!("GPT {c}"), format!("{batch} x {t} tokens")),
    };
    println!(
        "{what} ({params} parameters), {}, batch {per_rank} per rank, {world} rank(s), fused optimizer: {}",
        crate::perf::precision_on_device(args.precision, &dev),
        engine.implementation().is_fused()
    );
    println!("{}", perf.header());
    let mut progress = Progress::new(args.warmup, args.steps);
    let graph_warmup = usize::from(args.cuda_graph);
    for _ in 0..args.warmup.saturating_sub(graph_warmup) {
        engine.step(|_| net.loss(&x, &y))?;
        progress.step();
    }
    let graph = capture(&mut engine, args, || net.loss(&x, &y))?;
    if args.cuda_graph && args.warmup > 0 {
        progress.step();
    }
    dev.synchronize()?;
    let mut phases = PhaseTimes::default();
    let mut pending = crate::timing::PendingPhases::default();
    let started = Instant::now();
    let mut last = None;
    for _ in 0..args.steps {
        let r = match &graph {
            Some(g) => engine.replay(g)?,
            None => engine.step(|_| net.loss(&x, &y))?,
        };
        progress.step();
        phases.add(&r.times());
        pending.push(None, r.spans.clone());
        last = Some(r);
    }
    dev.synchronize()?;
    let device_phases = dev.is_cuda().then(|| pending.drain()).transpose()?;
    let secs = started.elapsed().as_secs_f64();
    let loss = match &last {
        Some(r) => r.loss()?,
        None => f32::NAN,
    };

    let steps = args.steps as f64;
    let ms_per_step = secs * 1e3 / steps;
    // global, over the ranks; for the MLP an item is a sample
    let throughput = Throughput {
        items: (batch * t * world * args.steps) as u64,
        unit: match &args.model {
            BenchModel::Mlp => Unit::Samples,
            BenchModel::Gpt(_) => Unit::Tokens,
        },
        secs,
        steps: ((args.warmup + 1) as u64, (args.warmup + args.steps) as u64),
        excluded: "warm-up",
    };
    let item = throughput.unit.name();
    let flops = match &args.model {
        BenchModel::Gpt(c) => c.train_flops(batch * t * world),
        BenchModel::Mlp => 6.0 * params as f64 * (batch * world) as f64,
    } / world as f64; // per GPU
    #[allow(unused_mut)]
    let (mut peak, mut gpu): (Option<u64>, Option<String>) = (None, None);
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = &dev {
        peak = Some(crate::cuda::memory::memory_stats(d)?.peak_allocated);
        gpu = d.cuda_stream().context().name().ok();
    }
    let dtype = args.precision.compute_dtype();
    // f32 runs with TF32 allowed on CUDA (above): TF32's peak, not plain FP32's
    let tf32 = dtype == DType::F32 && perf.tf32;
    let peak_rate = gpu.as_deref().and_then(|g| match tf32 {
        true => crate::profile::peak_tf32_flops(g),
        false => crate::profile::peak_flops(g, dtype),
    });
    let mfu = peak_rate.map(|p| flops / (ms_per_step / 1e3) / p);

    println!(
        "{} warm-up + {} timed steps{}; last loss {} (the same batch every step: the loss falls \
         as the model memorises it)",
        args.warmup,
        args.steps,
        if graph.is_some() {
            " (CUDA graph replays)"
        } else {
            ""
        },
        if loss.abs() < 1e-3 {
            format!("{loss:.3e}")
        } else {
            format!("{loss:.4}")
        }
    );
    println!("ms/step     {ms_per_step:.3}");
    println!(
        "{:<11} {:.0} ({})",
        format!("{item}/s"),
        throughput.per_s(),
        throughput.basis()
    );
    if let Some((started, buckets)) = engine.buckets_started_in_backward() {
        println!("overlap     {started} of {buckets} gradient buckets started during the backward");
    }
    // replays allocate from the driver's graph pool, beside the tensors that live in the
    // default pool (parameters, optimizer state): their sum, when above the ordinary steps' peak
    #[cfg(feature = "cuda")]
    if let (Device::Cuda(d), Some(p), Some(_)) = (&dev, peak.as_mut(), &graph) {
        let live = crate::cuda::memory::memory_stats(d)?.allocated;
        *p = (*p).max(live + crate::cuda::memory::graph_memory_peak(d)?);
    }
    match peak {
        Some(b) => println!(
            "peak memory {:.2} GB (CUDA pool high-water mark{})",
            b as f64 / 1e9,
            if graph.is_some() {
                ", or its live bytes + the graph pool's high-water mark if more"
            } else {
                ""
            }
        ),
        None => println!("peak memory n/a (CPU)"),
    }
    match (mfu, peak_rate) {
        (Some(m), Some(p)) => println!(
            "MFU         {:.1}% (6 x {params} params x {} {item} per step per GPU = {:.2} TFLOP; {} peak {:.0} TFLOP/s)",
            m * 100.0,
            batch * t,
            flops / 1e12,
            if tf32 { "TF32".to_string() } else { format!("{dtype:?}") },
            p / 1e12
        ),
        _ => println!(
            "MFU         n/a ({})",
            if gpu.is_some() {
                "GPU not in crate::profile::peak_flops"
            } else {
                "CPU"
            }
        ),
    }
    if let Some(p) = &device_phases {
        println!(
            "\nGPU time per phase (CUDA events on the compute stream):\n{}",
            p.table(args.steps as u64)
        );
    }
    println!(
        "\nhost time per phase (on CUDA: time to queue the work, waits on a full launch queue \
         included when the GPU runs behind; --batch 1 shows the host's own cost):\n{}",
        phases.table(args.steps as u64)
    );
    let tag = match args.precision {
        Precision::Fp32 => "fp32",
        Precision::Bf16Mixed => "bf16",
        Precision::F16Mixed => "fp16_scaler",
    };
    let key = if world > 1 {
        let mode = match (args.zero1, args.flat) {
            (true, true) => "zero1flat_",
            (true, false) => "zero1_",
            _ => "ddp",
        };
        format!("{name}_{tag}_{mode}{world}")
    } else {
        format!("{name}_{tag}")
    };
    let (rate_key, basis_key) = match &args.model {
        BenchModel::Mlp => (format!("{key}_samples_per_s"), "samples_per_s_basis"),
        BenchModel::Gpt(_) => (format!("{key}_tok_per_s"), "tokens_per_s_basis"),
    };
    let json = serde_json::json!({
        format!("{key}_ms"): ms_per_step,
        rate_key: throughput.per_s(),
        basis_key: throughput.basis(),
        format!("{key}_peak_GB"): peak.map(|b| b as f64 / 1e9),
        format!("{key}_mfu"): mfu,
        format!("{key}_phases_ms"): device_phases.map(|p| {
            let n = steps;
            serde_json::json!({
                "forward": p.forward.as_secs_f64() * 1e3 / n,
                "backward": p.backward.as_secs_f64() * 1e3 / n,
                "optimizer": p.optimizer.as_secs_f64() * 1e3 / n,
            })
        }),
        format!("{key}_host_ms"): serde_json::json!({
            "forward": phases.forward.as_secs_f64() * 1e3 / steps,
            "backward": phases.backward.as_secs_f64() * 1e3 / steps,
            "optimizer": phases.optimizer.as_secs_f64() * 1e3 / steps,
        }),
        "params": params,
        "batch": batch,
        "cuda_graph": graph.is_some(),
        "world_size": world,
        "device": args.device,
        "gpu": gpu,
        "wick": env!("CARGO_PKG_VERSION"),
    });
    println!("{json}");
    Ok(())
}

/// Progress of a benchmark whose steps are slow: after every step of a second or more, one
/// line with its time and an estimate of the time left (from the mean step so far), so that
/// e.g. gptmini on a CPU (about 30 s per step) does not sit silent for minutes.
struct Progress {
    warmup: usize,
    total: usize,
    done: usize,
    started: Instant,
    last: Instant,
}

impl Progress {
    fn new(warmup: usize, steps: usize) -> Self {
        let now = Instant::now();
        Self {
            warmup,
            total: warmup + steps,
            done: 0,
            started: now,
            last: now,
        }
    }

    /// Call after each step.
    fn step(&mut self) {
        let now = Instant::now();
        let took = now - self.last;
        self.last = now;
        self.done += 1;
        if took.as_secs_f64() < 1.0 {
            return;
        }
        let (what, i, n) = if self.done <= self.warmup {
            ("warm-up step", self.done, self.warmup)
        } else {
            (
                "timed step",
                self.done - self.warmup,
                self.total - self.warmup,
            )
        };
        let mean = (now - self.started).as_secs_f64() / self.done as f64;
        let left = mean * (self.total - self.done) as f64;
        let left = if left >= 90.0 {
            format!("about {:.0} min to go", left / 60.0)
        } else {
            format!("about {left:.0} s to go")
        };
        println!("{what} {i}/{n} took {:.1} s; {left}", took.as_secs_f64());
    }
}

/// With `--cuda-graph`: the last warm-up step and the capture of the next one; `None` (after
/// saying why) when capture fails, so that ordinary steps are timed.
fn capture(
    engine: &mut crate::Engine,
    args: &StepArgs,
    loss: impl Fn() -> candle_core::Result<Tensor>,
) -> Result<Option<crate::engine::CapturedStep>> {
    if !args.cuda_graph {
        return Ok(None);
    }
    let (_, captured) = engine.capture_step(|_| loss())?;
    match captured {
        Ok(g) => Ok(Some(g)),
        Err(e) => {
            println!("CUDA graph: not captured, timing ordinary steps: {e:#}");
            Ok(None)
        }
    }
}
