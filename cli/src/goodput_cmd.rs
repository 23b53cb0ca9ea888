//! `kvfleet sim` with `[sweep.goodput]`: each setup's goodput (the highest arrival rate whose SLO
//! attainment meets the target, found by `kvfleet_sim::goodput::search`) and its ratio to the
//! baseline's, printed as a table and written as `goodput.json` and `goodput.csv`.

use crate::{load_config, say, InputError, Overrides, SimArgs};
use anyhow::Context as _;
use kvfleet_sim::config::SimConfig;
use kvfleet_sim::goodput::{search, Goodput, GoodputConfig};
use std::path::Path;

/// One setup's search.
#[derive(serde::Serialize)]
struct SetupGoodput {
    setup: String,
    sets: Vec<String>,
    /// The workload's own mean arrival rate (scale 1), req/s.
    base_rate_rps: f64,
    /// Goodput, req/s (`None`: below the lowest rate searched).
    goodput_rps: Option<f64>,
    /// Goodput ÷ the baseline's.
    ratio_to_baseline: Option<f64>,
    #[serde(flatten)]
    search: Goodput,
}

/// The mean arrival rate of `cfg`'s workload as generated, req/s.
fn base_rate(cfg: &SimConfig, base_dir: &Path) -> anyhow::Result<f64> {
    let requests =
        kvfleet_core::workload::generate(&cfg.workload, base_dir).map_err(|e| InputError(format!("workload: {e}")))?;
    let (Some(first), Some(last)) = (requests.first(), requests.last()) else {
        return Err(InputError("workload: no requests".into()).into());
    };
    let span = last.arrival.saturating_since(first.arrival).as_secs_f64();
    if requests.len() < 2 || span <= 0.0 {
        return Err(InputError("`[sweep.goodput]` needs a workload whose arrivals span some time".into()).into());
    }
    Ok((requests.len() - 1) as f64 / span)
}

/// Run every setup's search (`g` from the loaded config) and report.
pub fn run(args: &SimArgs, g: &GoodputConfig, policies: &[String], base_dir: &Path) -> anyhow::Result<()> {
    let setups = g.setup_list(policies);
    let mut found: Vec<SetupGoodput> = Vec::new();
    for (name, sets) in &setups {
        let mut all_sets = args.sets.clone();
        all_sets.extend(sets.iter().cloned());
        let overrides = Overrides {
            policies: &[],
            rates: &[],
            seed: args.seed,
            seeds: None,
            requests: args.requests,
            sets: &all_sets,
        };
        let mut cfg = load_config(&args.config, &overrides).with_context(|| format!("setup `{name}`"))?;
        cfg.sweep = None;
        let rate = base_rate(&cfg, base_dir)?;
        let policy = cfg.scheduler.policy.clone();
        let scale0 = cfg.workload.rate_scale;
        let search = search(g, |scale| -> anyhow::Result<f64> {
            let mut c = cfg.clone();
            c.workload.rate_scale = scale0 * scale;
            let r = kvfleet_sim::run_one(&c, &policy, None, base_dir, |_| {})?;
            let a = r.summary.slo_attainment.context("no SLO attainment (set [slo] ttft_s)")?;
            if !args.quiet {
                say!("  {name:<14} {:>9.2} req/s  attainment {:>5.1} %", rate * scale, 100.0 * a);
            }
            Ok(a)
        })?;
        let goodput_rps = search.scale.map(|s| s * rate);
        found.push(SetupGoodput {
            setup: name.clone(),
            sets: sets.clone(),
            base_rate_rps: rate,
            goodput_rps,
            ratio_to_baseline: None,
            search,
        });
    }
    let baseline = g.baseline.clone().unwrap_or_else(|| setups[0].0.clone());
    let base = found.iter().find(|f| f.setup == baseline).and_then(|f| f.goodput_rps);
    for f in &mut found {
        f.ratio_to_baseline = match (f.goodput_rps, base) {
            (Some(x), Some(b)) if b > 0.0 => Some(x / b),
            _ => None,
        };
    }
    say!("goodput: the highest rate with SLO attainment ≥ {} % (within {} %)", percent(g.target), percent(g.rel_tol));
    say!("{:<16} {:>14} {:>8} {:>14}", "setup", "goodput req/s", "runs", format!("÷ {baseline}"));
    for f in &found {
        let gp = match (f.goodput_rps, f.search.at_least) {
            (Some(x), true) => format!("≥ {x:.2}"),
            (Some(x), false) => format!("{x:.2}"),
            (None, _) => format!("< {:.2}", f.base_rate_rps * 2f64.powi(-(g.octaves as i32))),
        };
        let ratio = f.ratio_to_baseline.map_or("-".to_string(), |r| format!("{r:.2}x"));
        say!("{:<16} {:>14} {:>8} {:>14}", f.setup, gp, f.search.probes.len(), ratio);
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let json = args.out.join("goodput.json");
    std::fs::write(&json, serde_json::to_string_pretty(&found)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let mut csv = String::from("setup,rate_rps,scale,attainment\n");
    for f in &found {
        for p in &f.search.probes {
            csv.push_str(&format!("{},{},{},{}\n", f.setup, p.scale * f.base_rate_rps, p.scale, p.attainment));
        }
    }
    let csv_path = args.out.join("goodput.csv");
    std::fs::write(&csv_path, csv).with_context(|| format!("writing {}", csv_path.display()))?;
    say!("wrote goodput.json and goodput.csv to {}", args.out.display());
    Ok(())
}

/// `x` as a percentage, to 0.01 without trailing zeros (0.9 → `90`, 0.005 → `0.5`).
fn percent(x: f64) -> String {
    let s = format!("{:.2}", 100.0 * x);
    let t = s.trim_end_matches('0').trim_end_matches('.');
    if t.is_empty() {
        "0".into()
    } else {
        t.into()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn percentages_print_without_trailing_zeros() {
        let seen: Vec<String> = [0.9, 0.02, 0.005, 0.07, 1.0, 0.0].into_iter().map(super::percent).collect();
        assert_eq!(seen, ["90", "2", "0.5", "7", "100", "0"]);
    }
}
