//! Prometheus exposition for the workers' and the coordinators' `GET /metrics`, on the
//! [`prometheus_client`] crate.
//!
//! Each scrape fills an [`Exposition`]: a [`Registry`] whose every sample carries the
//! `model_name` label (vLLM labels its metrics so), with gauges and counters holding the values
//! of that moment, [`Family`]s for the metrics split by one more label (`outcome`,
//! `finished_reason`), and the processes' own long-lived [`Histogram`]s. It is encoded in the
//! Prometheus text format 0.0.4 ([`CONTENT_TYPE`]) by
//! [`prometheus_client::encoding::prometheus_text::encode`], which keeps the names vLLM's
//! dashboards expect: a counter registered as `vllm:num_preemptions` is exposed, in its HELP and
//! TYPE lines too, as `vllm:num_preemptions_total`; `:` in names is kept; histogram `le` labels
//! are written as Go's client writes them (`le="1"`, `le="0.25"`, `le="+Inf"`).
//!
//! prometheus-client has no summary type: [`Exposition::summary`] writes those few lines itself,
//! after the registry's.

use prometheus_client::encoding::EncodeGaugeValue;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::borrow::Cow;
use std::fmt::Write as _;

/// The `Content-Type` of an [`Exposition`]: the Prometheus text format, version 0.0.4.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Latency buckets (seconds): vLLM's TTFT buckets extended for reasoning-length waits.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 320.0,
];

/// An empty histogram with these bucket upper bounds (`le`, ascending; `+Inf` is implicit).
/// Clones share their counts: keep one where the samples are observed and hand clones to the
/// [`Exposition`]s.
pub fn histogram(bounds: &[f64]) -> Histogram {
    Histogram::new(bounds.iter().copied())
}

/// An empty histogram over [`LATENCY_BUCKETS`] (seconds).
pub fn latency_histogram() -> Histogram {
    histogram(LATENCY_BUCKETS)
}

/// A label set of one label (`outcome="committed"`).
type OneLabel = [(&'static str, &'static str); 1];

/// The metrics of one scrape of one process, every sample labelled `model_name`.
#[derive(Debug)]
pub struct Exposition {
    registry: Registry,
    /// `model_name="..."`, escaped, for the summaries written by hand.
    model_label: String,
    /// Summary families, in the text format already.
    summaries: String,
}

impl Exposition {
    /// An empty page for a process serving `model`.
    pub fn new(model: &str) -> Exposition {
        let label = (Cow::Borrowed("model_name"), Cow::Owned(model.to_string()));
        Exposition {
            registry: Registry::with_labels(std::iter::once(label)),
            model_label: format!("model_name=\"{}\"", escape_label_value(model)),
            summaries: String::new(),
        }
    }

    /// A gauge with its current value.
    pub fn gauge<N>(&mut self, name: &str, help: &str, value: N)
    where
        N: EncodeGaugeValue + Send + Sync + std::fmt::Debug + 'static,
    {
        self.registry.register(name, help_text(help), ConstGauge::new(value));
    }

    /// A counter with its current value; `name` is the exposed one, ending in `_total`.
    pub fn counter(&mut self, name: &str, help: &str, value: u64) {
        self.registry.register(counter_name(name), help_text(help), ConstCounter::new(value));
    }

    /// One counter family split by `label`: a sample per `(label value, count)`, zeros included;
    /// `name` is the exposed one, ending in `_total`.
    pub fn counters(&mut self, name: &str, help: &str, label: &'static str, values: &[(&'static str, u64)]) {
        let family = Family::<OneLabel, Counter>::default();
        for &(value, n) in values {
            family.get_or_create(&[(label, value)]).inc_by(n);
        }
        self.registry.register(counter_name(name), help_text(help), family);
    }

    /// A histogram (a clone of the observed one: the page reads its counts when encoded).
    pub fn histogram(&mut self, name: &str, help: &str, histogram: &Histogram) {
        self.registry.register(name, help_text(help), histogram.clone());
    }

    /// A summary: `quantiles` as `(quantile, value)` pairs (`("0.99", 0.004)`), with the sum and
    /// count of the samples.
    pub fn summary(&mut self, name: &str, help: &str, quantiles: &[(&str, f64)], sum: f64, count: u64) {
        let (out, l) = (&mut self.summaries, &self.model_label);
        let _ = writeln!(out, "# HELP {name} {}\n# TYPE {name} summary", escape_help(help));
        for (q, v) in quantiles {
            let _ = writeln!(out, "{name}{{{l},quantile=\"{q}\"}} {v}");
        }
        let _ = writeln!(out, "{name}_sum{{{l}}} {sum}\n{name}_count{{{l}}} {count}");
    }

    /// The page in the text format ([`CONTENT_TYPE`]).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
            .expect("encoding into a String cannot fail");
        out.push_str(&self.summaries);
        out
    }
}

