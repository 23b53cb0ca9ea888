//! Deciding on the loads as of the decision's instant, as the simulator does.
//!
//! The simulator places a request arriving at `t` on every instance's load as of `t`: each
//! iteration that ended by then has been reported. A worker reports an iteration's end when its
//! timer fires and its report crosses a stream, a millisecond or more later; a placement made
//! meanwhile saw a request that had already finished still holding its blocks, and from that one
//! decision on the two backends placed differently. So each report says when the instance's next
//! one is due (`LoadReport::due_ns`: the end of its iteration in flight), and before deciding as
//! of `t` the leader waits for every report due by `t`, up to a bound. A paused worker costs
//! that bound once, not every decision (it is not waited for again until it reports), and a
//! worker behind its schedule by more than the bound (its host cannot keep up) is not waited
//! for at all: it would hold up every placement.

use kvfleet_core::{InstanceId, Timestamp};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::Notify;

/// The longest a decision waits for reports due before its instant.
pub const REPORT_WAIT: Duration = Duration::from_millis(20);

/// When each instance's next load report is due, and a signal when one arrives.
#[derive(Default)]
pub struct DueReports {
    due: Mutex<HashMap<InstanceId, u64>>,
    arrived: Notify,
}

impl DueReports {
    /// `instance` reported; its next report is due at `due_ns` (0: none foreseen).
    pub fn reported(&self, instance: InstanceId, due_ns: u64) {
        self.lock().insert(instance, due_ns);
        self.arrived.notify_waiters();
    }

    /// `instance` left: nothing more is expected from it.
    pub fn forget(&self, instance: InstanceId) {
        self.lock().remove(&instance);
        self.arrived.notify_waiters();
    }

    /// Wait until no report due by `at` (and not `bound` or more before it) is missing, or
    /// `bound` passed; the instances given up on (not waited for again until they report).
    /// `except` is not waited for: the instance whose own event (in order on its stream, after
    /// the report it is due as of) is being decided.
    pub async fn wait_through(&self, at: Timestamp, bound: Duration, except: Option<InstanceId>) -> Vec<InstanceId> {
        let deadline = tokio::time::Instant::now() + bound;
        let since = at.0.saturating_sub(u64::try_from(bound.as_nanos()).unwrap_or(u64::MAX));
        loop {
            // Registered before the check, so a report landing in between is not missed.
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            if overdue(&self.lock(), since, at, except).next().is_none() {
                return Vec::new();
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                let mut due = self.lock();
                let late: Vec<InstanceId> = overdue(&due, since, at, except).collect();
                for i in &late {
                    due.insert(*i, 0);
                }
                return late;
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<InstanceId, u64>> {
        self.due.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The instances whose report due in `since..=at` (ns) has not arrived.
fn overdue(
    due: &HashMap<InstanceId, u64>,
    since: u64,
    at: Timestamp,
    except: Option<InstanceId>,
) -> impl Iterator<Item = InstanceId> + '_ {
    due.iter().filter(move |(&i, &d)| d != 0 && since <= d && d <= at.0 && Some(i) != except).map(|(&i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn a_decision_waits_for_reports_due_by_its_instant_and_no_longer() {
        let reports = Arc::new(DueReports::default());
        reports.reported(InstanceId(0), 1_000);
        reports.reported(InstanceId(1), 5_000);
        reports.reported(InstanceId(2), 0);
        // Nothing due by 999: no wait.
        let t = tokio::time::Instant::now();
        assert!(reports.wait_through(Timestamp(999), Duration::from_secs(5), None).await.is_empty());
        assert!(t.elapsed() < Duration::from_secs(1));
        // Instance 0's report is due by 2,000: the wait ends when it comes (due next at 9,000).
        let late = {
            let r = reports.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(30)).await;
                r.reported(InstanceId(0), 9_000);
            })
        };
        let t = tokio::time::Instant::now();
        assert!(reports.wait_through(Timestamp(2_000), Duration::from_secs(5), None).await.is_empty());
        assert!(t.elapsed() >= Duration::from_millis(30), "waited for the report");
        late.await.unwrap();
        // Instance 1's never comes: given up after the bound, and not waited for again.
        let t = tokio::time::Instant::now();
        assert_eq!(reports.wait_through(Timestamp(6_000), Duration::from_millis(40), None).await, vec![InstanceId(1)]);
        assert!(t.elapsed() >= Duration::from_millis(40));
        let t = tokio::time::Instant::now();
        assert!(reports.wait_through(Timestamp(6_000), Duration::from_secs(5), None).await.is_empty());
        assert!(t.elapsed() < Duration::from_secs(1));
        // One behind its schedule by the bound or more is not waited for.
        reports.reported(InstanceId(0), 0);
        reports.reported(InstanceId(1), 1_000);
        let t = tokio::time::Instant::now();
        assert!(reports.wait_through(Timestamp(1_001 + 40_000_000), Duration::from_millis(40), None).await.is_empty());
        assert!(t.elapsed() < Duration::from_millis(30));
        reports.reported(InstanceId(1), 0);
        // The instance whose own event is decided is not waited for.
        reports.reported(InstanceId(1), 7_000);
        let t = tokio::time::Instant::now();
        assert!(reports.wait_through(Timestamp(8_000), Duration::from_secs(5), Some(InstanceId(1))).await.is_empty());
        assert!(t.elapsed() < Duration::from_secs(1));
        reports.reported(InstanceId(1), 0);
        // A worker that left is not waited for.
        reports.reported(InstanceId(3), 100);
        reports.forget(InstanceId(3));
        assert!(reports.wait_through(Timestamp(6_000), Duration::from_secs(5), None).await.is_empty());
    }
}
