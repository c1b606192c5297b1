//! `wick`: the command-line companion of the wick crate.
//!
//! ```text
//! wick bench optim [--params mlp|N] [--iters K] [--precision 32|bf16-mixed|16-mixed]
//! wick bench step [--model gptmini|gpt2_124m] [--precision P] [--device cpu|cuda] [--steps N]
//! wick info
//! wick doctor [--json] [--require cuda|cpu] [--precision 32|bf16-mixed|16-mixed]
//! wick plot METRICS.csv [-o loss.png] [--phases PHASES.csv [--phases-out phases.png]]
//! wick launch --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P] -- PROGRAM ARGS
//! wick finetune --config run.toml [--device cpu|cuda] [--resume]
//! ```
//!
//! `bench optim` and `bench step` are the library's [`wick::bench`] modules (see their docs);
//! this binary parses their arguments and calls them.
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
//! bar chart of the per-phase step time; the pictures go beside the CSV unless `-o` says
//! otherwise.
//!
//! `finetune` fine-tunes a model on chat data as the TOML file says ([`wick::finetune`];
//! docs/finetune.md lists every key): a progress bar, metrics and plots, evaluation on the
//! held-out conversations, checkpoints and resume, the LoRA adapter and the merged model. A
//! bad config is an error naming the key and the file (exit status 1); Ctrl-C saves a
//! checkpoint and exits with status 130.
//!
//! Numeric flags refuse values that make no sense with the flag's name and range
//! (`--steps 0`, `--iters -1`: `invalid value '-1' for '--iters <ITERS>': must be a whole
//! number >= 1`), with exit status 2 as every argument error.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::time::Duration;
use wick::Precision;

/// The candle version wick is built and tested against (pinned with `=` in Cargo.toml).
const CANDLE_VERSION: &str = "0.11.1";

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
    #[cfg(feature = "plot")]
    Plot(PlotArgs),
    /// Start and supervise the local ranks of a data-parallel job (torchrun's contract).
    Launch(LaunchArgs),
    /// Fine-tune a model on chat data (JSONL conversations) as a TOML config says.
    #[cfg(feature = "tokenizers")]
    Finetune(FinetuneArgs),
}

/// `wick finetune --config run.toml [--device cpu|cuda] [--resume]` (see `wick::finetune`).
#[cfg(feature = "tokenizers")]
#[derive(clap::Args, Debug)]
struct FinetuneArgs {
    /// The run's TOML config (docs/finetune.md lists its keys; examples/configs/ has examples).
    #[arg(long, value_name = "FILE")]
    config: std::path::PathBuf,
    /// Override the config's `device`: cpu or cuda.
    #[arg(long)]
    device: Option<String>,
    /// Continue from the newest checkpoint under the config's save.dir (as `resume = true`).
    #[arg(long)]
    resume: bool,
}

/// `wick launch --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]
/// -- PROGRAM ARGS` (see `wick::dist::launch`).
#[derive(clap::Args, Debug)]
struct LaunchArgs {
    /// Ranks on this node (one per GPU; rank l uses cuda:l through LOCAL_RANK).
    #[arg(long, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    nproc_per_node: usize,
    /// Nodes in the job.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = wick::cli::positive_usize)]
    nnodes: usize,
    /// This node's index, 0..nnodes.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = wick::cli::non_negative_usize)]
    node_rank: usize,
    /// Host of rank 0 (node 0).
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of rank 0's rendezvous, 1 to 65535.
    #[arg(long, default_value_t = 29500, allow_negative_numbers = true,
          value_parser = clap::value_parser!(u16).range(1..))]
    master_port: u16,
    /// Seconds between SIGTERM and SIGKILL when stopping ranks (>= 0; at most 3600 is used).
    #[arg(long, default_value_t = 10.0, allow_negative_numbers = true, value_parser = wick::cli::non_negative_f64)]
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

