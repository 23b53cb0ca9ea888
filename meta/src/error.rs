//! Errors of the metadata store. One enum for both stores so a coordinator handles them alike:
//! `Unreachable`/`Timeout`/`Etcd` are worth a retry with backoff, `LeaseNotFound` means the
//! lease is gone for good (a leader steps down, a worker re-registers), the rest are bugs or
//! bad configuration and name the field or file at fault.

use std::path::PathBuf;

use crate::{LeaseId, Revision};

/// Everything a [`MetaStore`](crate::MetaStore) operation (etcd or embedded) can fail with.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    /// No etcd endpoint answered (connection refused, TLS or auth failure, timeout).
    #[error("etcd unreachable at [{endpoints}] after {attempts} attempt(s): {reason}")]
    Unreachable {
        /// The endpoints tried, comma-separated.
        endpoints: String,
        /// Connection attempts made.
        attempts: u32,
        /// The last attempt's failure.
        reason: String,
    },

    /// An etcd request failed after the connection was established.
    #[error("etcd {op} failed: {source}")]
    Etcd {
        /// The operation (`put`, `txn`, `lease grant`, ...).
        op: &'static str,
        /// etcd-client's error.
        #[source]
        source: etcd_client::Error,
    },

    /// An etcd request got no answer in time (etcd down or partitioned).
    #[error("etcd {op} timed out after {timeout_ms} ms")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The bound it exceeded, milliseconds.
        timeout_ms: u64,
    },

    /// The lease is gone for good (expired or revoked): its keys are deleted, a keep-alive cannot
    /// revive it.
    #[error("lease {0} not found (expired or revoked)")]
    LeaseNotFound(LeaseId),

    /// A watch asked to replay from a revision whose events the store no longer keeps; re-list
    /// ("list, then watch") and watch from the listing's revision.
    #[error(
        "cannot watch from revision {}: history compacted up to revision {}",
        requested.0, compacted.0
    )]
    Compacted {
        /// The first revision the watch asked for.
        requested: Revision,
        /// The store's compaction revision: events up to it are gone.
        compacted: Revision,
    },

    /// A watch or observe stream ended (the connection to etcd was lost); re-open it.
    #[error("{what} stream closed: {reason}")]
    StreamClosed {
        /// Which stream (`watch`, `observe`, ...).
        what: &'static str,
        /// Why it ended.
        reason: String,
    },

    /// The candidate's election key vanished (lease expired or revoked) while campaigning.
    #[error("campaign in election {election:?} failed: {reason}")]
    Election {
        /// The election's name (key prefix).
        election: String,
        /// Why the campaign failed.
        reason: String,
    },

    /// A key read from etcd is not valid UTF-8 (this crate's keys always are).
    #[error("key {key:?} stored in etcd is not UTF-8")]
    NonUtf8Key {
        /// The key, lossily decoded.
        key: String,
    },

    /// An etcd TLS file (CA, client certificate or key) could not be read.
    #[error("cannot read etcd TLS {field} file {path}: {source}")]
    TlsFile {
        /// The option naming the file.
        field: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// An etcd connection option is invalid (e.g. a username without a password).
    #[error("invalid etcd option {field}: {reason}")]
    InvalidOption {
        /// The option.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
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
