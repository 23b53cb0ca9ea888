//! Spans joined into what an experimenter asks about: one [`TracedMigration`] per `migration`
//! span, one [`RequestTimeline`] per `request` span, and distributions per policy and per link
//! (docs/tracing.md is the schema).
//!
//! Joins: a migration's source-side phases are its children; `migration.target` is its child
//! through `Prepare.trace_context` (or, if that parent never arrived, the `migration.target`
//! with the same `kvfleet.migration.id`), and `reserve`/`verify`/`attach` are the target span's
//! children. A migration's policy is the `kvfleet.policy` of the `request` span of its trace
//! (its parent, else any in the trace), `"unknown"` without one.
//!
//! Completeness: a migration is complete when every phase its outcome implies is present.
//! `committed`: `prepare`, `kvfleet.migration.stages − 1` live `stage`s, `pause`, `stop_copy`,
//! `commit`, `downtime`, and on the target `reserve`, `verify`, `attach`. `aborted`: `abort`,
//! plus `downtime` if it was paused, and every copy stage it counts. Other outcomes (`unknown`,
//! `finished`): every copy stage it counts. A missing span usually means a process died before
//! exporting, or an exporter dropped a batch.

use crate::otlp_json::SpanRecord;
use crate::stats::Percentiles;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// One phase of a migration, on the source or the target.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Phase {
    /// The span name without `migration.`: `prepare`, `stage`, `pause`, `stop_copy`, `commit`,
    /// `abort`, `downtime`, `target`, `reserve`, `verify`, `attach`.
    pub name: String,
    /// `source` or `target`.
    pub side: &'static str,
    /// Span start, Unix nanoseconds.
    pub start_ns: u64,
    /// Span end, Unix nanoseconds.
    pub end_ns: u64,
    /// Start relative to the migration span's start.
    pub offset_ms: f64,
    /// Span duration, milliseconds.
    pub duration_ms: f64,
    /// `kvfleet.stage.index` of a `stage`/`stop_copy`.
    pub stage_index: Option<i64>,
    /// `kvfleet.stage.bytes` of a `stage`/`stop_copy`.
    pub bytes: Option<i64>,
}

/// Time spent in each phase (summed when a phase occurs more than once, as live stages do).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PhaseTimes {
    /// PREPARE (source side), milliseconds.
    pub prepare_ms: Option<f64>,
    /// All live (pre-copy) stages together.
    pub live_copy_ms: Option<f64>,
    /// Pausing the request on the source before the stop-and-copy, milliseconds.
    pub pause_ms: Option<f64>,
    /// The stop-and-copy stage, milliseconds.
    pub stop_copy_ms: Option<f64>,
    /// COMMIT, milliseconds.
    pub commit_ms: Option<f64>,
    /// The target reserving KV blocks, milliseconds.
    pub reserve_ms: Option<f64>,
    /// The target checking every block's checksum and token stamps, milliseconds.
    pub verify_ms: Option<f64>,
    /// The target attaching the request to its engine, milliseconds.
    pub attach_ms: Option<f64>,
}

