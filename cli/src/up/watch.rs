//! The cluster's processes watched while a run goes on: one that exits, or is stopped (SIGSTOP),
//! without `kvfleet up` having done it is named at once (which process, when, how it ended, its
//! log), and again where the run ends, so that the requests it failed are explained by their
//! cause rather than by the retries they ran out of ("no leader elected yet").

use super::cluster::Cluster;
use std::collections::HashSet;
use std::time::Instant;

/// What was seen of the processes not faulted on purpose.
pub struct Watch {
    /// When the replay (or `kvfleet serve`'s service) started (`None`: the cluster is starting).
    started: Option<Instant>,
    /// Pids whose exit was said.
    exited: HashSet<u32>,
    /// Pids said to be stopped, and not said to run again since.
    stopped: HashSet<u32>,
    /// Every line said, in order (the run's end repeats them).
    pub seen: Vec<String>,
}

impl Watch {
    /// Watching a cluster that is starting.
    pub fn new() -> Watch {
        Watch { started: None, exited: HashSet::new(), stopped: HashSet::new(), seen: Vec::new() }
    }

    /// The replay starts now: what happens from here is timed from it.
    pub fn replay_starts(&mut self) {
        self.started = Some(Instant::now());
    }

    /// The lines for what changed since the last look: a process that exited on its own, one
    /// stopped although not among `paused_on_purpose` (pids a fault stopped), one that resumed
    /// after that. Each said once.
    pub fn check(&mut self, cluster: &mut Cluster, paused_on_purpose: &[u32]) -> Vec<String> {
        let at = match self.started {
            Some(t) => format!("at {:.1} s", t.elapsed().as_secs_f64()),
            None => "while the cluster started".to_string(),
        };
        let mut lines = Vec::new();
        for p in cluster.processes_mut() {
            let pid = p.pid();
            if let Some(status) = p.ended_unasked() {
                if self.exited.insert(pid) {
                    lines.push(format!("{} (pid {pid}) exited {at} ({status}); see {}", p.name, p.log().display()));
                }
                continue;
            }
            if paused_on_purpose.contains(&pid) {
                continue;
            }
            let stopped = run_state(pid) == Some('T');
            if stopped && self.stopped.insert(pid) {
                lines.push(format!(
                    "{} (pid {pid}) is stopped (SIGSTOP or a debugger) {at}: it answers nobody until it is continued",
                    p.name
                ));
            } else if !stopped && self.stopped.remove(&pid) {
                lines.push(format!("{} (pid {pid}) runs again {at}", p.name));
            }
        }
        self.seen.extend(lines.iter().cloned());
        lines
    }

    /// One line for an error: what went wrong with the cluster's processes, if anything did.
    pub fn cause(&self) -> Option<String> {
        (!self.seen.is_empty()).then(|| self.seen.join("; "))
    }
}

/// The state letter of `/proc/PID/stat` (`R`, `S`, `T` stopped, `Z` zombie, …); `None` where it
/// cannot be read (gone, or not Linux).
fn run_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "PID (COMM) S …": COMM may hold spaces and parentheses, so the state follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

#[cfg(test)]
mod tests {
    use super::super::procs::sleeper;
    use super::*;
    use std::time::Duration;

    /// Polls `check` until it says something (the kernel changes a signalled process's state
    /// asynchronously), at most 5 s.
    fn next_lines(w: &mut Watch, c: &mut Cluster, paused: &[u32]) -> Vec<String> {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let lines = w.check(c, paused);
            if !lines.is_empty() || Instant::now() > until {
                return lines;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_process_that_dies_or_stops_on_its_own_is_named_once_and_faults_are_not() {
        let dir = std::env::temp_dir().join(format!("kvfleet-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut c =
            Cluster { workers: (0..4).map(|i| sleeper(&format!("worker-{i}"), &dir)).collect(), ..Cluster::default() };
        let mut w = Watch::new();
        assert!(w.check(&mut c, &[]).is_empty(), "all run");
        w.replay_starts();

        // Killed from outside: named, with its status and its log, once.
        let outside = c.workers[0].pid();
        super::super::procs::signal_pid(outside, "KILL");
        let lines = next_lines(&mut w, &mut c, &[]);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].starts_with(&format!("worker-0 (pid {outside}) exited at ")), "{lines:?}");
        assert!(lines[0].contains("signal: 9") && lines[0].contains("worker-0.log"), "{lines:?}");
        assert!(w.check(&mut c, &[]).is_empty(), "said once");

        // Killed as a fault: not a surprise.
        c.workers[1].kill9();
        assert!(w.check(&mut c, &[]).is_empty(), "a fault's kill is not named");

        // Stopped from outside: named; stopped as a fault: not.
        let stopped = c.workers[2].pid();
        c.workers[2].signal("STOP");
        c.workers[3].signal("STOP");
        let paused_on_purpose = [c.workers[3].pid()];
        let lines = next_lines(&mut w, &mut c, &paused_on_purpose);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].starts_with(&format!("worker-2 (pid {stopped}) is stopped")), "{lines:?}");
        assert!(w.check(&mut c, &paused_on_purpose).is_empty(), "said once");

        c.workers[2].signal("CONT");
        let lines = next_lines(&mut w, &mut c, &paused_on_purpose);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].starts_with(&format!("worker-2 (pid {stopped}) runs again at ")), "{lines:?}");
        assert!(w.check(&mut c, &paused_on_purpose).is_empty(), "said once");
        assert_eq!(w.seen.len(), 3);
        let cause = w.cause().expect("something happened");
        assert!(cause.contains("worker-0") && cause.contains("worker-2") && !cause.contains("worker-1"), "{cause}");
        c.workers[3].signal("CONT");
        for p in &mut c.workers {
            p.kill9();
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn run_state_reads_the_letter_after_the_command_name() {
        assert!(matches!(run_state(std::process::id()), Some('R' | 'S')));
        assert_eq!(run_state(u32::MAX), None);
    }
}
