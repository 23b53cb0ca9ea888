//! Workloads: which requests arrive when, with how many prompt, reasoning and answer tokens.
//!
//! PASCAL (§V) drives its cluster with reasoning requests whose reasoning and answer lengths are
//! known to the emulator (`</think>` is where the phase changes), arriving as a Poisson process at
//! a swept rate. This module turns a [`WorkloadConfig`] (TOML) into the `Vec<RequestSpec>` the
//! simulator and the load generator replay. It is pure: files are read once up front, and every
//! random draw comes from [`SimRng`] streams forked from `seed`, so one config gives one workload.
//!
//! | file | what lives there |
//! |---|---|
//! | `mod.rs` | [`WorkloadConfig`], [`WorkloadError`], [`generate`] |
//! | [`arrivals`](ArrivalConfig) | Poisson / gamma processes, trace replay, rate and time scaling |
//! | [`lengths`](LengthConfig) | ServeGen PMF sampling, log-normal and fixed lengths, output caps |
//! | [`traces`](TraceFormat) | Azure CSV, Mooncake JSONL and kvfleet CSV parsers |
//! | [`prefix`](PrefixConfig) | shared system prompts, unbounded prefix-cache reuse |
//!
//! What a prompt says ([`RequestSpec::content_ids`]) comes from a Mooncake trace's `hash_ids` or
//! from `[prefix]`; every other workload has no content ids, so nothing of its prompts is shared.

mod arrivals;
mod lengths;
mod prefix;
mod traces;

pub use arrivals::{ArrivalConfig, RatePhase};
pub use lengths::{
    cap_output, split_output, FixedLengths, Joint, LengthConfig, LengthPmf, LognormalLengths, PmfField,
    ReasonRatioConfig, TraceLengths,
};
pub use prefix::{describe_content, unbounded_prefix_reuse, MultiTurn, Popularity, PrefixConfig, MAX_SYSTEM_PROMPTS};
pub use traces::{load_trace, parse_trace, TraceFormat, TraceOutput, TraceRow, AZURE_HEADER, KVFLEET_HEADER};

use crate::ids::RequestId;
use crate::kv::TRACE_BLOCK_TOKENS;
use crate::request::RequestSpec;
use crate::rng::SimRng;
use crate::time::{Timestamp, RUN_LIMIT};
use arrivals::{phased_arrivals, replay_times, synthetic_arrivals, Scale, Stop};
use lengths::{sample_lognormal, sample_servegen, PmfRef};
use prefix::PrefixSampler;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Requests generated when synthetic arrivals have neither `num_requests` nor `duration_s`.
pub const DEFAULT_NUM_REQUESTS: u64 = 1_000;
/// Upper bound on one workload's size (guards against a typo asking for billions of requests).
pub const MAX_REQUESTS: u64 = 100_000_000;
/// `SimRng` stream of the arrival process (separate so that length draws never shift arrivals).
const STREAM_ARRIVALS: u64 = 1;
/// `SimRng` stream of the length draws.
const STREAM_LENGTHS: u64 = 2;
/// `SimRng` stream of the `[prefix]` draws (system prompt and suffix length).
const STREAM_PREFIX: u64 = 3;

/// Errors from loading, validating or generating a workload.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// A workload, trace or PMF file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Malformed row: file, 1-based line and the field that failed.
    #[error("{}:{line}: field `{field}`: {message}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The field that failed.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A problem with a whole file (empty, missing a section).
    #[error("{}: {message}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A config value out of range; `field` is its dotted TOML path.
    #[error("workload config: `{field}`: {message}")]
    Invalid {
        /// Dotted TOML path of the value (e.g. `arrivals.rate`).
        field: String,
        /// What is wrong.
        message: String,
    },
    /// The TOML itself did not deserialize.
    #[error("{origin}: invalid workload config: {message}")]
    Toml {
        /// Where the document came from (a path or `<cli>`).
        origin: String,
        /// The deserializer's message.
        message: String,
    },
}

