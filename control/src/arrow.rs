//! Arrow's decisions for prefill/decode disaggregation with instances that flip roles (Arrow,
//! "Adaptive Scheduling Mechanisms for Disaggregated LLM Inference Architecture", §4–§5): pure
//! functions of load snapshots, no clock, no I/O. Time comes in as `f64` seconds.
//!
//! | paper | here |
//! |---|---|
//! | §5.2 profiler: quadratic TTFT(l) | [`Quadratic::fit`], [`Quadratic::eval`] |
//! | §5.3 MT(i, SLO_TPOT) | [`max_tokens`] |
//! | Eq. 1–2, TTFT of a prefill queue | [`predict_ttft`] |
//! | §5.5 instance and pool loads | [`InstanceLoad::prefill_load`], [`InstanceLoad::decode_load`], [`Snapshot::pool_loads`] |
//! | Alg. 1, SLO-aware request scheduling | [`place_prefill`], [`place_decode`] ([`PrefillCost`], [`DecodeCost`]) |
//! | Alg. 2, monitoring loop (when to flip) | [`expand_decode`], [`monitor`] |
//! | Alg. 3, instance scheduling (which flips) | [`choose_flip`] ([`FlipCost`]) |
//!
//! Arrow has two pools: P = the instances whose role is [`Role::Prefill`], D = those whose role is
//! [`Role::Decode`]. Instances of the other roles are in neither: never a candidate, never
//! flipped, not counted in a pool's load. Every argmin breaks ties by the lowest [`InstanceId`]
//! (the paper names no rule), so a result never depends on the order loads are listed in.
//!
//! The paper keeps a flipped instance's old requests on it until they finish (§5.4: "requests
//! queued before instance flipping" still run); [`FlipCost`] reads such a half-finished flip off
//! the requests of the other phase still on an instance.

use crate::roles::Role;
use kvfleet_core::policy::cache_aware::PrefillCurve;
use kvfleet_core::InstanceId;
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;

/// Prompt lengths (tokens) the profiler measures TTFT at (ours: powers of two, 128 … 32768).
pub const PROFILE_PROMPT_TOKENS: [u32; 9] = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768];

/// Why Arrow refuses an input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ArrowError {
    /// A quadratic needs prompt lengths at three distinct values at least.
    #[error("a TTFT profile needs points at 3 distinct prompt lengths, got {distinct}")]
    TooFewPoints {
        /// Distinct prompt lengths among the points.
        distinct: usize,
    },
    /// A profile point is not a measurement.
    #[error("TTFT profile point {index} (l = {l}, t = {t}): {problem}")]
    BadPoint {
        /// Its index in the points.
        index: usize,
        /// Its prompt length.
        l: f64,
        /// Its measured TTFT, seconds.
        t: f64,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// The points' prompt lengths are too close together to fit a quadratic in `f64`.
    #[error("the TTFT profile's prompt lengths are too close together to fit a quadratic")]
    Singular,
    /// A parameter is out of range.
    #[error("arrow parameter `{field}`: {problem}")]
    InvalidParam {
        /// The parameter's name in [`ArrowParams`].
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// An instance has two loads in one snapshot.
    #[error("instance {0} is listed twice in a load snapshot")]
    DuplicateInstance(InstanceId),
    /// A load field is not a finite, non-negative number.
    #[error("load of instance {instance}: `{field}` must be finite and non-negative")]
    BadLoad {
        /// The instance.
        instance: InstanceId,
        /// The field of [`InstanceLoad`].
        field: &'static str,
    },
    /// A flip names an instance the snapshot does not have.
    #[error("instance {0} is not in the snapshot")]
    UnknownInstance(InstanceId),
    /// A flip would move an instance to the role it has.
    #[error("instance {instance} is already {role}")]
    AlreadyInRole {
        /// The instance.
        instance: InstanceId,
        /// Its role.
        role: Role,
    },
    /// A flip would empty a pool.
    #[error("instance {instance} is the last {role} instance: flipping it would empty the pool")]
    LastInPool {
        /// The instance.
        instance: InstanceId,
        /// Its pool.
        role: Role,
    },
}

/// Arrow's knobs (defaults: ours, the paper gives no values).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ArrowParams {
    /// Alg. 2's update interval, and the window decode loads average token latency over (1 s).
    pub interval_s: f64,
    /// L_EXPAND: a decode pool at this load or above is high; a P→D flip follows (0.9).
    pub l_expand: f64,
    /// L_SHRINK: a prefill pool at or below this while decode is at or above it gives an
    /// instance to decode (0.3).
    pub l_shrink: f64,
    /// COOLDOWN: no P→D flip within this long after the last flip (5 s).
    pub cooldown_s: f64,
    /// SLO_TTFT (3 s: Table 1, Azure Conversation on Qwen3-8B).
    pub slo_ttft_s: f64,
    /// SLO_TPOT (0.15 s: Table 1, Azure Conversation on Qwen3-8B).
    pub slo_tpot_s: f64,
    /// How requests are placed (§6.3's three strategies); only `slo-aware` flips roles.
    pub placement: Placement,
}

