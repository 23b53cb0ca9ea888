//! Capacity finder: the arrival rate at which a config's steady-state KV demand meets its GPU KV,
//! and the sweep rates around it.
//!
//! The model is Little's law per instance, arrivals spread evenly over the instances, at a
//! per-instance rate λ:
//! - a request sits in the batch for `o` iterations (its prefill produces the first of its `o`
//!   output tokens) and in the `j`-th (j = 1..=o) holds the blocks of `p + j` tokens, as the engine
//!   allocates them; so the batch holds `B = λ·T·E[o]` sequences (`λ·T` prefills, the rest decodes)
//!   and the KV held is `λ·T·E[Σ_j blocks(p + j)]·block_bytes`;
//! - `T = T(B)` is the timing model's iteration for that batch (decodes at the token-weighted mean
//!   context, prefills of the mean prompt; fractional counts interpolate between whole shapes), and
//!   `B` is the least fixed point of `B ↦ λ·E[o]·T(max(B, 1))`, iterated from 0 and capped at
//!   `max_num_seqs`;
//! - the capacity is the λ × instances where that KV equals an instance's GPU KV, found by
//!   bisection (the KV held grows with λ). Should the batch reach `max_num_seqs` first (or the
//!   iteration time outgrow the batch: compute-bound), the rate where it does is the capacity
//!   instead ([`CapacityLimit::Batch`]).
//!
//! Not modelled: queueing (a waiting request holds no KV), preemption and migration costs,
//! burstiness, uneven placement, `max_batched_tokens`. The rate is the centre of a sweep
//! ([`rates_around`]), not a verdict.

use crate::config::SimConfig;
use crate::SimError;
use kvfleet_core::request::RequestSpec;
use kvfleet_core::timing::{BatchShape, TimingModel};
use kvfleet_core::workload::{generate, ArrivalConfig, WorkloadConfig};
use std::path::Path;

/// Most requests [`capacity`] samples from a workload to estimate its length moments.
pub const SAMPLE_REQUESTS: usize = 20_000;

/// The sweep around the capacity that the project's PASCAL reproduction uses (× the capacity).
pub const SWEEP_FACTORS: [f64; 5] = [0.85, 0.95, 1.0, 1.05, 1.1];

/// Fixed-point iterations on the batch before falling back to bisection.
const FIXED_POINT_ITERATIONS: usize = 1_000;
/// Halvings/doublings of the rate while bracketing the capacity, and bisection steps.
const RATE_STEPS: usize = 200;
/// Relative tolerance of both solvers.
const TOLERANCE: f64 = 1e-12;

/// What bounds the capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CapacityLimit {
    /// The KV held reaches the instance's GPU KV.
    Kv,
    /// The batch reaches `max_num_seqs` (or the iteration time grows faster than the batch) before
    /// the KV fills.
    Batch,
}

/// The capacity of a config and what explains it.
#[derive(Clone, Debug, PartialEq)]
pub struct Capacity {
    /// Cluster arrival rate at capacity, requests/s.
    pub rate_rps: f64,
    /// Which bound meets first.
    pub limit: CapacityLimit,
    /// Serving instances (the rate is spread evenly over them).
    pub instances: u32,
    /// GPU KV of the whole cluster, bytes (`gpu_blocks × block_bytes × instances`).
    pub kv_bytes_cluster: u64,
    /// KV the cluster holds at capacity, bytes (≈ `kv_bytes_cluster` when the limit is [`CapacityLimit::Kv`]).
    pub kv_bytes_held: f64,
    /// Mean KV byte-seconds per request at the capacity rate (Little's law: held = rate × this).
    pub mean_kv_byte_seconds: f64,
    /// Mean sequences in an instance's batch at capacity (prefills and decodes).
    pub batch_per_instance: f64,
    /// Iteration time at that batch, seconds.
    pub iteration_s: f64,
    /// Mean output (reasoning + answer) tokens per request: iterations a request spends in the batch.
    pub mean_output_tokens: f64,
    /// Requests the length moments were estimated from.
    pub requests_sampled: usize,
}

