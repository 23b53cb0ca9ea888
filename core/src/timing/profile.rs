//! Profile-table timing model (placeholder, being written).
