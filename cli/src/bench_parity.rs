//! `kvfleet bench parity`: does a result of `kvfleet sim` hold in `kvfleet up`? Each workload runs
//! through both (same config, same seed; the emulator's arenas sized as the config's
//! `kv_cache_gb` / `cpu_swap_gb`, its migration links shaped to the config's `[link]`), and the
//! per-request records are compared: TTFT and E2E error, where each request was placed first, how
//! many migrations committed, migration downtime.
//!
//! How much a workload's placements hang on timing is measured beside: the simulator runs again
//! with the link's rate off by a few per cent either way (`--sensitivity-pct`) and is compared
//! with itself. Where a 1 % slower link already places a third of the requests elsewhere, an
//! emulator whose real migrations take a few per cent more or less than the fabric model cannot
//! agree with the simulator more than that; where the simulator holds its placements, every
//! divergence is the emulator's.
//!
//! The link must be one this host's loopback QUIC can carry (a few Gbit/s here): the embedded
//! quickstart config models a 100 Gbit/s fabric, so the bench runs it with `[link]` set to
//! [`QUICKSTART_LINK_GBPS`] in both.

use crate::up::DEFAULT_CONFIG;
use crate::{say, InputError};
use anyhow::Context as _;
use clap::Args;
use kvfleet_core::metrics::percentile::Distribution;
use kvfleet_sim::config::SimConfig;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The embedded default of `kvfleet up`, by name.
const QUICKSTART: &str = "quickstart";

/// The migration link of the quickstart workload here, Gbit/s (in the simulator's fabric model
/// and as the emulator's shaping): below what loopback QUIC carries on this host.
pub const QUICKSTART_LINK_GBPS: f64 = 2.0;

#[derive(Args)]
pub struct ParityBench {
    /// Workloads: `quickstart` (the embedded `kvfleet up` default) or config files.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "quickstart,examples/parity-trace.toml,examples/parity-migration.toml,examples/parity-prefix.toml"
    )]
    workloads: Vec<String>,
    /// Run each workload under these policies (in both backends; default: its config's
    /// `scheduler.policy`); each (workload, policy) is one row, named `<workload>-<policy>`.
    #[arg(long = "policy", value_delimiter = ',')]
    policies: Vec<String>,
    /// The emulator's time dilation (`kvfleet up --time-dilation`: a factor, or `auto` to pick
    /// one from this host's QUIC goodput and the config's link). Rows of a dilated run are named
    /// `<workload>-k<K>`.
    #[arg(long, default_value = "1")]
    time_dilation: String,
    /// The workload seed in both backends (default: each config's `workload.seed`); rows are then
    /// named `<workload>-seed<N>`.
    #[arg(long)]
    seed: Option<u64>,
    /// Per cent by which the simulator's link rate is set off, either way, to compare the
    /// simulator with itself (how much the workload's placements hang on migration times);
    /// `0` runs no such comparison.
    #[arg(long, value_delimiter = ',', default_value = "1,3", allow_negative_numbers = true)]
    sensitivity_pct: Vec<f64>,
    /// Output directory: per workload the simulator's and the emulator's outputs; `parity.json`
    /// and `parity.csv` with the figures.
    #[arg(short, long, default_value = "results/bench-parity")]
    out: PathBuf,
}

/// One request as a `requests-*.csv` row has it.
#[derive(Clone, Debug, PartialEq)]
struct Req {
    /// Arrival, s (each backend on its own clock: only the simulator's orders requests).
    arrival_s: f64,
    placed_on: u32,
    ttft_s: Option<f64>,
    e2e_s: Option<f64>,
    migrations: u32,
    /// Prompt tokens, and of those found in the prefix cache (0 where the CSV has no column).
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// The figures of one workload.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Parity {
    pub workload: String,
    /// Requests finished in both.
    pub compared: usize,
    pub sim_finished: usize,
    pub emu_finished: usize,
    pub ttft_mape_pct: f64,
    pub e2e_mape_pct: f64,
    pub e2e_median_abs_err_pct: f64,
    /// Share of the compared requests placed first on the same instance.
    pub placement_agreement_pct: f64,
    pub sim_migrations: u32,
    pub emu_migrations: u32,
    pub sim_downtime_p50_ms: Option<f64>,
    pub emu_downtime_p50_ms: Option<f64>,
    /// Prefix-cache hit rate (cached ÷ prompt tokens of the compared requests), % (`None`
    /// when nothing was cached in either).
    pub sim_prefix_hit_pct: Option<f64>,
    pub emu_prefix_hit_pct: Option<f64>,
    /// Share of the compared requests with the same cached tokens in both, %.
    pub same_cached_pct: f64,
    /// Largest gap between the two backends' hit rates of one instance (over the compared
    /// requests placed there), percentage points (`None` when nothing was cached).
    pub prefix_hit_instance_gap_pp: Option<f64>,
    /// The first request (in arrival order) the two backends placed apart, if any.
    pub first_divergence: Option<Divergence>,
    /// The simulator against itself with its link rate set off (`--sensitivity-pct`), one row
    /// per rate.
    pub sim_sensitivity: Vec<Sensitivity>,
}