/// One migration as reconstructed from its spans: the source's `migration` span with its phases
/// and the target's spans. Not a measurement: the backends' own per-migration measurements are
/// `kvfleet_core::metrics::MigrationRecord`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TracedMigration {
    /// Trace id (hex) of the `migration` span.
    pub trace_id: String,
    /// Span id (hex) of the `migration` span.
    pub span_id: String,
    /// `kvfleet.migration.id` (the span id when absent).
    pub migration_id: String,
    /// `kvfleet.request.id` of the migrated request.
    pub request_id: Option<i64>,
    /// The span id of the `request` span the migration belongs to (see the module doc).
    pub request_span_id: Option<String>,
    /// `kvfleet.policy` of the request span (see the module doc), `"unknown"` without one.
    pub policy: String,
    /// `kvfleet.link` (`"<source>-><target>"`).
    pub link: String,
    /// `kvfleet.migration.source`, else the span's `kvfleet.instance`: the source instance.
    pub source: Option<i64>,
    /// `kvfleet.migration.target`, else the target span's `kvfleet.instance`; `None` if unknown.
    pub target: Option<i64>,
    /// `committed`, `aborted`, `unknown`, or what the span says.
    pub outcome: String,
    /// `kvfleet.migration.abort_reason` (aborted migrations only).
    pub abort_reason: Option<String>,
    /// Start of the `migration` span, Unix nanoseconds.
    pub start_ns: u64,
    /// End of the `migration` span, Unix nanoseconds.
    pub end_ns: u64,
    /// `kvfleet.migration.total_ms`, else the span's duration.
    pub total_ms: f64,
    /// `kvfleet.migration.downtime_ms`, else the `downtime` span's duration.
    pub downtime_ms: Option<f64>,
    /// `kvfleet.migration.goodput_gbps`: bytes moved over total time, Gbit/s (committed only).
    pub goodput_gbps: Option<f64>,
    /// `kvfleet.migration.kv_tokens`: sequence length when paused, else at start.
    pub kv_tokens: Option<i64>,
    /// `kvfleet.migration.blocks`: KV blocks migrated.
    pub blocks: Option<i64>,
    /// `kvfleet.migration.bytes`, else the sum of the stages' bytes.
    pub bytes: Option<i64>,
    /// `kvfleet.migration.stages`: copy stages, stop-and-copy included.
    pub stages: Option<i64>,
    /// `kvfleet.link.gbps`: the link's shaped rate, Gbit/s (0 = unshaped).
    pub link_gbps: Option<f64>,
    /// `kvfleet.link.latency_us`: the link's added one-way latency, microseconds.
    pub link_latency_us: Option<f64>,
    /// Time per phase.
    pub times: PhaseTimes,
    /// Live `stage` spans found.
    pub live_stages: usize,
    /// Source phases then target phases, each by start time.
    pub phases: Vec<Phase>,
    /// Every phase expected for the outcome is present (see the module doc).
    pub complete: bool,
    /// What is missing when not complete.
    pub missing: Vec<String>,
}

/// The coordinator's placement decision for a request.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Placement {
    /// `kvfleet.placement.candidates`: live instances the policy saw.
    pub candidates: Option<i64>,
    /// `kvfleet.placement.chosen`: the instance picked.
    pub chosen: Option<i64>,
    /// `kvfleet.placement.reason`: the policy and the chosen instance's load.
    pub reason: Option<String>,
    /// Start of the `placement` span, Unix nanoseconds.
    pub start_ns: u64,
    /// Duration of the `placement` span, milliseconds.
    pub duration_ms: f64,
}

/// One phase of a request on one instance (`queued`, `prefill`, `reasoning`, `answering`,
/// `preempted`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RequestPhase {
    /// The span name without `request.`.
    pub name: String,
    /// The instance it ran on (`kvfleet.instance` of the span or its resource).
    pub instance: Option<i64>,
    /// Span start, Unix nanoseconds.
    pub start_ns: u64,
    /// Span end, Unix nanoseconds.
    pub end_ns: u64,
    /// Start relative to the request span's start.
    pub offset_ms: f64,
    /// Span duration, milliseconds.
    pub duration_ms: f64,
}

/// A migration of a request, as its timeline shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MigrationRef {
    /// [`TracedMigration::migration_id`].
    pub migration_id: String,
    /// Source instance.
    pub source: Option<i64>,
    /// Target instance.
    pub target: Option<i64>,
    /// [`TracedMigration::outcome`].
    pub outcome: String,
    /// Start relative to the request span's start, milliseconds.
    pub offset_ms: f64,
    /// [`TracedMigration::total_ms`].
    pub total_ms: f64,
    /// [`TracedMigration::downtime_ms`].
    pub downtime_ms: Option<f64>,
}

