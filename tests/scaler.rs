//! The loss scaler's state machine against hand-computed sequences (torch.amp.GradScaler's
//! `_amp_update_scale_` semantics, DeepSpeed-style hysteresis).

use wick::scaler::{ScalerKind, ScalerState};
use wick::{LossScaler, Precision, ScalerConfig};

fn dynamic(growth_interval: u32) -> LossScaler {
    LossScaler::new(ScalerConfig {
        growth_interval,
        ..ScalerConfig::default()
    })
    .unwrap()
}

#[test]
fn defaults_follow_gradscaler() {
    let c = ScalerConfig::default_for(Precision::F16Mixed);
    assert_eq!(c.kind, ScalerKind::Dynamic);
    assert_eq!(
        (
            c.init_scale,
            c.growth_factor,
            c.backoff_factor,
            c.growth_interval
        ),
        (65536.0, 2.0, 0.5, 2000)
    );
    assert_eq!(
        ScalerConfig::default_for(Precision::Bf16Mixed).kind,
        ScalerKind::None
    );
    assert_eq!(
        ScalerConfig::default_for(Precision::Fp32).kind,
        ScalerKind::None
    );
    assert_eq!(
        LossScaler::new(ScalerConfig::default_for(Precision::Bf16Mixed))
            .unwrap()
            .scale(),
        1.0
    );
}

#[test]
fn backoff_then_growth_at_the_interval() {
    let mut s = dynamic(3);
    // overflow: 65536 -> 32768, tracker reset
    s.update(true);
    assert_eq!(
        s.state(),
        ScalerState {
            scale: 32768.0,
            growth_tracker: 0,
            hysteresis_left: 1
        }
    );
    // two clean steps: no growth yet
    s.update(false);
    s.update(false);
    assert_eq!((s.scale(), s.state().growth_tracker), (32768.0, 2));
    // an overflow resets the tracker
    s.update(true);
    assert_eq!((s.scale(), s.state().growth_tracker), (16384.0, 0));
    // three clean steps: growth x2 at the third
    for _ in 0..3 {
        s.update(false);
    }
    assert_eq!((s.scale(), s.state().growth_tracker), (32768.0, 0));
}

#[test]
fn growth_is_capped_before_overflow_and_by_max_scale() {
    // 2^127 * 2 = inf in f32: growth must not happen
    let mut s = LossScaler::new(ScalerConfig {
        init_scale: 2f32.powi(127),
        growth_interval: 1,
        ..ScalerConfig::default()
    })
    .unwrap();
    s.update(false);
    assert_eq!(s.scale(), 2f32.powi(127));
    assert_eq!(s.state().growth_tracker, 0);
    let mut s = LossScaler::new(ScalerConfig {
        growth_interval: 1,
        max_scale: 100_000.0,
        ..ScalerConfig::default()
    })
    .unwrap();
    s.update(false);
    assert_eq!(s.scale(), 100_000.0);
    let mut s = LossScaler::new(ScalerConfig {
        init_scale: 4.0,
        min_scale: 2.0,
        ..ScalerConfig::default()
    })
    .unwrap();
    s.update(true);
    s.update(true);
    assert_eq!(s.scale(), 2.0, "min_scale bounds the backoff");
}

#[test]
fn thousand_growth_steps_on_a_tiny_loss_stay_finite() {
    let mut s = LossScaler::new(ScalerConfig {
        init_scale: 1.0,
        growth_interval: 1,
        ..ScalerConfig::default()
    })
    .unwrap();
    let tiny_loss = 1e-30f32;
    for i in 0..1000 {
        s.update(false);
        assert!(s.scale().is_finite(), "scale became non-finite at step {i}");
        assert!((tiny_loss * s.scale()).is_finite());
    }
    assert_eq!(
        s.scale(),
        2f32.powi(127),
        "growth stops at the largest finite power of two"
    );
}

#[test]
fn hysteresis_tolerates_overflows_before_backing_off() {
    let mut s = LossScaler::new(ScalerConfig {
        hysteresis: 2,
        growth_interval: 2,
        ..ScalerConfig::default()
    })
    .unwrap();
    s.update(true); // first overflow tolerated
    assert_eq!(s.scale(), 65536.0);
    s.update(true); // second backs off
    assert_eq!(s.scale(), 32768.0);
    // DeepSpeed: a backoff does not refill hysteresis, so the next overflow backs off too
    // (issue 14, item 8; the earlier assertion here encoded the refill)
    s.update(true);
    assert_eq!(s.scale(), 16384.0);
    s.update(false);
    s.update(false); // growth restores hysteresis
    assert_eq!(
        s.state(),
        ScalerState {
            scale: 32768.0,
            growth_tracker: 0,
            hysteresis_left: 2
        }
    );
}

#[test]
fn static_and_none_never_change_and_bad_configs_are_errors() {
    let mut s = LossScaler::new(ScalerConfig {
        kind: ScalerKind::Static(128.0),
        ..ScalerConfig::default()
    })
    .unwrap();
    s.update(true);
    s.update(false);
    assert_eq!(s.scale(), 128.0);
    for bad in [
        ScalerConfig {
            backoff_factor: 1.5,
            ..ScalerConfig::default()
        },
        ScalerConfig {
            growth_factor: 1.0,
            ..ScalerConfig::default()
        },
        ScalerConfig {
            init_scale: f32::INFINITY,
            ..ScalerConfig::default()
        },
        ScalerConfig {
            growth_interval: 0,
            ..ScalerConfig::default()
        },
    ] {
        assert!(LossScaler::new(bad).is_err());
    }
}
