//! One KV-cache migration as the simulator or coordinator logged it (PASCAL §IV-B, §V-D: P99 KV
//! transfer latency); runs report migration count, bytes, P50/P99 transfer time and aborts from these.

use crate::ids::{InstanceId, RequestId};
use crate::time::Timestamp;
use serde::{Deserialize, Serialize};

/// A request's KV cache moving between instances at its `</think>` boundary.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationRecord {
    /// The migrated request.
    pub request: RequestId,
    /// Source instance (where the request reasoned).
    pub from: InstanceId,
    /// Target instance chosen for the answering phase.
    pub to: InstanceId,
    /// Bytes put on the wire (for an aborted migration, what was sent before the abort).
    pub bytes: u64,
    /// When the transfer started.
    pub start: Timestamp,
    /// When the transfer completed or was abandoned.
    pub end: Timestamp,
    /// The migration was abandoned and the request stayed on (or went back to) `from`.
    pub aborted: bool,
}

impl MigrationRecord {
    /// `end − start` in seconds (zero if the record is inverted).
    pub fn transfer_s(&self) -> f64 {
        self.end.saturating_since(self.start).as_secs_f64()
    }
}
