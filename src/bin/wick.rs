//! `wick`: the command-line companion of the wick crate.
//!
//! ```text
//! wick bench optim [--params mlp|N] [--iters K] [--precision 32|bf16-mixed|16-mixed]
//! wick info
//! wick doctor [--json] [--require cuda|cpu] [--precision 32|bf16-mixed|16-mixed]
//! wick plot METRICS.csv [-o loss.png] [--phases PHASES.csv [--phases-out phases.png]]
//! wick launch --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P] -- PROGRAM ARGS
//! ```
//!
//! `bench optim` times one AdamW `Optimizer::step` over fp32 master weights with the two
//! implementations side by side: the reference path (plain candle tensor ops, the "unfused"
//! baseline) and the fused CPU path (one rayon pass per element). It reports the median wall
//! time per step over K iterations (after 3 warm-up steps), the speedup, and the effective
//! memory bandwidth, counting 28 bytes per element (read p, g, m, v and write p, m, v, all f32).
//! Set `RAYON_NUM_THREADS` to change the number of threads of the fused path.
//!
//! `info` prints the crate and candle versions, the cargo features of this build and rayon's
//! thread count.
//!
//! `doctor` reports the OS, CPU, memory, GPUs (through NVML, loaded at run time), the CUDA
//! libraries that can be loaded and what this build has, then recommendations, each with the
//! exact command. It exits with status 1 when `--require` names a device that cannot be used
//! (e.g. `--require cuda` on a machine without a GPU or with a CPU-only build), else 0.
//!
//! `plot` draws train/validation loss and the learning rate against step from a metrics CSV
//! (`step,epoch,loss,val_loss,lr,grad_norm,loss_scale,samples_per_s`), and with `--phases` a
//! bar chart of the per-phase step time.

use anyhow::{Context, Result};
use candle_core::{Device, Shape, Tensor};
use candle_nn::Init;
use clap::{Parser, Subcommand};
use rand::{rngs::StdRng, SeedableRng};
use rand_distr::{Distribution, Normal};
use std::str::FromStr;
use std::time::{Duration, Instant};
use wick::optim::{AdamW, AdamWConfig, GradStats, Impl, Optimizer, StepInputs};
use wick::params::{Param, Role};
use wick::{ParamStore, Precision};

/// The candle version wick is built and tested against (pinned with `=` in Cargo.toml).
const CANDLE_VERSION: &str = "0.11.1";

/// Warm-up steps run (and discarded) before timing each path.
const WARMUP_STEPS: usize = 3;

/// Bytes moved per element by one AdamW step: read p, g, m, v and write p, m, v (f32 each).
const BYTES_PER_ELEMENT: f64 = 28.0;

/// The MNIST example's MLP (784-1024-1024-10 with biases): parameter names and shapes.
const MLP_SHAPES: [(&str, &[usize]); 6] = [
    ("l1.weight", &[1024, 784]),
    ("l1.bias", &[1024]),
    ("l2.weight", &[1024, 1024]),
    ("l2.bias", &[1024]),
    ("l3.weight", &[10, 1024]),
    ("l3.bias", &[10]),
];

#[derive(Parser, Debug)]
#[command(
    name = "wick",
    version,
    about = "Mixed-precision training engine for candle"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Micro-benchmarks.
    Bench {
        #[command(subcommand)]
        what: Bench,
    },
    /// Versions, cargo features of this build, thread count.
    Info,
    /// Check this machine and build for training: hardware, drivers, libraries, settings.
    Doctor(DoctorArgs),
    /// Draw loss/lr curves (and the phase breakdown) from CSV files as PNG images.
    Plot(PlotArgs),
    /// Start and supervise the local ranks of a data-parallel job (torchrun's contract).
    Launch(LaunchArgs),
}

/// `wick launch --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]
/// -- PROGRAM ARGS` (see `wick::dist::launch`).
#[derive(clap::Args, Debug)]
struct LaunchArgs {
    /// Ranks on this node (one per GPU; rank l uses cuda:l through LOCAL_RANK).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    nproc_per_node: u32,
    /// Nodes in the job.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    nnodes: u32,
    /// This node's index, 0..nnodes.
    #[arg(long, default_value_t = 0)]
    node_rank: u32,
    /// Host of rank 0 (node 0).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of rank 0's rendezvous.
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
    /// Seconds between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long, default_value_t = 10.0)]
    grace_s: f64,
    /// The program every rank runs, and its arguments (after `--`).
    #[arg(last = true, required = true, num_args = 1..)]
    command: Vec<String>,
}

