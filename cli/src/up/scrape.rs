//! Prometheus snapshots of the workers and coordinators at the end of a run
//! (`OUT/metrics/worker-N.prom`, `coordinator-N.prom`), so a
//! run's results can be checked against what each process counted itself (e.g. the trace
//! analysis's migration downtimes against `kvfleet_migration_downtime_seconds`).

use anyhow::{bail, Context};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

/// `GET http://addr/metrics`: the body of a 200 answer.
pub fn scrape(addr: &str) -> anyhow::Result<String> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).with_context(|| format!("reading {addr}/metrics"))?;
    let text = String::from_utf8(raw).context("the metrics page is not UTF-8")?;
    let (head, body) = text.split_once("\r\n\r\n").context("no HTTP header end in the answer")?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1).is_none_or(|c| c != "200") {
        bail!("{addr}/metrics answered {status:?}");
    }
    Ok(body.to_string())
}

/// Save every reachable process's page as `dir/NAME.prom` (`worker-0`, `coordinator-1`); the
/// number saved.
pub fn save_all(dir: &Path, pages: &[(String, String)]) -> anyhow::Result<usize> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut saved = 0;
    for (name, addr) in pages {
        match scrape(addr) {
            Ok(body) => {
                std::fs::write(dir.join(format!("{name}.prom")), body)?;
                saved += 1;
            }
            // A process killed by fault injection has nothing to say.
            Err(e) => eprintln!("metrics of {name} not saved: {e:#}"),
        }
    }
    Ok(saved)
}
