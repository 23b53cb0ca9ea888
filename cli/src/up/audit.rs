//! After a run with etcd: does the result etcd stored for each request match what its client got?
//!
//! A paused worker's late copy of a re-placed request once overwrote `/kvfleet/results/<id>`
//! after the client had its answer, so the cluster's record of the run and the client's disagreed.
//! The leader now stores only the owner's first record; this audit checks it from the outside.

use kvfleet_core::metrics::RequestRecord;
use kvfleet_meta::{layout, EtcdOptions, EtcdStore, MetaStore};
use std::time::Duration;

/// How the stored results compare with the clients' records.
#[derive(Debug, Default)]
pub struct Audit {
    /// Requests whose stored result is the record the client got.
    pub matched: usize,
    /// Requests whose stored result differs (`id: what differs`).
    pub differ: Vec<String>,
    /// Requests the client got but etcd holds no result for.
    pub missing: Vec<u64>,
}

impl Audit {
    /// One line for the run's output.
    pub fn line(&self) -> String {
        format!(
            "etcd results: {} match what the clients got, {} differ, {} missing",
            self.matched,
            self.differ.len(),
            self.missing.len()
        )
    }

    /// Whether every client's record is the stored one.
    pub fn clean(&self) -> bool {
        self.differ.is_empty() && self.missing.is_empty()
    }
}

/// Reads every client's request back from etcd at `url` (`kvfleet up`'s own etcd, connected to
/// with `etcd`: mutual TLS with the CLI's cluster certificate, or plain with `--plaintext`) and
/// compares where and when it finished.
pub async fn audit(url: &str, etcd: &EtcdOptions, records: &[RequestRecord]) -> anyhow::Result<Audit> {
    let opts = EtcdOptions { connect_timeout: Duration::from_secs(5), ..etcd.clone() };
    let store = EtcdStore::connect(&[url.to_string()], &opts).await?;
    let mut audit = Audit::default();
    for client in records {
        let Some(kv) = store.get(&layout::result(client.id.0)).await? else {
            audit.missing.push(client.id.0);
            continue;
        };
        let stored: RequestRecord = serde_json::from_slice(&kv.value)?;
        let fields = [
            ("finished_on", format!("{:?}", stored.finished_on), format!("{:?}", client.finished_on)),
            ("first_token", format!("{:?}", stored.first_token), format!("{:?}", client.first_token)),
            ("finish", format!("{:?}", stored.finish), format!("{:?}", client.finish)),
        ];
        let diffs: Vec<String> = fields
            .iter()
            .filter(|(_, s, c)| s != c)
            .map(|(name, s, c)| format!("{name} stored {s}, client got {c}"))
            .collect();
        if diffs.is_empty() {
            audit.matched += 1;
        } else {
            audit.differ.push(format!("request {}: {}", client.id.0, diffs.join("; ")));
        }
    }
    Ok(audit)
}