/// Arrow's request scheduling strategies (§6.3, Fig. 7).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// Alg. 1–3: SLO-aware placement and role flips (Arrow).
    #[default]
    SloAware,
    /// The least-loaded instance of the pool (least queued prefill time for a prompt, fewest
    /// decode tokens for a handoff); roles never change.
    MinimalLoad,
    /// The pool's instances in turn; roles never change.
    RoundRobin,
}

impl Default for ArrowParams {
    fn default() -> Self {
        ArrowParams {
            interval_s: 1.0,
            l_expand: 0.9,
            l_shrink: 0.3,
            cooldown_s: 5.0,
            slo_ttft_s: 3.0,
            slo_tpot_s: 0.15,
            placement: Placement::SloAware,
        }
    }
}

impl ArrowParams {
    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), ArrowError> {
        let bad = |field: &'static str, problem: String| Err(ArrowError::InvalidParam { field, problem });
        if !(self.interval_s.is_finite() && self.interval_s >= 1e-3) {
            return bad("interval_s", format!("{} is not a number of seconds of at least 0.001", self.interval_s));
        }
        if !(self.cooldown_s.is_finite() && self.cooldown_s >= 0.0) {
            return bad("cooldown_s", format!("{} is not a non-negative number of seconds", self.cooldown_s));
        }
        for (field, value) in [("l_expand", self.l_expand), ("l_shrink", self.l_shrink)] {
            if !(value.is_finite() && value >= 0.0) {
                return bad(field, format!("{value} is not a non-negative load"));
            }
        }
        if self.l_shrink > self.l_expand {
            return bad("l_shrink", format!("{} is above l_expand ({})", self.l_shrink, self.l_expand));
        }
        for (field, value) in [("slo_ttft_s", self.slo_ttft_s), ("slo_tpot_s", self.slo_tpot_s)] {
            if !(value.is_finite() && value > 0.0) {
                return bad(field, format!("{value} is not a positive number of seconds"));
            }
        }
        Ok(())
    }
}

/// T(l) = a·l² + b·l + c: an instance's prefill time (seconds) for a prompt of l tokens (§5.2:
/// "fitting a quadratic curve to the relationship between input length and TTFT").
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Quadratic {
    /// Seconds per token².
    pub a: f64,
    /// Seconds per token.
    pub b: f64,
    /// Seconds.
    pub c: f64,
}

