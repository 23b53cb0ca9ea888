//! A request's ownership: which instance holds it, in which phase. The coordinator persists these
//! records (JSON, in etcd) before it acknowledges a client, so their format is stable: fields are
//! only ever added, with defaults.

use kvfleet_core::{InstanceId, RequestSpec};
use serde::{Deserialize, Serialize};

/// A request's phase as the cluster tracks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum OwnedPhase {
    /// Placed; producing reasoning tokens (or waiting to).
    Reasoning,
    /// Past `</think>`, or a request without reasoning.
    Answering,
    /// Being moved between instances.
    Migrating,
    /// Its final record was stored.
    Finished,
}

/// Who owns a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ownership {
    /// The request as the client submitted it.
    pub spec: RequestSpec,
    /// Where it runs (during a move: its source).
    pub instance: InstanceId,
    /// Its phase.
    pub phase: OwnedPhase,
    /// Times the request was re-placed because its instance died.
    pub replaced: u32,
    /// Committed migrations.
    pub migrations: u32,
    /// Times its KV was computed again after its handoff's bytes failed their checksum
    /// ([`crate::MAX_CORRUPT_HANDOFFS`]); counted in `replaced` too.
    #[serde(default)]
    pub reprefilled: u32,
    /// Handoffs of its current KV copy whose bytes failed their checksum at the target
    /// ([`crate::MAX_CORRUPT_HANDOFFS`]). Stored with the request, so that a leader taking over
    /// counts on from it; zero again when the request starts over elsewhere.
    #[serde(default)]
    pub corrupt_handoffs: u32,
    /// While `phase` is `Migrating`: where to. Persisted before the move starts, so a leader that
    /// takes over knows to settle a move its predecessor left undecided.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migrating_to: Option<InstanceId>,
}

impl Ownership {
    /// A new request placed on `instance`.
    pub fn placed(spec: RequestSpec, instance: InstanceId) -> Ownership {
        let phase = initial_phase(&spec);
        Ownership {
            spec,
            instance,
            phase,
            replaced: 0,
            migrations: 0,
            reprefilled: 0,
            corrupt_handoffs: 0,
            migrating_to: None,
        }
    }

    /// Whether the request still needs to run somewhere.
    pub fn unfinished(&self) -> bool {
        self.phase != OwnedPhase::Finished
    }
}

/// The phase a request starts (or starts over) in.
pub fn initial_phase(spec: &RequestSpec) -> OwnedPhase {
    if spec.reasoning_tokens > 0 {
        OwnedPhase::Reasoning
    } else {
        OwnedPhase::Answering
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_of_earlier_versions_still_load() {
        // Written before `migrating_to` existed.
        let old = r#"{"spec":{"id":3,"arrival":0,"prompt_tokens":1,"reasoning_tokens":1,"answer_tokens":1},
                     "instance":2,"phase":"Migrating","replaced":0,"migrations":1}"#;
        let o: Ownership = serde_json::from_str(old).unwrap();
        assert_eq!((o.instance, o.phase, o.migrating_to), (InstanceId(2), OwnedPhase::Migrating, None));
        let moving = Ownership { migrating_to: Some(InstanceId(5)), ..o };
        let back: Ownership = serde_json::from_slice(&serde_json::to_vec(&moving).unwrap()).unwrap();
        assert_eq!(back, moving);
    }
}
