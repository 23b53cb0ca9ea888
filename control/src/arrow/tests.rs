use super::*;
use proptest::prelude::*;
use std::collections::BTreeSet;

fn params() -> ArrowParams {
    ArrowParams::default()
}

/// An idle instance in `role` whose prefill of any prompt takes `prefill_s_each` seconds.
fn idle(id: u32, role: Role) -> InstanceLoad {
    InstanceLoad {
        instance: InstanceId(id),
        role,
        prefill_s: 0.0,
        prefill_tokens: 0,
        decode_tokens: 0,
        max_tokens: 1000,
        itl_mean_s: None,
        profile: Quadratic { a: 0.0, b: 0.0, c: 0.5 },
    }
}

fn snapshot(loads: Vec<InstanceLoad>) -> Snapshot {
    Snapshot::new(loads).expect("valid snapshot")
}

fn rel_err(got: f64, want: f64) -> f64 {
    (got - want).abs() / want.abs().max(f64::MIN_POSITIVE)
}

#[test]
fn fit_recovers_an_exact_quadratic() {
    let want = Quadratic { a: 2.5e-9, b: 1.2e-4, c: 0.018 };
    let points: Vec<(f64, f64)> = PROFILE_PROMPT_TOKENS.iter().map(|&l| (l as f64, want.eval(l as f64))).collect();
    let got = Quadratic::fit(&points).unwrap();
    for (name, g, w) in [("a", got.a, want.a), ("b", got.b, want.b), ("c", got.c, want.c)] {
        assert!(rel_err(g, w) < 1e-6, "{name}: got {g}, want {w}");
    }
    for &l in &PROFILE_PROMPT_TOKENS {
        assert!(rel_err(got.eval(l as f64), want.eval(l as f64)) < 1e-6, "T({l})");
    }
}

#[test]
fn fit_averages_noise_least_squares() {
    // Symmetric noise on repeated lengths cancels: the fit is the noiseless curve.
    let want = Quadratic { a: 1e-9, b: 2e-4, c: 0.05 };
    let mut points = Vec::new();
    for &l in &PROFILE_PROMPT_TOKENS {
        let (l, t) = (l as f64, want.eval(l as f64));
        points.push((l, t * 1.01));
        points.push((l, t * 0.99));
    }
    let got = Quadratic::fit(&points).unwrap();
    for &l in &PROFILE_PROMPT_TOKENS {
        assert!(rel_err(got.eval(l as f64), want.eval(l as f64)) < 1e-9, "T({l})");
    }
}

#[test]
fn fit_refuses_bad_points() {
    assert_eq!(Quadratic::fit(&[]), Err(ArrowError::TooFewPoints { distinct: 0 }));
    assert_eq!(
        Quadratic::fit(&[(128.0, 0.1), (128.0, 0.2), (256.0, 0.3)]),
        Err(ArrowError::TooFewPoints { distinct: 2 })
    );
    let err = Quadratic::fit(&[(128.0, 0.1), (f64::NAN, 0.2), (512.0, 0.3)]).unwrap_err();
    assert!(matches!(err, ArrowError::BadPoint { index: 1, problem: "not finite", .. }), "{err}");
    let err = Quadratic::fit(&[(128.0, 0.1), (256.0, f64::INFINITY), (512.0, 0.3)]).unwrap_err();
    assert!(matches!(err, ArrowError::BadPoint { index: 1, problem: "not finite", .. }), "{err}");
    let err = Quadratic::fit(&[(128.0, 0.1), (256.0, 0.2), (-512.0, 0.3)]).unwrap_err();
    assert!(matches!(err, ArrowError::BadPoint { index: 2, problem: "negative", .. }), "{err}");
    assert!(err.to_string().contains("point 2"), "{err}");
    // Three distinct lengths, but two of them indistinguishable once centred and scaled.
    let err = Quadratic::fit(&[(1e17, 0.1), (1e17 + 16.0, 0.2), (1e17 + 32.0, 0.3), (0.0, 0.0)]);
    assert_eq!(err, Err(ArrowError::Singular));
}