impl Quadratic {
    /// Least-squares fit to measured `(l, t)` points (prompt tokens, TTFT seconds). The normal
    /// equations are solved in l centred on its mean and scaled to [-1, 1], where they are well
    /// conditioned, then expanded back to `a, b, c`.
    pub fn fit(points: &[(f64, f64)]) -> Result<Quadratic, ArrowError> {
        for (index, &(l, t)) in points.iter().enumerate() {
            let problem = if !l.is_finite() || !t.is_finite() {
                "not finite"
            } else if l < 0.0 || t < 0.0 {
                "negative"
            } else {
                continue;
            };
            return Err(ArrowError::BadPoint { index, l, t, problem });
        }
        let mut ls: Vec<f64> = points.iter().map(|p| p.0).collect();
        ls.sort_by(f64::total_cmp);
        ls.dedup();
        if ls.len() < 3 {
            return Err(ArrowError::TooFewPoints { distinct: ls.len() });
        }
        let n = points.len() as f64;
        let mean = points.iter().map(|p| p.0).sum::<f64>() / n;
        let scale = points.iter().map(|p| (p.0 - mean).abs()).fold(0.0, f64::max);
        // Σ x^k for k = 0..4 and Σ t·x^k for k = 0..2, with x = (l − mean) / scale.
        let mut sx = [0.0f64; 5];
        let mut sxt = [0.0f64; 3];
        for &(l, t) in points {
            let x = (l - mean) / scale;
            let mut xk = 1.0;
            for k in 0..5 {
                sx[k] += xk;
                if k < 3 {
                    sxt[k] += t * xk;
                }
                xk *= x;
            }
        }
        // Unknowns (γ, β, α) of t ≈ γ + β·x + α·x².
        let mut m = [[sx[0], sx[1], sx[2], sxt[0]], [sx[1], sx[2], sx[3], sxt[1]], [sx[2], sx[3], sx[4], sxt[2]]];
        let [gamma, beta, alpha] = solve3(&mut m).ok_or(ArrowError::Singular)?;
        let (s, s2) = (scale, scale * scale);
        Ok(Quadratic {
            a: alpha / s2,
            b: beta / s - 2.0 * alpha * mean / s2,
            c: gamma - beta * mean / s + alpha * mean * mean / s2,
        })
    }

    /// The same curve as the placement policies weigh it ([`PrefillCurve`]: its queue sums).
    pub fn as_curve(&self) -> PrefillCurve {
        PrefillCurve { a: self.a, b: self.b, c: self.c }
    }

    /// T(l), seconds.
    pub fn eval(&self, l: f64) -> f64 {
        (self.a * l + self.b) * l + self.c
    }

    /// Whether every coefficient is a finite number.
    pub fn is_finite(&self) -> bool {
        self.a.is_finite() && self.b.is_finite() && self.c.is_finite()
    }
}