/// The simulator with its link's rate changed by `link_pct` per cent, against the simulator.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Sensitivity {
    pub link_pct: f64,
    pub placement_agreement_pct: f64,
    pub e2e_mape_pct: f64,
    pub migrations: u32,
    pub downtime_p50_ms: Option<f64>,
}

impl Sensitivity {
    /// The lowest placement agreement and highest E2E MAPE among the rows set off by `pct` either
    /// way.
    fn worst(rows: &[Sensitivity], pct: f64) -> Option<(f64, f64)> {
        let of = rows.iter().filter(|r| r.link_pct.abs() == pct);
        of.fold(None, |acc, r| {
            let (p, e) = acc.unwrap_or((f64::INFINITY, f64::NEG_INFINITY));
            Some((p.min(r.placement_agreement_pct), e.max(r.e2e_mape_pct)))
        })
    }
}

/// `--sensitivity-pct`: the per-cent changes to run, each either way (0 dropped); a value that
/// is no usable change is refused.
fn link_changes(pcts: &[f64]) -> Result<Vec<f64>, InputError> {
    let mut out = Vec::new();
    for &p in pcts {
        if !(0.0..50.0).contains(&p) {
            return Err(InputError(format!("--sensitivity-pct {p}: must be a per cent in [0, 50)")));
        }
        if p > 0.0 {
            out.extend([-p, p]);
        }
    }
    Ok(out)
}

/// The link rate, Gbit/s, `pct` per cent off `gbps`.
fn link_set_off(gbps: f64, pct: f64) -> String {
    format!("link.bandwidth_gbps={}", gbps * (1.0 + pct / 100.0))
}

/// Where two runs' placements first part, and how far their timelines had drifted by then.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Divergence {
    pub request: u64,
    /// Its arrival in the simulated run, s.
    pub arrival_s: f64,
    pub sim_on: u32,
    pub emu_on: u32,
    /// Requests before it whose TTFT differs between the backends by more than 1 ms: the
    /// instances' timelines had parted before their placements did.
    pub ttft_drifted_before: usize,
}

impl Divergence {
    /// The requests compared in both, in the simulator's arrival order.
    fn find(both: &[(u64, &Req, &Req)]) -> Option<Divergence> {
        let mut order: Vec<&(u64, &Req, &Req)> = both.iter().collect();
        order.sort_by(|a, b| a.1.arrival_s.total_cmp(&b.1.arrival_s).then(a.0.cmp(&b.0)));
        let k = order.iter().position(|(_, s, e)| s.placed_on != e.placed_on)?;
        let (id, s, e) = order[k];
        let drifted = |(_, s, e): &&&(u64, &Req, &Req)| match (s.ttft_s, e.ttft_s) {
            (Some(a), Some(b)) => (a - b).abs() > 1e-3,
            _ => false,
        };
        Some(Divergence {
            request: *id,
            arrival_s: s.arrival_s,
            sim_on: s.placed_on,
            emu_on: e.placed_on,
            ttft_drifted_before: order[..k].iter().filter(drifted).count(),
        })
    }

    /// One line: where and what.
    fn describe(&self, workload: &str) -> String {
        format!(
            "{workload}: placements first part at request {} (t = {:.3} s: instance {} in sim, {} in emu); \
             {} earlier requests' TTFTs differ by > 1 ms",
            self.request, self.arrival_s, self.sim_on, self.emu_on, self.ttft_drifted_before
        )
    }
}

