//! [`v1`] messages ↔ `kvfleet-core` types: request specs (validated on the way in), load reports
//! and per-request records.

use kvfleet_core::kv::{BlockHash, KvEvent, Tier, TRACE_BLOCK_TOKENS};
use kvfleet_core::metrics::RequestRecord;
use kvfleet_core::policy::{LoadReport, PrefillQueue};
use kvfleet_core::{InstanceId, RequestId, RequestSpec, Timestamp};

use crate::{v1, InvalidField};

/// Largest request the control plane accepts (a typo guard; no model has this context).
pub const MAX_TOKENS_PER_REQUEST: u32 = 1 << 24;

impl From<&RequestSpec> for v1::RequestSpec {
    fn from(s: &RequestSpec) -> Self {
        v1::RequestSpec {
            id: s.id.0,
            arrival_ns: s.arrival.0,
            prompt_tokens: s.prompt_tokens,
            reasoning_tokens: s.reasoning_tokens,
            answer_tokens: s.answer_tokens,
            content_ids: s.content_ids.clone(),
        }
    }
}

impl TryFrom<&v1::RequestSpec> for RequestSpec {
    type Error = InvalidField;
    fn try_from(s: &v1::RequestSpec) -> Result<Self, InvalidField> {
        if s.answer_tokens == 0 {
            return Err(InvalidField { field: "spec.answer_tokens", message: "must be at least 1".into() });
        }
        let total = s.prompt_tokens as u64 + s.reasoning_tokens as u64 + s.answer_tokens as u64;
        if total > MAX_TOKENS_PER_REQUEST as u64 {
            return Err(InvalidField {
                field: "spec",
                message: format!("prompt + reasoning + answer = {total} tokens exceeds {MAX_TOKENS_PER_REQUEST}"),
            });
        }
        // One content id per 512 prompt tokens at most (fewer: the rest of the prompt is unique).
        let most = s.prompt_tokens.div_ceil(TRACE_BLOCK_TOKENS) as usize;
        if s.content_ids.len() > most {
            return Err(InvalidField {
                field: "spec.content_ids",
                message: format!(
                    "{} ids for a {}-token prompt: at most one per {TRACE_BLOCK_TOKENS} tokens ({most})",
                    s.content_ids.len(),
                    s.prompt_tokens
                ),
            });
        }
        Ok(RequestSpec {
            content_ids: s.content_ids.clone(),
            id: RequestId(s.id),
            arrival: Timestamp(s.arrival_ns),
            prompt_tokens: s.prompt_tokens,
            reasoning_tokens: s.reasoning_tokens,
            answer_tokens: s.answer_tokens,
        })
    }
}

/// The `spec` field of a message that must carry one.
pub fn require_spec(spec: Option<&v1::RequestSpec>) -> Result<RequestSpec, InvalidField> {
    RequestSpec::try_from(spec.ok_or_else(|| InvalidField::missing("spec"))?)
}

impl From<&LoadReport> for v1::LoadReport {
    fn from(l: &LoadReport) -> Self {
        v1::LoadReport {
            instance: l.instance.0,
            gpu_used_blocks: l.gpu_used_blocks,
            cpu_used_blocks: l.cpu_used_blocks,
            gpu_total_blocks: l.gpu_total_blocks,
            block_bytes: l.block_bytes,
            reasoning_requests: l.reasoning_requests,
            fresh_answering_requests: l.fresh_answering_requests,
            answering_requests: l.answering_requests,
            waiting_requests: l.waiting_requests,
            answering_slo_ok: l.answering_slo_ok,
            block_tokens: l.block_tokens,
            waiting_blocks: l.waiting_blocks,
            admitted: l.admitted,
            reasoning_demand_blocks: l.reasoning_demand_blocks,
            prefill_queue_requests: l.prefill_queue.requests,
            prefill_queue_tokens: l.prefill_queue.tokens,
            prefill_queue_tokens_sq: l.prefill_queue.tokens_sq,
            decode_context_tokens: l.decode_context_tokens,
            decode_tokens_total: l.decode_tokens_total,
            decode_latency_ns_total: l.decode_latency_ns_total,
            // The driver's to say (the engine's report does not carry it).
            due_ns: 0,
        }
    }
}

