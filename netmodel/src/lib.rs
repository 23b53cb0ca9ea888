//! kvfleet-netmodel (placeholder, being written).