/// A workload description (TOML). Every field has a default; see `examples/` for complete files.
///
/// ```toml
/// seed = 7
/// num_requests = 2000
/// [arrivals]
/// kind = "gamma"
/// rate = 4.0
/// cv = 2.0
/// [lengths]
/// kind = "servegen"
/// joint = "comonotonic"
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkloadConfig {
    /// Seed of every random draw; the same config and seed give the identical workload.
    pub seed: u64,
    /// Stop after this many requests. With neither this nor `duration_s`, synthetic arrivals stop
    /// at 1,000 requests and traces are replayed whole.
    pub num_requests: Option<u64>,
    /// Stop at the last arrival at or before this many seconds (after scaling).
    pub duration_s: Option<f64>,
    /// The arrival process.
    pub arrivals: ArrivalConfig,
    /// Multiplies the arrival rate: a Poisson/gamma `rate`, or a trace's pace (its inter-arrival
    /// gaps are divided by this). 2 = twice the load.
    pub rate_scale: f64,
    /// Multiplies every arrival time (2 = the same requests spread over twice the time).
    /// Arrival times are raw × time_scale ÷ rate_scale.
    pub time_scale: f64,
    /// Where prompt, reasoning and answer lengths come from.
    pub lengths: LengthConfig,
    /// Clip prompts to at most this many tokens (so requests fit an instance).
    pub max_prompt_tokens: Option<u32>,
    /// Clip reasoning + answer to at most this many tokens, keeping their proportion and at least
    /// one answer token.
    pub max_output_tokens: Option<u32>,
    /// Shared system prompts: when present, every prompt is a system prompt plus a user suffix
    /// with content ids, replacing the prompt length (and any trace ids) from `lengths`.
    pub prefix: Option<PrefixConfig>,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        WorkloadConfig {
            seed: 0,
            num_requests: None,
            duration_s: None,
            arrivals: ArrivalConfig::default(),
            rate_scale: 1.0,
            time_scale: 1.0,
            lengths: LengthConfig::default(),
            max_prompt_tokens: None,
            max_output_tokens: None,
            prefix: None,
        }
    }
}

fn invalid(field: &str, message: impl Into<String>) -> WorkloadError {
    WorkloadError::Invalid { field: field.into(), message: message.into() }
}

fn positive(field: &str, v: f64) -> Result<(), WorkloadError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(invalid(field, format!("must be a positive finite number, got {v}")))
    }
}

fn at_least_one(field: &str, v: u32) -> Result<(), WorkloadError> {
    if v >= 1 {
        Ok(())
    } else {
        Err(invalid(field, "must be >= 1"))
    }
}

