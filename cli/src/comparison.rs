//! `comparison.txt` / `comparison.json` / `comparison.csv`: a sweep's policies side by side, per
//! rate, over its seeds — the figures PASCAL §V reports, scored its way.
//!
//! - Tail TTFT: the subject policy (`pascal` when the sweep has it) against every other policy,
//!   per reasoning-length bin ([`compare_tails`]): the largest reduction with both tails in
//!   seconds, the worst increase over all bins and over the trusted bins (below the demotion
//!   threshold, ≥ 10 samples), the demoted bins apart, the mean per-bin change.
//! - Per policy: SLO violation, blocking P99, E2E P50 / P99 (also as a change against the
//!   subject), output throughput, P99 KV transfer, migrations.
//!
//! Each figure is `mean [min … max]` over the seeds (one value with one seed).

use crate::plots::same_rate;
use crate::report::rate_label;
use kvfleet_core::metrics::{compare_tails, SeedRange, TailComparison};
use kvfleet_sim::RunResult;
use serde::Serialize;
use std::fmt::Write as _;

/// The subject's tail TTFT against one baseline at one rate, over the seeds.
#[derive(Debug, Serialize)]
pub struct TailRow {
    /// Arrival rate (None: the workload's own arrivals).
    pub rate: Option<f64>,
    /// The baseline policy.
    pub baseline: String,
    /// Seeds with a comparison (both runs share a bin).
    pub seeds: usize,
    /// Largest per-bin reduction (`policy / baseline − 1`, negative is better).
    pub max_reduction: Option<SeedRange>,
    /// The subject's tail in that bin, seconds.
    pub max_reduction_policy_s: Option<SeedRange>,
    /// The baseline's tail in that bin, seconds.
    pub max_reduction_baseline_s: Option<SeedRange>,
    /// Worst per-bin change over all shared bins.
    pub worst_increase: Option<SeedRange>,
    /// Worst per-bin change over trusted bins (below demotion, ≥ 10 samples in both).
    pub worst_trusted_increase: Option<SeedRange>,
    /// Worst per-bin change over the demoted bins.
    pub worst_demoted_increase: Option<SeedRange>,
    /// Mean per-bin change.
    pub mean_change: Option<SeedRange>,
    /// Change of the sum of tails.
    pub sum_of_tails_change: Option<SeedRange>,
}

/// One policy at one rate, over the seeds.
#[derive(Debug, Serialize)]
pub struct PolicyRow {
    /// Arrival rate.
    pub rate: Option<f64>,
    /// The policy.
    pub policy: String,
    /// Seeds run.
    pub seeds: usize,
    /// SLO violation, % of finished requests.
    pub slo_violation_pct: Option<SeedRange>,
    /// Blocking latency P99, seconds.
    pub blocking_p99_s: Option<SeedRange>,
    /// E2E P50, seconds.
    pub e2e_p50_s: Option<SeedRange>,
    /// E2E P99, seconds.
    pub e2e_p99_s: Option<SeedRange>,
    /// E2E P50 against the subject's in the same seed (`this / subject − 1`).
    pub e2e_p50_vs_subject: Option<SeedRange>,
    /// E2E P99 against the subject's in the same seed.
    pub e2e_p99_vs_subject: Option<SeedRange>,
    /// Output tokens per second of makespan.
    pub throughput_tok_s: Option<SeedRange>,
    /// Output throughput against the subject's in the same seed.
    pub throughput_vs_subject: Option<SeedRange>,
    /// P99 KV transfer time of migrations, seconds.
    pub transfer_p99_s: Option<SeedRange>,
    /// Migrations.
    pub migrations: Option<SeedRange>,
}

/// A sweep's comparison.
#[derive(Debug, Serialize)]
pub struct Comparison {
    /// The policy the others are compared with.
    pub subject: String,
    /// Bins starting at or above this reasoning length are demoted ones.
    pub demotion_tokens: u32,
    /// Distinct seeds in the sweep.
    pub seeds: usize,
    /// Tail TTFT rows, by rate then baseline.
    pub tail: Vec<TailRow>,
    /// Policy rows, by rate then policy.
    pub policies: Vec<PolicyRow>,
}

