//! Paged KV block manager (placeholder, being written).