impl WorkloadConfig {
    /// Parses and validates a TOML document; `origin` names it in errors (a path or `<cli>`).
    pub fn from_toml_str(text: &str, origin: &str) -> Result<WorkloadConfig, WorkloadError> {
        let cfg: WorkloadConfig =
            toml::from_str(text).map_err(|e| WorkloadError::Toml { origin: origin.into(), message: e.to_string() })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads a TOML file; generate with `generate(&cfg, path.parent())` so relative trace paths
    /// resolve against the file's directory.
    pub fn load(path: &Path) -> Result<WorkloadConfig, WorkloadError> {
        let text = traces::read_text(path)?;
        WorkloadConfig::from_toml_str(&text, &path.display().to_string())
    }

    fn synthetic_rate(&self) -> Option<f64> {
        match self.arrivals {
            ArrivalConfig::Poisson { rate } | ArrivalConfig::Gamma { rate, .. } => Some(rate),
            ArrivalConfig::Steps { .. } | ArrivalConfig::Trace { .. } => None,
        }
    }

    /// Checks every value that does not need a file; messages name the field.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        if let Some(d) = self.duration_s {
            positive("duration_s", d)?;
        }
        match self.num_requests {
            Some(0) => return Err(invalid("num_requests", "must be >= 1")),
            Some(n) if n > MAX_REQUESTS => {
                return Err(invalid("num_requests", format!("must be <= {MAX_REQUESTS}, got {n}")))
            }
            _ => {}
        }
        positive("rate_scale", self.rate_scale)?;
        positive("time_scale", self.time_scale)?;
        match &self.arrivals {
            ArrivalConfig::Poisson { rate } => positive("arrivals.rate", *rate)?,
            ArrivalConfig::Gamma { rate, cv } => {
                positive("arrivals.rate", *rate)?;
                positive("arrivals.cv", *cv)?;
            }
            ArrivalConfig::Steps { cv, phases } => {
                if let Some(cv) = cv {
                    positive("arrivals.cv", *cv)?;
                }
                if phases.is_empty() {
                    return Err(invalid("arrivals.phases", "needs at least one `{ rate, duration_s }` phase"));
                }
                for (i, p) in phases.iter().enumerate() {
                    if !(p.rate.is_finite() && p.rate >= 0.0) {
                        return Err(invalid(
                            &format!("arrivals.phases[{i}].rate"),
                            format!("must be a finite number >= 0, got {}", p.rate),
                        ));
                    }
                    positive(&format!("arrivals.phases[{i}].duration_s"), p.duration_s)?;
                }
                if phases.iter().all(|p| p.rate == 0.0) {
                    return Err(invalid("arrivals.phases", "every phase has rate 0: no request would arrive"));
                }
                let expected: f64 = phases.iter().map(|p| p.rate * p.duration_s).sum::<f64>() * self.rate_scale;
                if self.num_requests.is_none() && expected > MAX_REQUESTS as f64 {
                    return Err(invalid(
                        "arrivals.phases",
                        format!("about {expected:.3e} requests expected, more than {MAX_REQUESTS}; set `num_requests`"),
                    ));
                }
            }
            ArrivalConfig::Trace { path: None, format } => {
                if format.is_some() {
                    return Err(invalid("arrivals.format", "only meaningful with `arrivals.path`"));
                }
                if !matches!(self.lengths, LengthConfig::Trace(_)) {
                    return Err(invalid(
                        "arrivals.path",
                        "required unless `lengths.kind = \"trace\"` (then the length trace's timestamps are used)",
                    ));
                }
            }
            ArrivalConfig::Trace { path: Some(_), format: None } => {
                return Err(invalid("arrivals.format", "required with `arrivals.path` (azure, mooncake or kvfleet)"))
            }
            ArrivalConfig::Trace { path: Some(_), format: Some(_) } => {}
        }
        if let (Some(rate), None, Some(d)) = (self.synthetic_rate(), self.num_requests, self.duration_s) {
            let expected = rate * self.rate_scale * d / self.time_scale;
            if expected > MAX_REQUESTS as f64 {
                return Err(invalid(
                    "duration_s",
                    format!("about {expected:.3e} requests expected, more than {MAX_REQUESTS}; set `num_requests`"),
                ));
            }
        }
        self.validate_lengths()?;
        if let Some(c) = self.max_prompt_tokens {
            at_least_one("max_prompt_tokens", c)?;
        }
        if let Some(c) = self.max_output_tokens {
            at_least_one("max_output_tokens", c)?;
        }
        if let Some(p) = &self.prefix {
            p.validate()?;
        }
        Ok(())
    }

    fn validate_lengths(&self) -> Result<(), WorkloadError> {
        match &self.lengths {
            LengthConfig::Servegen { .. } => {}
            LengthConfig::Lognormal(l) => {
                for (name, median, sigma, lo, hi) in [
                    ("prompt", l.prompt_median, l.prompt_sigma, l.prompt_min, l.prompt_max),
                    ("reasoning", l.reasoning_median, l.reasoning_sigma, l.reasoning_min, l.reasoning_max),
                    ("answer", l.answer_median, l.answer_sigma, l.answer_min, l.answer_max),
                ] {
                    positive(&format!("lengths.{name}_median"), median)?;
                    if !(sigma.is_finite() && sigma >= 0.0) {
                        return Err(invalid(
                            &format!("lengths.{name}_sigma"),
                            format!("must be finite and >= 0, got {sigma}"),
                        ));
                    }
                    if lo > hi {
                        return Err(invalid(
                            &format!("lengths.{name}_min"),
                            format!("{lo} is above `{name}_max` ({hi})"),
                        ));
                    }
                }
                at_least_one("lengths.prompt_min", l.prompt_min)?;
                at_least_one("lengths.answer_min", l.answer_min)?;
            }
            LengthConfig::Fixed(f) => {
                at_least_one("lengths.prompt_tokens", f.prompt_tokens)?;
                at_least_one("lengths.answer_tokens", f.answer_tokens)?;
            }
            LengthConfig::Trace(t) => match (&t.reason_ratio, t.format) {
                (Some(_), TraceFormat::Kvfleet) => {
                    return Err(invalid(
                        "lengths.reason_ratio",
                        "not used with format \"kvfleet\" (its rows carry the split)",
                    ))
                }
                (Some(ReasonRatioConfig::Fixed { value }), _) if !(0.0..=1.0).contains(value) => {
                    return Err(invalid("lengths.reason_ratio.value", format!("must be in [0, 1], got {value}")))
                }
                _ => {}
            },
        }
        Ok(())
    }

    /// One line saying where the workload comes from, for run summaries (states the joint
    /// assumption and whether lengths are synthetic, as `data/README.md` asks, and where content
    /// ids come from; [`describe_content`] measures what the generated prompts share).
    pub fn describe(&self) -> String {
        let arrivals = match &self.arrivals {
            ArrivalConfig::Poisson { rate } => format!("Poisson {} req/s", rate * self.rate_scale / self.time_scale),
            ArrivalConfig::Gamma { rate, cv } => {
                format!("gamma {} req/s cv {cv}", rate * self.rate_scale / self.time_scale)
            }
            ArrivalConfig::Steps { cv, phases } => {
                let steps: Vec<String> = phases
                    .iter()
                    .map(|p| {
                        let rate = p.rate * self.rate_scale / self.time_scale;
                        format!("{rate} req/s for {} s", p.duration_s * self.time_scale)
                    })
                    .collect();
                let cv = cv.map(|cv| format!(" cv {cv}")).unwrap_or_default();
                format!("rate steps{cv}: {}", steps.join(", then "))
            }
            ArrivalConfig::Trace { path, .. } => {
                let p = path.as_ref().or(match &self.lengths {
                    LengthConfig::Trace(t) => Some(&t.path),
                    _ => None,
                });
                let p = p.map(|p| p.display().to_string()).unwrap_or_default();
                format!("trace {p} ×{} speed", self.rate_scale / self.time_scale)
            }
        };
        let pmf_name = |p: &Option<PathBuf>| {
            p.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "built-in ServeGen DeepSeek-R1".into())
        };
        let lengths = match &self.lengths {
            LengthConfig::Servegen { pmf, joint } => {
                format!("lengths from {} whole-day PMF, {} draws", pmf_name(pmf), joint.name())
            }
            LengthConfig::Lognormal(_) => "synthetic log-normal lengths".to_string(),
            LengthConfig::Fixed(f) => {
                format!("fixed lengths {}/{}/{}", f.prompt_tokens, f.reasoning_tokens, f.answer_tokens)
            }
            LengthConfig::Trace(t) => {
                let split = match (&t.reason_ratio, t.format) {
                    (_, TraceFormat::Kvfleet) => "explicit split".to_string(),
                    (Some(ReasonRatioConfig::Fixed { value }), _) => format!("reason ratio {value}"),
                    (Some(ReasonRatioConfig::Servegen { pmf }), _) => {
                        format!("reason ratio drawn from {}", pmf_name(pmf))
                    }
                    (None, _) => format!("reason ratio drawn from {}", pmf_name(&None)),
                };
                format!("lengths from {} trace {} ({split})", t.format.name(), t.path.display())
            }
        };
        let content = match (&self.prefix, &self.lengths) {
            (Some(p), _) => p.describe(),
            (None, LengthConfig::Trace(t)) if t.format == TraceFormat::Mooncake => {
                "content ids from the trace's `hash_ids`".to_string()
            }
            _ => "no content ids: nothing shared".to_string(),
        };
        format!("seed {}; {arrivals}; {lengths}; {content}", self.seed)
    }
}

