//! Arrival processes: Poisson, gamma (bursty), rate steps and trace replay, with rate and time
//! scaling.
//!
//! PASCAL (§V) sweeps the request rate on Poisson arrivals; production reasoning traffic is
//! burstier (ServeGen fits Gamma/Weibull inter-arrival laws per client), hence the gamma process
//! with a chosen coefficient of variation. A stepped process changes its rate at set times (a
//! load step that a role-flipping scheduler must follow). Traces keep their own timestamps, made
//! relative to their first request and compressed or stretched by `rate_scale` / `time_scale`.

use super::traces::TraceFormat;
use super::WorkloadError;
use crate::rng::SimRng;
use crate::time::Timestamp;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// When requests arrive (`[arrivals]` in TOML, selected by `kind`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ArrivalConfig {
    /// Exponential inter-arrival gaps.
    Poisson {
        /// Mean arrival rate, requests per second (before `rate_scale`).
        rate: f64,
    },
    /// Gamma inter-arrival gaps with shape 1/cv² and scale 1/(rate·shape): the same mean rate as
    /// Poisson, burstier when `cv` > 1.
    Gamma {
        /// Mean arrival rate, requests per second (before `rate_scale`).
        rate: f64,
        /// Coefficient of variation of the gaps (1 = Poisson).
        cv: f64,
    },
    /// Poisson (or gamma, with `cv`) arrivals whose rate steps from phase to phase; no arrival
    /// after the last phase ends.
    Steps {
        /// Coefficient of variation of the gaps inside each phase (absent: 1, Poisson).
        #[serde(default)]
        cv: Option<f64>,
        /// The phases in order, each `{ rate, duration_s }`; a rate of 0 is a silent phase.
        phases: Vec<RatePhase>,
    },
    /// Replay a trace file's own timestamps.
    Trace {
        /// Trace whose timestamps to replay. Absent: the `lengths` trace (which must then be a
        /// trace), so that each request keeps its own row's lengths.
        #[serde(default)]
        path: Option<PathBuf>,
        /// Format of `path` (required with `path`).
        #[serde(default)]
        format: Option<TraceFormat>,
    },
}

/// One phase of [`ArrivalConfig::Steps`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RatePhase {
    /// Mean arrival rate in this phase, requests per second (before `rate_scale`); 0 = none.
    pub rate: f64,
    /// How long the phase lasts, seconds (before `time_scale`).
    pub duration_s: f64,
}

impl ArrivalConfig {
    /// The TOML `kind` of this process.
    pub fn kind(&self) -> &'static str {
        match self {
            ArrivalConfig::Poisson { .. } => "poisson",
            ArrivalConfig::Gamma { .. } => "gamma",
            ArrivalConfig::Steps { .. } => "steps",
            ArrivalConfig::Trace { .. } => "trace",
        }
    }
}

impl Default for ArrivalConfig {
    fn default() -> Self {
        ArrivalConfig::Poisson { rate: 1.0 }
    }
}

/// When a generation loop must stop.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stop {
    /// At most this many requests.
    pub max_requests: u64,
    /// No arrival after this time.
    pub horizon: Timestamp,
}

/// Time scaling applied to every arrival: t' = t × time_scale ÷ rate_scale.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scale {
    pub rate_scale: f64,
    pub time_scale: f64,
}

impl Scale {
    fn stretch(self) -> f64 {
        self.time_scale / self.rate_scale
    }
}

/// Arrival times of a Poisson or gamma process starting at zero (the first request arrives one
/// gap after zero). `rate` and `cv` are already validated; `cv` is `None` for Poisson.
pub(crate) fn synthetic_arrivals(
    rate: f64,
    cv: Option<f64>,
    scale: Scale,
    stop: Stop,
    rng: &mut SimRng,
) -> Result<Vec<Timestamp>, WorkloadError> {
    phased_arrivals(&[RatePhase { rate, duration_s: f64::INFINITY }], cv, scale, stop, rng)
}

