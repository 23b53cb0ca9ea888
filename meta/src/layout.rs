//! The metadata-store layout shared by coordinators and workers, in one place.
//!
//! | key | value | written by |
//! |---|---|---|
//! | `/kvfleet/cluster` | JSON [`ClusterRecord`]: model, KV bytes/token, clock epoch, time dilation | first coordinator (create-if-absent) |
//! | `/kvfleet/workers/<instance>` | JSON `WorkerInfo`, attached to the worker's lease | worker (etcd) or leader on its behalf (embedded) |
//! | `/kvfleet/instances/<instance>` | the claiming worker's owner token, on the same lease as its registration | worker started with `--instance auto` (create-if-absent) |
//! | `/kvfleet/requests/<id>` | JSON `Ownership` (spec, instance, phase) | leader, fenced, before acknowledging |
//! | `/kvfleet/results/<id>` | JSON `RequestRecord` | leader, fenced, before acknowledging to the worker |
//! | `/kvfleet/roles/<instance>` | JSON role (`"prefill"`, `"decode"`, …) under prefill/decode disaggregation | leader, fenced, before telling the worker |
//! | `/kvfleet/role-changes/<at_ns>-<instance>` | JSON `{at_ns, instance, role}`: a role change after the first (a flip) | leader, fenced, after the role |
//! | `/kvfleet/leader/…` | election keys (value: the leader's advertised address) | `campaign` |

use kvfleet_core::{Dilation, Timestamp};
use serde::{Deserialize, Serialize};

/// What the cluster runs; a worker must match it to join.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterModel {
    /// Model name.
    pub model: String,
    /// KV-cache bytes per token (all layers), so migrated KV is sized alike everywhere.
    pub kv_bytes_per_token: u64,
}

/// Key of the [`ClusterRecord`].
pub const CLUSTER: &str = "/kvfleet/cluster";
/// Prefix of worker registrations ([`worker`]).
pub const WORKERS: &str = "/kvfleet/workers/";
/// Prefix of request ownership records ([`request`]).
pub const REQUESTS: &str = "/kvfleet/requests/";
/// Prefix of finished requests' records ([`result`]).
pub const RESULTS: &str = "/kvfleet/results/";
/// Prefix of instance roles under prefill/decode disaggregation ([`role`]).
pub const ROLES: &str = "/kvfleet/roles/";
/// Prefix of role changes ([`role_change`]).
pub const ROLE_CHANGES: &str = "/kvfleet/role-changes/";
/// Prefix of the live migrations the leaders ran ([`migration_log_entry`]): each leader logs its
/// own, and a new leader reads the run's so far back.
pub const MIGRATION_LOG: &str = "/kvfleet/migration-log/";
/// Prefix of settled prefill/decode handoffs ([`handoff`]): how each ended.
pub const HANDOFFS: &str = "/kvfleet/handoffs/";
/// Name (key prefix) of the coordinator election.
pub const ELECTION: &str = "/kvfleet/leader";
/// Instance numbers claimed by `--instance auto` workers (see [`instance_claim`]).
pub const INSTANCES: &str = "/kvfleet/instances/";

/// The registration key of instance `instance`.
pub fn worker(instance: u32) -> String {
    format!("{WORKERS}{instance}")
}
/// The claim key of instance number `instance`: created only if absent (and only while
/// [`worker`] of the same number is absent), under the lease the worker then registers with, so
/// the number is free again exactly when the registration lapses.
pub fn instance_claim(instance: u32) -> String {
    format!("{INSTANCES}{instance}")
}
/// The role key of instance `instance`.
pub fn role(instance: u32) -> String {
    format!("{ROLES}{instance}")
}
/// The key of instance `instance`'s role change at cluster time `at_ns` (zero-padded, so keys
/// sort by time).
pub fn role_change(at_ns: u64, instance: u32) -> String {
    format!("{ROLE_CHANGES}{at_ns:020}-{instance}")
}
/// The key of one settled live migration: its start (zero-padded, so keys sort by it), request
/// and source instance.
pub fn migration_log_entry(started_ns: u64, request: u64, source: u32) -> String {
    format!("{MIGRATION_LOG}{started_ns:020}-{request}-{source}")
}
/// The key of request `id`'s settled handoff.
pub fn handoff(id: u64) -> String {
    format!("{HANDOFFS}{id}")
}
/// The ownership key of request `id` (zero-padded to 20 digits so keys sort by id).
pub fn request(id: u64) -> String {
    format!("{REQUESTS}{id:020}")
}
/// The result key of request `id` (zero-padded to 20 digits so keys sort by id).
pub fn result(id: u64) -> String {
    format!("{RESULTS}{id:020}")
}

/// What every process of a cluster must agree on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterRecord {
    /// The model every worker must serve.
    pub model: ClusterModel,
    /// Cluster clock origin: `Timestamp` 0 in every process, as Unix nanoseconds.
    pub epoch_unix_ns: u64,
    /// Real seconds per emulated second, the same in every process (absent in records written
    /// before dilation existed: real time).
    #[serde(default, skip_serializing_if = "Dilation::is_none")]
    pub time_dilation: Dilation,
}

impl ClusterRecord {
    /// This cluster's clock.
    pub fn clock(&self) -> ClusterTime {
        ClusterTime { epoch_unix_ns: self.epoch_unix_ns, dilation: self.time_dilation }
    }
}

/// Cluster time read from the wall clock: emulated nanoseconds since the epoch, the wall clock
/// running `dilation` times faster. For processes that stamp events (the leader, the OpenAI API,
/// the load generator); workers anchor theirs on the monotonic clock (same mapping).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClusterTime {
    /// Cluster time 0, Unix nanoseconds.
    pub epoch_unix_ns: u64,
    /// Real seconds per emulated second.
    pub dilation: Dilation,
}

