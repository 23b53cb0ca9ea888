//! Analytic roofline timing model (placeholder, being written).