/// Arrival times of a process whose rate steps through `phases` (already validated), starting
/// at zero. Inside a phase the gaps are exponential (`cv` None) or gamma; a gap that would
/// overshoot the phase's end is dropped and the next phase starts drawing at that end (exact for
/// Poisson, which has no memory).
pub(crate) fn phased_arrivals(
    phases: &[RatePhase],
    cv: Option<f64>,
    scale: Scale,
    stop: Stop,
    rng: &mut SimRng,
) -> Result<Vec<Timestamp>, WorkloadError> {
    let capacity = stop.max_requests.min(1 << 20) as usize;
    let mut out = Vec::with_capacity(capacity);
    let mut start_s = 0.0f64;
    for phase in phases {
        let end_s = start_s + phase.duration_s * scale.time_scale;
        let rate = phase.rate * scale.rate_scale;
        let gamma = cv.map(|cv| {
            let shape = 1.0 / (cv * cv);
            (shape, 1.0 / (rate * shape))
        });
        let mut t_s = start_s;
        while rate > 0.0 && (out.len() as u64) < stop.max_requests {
            let gap_s = match gamma {
                None => rng.exponential(rate),
                Some((shape, scale_s)) => rng.gamma(shape, scale_s),
            };
            t_s += gap_s * scale.time_scale;
            if t_s > end_s {
                break;
            }
            let t = Timestamp::from_secs_f64(t_s);
            if t > stop.horizon {
                return Ok(out);
            }
            if out.len() as u64 >= super::MAX_REQUESTS {
                return Err(too_many());
            }
            out.push(t);
        }
        start_s = end_s;
    }
    Ok(out)
}

/// Scales raw, sorted trace timestamps (ns in the trace's clock) to run time: relative to the
/// first one, stretched by time_scale ÷ rate_scale, cut at `stop`.
pub(crate) fn replay_times(raw_sorted_ns: &[u64], scale: Scale, stop: Stop) -> Vec<Timestamp> {
    let Some(&t0) = raw_sorted_ns.first() else { return Vec::new() };
    let stretch = scale.stretch();
    raw_sorted_ns
        .iter()
        .map(|&t| Timestamp(((t - t0) as f64 * stretch).round() as u64))
        .take_while(|&t| t <= stop.horizon)
        .take(stop.max_requests.min(usize::MAX as u64) as usize)
        .collect()
}

