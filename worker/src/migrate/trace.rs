//! Spans of live migrations (docs/tracing.md, "Migrations"), made from the machines' reports.
//!
//! The sans-IO machines record when each phase happened on the cluster clock; the spans are
//! built from those records after the fact, so a trace shows exactly the times the metrics and
//! the coordinator's `MigrationStats` were computed from. Only the enclosing span is opened at
//! the start: its context travels in `Prepare.trace_context` so the target's spans join it.

use crate::clock::ClusterClock;
use kvfleet_core::{RequestId, Timestamp};
use kvfleet_netmodel::migration::{AbortReason, MigrationId, MigrationReport, Outcome, TargetReport};
use kvfleet_telemetry::{extract, unix_time, Carrier, Context, KeyValue, OpenSpan};

/// How the link a migration crosses is shaped (0 rate: unshaped).
#[derive(Clone, Copy, Debug, Default)]
pub struct LinkShape {
    /// Rate limit, Gbit/s (`--link-gbps`; 0: unshaped).
    pub gbps: f64,
    /// Added one-way latency, µs (`--link-latency-us`).
    pub latency_us: f64,
}

fn int(key: &'static str, v: impl TryInto<i64>) -> KeyValue {
    KeyValue::new(key, v.try_into().unwrap_or(i64::MAX))
}

fn ms(d: kvfleet_core::TimeSpan) -> f64 {
    d.as_millis_f64()
}

/// What the source calls an outcome in spans.
pub fn outcome_name(o: Option<&Outcome>) -> &'static str {
    match o {
        Some(Outcome::Committed) => "committed",
        Some(Outcome::Aborted(AbortReason::Refused(_))) => "refused",
        Some(Outcome::Aborted(_)) => "aborted",
        Some(Outcome::Unknown(_)) | None => "unknown",
    }
}

/// The source side of one migration: the `migration` span, open while it runs.
pub struct SourceTrace {
    span: OpenSpan,
    epoch_unix_ns: u64,
}

impl SourceTrace {
    /// Open `migration` under the request's context (`parent`, from `MigrateOut`'s metadata).
    pub fn start(
        parent: &Context,
        clock: &ClusterClock,
        now: Timestamp,
        id: MigrationId,
        request: RequestId,
        (source, target): (u32, Option<u32>),
        link: LinkShape,
    ) -> SourceTrace {
        let target_attr = target.map_or(-1, i64::from);
        let link_name = match target {
            Some(t) => format!("{source}->{t}"),
            None => format!("{source}->?"),
        };
        let attrs = vec![
            KeyValue::new("kvfleet.migration.id", id.to_string()),
            int("kvfleet.request.id", request.0),
            int("kvfleet.migration.source", source),
            KeyValue::new("kvfleet.migration.target", target_attr),
            KeyValue::new("kvfleet.link", link_name),
            KeyValue::new("kvfleet.link.gbps", if link.gbps.is_finite() { link.gbps } else { 0.0 }),
            KeyValue::new("kvfleet.link.latency_us", link.latency_us),
        ];
        let epoch_unix_ns = clock.epoch_unix_ns();
        let span = OpenSpan::start("migration", parent, unix_time(epoch_unix_ns + now.0), attrs);
        SourceTrace { span, epoch_unix_ns }
    }

    /// The context for `Prepare.trace_context`.
    pub fn carrier(&self) -> Carrier {
        self.span.carrier()
    }

    fn at(&self, t: Timestamp) -> std::time::SystemTime {
        unix_time(self.epoch_unix_ns + t.0)
    }

    /// The request finished on the source while its KV was copied: nothing was moved.
    pub fn finish_vanished(mut self, now: Timestamp) {
        self.span.set([
            KeyValue::new("kvfleet.migration.outcome", "finished"),
            KeyValue::new("kvfleet.migration.abort_reason", "the request finished on the source during the copy"),
        ]);
        let end = self.at(now);
        self.span.end(end);
    }