pub fn run(b: ParityBench) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("locating the kvfleet binary")?;
    std::fs::create_dir_all(&b.out).with_context(|| format!("creating {}", b.out.display()))?;
    let mut results = Vec::new();
    let policies: Vec<Option<&String>> =
        if b.policies.is_empty() { vec![None] } else { b.policies.iter().map(Some).collect() };
    let dilation: crate::up::cluster::DilationArg =
        b.time_dilation.parse().map_err(|e| InputError(format!("--time-dilation: {e}")))?;
    let changes = link_changes(&b.sensitivity_pct)?;
    let seed = b.seed.map(|s| s.to_string());
    let seed_args: Vec<&str> = seed.as_deref().map(|s| vec!["--seed", s]).unwrap_or_default();
    let runs = b.workloads.iter().flat_map(|w| policies.iter().map(move |p| (w, *p)));
    for (w, policy) in runs {
        let (name, config) = workload_config(w, &b.out)?;
        let cfg = SimConfig::load(&config).map_err(|e| InputError(e.to_string()))?;
        let name = match policy {
            Some(p) => {
                kvfleet_sim::config::resolve_policy(p).map_err(|e| InputError(e.to_string()))?;
                format!("{name}-{}", crate::report::file_safe(p))
            }
            None => name,
        };
        let name = match &b.seed {
            Some(seed) => format!("{name}-seed{seed}"),
            None => name,
        };
        let name = match dilation {
            crate::up::cluster::DilationArg::Fixed(k) if k.is_none() => name,
            _ => format!("{name}-k{}", b.time_dilation.trim()),
        };
        let policy_args: Vec<&str> = policy.map(|p| vec!["--policy", p.as_str()]).unwrap_or_default();
        let dir = b.out.join(&name);
        let _ = std::fs::remove_dir_all(&dir);
        let (sim_dir, emu_dir) = (dir.join("sim"), dir.join("emu"));
        let config_arg = config.to_string_lossy().into_owned();
        say!("parity {name}: kvfleet sim …");
        let sim_dir_arg = path_arg(&sim_dir);
        let sim_args = ["sim", "--config", &config_arg, "--no-plots", "-q"];
        let sim_args = [&sim_args[..], &policy_args, &seed_args].concat();
        run_step(&exe, &[&sim_args[..], &["--out", &sim_dir_arg]].concat())?;
        let sim = Run::read(&sim_dir)?;
        let mut sensitivity = Vec::new();
        for &pct in &changes {
            let dir = dir.join(format!("sim-link{pct:+}pct"));
            let (dir_arg, set) = (path_arg(&dir), link_set_off(cfg.link.bandwidth_gbps, pct));
            run_step(&exe, &[&sim_args[..], &["--set", &set, "--out", &dir_arg]].concat())?;
            let set_off = Run::read(&dir)?;
            // The set-off run stands where the emulator's does (its figures are the `emu_` ones).
            let p = figures(&name, &sim.requests, &set_off.requests);
            sensitivity.push(Sensitivity {
                link_pct: pct,
                placement_agreement_pct: p.placement_agreement_pct,
                e2e_mape_pct: p.e2e_mape_pct,
                migrations: p.emu_migrations,
                downtime_p50_ms: set_off.downtime_p50_ms,
            });
        }
        say!("parity {name}: kvfleet up (real processes; about as long as the simulated run) …");
        let Some(kv) = cfg.cluster.kv_cache_gb else {
            let why = "needs `cluster.kv_cache_gb`: the emulator's arenas are sized from it";
            return Err(InputError(format!("workload `{name}` ({}) {why}", config.display())).into());
        };
        let (kv, cpu) = (arena_bytes(kv), arena_bytes(cfg.cluster.cpu_swap_gb));
        let (gbps, latency_us) = (cfg.link.bandwidth_gbps.to_string(), cfg.link.latency_us.to_string());
        let emu_dir_arg = path_arg(&emu_dir);
        let up_args = [
            "up",
            "--config",
            &config_arg,
            "--no-etcd",
            "--no-traces",
            "--kv-memory",
            &kv,
            "--cpu-memory",
            &cpu,
            "--kv-fill",
            "stamp",
            "--link-gbps",
            &gbps,
            "--link-latency-us",
            &latency_us,
            "--time-dilation",
            &b.time_dilation,
            "-q",
            "--out",
            &emu_dir_arg,
        ];
        run_step(&exe, &[&up_args[..], &policy_args, &seed_args].concat())?;
        let p = Parity { sim_sensitivity: sensitivity, ..compare(&name, &sim, &Run::read(&emu_dir)?) };
        say!("{}", table(std::slice::from_ref(&p)));
        if let Some(d) = &p.first_divergence {
            say!("{}", d.describe(&p.workload));
        }
        results.push(p);
    }
    say!("\n{}", table(&results));
    if !changes.is_empty() {
        say!("\n{}", sensitivity_table(&results, &b.sensitivity_pct));
    }
    std::fs::write(b.out.join("parity.json"), serde_json::to_string_pretty(&results)? + "\n")?;
    std::fs::write(b.out.join("parity.csv"), csv(&results))?;
    if changes.is_empty() {
        say!("wrote parity.json and parity.csv to {}", b.out.display());
    } else {
        std::fs::write(b.out.join("sensitivity.csv"), sensitivity_csv(&results))?;
        say!("wrote parity.json, parity.csv and sensitivity.csv to {}", b.out.display());
    }
    Ok(())
}

