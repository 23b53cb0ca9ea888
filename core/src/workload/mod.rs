//! Workloads (placeholder, being written).