/// Gaussian elimination with partial pivoting on an augmented 3×4 system; `None` when singular.
fn solve3(m: &mut [[f64; 4]; 3]) -> Option<[f64; 3]> {
    // The Gram matrix's (0, 0) entry is the number of points: pivots far below it are noise.
    let tiny = m[0][0].abs() * 1e-12;
    for col in 0..3 {
        let pivot = (col..3).max_by(|&i, &j| m[i][col].abs().total_cmp(&m[j][col].abs()))?;
        if m[pivot][col].is_nan() || m[pivot][col].abs() <= tiny {
            return None;
        }
        m.swap(col, pivot);
        let top = m[col];
        for row in m.iter_mut().skip(col + 1) {
            let f = row[col] / top[col];
            for (v, t) in row.iter_mut().zip(top).skip(col) {
                *v -= f * t;
            }
        }
    }
    let mut x = [0.0; 3];
    for row in (0..3).rev() {
        let rest: f64 = (row + 1..3).map(|k| m[row][k] * x[k]).sum();
        x[row] = (m[row][3] - rest) / m[row][row];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// MT(i, SLO_TPOT): the most batch tokens whose decode iteration takes at most `slo_tpot_s`,
/// capped by `kv_cap_tokens` (what the instance's KV holds). `decode_iteration_s` (seconds for a
/// batch of that many tokens, from the TPOT profile) must be non-decreasing; a binary search
/// calls it about log₂(`kv_cap_tokens`) times. 0 when even one token is over the SLO.
pub fn max_tokens(decode_iteration_s: impl Fn(u64) -> f64, slo_tpot_s: f64, kv_cap_tokens: u64) -> u64 {
    let fits = |tokens: u64| decode_iteration_s(tokens) <= slo_tpot_s;
    if fits(kv_cap_tokens) {
        return kv_cap_tokens;
    }
    // Invariant: `lo` fits (0 tokens trivially), `hi` does not.
    let (mut lo, mut hi) = (0u64, kv_cap_tokens);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Eq. 1–2 over one prefill instance's queue.
#[derive(Clone, Debug, PartialEq)]
pub struct TtftPrediction {
    /// TTFT_j of each queued request, seconds from its arrival, in queue order.
    pub ttft_s: Vec<f64>,
    /// e_n: when the last queued prefill completes (e_0 when the queue is empty).
    pub end_s: f64,
}

/// Eq. 1–2: with e_0 = `now_s` + `running_left_s` (what is left of the prefill running now, 0
/// when none), each queued request j = 1..n in FCFS order, given as (a_j arrival, T(l_j) prefill
/// time) in seconds, gets TTFT_j = max(e_{j−1} − a_j, 0) + T(l_j) and completes at e_j = a_j +
/// TTFT_j.
pub fn predict_ttft(now_s: f64, running_left_s: f64, queue: &[(f64, f64)]) -> TtftPrediction {
    let mut end_s = now_s + running_left_s;
    let ttft_s = queue
        .iter()
        .map(|&(arrival_s, prefill_s)| {
            let ttft = (end_s - arrival_s).max(0.0) + prefill_s;
            end_s = arrival_s + ttft;
            ttft
        })
        .collect();
    TtftPrediction { ttft_s, end_s }
}

/// What Arrow knows about one instance (the instance monitor's view, §5.2). P and D are the
/// prefill and decode requests on it, whatever its role: a flipped instance keeps its old ones
/// until they finish.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InstanceLoad {
    /// The instance.
    pub instance: InstanceId,
    /// Its role; Arrow's pools are [`Role::Prefill`] and [`Role::Decode`].
    pub role: Role,
    /// Σ_{r_p ∈ P} T(r_p, i): estimated prefill time, seconds, of the prefill requests on it (the
    /// running one at what is left of it).
    pub prefill_s: f64,
    /// Σ_{r_p ∈ P} L(r_p): prompt tokens of the prefill requests on it. 0 ⇔ P = ∅.
    pub prefill_tokens: u64,
    /// Σ_{r_d ∈ D} L(r_d): tokens (prompt + output so far) of the decode requests on it. 0 ⇔ D = ∅.
    pub decode_tokens: u64,
    /// MT(i, SLO_TPOT), from [`max_tokens`].
    pub max_tokens: u64,
    /// Mean latency between consecutive tokens it generated over the last interval, seconds;
    /// `None` when it generated none.
    pub itl_mean_s: Option<f64>,
    /// T(·, i): its prefill time profile.
    pub profile: Quadratic,
}

impl InstanceLoad {
    /// Prefill load (§5.5): Σ T(r_p, i) / SLO_TTFT.
    pub fn prefill_load(&self, params: &ArrowParams) -> f64 {
        self.prefill_s / params.slo_ttft_s
    }

    /// Decode load: the larger of §5.5's mean inter-token latency over the last interval /
    /// SLO_TPOT (0 for an instance that generated no token) and, ours, Σ_{r_d ∈ D} L(r_d) /
    /// MT(i, SLO_TPOT). The paper's latency ratio alone stays low on an instance whose KV is full
    /// (its batch is capped by memory, not time), so the decode pool would look idle while
    /// handed-off requests wait for room, and prefill placements would flip its instances away.
    pub fn decode_load(&self, params: &ArrowParams) -> f64 {
        let latency = self.itl_mean_s.unwrap_or(0.0) / params.slo_tpot_s;
        let tokens = self.decode_tokens as f64 / self.max_tokens.max(1) as f64;
        latency.max(tokens)
    }
}

/// L_P and L_D: each pool's mean instance load (0 for an empty pool).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PoolLoads {
    /// L_P: mean prefill load of the prefill pool.
    pub prefill: f64,
    /// L_D: mean decode load of the decode pool.
    pub decode: f64,
}

impl PoolLoads {
    /// "Decode load is high" (ours): L_D ≥ L_EXPAND.
    pub fn decode_high(&self, params: &ArrowParams) -> bool {
        self.decode >= params.l_expand
    }
}

/// A checked set of instance loads at one moment: one entry per instance, finite numbers, sorted
/// by instance id.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    loads: Vec<InstanceLoad>,
}

