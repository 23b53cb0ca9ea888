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

/// The value of the sample of `metric` whose labels include `label` (e.g. `quantile="0.5"`).
pub fn sample(body: &str, metric: &str, label: &str) -> Option<f64> {
    body.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let rest = l.strip_prefix(metric)?.strip_prefix('{')?;
        let (labels, value) = rest.split_once('}')?;
        labels.split(',').any(|x| x == label).then(|| value.trim().parse().ok()).flatten()
    })
}

/// Save every reachable process's page as `dir/NAME.prom` (`worker-0`, `coordinator-1`); the
/// pages saved, by name.
pub fn save_all(dir: &Path, pages: &[(String, String)]) -> anyhow::Result<Vec<(String, String)>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut saved = Vec::new();
    for (name, addr) in pages {
        match scrape(addr) {
            Ok(body) => {
                std::fs::write(dir.join(format!("{name}.prom")), &body)?;
                saved.push((name.clone(), body));
            }
            // A process killed by fault injection has nothing to say.
            Err(e) => eprintln!("metrics of {name} not saved: {e:#}"),
        }
    }
    Ok(saved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_labelled_sample_is_read_and_others_are_not() {
        let body = "# TYPE x summary\nx{model_name=\"m\",quantile=\"0.5\"} 5.5\nx{model_name=\"m\",quantile=\"0.99\"} 10\nx_sum{model_name=\"m\"} 3\n";
        assert_eq!(sample(body, "x", "quantile=\"0.5\""), Some(5.5));
        assert_eq!(sample(body, "x", "quantile=\"0.99\""), Some(10.0));
        assert_eq!(sample(body, "x", "quantile=\"0.9\""), None);
        assert_eq!(sample(body, "y", "quantile=\"0.5\""), None);
    }
}