/// One request's life: the `request` span, its placement, its phases on each instance, and its
/// migrations.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RequestTimeline {
    /// Trace id (hex) of the `request` span.
    pub trace_id: String,
    /// Span id (hex) of the `request` span.
    pub span_id: String,
    /// `kvfleet.request.id`.
    pub request_id: Option<i64>,
    /// `kvfleet.policy`, `"unknown"` without one.
    pub policy: String,
    /// Start of the `request` span, Unix nanoseconds.
    pub start_ns: u64,
    /// End of the `request` span, Unix nanoseconds.
    pub end_ns: u64,
    /// Duration of the `request` span, milliseconds.
    pub duration_ms: f64,
    /// `kvfleet.request.prompt_tokens`.
    pub prompt_tokens: Option<i64>,
    /// `kvfleet.request.reasoning_tokens`.
    pub reasoning_tokens: Option<i64>,
    /// `kvfleet.request.answer_tokens`.
    pub answer_tokens: Option<i64>,
    /// The first `placement` span of this request, if any.
    pub placement: Option<Placement>,
    /// By start time.
    pub phases: Vec<RequestPhase>,
    /// Time per phase name, summed over instances.
    pub phase_ms: BTreeMap<String, f64>,
    /// Instances the request ran on, in order.
    pub instances: Vec<i64>,
    /// Its migrations, by start time.
    pub migrations: Vec<MigrationRef>,
}

/// Counts and distributions of one group of migrations (a policy, a link, or all).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GroupStats {
    /// The group: a policy name, a link name, or `all`.
    pub key: String,
    /// Migrations in the group.
    pub migrations: usize,
    /// Of which committed.
    pub committed: usize,
    /// Of which aborted.
    pub aborted: usize,
    /// Neither committed nor aborted (`unknown`, `finished`, ...).
    pub other: usize,
    /// Migrations with a phase missing (see the module doc).
    pub incomplete: usize,
    /// Bytes moved, summed over the migrations that report them.
    pub bytes: i64,
    /// Over every migration with a downtime (an aborted one's, after a pause, counts).
    pub downtime_ms: Percentiles,
    /// Over every migration.
    pub total_ms: Percentiles,
    /// Over committed migrations with a goodput.
    pub goodput_gbps: Percentiles,
}

impl GroupStats {
    fn of<'a>(key: String, ms: impl IntoIterator<Item = &'a TracedMigration>) -> GroupStats {
        let ms: Vec<&TracedMigration> = ms.into_iter().collect();
        let outcome = |o: &str| ms.iter().filter(|m| m.outcome == o).count();
        let (committed, aborted) = (outcome("committed"), outcome("aborted"));
        GroupStats {
            key,
            migrations: ms.len(),
            committed,
            aborted,
            other: ms.len() - committed - aborted,
            incomplete: ms.iter().filter(|m| !m.complete).count(),
            bytes: ms.iter().filter_map(|m| m.bytes).sum(),
            downtime_ms: Percentiles::of(ms.iter().filter_map(|m| m.downtime_ms)),
            total_ms: Percentiles::of(ms.iter().map(|m| m.total_ms)),
            goodput_gbps: Percentiles::of(
                ms.iter().filter(|m| m.outcome == "committed").filter_map(|m| m.goodput_gbps),
            ),
        }
    }
}

/// Everything [`analyze`] finds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Analysis {
    /// Spans analysed.
    pub spans: usize,
    /// Distinct trace ids among them.
    pub traces: usize,
    /// By start time.
    pub migrations: Vec<TracedMigration>,
    /// By start time.
    pub requests: Vec<RequestTimeline>,
    /// Every migration together.
    pub overall: GroupStats,
    /// By policy name.
    pub by_policy: Vec<GroupStats>,
    /// By link name.
    pub by_link: Vec<GroupStats>,
    /// `migration.target` spans whose migration is not in the file.
    pub unjoined_target_spans: usize,
}