/// `quickstart` (written out to `out/quickstart.toml`) or a config file; its name.
fn workload_config(w: &str, out: &Path) -> anyhow::Result<(String, PathBuf)> {
    if w == QUICKSTART {
        let path = out.join("quickstart.toml");
        let text = format!("{DEFAULT_CONFIG}\n[link]\nbandwidth_gbps = {QUICKSTART_LINK_GBPS:?}\n");
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        return Ok((QUICKSTART.into(), path));
    }
    let path = PathBuf::from(w);
    if !path.is_file() {
        return Err(InputError(format!("workload `{w}`: not `{QUICKSTART}` and no such config file")).into());
    }
    let name = path.file_stem().map_or_else(|| w.to_string(), |s| s.to_string_lossy().into_owned());
    Ok((name, path))
}

/// `kvfleet up --kv-memory` for a config's size in GB (10⁹ bytes).
fn arena_bytes(gb: f64) -> String {
    format!("{}", (gb * 1e9).round() as u64)
}

fn path_arg(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// Run `kvfleet args…`; a failure names the step and ends with its output's last lines.
fn run_step(exe: &Path, args: &[&str]) -> anyhow::Result<()> {
    let o = Command::new(exe).args(args).output().with_context(|| format!("starting {}", exe.display()))?;
    if o.status.success() {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&o.stderr).into_owned() + &String::from_utf8_lossy(&o.stdout);
    let tail: Vec<&str> = text.lines().rev().take(12).collect::<Vec<_>>().into_iter().rev().collect();
    anyhow::bail!("kvfleet {} failed ({}):\n{}", args.join(" "), o.status, tail.join("\n"))
}

/// The one file in `dir` whose name starts with `prefix` and ends in `.csv`.
fn find_csv(dir: &Path, prefix: &str) -> anyhow::Result<Option<PathBuf>> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let p = e?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name.starts_with(prefix) && name.ends_with(".csv") {
            found.push(p);
        }
    }
    anyhow::ensure!(found.len() <= 1, "{}: several {prefix}*.csv files", dir.display());
    Ok(found.pop())
}

/// Rows of a CSV whose fields hold no commas before the last column we read, by header name.
fn rows(path: &Path) -> anyhow::Result<Vec<BTreeMap<String, String>>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
    Ok(lines
        .filter(|l| !l.is_empty())
        .map(|l| header.iter().map(|h| h.to_string()).zip(l.split(',').map(str::to_string)).collect())
        .collect())
}

fn field<T: std::str::FromStr>(row: &BTreeMap<String, String>, name: &str, path: &Path) -> anyhow::Result<Option<T>> {
    match row.get(name).map(String::as_str) {
        None => anyhow::bail!("{}: no column `{name}`", path.display()),
        Some("") => Ok(None),
        Some(v) => {
            v.parse().map(Some).map_err(|_| anyhow::anyhow!("{}: `{name}` = {v:?} is not a number", path.display()))
        }
    }
}

fn requests(dir: &Path) -> anyhow::Result<BTreeMap<u64, Req>> {
    let path = find_csv(dir, "requests-")?.ok_or_else(|| anyhow::anyhow!("no requests-*.csv in {}", dir.display()))?;
    let mut out = BTreeMap::new();
    for row in rows(&path)? {
        let id = field(&row, "id", &path)?.unwrap_or_default();
        let req = Req {
            arrival_s: field(&row, "arrival_s", &path)?.unwrap_or_default(),
            placed_on: field(&row, "placed_on", &path)?.unwrap_or_default(),
            ttft_s: field(&row, "ttft_s", &path)?,
            e2e_s: field(&row, "e2e_s", &path)?,
            migrations: field(&row, "migrations", &path)?.unwrap_or_default(),
            prompt_tokens: field(&row, "prompt_tokens", &path)?.unwrap_or_default(),
            cached_tokens: field(&row, "cached_tokens", &path)?.unwrap_or_default(),
        };
        out.insert(id, req);
    }
    Ok(out)
}

