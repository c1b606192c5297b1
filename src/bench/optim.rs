//! `wick bench optim`: one AdamW `Optimizer::step` over fp32 master weights with the two
//! implementations side by side: the reference path (plain candle tensor ops, the "unfused"
//! baseline) and the fused CPU path (one rayon pass per element). It reports the median wall
//! time per step over K iterations (after 3 warm-up steps), the speedup, and the effective
//! memory bandwidth, counting 28 bytes per element (read p, g, m, v and write p, m, v, all f32).
//! Set `RAYON_NUM_THREADS` to change the number of threads of the fused path.

use crate::optim::{AdamW, AdamWConfig, GradStats, Impl, Optimizer, StepInputs};
use crate::params::{Param, Role};
use crate::{ParamStore, Precision};
use anyhow::{Context, Result};
use candle_core::{Device, Shape, Tensor};
use candle_nn::Init;
use rand::{rngs::StdRng, SeedableRng};
use rand_distr::{Distribution, Normal};
use std::str::FromStr;
use std::time::{Duration, Instant};

/// Warm-up steps run (and discarded) before timing each path.
const WARMUP_STEPS: usize = 3;

/// Bytes moved per element by one AdamW step: read p, g, m, v and write p, m, v (f32 each).
const BYTES_PER_ELEMENT: f64 = 28.0;

/// The MNIST example's MLP (784-1024-1024-10 with biases): parameter names and shapes.
pub const MLP_SHAPES: [(&str, &[usize]); 6] = [
    ("l1.weight", &[1024, 784]),
    ("l1.bias", &[1024]),
    ("l2.weight", &[1024, 1024]),
    ("l2.bias", &[1024]),
    ("l3.weight", &[10, 1024]),
    ("l3.bias", &[10]),
];

/// The arguments of `wick bench optim`.
#[derive(clap::Args, Debug)]
pub struct OptimArgs {
    /// Parameter set: "mlp" (the MNIST MLP's six tensors, 1,863,690 parameters) or a number N
    /// of elements in one tensor (underscores allowed: 16_000_000).
    #[arg(long, default_value = "mlp", allow_negative_numbers = true)]
    pub params: ParamSpec,
    /// Timed steps per path (>= 1; the median is reported).
    #[arg(long, default_value_t = 50, allow_negative_numbers = true, value_parser = crate::cli::positive_usize)]
    pub iters: usize,
    /// Precision of the ParamStore: "32", "bf16-mixed" or "16-mixed". The optimizer updates the
    /// fp32 masters whatever the mode; in the mixed modes the working-copy refresh that the
    /// engine runs after each step is timed too.
    #[arg(long, default_value = "bf16-mixed")]
    pub precision: Precision,
}

/// What `--params` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamSpec {
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
    iters: usize,
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
    let mut times = Vec::with_capacity(iters);
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

/// Runs the benchmark and prints its table.
pub fn run(args: &OptimArgs) -> Result<()> {
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
        let mut times = Vec::with_capacity(args.iters);
        for i in 0..WARMUP_STEPS + args.iters {
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