impl Analysis {
    /// The `n` migrations with the longest total time, slowest first.
    pub fn slowest(&self, n: usize) -> Vec<&TracedMigration> {
        let mut v: Vec<&TracedMigration> = self.migrations.iter().collect();
        v.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms).then_with(|| a.migration_id.cmp(&b.migration_id)));
        v.truncate(n);
        v
    }
}

/// Lookups over one file's spans.
struct Index<'a> {
    spans: &'a [SpanRecord],
    by_id: HashMap<(&'a str, &'a str), usize>,
    children: HashMap<(&'a str, &'a str), Vec<usize>>,
    requests_by_trace: HashMap<&'a str, Vec<usize>>,
    by_trace: HashMap<&'a str, Vec<usize>>,
    targets_by_migration_id: HashMap<&'a str, Vec<usize>>,
}

impl<'a> Index<'a> {
    fn new(spans: &'a [SpanRecord]) -> Index<'a> {
        let mut ix = Index {
            spans,
            by_id: HashMap::new(),
            children: HashMap::new(),
            requests_by_trace: HashMap::new(),
            by_trace: HashMap::new(),
            targets_by_migration_id: HashMap::new(),
        };
        for (i, s) in spans.iter().enumerate() {
            ix.by_id.insert((&s.trace_id, &s.span_id), i);
            ix.by_trace.entry(&s.trace_id).or_default().push(i);
            if let Some(p) = &s.parent_span_id {
                ix.children.entry((&s.trace_id, p)).or_default().push(i);
            }
            match s.name.as_str() {
                "request" => ix.requests_by_trace.entry(&s.trace_id).or_default().push(i),
                "migration.target" => {
                    if let Some(id) = s.attr_str("kvfleet.migration.id") {
                        ix.targets_by_migration_id.entry(id).or_default().push(i);
                    }
                }
                _ => {}
            }
        }
        ix
    }

    fn children(&self, s: &SpanRecord) -> Vec<&'a SpanRecord> {
        let Some(kids) = self.children.get(&(s.trace_id.as_str(), s.span_id.as_str())) else { return Vec::new() };
        kids.iter().map(|&i| &self.spans[i]).collect()
    }

    fn parent(&self, s: &SpanRecord) -> Option<&'a SpanRecord> {
        let p = s.parent_span_id.as_deref()?;
        self.by_id.get(&(s.trace_id.as_str(), p)).map(|&i| &self.spans[i])
    }

    /// The `request` span a span belongs to: its parent if that is one, else the trace's first.
    fn request_of(&self, s: &SpanRecord) -> Option<&'a SpanRecord> {
        self.parent(s).filter(|p| p.name == "request").or_else(|| {
            let first = *self.requests_by_trace.get(s.trace_id.as_str())?.first()?;
            Some(&self.spans[first])
        })
    }

    /// A migration's `migration.target` spans: its children, or the unparented ones carrying
    /// its migration id.
    fn targets_of(&self, m: &SpanRecord, migration_id: &str) -> Vec<&'a SpanRecord> {
        let mut t: Vec<&SpanRecord> = self.children(m).into_iter().filter(|c| c.name == "migration.target").collect();
        if t.is_empty() {
            let candidates = self.targets_by_migration_id.get(migration_id).into_iter().flatten();
            t = candidates.map(|&i| &self.spans[i]).filter(|c| self.parent(c).is_none()).collect();
        }
        t
    }
}

fn instance_of(s: &SpanRecord) -> Option<i64> {
    s.attr_i64("kvfleet.instance").or_else(|| s.resource.get("kvfleet.instance").and_then(|v| v.as_i64()))
}

/// `t − origin` in milliseconds, exact to the nanosecond (Unix-nanosecond `u64`s near 1.7·10¹⁸
/// lose 256 ns to `f64` if converted before subtracting).
fn offset_ms(t: u64, origin: u64) -> f64 {
    (i128::from(t) - i128::from(origin)) as f64 / 1e6
}

