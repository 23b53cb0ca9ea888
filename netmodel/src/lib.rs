//! kvfleet-netmodel: how KV caches move between instances.
//!
//! | module | what lives there |
//! |---|---|
//! | [`link`] | the simulator's network: per-instance full-duplex NICs, bandwidth shared by concurrent transfers, one-way latency (PASCAL §IV-B "KV cache transfer overhead", §V-C) |
//!
//! Like `kvfleet-core` it is sans-IO: time is passed in as [`kvfleet_core::SimTime`].
//!
//! Later it will also hold the `KvTransport` trait with its QUIC, RDMA and in-memory transports,
//! and the migration state machine (PREPARE, pipelined copy stages, stop-and-copy, COMMIT/ABORT;
//! SPEC "Migration") that the simulator and the worker both drive.

pub mod link;

pub use link::{Fabric, LinkError, LinkParams, TransferId};