/// Values in first-seen order, without repeats.
fn distinct<T: PartialEq + Clone>(items: impl Iterator<Item = T>) -> Vec<T> {
    let mut out: Vec<T> = Vec::new();
    for x in items {
        if !out.contains(&x) {
            out.push(x);
        }
    }
    out
}

/// The comparison of `runs` (a sweep's results); `None` when the sweep has a single policy.
pub fn compare(runs: &[RunResult], demotion_tokens: u32) -> Option<Comparison> {
    let policies = distinct(runs.iter().map(|r| r.policy.clone()));
    if policies.len() < 2 {
        return None;
    }
    let subject = policies.iter().find(|p| *p == "pascal").unwrap_or(&policies[0]).clone();
    let rates = distinct(runs.iter().map(|r| r.rate.map(f64::to_bits))).into_iter().map(|r| r.map(f64::from_bits));
    let seeds = distinct(runs.iter().map(|r| r.seed));
    let find = |policy: &str, rate: Option<f64>, seed: u64| {
        runs.iter().find(|r| r.policy == policy && same_rate(r.rate, rate) && r.seed == seed)
    };
    let mut tail = Vec::new();
    let mut rows = Vec::new();
    for rate in rates {
        // (subject, other) run pairs of one seed each.
        let pairs = |other: &str| -> Vec<(&RunResult, &RunResult)> {
            seeds.iter().filter_map(|&s| Some((find(&subject, rate, s)?, find(other, rate, s)?))).collect()
        };
        for baseline in policies.iter().filter(|p| **p != subject) {
            let c: Vec<TailComparison> = pairs(baseline)
                .iter()
                .filter_map(|(a, b)| compare_tails(&a.tail_ttft, &b.tail_ttft, demotion_tokens))
                .collect();
            let over = |f: &dyn Fn(&TailComparison) -> Option<f64>| SeedRange::of(c.iter().filter_map(f));
            tail.push(TailRow {
                rate,
                baseline: baseline.clone(),
                seeds: c.len(),
                max_reduction: over(&|c| Some(c.max_reduction.change)),
                max_reduction_policy_s: over(&|c| Some(c.max_reduction.policy_s)),
                max_reduction_baseline_s: over(&|c| Some(c.max_reduction.baseline_s)),
                worst_increase: over(&|c| Some(c.worst_increase.change)),
                worst_trusted_increase: over(&|c| c.worst_trusted_increase.map(|b| b.change)),
                worst_demoted_increase: over(&|c| c.worst_demoted_increase.map(|b| b.change)),
                mean_change: over(&|c| Some(c.mean_change)),
                sum_of_tails_change: over(&|c| Some(c.sum_of_tails_change)),
            });
        }
        for policy in &policies {
            let own: Vec<&RunResult> = seeds.iter().filter_map(|&s| find(policy, rate, s)).collect();
            if own.is_empty() {
                continue;
            }
            let over = |f: &dyn Fn(&RunResult) -> Option<f64>| SeedRange::of(own.iter().filter_map(|r| f(r)));
            let pairs = pairs(policy);
            let versus = |f: &dyn Fn(&RunResult) -> Option<f64>| {
                SeedRange::of(pairs.iter().filter_map(|(s, o)| Some(f(o)? / f(s)? - 1.0)))
            };
            rows.push(PolicyRow {
                rate,
                policy: policy.clone(),
                seeds: own.len(),
                slo_violation_pct: over(&|r| r.summary.slo_violation_rate.map(|v| 100.0 * v)),
                blocking_p99_s: over(&|r| r.summary.blocking_latency_p99_s),
                e2e_p50_s: over(&|r| r.summary.e2e_p50_s),
                e2e_p99_s: over(&|r| r.summary.e2e_p99_s),
                e2e_p50_vs_subject: versus(&|r| r.summary.e2e_p50_s),
                e2e_p99_vs_subject: versus(&|r| r.summary.e2e_p99_s),
                throughput_tok_s: over(&|r| r.summary.throughput_output_tokens_per_s),
                throughput_vs_subject: versus(&|r| r.summary.throughput_output_tokens_per_s),
                transfer_p99_s: over(&|r| r.summary.migration_transfer_p99_s),
                migrations: over(&|r| Some(r.summary.migrations_total as f64)),
            });
        }
    }
    Some(Comparison { subject, demotion_tokens, seeds: seeds.len(), tail, policies: rows })
}