impl ClusterTime {
    /// Cluster time now (0 before the epoch).
    pub fn now(&self) -> Timestamp {
        self.at_unix_ns(unix_now_ns())
    }

    /// The cluster time of a Unix instant (0 before the epoch).
    pub fn at_unix_ns(&self, unix_ns: u64) -> Timestamp {
        Timestamp(self.dilation.emulated_ns(unix_ns.saturating_sub(self.epoch_unix_ns)))
    }

    /// The Unix instant (ns) of cluster time `t`.
    pub fn unix_ns(&self, t: Timestamp) -> u64 {
        self.epoch_unix_ns.saturating_add(self.dilation.real_ns(t.0))
    }
}

/// The wall clock, ns since the Unix epoch (0 if the clock reads before 1970).
pub fn unix_now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// A worker's registration, as stored (the gRPC `WorkerInfo` in JSON-friendly form).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// Instance number.
    pub instance: u32,
    /// The gRPC address it advertises (`host:port`).
    pub address: String,
    /// Model it serves.
    pub model: String,
    /// KV-cache bytes per token.
    pub kv_bytes_per_token: u64,
    /// KV blocks in GPU memory.
    pub gpu_blocks: u32,
    /// Tokens per KV block (0 in records of earlier versions: unknown until its first load report).
    #[serde(default)]
    pub block_size: u32,
    /// Its intra-instance scheduler (`fcfs`, `rr` or `pascal`).
    pub scheduler: String,
    /// Where it receives live KV migrations (QUIC); empty when it cannot.
    #[serde(default)]
    pub kv_address: String,
    /// Which process of this instance number registered (its start time, Unix nanoseconds; 0 in
    /// records of earlier versions). A new one under a known number means the old process, and
    /// every request it held, is gone, whether or not its registration has lapsed yet.
    #[serde(default)]
    pub incarnation: u64,
    /// Arrow's profile of the instance, measured by the worker (absent in records of earlier
    /// versions, and when the worker measured none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrow_profile: Option<ProfileRecord>,
}

/// Arrow's profile of one instance as a worker registers it: T(l) = a·l² + b·l + c seconds for an
/// l-token prompt, and the most decode batch tokens within `slo_tpot_s` (before the cap its KV
/// sets, which the leader applies).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProfileRecord {
    /// a of T(l), seconds per token².
    pub prefill_a: f64,
    /// b of T(l), seconds per token.
    pub prefill_b: f64,
    /// c of T(l), seconds.
    pub prefill_c: f64,
    /// MT: the most decode batch tokens with an iteration within `slo_tpot_s`.
    pub decode_max_tokens: u64,
    /// The SLO_TPOT MT was measured against, seconds.
    pub slo_tpot_s: f64,
}

impl From<&kvfleet_proto::v1::ArrowProfile> for ProfileRecord {
    fn from(p: &kvfleet_proto::v1::ArrowProfile) -> Self {
        ProfileRecord {
            prefill_a: p.prefill_a,
            prefill_b: p.prefill_b,
            prefill_c: p.prefill_c,
            decode_max_tokens: p.decode_max_tokens,
            slo_tpot_s: p.slo_tpot_s,
        }
    }
}

impl From<&kvfleet_proto::v1::WorkerInfo> for WorkerRecord {
    /// The registration a worker's self-description turns into.
    fn from(info: &kvfleet_proto::v1::WorkerInfo) -> Self {
        WorkerRecord {
            instance: info.instance,
            address: info.advertise.clone(),
            model: info.model.clone(),
            kv_bytes_per_token: info.kv_bytes_per_token,
            gpu_blocks: info.gpu_blocks,
            block_size: info.block_size,
            scheduler: info.scheduler.clone(),
            kv_address: info.kv_address.clone(),
            incarnation: info.incarnation,
            arrow_profile: info.arrow_profile.as_ref().map(ProfileRecord::from),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registrations_of_earlier_versions_still_load() {
        let old = r#"{"instance":3,"address":"10.0.0.3:7100","model":"m","kv_bytes_per_token":2,"gpu_blocks":64,"scheduler":"pascal"}"#;
        let rec: WorkerRecord = serde_json::from_str(old).unwrap();
        assert_eq!((rec.instance, rec.block_size, rec.kv_address.as_str(), rec.incarnation), (3, 0, "", 0));
    }
}

#[cfg(test)]
mod profile_tests {
    use super::*;

    /// A registered Arrow profile reaches the leader as the worker measured it, bit for bit: its
    /// numbers cross etcd as JSON, whose shortest round-trip printing needs an exact parser back
    /// (serde_json's default one is off by an ulp now and then).
    #[test]
    fn a_profile_survives_its_json_bit_for_bit() {
        let mut bits = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            bits = bits.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            // Positive, finite, spread over the exponents a fit's coefficients take.
            f64::from_bits((bits >> 12) | (((bits >> 4) % 80 + 983) << 52))
        };
        for _ in 0..20_000 {
            let p = ProfileRecord {
                prefill_a: next(),
                prefill_b: next(),
                prefill_c: next(),
                decode_max_tokens: 4096,
                slo_tpot_s: next(),
            };
            let back: ProfileRecord = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
            let as_bits = |p: &ProfileRecord| [p.prefill_a, p.prefill_b, p.prefill_c, p.slo_tpot_s].map(f64::to_bits);
            assert_eq!(as_bits(&back), as_bits(&p), "{p:?} came back as {back:?}");
        }
    }
}
