//! kvfleet-sim (placeholder, being written).