#[test]
fn max_tokens_searches_a_linear_iteration_time() {
    // 0.25 s + 0.25 s per 1024 tokens: exact in binary, so 1 s allows exactly 3072 tokens.
    let iteration = |tokens: u64| 0.25 + tokens as f64 / 1024.0 * 0.25;
    assert_eq!(max_tokens(iteration, 1.0, 1_000_000), 3072);
    assert_eq!(max_tokens(iteration, 1.0, 2000), 2000, "KV cap");
    assert_eq!(max_tokens(iteration, 1.0, 3072), 3072);
    assert_eq!(max_tokens(iteration, 1.0, 3073), 3072);
    assert_eq!(max_tokens(iteration, 0.1, 1_000_000), 0, "even one token is over the SLO");
    assert_eq!(max_tokens(iteration, 1.0, 0), 0);
    assert_eq!(max_tokens(|_| f64::NAN, 1.0, 100), 0, "a NaN time never fits");
    assert_eq!(max_tokens(|_| 0.0, 1.0, u64::MAX), u64::MAX);
}

#[test]
fn predict_ttft_follows_eq_1_and_2() {
    let p = predict_ttft(0.0, 0.0, &[(0.0, 2.0), (1.0, 2.0), (1.5, 1.0), (5.0, 1.0)]);
    assert_eq!(p.ttft_s, vec![2.0, 3.0, 3.5, 1.0]);
    assert_eq!(p.end_s, 6.0);
}

#[test]
fn predict_ttft_counts_the_running_prefill_and_time_waited() {
    // At 10 s a prefill has 1.5 s left (e_0 = 11.5); one request has waited since 9 s, the next
    // arrives at 12 s, while the first still runs (e_1 = 12.5).
    let p = predict_ttft(10.0, 1.5, &[(9.0, 1.0), (12.0, 2.0)]);
    assert_eq!(p.ttft_s, vec![3.5, 2.5]);
    assert_eq!(p.end_s, 14.5);
    let empty = predict_ttft(10.0, 1.5, &[]);
    assert_eq!((empty.ttft_s.len(), empty.end_s), (0, 11.5));
}

#[test]
fn default_params_are_valid() {
    assert_eq!(params().validate(), Ok(()));
    let zero_cooldown = ArrowParams { cooldown_s: 0.0, ..params() };
    assert_eq!(zero_cooldown.validate(), Ok(()));
}

#[test]
fn validate_names_the_bad_field() {
    let d = params();
    let table = [
        (ArrowParams { l_shrink: 0.95, ..d }, "l_shrink"),
        (ArrowParams { l_expand: f64::NAN, ..d }, "l_expand"),
        (ArrowParams { l_shrink: -0.1, ..d }, "l_shrink"),
        (ArrowParams { cooldown_s: -1.0, ..d }, "cooldown_s"),
        (ArrowParams { cooldown_s: f64::INFINITY, ..d }, "cooldown_s"),
        (ArrowParams { interval_s: -1.0, ..d }, "interval_s"),
        (ArrowParams { interval_s: f64::NAN, ..d }, "interval_s"),
        (ArrowParams { interval_s: 0.0, ..d }, "interval_s"),
        (ArrowParams { slo_ttft_s: 0.0, ..d }, "slo_ttft_s"),
        (ArrowParams { slo_ttft_s: -3.0, ..d }, "slo_ttft_s"),
        (ArrowParams { slo_tpot_s: 0.0, ..d }, "slo_tpot_s"),
        (ArrowParams { slo_tpot_s: f64::NAN, ..d }, "slo_tpot_s"),
    ];
    for (p, want) in table {
        match p.validate() {
            Err(ArrowError::InvalidParam { field, .. }) => assert_eq!(field, want, "{p:?}"),
            other => panic!("{p:?}: {other:?}"),
        }
        assert!(p.validate().unwrap_err().to_string().contains(want));
    }
}