fn phase(s: &SpanRecord, side: &'static str, origin_ns: u64) -> Phase {
    Phase {
        name: s.name.strip_prefix("migration.").unwrap_or(&s.name).to_string(),
        side,
        start_ns: s.start_ns,
        end_ns: s.end_ns,
        offset_ms: offset_ms(s.start_ns, origin_ns),
        duration_ms: s.duration_ms(),
        stage_index: s.attr_i64("kvfleet.stage.index"),
        bytes: s.attr_i64("kvfleet.stage.bytes"),
    }
}

fn migration(ix: &Index, m: &SpanRecord) -> TracedMigration {
    let migration_id = m.attr_str("kvfleet.migration.id").unwrap_or(&m.span_id).to_string();
    let mut phases: Vec<Phase> = ix
        .children(m)
        .into_iter()
        .filter(|c| c.name.starts_with("migration.") && c.name != "migration.target")
        .map(|c| phase(c, "source", m.start_ns))
        .collect();
    phases.sort_by_key(|p| (p.start_ns, p.end_ns));
    let targets = ix.targets_of(m, &migration_id);
    let mut target_phases = Vec::new();
    for t in &targets {
        target_phases.push(phase(t, "target", m.start_ns));
        target_phases.extend(ix.children(t).into_iter().map(|c| phase(c, "target", m.start_ns)));
    }
    target_phases.sort_by_key(|p| (p.start_ns, p.end_ns));
    phases.extend(target_phases);

    let count = |name: &str| phases.iter().filter(|p| p.name == name).count();
    let sum = |name: &str| -> Option<f64> {
        let d: Vec<f64> = phases.iter().filter(|p| p.name == name).map(|p| p.duration_ms).collect();
        (!d.is_empty()).then(|| d.iter().sum())
    };
    let outcome_attr = m.attr_str("kvfleet.migration.outcome");
    let outcome = outcome_attr.unwrap_or("unknown").to_string();
    let stages = m.attr_i64("kvfleet.migration.stages");

    let mut missing = Vec::new();
    if outcome_attr.is_none() {
        missing.push("kvfleet.migration.outcome".to_string());
    }
    let mut need = |name: &str, present: bool| {
        if !present {
            missing.push(name.to_string());
        }
    };
    match outcome.as_str() {
        "committed" => {
            for n in ["prepare", "pause", "stop_copy", "commit", "downtime"] {
                need(n, count(n) > 0);
            }
            need("target", !targets.is_empty());
            if !targets.is_empty() {
                for n in ["reserve", "verify", "attach"] {
                    need(n, count(n) > 0);
                }
            }
        }
        "aborted" => {
            need("abort", count("abort") > 0);
            if count("pause") > 0 {
                need("downtime", count("downtime") > 0);
            }
        }
        _ => {}
    }
    if let Some(stages) = stages {
        // Every copy stage is a span: `stages − 1` live ones when committed (the last is the
        // stop-and-copy), otherwise all that are not a stop-and-copy found.
        let final_stage = if outcome == "committed" { 1 } else { count("stop_copy") as i64 };
        let live_expected = (stages - final_stage).max(0) as usize;
        let live = count("stage");
        if live < live_expected {
            missing.push(format!("stage ({live} of {live_expected} live stages)"));
        }
    }

    let stage_bytes: Vec<i64> =
        phases.iter().filter(|p| p.name == "stage" || p.name == "stop_copy").filter_map(|p| p.bytes).collect();
    let target = m
        .attr_i64("kvfleet.migration.target")
        .filter(|&t| t >= 0)
        .or_else(|| targets.iter().find_map(|t| instance_of(t)));
    let source = m.attr_i64("kvfleet.migration.source").or_else(|| instance_of(m));
    let link = m.attr_str("kvfleet.link").map(str::to_string).unwrap_or_else(|| match (source, target) {
        (Some(s), Some(t)) => format!("{s}->{t}"),
        _ => "unknown".to_string(),
    });
    let times = PhaseTimes {
        prepare_ms: sum("prepare"),
        live_copy_ms: sum("stage"),
        pause_ms: sum("pause"),
        stop_copy_ms: sum("stop_copy"),
        commit_ms: sum("commit"),
        reserve_ms: sum("reserve"),
        verify_ms: sum("verify"),
        attach_ms: sum("attach"),
    };
    let request = ix.request_of(m);
    TracedMigration {
        trace_id: m.trace_id.clone(),
        span_id: m.span_id.clone(),
        request_id: m.attr_i64("kvfleet.request.id"),
        request_span_id: request.map(|r| r.span_id.clone()),
        policy: request.and_then(|r| r.attr_str("kvfleet.policy")).unwrap_or("unknown").to_string(),
        link,
        source,
        target,
        abort_reason: m.attr_str("kvfleet.migration.abort_reason").map(str::to_string),
        start_ns: m.start_ns,
        end_ns: m.end_ns,
        total_ms: m.attr_f64("kvfleet.migration.total_ms").unwrap_or_else(|| m.duration_ms()),
        downtime_ms: m.attr_f64("kvfleet.migration.downtime_ms").or_else(|| sum("downtime")),
        goodput_gbps: m.attr_f64("kvfleet.migration.goodput_gbps"),
        kv_tokens: m.attr_i64("kvfleet.migration.kv_tokens"),
        blocks: m.attr_i64("kvfleet.migration.blocks"),
        bytes: m
            .attr_i64("kvfleet.migration.bytes")
            .or_else(|| (!stage_bytes.is_empty()).then(|| stage_bytes.iter().sum())),
        stages,
        link_gbps: m.attr_f64("kvfleet.link.gbps"),
        link_latency_us: m.attr_f64("kvfleet.link.latency_us"),
        times,
        live_stages: count("stage"),
        complete: missing.is_empty(),
        missing,
        phases,
        migration_id,
        outcome,
    }
}