fn resolve(base_dir: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base_dir.join(p)
    }
}

/// The per-request length source, opened once (files read and parsed up front).
enum LengthSource<'a> {
    Servegen { pmf: PmfRef, joint: Joint },
    Lognormal(&'a LognormalLengths),
    Fixed(&'a FixedLengths),
    Trace { rows: Vec<TraceRow>, ratio: RatioSource },
}

enum RatioSource {
    Fixed(f64),
    Pmf(PmfRef),
}

impl LengthSource<'_> {
    /// Content ids of request `i`: its trace row's (Mooncake `hash_ids`), none otherwise.
    fn content_ids(&self, i: usize) -> &[u64] {
        match self {
            LengthSource::Trace { rows, .. } => &rows[i % rows.len()].content_ids,
            _ => &[],
        }
    }

    /// (prompt, reasoning, answer) of request `i`.
    #[inline]
    fn draw(&self, i: usize, rng: &mut SimRng) -> (u32, u32, u32) {
        match self {
            LengthSource::Servegen { pmf, joint } => sample_servegen(pmf.get(), *joint, rng),
            LengthSource::Lognormal(l) => sample_lognormal(l, rng),
            LengthSource::Fixed(f) => (f.prompt_tokens, f.reasoning_tokens, f.answer_tokens),
            LengthSource::Trace { rows, ratio } => {
                let row = &rows[i % rows.len()];
                match row.output {
                    TraceOutput::Split { reasoning_tokens, answer_tokens } => {
                        (row.prompt_tokens, reasoning_tokens, answer_tokens)
                    }
                    TraceOutput::Total(output) => {
                        let r = match ratio {
                            RatioSource::Fixed(v) => *v,
                            RatioSource::Pmf(p) => p.get().quantile(PmfField::ReasonRatio, rng.f64()),
                        };
                        let (reasoning, answer) = split_output(output, r);
                        (row.prompt_tokens, reasoning, answer)
                    }
                }
            }
        }
    }
}