/// A workload's length moments as the solver uses them, per request.
#[derive(Clone, Debug, PartialEq)]
pub struct KvDemand {
    /// Requests the means come from.
    pub requests: usize,
    /// E[output tokens]: iterations a request spends in the batch.
    pub output_tokens: f64,
    /// E[Σ over a request's iterations of the KV bytes it holds] (whole blocks).
    pub kv_byte_iterations: f64,
    /// Token-weighted mean context of a decode, counting the token being produced.
    pub decode_context_tokens: f64,
    /// E[prompt tokens].
    pub prompt_tokens: f64,
    /// E[prompt tokens²].
    pub prompt_tokens_sq: f64,
    /// The most KV one request holds (at its last token), bytes.
    pub max_request_kv_bytes: u64,
}

/// Σ_{j=1..=n} ⌈j / bs⌉: block-iterations of a sequence growing one token per iteration to `n`.
fn block_prefix_sum(n: u64, bs: u64) -> u64 {
    let (q, r) = (n / bs, n % bs);
    bs * q * (q + 1) / 2 + r * (q + 1)
}

impl KvDemand {
    /// The moments of `requests` on an engine with `block_size`-token blocks of
    /// `kv_bytes_per_token` bytes per token.
    pub fn from_requests(
        requests: &[RequestSpec],
        block_size: u32,
        kv_bytes_per_token: u64,
    ) -> Result<KvDemand, SimError> {
        if requests.is_empty() {
            return Err(SimError::Setup("capacity: the workload has no requests to sample lengths from".into()));
        }
        if block_size == 0 || kv_bytes_per_token == 0 {
            return Err(SimError::Setup("capacity: block size and KV bytes per token must be > 0".into()));
        }
        let bs = u64::from(block_size);
        let block_bytes = bs as f64 * kv_bytes_per_token as f64;
        let (mut out, mut blocks, mut decodes, mut decode_ctx, mut p1, mut p2) = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
        let mut max_blocks = 0u64;
        for r in requests {
            let (p, o) = (u64::from(r.prompt_tokens.max(1)), u64::from(r.output_tokens().max(1)));
            out += o as f64;
            blocks += (block_prefix_sum(p + o, bs) - block_prefix_sum(p, bs)) as f64;
            max_blocks = max_blocks.max((p + o).div_ceil(bs));
            // Decode j = 1..o-1 runs with context p + j + 1 (`BatchShape::add_decode(context + 1)`).
            let d = (o - 1) as f64;
            decodes += d;
            decode_ctx += d * (p + 1) as f64 + d * (d + 1.0) / 2.0;
            p1 += p as f64;
            p2 += (p * p) as f64;
        }
        let n = requests.len() as f64;
        let mean_prompt = p1 / n;
        Ok(KvDemand {
            requests: requests.len(),
            output_tokens: out / n,
            kv_byte_iterations: blocks * block_bytes / n,
            decode_context_tokens: if decodes > 0.0 { decode_ctx / decodes } else { mean_prompt },
            prompt_tokens: mean_prompt,
            prompt_tokens_sq: p2 / n,
            max_request_kv_bytes: max_blocks.saturating_mul(bs * kv_bytes_per_token),
        })
    }
}

/// One instance in steady state at a rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InstancePoint {
    /// Per-instance arrival rate, requests/s.
    pub rate_rps: f64,
    /// Mean sequences in the batch.
    pub batch: f64,
    /// Iteration time at that batch, seconds.
    pub iteration_s: f64,
    /// KV held, bytes.
    pub kv_bytes_held: f64,
    /// Whether the batch has no fixed point below `max_num_seqs` (the instance cannot keep up).
    pub saturated: bool,
}