/// `migrations`: those of this request (see [`TracedMigration::request_span_id`]).
fn request(ix: &Index, r: &SpanRecord, migrations: &[&TracedMigration]) -> RequestTimeline {
    let trace_requests = ix.requests_by_trace.get(r.trace_id.as_str()).map_or(&[][..], Vec::as_slice);
    let first_in_trace = trace_requests.first().is_some_and(|&i| ix.spans[i].span_id == r.span_id);
    // Phase spans belong to their parent request, or (parent lost) to the trace's first.
    let mine = |s: &SpanRecord| match ix.parent(s) {
        Some(p) if p.name == "request" => p.span_id == r.span_id,
        _ => first_in_trace,
    };
    let trace_spans = ix.by_trace.get(r.trace_id.as_str()).into_iter().flatten().map(|&i| &ix.spans[i]);
    let mut phases: Vec<RequestPhase> = Vec::new();
    let mut placement = None;
    for s in trace_spans {
        if s.name == "placement" && mine(s) && placement.is_none() {
            placement = Some(Placement {
                candidates: s.attr_i64("kvfleet.placement.candidates"),
                chosen: s.attr_i64("kvfleet.placement.chosen"),
                reason: s.attr_str("kvfleet.placement.reason").map(str::to_string),
                start_ns: s.start_ns,
                duration_ms: s.duration_ms(),
            });
        } else if let Some(name) = s.name.strip_prefix("request.").filter(|_| mine(s)) {
            phases.push(RequestPhase {
                name: name.to_string(),
                instance: instance_of(s),
                start_ns: s.start_ns,
                end_ns: s.end_ns,
                offset_ms: offset_ms(s.start_ns, r.start_ns),
                duration_ms: s.duration_ms(),
            });
        }
    }
    phases.sort_by_key(|p| (p.start_ns, p.end_ns));
    let mut phase_ms = BTreeMap::new();
    let mut instances = Vec::new();
    for p in &phases {
        *phase_ms.entry(p.name.clone()).or_insert(0.0) += p.duration_ms;
        if let Some(i) = p.instance.filter(|i| instances.last() != Some(i)) {
            instances.push(i);
        }
    }
    let migrations = migrations
        .iter()
        .map(|m| MigrationRef {
            migration_id: m.migration_id.clone(),
            source: m.source,
            target: m.target,
            outcome: m.outcome.clone(),
            offset_ms: offset_ms(m.start_ns, r.start_ns),
            total_ms: m.total_ms,
            downtime_ms: m.downtime_ms,
        })
        .collect();
    RequestTimeline {
        trace_id: r.trace_id.clone(),
        span_id: r.span_id.clone(),
        request_id: r.attr_i64("kvfleet.request.id"),
        policy: r.attr_str("kvfleet.policy").unwrap_or("unknown").to_string(),
        start_ns: r.start_ns,
        end_ns: r.end_ns,
        duration_ms: r.duration_ms(),
        prompt_tokens: r.attr_i64("kvfleet.request.prompt_tokens"),
        reasoning_tokens: r.attr_i64("kvfleet.request.reasoning_tokens"),
        answer_tokens: r.attr_i64("kvfleet.request.answer_tokens"),
        placement,
        phases,
        phase_ms,
        instances,
        migrations,
    }
}

