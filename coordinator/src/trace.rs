//! Request traces (docs/tracing.md, "Requests"): the leader opens a `request` span when it
//! accepts a request, records its `placement`, hands the trace context to the worker with
//! `Submit` and `MigrateOut` (W3C `traceparent` in the gRPC metadata, so the workers' migration
//! spans join the trace), and when the finished record arrives ends the span with the phases the
//! worker measured (`request.queued`, `.prefill`, `.reasoning`, `.blocked`, `.answering`).

use kvfleet_core::metrics::RequestRecord;
use kvfleet_core::policy::LoadReport;
use kvfleet_core::{InstanceId, RequestId, RequestSpec, Timestamp};
use kvfleet_telemetry::{unix_time, Context, KeyValue, OpenSpan};
use std::collections::HashMap;
use std::sync::Mutex;

fn int(key: &'static str, v: impl Into<i64>) -> KeyValue {
    KeyValue::new(key, v.into())
}

/// Why the policy chose what it chose, as span attributes.
#[derive(Clone, Debug)]
pub struct PlacementNote {
    /// Live instances the policy chose among.
    pub candidates: usize,
    /// The instance it placed the request on.
    pub chosen: InstanceId,
    /// One line: the policy, and the chosen instance's load when it decided.
    pub reason: String,
}

impl PlacementNote {
    /// `loads` are what the policy saw; `chosen` what it picked.
    pub fn new(policy: &str, loads: &[LoadReport], chosen: InstanceId) -> PlacementNote {
        let reason = match loads.iter().find(|l| l.instance == chosen) {
            Some(l) => format!(
                "{policy}: chose instance {} (KV {}/{} blocks used, {} waiting, {} reasoning, {} answering) of {} live",
                chosen.0,
                l.gpu_used_blocks,
                l.gpu_total_blocks,
                l.waiting_requests,
                l.reasoning_requests,
                l.answering_requests,
                loads.len()
            ),
            None => format!("{policy}: chose instance {} of {} live", chosen.0, loads.len()),
        };
        PlacementNote { candidates: loads.len(), chosen, reason }
    }
}

/// The open `request` spans of the requests this leader follows.
pub struct RequestTraces {
    epoch_unix_ns: u64,
    policy: String,
    open: Mutex<HashMap<RequestId, OpenSpan>>,
}

impl RequestTraces {
    /// No open spans; cluster times are placed on the wall clock at `epoch_unix_ns`, spans name `policy`.
    pub fn new(epoch_unix_ns: u64, policy: &str) -> RequestTraces {
        RequestTraces { epoch_unix_ns, policy: policy.to_string(), open: Mutex::new(HashMap::new()) }
    }

    fn at(&self, t: Timestamp) -> std::time::SystemTime {
        unix_time(self.epoch_unix_ns + t.0)
    }

    /// Open `spec`'s span at its arrival. `resumed`: a previous leader accepted it (its first
    /// span ended with that leader; this one covers the rest).
    pub fn open(&self, spec: &RequestSpec, resumed: bool) {
        let mut attrs = vec![
            int("kvfleet.request.id", spec.id.0 as i64),
            int("kvfleet.request.prompt_tokens", spec.prompt_tokens),
            int("kvfleet.request.reasoning_tokens", spec.reasoning_tokens),
            int("kvfleet.request.answer_tokens", spec.answer_tokens),
            KeyValue::new("kvfleet.policy", self.policy.clone()),
        ];
        if resumed {
            attrs.push(KeyValue::new("kvfleet.request.resumed", true));
        }
        let span = OpenSpan::start("request", &Context::new(), self.at(spec.arrival), attrs);
        self.open.lock().expect("traces lock").insert(spec.id, span);
    }

    /// Record the placement decision, made at cluster time `now`.
    pub fn placement(&self, id: RequestId, now: Timestamp, note: &PlacementNote) {
        let open = self.open.lock().expect("traces lock");
        if let Some(span) = open.get(&id) {
            let attrs = vec![
                int("kvfleet.request.id", id.0 as i64),
                int("kvfleet.placement.candidates", note.candidates as i64),
                int("kvfleet.placement.chosen", note.chosen.0),
                KeyValue::new("kvfleet.placement.reason", note.reason.clone()),
            ];
            span.child("placement", self.at(now), self.at(now), attrs);
        }
    }

    /// The request's trace context (empty if it has no open span).
    pub fn context(&self, id: RequestId) -> Context {
        self.open.lock().expect("traces lock").get(&id).map(|s| s.context().clone()).unwrap_or_default()
    }

    /// The request finished: its phases as the worker measured them, then the end of its span.
    pub fn close(&self, rec: &RequestRecord) {
        let Some(mut span) = self.open.lock().expect("traces lock").remove(&rec.id) else { return };
        let phase = |name: &'static str, from: Option<Timestamp>, to: Option<Timestamp>, on: InstanceId| {
            if let (Some(from), Some(to)) = (from, to) {
                let attrs = vec![int("kvfleet.request.id", rec.id.0 as i64), int("kvfleet.instance", on.0)];
                span.child(name, self.at(from), self.at(to), attrs);
            }
        };
        let placed = rec.placed_on;
        let finished = rec.finished_on.unwrap_or(placed);
        phase("request.queued", Some(rec.arrival), rec.first_scheduled, placed);
        phase("request.prefill", rec.first_scheduled, rec.first_token, placed);
        if rec.reasoning_end.is_some() {
            phase("request.reasoning", rec.first_token, rec.reasoning_end, placed);
            phase("request.blocked", rec.reasoning_end, rec.first_scheduled_after_reasoning, finished);
        }
        let answer_from = rec.first_scheduled_after_reasoning.or(rec.first_answer_token).or(rec.first_token);
        phase("request.answering", answer_from, rec.finish, finished);
        let mut attrs = vec![
            int("kvfleet.request.preemptions", rec.preemptions),
            int("kvfleet.request.migrations", rec.migrations),
            int("kvfleet.request.placed_on", placed.0),
            int("kvfleet.request.finished_on", finished.0),
        ];
        if rec.rejected {
            attrs.push(KeyValue::new("kvfleet.request.rejected", true));
        }
        span.set(attrs);
        let end = rec.finish.unwrap_or(rec.arrival).max(rec.arrival);
        span.end(self.at(end));
    }
}