impl Snapshot {
    /// Checks `loads`: no instance twice, `prefill_s` and `itl_mean_s` finite and non-negative,
    /// profile coefficients finite.
    pub fn new(mut loads: Vec<InstanceLoad>) -> Result<Snapshot, ArrowError> {
        loads.sort_by_key(|l| l.instance);
        if let Some(w) = loads.windows(2).find(|w| w[0].instance == w[1].instance) {
            return Err(ArrowError::DuplicateInstance(w[0].instance));
        }
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        for l in &loads {
            let field = if !ok(l.prefill_s) {
                "prefill_s"
            } else if !l.itl_mean_s.is_none_or(ok) {
                "itl_mean_s"
            } else if !l.profile.is_finite() {
                "profile"
            } else {
                continue;
            };
            return Err(ArrowError::BadLoad { instance: l.instance, field });
        }
        Ok(Snapshot { loads })
    }

    /// Every instance's load, by instance id.
    pub fn loads(&self) -> &[InstanceLoad] {
        &self.loads
    }

    /// One instance's load.
    pub fn get(&self, instance: InstanceId) -> Option<&InstanceLoad> {
        self.loads.binary_search_by_key(&instance, |l| l.instance).ok().map(|i| &self.loads[i])
    }

    /// The instances whose role is `role`, by instance id.
    pub fn pool(&self, role: Role) -> impl Iterator<Item = &InstanceLoad> + '_ {
        self.loads.iter().filter(move |l| l.role == role)
    }

    /// L_P and L_D (§5.5: "The load of the instance pool is the average load of all instances
    /// within it").
    pub fn pool_loads(&self, params: &ArrowParams) -> PoolLoads {
        let mean = |role, load: &dyn Fn(&InstanceLoad) -> f64| {
            let (sum, n) = self.pool(role).fold((0.0, 0u32), |(s, n), l| (s + load(l), n + 1));
            if n == 0 {
                0.0
            } else {
                sum / f64::from(n)
            }
        };
        PoolLoads {
            prefill: mean(Role::Prefill, &|l| l.prefill_load(params)),
            decode: mean(Role::Decode, &|l| l.decode_load(params)),
        }
    }

    /// Applies a flip: `instance` takes `to_role`. Refused for an unknown instance, one already in
    /// `to_role`, and the last instance of the prefill or decode pool.
    pub fn flip(&mut self, instance: InstanceId, to_role: Role) -> Result<(), ArrowError> {
        let from = self.get(instance).ok_or(ArrowError::UnknownInstance(instance))?.role;
        if from == to_role {
            return Err(ArrowError::AlreadyInRole { instance, role: from });
        }
        if matches!(from, Role::Prefill | Role::Decode) && self.pool(from).count() == 1 {
            return Err(ArrowError::LastInPool { instance, role: from });
        }
        if let Some(l) = self.loads.iter_mut().find(|l| l.instance == instance) {
            l.role = to_role;
        }
        Ok(())
    }
}

/// Alg. 1's cost of prefilling request r on instance i: (Σ_{r_d ∈ D} L(r_d), Σ_{r_p ∈ P ∪ {r}}
/// T(r_p, i)), compared lexicographically. The first element (decode tokens on i) keeps
/// prefills off instances still decoding; the second is r's predicted TTFT if it queues there.
#[derive(Clone, Copy, Debug)]
pub struct PrefillCost {
    /// Σ_{r_d ∈ D} L(r_d).
    pub decode_tokens: u64,
    /// Σ_{r_p ∈ P ∪ {r}} T(r_p, i), seconds.
    pub prefill_s: f64,
}