#[derive(clap::Args, Debug)]
struct DoctorArgs {
    /// Print the report as JSON (report, recommendations, ready, verdict).
    #[arg(long)]
    json: bool,
    /// Exit non-zero unless this device is usable: "cuda" or "cpu".
    #[arg(long, value_name = "DEVICE")]
    require: Option<wick::doctor::Require>,
    /// The precision you plan to train with, to tailor the advice: "32", "bf16-mixed", "16-mixed".
    #[arg(long)]
    precision: Option<Precision>,
}

#[derive(clap::Args, Debug)]
struct PlotArgs {
    /// Metrics CSV: step,epoch,loss,val_loss,lr,grad_norm,loss_scale,samples_per_s (empty cells
    /// allowed; only `step` is required).
    metrics: std::path::PathBuf,
    /// Output PNG for the loss and lr curves.
    #[arg(short = 'o', long = "out", default_value = "loss.png")]
    out: std::path::PathBuf,
    /// Phases CSV (`phase,ms_per_step` rows, or per-step columns data,h2d,forward,backward,optimizer).
    #[arg(long)]
    phases: Option<std::path::PathBuf>,
    /// Output PNG for the phase bar chart (default: phases.png beside --out).
    #[arg(long = "phases-out", visible_alias = "o2")]
    phases_out: Option<std::path::PathBuf>,
    /// Picture width in pixels.
    #[arg(long, default_value_t = wick::plot::DEFAULT_SIZE.0)]
    width: u32,
    /// Picture height in pixels.
    #[arg(long, default_value_t = wick::plot::DEFAULT_SIZE.1)]
    height: u32,
}

#[derive(Subcommand, Debug)]
enum Bench {
    /// Time one AdamW step: reference path against the fused CPU path.
    Optim(OptimArgs),
    /// Time full training steps of a GPT (torch_reference.py's models) on random tokens.
    Step(StepArgs),
}

#[derive(clap::Args, Debug)]
struct OptimArgs {
    /// Parameter set: "mlp" (the MNIST MLP's six tensors, 1,863,690 parameters) or a number N
    /// of elements in one tensor (underscores allowed: 16_000_000).
    #[arg(long, default_value = "mlp")]
    params: ParamSpec,
    /// Timed steps per path (the median is reported).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Precision of the ParamStore: "32", "bf16-mixed" or "16-mixed". The optimizer updates the
    /// fp32 masters whatever the mode; in the mixed modes the working-copy refresh that the
    /// engine runs after each step is timed too.
    #[arg(long, default_value = "bf16-mixed")]
    precision: Precision,
}

/// What `--params` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ParamSpec {
    /// The MNIST MLP's shapes.
    Mlp,
    /// One flat tensor of this many elements.
    Flat(usize),
}

impl FromStr for ParamSpec {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("mlp") {
            return Ok(ParamSpec::Mlp);
        }
        match s.replace('_', "").parse::<usize>() {
            Ok(0) => Err("the number of elements must be >= 1".to_string()),
            Ok(n) => Ok(ParamSpec::Flat(n)),
            Err(_) => Err(format!(
                "expected \"mlp\" or a number of elements (e.g. 16000000), got {s:?}"
            )),
        }
    }
}

impl ParamSpec {
    fn shapes(self) -> Vec<(String, Vec<usize>)> {
        match self {
            ParamSpec::Mlp => MLP_SHAPES
                .iter()
                .map(|(n, s)| (n.to_string(), s.to_vec()))
                .collect(),
            ParamSpec::Flat(n) => vec![("flat".to_string(), vec![n])],
        }
    }

    fn describe(self) -> String {
        match self {
            ParamSpec::Mlp => "MNIST MLP 784-1024-1024-10".to_string(),
            ParamSpec::Flat(n) => format!("one tensor of {n} elements"),
        }
    }
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Bench {
            what: Bench::Optim(args),
        } => bench_optim(&args),
        Command::Bench {
            what: Bench::Step(args),
        } => bench_step(&args),
        Command::Info => {
            info();
            Ok(())
        }
        Command::Doctor(args) => doctor(&args),
        Command::Plot(args) => plot(&args),
        Command::Launch(args) => launch(args),
    }
}

