//! Fault injection for `kvfleet up`: single faults at fixed times (`--kill-leader-after-s`, …)
//! and `--chaos SEED`, a seeded random schedule of them — kill -9 and SIGSTOP/SIGCONT of the
//! leader and of workers, a worker restarted at once under its instance number, etcd killed and
//! restarted. The same seed gives the same schedule; the run's checks (every request completed
//! exactly once, etcd's results equal the clients') decide whether the cluster survived it.

use super::cluster::Cluster;
use super::procs::signal_pid;
use super::replay::LeaderFinder;
use crate::say;
use indicatif::ProgressBar;
use kvfleet_core::SimRng;
use std::time::{Duration, Instant};

/// One fault.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fault {
    /// kill -9 the leader coordinator; it is started again (same address) 3 s later.
    KillLeader,
    /// SIGSTOP the leader for this many seconds, then SIGCONT.
    PauseLeader(f64),
    /// kill -9 worker `i` for good.
    KillWorker(usize),
    /// SIGSTOP worker `i` for this many seconds, then SIGCONT.
    PauseWorker(usize, f64),
    /// kill -9 worker `i` and start it again at once under the same instance number.
    RestartWorker(usize),
    /// kill -9 etcd and start it again (same data) 2 s later.
    RestartEtcd,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fault::KillLeader => write!(f, "kill -9 the leader (restarted 3 s later)"),
            Fault::PauseLeader(s) => write!(f, "SIGSTOP the leader for {s:.1} s"),
            Fault::KillWorker(i) => write!(f, "kill -9 worker-{i}"),
            Fault::PauseWorker(i, s) => write!(f, "SIGSTOP worker-{i} for {s:.1} s"),
            Fault::RestartWorker(i) => write!(f, "restart worker-{i} at once (same instance)"),
            Fault::RestartEtcd => write!(f, "kill -9 etcd (restarted 2 s later)"),
        }
    }
}

/// A fault and when, after the replay started.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scheduled {
    /// Seconds into the replay.
    pub at_s: f64,
    /// What happens.
    pub fault: Fault,
}

/// `faults` faults drawn from `seed`, spread over `[2 s, span_s)`, in time order. Worker faults
/// pick among `workers` (worker 0 is never killed for good, so one always stays); etcd faults
/// only with etcd.
pub fn random_schedule(seed: u64, faults: usize, span_s: f64, workers: usize, etcd: bool) -> Vec<Scheduled> {
    let mut rng = SimRng::seed_from_u64(seed ^ 0x6b76_6368_616f_7321);
    let kinds: &[u64] = if etcd { &[0, 1, 2, 3, 4, 5] } else { &[1, 2, 3, 4] };
    let mut out: Vec<Scheduled> = (0..faults)
        .map(|_| {
            let at_s = 2.0 + rng.f64() * (span_s - 2.0).max(1.0);
            let worker = rng.below(workers.max(1) as u64) as usize;
            let pause = 3.0 + rng.f64() * 7.0;
            let fault = match kinds[rng.below(kinds.len() as u64) as usize] {
                0 => Fault::KillLeader,
                1 => Fault::PauseLeader(pause),
                2 => Fault::PauseWorker(worker, pause),
                3 => Fault::RestartWorker(worker),
                4 if worker > 0 && workers > 2 => Fault::KillWorker(worker),
                4 => Fault::RestartWorker(worker),
                _ => Fault::RestartEtcd,
            };
            Scheduled { at_s, fault }
        })
        .collect();
    if !etcd {
        // Without etcd there is one coordinator: killing it ends the cluster.
        out.retain(|s| s.fault != Fault::KillLeader);
    }
    out.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    out
}

/// What the faults did, for the run's report.
#[derive(Debug, Default)]
pub struct ChaosLog {
    /// Faults injected.
    pub faults: usize,
    /// What happened (faults, restarts, SIGCONTs), with when.
    pub injected: Vec<String>,
    /// Kill -9 (or SIGSTOP) of a leader → another coordinator answering as leader, ms.
    pub failovers_ms: Vec<u128>,
    /// Faults still pending when the run ended (scheduled past its end), as lines to print.
    pub not_injected: Vec<String>,
}

