//! Engine (placeholder, being written).
