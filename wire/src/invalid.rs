//! [`InvalidField`]: a message from the network that failed validation.

/// A message from the network failed validation: names the field (`kvfleet-proto` turns it into
/// a gRPC `invalid_argument`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidField {
    /// The offending field, dotted from the message (`spec.answer_tokens`).
    pub field: &'static str,
    /// What is wrong with it.
    pub message: String,
}

impl InvalidField {
    /// A required field that is absent.
    pub(crate) fn missing(field: &'static str) -> Self {
        InvalidField { field, message: "missing".into() }
    }
}

impl std::fmt::Display for InvalidField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}`: {}", self.field, self.message)
    }
}

impl std::error::Error for InvalidField {}
