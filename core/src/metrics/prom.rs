//! Prometheus text exposition (format 0.0.4) helpers: a cumulative histogram and gauge/counter
//! lines. Pure string formatting, shared by the worker's and the coordinator's `/metrics`.

use std::fmt::Write as _;

/// Latency buckets (seconds), vLLM's TTFT buckets extended for reasoning-length waits.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 320.0,
];

/// A cumulative Prometheus histogram.
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram with these bucket upper bounds (`le`), ascending.
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    /// An empty histogram over [`LATENCY_BUCKETS`] (seconds).
    pub fn latency() -> Histogram {
        Histogram::new(LATENCY_BUCKETS)
    }

    /// Record one sample; non-finite values are ignored.
    pub fn observe(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Samples recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of the samples recorded.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// Append HELP/TYPE, cumulative `_bucket`, `_sum` and `_count` lines to `out`; `labels` is
    /// `k="v",...` without braces (may be empty).
    pub fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c;
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// One gauge or counter sample with its HELP and TYPE lines (`kind`: "gauge" or "counter").
pub fn gauge(out: &mut String, name: &str, help: &str, kind: &str, labels: &str, v: f64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {v}");
}