impl PrefillCost {
    /// The SLO check: the second element is at most SLO_TTFT.
    pub fn meets_slo(&self, params: &ArrowParams) -> bool {
        self.prefill_s <= params.slo_ttft_s
    }
}

impl Ord for PrefillCost {
    fn cmp(&self, other: &Self) -> Ordering {
        self.decode_tokens.cmp(&other.decode_tokens).then(self.prefill_s.total_cmp(&other.prefill_s))
    }
}
impl PartialOrd for PrefillCost {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for PrefillCost {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for PrefillCost {}

/// Alg. 1's cost of decoding request r on instance i: (Σ_{r_p ∈ P} L(r_p), Σ_{r_d ∈ D ∪ {r}}
/// L(r_d) − MT(i, SLO_TPOT)), compared lexicographically. The first element (prompt tokens
/// waiting for prefill on i) keeps decodes off instances still prefilling; the second is how far
/// i would be over the most tokens it decodes within SLO_TPOT (negative: room left).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DecodeCost {
    /// Σ_{r_p ∈ P} L(r_p).
    pub prefill_tokens: u64,
    /// Σ_{r_d ∈ D ∪ {r}} L(r_d) − MT(i, SLO_TPOT).
    pub over_tokens: i64,
}

impl DecodeCost {
    /// The SLO check: the second element is at most 0.
    pub fn meets_slo(&self) -> bool {
        self.over_tokens <= 0
    }
}

/// [`PrefillCost`] of a prompt of `prompt_tokens` on `load`'s instance (T(r, i) from its profile,
/// at least 0).
pub fn prefill_cost(load: &InstanceLoad, prompt_tokens: u64) -> PrefillCost {
    let own_s = load.profile.eval(prompt_tokens as f64).max(0.0);
    PrefillCost { decode_tokens: load.decode_tokens, prefill_s: load.prefill_s + own_s }
}

/// [`DecodeCost`] of a decode request of `tokens` tokens (L(r): prompt + output so far) on
/// `load`'s instance.
pub fn decode_cost(load: &InstanceLoad, tokens: u64) -> DecodeCost {
    let over = i128::from(load.decode_tokens) + i128::from(tokens) - i128::from(load.max_tokens);
    DecodeCost {
        prefill_tokens: load.prefill_tokens,
        over_tokens: i64::try_from(over).unwrap_or(if over > 0 { i64::MAX } else { i64::MIN }),
    }
}

/// Alg. 1's answer: where the request goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Place it on this instance.
    Instance(InstanceId),
    /// Flip `instance` to `to_role` (Alg. 3's pick), then place the request on it.
    Flip {
        /// The instance that flips.
        instance: InstanceId,
        /// Its new role: the request's phase.
        to_role: Role,
    },
}

/// A request entering its decode phase (Alg. 1 with r.type = Decode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeRequest {
    /// L(r): its tokens, prompt + output so far (what its KV holds).
    pub tokens: u64,
    /// The instance that prefilled it, if known.
    pub prefill_instance: Option<InstanceId>,
}

/// The lowest cost, the lowest instance id among equal costs (`None` for no candidate).
fn argmin<C: Ord>(costs: impl Iterator<Item = (C, InstanceId)>) -> Option<InstanceId> {
    costs.min_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1))).map(|(_, id)| id)
}

/// Alg. 1 for a prefill request of `prompt_tokens` tokens, over the prefill pool: the lowest
/// [`PrefillCost`] among instances meeting SLO_TTFT; if none does and decode load is low, a
/// decode instance flipped to prefill ([`choose_flip`]); else the lowest cost. `None` only when
/// the prefill pool is empty and no instance can flip to it.
pub fn place_prefill(
    snapshot: &Snapshot,
    prompt_tokens: u64,
    now_s: f64,
    last_flip_s: Option<f64>,
    params: &ArrowParams,
) -> Option<Choice> {
    let costs = || snapshot.pool(Role::Prefill).map(|l| (prefill_cost(l, prompt_tokens), l.instance));
    if let Some(id) = argmin(costs().filter(|(c, _)| c.meets_slo(params))) {
        return Some(Choice::Instance(id));
    }
    // Line 13: a prefill request flips only while decode load is low; choose_flip checks that.
    if let Ok(instance) = choose_flip(snapshot, Direction::DecodeToPrefill, now_s, last_flip_s, params) {
        return Some(Choice::Flip { instance, to_role: Role::Prefill });
    }
    argmin(costs()).map(Choice::Instance)
}