/// Carries out a schedule while the replay runs: call [`Chaos::step`] every ~100 ms.
pub struct Chaos {
    pending: Vec<Scheduled>,
    started: Instant,
    /// Stopped processes: (pid, name, when to SIGCONT).
    paused: Vec<(u32, String, Instant)>,
    /// Killed coordinators to start again: (index, when).
    coordinators_back: Vec<(usize, Instant)>,
    etcd_back_at: Option<Instant>,
    /// Failover times measured so far (by tasks of their own).
    failovers: std::sync::Arc<std::sync::Mutex<Vec<u128>>>,
    /// What happened.
    pub log: ChaosLog,
}

impl Chaos {
    /// A schedule starting now.
    pub fn new(mut schedule: Vec<Scheduled>) -> Chaos {
        schedule.sort_by(|a, b| b.at_s.total_cmp(&a.at_s)); // popped from the end
        Chaos {
            pending: schedule,
            started: Instant::now(),
            paused: Vec::new(),
            coordinators_back: Vec::new(),
            etcd_back_at: None,
            failovers: Default::default(),
            log: ChaosLog::default(),
        }
    }

    fn say(&mut self, bar: &ProgressBar, line: String) {
        let at = self.started.elapsed().as_secs_f64();
        bar.suspend(|| say!("chaos: {line} (t = {at:.1} s)"));
        self.log.injected.push(format!("{at:.1} s: {line}"));
    }

    /// Inject what is due, and end what is over (SIGCONT, restarts), in time order: a restart or
    /// SIGCONT that falls due while faults are injected (a leader fault can wait seconds for a
    /// leader to answer) is not held back by the faults due after it.
    pub async fn step(&mut self, cluster: &mut Cluster, finder: &LeaderFinder, bar: &ProgressBar) {
        loop {
            self.end_what_is_over(cluster, bar);
            let elapsed = self.started.elapsed().as_secs_f64();
            if !self.pending.last().is_some_and(|s| s.at_s <= elapsed) {
                return;
            }
            let s = self.pending.pop().expect("checked");
            self.inject(s.fault, cluster, finder, bar).await;
        }
    }

    /// No SIGCONT for `pid` (killed or replaced while stopped).
    fn forget_pause(&mut self, pid: u32) {
        self.paused.retain(|(p, _, _)| *p != pid);
    }

    /// SIGCONT the processes whose pause is over; start again etcd and the coordinators due back.
    fn end_what_is_over(&mut self, cluster: &mut Cluster, bar: &ProgressBar) {
        let now = Instant::now();
        let mut resumed = Vec::new();
        self.paused.retain(|(pid, name, at)| {
            if now < *at {
                return true;
            }
            signal_pid(*pid, "CONT");
            resumed.push(format!("SIGCONT {name} (pid {pid})"));
            false
        });
        for line in resumed {
            self.say(bar, line);
        }
        if self.etcd_back_at.is_some_and(|t| now >= t) {
            self.etcd_back_at = None;
            if let (Some(spec), Some(slot)) = (cluster.etcd_spec.as_ref(), cluster.etcd.as_mut()) {
                match spec.start() {
                    Ok(p) => {
                        let line = format!("etcd restarted (pid {})", p.pid());
                        slot.0 = p;
                        self.say(bar, line);
                    }
                    Err(e) => self.say(bar, format!("etcd restart failed: {e:#}")),
                }
            }
        }
        let due: Vec<usize> = self.coordinators_back.iter().filter(|(_, at)| now >= *at).map(|(i, _)| *i).collect();
        self.coordinators_back.retain(|(_, at)| now < *at);
        for i in due {
            if let Some(p) = cluster.coordinators.get_mut(i) {
                match p.restart() {
                    Ok(()) => {
                        let line = format!("{} restarted (pid {})", p.name, p.pid());
                        self.say(bar, line);
                    }
                    Err(e) => self.say(bar, format!("restarting coordinator-{i} failed: {e:#}")),
                }
            }
        }
    }

    /// `pid` stopped until `until`; stopped already, it stays stopped until the later of the two.
    fn pause(&mut self, pid: u32, name: String, until: Instant) {
        match self.paused.iter_mut().find(|(p, _, _)| *p == pid) {
            Some(entry) => entry.2 = entry.2.max(until),
            None => self.paused.push((pid, name, until)),
        }
    }