/// The name to register a counter under: prometheus-client appends `_total` itself.
fn counter_name(exposed: &str) -> &str {
    exposed.strip_suffix("_total").unwrap_or_else(|| panic!("counter {exposed} must end in _total"))
}

/// prometheus-client ends every HELP text with a full stop: drop ours.
fn help_text(help: &str) -> &str {
    help.strip_suffix('.').unwrap_or(help)
}

fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

fn escape_label_value(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_labels_and_buckets_are_as_vllm_exposes_them() {
        let mut page = Exposition::new("m\"1");
        page.gauge("vllm:num_requests_running", "Requests running.", 3u32);
        page.gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage (1 = full).", 0.25);
        page.counter("vllm:num_preemptions_total", "Preemptions.", 2);
        page.counters(
            "kvfleet_migrations_total",
            "Migrations by outcome.",
            "outcome",
            &[("committed", 1), ("failed", 0)],
        );
        let h = histogram(&[0.5, 1.0, 2.5]);
        h.observe(0.75);
        h.observe(3.0);
        page.histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", &h);
        page.summary("kvfleet_lateness_seconds", "Lateness.", &[("0.5", 0.001), ("1", 0.25)], 0.5, 4);
        let text = page.encode();
        let m = "model_name=\"m\\\"1\"";
        let expected = [
            "# HELP vllm:num_requests_running Requests running.".to_string(),
            "# TYPE vllm:num_requests_running gauge".into(),
            format!("vllm:num_requests_running{{{m}}} 3"),
            "# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage (1 = full).".into(),
            "# TYPE vllm:gpu_cache_usage_perc gauge".into(),
            format!("vllm:gpu_cache_usage_perc{{{m}}} 0.25"),
            "# HELP vllm:num_preemptions_total Preemptions.".into(),
            "# TYPE vllm:num_preemptions_total counter".into(),
            format!("vllm:num_preemptions_total{{{m}}} 2"),
            "# HELP kvfleet_migrations_total Migrations by outcome.".into(),
            "# TYPE kvfleet_migrations_total counter".into(),
        ];
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[..expected.len()], expected, "{text}");
        // A family's samples come in no particular order.
        for outcome in ["committed\"} 1", "failed\"} 0"] {
            assert!(text.contains(&format!("kvfleet_migrations_total{{{m},outcome=\"{outcome}\n")), "{text}");
        }
        let rest = text.split_once("# HELP vllm:e2e_request_latency_seconds").expect("the histogram").1;
        let expected = [
            " Arrival to last token.".to_string(),
            "# TYPE vllm:e2e_request_latency_seconds histogram".into(),
            format!("vllm:e2e_request_latency_seconds_bucket{{{m},le=\"0.5\"}} 0"),
            format!("vllm:e2e_request_latency_seconds_bucket{{{m},le=\"1\"}} 1"),
            format!("vllm:e2e_request_latency_seconds_bucket{{{m},le=\"2.5\"}} 1"),
            format!("vllm:e2e_request_latency_seconds_bucket{{{m},le=\"+Inf\"}} 2"),
            format!("vllm:e2e_request_latency_seconds_sum{{{m}}} 3.75"),
            format!("vllm:e2e_request_latency_seconds_count{{{m}}} 2"),
            "# HELP kvfleet_lateness_seconds Lateness.".into(),
            "# TYPE kvfleet_lateness_seconds summary".into(),
            format!("kvfleet_lateness_seconds{{{m},quantile=\"0.5\"}} 0.001"),
            format!("kvfleet_lateness_seconds{{{m},quantile=\"1\"}} 0.25"),
            format!("kvfleet_lateness_seconds_sum{{{m}}} 0.5"),
            format!("kvfleet_lateness_seconds_count{{{m}}} 4"),
        ];
        assert_eq!(rest.lines().collect::<Vec<_>>(), expected, "{text}");
    }

    #[test]
    fn latency_buckets_are_ascending_and_end_before_inf() {
        assert!(LATENCY_BUCKETS.windows(2).all(|w| w[0] < w[1]));
        let text = {
            let mut page = Exposition::new("m");
            page.histogram("t_seconds", "T.", &latency_histogram());
            page.encode()
        };
        let les: Vec<&str> = text.lines().filter_map(|l| l.split("le=\"").nth(1)?.split('"').next()).collect();
        assert_eq!(les.len(), LATENCY_BUCKETS.len() + 1);
        assert_eq!(les[11], "1");
        assert_eq!(les.last(), Some(&"+Inf"));
    }

    #[test]
    #[should_panic(expected = "must end in _total")]
    fn counter_names_end_in_total() {
        Exposition::new("m").counter("vllm:num_preemptions", "Preemptions.", 1);
    }
}
