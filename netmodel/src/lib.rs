//! kvfleet-netmodel: how KV caches move between instances.
//!
//! | module | what lives there |
//! |---|---|
//! | [`link`] | the simulator's network: per-instance full-duplex NICs, bandwidth shared by concurrent transfers, one-way latency (PASCAL §IV-B "KV cache transfer overhead", §V-C) |
//! | [`migration`] | the live-migration protocol as a sans-IO state machine (PREPARE, pipelined copy stages, stop-and-copy, COMMIT/ABORT; Llumnix §4.2), shared by every transport |
//! | [`payload`] | a frame's bulk payload as the list of buffers it arrived in ([`Payload`]): received KV is copied once, into the arena |
//! | [`shaping`] | link shaping (token-bucket rate, added latency) so a run can emulate a fabric's timing on a faster or slower host |
//!
//! Like `kvfleet-core` it is sans-IO: time is passed in as [`kvfleet_core::Timestamp`]. The byte
//! movers (QUIC, RDMA, in-memory) live in `kvfleet-transport`.

#![warn(missing_docs)]

pub mod link;
pub mod migration;
pub mod payload;
pub mod shaping;

pub use link::{Fabric, LinkError, LinkParams, TransferId};
pub use payload::Payload;