impl From<&v1::LoadReport> for LoadReport {
    fn from(l: &v1::LoadReport) -> Self {
        LoadReport {
            instance: InstanceId(l.instance),
            gpu_used_blocks: l.gpu_used_blocks,
            cpu_used_blocks: l.cpu_used_blocks,
            gpu_total_blocks: l.gpu_total_blocks,
            block_bytes: l.block_bytes,
            reasoning_requests: l.reasoning_requests,
            fresh_answering_requests: l.fresh_answering_requests,
            answering_requests: l.answering_requests,
            waiting_requests: l.waiting_requests,
            answering_slo_ok: l.answering_slo_ok,
            block_tokens: l.block_tokens,
            waiting_blocks: l.waiting_blocks,
            admitted: l.admitted,
            reasoning_demand_blocks: l.reasoning_demand_blocks,
            prefill_queue: PrefillQueue {
                requests: l.prefill_queue_requests,
                tokens: l.prefill_queue_tokens,
                tokens_sq: l.prefill_queue_tokens_sq,
            },
            decode_context_tokens: l.decode_context_tokens,
            decode_tokens_total: l.decode_tokens_total,
            decode_latency_ns_total: l.decode_latency_ns_total,
        }
    }
}

fn ns(t: Option<Timestamp>) -> Option<u64> {
    t.map(|t| t.0)
}
fn time(ns: Option<u64>) -> Option<Timestamp> {
    ns.map(Timestamp)
}

impl From<&RequestRecord> for v1::RequestRecord {
    fn from(r: &RequestRecord) -> Self {
        v1::RequestRecord {
            id: r.id.0,
            arrival_ns: r.arrival.0,
            prompt_tokens: r.prompt_tokens,
            reasoning_tokens: r.reasoning_tokens,
            answer_tokens: r.answer_tokens,
            placed_on: r.placed_on.0,
            finished_on: r.finished_on.map(|i| i.0),
            first_scheduled_ns: ns(r.first_scheduled),
            first_token_ns: ns(r.first_token),
            reasoning_end_ns: ns(r.reasoning_end),
            first_scheduled_after_reasoning_ns: ns(r.first_scheduled_after_reasoning),
            first_answer_token_ns: ns(r.first_answer_token),
            finish_ns: ns(r.finish),
            qoe: r.qoe,
            preemptions: r.preemptions,
            migrations: r.migrations,
            rejected: r.rejected,
            kv_rematerialized: false,
            cached_tokens: r.cached_tokens,
            migrated_in_ns: ns(r.migrated_in),
            first_scheduled_after_migration_ns: ns(r.first_scheduled_after_migration),
            replaced: r.replaced,
        }
    }
}

impl From<&v1::RequestRecord> for RequestRecord {
    fn from(r: &v1::RequestRecord) -> Self {
        RequestRecord {
            cached_tokens: r.cached_tokens,
            id: RequestId(r.id),
            arrival: Timestamp(r.arrival_ns),
            prompt_tokens: r.prompt_tokens,
            reasoning_tokens: r.reasoning_tokens,
            answer_tokens: r.answer_tokens,
            placed_on: InstanceId(r.placed_on),
            finished_on: r.finished_on.map(InstanceId),
            first_scheduled: time(r.first_scheduled_ns),
            first_token: time(r.first_token_ns),
            reasoning_end: time(r.reasoning_end_ns),
            first_scheduled_after_reasoning: time(r.first_scheduled_after_reasoning_ns),
            first_answer_token: time(r.first_answer_token_ns),
            finish: time(r.finish_ns),
            qoe: r.qoe,
            preemptions: r.preemptions,
            migrations: r.migrations,
            rejected: r.rejected,
            migrated_in: time(r.migrated_in_ns),
            first_scheduled_after_migration: time(r.first_scheduled_after_migration_ns),
            replaced: r.replaced,
        }
    }
}