/// The steady state of one instance at per-instance rate `rate` (see the module doc);
/// `iteration_s(decodes, prefills)` is the iteration time of a batch with those (fractional) counts.
pub fn instance_point(
    demand: &KvDemand,
    max_num_seqs: u32,
    rate: f64,
    iteration_s: &impl Fn(f64, f64) -> f64,
) -> Result<InstancePoint, SimError> {
    let eo = demand.output_tokens;
    let cap = f64::from(max_num_seqs);
    // A request always shares its iteration with itself: the batch it sees is at least one.
    let t_of = |b: f64| -> Result<f64, SimError> {
        let b = b.max(1.0);
        let t = iteration_s(b * (1.0 - 1.0 / eo), b / eo);
        if t.is_finite() && t > 0.0 {
            Ok(t)
        } else {
            Err(SimError::Setup(format!(
                "capacity: the timing model gives an iteration time of {t} s for a batch of {b:.1}; it must be positive and finite"
            )))
        }
    };
    let map = |b: f64| -> Result<f64, SimError> { Ok(rate * eo * t_of(b)?) };
    let point = |b: f64, saturated: bool| -> Result<InstancePoint, SimError> {
        let t = t_of(b)?;
        Ok(InstancePoint {
            rate_rps: rate,
            batch: b,
            iteration_s: t,
            kv_bytes_held: rate * t * demand.kv_byte_iterations,
            saturated,
        })
    };
    // From 0 the iterates rise monotonically to the least fixed point (the map grows with B).
    let mut b = 0.0;
    for _ in 0..FIXED_POINT_ITERATIONS {
        let next = map(b)?;
        if next >= cap {
            return point(cap, true);
        }
        if (next - b).abs() <= TOLERANCE * next.max(1.0) {
            return point(next, false);
        }
        b = next;
    }
    // Slow convergence (near the compute-bound edge): bisect B − map(B) on [b, cap].
    if map(cap)? >= cap {
        return point(cap, true);
    }
    let (mut lo, mut hi) = (b, cap);
    for _ in 0..RATE_STEPS {
        let mid = 0.5 * (lo + hi);
        if map(mid)? > mid {
            lo = mid;
        } else {
            hi = mid;
        }
        if hi - lo <= TOLERANCE * hi.max(1.0) {
            break;
        }
    }
    point(hi, false)
}

