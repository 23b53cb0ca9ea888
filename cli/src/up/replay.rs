//! The load generator of `kvfleet up`: submits every request of a workload at its arrival time
//! (on the cluster clock) through the leader and follows it to its final record. A broken stream
//! (the leader died) is resumed through the new leader, so every request ends with exactly one
//! record.

use kvfleet_core::metrics::RequestRecord;
use kvfleet_core::{RequestSpec, Timestamp};
pub use kvfleet_meta::layout::unix_now_ns;
use kvfleet_meta::layout::ClusterTime;
use kvfleet_proto::v1;
use kvfleet_proto::v1::coordinator_client::CoordinatorClient;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{oneshot, watch};
use tonic::transport::Channel;
use tonic::Code;

/// Counters the progress bar and the summary show.
#[derive(Debug, Default)]
pub struct ReplayStats {
    pub submitted: AtomicU64,
    pub finished: AtomicU64,
    pub resumed: AtomicU64,
    pub retries: AtomicU64,
    pub tokens: AtomicU64,
}

/// Where one request's client has got to; named in its error if the run gives up on it.
#[derive(Debug, Default)]
struct Progress {
    phase: &'static str,
    /// The instance the leader last said it placed the request on.
    instance: Option<u32>,
    tokens: u64,
    attempts: u32,
}

impl Progress {
    fn set(cell: &Mutex<Progress>, f: impl FnOnce(&mut Progress)) {
        f(&mut cell.lock().expect("progress lock"));
    }

    fn describe(&self) -> String {
        let on = self.instance.map_or_else(|| "not placed".to_string(), |i| format!("last placed on instance {i}"));
        format!("{} ({on}, {} tokens received, attempt {})", self.phase, self.tokens, self.attempts)
    }
}

/// Tells every request still running to give up, with the reason (a timeout, a stalled cluster):
/// each then ends with an error naming where it was, so a run that cannot finish says which
/// requests are missing and why instead of waiting forever.
#[derive(Clone, Debug)]
pub struct GiveUp(watch::Sender<Option<String>>);

impl Default for GiveUp {
    fn default() -> Self {
        GiveUp(watch::channel(None).0)
    }
}

impl GiveUp {
    pub fn give_up(&self, reason: impl Into<String>) {
        self.0.send_replace(Some(reason.into()));
    }

    /// Resolves with the reason once [`GiveUp::give_up`] was called.
    async fn wait(&self) -> String {
        let mut rx = self.0.subscribe();
        if rx.wait_for(Option::is_some).await.is_err() {
            // The sender lives in `self`: the channel cannot close while we wait.
            std::future::pending::<()>().await;
        }
        let reason = rx.borrow().clone().unwrap_or_default();
        reason
    }
}

/// How long one coordinator may take to answer `Status` (above the coordinator's own 5 s bound on
/// the etcd read it makes to name the leader).
const STATUS_TIMEOUT: Duration = Duration::from_secs(10);

/// A coordinator's `Status`, within [`STATUS_TIMEOUT`]: one that accepts the connection but never
/// answers counts as down.
async fn status_within(
    c: &mut CoordinatorClient<Channel>,
    addr: &str,
    limit: Duration,
) -> Result<v1::ClusterStatus, tonic::Status> {
    match tokio::time::timeout(limit, c.status(v1::StatusRequest {})).await {
        Ok(answer) => answer.map(tonic::Response::into_inner),
        Err(_) => Err(tonic::Status::deadline_exceeded(format!("{addr}: no answer within {limit:?}"))),
    }
}

/// Finds and talks to the current leader among `coordinators`.
#[derive(Clone)]
pub struct LeaderFinder {
    coordinators: Vec<String>,
    /// The client's cluster certificate (mutual TLS), or `None` for a plain-text cluster.
    tls: Option<kvfleet_pki::NodeIdentity>,
    /// The leader last found, shared by every clone: requests reuse its channel (one HTTP/2
    /// connection) instead of asking two `Status`es on fresh mutual-TLS channels each, which cost
    /// a request tens of milliseconds between its arrival and its placement.
    known: Arc<Mutex<Option<CoordinatorClient<Channel>>>>,
}

