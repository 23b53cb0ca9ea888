//! kvfleet-coordinator: the control plane of the emulator.
//!
//! | module | what lives there |
//! |---|---|
//! | [`leader`] | the leader's async driver of the cluster controller (`kvfleet-control`, shared with the simulator): worker event logs, fenced ownership writes, migrations, client streams |
//! | [`node`] | one coordinator process: gRPC service, campaign loop, registry watch |
//! | [`openai`] | the OpenAI-compatible HTTP API (`--http-listen`): chat/completions, SSE streaming |
//! | [`trace`] | request spans: open at acceptance, context sent with Submit/MigrateOut, phases at the end |
//!
//! The metadata-store layout is `kvfleet_meta::layout` (shared with workers).

#![warn(missing_docs)]

pub mod leader;
pub mod metrics;
pub mod node;
pub mod openai;
pub mod trace;