/// Downtime (ms) of every committed live migration in `dir`'s `live-migrations*.csv`.
fn downtimes_ms(dir: &Path) -> anyhow::Result<Vec<f64>> {
    let Some(path) = find_csv(dir, "live-migrations")? else { return Ok(Vec::new()) };
    let mut out = Vec::new();
    for row in rows(&path)? {
        if row.get("outcome").is_some_and(|o| o == "committed") {
            out.extend(field::<f64>(&row, "downtime_ms", &path)?);
        }
    }
    Ok(out)
}

/// One run's records, as compared: its requests and its committed migrations' downtime P50.
struct Run {
    requests: BTreeMap<u64, Req>,
    downtime_p50_ms: Option<f64>,
}

impl Run {
    fn read(dir: &Path) -> anyhow::Result<Run> {
        Ok(Run { requests: requests(dir)?, downtime_p50_ms: Distribution::new(downtimes_ms(dir)?).percentile(0.5) })
    }
}

/// The emulator's run against the simulator's.
fn compare(name: &str, sim: &Run, emu: &Run) -> Parity {
    Parity {
        sim_downtime_p50_ms: sim.downtime_p50_ms,
        emu_downtime_p50_ms: emu.downtime_p50_ms,
        ..figures(name, &sim.requests, &emu.requests)
    }
}

/// Relative error of `emu` against `sim`, in %; `None` unless both are known and `sim` > 0.
fn ape(sim: Option<f64>, emu: Option<f64>) -> Option<f64> {
    match (sim, emu) {
        (Some(s), Some(e)) if s > 0.0 => Some(100.0 * (e - s).abs() / s),
        _ => None,
    }
}

fn figures(name: &str, sim: &BTreeMap<u64, Req>, emu: &BTreeMap<u64, Req>) -> Parity {
    let finished = |m: &BTreeMap<u64, Req>| m.values().filter(|r| r.e2e_s.is_some()).count();
    let both_ids: Vec<(u64, &Req, &Req)> = sim
        .iter()
        .filter_map(|(id, s)| emu.get(id).map(|e| (*id, s, e)))
        .filter(|(_, s, e)| s.e2e_s.is_some() && e.e2e_s.is_some())
        .collect();
    let both: Vec<(&Req, &Req)> = both_ids.iter().map(|&(_, s, e)| (s, e)).collect();
    let mean = |v: Vec<f64>| Distribution::new(v).mean().unwrap_or(f64::NAN);
    let e2e: Vec<f64> = both.iter().filter_map(|(s, e)| ape(s.e2e_s, e.e2e_s)).collect();
    let share = |n: usize| if both.is_empty() { f64::NAN } else { 100.0 * n as f64 / both.len() as f64 };
    let prompt: u64 = both.iter().map(|(s, _)| s.prompt_tokens).sum();
    let cached: (u64, u64) = both.iter().fold((0, 0), |(a, b), (s, e)| (a + s.cached_tokens, b + e.cached_tokens));
    let hit = |c: u64| (cached != (0, 0) && prompt > 0).then(|| 100.0 * c as f64 / prompt as f64);
    Parity {
        workload: name.to_string(),
        compared: both.len(),
        sim_finished: finished(sim),
        emu_finished: finished(emu),
        ttft_mape_pct: mean(both.iter().filter_map(|(s, e)| ape(s.ttft_s, e.ttft_s)).collect()),
        e2e_mape_pct: mean(e2e.clone()),
        e2e_median_abs_err_pct: Distribution::new(e2e).percentile(0.5).unwrap_or(f64::NAN),
        placement_agreement_pct: share(both.iter().filter(|(s, e)| s.placed_on == e.placed_on).count()),
        sim_migrations: sim.values().map(|r| r.migrations).sum(),
        emu_migrations: emu.values().map(|r| r.migrations).sum(),
        sim_downtime_p50_ms: None,
        emu_downtime_p50_ms: None,
        sim_prefix_hit_pct: hit(cached.0),
        emu_prefix_hit_pct: hit(cached.1),
        same_cached_pct: share(both.iter().filter(|(s, e)| s.cached_tokens == e.cached_tokens).count()),
        prefix_hit_instance_gap_pp: if cached == (0, 0) { None } else { instance_hit_gap(&both) },
        first_divergence: Divergence::find(&both_ids),
        sim_sensitivity: Vec::new(),
    }
}