/// Joins `spans` (one file's, deduplicated) into migrations, requests and distributions.
pub fn analyze(spans: &[SpanRecord]) -> Analysis {
    let ix = Index::new(spans);
    let mut migrations: Vec<TracedMigration> =
        spans.iter().filter(|s| s.name == "migration").map(|m| migration(&ix, m)).collect();
    migrations.sort_by(|a, b| a.start_ns.cmp(&b.start_ns).then_with(|| a.migration_id.cmp(&b.migration_id)));
    let mut per_request: HashMap<(&str, &str), Vec<&TracedMigration>> = HashMap::new();
    for m in &migrations {
        if let Some(r) = &m.request_span_id {
            per_request.entry((&m.trace_id, r)).or_default().push(m);
        }
    }
    let mut requests: Vec<RequestTimeline> = spans
        .iter()
        .filter(|s| s.name == "request")
        .map(|r| {
            let mine = per_request.get(&(r.trace_id.as_str(), r.span_id.as_str())).map_or(&[][..], Vec::as_slice);
            request(&ix, r, mine)
        })
        .collect();
    requests.sort_by(|a, b| a.start_ns.cmp(&b.start_ns).then_with(|| a.request_id.cmp(&b.request_id)));

    let group = |key: fn(&TracedMigration) -> &str| -> Vec<GroupStats> {
        let mut groups: BTreeMap<&str, Vec<&TracedMigration>> = BTreeMap::new();
        for m in &migrations {
            groups.entry(key(m)).or_default().push(m);
        }
        groups.into_iter().map(|(k, ms)| GroupStats::of(k.to_string(), ms)).collect()
    };
    let by_policy = group(|m| &m.policy);
    let by_link = group(|m| &m.link);
    let joined: usize = migrations.iter().map(|m| m.phases.iter().filter(|p| p.name == "target").count()).sum();
    let target_spans = spans.iter().filter(|s| s.name == "migration.target").count();
    let mut traces: Vec<&str> = spans.iter().map(|s| s.trace_id.as_str()).collect();
    traces.sort_unstable();
    traces.dedup();
    Analysis {
        spans: spans.len(),
        traces: traces.len(),
        overall: GroupStats::of("all".to_string(), &migrations),
        by_policy,
        by_link,
        unjoined_target_spans: target_spans.saturating_sub(joined),
        migrations,
        requests,
    }
}

#[cfg(test)]
#[path = "model_tests.rs"]
mod tests;
