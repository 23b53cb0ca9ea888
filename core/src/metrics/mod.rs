//! Metrics (placeholder, being written).
pub mod record;
pub use record::RequestRecord;