/// Per instance, the hit rate (cached ÷ prompt tokens, %) of the requests each backend placed
/// there; the largest gap between the two over the instances either used.
fn instance_hit_gap(both: &[(&Req, &Req)]) -> Option<f64> {
    let rates = |side: &dyn Fn(&(&Req, &Req)) -> Req| {
        let mut per: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
        for pair in both {
            let r = side(pair);
            let e = per.entry(r.placed_on).or_default();
            (e.0, e.1) = (e.0 + r.cached_tokens, e.1 + r.prompt_tokens);
        }
        per.into_iter()
            .map(|(i, (c, p))| (i, if p > 0 { 100.0 * c as f64 / p as f64 } else { 0.0 }))
            .collect::<BTreeMap<u32, f64>>()
    };
    let (sim, emu) = (rates(&|(s, _)| (*s).clone()), rates(&|(_, e)| (*e).clone()));
    let instances: std::collections::BTreeSet<u32> = sim.keys().chain(emu.keys()).copied().collect();
    instances
        .into_iter()
        .map(|i| (sim.get(&i).copied().unwrap_or(0.0) - emu.get(&i).copied().unwrap_or(0.0)).abs())
        .max_by(f64::total_cmp)
}

fn opt_ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.1}"))
}

/// The summary table: one row per workload.
pub fn table(rows: &[Parity]) -> String {
    let mut s = String::from(
        "workload            compared  TTFT MAPE %  E2E MAPE %  E2E median err %  same placement %  migrations sim/emu  downtime p50 ms sim/emu  prefix hit % sim/emu  same cached %\n",
    );
    for p in rows {
        let pct = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
        let _ = writeln!(
            s,
            "{:<18} {:>4}/{:<4} {:>11.2} {:>11.2} {:>17.2} {:>17.1} {:>10}/{:<9} {:>12}/{:<11} {:>9}/{:<10} {:>13.1}",
            p.workload,
            p.compared,
            p.sim_finished.max(p.emu_finished),
            p.ttft_mape_pct,
            p.e2e_mape_pct,
            p.e2e_median_abs_err_pct,
            p.placement_agreement_pct,
            p.sim_migrations,
            p.emu_migrations,
            opt_ms(p.sim_downtime_p50_ms),
            opt_ms(p.emu_downtime_p50_ms),
            pct(p.sim_prefix_hit_pct),
            pct(p.emu_prefix_hit_pct),
            p.same_cached_pct,
        );
    }
    s
}

/// Same placement and E2E MAPE of the emulator against the simulator, beside the simulator's own
/// against itself with the link set off by each of `pcts` (the worse way).
pub fn sensitivity_table(rows: &[Parity], pcts: &[f64]) -> String {
    let pcts: Vec<f64> = pcts.iter().copied().filter(|&p| p > 0.0).collect();
    let mut s = String::from(
        "same placement % / E2E MAPE %: emulator vs simulator, and simulator vs itself with its link rate set off\n",
    );
    let _ = write!(s, "{:<18} {:>17}", "workload", "emulator");
    for p in &pcts {
        let _ = write!(s, " {:>17}", format!("sim ±{p} % link"));
    }
    s.push('\n');
    for r in rows {
        let _ =
            write!(s, "{:<18} {:>17}", r.workload, format!("{:.1} / {:.2}", r.placement_agreement_pct, r.e2e_mape_pct));
        for &p in &pcts {
            let cell =
                Sensitivity::worst(&r.sim_sensitivity, p).map_or("-".into(), |(a, e)| format!("{a:.1} / {e:.2}"));
            let _ = write!(s, " {cell:>17}");
        }
        s.push('\n');
    }
    s
}

fn csv(rows: &[Parity]) -> String {
    let mut s = String::from(
        "workload,compared,sim_finished,emu_finished,ttft_mape_pct,e2e_mape_pct,e2e_median_abs_err_pct,placement_agreement_pct,sim_migrations,emu_migrations,sim_downtime_p50_ms,emu_downtime_p50_ms,sim_prefix_hit_pct,emu_prefix_hit_pct,same_cached_pct,prefix_hit_instance_gap_pp\n",
    );
    for p in rows {
        let o = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.3}"));
        let _ = writeln!(
            s,
            "{},{},{},{},{:.3},{:.3},{:.3},{:.2},{},{},{},{},{},{},{:.2},{}",
            p.workload,
            p.compared,
            p.sim_finished,
            p.emu_finished,
            p.ttft_mape_pct,
            p.e2e_mape_pct,
            p.e2e_median_abs_err_pct,
            p.placement_agreement_pct,
            p.sim_migrations,
            p.emu_migrations,
            o(p.sim_downtime_p50_ms),
            o(p.emu_downtime_p50_ms),
            o(p.sim_prefix_hit_pct),
            o(p.emu_prefix_hit_pct),
            p.same_cached_pct,
            o(p.prefix_hit_instance_gap_pp),
        );
    }
    s
}