#[test]
fn params_read_from_partial_config() {
    let p: ArrowParams = serde_json::from_str(r#"{"cooldown_s": 2.0}"#).unwrap();
    assert_eq!(p, ArrowParams { cooldown_s: 2.0, ..params() });
}

#[test]
fn roles_serialize_lowercase() {
    for (role, name) in [
        (Role::Prefill, "prefill"),
        (Role::Decode, "decode"),
        (Role::Mixed, "mixed"),
        (Role::Convertible, "convertible"),
        (Role::Standby, "standby"),
    ] {
        assert_eq!(serde_json::to_string(&role).unwrap(), format!("\"{name}\""));
        assert_eq!(serde_json::from_str::<Role>(&format!("\"{name}\"")).unwrap(), role);
    }
}

#[test]
fn loads_are_ratios_to_the_slos() {
    let p = ArrowParams { slo_ttft_s: 4.0, slo_tpot_s: 0.1, ..params() };
    let busy_prefill = InstanceLoad { prefill_s: 2.0, ..idle(0, Role::Prefill) };
    let busy_decode = InstanceLoad { itl_mean_s: Some(0.08), ..idle(1, Role::Decode) };
    assert_eq!(busy_prefill.prefill_load(&p), 0.5);
    assert!((busy_decode.decode_load(&p) - 0.8).abs() < 1e-12);
    assert_eq!(idle(2, Role::Decode).decode_load(&p), 0.0, "no token in the interval");
    // Ours: a decode batch at its token limit is loaded, however fast its tokens come.
    let full = InstanceLoad { decode_tokens: 950, itl_mean_s: Some(0.01), ..idle(5, Role::Decode) };
    assert!((full.decode_load(&p) - 0.95).abs() < 1e-12);
    let snap = snapshot(vec![
        busy_prefill,
        idle(2, Role::Prefill),
        busy_decode,
        idle(3, Role::Decode),
        // Neither pool: ignored.
        InstanceLoad { prefill_s: 100.0, itl_mean_s: Some(10.0), ..idle(4, Role::Mixed) },
    ]);
    let pools = snap.pool_loads(&p);
    assert_eq!(pools.prefill, 0.25);
    assert!((pools.decode - 0.4).abs() < 1e-12);
    assert_eq!(snapshot(vec![]).pool_loads(&p), PoolLoads { prefill: 0.0, decode: 0.0 });
}

#[test]
fn snapshot_refuses_bad_loads() {
    assert_eq!(
        Snapshot::new(vec![idle(1, Role::Prefill), idle(1, Role::Decode)]),
        Err(ArrowError::DuplicateInstance(InstanceId(1)))
    );
    let table = [
        (InstanceLoad { prefill_s: f64::NAN, ..idle(0, Role::Prefill) }, "prefill_s"),
        (InstanceLoad { prefill_s: -1.0, ..idle(0, Role::Prefill) }, "prefill_s"),
        (InstanceLoad { itl_mean_s: Some(f64::INFINITY), ..idle(0, Role::Decode) }, "itl_mean_s"),
        (InstanceLoad { profile: Quadratic { a: f64::NAN, b: 0.0, c: 0.0 }, ..idle(0, Role::Decode) }, "profile"),
    ];
    for (load, want) in table {
        assert_eq!(Snapshot::new(vec![load]), Err(ArrowError::BadLoad { instance: InstanceId(0), field: want }));
    }
}

#[test]
fn snapshot_flip_never_empties_a_pool() {
    let mut snap = snapshot(vec![idle(0, Role::Prefill), idle(1, Role::Decode), idle(2, Role::Decode)]);
    assert_eq!(
        snap.flip(InstanceId(0), Role::Decode),
        Err(ArrowError::LastInPool { instance: InstanceId(0), role: Role::Prefill })
    );
    assert_eq!(
        snap.flip(InstanceId(1), Role::Decode),
        Err(ArrowError::AlreadyInRole { instance: InstanceId(1), role: Role::Decode })
    );
    assert_eq!(snap.flip(InstanceId(9), Role::Decode), Err(ArrowError::UnknownInstance(InstanceId(9))));
    assert_eq!(snap.flip(InstanceId(1), Role::Prefill), Ok(()));
    assert_eq!(snap.get(InstanceId(1)).unwrap().role, Role::Prefill);
    assert_eq!(snap.pool(Role::Prefill).count(), 2);
}

#[test]
fn costs_compare_lexicographically() {
    let c = |decode_tokens, prefill_s| PrefillCost { decode_tokens, prefill_s };
    assert!(c(0, 3.0) < c(1, 1.0), "the first element dominates");
    assert!(c(1, 1.0) < c(1, 3.0));
    assert_eq!(c(2, 1.5), c(2, 1.5));
    let d = |prefill_tokens, over_tokens| DecodeCost { prefill_tokens, over_tokens };
    assert!(d(0, 300) < d(1, -100), "the first element dominates");
    assert!(d(1, -100) < d(1, 0));
    let f = |other_empty, work| FlipCost { other_empty, work };
    assert!(f(false, 9.0) < f(true, 0.0), "a half-finished flip goes first");
    assert!(f(true, 1.0) < f(true, 2.0));
}

#[test]
fn costs_follow_the_paper() {
    let load = InstanceLoad {
        prefill_s: 1.0,
        prefill_tokens: 300,
        decode_tokens: 700,
        max_tokens: 1000,
        profile: Quadratic { a: 0.0, b: 0.001, c: 0.1 },
        ..idle(0, Role::Prefill)
    };
    let pc = prefill_cost(&load, 1000);
    assert_eq!(pc.decode_tokens, 700);
    assert!((pc.prefill_s - 2.1).abs() < 1e-12);
    assert_eq!(decode_cost(&load, 200), DecodeCost { prefill_tokens: 300, over_tokens: -100 });
    assert_eq!(decode_cost(&load, 300), DecodeCost { prefill_tokens: 300, over_tokens: 0 });
    assert!(decode_cost(&load, 300).meets_slo());
    assert!(!decode_cost(&load, 301).meets_slo());
    let huge = InstanceLoad { decode_tokens: u64::MAX, max_tokens: 0, ..load };
    assert_eq!(decode_cost(&huge, u64::MAX).over_tokens, i64::MAX, "saturates");
    let negative = InstanceLoad { profile: Quadratic { a: 0.0, b: 0.0, c: -5.0 }, ..load };
    assert_eq!(prefill_cost(&negative, 10).prefill_s, 1.0, "T(r, i) is at least 0");
}

/// A prefill instance: (id, decode tokens on it, Σ T of its prefills).
fn p(id: u32, decode_tokens: u64, prefill_s: f64) -> InstanceLoad {
    InstanceLoad { decode_tokens, prefill_s, ..idle(id, Role::Prefill) }
}

/// A decode instance: (id, mean ITL over the last interval).
fn d(id: u32, itl_mean_s: f64) -> InstanceLoad {
    InstanceLoad { itl_mean_s: Some(itl_mean_s), decode_tokens: 100, ..idle(id, Role::Decode) }
}

#[test]
fn place_prefill_table() {
    // SLO_TTFT 3 s, each prompt's own prefill 0.5 s, decode "high" at ITL ≥ 0.9 · 0.15 s.
    let pr = params();
    let low = 0.03;
    let high = 0.14;
    // (case, loads, last flip, expected)
    type Row = (&'static str, Vec<InstanceLoad>, Option<f64>, Option<Choice>);
    let table: Vec<Row> = vec![
        (
            "lexicographic: (0, 2.5) beats (1, 0.5)",
            vec![p(0, 1, 0.0), p(1, 0, 2.0), d(2, low), d(3, low)],
            None,
            Some(Choice::Instance(InstanceId(1))),
        ),
        (
            "SLO filter: (0, 3.5) misses, (1, 1.5) meets",
            vec![p(0, 1, 1.0), p(1, 0, 3.0), d(2, low), d(3, low)],
            None,
            Some(Choice::Instance(InstanceId(0))),
        ),
        ("the SLO bound is inclusive", vec![p(0, 0, 2.5), d(2, low)], None, Some(Choice::Instance(InstanceId(0)))),
        (
            "ties: the lowest id",
            vec![p(5, 0, 1.0), p(3, 0, 1.0), d(2, low), d(4, low)],
            None,
            Some(Choice::Instance(InstanceId(3))),
        ),
        (
            "none meets, decode low: the lightest decode instance flips",
            vec![p(0, 0, 4.0), p(1, 0, 5.0), d(2, low), InstanceLoad { decode_tokens: 50, ..d(3, low) }],
            None,
            Some(Choice::Flip { instance: InstanceId(3), to_role: Role::Prefill }),
        ),
        (
            "none meets, D→P ignores the P→D cooldown",
            vec![p(0, 0, 4.0), d(2, low), d(3, low)],
            Some(0.0),
            Some(Choice::Flip { instance: InstanceId(2), to_role: Role::Prefill }),
        ),
        (
            "none meets, decode high: fallback to the lexicographic argmin",
            vec![p(0, 1, 3.0), p(1, 0, 5.0), d(2, high), d(3, high)],
            None,
            Some(Choice::Instance(InstanceId(1))),
        ),
        (
            "none meets, a decode pool of one: fallback",
            vec![p(0, 0, 4.0), p(1, 0, 5.0), d(2, low)],
            None,
            Some(Choice::Instance(InstanceId(0))),
        ),
        (
            "no prefill instance: a decode one flips",
            vec![d(2, low), d(3, low)],
            None,
            Some(Choice::Flip { instance: InstanceId(2), to_role: Role::Prefill }),
        ),
        ("no prefill instance and none can flip", vec![d(2, low)], None, None),
        (
            "other roles are never candidates",
            vec![p(0, 0, 2.0), idle(1, Role::Mixed), idle(2, Role::Convertible), idle(3, Role::Standby), d(4, low)],
            None,
            Some(Choice::Instance(InstanceId(0))),
        ),
    ];
    for (name, loads, last_flip_s, want) in table {
        let snap = snapshot(loads);
        assert_eq!(place_prefill(&snap, 1000, 3.0, last_flip_s, &pr), want, "{name}");
    }
}

/// A decode instance: (id, prompt tokens waiting for prefill on it, decode tokens, MT).
fn dd(id: u32, prefill_tokens: u64, decode_tokens: u64, max_tokens: u64) -> InstanceLoad {
    InstanceLoad { prefill_tokens, decode_tokens, max_tokens, ..idle(id, Role::Decode) }
}

#[test]
fn place_decode_table() {
    let pr = params();
    let req = |prefill: Option<u32>| DecodeRequest { tokens: 100, prefill_instance: prefill.map(InstanceId) };
    // (case, loads, request, last flip, expected)
    type Row = (&'static str, Vec<InstanceLoad>, DecodeRequest, Option<f64>, Option<Choice>);
    let table: Vec<Row> = vec![
        (
            "lexicographic: (0, −400) beats (5, −900)",
            vec![dd(0, 5, 0, 1000), dd(1, 0, 500, 1000), p(8, 0, 0.0), p(9, 0, 0.0)],
            req(None),
            None,
            Some(Choice::Instance(InstanceId(1))),
        ),
        (
            "SLO filter: (0, +100) misses, (5, −400) meets",
            vec![dd(0, 5, 500, 1000), dd(1, 0, 1000, 1000), p(8, 0, 0.0), p(9, 0, 0.0)],
            req(None),
            None,
            Some(Choice::Instance(InstanceId(0))),
        ),
        (
            "its prefill instance now decodes: no KV transfer, whatever its cost",
            vec![dd(0, 0, 0, 1000), dd(1, 7, 5000, 1000), p(8, 0, 0.0)],
            req(Some(1)),
            None,
            Some(Choice::Instance(InstanceId(1))),
        ),
        (
            "its prefill instance still prefills: the usual choice",
            vec![dd(0, 0, 0, 1000), p(8, 0, 0.0), p(9, 0, 0.0)],
            req(Some(8)),
            None,
            Some(Choice::Instance(InstanceId(0))),
        ),
        (
            "none has room: a half-finished flip is undone first",
            vec![dd(0, 0, 1000, 1000), p(8, 0, 0.0), p(9, 40, 2.0)],
            req(None),
            None,
            Some(Choice::Flip { instance: InstanceId(9), to_role: Role::Decode }),
        ),
        (
            "none has room: the lightest prefill instance flips",
            vec![dd(0, 0, 1000, 1000), p(8, 0, 1.0), p(9, 0, 0.5)],
            req(None),
            Some(0.0),
            Some(Choice::Flip { instance: InstanceId(9), to_role: Role::Decode }),
        ),
        (
            "none has room, P→D in cooldown: fallback to the argmin",
            vec![dd(0, 0, 1200, 1000), dd(1, 0, 1100, 1000), p(8, 0, 1.0), p(9, 0, 0.5)],
            req(None),
            Some(4.0),
            Some(Choice::Instance(InstanceId(1))),
        ),
        (
            "none has room, a prefill pool of one: fallback",
            vec![dd(0, 0, 1200, 1000), p(8, 0, 1.0)],
            req(None),
            None,
            Some(Choice::Instance(InstanceId(0))),
        ),
        ("no decode instance and none can flip", vec![p(8, 0, 1.0)], req(None), None, None),
    ];
    for (name, loads, request, last_flip_s, want) in table {
        let snap = snapshot(loads);
        assert_eq!(place_decode(&snap, request, 5.0, last_flip_s, &pr), want, "{name}");
    }
}

#[test]
fn expand_decode_table() {
    let pr = params();
    // (L_P, L_D, flip P→D?)
    let table = [
        (0.2, 0.5, true),
        (0.2, 0.1, false),
        (0.5, 0.95, true),
        (0.5, 0.5, false),
        (0.3, 0.3, true),
        (0.9, 0.9, true),
        (2.0, 0.89, false),
        (0.0, 0.0, false),
    ];
    for (prefill, decode, want) in table {
        assert_eq!(expand_decode(PoolLoads { prefill, decode }, &pr), want, "L_P {prefill}, L_D {decode}");
    }
}

#[test]
fn monitor_flips_the_lightest_prefill_instance() {
    let pr = params();
    // L_P = mean(0.6, 0) / 3 = 0.1 ≤ 0.3 ≤ L_D = 0.045 / 0.15 = 0.3.
    let snap = snapshot(vec![p(0, 0, 0.6), p(1, 0, 0.0), d(2, 0.045)]);
    assert_eq!(monitor(&snap, 10.0, None, &pr), Some(InstanceId(1)));
    assert_eq!(monitor(&snap, 10.0, Some(6.0), &pr), None, "cooldown");
    assert_eq!(monitor(&snap, 10.0, Some(5.0), &pr), Some(InstanceId(1)), "cooldown over");
    let quiet = snapshot(vec![p(0, 0, 0.6), p(1, 0, 0.0), d(2, 0.01)]);
    assert_eq!(monitor(&quiet, 10.0, None, &pr), None, "decode idle");
    let one = snapshot(vec![p(0, 0, 0.0), d(2, 0.2)]);
    assert_eq!(monitor(&one, 10.0, None, &pr), None, "a pool of one");
}

#[test]
fn cooldown_blocks_p2d_but_not_d2p() {
    let pr = params();
    let snap = snapshot(vec![p(0, 0, 0.0), p(1, 0, 0.0), d(2, 0.01), d(3, 0.01)]);
    let p2d = |now| choose_flip(&snap, Direction::PrefillToDecode, now, Some(0.0), &pr);
    let d2p = |now| choose_flip(&snap, Direction::DecodeToPrefill, now, Some(0.0), &pr);
    assert_eq!(p2d(3.0), Err(FlipRefusal::Cooldown { left_s: 2.0 }));
    assert_eq!(d2p(3.0), Ok(InstanceId(2)));
    assert_eq!(p2d(5.0), Ok(InstanceId(0)));
    assert_eq!(choose_flip(&snap, Direction::PrefillToDecode, 3.0, None, &pr), Ok(InstanceId(0)));
}

#[test]
fn a_pool_of_one_is_never_flipped_away() {
    let pr = params();
    let snap = snapshot(vec![p(0, 0, 0.0), d(1, 0.01), idle(2, Role::Standby)]);
    for direction in [Direction::PrefillToDecode, Direction::DecodeToPrefill] {
        let role = direction.from_role();
        assert_eq!(
            choose_flip(&snap, direction, 100.0, None, &pr),
            Err(FlipRefusal::PoolTooSmall { role, size: 1 }),
            "{direction:?}"
        );
    }
    let none = snapshot(vec![d(1, 0.01), d(2, 0.01)]);
    assert_eq!(
        choose_flip(&none, Direction::PrefillToDecode, 100.0, None, &pr),
        Err(FlipRefusal::PoolTooSmall { role: Role::Prefill, size: 0 })
    );
}

#[test]
fn d2p_is_aborted_while_decode_load_is_high() {
    let pr = params();
    let snap = snapshot(vec![p(0, 0, 9.0), d(1, 0.14), d(2, 0.14)]);
    assert_eq!(choose_flip(&snap, Direction::DecodeToPrefill, 0.0, None, &pr), Err(FlipRefusal::DecodeLoadHigh));
    // P→D proceeds without a prefill load check.
    let snap = snapshot(vec![p(0, 0, 90.0), p(3, 0, 90.0), d(1, 0.14)]);
    assert_eq!(choose_flip(&snap, Direction::PrefillToDecode, 0.0, None, &pr), Ok(InstanceId(0)));
}

#[test]
fn half_finished_flips_are_undone_first() {
    let pr = params();
    // Instance 1 was a decode instance flipped to prefill and still decodes: it goes back first,
    // though it has more prefill work than instance 0.
    let snap = snapshot(vec![p(0, 0, 0.1), p(1, 200, 2.0), p(2, 0, 0.0), d(3, 0.01)]);
    assert_eq!(choose_flip(&snap, Direction::PrefillToDecode, 0.0, None, &pr), Ok(InstanceId(1)));
    // Instance 4 was a prefill instance flipped to decode and still prefills.
    let busy = InstanceLoad { decode_tokens: 10, ..idle(3, Role::Decode) };
    let draining =
        InstanceLoad { decode_tokens: 5000, prefill_tokens: 64, max_tokens: 100_000, ..idle(4, Role::Decode) };
    let snap = snapshot(vec![p(0, 0, 0.0), busy, draining]);
    assert_eq!(choose_flip(&snap, Direction::DecodeToPrefill, 0.0, None, &pr), Ok(InstanceId(4)));
    assert_eq!(flip_cost(&draining, Direction::DecodeToPrefill), FlipCost { other_empty: false, work: 5000.0 });
}

/// One step of a random run: time passes, loads change, then one of Arrow's decisions.
#[derive(Clone, Debug)]
struct Step {
    dt_s: f64,
    /// 0: Alg. 2's monitor, 1: a prefill request, 2: a decode request.
    kind: u8,
    /// Per instance: (Σ T, prefill tokens, decode tokens, MT, ITL).
    loads: Vec<(f64, u64, u64, u64, f64)>,
    tokens: u64,
    prefill_instance: u32,
}

fn step(n: usize) -> impl Strategy<Value = Step> {
    let load = (0.0..8.0f64, 0..3u64, 0..3u64, 0..3u64, 0.0..0.3f64)
        .prop_map(|(s, pt, dt, mt, itl)| (s, pt * 500, dt * 800, mt * 1000, itl));
    (0.0..4.0f64, 0..3u8, prop::collection::vec(load, n), 1..4000u64, 0..n as u32)
        .prop_map(|(dt_s, kind, loads, tokens, prefill_instance)| Step { dt_s, kind, loads, tokens, prefill_instance })
}

fn run() -> impl Strategy<Value = (usize, usize, Vec<Step>)> {
    (2..7usize).prop_flat_map(|n| (Just(n), 1..n, prop::collection::vec(step(n + 1), 1..40)))
}

proptest! {
    #[test]
    fn flips_never_empty_a_pool_nor_share_an_instance((n, n_prefill, steps) in run()) {
        let pr = params();
        // Instances 0..n_prefill prefill, n_prefill..n decode, n is on standby throughout.
        let mut prefill: BTreeSet<u32> = (0..n_prefill as u32).collect();
        let mut decode: BTreeSet<u32> = (n_prefill as u32..n as u32).collect();
        let standby = n as u32;
        let (mut now_s, mut last_flip_s) = (0.0, None::<f64>);
        for s in steps {
            now_s += s.dt_s;
            let loads = s.loads.iter().enumerate().map(|(i, &(prefill_s, pt, dt, mt, itl))| {
                let id = i as u32;
                let role = if prefill.contains(&id) {
                    Role::Prefill
                } else if decode.contains(&id) {
                    Role::Decode
                } else {
                    Role::Standby
                };
                InstanceLoad {
                    prefill_s, prefill_tokens: pt, decode_tokens: dt, max_tokens: mt, itl_mean_s: Some(itl),
                    ..idle(id, role)
                }
            }).collect();
            let mut snap = Snapshot::new(loads).unwrap();
            let flip = match s.kind {
                0 => monitor(&snap, now_s, last_flip_s, &pr).map(|i| (i, Role::Decode)),
                1 => match place_prefill(&snap, s.tokens, now_s, last_flip_s, &pr) {
                    Some(Choice::Flip { instance, to_role }) => Some((instance, to_role)),
                    Some(Choice::Instance(i)) => {
                        prop_assert!(prefill.contains(&i.0), "prefill placed on {i}");
                        None
                    }
                    None => None,
                },
                _ => {
                    let request = DecodeRequest { tokens: s.tokens, prefill_instance: Some(InstanceId(s.prefill_instance)) };
                    match place_decode(&snap, request, now_s, last_flip_s, &pr) {
                        Some(Choice::Flip { instance, to_role }) => Some((instance, to_role)),
                        Some(Choice::Instance(i)) => {
                            prop_assert!(decode.contains(&i.0), "decode placed on {i}");
                            None
                        }
                        None => None,
                    }
                }
            };
            if let Some((instance, to_role)) = flip {
                let (from, to) = match to_role {
                    Role::Decode => {
                        if let Some(last) = last_flip_s {
                            prop_assert!(now_s - last >= pr.cooldown_s, "P→D in cooldown");
                        }
                        (&mut prefill, &mut decode)
                    }
                    Role::Prefill => (&mut decode, &mut prefill),
                    other => return Err(TestCaseError::fail(format!("flip to {other}"))),
                };
                prop_assert!(instance.0 != standby, "standby instance flipped");
                prop_assert!(from.remove(&instance.0), "{instance} flipped from a pool it is not in");
                prop_assert!(to.insert(instance.0), "{instance} already in the target pool");
                prop_assert_eq!(snap.flip(instance, to_role), Ok(()));
                last_flip_s = Some(now_s);
            }
            prop_assert!(!prefill.is_empty() && !decode.is_empty(), "a pool emptied");
            prop_assert!(prefill.is_disjoint(&decode), "an instance in both pools");
            prop_assert_eq!(prefill.len() + decode.len(), n);
            prop_assert_eq!(snap.pool(Role::Prefill).count(), prefill.len());
            prop_assert_eq!(snap.pool(Role::Decode).count(), decode.len());
        }
    }
}
