//! kvfleet-worker: the process that emulates one GPU instance (real-time driver of the core engine). The driver arrives with the multi-process emulator issue; today this crate only re-exports what it will drive.
pub use kvfleet_core::engine;
