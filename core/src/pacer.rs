//! Token pacer (placeholder, being written).
