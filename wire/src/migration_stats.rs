//! What a [`v1::MigrationStats`] says about how its migration ended.

use crate::v1;

/// How the source words a declined `Prepare` (`AbortReason::Refused`'s message).
pub const REFUSED_PREFIX: &str = "refused by the target";

impl v1::MigrationStats {
    /// The migration committed (the request runs on the target): no abort reason.
    pub fn committed(&self) -> bool {
        self.abort_reason.is_empty()
    }

    /// The target declined the `Prepare` (no room): nothing was copied and the request never
    /// paused; the coordinator may try another target. Not an abort of a running migration.
    pub fn refused(&self) -> bool {
        !self.committed() && self.bytes == 0 && self.abort_reason.starts_with(REFUSED_PREFIX)
    }

    /// `committed`, `refused` or `aborted`.
    pub fn outcome_name(&self) -> &'static str {
        outcome_name(self.committed(), self.refused())
    }

    /// Its outcome as the target's answer settled it (`held`: the target runs the request), the
    /// source having never heard the move's end: in doubt; committed with no abort reason, or
    /// aborted with one.
    pub fn settle_in_doubt(&mut self, held: bool) {
        self.in_doubt = true;
        if held {
            self.abort_reason.clear();
        } else if self.abort_reason.is_empty() {
            self.abort_reason = "settled in doubt: the target did not hold it".into();
        }
    }

    /// Start to settle, in nanoseconds.
    pub fn total_ns(&self) -> u64 {
        self.ended_ns.saturating_sub(self.started_ns)
    }
}

/// How a migration ended, as every report names it: `committed`, `refused` (the target declined
/// before anything moved) or `aborted`.
pub fn outcome_name(committed: bool, refused: bool) -> &'static str {
    if committed {
        "committed"
    } else if refused {
        "refused"
    } else {
        "aborted"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_are_named() {
        let stats =
            |bytes, reason: &str| v1::MigrationStats { bytes, abort_reason: reason.into(), ..Default::default() };
        assert_eq!(stats(10, "").outcome_name(), "committed");
        assert_eq!(stats(0, &format!("{REFUSED_PREFIX}: no room")).outcome_name(), "refused");
        // A refusal after bytes moved is not a clean decline.
        assert_eq!(stats(10, &format!("{REFUSED_PREFIX}: no room")).outcome_name(), "aborted");
        assert_eq!(stats(0, "timeout").outcome_name(), "aborted");
    }
}