/// Generates the workload: requests sorted by arrival (ties keep source order), ids `0..n`, the
/// first arrival relative to time zero. Relative paths resolve against `base_dir` (the config
/// file's directory). Deterministic in `cfg.seed`.
pub fn generate(cfg: &WorkloadConfig, base_dir: &Path) -> Result<Vec<RequestSpec>, WorkloadError> {
    cfg.validate()?;
    let root = SimRng::seed_from_u64(cfg.seed);
    let mut arrival_rng = root.fork(STREAM_ARRIVALS);
    let mut length_rng = root.fork(STREAM_LENGTHS);
    let mut prefix_rng = root.fork(STREAM_PREFIX);
    let prefix = cfg.prefix.as_ref().map(PrefixSampler::new);
    let scale = Scale { rate_scale: cfg.rate_scale, time_scale: cfg.time_scale };
    let default_n = match (cfg.synthetic_rate(), cfg.duration_s) {
        (Some(_), None) => DEFAULT_NUM_REQUESTS,
        _ => MAX_REQUESTS,
    };
    let stop = Stop {
        max_requests: cfg.num_requests.unwrap_or(default_n),
        horizon: cfg.duration_s.map(Timestamp::from_secs_f64).unwrap_or(Timestamp::MAX),
    };

    let mut length_rows = match &cfg.lengths {
        LengthConfig::Trace(t) => Some(load_trace(&resolve(base_dir, &t.path), t.format)?),
        _ => None,
    };

    let arrivals = match &cfg.arrivals {
        ArrivalConfig::Poisson { rate } => synthetic_arrivals(*rate, None, scale, stop, &mut arrival_rng)?,
        ArrivalConfig::Gamma { rate, cv } => synthetic_arrivals(*rate, Some(*cv), scale, stop, &mut arrival_rng)?,
        ArrivalConfig::Steps { cv, phases } => phased_arrivals(phases, *cv, scale, stop, &mut arrival_rng)?,
        ArrivalConfig::Trace { path: None, .. } => {
            // Replaying the length trace: sort its rows so request i keeps row i's lengths.
            let rows = length_rows.as_mut().ok_or_else(|| invalid("arrivals.path", "required"))?;
            rows.sort_by_key(|r| r.arrival_ns);
            let raw: Vec<u64> = rows.iter().map(|r| r.arrival_ns).collect();
            replay_times(&raw, scale, stop)
        }
        ArrivalConfig::Trace { path: Some(path), format } => {
            let format = format.ok_or_else(|| invalid("arrivals.format", "required with `arrivals.path`"))?;
            let mut raw: Vec<u64> =
                load_trace(&resolve(base_dir, path), format)?.into_iter().map(|r| r.arrival_ns).collect();
            raw.sort_unstable();
            replay_times(&raw, scale, stop)
        }
    };

    let source = match &cfg.lengths {
        LengthConfig::Servegen { pmf, joint } => {
            let path = pmf.as_deref().map(|p| resolve(base_dir, p));
            LengthSource::Servegen { pmf: PmfRef::open(path.as_deref())?, joint: *joint }
        }
        LengthConfig::Lognormal(l) => LengthSource::Lognormal(l),
        LengthConfig::Fixed(f) => LengthSource::Fixed(f),
        LengthConfig::Trace(t) => {
            let ratio = match &t.reason_ratio {
                // Kvfleet rows carry their split and never consult the ratio.
                _ if t.format == TraceFormat::Kvfleet => RatioSource::Fixed(0.0),
                Some(ReasonRatioConfig::Fixed { value }) => RatioSource::Fixed(*value),
                Some(ReasonRatioConfig::Servegen { pmf: Some(p) }) => {
                    RatioSource::Pmf(PmfRef::open(Some(&resolve(base_dir, p)))?)
                }
                Some(ReasonRatioConfig::Servegen { pmf: None }) | None => RatioSource::Pmf(PmfRef::open(None)?),
            };
            let rows = length_rows.take().ok_or_else(|| invalid("lengths.path", "trace not loaded"))?;
            LengthSource::Trace { rows, ratio }
        }
    };

    let output = |i: usize, rng: &mut SimRng| {
        let (prompt, reasoning, answer) = source.draw(i, rng);
        let (reasoning, answer) =
            cfg.max_output_tokens.map_or((reasoning, answer.max(1)), |c| cap_output(reasoning, answer.max(1), c));
        (prompt, reasoning, answer)
    };
    // Multi-turn conversations: each arrival starts one; their turns, in arrival order.
    let turns = match &prefix {
        Some(p) if p.multi_turn() => {
            let n = arrivals.len();
            let draw = |k: usize| {
                let (_, reasoning, answer) = output(k, &mut length_rng);
                (reasoning, answer)
            };
            Some(p.conversations(&arrivals, n, draw, &mut prefix_rng))
        }
        _ => None,
    };
    let mut out = Vec::with_capacity(arrivals.len());
    // Each request's arrival, and its (prompt, reasoning, answer, content ids) when drawn already.
    type Drawn = (u32, u32, u32, Vec<u64>);
    let requests: Vec<(Timestamp, Option<Drawn>)> = match turns {
        Some(turns) => turns.into_iter().map(|(at, p, r, a, ids)| (at, Some((p, r, a, ids)))).collect(),
        None => arrivals.into_iter().map(|at| (at, None)).collect(),
    };
    for (i, (arrival, turn)) in requests.into_iter().enumerate() {
        let (prompt, reasoning, answer, mut content_ids) = match turn {
            Some(turn) => turn,
            None => {
                let (prompt, reasoning, answer) = output(i, &mut length_rng);
                let (prompt, content_ids) = match &prefix {
                    Some(p) => p.draw(i, reasoning.saturating_add(answer), &mut prefix_rng),
                    None => (prompt, source.content_ids(i).to_vec()),
                };
                (prompt, reasoning, answer, content_ids)
            }
        };
        let prompt = cfg.max_prompt_tokens.map_or(prompt, |c| prompt.min(c)).max(1);
        // A clipped prompt keeps only the ids of what is left of it.
        content_ids.truncate(prompt.div_ceil(TRACE_BLOCK_TOKENS) as usize);
        let spec = RequestSpec {
            content_ids,
            id: RequestId(i as u64),
            arrival,
            prompt_tokens: prompt,
            reasoning_tokens: reasoning,
            answer_tokens: answer,
        };
        spec.check_lengths().map_err(|m| invalid("lengths", format!("request {i}: {m}")))?;
        if arrival > RUN_LIMIT {
            let message = format!(
                "request {i} arrives at {:.3e} s, later than a run may last ({} s); check the trace's timestamps and `time_scale`",
                arrival.as_secs_f64(),
                RUN_LIMIT.as_secs_f64()
            );
            return Err(invalid("arrivals", message));
        }
        out.push(spec);
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
