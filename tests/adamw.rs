//! AdamW: fused CPU path vs the candle-op reference path, and both against an independent
//! scalar f64 implementation of torch.optim.AdamW's update.

mod common;
use candle_core::Tensor;
use common::{flat, max_rel_err, random_grads};
use rand::SeedableRng;
use wick::optim::{AdamW, AdamWConfig, GradStats, Impl, Optimizer, StepInputs};
use wick::params::ParamStore;

/// Shapes with an empty tensor, a 1-D tensor and odd sizes (larger than one rayon chunk).
const SHAPES: &[&[usize]] = &[&[0], &[7], &[13, 17], &[0, 5], &[3, 5, 11], &[40_001]];

fn store(seed: u64) -> anyhow::Result<ParamStore> {
    common::store(seed, SHAPES)
}

#[test]
fn fused_matches_reference_over_200_steps() -> anyhow::Result<()> {
    let config = AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let (sr, sf) = (store(3)?, store(3)?);
    let mut reference = AdamW::new(config.clone(), Impl::Reference)?;
    let mut fused = AdamW::new(config, Impl::FusedCpu)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for step in 0..200 {
        let grads = random_grads(&sr.params(), &mut rng, 1.0)?;
        let lr = 1e-2 * (1.0 - step as f64 / 400.0);
        reference.step(
            &sr.params(),
            &grads,
            StepInputs::host(&GradStats::clean(0.5), lr),
        )?;
        fused.step(
            &sf.params(),
            &grads,
            StepInputs::host(&GradStats::clean(0.5), lr),
        )?;
    }
    let mut worst = 0f64;
    for (a, b) in sf.params().iter().zip(sr.params().iter()) {
        worst = worst.max(max_rel_err(
            &flat(a.master.as_tensor()),
            &flat(b.master.as_tensor()),
        ));
    }
    let (st_f, st_r) = (
        fused.state_tensors(&sf.params())?,
        reference.state_tensors(&sr.params())?,
    );
    assert_eq!(st_f.len(), st_r.len());
    for ((nf, tf), (nr, tr)) in st_f.iter().zip(&st_r) {
        assert_eq!(nf, nr);
        worst = worst.max(max_rel_err(&flat(tf), &flat(tr)));
    }
    assert!(worst <= 1e-6, "max relative error {worst:e} > 1e-6");
    let steps = |st: &[(String, candle_core::Tensor)]| -> Vec<f32> {
        st.iter()
            .filter(|(n, _)| n.ends_with(".step"))
            .map(|(_, t)| flat(t)[0])
            .collect()
    };
    assert!(steps(&st_f)
        .iter()
        .chain(&steps(&st_r))
        .all(|&s| s == 200.0));
    Ok(())
}

/// torch.optim.AdamW's update written out in f64 for one element.
#[allow(clippy::too_many_arguments)] // the scalar update takes each hyperparameter by name, as torch.optim does
fn adamw_scalar(
    p: &mut f64,
    m: &mut f64,
    v: &mut f64,
    g: f64,
    t: i32,
    c: &AdamWConfig,
    lr: f64,
    decay: bool,
) {
    if decay {
        *p *= 1.0 - lr * c.weight_decay;
    }
    *m = c.beta1 * *m + (1.0 - c.beta1) * g;
    *v = c.beta2 * *v + (1.0 - c.beta2) * g * g;
    let m_hat = *m / (1.0 - c.beta1.powi(t));
    let v_hat = *v / (1.0 - c.beta2.powi(t));
    *p -= lr * m_hat / (v_hat.sqrt() + c.eps);
}

#[test]
fn both_paths_match_scalar_f64_adamw_and_skip_decay_for_rank1() -> anyhow::Result<()> {
    let c = AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.5,
        ..AdamWConfig::default()
    };
    for fused in [false, true] {
        let s = store(5)?;
        let params = s.params();
        let init: Vec<Vec<f32>> = params.iter().map(|p| flat(p.master.as_tensor())).collect();
        let mut opt = AdamW::new(
            c.clone(),
            if fused {
                Impl::FusedCpu
            } else {
                Impl::Reference
            },
        )?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let mut history = Vec::new();
        for _ in 0..30 {
            let g = random_grads(&params, &mut rng, 3.0)?;
            opt.step(&params, &g, StepInputs::host(&GradStats::clean(0.25), c.lr))?;
            history.push(g);
        }
        // replay element 0..n of p1 (rank 1, not decayed) and p2 (rank 2, decayed) in f64
        for idx in [1usize, 2] {
            let got = flat(params[idx].master.as_tensor());
            for e in [0usize, 3, got.len() - 1] {
                let (mut p, mut m, mut v) = (init[idx][e] as f64, 0.0, 0.0);
                for (t, g) in history.iter().enumerate() {
                    let gi = flat(g[idx].as_ref().unwrap())[e] as f64 * 0.25;
                    adamw_scalar(&mut p, &mut m, &mut v, gi, t as i32 + 1, &c, c.lr, idx == 2);
                }
                // f32 against f64 over 30 steps of size ~lr = 1e-2: rounding stays below 2e-6,
                // while a wrong bias correction or decay moves the result by ~1e-3.
                let err = (got[e] as f64 - p).abs();
                assert!(
                    err < 2e-6 * p.abs().max(1.0),
                    "fused={fused} p{idx}[{e}]: got {} want {p} (abs err {err:e})",
                    got[e]
                );
            }
        }
        assert!(!params[1].options.weight_decay && params[2].options.weight_decay);
    }
    Ok(())
}

#[test]
fn rank1_parameters_are_not_decayed_with_zero_gradient() -> anyhow::Result<()> {
    let c = AdamWConfig {
        lr: 0.1,
        weight_decay: 0.5,
        ..AdamWConfig::default()
    };
    let s = store(1)?;
    let params = s.params();
    let before: Vec<Vec<f32>> = params.iter().map(|p| flat(p.master.as_tensor())).collect();
    let zeros: Vec<Option<Tensor>> = params
        .iter()
        .map(|p| Some(p.master.zeros_like().unwrap()))
        .collect();
    let mut opt = AdamW::new(c, Impl::FusedCpu)?;
    opt.step(
        &params,
        &zeros,
        StepInputs::host(&GradStats::clean(1.0), 0.1),
    )?;
    assert_eq!(
        flat(params[1].master.as_tensor()),
        before[1],
        "1-D tensor must not decay"
    );
    let after = flat(params[2].master.as_tensor());
    for (a, b) in after.iter().zip(&before[2]) {
        assert!(
            (a - b * 0.95).abs() <= 1e-7,
            "2-D tensor decays by (1 - lr*wd) = 0.95"
        );
    }
    Ok(())
}
