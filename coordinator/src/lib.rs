//! kvfleet-coordinator: the control plane of the emulator.
//!
//! | module | what lives there |
//! |---|---|
//! | [`state`] | sans-IO scheduling state: registry, request ownership, the instance-level policy from `kvfleet-core` |
//! | [`leader`] | the leader's async driver: worker event logs, placement, migration, fenced writes |
//! | [`node`] | one coordinator process: gRPC service, campaign loop, registry watch |
//! | [`openai`] | the OpenAI-compatible HTTP API (`--http-listen`): chat/completions, SSE streaming |
//! | [`trace`] | request spans: open at acceptance, context sent with Submit/MigrateOut, phases at the end |
//!
//! The metadata-store layout is `kvfleet_meta::layout` (shared with workers).

pub mod leader;
pub mod metrics;
pub mod node;
pub mod openai;
pub mod state;
pub mod trace;