/// The per-instance capacity: the largest rate whose steady state neither holds `kv_bytes` of KV
/// nor saturates the batch, and which bound meets there.
pub fn instance_capacity(
    demand: &KvDemand,
    kv_bytes: u64,
    max_num_seqs: u32,
    iteration_s: impl Fn(f64, f64) -> f64,
) -> Result<(InstancePoint, CapacityLimit), SimError> {
    let kv = kv_bytes as f64;
    for (what, v) in [
        ("mean output tokens", demand.output_tokens),
        ("mean KV byte-iterations", demand.kv_byte_iterations),
        ("mean decode context", demand.decode_context_tokens),
        ("mean prompt tokens", demand.prompt_tokens),
        ("mean squared prompt tokens", demand.prompt_tokens_sq),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return Err(SimError::Setup(format!(
                "capacity: the workload's {what} is {v}; it must be positive and finite"
            )));
        }
    }
    if demand.output_tokens < 1.0 || kv_bytes == 0 || max_num_seqs == 0 {
        return Err(SimError::Setup(
            "capacity: needs at least one output token per request, some GPU KV and max_num_seqs > 0".into(),
        ));
    }
    if demand.max_request_kv_bytes > kv_bytes {
        return Err(SimError::Setup(format!(
            "capacity: the largest sampled request holds {:.3} GB of KV at its last token, more than an instance's \
             {:.3} GB of GPU KV, so no rate fits it (cap `workload.max_prompt_tokens` / `max_output_tokens`, or give \
             instances more KV)",
            demand.max_request_kv_bytes as f64 / 1e9,
            kv / 1e9
        )));
    }
    let over = |p: &InstancePoint| p.saturated || p.kv_bytes_held >= kv;
    let at = |rate: f64| instance_point(demand, max_num_seqs, rate, &iteration_s);
    // First guess: the rate that fills the KV if iterations stayed as short as a lone request's.
    let t1 = at(0.0)?.iteration_s;
    let guess = kv / (t1 * demand.kv_byte_iterations);
    if !(guess.is_finite() && guess > 0.0) {
        return Err(SimError::Setup(format!(
            "capacity: cannot bracket the rate where KV fills: a lone request's iteration of {t1:e} s gives a \
             starting rate of {guess} req/s per instance"
        )));
    }
    let (mut lo, mut hi) = (guess, guess);
    let mut bracketed = false;
    if over(&at(guess)?) {
        for _ in 0..RATE_STEPS {
            lo *= 0.5;
            if !over(&at(lo)?) {
                bracketed = true;
                break;
            }
            hi = lo;
        }
    } else {
        for _ in 0..RATE_STEPS {
            hi *= 2.0;
            if !hi.is_finite() {
                break;
            }
            if over(&at(hi)?) {
                bracketed = true;
                break;
            }
            lo = hi;
        }
    }
    if !bracketed {
        return Err(SimError::Setup(format!(
            "capacity: cannot bracket the rate where KV fills or the batch saturates (searched {lo:.3e} to {hi:.3e} \
             req/s per instance); the timing model or the lengths are degenerate"
        )));
    }
    for _ in 0..RATE_STEPS {
        if hi - lo <= TOLERANCE * hi {
            break;
        }
        let mid = 0.5 * (lo + hi);
        if over(&at(mid)?) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    let p = at(lo)?;
    let limit = if p.kv_bytes_held >= kv * (1.0 - 1e-6) { CapacityLimit::Kv } else { CapacityLimit::Batch };
    Ok((p, limit))
}

/// The iteration time of `decodes` decodes and `prefills` prefills (fractional: the bilinear
/// interpolation of the four whole shapes around them) at the demand's mean context and prompt.
fn expected_iteration_s(timing: &dyn TimingModel, demand: &KvDemand, decodes: f64, prefills: f64) -> f64 {
    let split = |x: f64| {
        let whole = x.floor();
        [(whole, 1.0 - (x - whole)), (whole + 1.0, x - whole)]
    };
    let mut t = 0.0;
    for (d, wd) in split(decodes) {
        for (p, wp) in split(prefills) {
            if wd * wp == 0.0 {
                continue;
            }
            let shape = BatchShape {
                decode_seqs: d as u32,
                decode_context_tokens: (d * demand.decode_context_tokens).round() as u64,
                prefill_seqs: p as u32,
                prefill_tokens: (p * demand.prompt_tokens).round() as u64,
                prefill_tokens_sq: (p * demand.prompt_tokens_sq).round() as u64,
            };
            t += wd * wp * timing.iteration(&shape).as_secs_f64();
        }
    }
    t
}

/// Up to [`SAMPLE_REQUESTS`] requests of the config's length distribution. Synthetic arrivals draw
/// a full sample whatever `num_requests` says (lengths come from their own random stream, so the
/// config's own requests are its first ones); traces give their first requests.
fn sample_requests(workload: &WorkloadConfig, base_dir: &Path) -> Result<Vec<RequestSpec>, SimError> {
    let mut w = workload.clone();
    if let ArrivalConfig::Steps { .. } = w.arrivals {
        // lengths do not depend on when requests arrive: sample them from an unbounded process
        w.arrivals = ArrivalConfig::Poisson { rate: 1.0 };
    }
    if matches!(w.arrivals, ArrivalConfig::Poisson { .. } | ArrivalConfig::Gamma { .. }) {
        w.num_requests = Some(SAMPLE_REQUESTS as u64);
        w.duration_s = None;
    }
    let mut requests = generate(&w, base_dir).map_err(|e| SimError::Workload(e.to_string()))?;
    requests.truncate(SAMPLE_REQUESTS);
    Ok(requests)
}

