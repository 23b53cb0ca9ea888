//! `kvfleet status`: one screen on a running cluster, from the leader's `Status`: the leader and
//! its store, every instance (liveness, KV use, the requests it holds by phase, its SLO state),
//! request counters and the live migrations so far. `--watch SECS` redraws until interrupted.

use crate::say;
use crate::up::replay::LeaderFinder;
use clap::Args;
use kvfleet_core::metrics::Distribution;
use kvfleet_pki::TlsArgs;
use kvfleet_proto::v1;
use std::fmt::Write as _;
use std::time::Duration;

#[derive(Args)]
pub struct StatusArgs {
    /// Coordinator addresses (any of them; the leader is found through them).
    #[arg(long, value_delimiter = ',', required = true)]
    coordinator: Vec<String>,
    /// Redraw every this many seconds until interrupted.
    #[arg(long)]
    watch: Option<f64>,
    #[command(flatten)]
    tls: TlsArgs,
}

pub fn run(a: StatusArgs) -> anyhow::Result<()> {
    let tls = a.tls.load()?;
    let finder = LeaderFinder::new(a.coordinator.clone(), tls);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    loop {
        let (_, status) = rt.block_on(finder.leader(Duration::from_secs(5))).map_err(|e| {
            crate::InputError(format!("no leader among {:?} within 5 s: {}", a.coordinator, e.message()))
        })?;
        let screen = render(&status);
        match a.watch {
            Some(secs) => {
                // Clear the terminal and draw from the top.
                say!("\x1b[2J\x1b[H{screen}");
                std::thread::sleep(Duration::from_secs_f64(secs.max(0.1)));
            }
            None => {
                say!("{screen}");
                return Ok(());
            }
        }
    }
}

/// The screen for one status snapshot.
pub fn render(s: &v1::ClusterStatus) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "leader {}   store {}   epoch {} ns", s.leader, s.store, s.epoch_unix_ns);
    let _ = writeln!(
        out,
        "requests: {} in flight, {} finished ({} late copies refused, {} stale copies dropped), {} cancelled   migrations: {} committed, {} did not commit   workers expelled: {}",
        s.requests_in_flight,
        s.requests_finished,
        s.late_results,
        s.stale_copies_dropped,
        s.cancelled,
        s.migrations,
        s.migrations_failed,
        s.workers_expelled
    );
    let _ = writeln!(
        out,
        "\n{:>8} {:<22} {:>5} {:>8} {:>14} {:>6} {:>9} {:>9} {:>7} {:>6}",
        "instance", "address", "alive", "role", "GPU blocks", "CPU", "reasoning", "answering", "waiting", "SLO"
    );
    for i in &s.instances {
        let (id, addr) = i.info.as_ref().map_or((0, ""), |w| (w.instance, w.advertise.as_str()));
        let l = i.load.unwrap_or_default();
        let _ = writeln!(
            out,
            "{:>8} {:<22} {:>5} {:>8} {:>14} {:>6} {:>9} {:>9} {:>7} {:>6}",
            id,
            addr,
            if i.alive { "yes" } else { "NO" },
            if i.role.is_empty() { "mixed" } else { i.role.as_str() },
            format!("{}/{}", l.gpu_used_blocks, l.gpu_total_blocks),
            l.cpu_used_blocks,
            l.reasoning_requests,
            l.answering_requests,
            l.waiting_requests,
            if l.answering_slo_ok { "ok" } else { "LATE" }
        );
    }
    if s.handoffs + s.handoffs_released > 0 || !s.role_changes.is_empty() {
        let _ = writeln!(
            out,
            "\nprefill/decode: {} handoffs to a decoder, {} decoded where prefilled, {} role flips",
            s.handoffs,
            s.handoffs_released,
            s.role_changes.len()
        );
        for c in s.role_changes.iter().rev().take(5) {
            let _ = writeln!(out, "  instance {:>3} -> {:<8} at {:.3} s", c.instance, c.role, c.at_ns as f64 / 1e9);
        }
    }
    let ok: Vec<&v1::MigrationStats> = s.migration_log.iter().filter(|m| m.committed()).collect();
    if !s.migration_log.is_empty() {
        let down = Distribution::new(ok.iter().map(|m| m.downtime_ns as f64 / 1e6).collect());
        let _ = writeln!(
            out,
            "\nlive migrations: {} committed, {} aborted; downtime ms p50 {} p99 {}",
            ok.len(),
            s.migration_log.len() - ok.len(),
            down.percentile(0.5).map_or("-".into(), |v| format!("{v:.1}")),
            down.percentile(0.99).map_or("-".into(), |v| format!("{v:.1}")),
        );
        for m in s.migration_log.iter().rev().take(5) {
            let _ = writeln!(
                out,
                "  request {:>6} {}→{}  {:>6} tokens  {} stages  {:>8.1} ms total  {:>6.1} ms down  {}",
                m.request_id,
                m.source,
                m.target,
                m.kv_tokens,
                m.stages,
                m.total_ns() as f64 / 1e6,
                m.downtime_ns as f64 / 1e6,
                if m.committed() { "committed".to_string() } else { format!("aborted: {}", m.abort_reason) }
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_screen_shows_roles_handoffs_and_flips() {
        let instance = |i, role: &str| v1::InstanceStatus {
            info: Some(v1::WorkerInfo { instance: i, ..Default::default() }),
            alive: true,
            role: role.into(),
            ..Default::default()
        };
        let s = v1::ClusterStatus {
            instances: vec![instance(0, "prefill"), instance(1, "")],
            role_changes: vec![v1::RoleChange { at_ns: 2_500_000_000, instance: 1, role: "prefill".into() }],
            handoffs: 7,
            ..Default::default()
        };
        let screen = render(&s);
        let row = |i: u32| screen.lines().find(|l| l.trim_start().starts_with(&format!("{i} "))).unwrap().to_string();
        assert!(row(0).contains("prefill"), "{screen}");
        assert!(row(1).contains("mixed"), "{screen}");
        assert!(screen.contains("7 handoffs to a decoder, 0 decoded where prefilled, 1 role flips"), "{screen}");
        assert!(screen.contains("instance   1 -> prefill  at 2.500 s"), "{screen}");
    }
}