fn pct(r: &Option<SeedRange>) -> String {
    r.map_or("-".into(), |r| r.show(|x| format!("{:+.1}%", 100.0 * x)))
}

fn num(r: &Option<SeedRange>, decimals: usize) -> String {
    r.map_or("-".into(), |r| r.show(|x| format!("{x:.decimals$}")))
}

/// Left-aligned first column, the others right-aligned, widths from the content.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let all = std::iter::once(header.iter().map(|s| s.to_string()).collect::<Vec<_>>()).chain(rows.iter().cloned());
    for row in all {
        let mut line = String::new();
        for (i, (c, w)) in row.iter().zip(&widths).enumerate() {
            let _ = if i < 2 { write!(line, "{c:<w$}  ") } else { write!(line, "{c:>w$}  ") };
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The comparison as text: the tail table, then the per-policy table.
pub fn render(c: &Comparison) -> String {
    let mut out = format!(
        "Tail TTFT per 256-token reasoning bin, {} vs each policy ({}): change = {} / other − 1\n",
        c.subject,
        if c.seeds > 1 { format!("mean [min … max] over {} seeds", c.seeds) } else { "one seed".into() },
        c.subject
    );
    let rows: Vec<Vec<String>> = c
        .tail
        .iter()
        .map(|t| {
            vec![
                rate_label(t.rate),
                t.baseline.clone(),
                pct(&t.max_reduction),
                format!("{} / {}", num(&t.max_reduction_policy_s, 1), num(&t.max_reduction_baseline_s, 1)),
                pct(&t.worst_trusted_increase),
                pct(&t.worst_increase),
                pct(&t.worst_demoted_increase),
                pct(&t.mean_change),
            ]
        })
        .collect();
    let trusted = format!("worst (<{} tok, ≥10)", c.demotion_tokens);
    out.push_str(&table(
        &[
            "rate",
            "vs",
            "max reduction",
            "there: s / s",
            &trusted,
            "worst (all bins)",
            "worst (demoted)",
            "mean per-bin",
        ],
        &rows,
    ));
    out.push('\n');
    let rows: Vec<Vec<String>> = c
        .policies
        .iter()
        .map(|p| {
            vec![
                rate_label(p.rate),
                p.policy.clone(),
                num(&p.slo_violation_pct, 2),
                num(&p.blocking_p99_s, 2),
                format!("{} ({})", num(&p.e2e_p50_s, 1), pct(&p.e2e_p50_vs_subject)),
                format!("{} ({})", num(&p.e2e_p99_s, 1), pct(&p.e2e_p99_vs_subject)),
                format!("{} ({})", num(&p.throughput_tok_s, 0), pct(&p.throughput_vs_subject)),
                num(&p.transfer_p99_s, 3),
                num(&p.migrations, 0),
            ]
        })
        .collect();
    out.push_str(&table(
        &[
            "rate",
            "policy",
            "SLO viol %",
            "blocking p99 s",
            &format!("E2E p50 s (vs {})", c.subject),
            "E2E p99 s",
            "output tok/s",
            "xfer p99 s",
            "migrations",
        ],
        &rows,
    ));
    out
}

/// `comparison.csv`: one row per tail row, the ranges as `_mean`, `_min`, `_max` columns.
pub fn csv(c: &Comparison) -> String {
    let fields = [
        "max_reduction",
        "max_reduction_policy_s",
        "max_reduction_baseline_s",
        "worst_trusted_increase",
        "worst_increase",
        "worst_demoted_increase",
        "mean_change",
    ];
    let mut out = String::from("rate,subject,baseline,seeds");
    for f in fields {
        let _ = write!(out, ",{f}_mean,{f}_min,{f}_max");
    }
    out.push('\n');
    for t in &c.tail {
        let _ = write!(
            out,
            "{},{},{},{}",
            t.rate.map(|r| r.to_string()).unwrap_or_default(),
            c.subject,
            t.baseline,
            t.seeds
        );
        for r in [
            t.max_reduction,
            t.max_reduction_policy_s,
            t.max_reduction_baseline_s,
            t.worst_trusted_increase,
            t.worst_increase,
            t.worst_demoted_increase,
            t.mean_change,
        ] {
            match r {
                Some(r) => {
                    let _ = write!(out, ",{:.6},{:.6},{:.6}", r.mean, r.min, r.max);
                }
                None => out.push_str(",,,"),
            }
        }
        out.push('\n');
    }
    out
}

/// Writes `comparison.txt` (`text`, from [`render`]), `comparison.json` and `comparison.csv`.
pub fn write(out_dir: &std::path::Path, c: &Comparison, text: &str) -> anyhow::Result<Vec<std::path::PathBuf>> {
    use anyhow::Context as _;
    let mut json = serde_json::to_string_pretty(c).context("serializing the comparison")?;
    json.push('\n');
    let files = [("comparison.txt", text.to_string()), ("comparison.json", json), ("comparison.csv", csv(c))];
    let mut written = Vec::new();
    for (name, body) in files {
        let path = out_dir.join(name);
        std::fs::write(&path, body).with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::fixtures;
    use kvfleet_core::metrics::{TailBin, TailStatistic};

    fn bins(tails: &[(u32, f64)]) -> Vec<TailBin> {
        tails
            .iter()
            .map(|&(lo, ttft_s)| TailBin { lo, hi: lo + 255, samples: 50, statistic: TailStatistic::P95, ttft_s })
            .collect()
    }

    fn run(policy: &str, seed: u64, tails: &[(u32, f64)]) -> RunResult {
        let mut r = fixtures::run(policy, Some(8.0), Vec::new(), Vec::new());
        r.seed = seed;
        r.tail_ttft = bins(tails);
        r
    }

    #[test]
    fn ranges_over_seeds_per_baseline() {
        let runs = vec![
            run("fcfs", 1, &[(0, 10.0), (256, 4.0)]),
            run("pascal", 1, &[(0, 5.0), (256, 5.0)]),
            run("pascal", 2, &[(0, 7.0), (256, 4.0)]),
            run("fcfs", 2, &[(0, 10.0), (256, 4.0)]),
        ];
        let c = compare(&runs, 5000).unwrap();
        assert_eq!(c.subject, "pascal", "pascal is the subject even when listed second");
        assert_eq!(c.seeds, 2);
        assert_eq!(c.tail.len(), 1);
        let t = &c.tail[0];
        assert_eq!((t.baseline.as_str(), t.seeds), ("fcfs", 2));
        let max = t.max_reduction.unwrap();
        // Seed 1: bin 0 −50 %; seed 2: bin 0 −30 %.
        assert!((max.min + 0.5).abs() < 1e-12 && (max.max + 0.3).abs() < 1e-12, "{max:?}");
        let worst = t.worst_trusted_increase.unwrap();
        // Seed 1: bin 256 +25 %; seed 2: bin 0 −30 % vs bin 256 0 % → 0 %.
        assert!((worst.max - 0.25).abs() < 1e-12 && worst.min.abs() < 1e-12, "{worst:?}");
        let text = render(&c);
        assert!(text.contains("-50.0%") || text.contains("-40.0% [-50.0% … -30.0%]"), "{text}");
        assert!(csv(&c).lines().count() == 2);
        assert_eq!(c.policies.len(), 2);
    }

    #[test]
    fn one_policy_has_nothing_to_compare() {
        assert!(compare(&[run("pascal", 1, &[(0, 1.0)])], 5000).is_none());
        assert!(compare(&[], 5000).is_none());
    }
}