/// Alg. 1 for a decode request: its prefill instance if that instance is in the decode pool now
/// (no KV transfer); else the lowest [`DecodeCost`] among decode instances with room under
/// SLO_TPOT; if none has, a prefill instance flipped to decode ([`choose_flip`]); else the lowest
/// cost. `None` only when the decode pool is empty and no instance can flip to it.
pub fn place_decode(
    snapshot: &Snapshot,
    request: DecodeRequest,
    now_s: f64,
    last_flip_s: Option<f64>,
    params: &ArrowParams,
) -> Option<Choice> {
    if let Some(id) = place_decode_within_slo(snapshot, request) {
        return Some(Choice::Instance(id));
    }
    if let Ok(instance) = choose_flip(snapshot, Direction::PrefillToDecode, now_s, last_flip_s, params) {
        return Some(Choice::Flip { instance, to_role: Role::Decode });
    }
    argmin(decode_costs(snapshot, request)).map(Choice::Instance)
}

/// The first half of [`place_decode`]: the instance it picks without flipping one or falling
/// back on a decoder that misses SLO_TPOT (the request's own prefill instance if that decodes
/// now, else the cheapest decoder meeting the SLO); `None` where [`place_decode`] would flip or
/// fall back. An overlapped handoff, decided as its prefill starts, takes only this: an early
/// decision that flips would do so on loads its own and its peers' reservations inflate for a
/// whole prefill, so the handoff is decided at the prefill's end instead.
pub fn place_decode_within_slo(snapshot: &Snapshot, request: DecodeRequest) -> Option<InstanceId> {
    if let Some(load) = request.prefill_instance.and_then(|p| snapshot.get(p)) {
        if load.role == Role::Decode {
            return Some(load.instance);
        }
    }
    argmin(decode_costs(snapshot, request).filter(|(c, _)| c.meets_slo()))
}

fn decode_costs(snapshot: &Snapshot, request: DecodeRequest) -> impl Iterator<Item = (DecodeCost, InstanceId)> + '_ {
    snapshot.pool(Role::Decode).map(move |l| (decode_cost(l, request.tokens), l.instance))
}

/// Alg. 2, line 4: whether this interval's pool loads call for a P→D flip: L_D ≥ L_EXPAND, or
/// L_P ≤ L_SHRINK ≤ L_D (prefill idle while decode is not).
pub fn expand_decode(loads: PoolLoads, params: &ArrowParams) -> bool {
    loads.decode >= params.l_expand || (loads.prefill <= params.l_shrink && params.l_shrink <= loads.decode)
}

/// One pass of Alg. 2 (the driver calls it every `interval_s`): the prefill instance to flip to
/// decode, if [`expand_decode`] holds and [`choose_flip`] allows one. The paper's loop flips only
/// P→D; D→P flips happen in Alg. 1 ([`place_prefill`]).
pub fn monitor(snapshot: &Snapshot, now_s: f64, last_flip_s: Option<f64>, params: &ArrowParams) -> Option<InstanceId> {
    if !expand_decode(snapshot.pool_loads(params), params) {
        return None;
    }
    choose_flip(snapshot, Direction::PrefillToDecode, now_s, last_flip_s, params).ok()
}

/// Which way an instance flips.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// A prefill instance starts decoding (P2D).
    PrefillToDecode,
    /// A decode instance starts prefilling (D2P).
    DecodeToPrefill,
}