/// One row per workload and link change.
fn sensitivity_csv(rows: &[Parity]) -> String {
    let mut s = String::from("workload,link_pct,placement_agreement_pct,e2e_mape_pct,migrations,downtime_p50_ms\n");
    for p in rows {
        for r in &p.sim_sensitivity {
            let down = r.downtime_p50_ms.map_or(String::new(), |v| format!("{v:.3}"));
            let _ = writeln!(
                s,
                "{},{},{:.2},{:.3},{},{down}",
                p.workload, r.link_pct, r.placement_agreement_pct, r.e2e_mape_pct, r.migrations
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(placed_on: u32, ttft: f64, e2e: f64, migrations: u32) -> Req {
        Req {
            arrival_s: 0.0,
            placed_on,
            ttft_s: Some(ttft),
            e2e_s: Some(e2e),
            migrations,
            prompt_tokens: 100,
            cached_tokens: 0,
        }
    }

    /// The first request placed apart, in the simulator's arrival order (not by id), and the
    /// earlier ones whose TTFTs had drifted.
    #[test]
    fn the_first_divergence_is_found_in_arrival_order() {
        let at = |arrival_s: f64, placed_on: u32, ttft: f64| Req { arrival_s, ..req(placed_on, ttft, 10.0, 0) };
        let sim: BTreeMap<u64, Req> =
            [(1, at(3.0, 0, 1.0)), (2, at(1.0, 1, 1.0)), (3, at(2.0, 2, 1.0)), (4, at(0.5, 0, 1.0))].into();
        let mut emu = sim.clone();
        emu.insert(1, at(3.1, 1, 1.0)); // placed apart, last to arrive
        emu.insert(3, at(2.1, 3, 1.0)); // placed apart, arrives first of the two
        emu.insert(2, at(1.1, 1, 1.01)); // drifted by 10 ms before it
        emu.insert(4, at(0.6, 0, 1.0005)); // within 1 ms
        let d = figures("w", &sim, &emu).first_divergence.expect("placements part");
        assert_eq!(d, Divergence { request: 3, arrival_s: 2.0, sim_on: 2, emu_on: 3, ttft_drifted_before: 1 });
        assert!(
            d.describe("w").contains("request 3 (t = 2.000 s: instance 2 in sim, 3 in emu)"),
            "{}",
            d.describe("w")
        );
        assert_eq!(figures("w", &sim, &sim).first_divergence, None);
    }

    #[test]
    fn figures_compare_request_by_request() {
        let sim: BTreeMap<u64, Req> =
            [(1, req(0, 1.0, 10.0, 1)), (2, req(1, 2.0, 20.0, 0)), (3, req(2, 1.0, 5.0, 0))].into();
        let mut emu = sim.clone();
        emu.insert(1, req(0, 1.1, 11.0, 1)); // +10 %
        emu.insert(2, req(3, 2.0, 19.0, 1)); // -5 %, elsewhere, moved
        emu.insert(3, Req { e2e_s: None, ..req(2, 1.0, 5.0, 0) }); // unfinished: not compared
        let p = figures("w", &sim, &emu);
        assert_eq!((p.compared, p.sim_finished, p.emu_finished), (2, 3, 2));
        assert!((p.e2e_mape_pct - 7.5).abs() < 1e-9, "{}", p.e2e_mape_pct);
        assert!((p.ttft_mape_pct - 5.0).abs() < 1e-9, "{}", p.ttft_mape_pct);
        assert!((p.placement_agreement_pct - 50.0).abs() < 1e-9);
        assert_eq!((p.sim_migrations, p.emu_migrations), (1, 2));
        assert_eq!((p.sim_prefix_hit_pct, p.emu_prefix_hit_pct, p.same_cached_pct), (None, None, 100.0));
        assert!(table(&[p]).lines().nth(1).unwrap().starts_with("w "));
        // Prefix caching: 40 of 200 prompt tokens cached in the simulator, 32 in the emulator.
        let mut emu = sim.clone();
        let mut sim = sim;
        sim.get_mut(&1).unwrap().cached_tokens = 32;
        sim.get_mut(&2).unwrap().cached_tokens = 8;
        emu.get_mut(&1).unwrap().cached_tokens = 32;
        let p = figures("w", &sim, &emu);
        assert_eq!((p.sim_prefix_hit_pct, p.emu_prefix_hit_pct), (Some(40.0 / 3.0), Some(32.0 / 3.0)));
        assert!((p.same_cached_pct - 200.0 / 3.0).abs() < 1e-9, "{}", p.same_cached_pct);
        // Instance 0 (request 1): 32 % in both; instance 1 (request 2): 8 % against 0 %.
        assert_eq!(p.prefix_hit_instance_gap_pp, Some(8.0));
    }

    /// Each change runs either way; the table shows the worse of the two beside the emulator's.
    #[test]
    fn the_simulators_sensitivity_is_run_both_ways_and_shown_at_its_worst() {
        assert_eq!(link_changes(&[1.0, 0.0, 3.0]).unwrap(), [-1.0, 1.0, -3.0, 3.0]);
        assert!(link_changes(&[0.0]).unwrap().is_empty());
        for bad in [-1.0, 50.0, f64::NAN] {
            let e = link_changes(&[bad]).unwrap_err().0;
            assert!(e.starts_with("--sensitivity-pct"), "{e}");
        }
        assert_eq!(link_set_off(2.0, -1.0), "link.bandwidth_gbps=1.98");
        assert_eq!(link_set_off(2.0, 3.0), "link.bandwidth_gbps=2.06");
        let row = |link_pct: f64, agree: f64, mape: f64| Sensitivity {
            link_pct,
            placement_agreement_pct: agree,
            e2e_mape_pct: mape,
            migrations: 3,
            downtime_p50_ms: Some(1.5),
        };
        let rows = [row(-1.0, 90.0, 0.5), row(1.0, 100.0, 0.7), row(-3.0, 50.0, 4.0), row(3.0, 75.0, 2.0)];
        assert_eq!(Sensitivity::worst(&rows, 1.0), Some((90.0, 0.7)));
        assert_eq!(Sensitivity::worst(&rows, 3.0), Some((50.0, 4.0)));
        assert_eq!(Sensitivity::worst(&rows, 2.0), None);
        let sim: BTreeMap<u64, Req> = [(1, req(0, 1.0, 10.0, 1)), (2, req(1, 2.0, 20.0, 0))].into();
        let mut emu = sim.clone();
        emu.insert(2, req(0, 2.0, 22.0, 0));
        let p = Parity { sim_sensitivity: rows.to_vec(), ..figures("w", &sim, &emu) };
        let t = sensitivity_table(std::slice::from_ref(&p), &[1.0, 3.0]);
        let line = t.lines().nth(2).unwrap();
        assert!(line.starts_with("w ") && line.contains("50.0 / 5.00"), "{t}");
        assert!(line.contains("90.0 / 0.70") && line.ends_with("50.0 / 4.00"), "{t}");
        let c = sensitivity_csv(&[p]);
        assert_eq!(c.lines().count(), 5, "{c}");
        assert!(c.lines().nth(3).unwrap().starts_with("w,-3,50.00,4.000,3,1.500"), "{c}");
    }

    #[test]
    fn csv_rows_are_read_by_header_and_bad_numbers_named() {
        let dir = std::env::temp_dir().join(format!("kvfleet-parity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let head = "id,arrival_s,placed_on,ttft_s,e2e_s,migrations,prompt_tokens,cached_tokens";
        std::fs::write(dir.join("requests-x.csv"), format!("{head}\n4,1.5,2,0.5,,0,64,16\n")).unwrap();
        let r = requests(&dir).unwrap();
        assert_eq!(
            r[&4],
            Req {
                arrival_s: 1.5,
                placed_on: 2,
                ttft_s: Some(0.5),
                e2e_s: None,
                migrations: 0,
                prompt_tokens: 64,
                cached_tokens: 16
            }
        );
        std::fs::write(dir.join("requests-x.csv"), format!("{head}\n4,0,two,0.5,1,0,64,0\n")).unwrap();
        let e = requests(&dir).unwrap_err().to_string();
        assert!(e.contains("`placed_on`") && e.contains("two"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