impl LeaderFinder {
    pub fn new(coordinators: Vec<String>, tls: Option<kvfleet_pki::NodeIdentity>) -> Self {
        LeaderFinder { coordinators, tls, known: Arc::default() }
    }

    /// The leader's client: the one last found while it serves, else found afresh.
    pub async fn client(&self, deadline: Duration) -> Result<CoordinatorClient<Channel>, tonic::Status> {
        if let Some(c) = self.known.lock().expect("leader cache lock").clone() {
            return Ok(c);
        }
        let (c, _) = self.leader(deadline).await?;
        *self.known.lock().expect("leader cache lock") = Some(c.clone());
        Ok(c)
    }

    /// Forget the leader last found (it failed a call: it may be dead, paused or deposed).
    pub fn forget(&self) {
        *self.known.lock().expect("leader cache lock") = None;
    }

    fn channel(&self, addr: &str) -> Result<Channel, tonic::Status> {
        kvfleet_pki::endpoint(addr, self.tls.as_ref())
            .map_err(tonic::Status::invalid_argument)
            .map(|e| e.connect_timeout(Duration::from_secs(1)).tcp_nodelay(true).connect_lazy())
    }

    /// The leader's client, asking every coordinator until one names a live leader.
    pub async fn leader(
        &self,
        deadline: Duration,
    ) -> Result<(CoordinatorClient<Channel>, v1::ClusterStatus), tonic::Status> {
        let until = tokio::time::Instant::now() + deadline;
        let mut last = tonic::Status::unavailable("no coordinator answered");
        loop {
            for addr in &self.coordinators {
                // Each call within what is left of the deadline: a paused coordinator named as
                // the leader must not hold the search past it (chaos measures failovers so).
                let limit = STATUS_TIMEOUT.min(until.saturating_duration_since(tokio::time::Instant::now()));
                let limit = limit.max(Duration::from_millis(100));
                let mut c = CoordinatorClient::new(self.channel(addr)?);
                match status_within(&mut c, addr, limit).await {
                    Ok(s) => {
                        if s.leader.is_empty() {
                            last = tonic::Status::unavailable("no leader elected yet");
                            continue;
                        }
                        let mut lc = CoordinatorClient::new(self.channel(&s.leader)?);
                        // Only while the one named still reads itself as the leader: a leader
                        // resumed from a pause may answer while its lease has lapsed and nobody
                        // leads yet (chaos then logged a failover to "").
                        match status_within(&mut lc, &s.leader, limit).await {
                            Ok(ls) if ls.leader == s.leader => return Ok((lc, ls)),
                            Ok(_) => last = tonic::Status::unavailable("the leader changed while asked"),
                            Err(e) => last = e,
                        }
                    }
                    Err(e) => last = e,
                }
            }
            if tokio::time::Instant::now() >= until {
                return Err(last);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Run one request to its final record. `spec.arrival` is on the cluster clock. `placed` fires
/// once the leader has placed it (or the first attempt failed).
async fn run_request(
    finder: LeaderFinder,
    spec: RequestSpec,
    stats: Arc<ReplayStats>,
    failover_wait: Duration,
    progress: &Mutex<Progress>,
    placed: oneshot::Sender<()>,
) -> Result<RequestRecord, String> {
    let mut placed = Some(placed);
    let mut submitted = false;
    let mut attempts = 0u32;
    // Waits between attempts while no leader serves (an election, an etcd outage): doubling, capped.
    let mut backoff = Duration::from_millis(50);
    loop {
        attempts += 1;
        if attempts > 200 {
            return Err(format!("request {} gave up after {attempts} attempts", spec.id.0));
        }
        Progress::set(progress, |p| {
            p.phase = "finding the leader";
            p.attempts = attempts;
        });
        let mut client =
            finder.client(failover_wait).await.map_err(|e| format!("request {}: no leader: {e}", spec.id.0))?;
        let stream = if submitted {
            stats.resumed.fetch_add(1, Ordering::Relaxed);
            client.resume(v1::ResumeRequest { request_id: spec.id.0 }).await
        } else {
            client.submit(v1::ClientSubmit { spec: Some((&spec).into()) }).await
        };
        if stream.is_err() {
            tell(&mut placed);
            finder.forget();
        }
        let mut stream = match stream {
            Ok(s) => s.into_inner(),
            Err(e) if e.code() == Code::AlreadyExists => {
                // Our earlier submit reached a leader that died before answering: resume it.
                submitted = true;
                continue;
            }
            Err(e) if e.code() == Code::NotFound && submitted => {
                // The new leader never saw it (the old one died before storing it): submit again.
                submitted = false;
                continue;
            }
            Err(e)
                if matches!(e.code(), Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded) =>
            {
                stats.retries.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
            Err(e) => return Err(format!("request {}: {e}", spec.id.0)),
        };
        if !submitted {
            stats.submitted.fetch_add(1, Ordering::Relaxed);
        }
        Progress::set(progress, |p| p.phase = "waiting for the leader to place it");
        backoff = Duration::from_millis(50);
        loop {
            match stream.message().await {
                Ok(Some(ev)) => match ev.event {
                    Some(v1::client_event::Event::AcceptedOn(i)) => {
                        tell(&mut placed);
                        Progress::set(progress, |p| {
                            p.phase = "placed, waiting for tokens";
                            p.instance = Some(i);
                        })
                    }
                    Some(v1::client_event::Event::Tokens(t)) => {
                        stats.tokens.fetch_add(t.count as u64, Ordering::Relaxed);
                        Progress::set(progress, |p| {
                            p.phase = "streaming tokens";
                            p.tokens += t.count as u64;
                        });
                    }
                    Some(v1::client_event::Event::Finished(r)) => {
                        stats.finished.fetch_add(1, Ordering::Relaxed);
                        return Ok(RequestRecord::from(&r));
                    }
                    None => {}
                },
                // The leader went away mid-stream: find the new one and resume.
                Ok(None) | Err(_) => {
                    finder.forget();
                    submitted = true;
                    stats.retries.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
    }
}

/// Fire a once-only signal (if not fired yet; nobody listening is fine).
fn tell(signal: &mut Option<oneshot::Sender<()>>) {
    if let Some(s) = signal.take() {
        let _ = s.send(());
    }
}

/// A replay's outcomes split into the finished records (by request id) and the failures.
pub fn partition(results: Vec<Result<RequestRecord, String>>) -> (Vec<RequestRecord>, Vec<String>) {
    let (mut ok, mut failed) = (Vec::new(), Vec::new());
    for r in results {
        match r {
            Ok(rec) => ok.push(rec),
            Err(e) => failed.push(e),
        }
    }
    ok.sort_by_key(|r| r.id);
    (ok, failed)
}

/// Submit every request at its arrival on the cluster clock and wait for all records, or until
/// `give_up` fires: every request still running then ends with an error naming where it was.
///
/// Requests reach the leader in arrival order: a dispatcher releases each at its arrival time,
/// once the one before it was placed (or [`ORDER_WAIT`] passed). Timers are millisecond-grained, so without this two
/// arrivals a fraction of a millisecond apart race, and the leader may place them in the other
/// order than the simulator does.
pub async fn replay(
    finder: LeaderFinder,
    requests: Vec<RequestSpec>,
    clock: ClusterTime,
    stats: Arc<ReplayStats>,
    failover_wait: Duration,
    give_up: GiveUp,
) -> Vec<Result<RequestRecord, String>> {
    let mut order: Vec<(Timestamp, u64, usize)> =
        requests.iter().enumerate().map(|(i, r)| (r.arrival, r.id.0, i)).collect();
    order.sort_unstable();
    let mut tasks = Vec::with_capacity(requests.len());
    // Per request: the dispatcher's go, and the request's "placed" back to the dispatcher.
    let mut gates = Vec::with_capacity(requests.len());
    for spec in requests {
        let finder = finder.clone();
        let stats = stats.clone();
        let give_up = give_up.clone();
        let (go_tx, go) = oneshot::channel::<()>();
        let (placed, placed_rx) = oneshot::channel::<()>();
        gates.push((Some(go_tx), Some(placed_rx)));
        tasks.push(tokio::spawn(async move {
            let id = spec.id.0;
            let progress = Mutex::new(Progress { phase: "not yet due", ..Progress::default() });
            let run = async {
                // Fired, or dropped (the dispatcher is gone): either way, go.
                let _ = go.await;
                run_request(finder, spec, stats, failover_wait, &progress, placed).await
            };
            tokio::select! {
                r = run => r,
                why = give_up.wait() => Err(format!(
                    "request {id}: given up ({why}) while {}",
                    progress.lock().expect("progress lock").describe()
                )),
            }
        }));
    }
    // The dispatcher: each request at its arrival time, once the one before it was placed.
    let dispatcher = tokio::spawn(async move {
        for (arrival, _, i) in order {
            let due_unix = clock.unix_ns(arrival);
            let now = unix_now_ns();
            if due_unix > now {
                tokio::time::sleep(Duration::from_nanos(due_unix - now)).await;
            }
            let (go, placed) = &mut gates[i];
            if let Some(go) = go.take() {
                let _ = go.send(());
            }
            if let Some(placed) = placed.take() {
                // Placed, failed or given up (dropped): next. A leader election: time runs on.
                let _ = tokio::time::timeout(ORDER_WAIT, placed).await;
            }
        }
    });
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.unwrap_or_else(|e| Err(format!("client task failed: {e}"))));
    }
    dispatcher.abort();
    out
}

/// The longest a request waits for the one before it to be placed: well above a placement's usual
/// latency (a `Submit` on the leader's open channel; after a failure, two `Status` calls on new
/// mutual-TLS channels first); during a leader election or an etcd outage requests then go out
/// this far apart.
pub const ORDER_WAIT: Duration = Duration::from_millis(250);

/// The cluster clock a leader's status names (a leader from before time dilation: real time).
pub fn status_clock(status: &v1::ClusterStatus) -> Result<ClusterTime, kvfleet_core::time::DilationError> {
    let dilation = match status.time_dilation {
        0.0 => kvfleet_core::Dilation::NONE,
        k => kvfleet_core::Dilation::new(k)?,
    };
    Ok(ClusterTime { epoch_unix_ns: status.epoch_unix_ns, dilation })
}

/// Shift a workload (arrivals from 0) to start `lead` (real time) after now, on the cluster clock.
pub fn schedule(requests: &mut [RequestSpec], clock: ClusterTime, lead: Duration) {
    let start = clock.now() + clock.dilation.emulated(lead);
    let start = start.0;
    for r in requests {
        r.arrival = Timestamp(start + r.arrival.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvfleet_core::RequestId;

    fn spec(id: u64, arrival_ns: u64) -> RequestSpec {
        RequestSpec {
            content_ids: Vec::new(),
            id: RequestId(id),
            arrival: Timestamp(arrival_ns),
            prompt_tokens: 1,
            reasoning_tokens: 1,
            answer_tokens: 1,
        }
    }

    #[tokio::test]
    async fn giving_up_ends_every_unfinished_request_with_where_it_was() {
        // One request due in an hour, one due now against a coordinator that is not there
        // (a closed port: the client keeps looking for a leader).
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let finder = LeaderFinder::new(vec![format!("http://{closed}")], None);
        let epoch = ClusterTime { epoch_unix_ns: unix_now_ns(), dilation: kvfleet_core::Dilation::NONE };
        let requests = vec![spec(0, 3_600_000_000_000), spec(1, 0)];
        let give_up = GiveUp::default();
        let stats = Arc::new(ReplayStats::default());
        let run = tokio::spawn(replay(finder, requests, epoch, stats, Duration::from_secs(3600), give_up.clone()));
        // On this single-threaded runtime, yielding lets the replay spawn its request tasks and
        // the due one start looking for its leader.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        give_up.give_up("test over");
        let results = tokio::time::timeout(Duration::from_secs(10), run).await.expect("ends once given up").unwrap();
        let errors: Vec<String> = results.into_iter().map(|r| r.expect_err("nothing can finish")).collect();
        assert!(errors[0].starts_with("request 0: given up (test over) while not yet due"), "{}", errors[0]);
        assert!(errors[1].starts_with("request 1: given up (test over) while finding the leader"), "{}", errors[1]);
        assert!(errors[1].contains("not placed"), "{}", errors[1]);
    }

    #[test]
    fn progress_names_the_instance_and_the_tokens() {
        let p = Progress { phase: "streaming tokens", instance: Some(3), tokens: 17, attempts: 2 };
        assert_eq!(p.describe(), "streaming tokens (last placed on instance 3, 17 tokens received, attempt 2)");
    }
}