    /// Record every phase of `r` and end the span at the migration's end (`now` if it has none).
    pub fn finish(mut self, r: &MigrationReport, now: Timestamp) {
        let end = r.finished_at.unwrap_or(now);
        let started = r.started.unwrap_or(r.created);
        let blocks: u64 = r.stages.iter().map(|s| u64::from(s.blocks)).sum();
        let mut attrs = vec![
            int("kvfleet.migration.kv_tokens", r.kv_tokens_final.unwrap_or(r.kv_tokens_start)),
            int("kvfleet.migration.blocks", blocks),
            int("kvfleet.migration.bytes", r.bytes),
            int("kvfleet.migration.stages", r.stages.len()),
            KeyValue::new("kvfleet.migration.outcome", outcome_name(r.outcome.as_ref())),
            KeyValue::new("kvfleet.migration.total_ms", end.saturating_since(started).as_millis_f64()),
        ];
        if let Some(d) = r.downtime {
            attrs.push(KeyValue::new("kvfleet.migration.downtime_ms", ms(d)));
        }
        if let Some(g) = r.goodput_bytes_per_s {
            attrs.push(KeyValue::new("kvfleet.migration.goodput_gbps", g * 8e-9));
        }
        let abort_reason = match &r.outcome {
            Some(Outcome::Aborted(e)) | Some(Outcome::Unknown(e)) => Some(e.to_string()),
            _ => None,
        };
        if let Some(reason) = &abort_reason {
            attrs.push(KeyValue::new("kvfleet.migration.abort_reason", reason.clone()));
        }
        self.span.set(attrs);

        if r.started.is_some() {
            let answered = r.stages.first().map_or(end, |s| s.started);
            self.span.child("migration.prepare", self.at(started), self.at(answered), vec![]);
        }
        for s in &r.stages {
            let attrs = vec![
                int("kvfleet.stage.index", s.stage),
                int("kvfleet.stage.blocks", s.blocks),
                int("kvfleet.stage.bytes", s.bytes),
            ];
            if s.final_stage {
                let sent = s.sent.or(s.ended).unwrap_or(end);
                self.span.child("migration.stop_copy", self.at(s.started), self.at(sent), attrs);
            } else {
                let acked = s.ended.or(s.sent).unwrap_or(end);
                self.span.child("migration.stage", self.at(s.started), self.at(acked), attrs);
            }
        }
        if let (Some(asked), Some(paused)) = (r.pause_requested_at, r.paused_at) {
            self.span.child("migration.pause", self.at(asked), self.at(paused), vec![]);
        }
        if let Some(sent) = r.commit_sent_at {
            self.span.child("migration.commit", self.at(sent), self.at(end), vec![]);
        }
        let aborted = matches!(r.outcome, Some(Outcome::Aborted(_)));
        if let Some(reason) = abort_reason.filter(|_| aborted) {
            let attrs = vec![KeyValue::new("kvfleet.migration.abort_reason", reason)];
            self.span.child("migration.abort", self.at(end), self.at(end), attrs);
        }
        if let (Some(paused), Some(d)) = (r.paused_at, r.downtime) {
            let attrs = vec![KeyValue::new("kvfleet.migration.downtime_ms", ms(d))];
            self.span.child("migration.downtime", self.at(paused), self.at(paused + d), attrs);
        }
        let end = self.at(end);
        self.span.end(end);
    }
}

/// The target side of one migration: `migration.target` and its phases, timed by the driver.
pub struct TargetTrace {
    span: OpenSpan,
    epoch_unix_ns: u64,
}

impl TargetTrace {
    /// Open `migration.target` under the source's `migration` span (`Prepare.trace_context`).
    pub fn start(
        trace_context: &Carrier,
        clock: &ClusterClock,
        now: Timestamp,
        id: MigrationId,
        request: RequestId,
        instance: u32,
    ) -> TargetTrace {
        let attrs = vec![
            KeyValue::new("kvfleet.migration.id", id.to_string()),
            int("kvfleet.request.id", request.0),
            int("kvfleet.instance", instance),
        ];
        let epoch_unix_ns = clock.epoch_unix_ns();
        let span =
            OpenSpan::start("migration.target", &extract(trace_context), unix_time(epoch_unix_ns + now.0), attrs);
        TargetTrace { span, epoch_unix_ns }
    }

    /// Record a phase `[from, to]` (`migration.reserve`, `.verify`, `.attach`).
    pub fn phase(&self, name: &'static str, from: Timestamp, to: Timestamp, blocks: Option<u64>) {
        let attrs = blocks.map(|b| vec![int("kvfleet.migration.blocks", b)]).unwrap_or_default();
        self.span.child(name, unix_time(self.epoch_unix_ns + from.0), unix_time(self.epoch_unix_ns + to.0), attrs);
    }

    /// Tag the outcome and end the span at the target's finish time (`now` if it never finished).
    pub fn finish(mut self, r: &TargetReport, now: Timestamp) {
        self.span.set([KeyValue::new("kvfleet.migration.outcome", outcome_name(r.outcome.as_ref()))]);
        let end = unix_time(self.epoch_unix_ns + r.finished_at.unwrap_or(now).0);
        self.span.end(end);
    }
}