/// The rate at which `cfg`'s steady-state KV demand meets its GPU KV (see the module doc).
/// Relative paths in the config resolve against `base_dir`, as for [`crate::run_one`].
pub fn capacity(cfg: &SimConfig, base_dir: &Path) -> Result<Capacity, SimError> {
    let (model, gpu) = cfg.specs()?;
    let engine = cfg.engine_config(&model, &gpu)?;
    let timing = crate::timing_model(cfg, base_dir)?;
    let requests = sample_requests(&cfg.workload, base_dir)?;
    let demand = KvDemand::from_requests(&requests, engine.block_size, engine.kv_bytes_per_token)?;
    let kv_bytes = u64::from(engine.gpu_blocks) * engine.block_bytes();
    let (p, limit) = instance_capacity(&demand, kv_bytes, engine.max_num_seqs, |d, pf| {
        expected_iteration_s(timing.as_ref(), &demand, d, pf)
    })?;
    let instances = cfg.cluster.instances;
    Ok(Capacity {
        rate_rps: p.rate_rps * f64::from(instances),
        limit,
        instances,
        kv_bytes_cluster: kv_bytes * u64::from(instances),
        kv_bytes_held: p.kv_bytes_held * f64::from(instances),
        mean_kv_byte_seconds: p.iteration_s * demand.kv_byte_iterations,
        batch_per_instance: p.batch,
        iteration_s: p.iteration_s,
        mean_output_tokens: demand.output_tokens,
        requests_sampled: demand.requests,
    })
}

