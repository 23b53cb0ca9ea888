//! Errors of the metadata store. One enum for both stores so a coordinator handles them alike:
//! `Unreachable`/`Timeout`/`Etcd` are worth a retry with backoff, `LeaseNotFound` means the
//! lease is gone for good (a leader steps down, a worker re-registers), the rest are bugs or
//! bad configuration and name the field or file at fault.

use std::path::PathBuf;

use crate::{LeaseId, Revision};

#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    /// No etcd endpoint answered (connection refused, TLS or auth failure, timeout).
    #[error("etcd unreachable at [{endpoints}] after {attempts} attempt(s): {reason}")]
    Unreachable { endpoints: String, attempts: u32, reason: String },

    /// An etcd request failed after the connection was established.
    #[error("etcd {op} failed: {source}")]
    Etcd {
        op: &'static str,
        #[source]
        source: etcd_client::Error,
    },

    /// An etcd request got no answer in time (etcd down or partitioned).
    #[error("etcd {op} timed out after {timeout_ms} ms")]
    Timeout { op: &'static str, timeout_ms: u64 },

    #[error("lease {0} not found (expired or revoked)")]
    LeaseNotFound(LeaseId),

    #[error(
        "cannot watch from revision {}: history compacted up to revision {}",
        requested.0, compacted.0
    )]
    Compacted { requested: Revision, compacted: Revision },

    /// A watch or observe stream ended (the connection to etcd was lost); re-open it.
    #[error("{what} stream closed: {reason}")]
    StreamClosed { what: &'static str, reason: String },

    /// The candidate's election key vanished (lease expired or revoked) while campaigning.
    #[error("campaign in election {election:?} failed: {reason}")]
    Election { election: String, reason: String },

    #[error("key {key:?} stored in etcd is not UTF-8")]
    NonUtf8Key { key: String },

    #[error("cannot read etcd TLS {field} file {path}: {source}")]
    TlsFile {
        field: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("invalid etcd option {field}: {reason}")]
    InvalidOption { field: &'static str, reason: String },
}

impl MetaError {
    /// Whether retrying (after a pause, or re-opening a stream) can succeed: etcd down,
    /// restarting or slow. `false` for a lost lease, compacted history and
    /// configuration errors, which a retry cannot fix.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            MetaError::Unreachable { .. }
                | MetaError::Etcd { .. }
                | MetaError::Timeout { .. }
                | MetaError::StreamClosed { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_errors_table() {
        let table = [
            (MetaError::Unreachable { endpoints: "e".into(), attempts: 1, reason: "r".into() }, true),
            (MetaError::Timeout { op: "get", timeout_ms: 1 }, true),
            (MetaError::StreamClosed { what: "watch", reason: "r".into() }, true),
            (MetaError::LeaseNotFound(LeaseId(1)), false),
            (MetaError::Compacted { requested: Revision(1), compacted: Revision(2) }, false),
            (MetaError::InvalidOption { field: "endpoints", reason: "r".into() }, false),
        ];
        for (err, transient) in table {
            assert_eq!(err.is_transient(), transient, "{err}");
        }
    }
}