impl Direction {
    /// The pool the instance leaves (S in Alg. 3).
    pub fn from_role(self) -> Role {
        match self {
            Direction::PrefillToDecode => Role::Prefill,
            Direction::DecodeToPrefill => Role::Decode,
        }
    }

    /// The pool the instance joins (T in Alg. 3).
    pub fn to_role(self) -> Role {
        match self {
            Direction::PrefillToDecode => Role::Decode,
            Direction::DecodeToPrefill => Role::Prefill,
        }
    }
}

/// Alg. 3's flipping cost, compared lexicographically: (I[the other phase's requests = ∅], the
/// instance's own-phase work). For a prefill instance (I[D = ∅], Σ_{r_p ∈ P} T(r_p, i)); for a
/// decode instance (I[P = ∅], Σ_{r_d ∈ D} L(r_d)). An instance still holding the other phase's
/// requests is a half-finished earlier flip (indicator 0), so it is flipped back first; then the
/// lightest.
#[derive(Clone, Copy, Debug)]
pub struct FlipCost {
    /// I[the other phase's requests = ∅].
    pub other_empty: bool,
    /// Σ T(r_p, i) seconds (prefill instance) or Σ L(r_d) tokens (decode instance).
    pub work: f64,
}

impl Ord for FlipCost {
    fn cmp(&self, other: &Self) -> Ordering {
        self.other_empty.cmp(&other.other_empty).then(self.work.total_cmp(&other.work))
    }
}
impl PartialOrd for FlipCost {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for FlipCost {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for FlipCost {}

/// [`FlipCost`] of flipping `load`'s instance in `direction`.
pub fn flip_cost(load: &InstanceLoad, direction: Direction) -> FlipCost {
    match direction {
        Direction::PrefillToDecode => FlipCost { other_empty: load.decode_tokens == 0, work: load.prefill_s },
        Direction::DecodeToPrefill => {
            FlipCost { other_empty: load.prefill_tokens == 0, work: load.decode_tokens as f64 }
        }
    }
}

/// Why Alg. 3 flips nothing.
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
pub enum FlipRefusal {
    /// P→D within COOLDOWN of the last flip (line 3).
    #[error("P→D flip in cooldown ({left_s:.3} s left)")]
    Cooldown {
        /// Seconds until the cooldown ends.
        left_s: f64,
    },
    /// D→P while decode load is high (§5.5, "Scheduling in Overload Scenario").
    #[error("D→P flip aborted: decode load is high")]
    DecodeLoadHigh,
    /// The source pool has at most one instance (line 6: `|S| > 1`).
    #[error("the {role} pool has {size} instance(s): it is never emptied")]
    PoolTooSmall {
        /// The source pool.
        role: Role,
        /// Its size.
        size: usize,
    },
}

/// Alg. 3: the instance to flip in `direction`, the argmin of [`FlipCost`] over the source pool.
/// Refused for P→D within `cooldown_s` of `last_flip_s` (the last flip of any instance, either
/// way), for D→P while decode load is high, and when the source pool has one instance or none.
pub fn choose_flip(
    snapshot: &Snapshot,
    direction: Direction,
    now_s: f64,
    last_flip_s: Option<f64>,
    params: &ArrowParams,
) -> Result<InstanceId, FlipRefusal> {
    match direction {
        Direction::PrefillToDecode => {
            if let Some(last) = last_flip_s {
                let since = now_s - last;
                if since < params.cooldown_s {
                    return Err(FlipRefusal::Cooldown { left_s: params.cooldown_s - since });
                }
            }
        }
        Direction::DecodeToPrefill => {
            if snapshot.pool_loads(params).decode_high(params) {
                return Err(FlipRefusal::DecodeLoadHigh);
            }
        }
    }
    let role = direction.from_role();
    let size = snapshot.pool(role).count();
    if size <= 1 {
        return Err(FlipRefusal::PoolTooSmall { role, size });
    }
    argmin(snapshot.pool(role).map(|l| (flip_cost(l, direction), l.instance)))
        .ok_or(FlipRefusal::PoolTooSmall { role, size })
}

#[cfg(test)]
mod tests;