fn launch(args: LaunchArgs) -> Result<()> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use wick::dist::launch::{LaunchConfig, LaunchOutcome};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    // best effort: without the handler, Ctrl-C still ends the launcher
    let _ = ctrlc::set_handler(move || s.store(true, Ordering::SeqCst));
    let mut command = args.command.into_iter();
    let config = LaunchConfig {
        nproc_per_node: args.nproc_per_node as usize,
        nnodes: args.nnodes as usize,
        node_rank: args.node_rank as usize,
        master_addr: args.master_addr,
        master_port: args.master_port,
        program: command.next().unwrap_or_default(),
        args: command.collect(),
        grace: Duration::from_secs_f64(if args.grace_s.is_finite() {
            args.grace_s.clamp(0.0, 3600.0)
        } else {
            10.0
        }),
        stop: Some(stop),
    };
    let outcome = wick::dist::launch::launch(&config)?;
    if outcome != LaunchOutcome::Success {
        eprintln!("{}", outcome.message());
        std::process::exit(outcome.exit_code());
    }
    Ok(())
}

fn doctor(args: &DoctorArgs) -> Result<()> {
    use wick::doctor;
    let report = doctor::collect().with_intent(args.precision, args.require);
    let recs = doctor::recommendations(&report);
    let ready = doctor::ready(&recs);
    let verdict = doctor::verdict(&report, &recs);
    if args.json {
        let out = doctor::DoctorOutput {
            report: &report,
            recommendations: &recs,
            ready,
            verdict: verdict.clone(),
        };
        let mut json =
            serde_json::to_string_pretty(&out).context("serialising the doctor report")?;
        json.push('\n');
        emit(&json)?;
    } else {
        emit(&doctor::render_text(&report, &recs))?;
    }
    if !ready {
        eprintln!("wick doctor: {verdict}");
        std::process::exit(1);
    }
    Ok(())
}

/// Writes to stdout; a closed pipe (`wick doctor | head`) ends the output quietly instead of
/// panicking as `print!` does.
fn emit(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e).context("writing to stdout"),
        _ => Ok(()),
    }
}

fn plot(args: &PlotArgs) -> Result<()> {
    use wick::plot::{self, PlotOptions};
    let opts = PlotOptions {
        size: (args.width, args.height),
        labels: true,
    };
    let rows = plot::read_metrics(&args.metrics)?;
    let r = plot::plot_metrics(&rows, &args.out, &opts)
        .with_context(|| format!("plotting {}", args.metrics.display()))?;
    println!(
        "wrote {} ({}x{}, {} points from {} rows)",
        r.path.display(),
        r.size.0,
        r.size.1,
        r.points,
        rows.len()
    );
    let mut font = r.font.clone();
    if let Some(phases) = &args.phases {
        let b = plot::read_phases(phases)?;
        let out = args.phases_out.clone().unwrap_or_else(|| {
            args.out
                .parent()
                .unwrap_or(std::path::Path::new(""))
                .join("phases.png")
        });
        let r = plot::plot_phases(&b, &out, &opts)
            .with_context(|| format!("plotting {}", phases.display()))?;
        println!(
            "wrote {} ({}x{}, {} phases, {:.3} ms per step)",
            r.path.display(),
            r.size.0,
            r.size.1,
            r.points,
            b.total_ms()
        );
        font = font.or(r.font);
    } else if args.phases_out.is_some() {
        anyhow::bail!("--phases-out needs --phases PHASES.csv");
    }
    if font.is_none() {
        eprintln!(
            "note: no TrueType font found, so the plots have no text; set {}=/path/to/font.ttf",
            plot::FONT_ENV
        );
    }
    Ok(())
}

