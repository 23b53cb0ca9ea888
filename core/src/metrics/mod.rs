//! Metrics: per-request records reduced to what PASCAL §V reports (TTFT, TTFAT, TPOT, E2E, QoE,
//! tail bins) plus KV-migration statistics.
//!
//! | file | what lives there |
//! |---|---|
//! | [`record`] | [`RequestRecord`], every timestamp of one request (filled by the engine) |
//! | [`compare`] | [`compare_tails`]: a policy's binned tail TTFT against a baseline's, scored as PASCAL §V does; [`SeedRange`] |
//! | [`migration`] | [`MigrationRecord`], one KV-cache migration at a phase boundary as either backend measured it ([`MigrationOutcome`]) |
//! | [`percentile`] | nearest-rank percentiles (`P_q = x[ceil(q·n) − 1]`) and [`Distribution`] |
//! | [`summary`] | [`SloTargets`] and [`summarize`] → [`RunSummary`] (one JSON object / CSV row per run) |
//! | [`run`] | [`RunResult`]: one run of either backend, built from its records the same way; [`LiveMigrations`] |
//! | [`tail`] | tail TTFT per 256-token reasoning bin (Fig. 10) and the TTFT CDF |
//!
//! The per-request QoE itself is computed while the request runs, by [`crate::pacer::TokenPacer`].

pub mod compare;
pub mod migration;
pub mod percentile;
pub mod record;
pub mod run;
pub mod summary;
pub mod tail;

pub use compare::{compare_tails, BinChange, SeedRange, TailComparison, MIN_TRUSTED_SAMPLES};
pub use migration::{MigrationOutcome, MigrationRecord};
pub use percentile::{nearest_rank, Distribution};
pub use record::RequestRecord;
pub use run::{DecisionTimes, HandoffTimes, LiveMigrations, RoleChange, RunIdentity, RunResult, TAIL_BIN_TOKENS};
pub use summary::{summarize, RunSummary, SloTargets};
pub use tail::{tail_ttft_by_reasoning_bin, ttft_cdf, ttft_s, TailBin, TailStatistic};