/// Sweep rates `capacity_rps × factor`, rounded to 2 decimals, in the factors' order with
/// repeats (after rounding) dropped.
pub fn rates_around(capacity_rps: f64, factors: &[f64]) -> Result<Vec<f64>, SimError> {
    if !(capacity_rps.is_finite() && capacity_rps > 0.0) {
        return Err(SimError::Setup(format!("capacity must be a positive rate, got {capacity_rps}")));
    }
    if factors.is_empty() {
        return Err(SimError::Setup("capacity sweep: no factors given".into()));
    }
    let mut rates = Vec::with_capacity(factors.len());
    for &f in factors {
        if !(f.is_finite() && f > 0.0) {
            return Err(SimError::Setup(format!("capacity sweep: factors must be positive, got {f}")));
        }
        let r = (capacity_rps * f * 100.0).round() / 100.0;
        if r <= 0.0 {
            return Err(SimError::Setup(format!(
                "capacity sweep: {capacity_rps} req/s × {f} rounds to 0 req/s at 2 decimals"
            )));
        }
        if !rates.contains(&r) {
            rates.push(r);
        }
    }
    Ok(rates)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::ids::RequestId;
    use kvfleet_core::time::Timestamp;

    fn req(prompt: u32, reasoning: u32, answer: u32) -> RequestSpec {
        RequestSpec {
            content_ids: Vec::new(),
            id: RequestId(0),
            arrival: Timestamp::ZERO,
            prompt_tokens: prompt,
            reasoning_tokens: reasoning,
            answer_tokens: answer,
        }
    }

    const BYTES_PER_TOKEN: u64 = 1000;

    /// Two requests, one-token blocks: E[Σ_j (p + j)] = E[o·p + o(o+1)/2] by hand.
    fn two_requests() -> KvDemand {
        let d = KvDemand::from_requests(&[req(100, 30, 20), req(300, 100, 50)], 1, BYTES_PER_TOKEN).unwrap();
        // (100, 50): 5000 + 1275 = 6275; (300, 150): 45000 + 11325 = 56325; mean 31300 token-iterations.
        assert_eq!(d.kv_byte_iterations, 31_300.0 * BYTES_PER_TOKEN as f64);
        assert_eq!(d.output_tokens, 100.0);
        d
    }

    fn close(got: f64, want: f64, rel: f64) -> bool {
        (got - want).abs() <= rel * want.abs()
    }

    #[test]
    fn capacity_constant_iteration_matches_closed_form() {
        let d = two_requests();
        let (t, kv) = (0.05, 100_000_000u64);
        let (p, limit) = instance_capacity(&d, kv, 1024, |_, _| t).unwrap();
        // KV = λ·T·E[Σ(p + j)]·bytes → λ* = KV / (T·E[…]·bytes); B = λ*·E[o]·T.
        let want = kv as f64 / (t * 31_300.0 * BYTES_PER_TOKEN as f64);
        assert!(close(p.rate_rps, want, 0.01), "{} vs {want}", p.rate_rps);
        assert!(close(p.batch, want * 100.0 * t, 0.01), "{} vs {}", p.batch, want * 100.0 * t);
        assert_eq!(limit, CapacityLimit::Kv);
    }

    #[test]
    fn capacity_affine_iteration_matches_closed_form() {
        // T = a + s_d·decodes + s_p·prefills, with B(1 − 1/E[o]) decodes and B/E[o] prefills:
        // T = a + s·B, s = s_d(1 − 1/E[o]) + s_p/E[o]. B = λ·E[o]·T gives T = a / (1 − λ·E[o]·s),
        // and KV = λ·T·K = C gives λ* = C / (K·a + C·E[o]·s).
        let d = two_requests();
        let (a, s_d, s_p, c) = (0.02, 0.0004, 0.1, 100_000_000f64);
        let (k, eo) = (d.kv_byte_iterations, 100.0);
        let s = s_d * (1.0 - 1.0 / eo) + s_p / eo;
        let (p, limit) = instance_capacity(&d, c as u64, 4096, |dec, pre| a + s_d * dec + s_p * pre).unwrap();
        let want = c / (k * a + c * eo * s);
        assert!(close(p.rate_rps, want, 0.01), "{} vs {want}", p.rate_rps);
        assert!(close(p.iteration_s, a / (1.0 - want * eo * s), 0.01));
        assert_eq!(limit, CapacityLimit::Kv);
    }

    #[test]
    fn capacity_compute_bound_edge_converges() {
        // T = a + s·B with KV to spare: the batch reaches max_num_seqs = N at
        // λ = N / (E[o]·(a + s·N)), just below 1 / (E[o]·s) where B diverges. There the fixed
        // point converges too slowly to iterate, and the bisection on B takes over.
        let d = two_requests();
        let (a, s, n) = (0.02, 0.0004, 100_000u32);
        let (p, limit) = instance_capacity(&d, u64::MAX, n, |dec, pre| a + s * (dec + pre)).unwrap();
        let want = f64::from(n) / (100.0 * (a + s * f64::from(n)));
        assert_eq!(limit, CapacityLimit::Batch);
        assert!(close(p.rate_rps, want, 1e-4), "{} vs {want}", p.rate_rps);
        assert!(p.batch > 0.9 * f64::from(n), "{}", p.batch);
    }

    #[test]
    fn capacity_batch_limit_when_kv_never_fills() {
        let d = two_requests();
        // 10 GB of KV, 64 sequences of ≤ 450 tokens at 1 KB: the batch saturates at λ = 64 / (E[o]·T).
        let (p, limit) = instance_capacity(&d, 10_000_000_000, 64, |_, _| 0.05).unwrap();
        assert_eq!(limit, CapacityLimit::Batch);
        assert!(close(p.rate_rps, 64.0 / (100.0 * 0.05), 0.01), "{}", p.rate_rps);
    }

    #[test]
    fn capacity_block_rounding_counts_whole_blocks() {
        // 16-token blocks: a 1-token prompt with 16 outputs holds blocks ⌈(1 + j)/16⌉, j = 1..=16:
        // 15 × 1 + 1 × 2 = 17 blocks.
        let d = KvDemand::from_requests(&[req(1, 0, 16)], 16, 1).unwrap();
        assert_eq!(d.kv_byte_iterations, 17.0 * 16.0);
        assert_eq!(d.max_request_kv_bytes, 2 * 16);
        for bs in [1u64, 3, 16] {
            for n in 0..100u64 {
                assert_eq!(block_prefix_sum(n, bs), (1..=n).map(|j| j.div_ceil(bs)).sum::<u64>(), "n {n} bs {bs}");
            }
        }
    }

    #[test]
    fn capacity_of_pascal_example_is_near_the_measured_saturation() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/pascal-8xh100.toml");
        let cfg = SimConfig::load(&path).unwrap();
        let c = capacity(&cfg, path.parent().unwrap()).unwrap();
        println!("{c:#?}");
        assert!((5.0..=12.0).contains(&c.rate_rps), "{c:?}");
        assert_eq!(c.requests_sampled, SAMPLE_REQUESTS);
        assert_eq!(c.limit, CapacityLimit::Kv);
        assert!(close(c.kv_bytes_held, c.kv_bytes_cluster as f64, 1e-3));
    }

    #[test]
    fn capacity_errors_instead_of_panicking() {
        let d = two_requests();
        let setup = |r: Result<(InstancePoint, CapacityLimit), SimError>| match r {
            Err(SimError::Setup(m)) => m,
            other => panic!("expected a setup error, got {other:?}"),
        };
        assert!(KvDemand::from_requests(&[], 16, 1).unwrap_err().to_string().contains("no requests"));
        // One request needs 450 KB; an instance has 100 KB.
        assert!(setup(instance_capacity(&d, 100_000, 256, |_, _| 0.05)).contains("largest sampled request"));
        assert!(setup(instance_capacity(&d, 1 << 30, 256, |_, _| 0.0)).contains("iteration time"));
        assert!(setup(instance_capacity(&d, 1 << 30, 256, |_, _| f64::NAN)).contains("iteration time"));
        let mut bad = d.clone();
        bad.kv_byte_iterations = f64::INFINITY;
        assert!(setup(instance_capacity(&bad, 1 << 30, 256, |_, _| 0.05)).contains("positive and finite"));
        // Iterations so short that no finite rate fills the KV.
        assert!(setup(instance_capacity(&d, 1 << 30, u32::MAX, |_, _| 1e-310)).contains("cannot bracket"));

        // Through a config: every request is bigger than an instance's KV (2 blocks of 4 MiB).
        let toml = "[cluster]\nkv_cache_gb = 0.01\n[workload.lengths]\nkind = \"fixed\"\nprompt_tokens = 100";
        let cfg = SimConfig::parse(toml, "x.toml").unwrap();
        let e = capacity(&cfg, Path::new(".")).unwrap_err().to_string();
        assert!(e.contains("largest sampled request"), "{e}");
    }

    #[test]
    fn capacity_rates_around_round_and_reject_bad_factors() {
        assert_eq!(rates_around(8.0, &SWEEP_FACTORS).unwrap(), vec![6.8, 7.6, 8.0, 8.4, 8.8]);
        assert_eq!(rates_around(7.777, &[1.0, 1.0001]).unwrap(), vec![7.78]);
        assert!(rates_around(8.0, &[]).is_err());
        assert!(rates_around(8.0, &[1.0, 0.0]).is_err());
        assert!(rates_around(8.0, &[-1.0]).is_err());
        assert!(rates_around(8.0, &[f64::NAN]).is_err());
        assert!(rates_around(0.0, &[1.0]).is_err());
        assert!(rates_around(0.001, &[1.0]).unwrap_err().to_string().contains("rounds to 0"));
    }
}