fn info() {
    let yes_no = |b: bool| if b { "on" } else { "off" };
    println!("wick    {}", env!("CARGO_PKG_VERSION"));
    println!("candle  {CANDLE_VERSION}");
    println!(
        "build   {}",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
    println!("features:");
    println!("  cuda  {}", yes_no(cfg!(feature = "cuda")));
    println!("  nccl  {}", yes_no(cfg!(feature = "nccl")));
    println!(
        "rayon threads  {} (set RAYON_NUM_THREADS to change)",
        rayon::current_num_threads()
    );
}

/// A ParamStore with the requested shapes, and one random fp32 gradient per parameter.
fn build_problem(spec: ParamSpec, precision: Precision) -> Result<(ParamStore, Vec<Tensor>)> {
    let store = ParamStore::new(precision, Device::Cpu, 0);
    let mut rng = StdRng::seed_from_u64(1);
    let normal = Normal::new(0.0f32, 1e-2).context("gradient distribution")?;
    let mut grads = Vec::new();
    for (name, dims) in spec.shapes() {
        let shape = Shape::from(dims);
        let bound = 1.0 / (*shape.dims().last().unwrap_or(&1) as f64).sqrt();
        store.get_or_init(
            &name,
            shape.clone(),
            Init::Uniform {
                lo: -bound,
                up: bound,
            },
            Role::Matmul,
        )?;
        let g: Vec<f32> = (0..shape.elem_count())
            .map(|_| normal.sample(&mut rng))
            .collect();
        grads.push(Tensor::from_vec(g, shape, &Device::Cpu)?);
    }
    Ok((store, grads))
}

/// Runs `WARMUP_STEPS` untimed steps, then `iters` timed ones; returns the sorted step times.
fn time_steps(
    fused: bool,
    params: &[Param],
    grads: &[Option<Tensor>],
    iters: u32,
) -> Result<Vec<Duration>> {
    let mut opt = AdamW::new(
        AdamWConfig::default(),
        if fused {
            Impl::FusedCpu
        } else {
            Impl::Reference
        },
    )?;
    let lr = AdamWConfig::default().lr;
    for _ in 0..WARMUP_STEPS {
        opt.step(params, grads, StepInputs::host(&GradStats::clean(1.0), lr))?;
    }
    let mut times = Vec::with_capacity(iters as usize);
    for _ in 0..iters {
        let t = Instant::now();
        opt.step(params, grads, StepInputs::host(&GradStats::clean(1.0), lr))?;
        times.push(t.elapsed());
    }
    times.sort();
    Ok(times)
}

fn median(sorted: &[Duration]) -> Duration {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn bench_optim(args: &OptimArgs) -> Result<()> {
    let (store, grads) = build_problem(args.params, args.precision)?;
    let params = store.params();
    let grads: Vec<Option<Tensor>> = grads.into_iter().map(Some).collect();
    let n = store.num_elements();
    println!(
        "AdamW step on {}: {} tensor(s), {} parameters; precision {} (fp32 masters and moments)",
        args.params.describe(),
        params.len(),
        n,
        args.precision
    );
    println!(
        "CPU, {} rayon threads; median of {} steps after {} warm-up; {} bytes moved per element",
        rayon::current_num_threads(),
        args.iters,
        WARMUP_STEPS,
        BYTES_PER_ELEMENT
    );
    println!();
    println!(
        "{:<10} {:>12} {:>10} {:>10} {:>8}",
        "path", "median ms", "min ms", "max ms", "GB/s"
    );
    let gbps = |d: Duration| n as f64 * BYTES_PER_ELEMENT / d.as_secs_f64() / 1e9;
    let mut medians = Vec::new();
    for (label, fused) in [("reference", false), ("fused", true)] {
        let times = time_steps(fused, &params, &grads, args.iters)
            .with_context(|| format!("timing the {label} AdamW path"))?;
        let med = median(&times);
        println!(
            "{:<10} {:>12.3} {:>10.3} {:>10.3} {:>8.2}",
            label,
            ms(med),
            ms(times[0]),
            ms(times[times.len() - 1]),
            gbps(med)
        );
        medians.push(med);
    }
    println!();
    println!(
        "speedup (reference / fused): {:.2}x",
        medians[0].as_secs_f64() / medians[1].as_secs_f64()
    );

    if args.precision.is_mixed() {
        // The engine refreshes the half working copies after every applied step.
        let mut times = Vec::with_capacity(args.iters as usize);
        for i in 0..WARMUP_STEPS + args.iters as usize {
            let t = Instant::now();
            store.refresh_working_copies()?;
            if i >= WARMUP_STEPS {
                times.push(t.elapsed());
            }
        }
        times.sort();
        println!(
            "working-copy refresh (fp32 -> {:?}, runs after each engine step): {:.3} ms median",
            args.precision.compute_dtype(),
            ms(median(&times))
        );
    }
    Ok(())
}

// ---- bench step: full training steps of wick::models::gpt ------------------------------------

/// Device `wick bench step` uses unless `--device` says otherwise.
const BENCH_STEP_DEVICE: &str = if cfg!(feature = "cuda") {
    "cuda"
} else {
    "cpu"
};

/// `wick bench step --model gptmini|gpt2_124m [--precision 32|bf16-mixed] [--device cpu|cuda]
/// [--steps N] [--batch B]`: the train-step benchmark of `torch_reference.py step`, in wick.
///
/// Builds the model (GPT-2 init), an Engine with the reference's AdamW (lr 1e-3, betas
/// 0.9/0.99, eps 1e-8, weight decay 0.1 on rank >= 2; constant lr, no clipping, as the
/// reference's `step`), one batch of random tokens `x: (B, T)` with targets `y = x` (as the
/// reference), runs `--warmup` untimed steps, then times `--steps` steps between two device
/// synchronisations. Reports ms/step, tokens/s, peak device memory (the CUDA pool's high-water
/// mark since before the model was built, like `torch.cuda.max_memory_allocated`; n/a on the
/// CPU), MFU (6 × parameters × tokens per step over the GPU's peak for the compute dtype, from
/// `wick::profile::peak_flops`), the host time per phase, and one JSON line with the
/// reference's keys (`gptmini_bf16_ms`, `..._tok_per_s`, `..._peak_GB`). On CUDA, TF32 is on
/// for f32 matmuls (the reference sets `allow_tf32`).
#[derive(clap::Args, Debug)]
struct StepArgs {
    /// Model: "gptmini" (V 256, T 256, 6 x 384) or "gpt2_124m" (V 50304, T 1024, 12 x 768).
    #[arg(long, default_value = "gptmini")]
    model: wick::models::GptConfig,
    /// Precision: "32", "bf16-mixed" or "16-mixed".
    #[arg(long, default_value = "bf16-mixed")]
    precision: Precision,
    /// cpu or cuda (the default is cuda in builds with the cuda feature, cpu otherwise).
    #[arg(long, default_value = BENCH_STEP_DEVICE)]
    device: String,
    /// Timed steps.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    steps: u32,
    /// Untimed warm-up steps before timing (the first CUDA steps JIT-compile kernels).
    #[arg(long, default_value_t = 3)]
    warmup: u32,
    /// Sequences per step (default: the reference's, 64 for gptmini and 16 for gpt2_124m).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    batch: Option<u64>,
    /// Seed of the initialisation and of the random tokens.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Under `wick launch`: ZeRO-1 (optimizer state partitioned over the ranks) instead of
    /// plain DDP.
    #[arg(long)]
    zero1: bool,
}

fn bench_step(args: &StepArgs) -> Result<()> {
    use rand::Rng;
    use wick::engine::OptimizerConfig;
    use wick::models::{gpt::reference_adamw, Gpt};
    use wick::perf::PerfSettings;
    use wick::profile::PhaseTimes;
    use wick::{Engine, EngineConfig};

    // under `wick launch` (torchrun's variables): one rank per GPU, DDP over the collective
    let dist = wick::dist::DistEnv::from_env()?;
    let (rank, world) = dist.as_ref().map_or((0, 1), |e| (e.rank, e.world_size));
    let dev = match args.device.as_str() {
        "cpu" => Device::Cpu,
        "cuda" => Device::new_cuda(dist.as_ref().map_or(0, |e| e.local_rank)).context(
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
        wick::cuda::memory::reset_peak(d)?;
    }

    let config = args.model;
    let batch = args
        .batch
        .map(|b| b as usize)
        .unwrap_or_else(|| config.reference_batch_size());
    let t = config.context_len;
    let store = ParamStore::new(args.precision, dev.clone(), args.seed);
    let gpt = Gpt::new(&store, config)?;
    let params = store.num_elements();
    let mut ec = EngineConfig::adamw(1e-3);
    ec.optimizer = OptimizerConfig::AdamW(reference_adamw());
    let mut engine = Engine::new(store, ec)?;
    if dist.is_some() {
        let c = wick::dist::init(&dev).context("joining the process group")?;
        let ddp = wick::dist::DdpConfig {
            zero1: args.zero1,
            ..wick::dist::DdpConfig::default()
        };
        engine = engine.with_collective(c, ddp)?;
    }

    let mut rng = StdRng::seed_from_u64(args.seed + rank as u64);
    let ids: Vec<u32> = (0..batch * t)
        .map(|_| rng.random_range(0..config.vocab_size as u32))
        .collect();
    let x = Tensor::from_vec(ids, (batch, t), &dev)?;
    let y = x.clone();

    if rank != 0 {
        // other ranks run the same steps and stay quiet
        for _ in 0..args.warmup + args.steps {
            engine.step(|_| gpt.loss(&x, &y))?;
        }
        dev.synchronize()?;
        return Ok(());
    }
    println!(
        "GPT {config} ({params} parameters), {} on {:?}, batch {batch} x {t} tokens per rank, {world} rank(s), fused optimizer: {}",
        args.precision,
        dev,
        engine.implementation().is_fused()
    );
    println!("{}", perf.header());
    for _ in 0..args.warmup {
        engine.step(|_| gpt.loss(&x, &y))?;
    }
    dev.synchronize()?;
    let mut phases = PhaseTimes::default();
    let mut pending = wick::timing::PendingPhases::default();
    let started = Instant::now();
    let mut last = None;
    for _ in 0..args.steps {
        let r = engine.step(|_| gpt.loss(&x, &y))?;
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
    let tokens = (batch * t * world) as f64; // global, over the ranks
    let tok_per_s = tokens * steps / secs;
    let flops = config.train_flops(batch * t * world) / world as f64; // per GPU
    #[allow(unused_mut)]
    let (mut peak, mut gpu): (Option<u64>, Option<String>) = (None, None);
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = &dev {
        peak = Some(wick::cuda::memory::memory_stats(d)?.peak_allocated);
        gpu = d.cuda_stream().context().name().ok();
    }
    let dtype = args.precision.compute_dtype();
    let peak_rate = gpu
        .as_deref()
        .and_then(|g| wick::profile::peak_flops(g, dtype));
    let mfu = peak_rate.map(|p| flops / (ms_per_step / 1e3) / p);

    println!(
        "{} warm-up + {} timed steps; last loss {loss:.4}",
        args.warmup, args.steps
    );
    println!("ms/step     {ms_per_step:.3}");
    println!("tokens/s    {tok_per_s:.0}");
    match peak {
        Some(b) => println!(
            "peak memory {:.2} GB (CUDA pool high-water mark)",
            b as f64 / 1e9
        ),
        None => println!("peak memory n/a (CPU)"),
    }
    match (mfu, peak_rate) {
        (Some(m), Some(p)) => println!(
            "MFU         {:.1}% (6 x {params} params x {} tokens per step per GPU = {:.2} TFLOP; {:?} peak {:.0} TFLOP/s)",
            m * 100.0,
            batch * t,
            flops / 1e12,
            dtype,
            p / 1e12
        ),
        _ => println!(
            "MFU         n/a ({})",
            if gpu.is_some() {
                "GPU not in wick::profile::peak_flops"
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
        "\nhost time per phase (on CUDA: time to queue the work):\n{}",
        phases.table(args.steps as u64)
    );
    let name = if config == wick::models::GptConfig::gpt2_124m() {
        "gpt2_124m"
    } else {
        "gptmini"
    };
    let tag = match args.precision {
        Precision::Fp32 => "fp32",
        Precision::Bf16Mixed => "bf16",
        Precision::F16Mixed => "fp16_scaler",
    };
    let key = if world > 1 {
        let mode = if args.zero1 { "zero1_" } else { "ddp" };
        format!("{name}_{tag}_{mode}{world}")
    } else {
        format!("{name}_{tag}")
    };
    let json = serde_json::json!({
        format!("{key}_ms"): ms_per_step,
        format!("{key}_tok_per_s"): tok_per_s,
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
        "world_size": world,
        "device": args.device,
        "gpu": gpu,
        "wick": env!("CARGO_PKG_VERSION"),
    });
    println!("{json}");
    Ok(())
}
