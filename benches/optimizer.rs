//! AdamW `Optimizer::step` on the MNIST MLP's parameters (784-1024-1024-10 with biases,
//! 1,863,690 fp32 masters): the reference path (plain candle tensor ops) against the fused CPU
//! path (one rayon pass per element).
//!
//! ```text
//! cargo bench --bench optimizer
//! ```
//! Throughput is reported as 28 bytes per element (read p, g, m, v; write p, m, v; all f32).
//! `wick bench optim` prints the same comparison without criterion.

use candle_core::{Device, Tensor};
use candle_nn::Init;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use rand::{rngs::StdRng, SeedableRng};
use rand_distr::{Distribution, Normal};
use std::time::Duration;
use wick::bench::optim::MLP_SHAPES;
use wick::optim::{AdamW, AdamWConfig, GradStats, Impl, Optimizer, StepInputs};
use wick::params::Role;
use wick::{ParamStore, Precision};

/// A bf16-mixed store with the MLP's parameters and one random fp32 gradient per parameter.
fn mlp_problem() -> anyhow::Result<(ParamStore, Vec<Option<Tensor>>)> {
    let store = ParamStore::new(Precision::Bf16Mixed, Device::Cpu, 0);
    let mut rng = StdRng::seed_from_u64(1);
    let normal = Normal::new(0.0f32, 1e-2)?;
    let mut grads = Vec::new();
    for (name, dims) in MLP_SHAPES {
        let bound = 1.0 / (dims[dims.len() - 1] as f64).sqrt();
        let init = Init::Uniform {
            lo: -bound,
            up: bound,
        };
        store.get_or_init(name, dims, init, Role::Matmul)?;
        let n: usize = dims.iter().product();
        let g: Vec<f32> = (0..n).map(|_| normal.sample(&mut rng)).collect();
        grads.push(Some(Tensor::from_vec(g, dims, &Device::Cpu)?));
    }
    Ok((store, grads))
}

fn adamw_step_mlp(c: &mut Criterion) {
    let (store, grads) = mlp_problem().expect("building the MLP parameters");
    let params = store.params();
    let bytes = 28 * store.num_elements() as u64;
    let lr = AdamWConfig::default().lr;

    let mut group = c.benchmark_group("adamw_step_mlp");
    group.throughput(Throughput::Bytes(bytes));
    group.sample_size(30);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(3));
    for (label, fused) in [("reference", false), ("fused", true)] {
        let mut opt = AdamW::new(
            AdamWConfig::default(),
            if fused {
                Impl::FusedCpu
            } else {
                Impl::Reference
            },
        )
        .expect("AdamW config");
        group.bench_function(label, |b| {
            b.iter(|| {
                opt.step(
                    &params,
                    &grads,
                    StepInputs::host(&GradStats::clean(1.0), lr),
                )
                .expect("AdamW step")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, adamw_step_mlp);
criterion_main!(benches);