    /// The processes a fault stopped and has not continued yet.
    pub fn paused_pids(&self) -> Vec<u32> {
        self.paused.iter().map(|(pid, _, _)| *pid).collect()
    }

    /// Resume every stopped process (the run is over), collect the failover times and name the
    /// faults the run ended before.
    pub fn finish(&mut self) {
        for (pid, _, _) in self.paused.drain(..) {
            signal_pid(pid, "CONT");
        }
        let ended = self.started.elapsed().as_secs_f64();
        self.log.not_injected = (self.pending.drain(..).rev())
            .map(|s| format!("{} at {:.1} s was not injected: the run ended at {ended:.1} s", s.fault, s.at_s))
            .collect();
        self.log.failovers_ms = self.failovers.lock().expect("failovers lock").clone();
    }

    async fn inject(&mut self, fault: Fault, cluster: &mut Cluster, finder: &LeaderFinder, bar: &ProgressBar) {
        self.log.faults += 1;
        match fault {
            Fault::RestartEtcd if self.etcd_back_at.is_some() => {
                self.say(bar, format!("{fault}: etcd is down already (restarting); skipped"));
            }
            Fault::KillLeader | Fault::PauseLeader(_) => {
                // Asked in short turns, 5 s in all (a stopped coordinator's status call waits out
                // its own timeout): between turns, the pauses and restarts that fall due end on
                // time (a paused leader answers nobody until its SIGCONT).
                let give_up = Instant::now() + Duration::from_secs(5);
                let turn = Duration::from_millis(500);
                let s = loop {
                    if let Ok(Ok((_, s))) = tokio::time::timeout(turn, finder.leader(turn)).await {
                        break s;
                    }
                    self.end_what_is_over(cluster, bar);
                    if Instant::now() >= give_up {
                        self.say(bar, format!("{fault}: no leader answered; skipped"));
                        return;
                    }
                };
                let Some(i) = cluster.coordinators.iter().position(|p| p.addr.as_deref() == Some(s.leader.as_str()))
                else {
                    return;
                };
                let p = &mut cluster.coordinators[i];
                let pid = p.pid();
                match fault {
                    Fault::KillLeader => {
                        p.kill9();
                        self.forget_pause(pid);
                        self.coordinators_back.push((i, Instant::now() + Duration::from_secs(3)));
                    }
                    Fault::PauseLeader(secs) => {
                        p.signal("STOP");
                        let until = Instant::now() + Duration::from_secs_f64(secs);
                        self.pause(pid, format!("leader {}", s.leader), until);
                    }
                    _ => unreachable!("leader faults only"),
                }
                self.say(bar, format!("{fault}: {} (pid {pid})", s.leader));
                // Failover time: until another coordinator answers as leader (measured aside, so
                // the schedule goes on meanwhile: etcd may be down and due back).
                let (hit, finder, failovers, bar) =
                    (Instant::now(), finder.clone(), self.failovers.clone(), bar.clone());
                tokio::spawn(async move {
                    while hit.elapsed() < Duration::from_secs(60) {
                        if let Ok((_, s2)) = finder.leader(Duration::from_millis(200)).await {
                            if s2.leader != s.leader {
                                let ms = hit.elapsed().as_millis();
                                failovers.lock().expect("failovers lock").push(ms);
                                bar.suspend(|| say!("chaos: failover: new leader {} after {ms} ms", s2.leader));
                                return;
                            }
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                });
            }
            Fault::KillWorker(i) | Fault::PauseWorker(i, _) | Fault::RestartWorker(i) => {
                let Some(p) = cluster.workers.get_mut(i) else { return };
                let pid = p.pid();
                if !matches!(fault, Fault::RestartWorker(_)) && p.exit_status().is_some() {
                    // Killed for good by an earlier fault: nothing to kill or stop.
                    self.say(bar, format!("{fault}: worker-{i} is down already; skipped"));
                    return;
                }
                if !matches!(fault, Fault::PauseWorker(..)) {
                    // A stopped process killed or replaced: its pause ends with it, and its pid
                    // must not get the SIGCONT (the system may give the number to another).
                    self.forget_pause(pid);
                }
                match fault {
                    Fault::KillWorker(_) => p.kill9(),
                    Fault::PauseWorker(_, secs) => {
                        p.signal("STOP");
                        let name = p.name.clone();
                        self.pause(pid, name, Instant::now() + Duration::from_secs_f64(secs));
                    }
                    _ => {
                        if let Err(e) = p.restart() {
                            self.say(bar, format!("{fault}: failed: {e:#}"));
                            return;
                        }
                    }
                }
                self.say(bar, format!("{fault} (pid {pid})"));
            }
            Fault::RestartEtcd => {
                if let Some((p, _)) = cluster.etcd.as_mut() {
                    let pid = p.pid();
                    p.kill9();
                    self.etcd_back_at = Some(Instant::now() + Duration::from_secs(2));
                    self.say(bar, format!("{fault} (pid {pid})"));
                }
            }
        }
    }
}

/// The outcome of a `--chaos` run, as printed and written to `chaos.json`.
#[derive(Debug, serde::Serialize)]
pub struct ChaosReport {
    /// The schedule's seed.
    pub seed: u64,
    /// Faults injected (single ones asked for included).
    pub faults: usize,
    /// What happened, with when (faults, restarts, SIGCONTs).
    pub events: Vec<String>,
    /// Requests the clients submitted.
    pub submitted: u64,
    /// Requests whose client got exactly one final record, the one etcd stores.
    pub completed_once: u64,
    /// Requests with more than one final record at their client, or whose stored result is not
    /// the one the client got (a second execution overwrote it).
    pub executed_twice: u64,
    /// Requests that never completed (named in `failed.txt`).
    pub lost: u64,
    /// Requests etcd holds no result for although their client got one.
    pub unstored: u64,
    /// Live migrations that committed / did not.
    pub migrations_committed: u64,
    /// Live migrations aborted or refused.
    pub migrations_aborted: u64,
    /// Leader failover times, ms.
    pub failovers_ms: Vec<u128>,
}

impl ChaosReport {
    /// Whether the cluster kept its promise: every request exactly once, none lost.
    pub fn survived(&self) -> bool {
        self.executed_twice == 0 && self.lost == 0 && self.unstored == 0 && self.completed_once == self.submitted
    }

    /// The table `kvfleet up --chaos` prints.
    pub fn table(&self) -> String {
        let failovers = if self.failovers_ms.is_empty() {
            "none".to_string()
        } else {
            self.failovers_ms.iter().map(|ms| format!("{:.1} s", *ms as f64 / 1e3)).collect::<Vec<_>>().join(", ")
        };
        format!(
            "chaos (seed {}, {} faults): {}\n  submitted                {}\n  completed exactly once   {}\n  executed more than once  {}\n  lost or hung             {}\n  results missing in etcd  {}\n  migrations               {} committed, {} aborted\n  leader failovers         {}\n",
            self.seed,
            self.faults,
            if self.survived() { "survived" } else { "FAILED" },
            self.submitted,
            self.completed_once,
            self.executed_twice,
            self.lost,
            self.unstored,
            self.migrations_committed,
            self.migrations_aborted,
            failovers
        )
    }
}

/// Counts what a chaos run's clients and etcd say.
pub fn report(
    seed: u64,
    log: &ChaosLog,
    submitted: u64,
    ok: &[kvfleet_core::metrics::RequestRecord],
    failed: &[String],
    audit: Option<&super::audit::Audit>,
    migrations: &[kvfleet_core::metrics::MigrationRecord],
) -> ChaosReport {
    let mut ids: Vec<u64> = ok.iter().map(|r| r.id.0).collect();
    ids.sort_unstable();
    let records = ids.len() as u64;
    ids.dedup();
    let unique = ids.len() as u64;
    let differ = audit.map_or(0, |a| a.differ.len() as u64);
    let unstored = audit.map_or(0, |a| a.missing.len() as u64);
    let committed = migrations.iter().filter(|m| m.committed()).count() as u64;
    ChaosReport {
        seed,
        faults: log.faults,
        events: log.injected.clone(),
        submitted,
        completed_once: unique.saturating_sub(differ + unstored),
        executed_twice: (records - unique) + differ,
        lost: failed.len() as u64,
        unstored,
        migrations_committed: committed,
        migrations_aborted: migrations.len() as u64 - committed,
        failovers_ms: log.failovers_ms.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_the_run_ended_before_are_named() {
        let at = |at_s, fault| Scheduled { at_s, fault };
        let mut chaos = Chaos::new(vec![at(900.0, Fault::KillLeader), at(800.0, Fault::PauseWorker(0, 5.0))]);
        chaos.finish();
        let lines = &chaos.log.not_injected;
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].starts_with("SIGSTOP worker-0 for 5.0 s at 800.0 s was not injected"), "{lines:?}");
        assert!(lines[1].starts_with("kill -9 the leader"), "{lines:?}");
        assert_eq!(chaos.log.faults, 0);
    }

    /// What falls due while faults are injected is done between them; a fault on a process an
    /// earlier one killed is skipped, and a second pause of a stopped process extends the first.
    #[tokio::test]
    async fn pauses_end_between_injections_and_faults_on_a_killed_worker_are_skipped() {
        let dir = std::env::temp_dir().join(format!("kvfleet-chaos-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let workers = (0..2).map(|i| super::super::procs::sleeper(&format!("worker-{i}"), &dir)).collect();
        let mut c = Cluster { workers, ..Cluster::default() };
        let (w0, w1) = (c.workers[0].pid(), c.workers[1].pid());
        // Negative times: all due at the first step, in this order.
        let at = |at_s, fault| Scheduled { at_s, fault };
        let mut chaos = Chaos::new(vec![
            at(-6.0, Fault::PauseWorker(0, 0.0)),
            at(-5.0, Fault::KillWorker(1)),
            at(-4.0, Fault::KillWorker(1)),
            at(-3.0, Fault::PauseWorker(1, 5.0)),
            at(-2.0, Fault::PauseWorker(0, 30.0)),
            at(-1.0, Fault::PauseWorker(0, 1.0)),
        ]);
        let finder = LeaderFinder::new(Vec::new(), None);
        chaos.step(&mut c, &finder, &ProgressBar::hidden()).await;
        let lines: Vec<&str> = chaos.log.injected.iter().map(|l| l.split_once(": ").expect("timed").1).collect();
        assert_eq!(
            lines,
            [
                format!("SIGSTOP worker-0 for 0.0 s (pid {w0})"),
                format!("SIGCONT worker-0 (pid {w0})"),
                format!("kill -9 worker-1 (pid {w1})"),
                "kill -9 worker-1: worker-1 is down already; skipped".to_string(),
                "SIGSTOP worker-1 for 5.0 s: worker-1 is down already; skipped".to_string(),
                format!("SIGSTOP worker-0 for 30.0 s (pid {w0})"),
                format!("SIGSTOP worker-0 for 1.0 s (pid {w0})"),
            ]
        );
        assert_eq!(chaos.paused_pids(), [w0], "one pause, extended to the later end");
        std::thread::sleep(Duration::from_millis(1100));
        chaos.step(&mut c, &finder, &ProgressBar::hidden()).await;
        assert_eq!(chaos.paused_pids(), [w0], "still stopped: the 30 s pause is not over");
        // Killed while stopped: no SIGCONT is due for its pid any more.
        chaos.inject(Fault::KillWorker(0), &mut c, &finder, &ProgressBar::hidden()).await;
        assert!(chaos.paused_pids().is_empty(), "the pause ended with the process");
        chaos.finish();
        let conts = chaos.log.injected.iter().filter(|l| l.contains("SIGCONT worker-0")).count();
        assert_eq!(conts, 1, "only the first pause's SIGCONT: {:?}", chaos.log.injected);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_seed_gives_one_schedule_in_time_order() {
        let a = random_schedule(7, 8, 60.0, 4, true);
        assert_eq!(a, random_schedule(7, 8, 60.0, 4, true), "deterministic in the seed");
        assert_ne!(a, random_schedule(8, 8, 60.0, 4, true));
        assert_eq!(a.len(), 8);
        assert!(a.windows(2).all(|w| w[0].at_s <= w[1].at_s));
        assert!(a.iter().all(|s| (2.0..60.0).contains(&s.at_s)));
        for s in random_schedule(3, 50, 60.0, 4, true) {
            assert_ne!(s.fault, Fault::KillWorker(0), "worker 0 stays");
        }
        let without = random_schedule(3, 50, 60.0, 2, false);
        assert!(without
            .iter()
            .all(|s| !matches!(s.fault, Fault::KillLeader | Fault::RestartEtcd | Fault::KillWorker(_))));
    }
}