/// An instance's prefix-cache changes as its worker streams them ([`v1::KvCacheEvents`]).
pub fn kv_events_to_proto(instance: InstanceId, events: &[KvEvent]) -> v1::KvCacheEvents {
    use v1::kv_cache_event::Kind;
    let one = |kind: Kind, tier: Tier, hash: BlockHash| v1::KvCacheEvent {
        kind: kind as i32,
        cpu: tier == Tier::Cpu,
        hash_hi: (hash >> 64) as u64,
        hash_lo: hash as u64,
    };
    let events = events
        .iter()
        .map(|e| match *e {
            KvEvent::Stored { tier, hash } => one(Kind::Stored, tier, hash),
            KvEvent::Removed { tier, hash } => one(Kind::Removed, tier, hash),
            KvEvent::AllCleared => v1::KvCacheEvent { kind: Kind::AllCleared as i32, ..Default::default() },
        })
        .collect();
    v1::KvCacheEvents { instance: instance.0, events }
}

/// The changes a [`v1::KvCacheEvents`] carries, in order (an event of an unknown kind is skipped:
/// a lost event costs only cache hits).
pub fn kv_events_from_proto(m: &v1::KvCacheEvents) -> Vec<KvEvent> {
    use v1::kv_cache_event::Kind;
    m.events
        .iter()
        .filter_map(|e| {
            let tier = if e.cpu { Tier::Cpu } else { Tier::Gpu };
            let hash = (e.hash_hi as BlockHash) << 64 | e.hash_lo as BlockHash;
            match Kind::try_from(e.kind).ok()? {
                Kind::Stored => Some(KvEvent::Stored { tier, hash }),
                Kind::Removed => Some(KvEvent::Removed { tier, hash }),
                Kind::AllCleared => Some(KvEvent::AllCleared),
                Kind::Unspecified => None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips() {
        let r = RequestRecord {
            id: RequestId(9),
            arrival: Timestamp(5),
            prompt_tokens: 1,
            reasoning_tokens: 2,
            answer_tokens: 3,
            placed_on: InstanceId(1),
            finished_on: Some(InstanceId(2)),
            first_token: Some(Timestamp(7)),
            finish: Some(Timestamp(11)),
            qoe: Some(0.5),
            migrations: 1,
            cached_tokens: 48,
            migrated_in: Some(Timestamp(8)),
            first_scheduled_after_migration: Some(Timestamp(9)),
            ..RequestRecord::default()
        };
        assert_eq!(RequestRecord::from(&v1::RequestRecord::from(&r)), r);
    }

    #[test]
    fn invalid_specs_name_the_field() {
        let bad = v1::RequestSpec { id: 1, answer_tokens: 0, ..Default::default() };
        assert_eq!(RequestSpec::try_from(&bad).unwrap_err().field, "spec.answer_tokens");
        assert_eq!(require_spec(None).unwrap_err().field, "spec");
        let huge = v1::RequestSpec { id: 1, prompt_tokens: u32::MAX, answer_tokens: 1, ..Default::default() };
        assert!(RequestSpec::try_from(&huge).is_err());
        let ids = v1::RequestSpec {
            id: 1,
            prompt_tokens: 513,
            answer_tokens: 1,
            content_ids: vec![1, 2, 3],
            ..Default::default()
        };
        assert_eq!(RequestSpec::try_from(&ids).unwrap_err().field, "spec.content_ids");
    }

    #[test]
    fn kv_events_round_trip() {
        let hash = (0xdead_beef_u128 << 64) | 0x1234_5678;
        let events = [
            KvEvent::AllCleared,
            KvEvent::Stored { tier: Tier::Gpu, hash },
            KvEvent::Removed { tier: Tier::Cpu, hash: u128::MAX },
        ];
        let m = kv_events_to_proto(InstanceId(3), &events);
        assert_eq!(m.instance, 3);
        assert_eq!(kv_events_from_proto(&m), events);
        let unknown =
            v1::KvCacheEvents { instance: 3, events: vec![v1::KvCacheEvent { kind: 99, ..Default::default() }] };
        assert!(kv_events_from_proto(&unknown).is_empty());
    }

    #[test]
    fn content_ids_travel_with_the_spec() {
        let ids = v1::RequestSpec {
            id: 1,
            prompt_tokens: 1025,
            answer_tokens: 1,
            content_ids: vec![7, 8, 9],
            ..Default::default()
        };
        let spec = RequestSpec::try_from(&ids).unwrap();
        assert_eq!(spec.content_ids, [7, 8, 9]);
        assert_eq!(v1::RequestSpec::from(&spec), ids);
    }
}
