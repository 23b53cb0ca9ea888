//! kvfleet-coordinator: etcd registry, leader election and the instance-level scheduler driver. Filled by the multi-process emulator issue; today it re-exports the policies it will run.
pub use kvfleet_core::policy;