fn too_many() -> WorkloadError {
    WorkloadError::Invalid {
        field: "num_requests".into(),
        message: format!(
            "more than {} requests would be generated; set `num_requests` or shorten `duration_s`",
            super::MAX_REQUESTS
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UNLIMITED: Stop = Stop { max_requests: 200_000, horizon: Timestamp::MAX };
    const UNIT: Scale = Scale { rate_scale: 1.0, time_scale: 1.0 };

    /// Mean and coefficient of variation of the gaps, in seconds.
    fn gap_stats(times: &[Timestamp]) -> (f64, f64) {
        let mut prev = 0.0;
        let gaps: Vec<f64> = times
            .iter()
            .map(|t| {
                let s = t.as_secs_f64();
                let g = s - prev;
                prev = s;
                g
            })
            .collect();
        let n = gaps.len() as f64;
        let mean = gaps.iter().sum::<f64>() / n;
        let var = gaps.iter().map(|g| (g - mean) * (g - mean)).sum::<f64>() / (n - 1.0);
        (mean, var.sqrt() / mean)
    }

    #[test]
    fn poisson_gaps_have_mean_one_over_rate_and_cv_one() {
        let mut rng = SimRng::seed_from_u64(11);
        let t = synthetic_arrivals(4.0, None, UNIT, UNLIMITED, &mut rng).unwrap();
        assert_eq!(t.len(), 200_000);
        let (mean, cv) = gap_stats(&t);
        assert!((mean - 0.25).abs() < 0.25 * 0.01, "mean gap {mean}");
        assert!((cv - 1.0).abs() < 0.02, "cv {cv}");
        assert!(t.windows(2).all(|w| w[0] <= w[1]));
    }

    /// (rate, cv): the gaps keep mean 1/rate and reach the requested CV.
    #[test]
    fn gamma_gaps_reach_the_requested_cv() {
        for &(rate, cv_want) in &[(2.0, 0.5), (2.0, 2.0), (10.0, 3.0)] {
            let mut rng = SimRng::seed_from_u64(5);
            let t = synthetic_arrivals(rate, Some(cv_want), UNIT, UNLIMITED, &mut rng).unwrap();
            let (mean, cv) = gap_stats(&t);
            assert!((mean * rate - 1.0).abs() < 0.02, "rate {rate} cv {cv_want}: mean gap {mean}");
            assert!((cv / cv_want - 1.0).abs() < 0.05, "rate {rate}: cv {cv} want {cv_want}");
        }
    }

    #[test]
    fn rate_scale_doubles_the_rate_and_time_scale_stretches() {
        let base = synthetic_arrivals(3.0, None, UNIT, UNLIMITED, &mut SimRng::seed_from_u64(1)).unwrap();
        let fast = synthetic_arrivals(
            3.0,
            None,
            Scale { rate_scale: 2.0, time_scale: 1.0 },
            UNLIMITED,
            &mut SimRng::seed_from_u64(1),
        )
        .unwrap();
        let slow = synthetic_arrivals(
            3.0,
            None,
            Scale { rate_scale: 1.0, time_scale: 2.0 },
            UNLIMITED,
            &mut SimRng::seed_from_u64(1),
        )
        .unwrap();
        let (m0, _) = gap_stats(&base);
        let (m2, _) = gap_stats(&fast);
        let (ms, _) = gap_stats(&slow);
        assert!((m0 / m2 - 2.0).abs() < 1e-6, "{m0} / {m2}");
        assert!((ms / m0 - 2.0).abs() < 1e-6, "{ms} / {m0}");
    }

    #[test]
    fn horizon_and_count_stop_generation() {
        let stop = Stop { max_requests: u64::MAX, horizon: Timestamp::from_secs_f64(100.0) };
        let t = synthetic_arrivals(5.0, Some(1.5), UNIT, stop, &mut SimRng::seed_from_u64(2)).unwrap();
        assert!((400..600).contains(&t.len()), "{}", t.len());
        assert!(t.last().unwrap() <= &stop.horizon);
        let stop = Stop { max_requests: 7, horizon: Timestamp::MAX };
        assert_eq!(synthetic_arrivals(5.0, None, UNIT, stop, &mut SimRng::seed_from_u64(2)).unwrap().len(), 7);
    }

    /// A stepped process keeps each phase's rate inside its window, and none after the last.
    #[test]
    fn stepped_arrivals_follow_each_phases_rate() {
        let phases = [
            RatePhase { rate: 2.0, duration_s: 500.0 },
            RatePhase { rate: 0.0, duration_s: 100.0 },
            RatePhase { rate: 10.0, duration_s: 300.0 },
        ];
        let t = phased_arrivals(&phases, None, UNIT, UNLIMITED, &mut SimRng::seed_from_u64(4)).unwrap();
        let count = |lo: f64, hi: f64| t.iter().filter(|x| (lo..hi).contains(&x.as_secs_f64())).count() as f64;
        assert!((count(0.0, 500.0) / 1000.0 - 1.0).abs() < 0.1, "{}", count(0.0, 500.0));
        assert_eq!(count(500.0, 600.0), 0.0);
        assert!((count(600.0, 900.0) / 3000.0 - 1.0).abs() < 0.05, "{}", count(600.0, 900.0));
        assert!(t.last().unwrap().as_secs_f64() <= 900.0);
        assert!(t.windows(2).all(|w| w[0] <= w[1]));
        // rate_scale scales every phase's rate, time_scale stretches the phases
        let scaled = Scale { rate_scale: 2.0, time_scale: 2.0 };
        let t2 = phased_arrivals(&phases, Some(2.0), scaled, UNLIMITED, &mut SimRng::seed_from_u64(4)).unwrap();
        let late = t2.iter().filter(|x| x.as_secs_f64() >= 1200.0).count() as f64;
        assert!(t2.last().unwrap().as_secs_f64() <= 1800.0);
        assert!((late / 6000.0 - 1.0).abs() < 0.1, "{late}");
        assert!(!t2.iter().any(|x| (1000.0..1200.0).contains(&x.as_secs_f64())));
    }

    #[test]
    fn replay_is_relative_scaled_and_cut() {
        let raw = [1_000_000_000u64, 1_500_000_000, 3_000_000_000, 9_000_000_000];
        let t = replay_times(&raw, UNIT, UNLIMITED);
        assert_eq!(t, vec![Timestamp(0), Timestamp(500_000_000), Timestamp(2_000_000_000), Timestamp(8_000_000_000)]);
        let t = replay_times(&raw, Scale { rate_scale: 2.0, time_scale: 1.0 }, UNLIMITED);
        assert_eq!(t[3], Timestamp(4_000_000_000));
        let t = replay_times(&raw, Scale { rate_scale: 1.0, time_scale: 0.5 }, UNLIMITED);
        assert_eq!(t[2], Timestamp(1_000_000_000));
        let t = replay_times(&raw, UNIT, Stop { max_requests: 10, horizon: Timestamp::from_secs_f64(2.0) });
        assert_eq!(t.len(), 3);
        let t = replay_times(&raw, UNIT, Stop { max_requests: 2, horizon: Timestamp::MAX });
        assert_eq!(t.len(), 2);
        assert!(replay_times(&[], UNIT, UNLIMITED).is_empty());
    }
}