#[cfg(feature = "plot")]
#[derive(clap::Args, Debug)]
struct PlotArgs {
    /// Metrics CSV: step,epoch,loss,val_loss,lr,grad_norm,loss_scale,samples_per_s (empty cells
    /// allowed; only `step` is required).
    metrics: std::path::PathBuf,
    /// Output PNG for the loss and lr curves (default: loss.png beside METRICS, where the
    /// Trainer draws it too).
    #[arg(short = 'o', long = "out")]
    out: Option<std::path::PathBuf>,
    /// Phases CSV (`phase,ms_per_step` rows, or per-step columns data,h2d,forward,backward,optimizer).
    #[arg(long)]
    phases: Option<std::path::PathBuf>,
    /// Output PNG for the phase bar chart (default: phases.png beside --out).
    #[arg(long = "phases-out", visible_alias = "o2")]
    phases_out: Option<std::path::PathBuf>,
    /// Picture width in pixels, 64 to 16384.
    #[arg(long, default_value_t = wick::plot::DEFAULT_SIZE.0, allow_negative_numbers = true,
          value_parser = clap::value_parser!(u32).range(64..=16384))]
    width: u32,
    /// Picture height in pixels, 64 to 16384.
    #[arg(long, default_value_t = wick::plot::DEFAULT_SIZE.1, allow_negative_numbers = true,
          value_parser = clap::value_parser!(u32).range(64..=16384))]
    height: u32,
}

#[derive(Subcommand, Debug)]
enum Bench {
    /// Time one AdamW step: reference path against the fused CPU path.
    Optim(wick::bench::optim::OptimArgs),
    /// Time full training steps of a GPT (torch_reference.py's models) on random tokens.
    Step(wick::bench::step::StepArgs),
}

fn main() {
    // a closed pipe (`wick ... | head`) ends the process quietly, as for other Unix tools,
    // instead of a panic in println!
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // errors as one line of causes, without a backtrace (RUST_BACKTRACE is for panics)
    if let Err(e) = run(Cli::parse().command) {
        eprintln!("Error: {e:#}");
        std::process::exit(1);
    }
}

fn run(command: Command) -> Result<()> {
    match command {
        Command::Bench {
            what: Bench::Optim(args),
        } => wick::bench::optim::run(&args),
        Command::Bench {
            what: Bench::Step(args),
        } => wick::bench::step::run(&args),
        Command::Info => {
            info();
            Ok(())
        }
        Command::Doctor(args) => doctor(&args),
        #[cfg(feature = "plot")]
        Command::Plot(args) => plot(&args),
        Command::Launch(args) => launch(args),
        #[cfg(feature = "tokenizers")]
        Command::Finetune(args) => finetune(&args),
    }
}

#[cfg(feature = "tokenizers")]
fn finetune(args: &FinetuneArgs) -> Result<()> {
    wick::cli::init_logging();
    let overrides = wick::finetune::Overrides {
        device: args.device.clone(),
        resume: args.resume,
    };
    match wick::finetune::run(&args.config, &overrides)? {
        wick::finetune::Outcome::Finished(_) => Ok(()),
        wick::finetune::Outcome::Interrupted(path) => {
            println!(
                "interrupted: saved {} (continue with --resume or resume = true)",
                path.display()
            );
            std::process::exit(wick::checkpoint::INTERRUPTED_EXIT_CODE);
        }
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
        nproc_per_node: args.nproc_per_node,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr,
        master_port: args.master_port,
        program: command.next().unwrap_or_default(),
        args: command.collect(),
        grace: Duration::from_secs_f64(args.grace_s.min(3600.0)),
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

#[cfg(feature = "plot")]
fn plot(args: &PlotArgs) -> Result<()> {
    use wick::plot::{self, PlotOptions};
    let opts = PlotOptions {
        size: (args.width, args.height),
        labels: true,
    };
    let rows = plot::read_metrics(&args.metrics)?;
    let beside_metrics = |name: &str| {
        args.metrics
            .parent()
            .unwrap_or(std::path::Path::new(""))
            .join(name)
    };
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| beside_metrics("loss.png"));
    let r = plot::plot_metrics(&rows, &out, &opts)
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
            out.parent()
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
