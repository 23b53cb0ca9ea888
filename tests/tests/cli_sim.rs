//! `kvfleet sim` end to end, as a separate process: invalid input is refused with exit code 2 and
//! one line naming the problem; the same config and seed give byte-identical files whatever the
//! parallelism; a policies × rates sweep (PASCAL §V's experiment shape) writes one summary row, one
//! JSON run and one per-request CSV per point, plus the SVG plots; a trace-driven workload (Azure
//! LLM inference trace, code) replays the trace's own arrivals and lengths.
//!
//! Workloads are a few hundred requests so the whole file runs in seconds on a debug build.

use kvfleet_tests::{describe, fixture, kvfleet_bin, read_dir_files, run_kvfleet, TempDir};
use std::collections::BTreeSet;
use std::path::Path;

/// A small CSV (no quoted fields) as its header and rows.
struct Csv {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Csv {
    fn read(path: &Path) -> Csv {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        assert!(!text.contains('"'), "{}: quoted fields are not expected here", path.display());
        assert!(text.ends_with('\n'), "{}: last line is not terminated", path.display());
        let mut lines = text.lines();
        let header: Vec<String> = lines.next().unwrap_or_default().split(',').map(str::to_string).collect();
        let rows: Vec<Vec<String>> = lines.map(|l| l.split(',').map(str::to_string).collect()).collect();
        for (i, row) in rows.iter().enumerate() {
            assert_eq!(
                row.len(),
                header.len(),
                "{} row {}: {} cells for {} columns",
                path.display(),
                i + 1,
                row.len(),
                header.len()
            );
        }
        Csv { header, rows }
    }

    fn col(&self, name: &str) -> usize {
        self.header.iter().position(|h| h == name).unwrap_or_else(|| panic!("no column `{name}` in {:?}", self.header))
    }

    /// Column `name` of every row.
    fn column(&self, name: &str) -> Vec<&str> {
        let c = self.col(name);
        self.rows.iter().map(|r| r[c].as_str()).collect()
    }

    /// Column `name` of every row, parsed as an integer.
    fn counts(&self, name: &str) -> Vec<u64> {
        self.column(name).iter().map(|v| v.parse().unwrap_or_else(|e| panic!("`{name}` = {v:?}: {e}"))).collect()
    }
}

fn sim(args: &[&str]) -> std::process::Output {
    let out = run_kvfleet(["sim"].iter().chain(args));
    assert_eq!(out.status.code(), Some(0), "kvfleet sim {args:?} failed: {}", describe(&out));
    out
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("temp paths are UTF-8")
}

// ---------------------------------------------------------------------------------------------
// Invalid input: exit code 2, one line on stderr naming the problem, nothing written.

/// One invalid invocation: a config written to a temp dir (`None`: the config file is missing),
/// extra flags, and what the error line must mention.
struct BadInput {
    name: &'static str,
    config: Option<&'static str>,
    args: &'static [&'static str],
    mentions: &'static [&'static str],
}

/// A valid small workload the bad cases below add one mistake to.
const OK_WORKLOAD: &str = "[workload]\nnum_requests = 5\n[workload.lengths]\nkind = \"fixed\"\n";

const BAD_INPUTS: &[BadInput] = &[
    BadInput {
        name: "unknown policy in config",
        config: Some("[scheduler]\npolicy = \"sjf\"\n"),
        args: &[],
        mentions: &["policy", "`sjf`"],
    },
    BadInput {
        name: "unknown policy in sweep",
        config: Some("[sweep]\npolicies = [\"pascal\", \"lottery\"]\nrates = [1.0]\n"),
        args: &[],
        mentions: &["policy", "`lottery`"],
    },
    BadInput {
        name: "unknown instance policy in a pair",
        config: Some("[scheduler]\npolicy = \"fcfs+hottest\"\n"),
        args: &[],
        mentions: &["instance policy", "`hottest`"],
    },
    BadInput {
        name: "unknown policy flag",
        config: Some(OK_WORKLOAD),
        args: &["--policy", "nope"],
        mentions: &["policy", "`nope`"],
    },
    BadInput { name: "negative rate flag", config: Some(OK_WORKLOAD), args: &["--rate=-1"], mentions: &["rate", "-1"] },
    BadInput {
        name: "zero rate flag",
        config: Some(OK_WORKLOAD),
        args: &["--rate", "0"],
        mentions: &["rate", "got 0"],
    },
    BadInput { name: "NaN rate flag", config: Some(OK_WORKLOAD), args: &["--rate", "NaN"], mentions: &["rate", "NaN"] },
    BadInput {
        name: "negative rate in sweep",
        config: Some("[sweep]\npolicies = [\"pascal\"]\nrates = [2.0, -1.0]\n"),
        args: &[],
        mentions: &["sweep.rates", "-1"],
    },
    BadInput {
        name: "zero seeds",
        config: Some(OK_WORKLOAD),
        args: &["--seeds", "0"],
        mentions: &["--seeds", "got 0"],
    },
    BadInput {
        name: "zero seeds in sweep",
        config: Some("[sweep]\npolicies = [\"pascal\"]\nseeds = 0\n"),
        args: &[],
        mentions: &["sweep.seeds", "got 0"],
    },
    BadInput {
        name: "zero capacity factor",
        config: Some(OK_WORKLOAD),
        args: &["--around-capacity", "1,0"],
        mentions: &["--around-capacity", "got 0"],
    },
    BadInput {
        name: "a request larger than the KV memory",
        config: Some("[cluster]\nkv_cache_gb = 0.01\n[workload]\nnum_requests = 5\n[workload.lengths]\nkind = \"fixed\"\nprompt_tokens = 4000\n"),
        args: &["--capacity"],
        mentions: &["capacity"],
    },
    BadInput { name: "malformed --set", config: Some(OK_WORKLOAD), args: &["--set", "cluster.instances"], mentions: &["--set", "KEY=VALUE"] },
    BadInput { name: "missing config file", config: None, args: &[], mentions: &["cannot read config", "absent.toml"] },
    BadInput {
        name: "missing trace file",
        config: Some(
            "[workload]\nnum_requests = 5\n[workload.arrivals]\nkind = \"trace\"\n\
             [workload.lengths]\nkind = \"trace\"\npath = \"traces/missing-trace.csv\"\nformat = \"azure\"\n",
        ),
        args: &[],
        mentions: &["workload", "missing-trace.csv"],
    },
    BadInput {
        name: "malformed trace row",
        config: Some(
            "[workload]\nnum_requests = 5\n[workload.arrivals]\nkind = \"trace\"\n\
             [workload.lengths]\nkind = \"trace\"\npath = \"bad-trace.csv\"\nformat = \"azure\"\n",
        ),
        args: &[],
        mentions: &["bad-trace.csv:2", "TIMESTAMP"],
    },
    BadInput {
        name: "unknown field",
        config: Some("[cluster]\ninstances = 2\nbogus_gb = 1\n"),
        args: &[],
        mentions: &["`bogus_gb`", "line 3"],
    },
    BadInput { name: "unknown table", config: Some("[clutser]\ninstances = 2\n"), args: &[], mentions: &["`clutser`"] },
    BadInput {
        name: "arrow without a prefill pool",
        config: Some("[pd]\npolicy = \"arrow\"\n"),
        args: &[],
        mentions: &["pd.policy", "pd.prefill_instances"],
    },
    BadInput {
        name: "arrow: l_shrink above l_expand",
        config: Some("[cluster]\ninstances = 4\n[pd]\nprefill_instances = 2\npolicy = \"arrow\"\n[pd.arrow]\nl_shrink = 0.95\n"),
        args: &[],
        mentions: &["[pd.arrow]", "l_shrink", "l_expand"],
    },
    BadInput {
        name: "arrow: negative cooldown",
        config: Some("[cluster]\ninstances = 4\n[pd]\nprefill_instances = 2\npolicy = \"arrow\"\n[pd.arrow]\ncooldown_s = -1\n"),
        args: &[],
        mentions: &["cooldown_s", "-1"],
    },
    BadInput {
        name: "arrow: unknown knob",
        config: Some("[cluster]\ninstances = 4\n[pd]\nprefill_instances = 2\npolicy = \"arrow\"\n[pd.arrow]\ncool_down = 1\n"),
        args: &[],
        mentions: &["`cool_down`"],
    },
    BadInput {
        name: "unknown pd policy",
        config: Some("[cluster]\ninstances = 4\n[pd]\nprefill_instances = 2\npolicy = \"flippy\"\n"),
        args: &[],
        mentions: &["`flippy`"],
    },
    BadInput {
        name: "unknown model",
        config: Some("[cluster]\nmodel = \"gpt-9\"\n"),
        args: &[],
        mentions: &["cluster.model", "`gpt-9`"],
    },
    BadInput {
        name: "unknown gpu",
        config: Some("[cluster]\ngpu = \"tpu-v9\"\n"),
        args: &[],
        mentions: &["cluster.gpu", "tpu-v9"],
    },
    BadInput {
        name: "TOML syntax error",
        config: Some("[cluster]\ninstances = [\n"),
        args: &[],
        mentions: &["invalid config", "line 2"],
    },
    BadInput {
        name: "zero quantum",
        config: Some("[scheduler.intra]\nquantum_tokens = 0\n"),
        args: &[],
        mentions: &["scheduler.intra", "quantum_tokens"],
    },
    BadInput {
        name: "KV cache of a billion GB",
        config: Some("[cluster]\nkv_cache_gb = 1e9\n"),
        args: &[],
        mentions: &["cluster.kv_cache_gb", "one pool may hold"],
    },
    BadInput {
        name: "CPU pool of a billion GB",
        config: Some("[cluster]\ncpu_swap_gb = 1e9\n"),
        args: &[],
        mentions: &["cluster.cpu_swap_gb", "one pool may hold"],
    },
    BadInput {
        name: "model whose KV bytes per token overflow",
        config: Some("[cluster]\nmodel = \"huge-model.toml\"\n"),
        args: &[],
        mentions: &["cluster.model", "`layers` must be in 1..=4096"],
    },
    BadInput {
        name: "GPU of 1e-9 TFLOP/s",
        config: Some("[cluster]\ngpu = \"slow-gpu.toml\"\ntiming = \"analytic\"\n"),
        args: &[],
        mentions: &["cluster.gpu", "`bf16_tflops` must be in"],
    },
    BadInput {
        name: "Mooncake row with an absurd timestamp",
        config: Some(
            "[workload]\nnum_requests = 5\n[workload.arrivals]\nkind = \"trace\"\n\
             [workload.lengths]\nkind = \"trace\"\npath = \"bad-mooncake.jsonl\"\nformat = \"mooncake\"\n",
        ),
        args: &[],
        mentions: &["bad-mooncake.jsonl:2", "timestamp"],
    },
    BadInput {
        name: "kvfleet row whose prompt + output reach 2^32",
        config: Some(
            "[workload]\nnum_requests = 5\n[workload.arrivals]\nkind = \"trace\"\n\
             [workload.lengths]\nkind = \"trace\"\npath = \"long.csv\"\nformat = \"kvfleet\"\n",
        ),
        args: &[],
        mentions: &["long.csv:3", "one request may hold"],
    },
    BadInput {
        name: "goodput search without a TTFT SLO",
        config: Some("[sweep]\npolicies = [\"fcfs\"]\n[sweep.goodput]\ntarget = 0.9\n"),
        args: &[],
        mentions: &["sweep.goodput", "ttft_s"],
    },
    BadInput {
        name: "goodput target out of range",
        config: Some("[slo]\nttft_s = 1.0\n[sweep]\npolicies = [\"fcfs\"]\n[sweep.goodput]\ntarget = 1.5\n"),
        args: &[],
        mentions: &["sweep.goodput.target", "1.5"],
    },
    BadInput {
        name: "goodput baseline that is no setup",
        config: Some("[slo]\nttft_s = 1.0\n[sweep]\npolicies = [\"fcfs\"]\n[sweep.goodput]\nbaseline = \"rr\"\n"),
        args: &[],
        mentions: &["sweep.goodput.baseline", "`rr`"],
    },
    BadInput {
        name: "decode tensor-parallel degree without a decode pool",
        config: Some("[cluster]\ndecode_tensor_parallel_size = 2\ntiming = \"analytic\"\n"),
        args: &[],
        mentions: &["decode_tensor_parallel_size", "prefill_instances"],
    },
    BadInput {
        name: "overlapped handoffs without chunked prefill",
        config: Some("[pd]\nprefill_instances = 1\noverlap = \"chunk\"\n"),
        args: &[],
        mentions: &["pd.overlap", "chunked_prefill_tokens"],
    },
    BadInput {
        name: "overlapped handoffs without disaggregation",
        config: Some("[scheduler.intra]\nchunked_prefill_tokens = 256\n[pd]\noverlap = \"chunk\"\n"),
        args: &[],
        mentions: &["pd.overlap", "prefill_instances"],
    },
    BadInput {
        name: "layer-by-layer handoffs without disaggregation",
        config: Some("[pd]\noverlap = \"layer\"\n"),
        args: &[],
        mentions: &["pd.overlap", "prefill_instances"],
    },
    BadInput {
        name: "an overlap mode that does not exist",
        config: Some("[pd]\nprefill_instances = 1\noverlap = \"layers\"\n"),
        args: &[],
        mentions: &["overlap", "layers"],
    },
    BadInput {
        name: "zero chunked prefill",
        config: Some("[scheduler.intra]\nchunked_prefill_tokens = 0\n"),
        args: &[],
        mentions: &["chunked_prefill_tokens"],
    },
    BadInput {
        name: "zero requests flag",
        config: Some(OK_WORKLOAD),
        args: &["--requests", "0"],
        mentions: &["num_requests"],
    },
];

/// Runs one bad invocation in a fresh temp dir and checks the refusal.
fn assert_refused(case: &BadInput) {
    let dir = TempDir::new("bad-input");
    dir.write("bad-trace.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,5\n");
    dir.write(
        "huge-model.toml",
        "name = \"huge\"\nlayers = 4294967295\nhidden = 5120\nq_heads = 40\nkv_heads = 8\nhead_dim = 128\n\
         intermediate = 27648\nvocab = 152064\ndtype_bytes = 2\n",
    );
    dir.write(
        "slow-gpu.toml",
        "name = \"slow\"\nmemory_gb = 96\nbf16_tflops = 1e-9\nhbm_tbytes_per_s = 3.35\nhost_link_gbytes_per_s = 53.7\n",
    );
    dir.write(
        "bad-mooncake.jsonl",
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5}\n\
         {\"timestamp\": 1e300, \"input_length\": 10, \"output_length\": 5}\n",
    );
    dir.write("long.csv", "arrival_s,prompt_tokens,reasoning_tokens,answer_tokens\n0,100,10,10\n1,4294967295,0,1\n");
    let config = match case.config {
        Some(text) => dir.write("config.toml", text),
        None => dir.join("absent.toml"),
    };
    let out_dir = dir.join("out");
    let mut args = vec!["sim", "--config", path_str(&config), "--out", path_str(&out_dir), "-q"];
    args.extend(case.args);
    let out = run_kvfleet(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let context = format!("case `{}`: {}", case.name, describe(&out));
    assert_eq!(out.status.code(), Some(2), "{context}");
    assert_eq!(stderr.lines().count(), 1, "want exactly one stderr line; {context}");
    assert!(stderr.starts_with("error: "), "{context}");
    for want in case.mentions {
        assert!(stderr.contains(want), "stderr should mention {want:?}; {context}");
    }
    assert!(out.stdout.is_empty(), "nothing on stdout for invalid input; {context}");
    assert!(!out_dir.exists(), "invalid input must not create the output directory; {context}");
}

#[test]
fn invalid_input_exits_2_with_one_line_naming_the_problem() {
    for case in BAD_INPUTS {
        assert_refused(case);
    }
}

/// A `[pd]` split `kvfleet up` cannot run (no decode instance left) is refused in one line naming
/// the field, before anything starts.
#[test]
fn up_refuses_a_prefill_decode_split_without_decoders() {
    let dir = TempDir::new("up-pd");
    let config = dir.write("pd.toml", "[cluster]\ninstances = 2\n[pd]\nprefill_instances = 2\n");
    let out = run_kvfleet(["up", "--config", path_str(&config), "--no-etcd", "-q"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    assert_eq!(stderr.lines().count(), 1, "{}", describe(&out));
    assert!(stderr.contains("pd.prefill_instances"), "{}", describe(&out));
}

/// `kvfleet up --kv-memory SIZE` fails in one line naming the flag and `why`, exit status 2.
fn assert_up_refuses_kv_memory(size: &str, why: &str) {
    let out = run_kvfleet(["up", "--kv-memory", size, "--no-etcd", "-q"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    assert_eq!(stderr.lines().count(), 1, "{}", describe(&out));
    assert!(stderr.contains(&format!("--kv-memory {size}")) && stderr.contains(why), "{}", describe(&out));
}

/// `--kv-memory` too small for one KV block is refused by `kvfleet up` in one line before any
/// process starts (each worker would otherwise fail at start-up, exit status 1).
#[test]
fn up_refuses_a_kv_arena_that_holds_no_block() {
    assert_up_refuses_kv_memory("0", "no KV block");
}

/// An arena larger than the host's memory is refused in one line before any process starts (each
/// worker's mmap would fail: exit status 1, one error per worker).
#[test]
fn up_refuses_a_kv_arena_larger_than_the_host() {
    assert_up_refuses_kv_memory("64TiB", "this host's memory");
}

/// `kvfleet up`'s own flags, absurd: one line naming the flag, exit status 2, before any process
/// starts (were: `--coordinators 1000` started a thousand coordinators, `--stall-timeout-s 0` gave
/// up on every request at once, `--otlp-endpoint` was refused by each child in turn, negative
/// times were taken for unknown flags).
#[test]
fn up_refuses_absurd_run_flags_in_one_line() {
    let cases: [(&[&str], &str); 8] = [
        (&["--coordinators", "0"], "--coordinators must be in 1..="),
        (&["--coordinators", "1000"], "--coordinators must be in 1..="),
        (&["--stall-timeout-s", "0"], "--stall-timeout-s must be a positive number of seconds, got 0"),
        (&["--pause-worker-after-s", "1", "--pause-for-s", "-1"], "--pause-for-s must be a positive"),
        (&["--kill-worker-after-s", "-3"], "--kill-worker-after-s must be a number of seconds ≥ 0, got -3"),
        (&["--chaos", "1", "--chaos-faults", "100000"], "--chaos-faults must be at most"),
        (&["--otlp-endpoint", "notaurl"], "--otlp-endpoint \"notaurl\": expected an http:// or https:// URL"),
        (&["--link-latency-us", "-5"], "--link-latency-us must be ≥ 0, got -5"),
    ];
    for (flags, want) in cases {
        let mut args = vec!["up", "--no-etcd", "-q"];
        args.extend_from_slice(flags);
        let out = run_kvfleet(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {}", describe(&out));
        assert_eq!(stderr.lines().count(), 1, "{flags:?}: {}", describe(&out));
        assert!(stderr.contains(want), "{flags:?}: {}", describe(&out));
    }
}

/// The worker and coordinator binaries, given a flag whose value cannot work: one error line
/// naming it, exit status 2, at once (a malformed etcd endpoint was retried for a minute as an
/// unreachable etcd; a bad OTLP URL or model ended the coordinator with exit 1 and a backtrace).
#[test]
fn worker_and_coordinator_refuse_unusable_flags_with_exit_2() {
    let cases: [(&str, &[&str], &str); 6] = [
        ("kvfleet-worker", &["--etcd", "notaurl"], "`notaurl` is not HOST:PORT"),
        ("kvfleet-worker", &["--otlp-endpoint", "nope"], "--otlp-endpoint \"nope\""),
        ("kvfleet-worker", &["--link-gbps", "0"], "`--link-gbps`: must be a positive number"),
        ("kvfleet-coordinator", &["--etcd", "etcd"], "`etcd` is not HOST:PORT"),
        ("kvfleet-coordinator", &["--otlp-endpoint", "nope"], "--otlp-endpoint \"nope\""),
        ("kvfleet-coordinator", &["--model", "gpt-9"], "unknown model `gpt-9`"),
    ];
    for (bin, flags, want) in cases {
        let out = std::process::Command::new(kvfleet_tests::workspace_bin(bin))
            .arg("--plaintext")
            .args(flags)
            .output()
            .expect("the binary runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bin} {flags:?}: {}", describe(&out));
        let last = stderr.lines().last().unwrap_or_default();
        assert!(
            last.starts_with(&format!("{bin}: error: ")) && last.contains(want),
            "{bin} {flags:?}: {}",
            describe(&out)
        );
    }
}

/// A coordinator address nobody answers at: `kvfleet replay` says it waits (not silent for its
/// whole `--wait-s`), then, like `kvfleet status`, names the address, exit status 2; and
/// `bench workers` refuses a count of 0 (it printed a row of NaN).
#[test]
fn replay_and_status_name_a_dead_coordinator_and_bench_workers_refuses_zero() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().expect("bound").to_string()
    };
    let dir = TempDir::new("replay-dead");
    let out_dir = dir.join("out");
    let replay = ["replay", "--coordinators", &dead, "--plaintext", "--requests", "2", "--wait-s", "12", "-q"];
    let out = run_kvfleet(replay.iter().copied().chain(["--out", path_str(&out_dir)]));
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("waiting     for a leader among [\"{dead}\"] (10 s of --wait-s 12)")),
        "{}",
        describe(&out)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    assert!(last.starts_with(&format!("error: no leader among [\"{dead}\"] within 12 s")), "{}", describe(&out));

    let out = run_kvfleet(["status", "--coordinator", &dead, "--plaintext"]);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("no leader among [\"{dead}\"]")),
        "{}",
        describe(&out)
    );

    let out = run_kvfleet(["bench", "workers", "--counts", "8,0"]);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--counts: each count must be in 1..="),
        "{}",
        describe(&out)
    );
}

/// An absurd but valid rate runs and names its files compactly (`1e308`: the plain expansion of
/// 309 digits made the file name too long to create).
#[test]
fn an_absurd_rate_names_its_files_compactly() {
    let dir = TempDir::new("absurd-rate");
    let out_dir = dir.join("out");
    let config = dir.write("w.toml", OK_WORKLOAD);
    sim(&[
        "--config",
        path_str(&config),
        "--rate",
        "1e308",
        "--requests",
        "20",
        "--no-plots",
        "-q",
        "--out",
        path_str(&out_dir),
    ]);
    let names: Vec<String> = std::fs::read_dir(&out_dir)
        .expect("output written")
        .map(|e| e.expect("readable").file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().any(|n| n.starts_with("requests-") && n.ends_with("-1e308.csv")), "{names:?}");
}

/// `--rate -1` (the value as a separate word) is the natural spelling; it must be refused the same
/// way as `--rate=-1`, naming the rate.
#[test]
fn negative_rate_as_separate_word_is_refused_naming_the_rate() {
    assert_refused(&BadInput {
        name: "--rate -1",
        config: Some(OK_WORKLOAD),
        args: &["--rate", "-1"],
        mentions: &["rate", "-1"],
    });
}

// ---------------------------------------------------------------------------------------------
// Determinism.

/// The small sweep with fewer requests: enough for every output kind, fast to run repeatedly.
fn small_sweep_into(out_dir: &Path, extra: &[&str]) {
    let config = fixture("small-sweep.toml");
    let mut args = vec!["--config", path_str(&config), "--requests", "100", "--out", path_str(out_dir), "-q"];
    args.extend(extra);
    sim(&args);
}

#[test]
fn same_config_and_seed_give_byte_identical_files() {
    let tmp = TempDir::new("determinism");
    let (a, b, c, d) = (tmp.join("a"), tmp.join("b"), tmp.join("c"), tmp.join("d"));
    // Different thread counts too: runs finish in a different order, the files must not care.
    small_sweep_into(&a, &["--no-plots", "-j", "1"]);
    small_sweep_into(&b, &["--no-plots", "-j", "2"]);
    small_sweep_into(&c, &["-j", "2"]);
    small_sweep_into(&d, &["-j", "1"]);
    let (a, b, c, d) = (read_dir_files(&a), read_dir_files(&b), read_dir_files(&c), read_dir_files(&d));

    assert!(a.len() >= 6, "results.json, summary.csv and 4 request CSVs at least: {:?}", a.keys());
    assert!(!a.keys().any(|n| n.ends_with(".svg")), "--no-plots drew plots: {:?}", a.keys());
    for (x, y, what) in [(&a, &b, "without plots"), (&c, &d, "with plots")] {
        assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>(), "file sets differ {what}");
        for (name, bytes) in x {
            assert!(bytes == &y[name], "{name} differs between two identical runs {what}");
        }
    }
    // Plots add files and change none of the others.
    let svgs: Vec<&String> = c.keys().filter(|n| n.ends_with(".svg")).collect();
    assert!(!svgs.is_empty(), "no plots drawn: {:?}", c.keys());
    let c_data: Vec<&String> = c.keys().filter(|n| !n.ends_with(".svg")).collect();
    assert_eq!(c_data, a.keys().collect::<Vec<_>>(), "drawing plots changed the set of data files");
    for (name, bytes) in &a {
        assert!(bytes == &c[name], "{name} differs between runs with and without plots");
    }
}

#[test]
fn a_different_seed_changes_every_request_log() {
    let tmp = TempDir::new("seed");
    let (a, b) = (tmp.join("a"), tmp.join("b"));
    small_sweep_into(&a, &["--no-plots"]);
    small_sweep_into(&b, &["--no-plots", "--seed", "12"]);
    let (a, b) = (read_dir_files(&a), read_dir_files(&b));
    let requests: Vec<&String> = a.keys().filter(|n| n.starts_with("requests-")).collect();
    assert_eq!(requests.len(), 4, "{:?}", a.keys());
    for name in requests {
        let other = b.get(name).unwrap_or_else(|| panic!("{name} missing with --seed 12"));
        assert!(&a[name] != other, "{name} is the same for seeds 11 and 12");
    }
}

// ---------------------------------------------------------------------------------------------
// A sweep and its outputs.

#[test]
fn small_sweep_writes_every_output_and_finishes_every_request() {
    const REQUESTS: u64 = 200;
    let tmp = TempDir::new("sweep");
    let out_dir = tmp.join("out");
    let config = fixture("small-sweep.toml");
    let out = sim(&["--config", path_str(&config), "--out", path_str(&out_dir), "-q"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let files = read_dir_files(&out_dir);
    assert!(stdout.contains("4 run(s)"), "{stdout}");
    assert!(stdout.contains(&format!("wrote {} files to ", files.len())), "{stdout}\nfiles: {:?}", files.keys());

    // summary.csv: a header and one row per (policy, rate), rates outermost as in the config.
    let summary = Csv::read(&out_dir.join("summary.csv"));
    assert_eq!(
        &summary.header[..7],
        ["policy", "intra", "instance_policy", "rate", "seed", "timing", "requests_total"]
    );
    let points: Vec<(&str, &str)> = summary.column("policy").into_iter().zip(summary.column("rate")).collect();
    assert_eq!(points, [("pascal", "1"), ("fcfs", "1"), ("pascal", "2.5"), ("fcfs", "2.5")]);
    assert_eq!(summary.column("instance_policy"), ["pascal", "least-kv", "pascal", "least-kv"]);
    assert_eq!(summary.counts("requests_total"), [REQUESTS; 4]);
    assert_eq!(summary.counts("requests_finished"), [REQUESTS; 4], "every request finishes");
    assert_eq!(summary.counts("requests_rejected"), [0; 4]);
    // The KV cap is there so memory matters: at the higher rate both policies preempt.
    let preemptions = summary.counts("preemptions_total");
    assert!(preemptions[2] > 0 && preemptions[3] > 0, "no preemption under a 3 GB KV cap: {preemptions:?}");
    assert_eq!(summary.counts("migrations_total")[1], 0, "fcfs (least-kv placement) never migrates");

    // results.json: the same four runs, same order.
    let json: serde_json::Value = serde_json::from_slice(&files["results.json"]).expect("results.json parses");
    let runs = json.as_array().expect("results.json is an array of runs");
    assert_eq!(runs.len(), 4);
    for (run, (policy, rate)) in runs.iter().zip(&points) {
        assert_eq!(run["policy"], *policy);
        assert_eq!(run["rate"].as_f64(), Some(rate.parse::<f64>().unwrap()));
        assert_eq!(run["summary"]["requests_finished"].as_u64(), Some(REQUESTS));
        assert!(run["tail_ttft"].is_array(), "{run}");
    }

    // One per-request CSV per run, one row per request id, every one finished.
    for (policy, rate) in &points {
        let csv = Csv::read(&out_dir.join(format!("requests-{policy}-{rate}.csv")));
        let ids: BTreeSet<u64> = csv.counts("id").into_iter().collect();
        assert_eq!(csv.rows.len() as u64, REQUESTS, "{policy} @ {rate}");
        assert_eq!(ids, (0..REQUESTS).collect(), "{policy} @ {rate}: ids are not 0..{REQUESTS} once each");
        assert!(csv.column("rejected").iter().all(|v| *v == "false"), "{policy} @ {rate}");
        assert!(csv.column("finished_on").iter().all(|v| !v.is_empty()), "{policy} @ {rate}");
        assert!(csv.column("e2e_s").iter().all(|v| v.parse::<f64>().is_ok_and(|s| s > 0.0)), "{policy} @ {rate}");
    }

    // Plots: per rate, and across rates.
    for name in [
        "ttft_cdf-rate-1.svg",
        "ttft_cdf-rate-2.5.svg",
        "tail_ttft-rate-1.svg",
        "tail_ttft-rate-2.5.svg",
        "slo_violation_vs_rate.svg",
        "tail_ttft_p99_vs_rate.svg",
    ] {
        let svg = files.get(name).unwrap_or_else(|| panic!("plot {name} missing: {:?}", files.keys()));
        let text = String::from_utf8_lossy(svg);
        assert!(text.starts_with("<svg") && text.trim_end().ends_with("</svg>"), "{name} is not an SVG document");
        assert!(text.contains("pascal") && text.contains("fcfs"), "{name} lacks a legend entry per policy");
    }
}

#[test]
fn seeds_run_every_point_per_seed_and_compare_the_policies_over_them() {
    let tmp = TempDir::new("seeds");
    let out_dir = tmp.join("out");
    let config = fixture("small-sweep.toml");
    let out = sim(&["--config", path_str(&config), "--out", path_str(&out_dir), "-q", "--rate", "2.5", "--seeds", "3"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("6 run(s)"), "{stdout}");
    let summary = Csv::read(&out_dir.join("summary.csv"));
    let base: u64 = summary.counts("seed")[0];
    // Seeds outermost, then the sweep's policies.
    assert_eq!(summary.counts("seed"), [base, base, base + 1, base + 1, base + 2, base + 2]);
    let files = read_dir_files(&out_dir);
    for seed in base..base + 3 {
        assert!(files.contains_key(&format!("requests-pascal-2.5-seed{seed}.csv")), "{:?}", files.keys());
    }
    // pascal against fcfs at 2.5 req/s over the three seeds, in the text, JSON and CSV.
    let json: serde_json::Value = serde_json::from_slice(&files["comparison.json"]).expect("comparison.json parses");
    assert_eq!(json["subject"], "pascal");
    assert_eq!(json["seeds"], 3);
    let row = &json["tail"][0];
    assert_eq!((row["baseline"].as_str(), row["seeds"].as_u64()), (Some("fcfs"), Some(3)));
    let (min, mean, max) = (
        row["max_reduction"]["min"].as_f64(),
        row["max_reduction"]["mean"].as_f64(),
        row["max_reduction"]["max"].as_f64(),
    );
    assert!(min <= mean && mean <= max && min.is_some(), "{row}");
    let text = String::from_utf8_lossy(&files["comparison.txt"]);
    assert!(text.contains("over 3 seeds") && stdout.contains("over 3 seeds"), "{text}");
    assert_eq!(String::from_utf8_lossy(&files["comparison.csv"]).lines().count(), 2);
}

#[test]
fn the_capacity_finder_centres_a_sweep_on_the_capacity_rate() {
    let tmp = TempDir::new("capacity");
    let config = fixture("small-sweep.toml");
    let out = sim(&["--config", path_str(&config), "--capacity"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let rate: f64 = stdout
        .strip_prefix("capacity")
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no capacity rate in: {stdout}"));
    assert!(rate > 0.0 && rate.is_finite(), "{stdout}");
    assert!(!tmp.join("out").exists());
    // Around it: the sweep's rates become factor × capacity, rounded to 2 decimals.
    let out_dir = tmp.join("out");
    let out = sim(&[
        "--config",
        path_str(&config),
        "--out",
        path_str(&out_dir),
        "-q",
        "--no-plots",
        "--policy",
        "fcfs",
        "--requests",
        "60",
        "--around-capacity",
        "0.5,1",
        "--set",
        "scheduler.intra.boundary_hold=true",
    ]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("2 run(s)"));
    let summary = Csv::read(&out_dir.join("summary.csv"));
    let rates: Vec<f64> = summary.column("rate").iter().map(|r| r.parse().unwrap()).collect();
    let want = |f: f64| (f * rate * 100.0).round() / 100.0;
    assert_eq!(rates, [want(0.5), want(1.0)], "capacity {rate}");
    // Far below the capacity nothing is preempted: the run says the sweep missed the edge.
    let out = sim(&[
        "--config",
        path_str(&config),
        "--out",
        path_str(&tmp.join("low")),
        "-q",
        "--no-plots",
        "--policy",
        "fcfs",
        "--requests",
        "30",
        "--around-capacity",
        "0.1",
    ]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("no memory pressure"), "{}", describe(&out));
}

// ---------------------------------------------------------------------------------------------
// Trace-driven workload.

#[test]
fn azure_code_trace_replays_its_arrivals_and_lengths() {
    const REQUESTS: u64 = 300;
    let tmp = TempDir::new("trace");
    let out_dir = tmp.join("out");
    let config = fixture("azure-code-trace.toml");
    sim(&["--config", path_str(&config), "--out", path_str(&out_dir), "-q", "--no-plots"]);

    let summary = Csv::read(&out_dir.join("summary.csv"));
    assert_eq!(summary.rows.len(), 1);
    assert_eq!(summary.column("rate"), [""], "a trace run has no arrival rate");
    assert_eq!(summary.counts("requests_total"), [REQUESTS]);
    assert_eq!(summary.counts("requests_finished"), [REQUESTS], "every request finishes");

    let csv = Csv::read(&out_dir.join("requests-pascal-trace.csv"));
    assert_eq!(csv.rows.len() as u64, REQUESTS);
    // The first rows of data/traces/AzureLLMInferenceTrace_code.csv:
    //   2023-11-16 18:17:03.9799600,4808,10
    //   2023-11-16 18:17:04.0319600,3180,8
    // arrivals start at zero and keep the trace's gaps; output = reasoning + answer.
    let arrival = csv.column("arrival_s");
    let prompt = csv.counts("prompt_tokens");
    let output: Vec<u64> =
        csv.counts("reasoning_tokens").iter().zip(csv.counts("answer_tokens")).map(|(r, a)| r + a).collect();
    assert_eq!((arrival[0], prompt[0], output[0]), ("0.000000", 4808, 10));
    assert_eq!((arrival[1], prompt[1], output[1]), ("0.052000", 3180, 8));
    let arrivals: Vec<f64> = arrival.iter().map(|v| v.parse().expect("arrival_s is a number")).collect();
    assert!(arrivals.windows(2).all(|w| w[0] <= w[1]), "trace arrivals are in order");
}

/// `[sweep.goodput]`: each setup's goodput is bracketed where it was measured (the rate reported
/// met the target, one within `rel_tol` above it did not), the ratio to the baseline is the
/// quotient of the two, and the search is the same run after run.
#[test]
fn a_goodput_search_brackets_each_setup_and_divides_by_the_baseline() {
    let dir = TempDir::new("goodput");
    let config = dir.write(
        "goodput.toml",
        "[cluster]\ninstances = 2\nmodel = \"qwen3-8b\"\ngpu = \"h20-141gb\"\n\
         [slo]\nttft_s = 1.0\ntpot_s = 0.1\n\
         [workload]\nseed = 2\nnum_requests = 120\n[workload.arrivals]\nkind = \"poisson\"\nrate = 4.0\n\
         [workload.lengths]\nkind = \"lognormal\"\nprompt_median = 2000.0\nprompt_sigma = 0.5\n\
         reasoning_median = 1.0\nreasoning_sigma = 0.0\nanswer_median = 60.0\nanswer_sigma = 0.3\n\
         [sweep]\npolicies = [\"fcfs+least-kv\", \"fcfs+round-robin\"]\n\
         [sweep.goodput]\ntarget = 0.8\nrel_tol = 0.05\noctaves = 4\nbaseline = \"fcfs+round-robin\"\n",
    );
    let (a, b) = (dir.join("a"), dir.join("b"));
    for out in [&a, &b] {
        let printed = sim(&["--config", path_str(&config), "--out", path_str(out), "-q"]);
        let text = String::from_utf8_lossy(&printed.stdout);
        assert!(text.contains("goodput req/s") && text.contains("÷ fcfs+round-robin"), "{text}");
    }
    let json = std::fs::read_to_string(a.join("goodput.json")).unwrap();
    assert_eq!(json, std::fs::read_to_string(b.join("goodput.json")).unwrap(), "deterministic");
    let found: serde_json::Value = serde_json::from_str(&json).unwrap();
    let setups = found.as_array().unwrap();
    assert_eq!(setups.len(), 2);
    let mut goodputs = Vec::new();
    for s in setups {
        let rate = s["goodput_rps"].as_f64().expect("each setup meets 80 % somewhere in the grid");
        let base = s["base_rate_rps"].as_f64().unwrap();
        let probes = s["probes"].as_array().unwrap();
        let at = |scale: f64| probes.iter().find(|p| (p["scale"].as_f64().unwrap() - scale).abs() < 1e-12);
        let scale = rate / base;
        assert!(at(scale).unwrap()["attainment"].as_f64().unwrap() >= 0.8, "{s}");
        // The lowest failing scale above it is within the tolerance.
        let above = probes
            .iter()
            .filter(|p| p["scale"].as_f64().unwrap() > scale && p["attainment"].as_f64().unwrap() < 0.8)
            .map(|p| p["scale"].as_f64().unwrap())
            .fold(f64::INFINITY, f64::min);
        assert!(above / scale - 1.0 <= 0.05 + 1e-9, "{s}");
        goodputs.push((s["setup"].as_str().unwrap().to_string(), rate, s["ratio_to_baseline"].as_f64().unwrap()));
    }
    let baseline = goodputs.iter().find(|g| g.0 == "fcfs+round-robin").unwrap().1;
    for (name, rate, ratio) in &goodputs {
        assert!((ratio - rate / baseline).abs() < 1e-9, "{name}: {ratio} vs {rate} / {baseline}");
    }
    let csv = Csv::read(&a.join("goodput.csv"));
    assert_eq!(csv.rows.len(), setups.iter().map(|s| s["probes"].as_array().unwrap().len()).sum::<usize>());
}

#[test]
fn bench_sim_compares_leaping_with_stepping_in_one_run() {
    let out = run_kvfleet(["bench", "sim", "--instances", "16", "--duration-s", "60", "--mode", "both"].iter());
    assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("results identical"), "{text}");
    let handled: Vec<u64> = text
        .lines()
        .find(|l| l.trim_start().starts_with("events handled"))
        .unwrap_or_else(|| panic!("{text}"))
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    // Leaping handles fewer events than stepping, which handles every one.
    assert!(matches!(handled[..], [leap, step] if leap < step), "{text}");
    let refused = run_kvfleet(["bench", "sim", "--mode", "sideways"].iter());
    assert_eq!(refused.status.code(), Some(2), "{}", describe(&refused));
}

/// `kvfleet bench handoff --sim-only`: each length one-shot, overlapped by chunk and by layer; at
/// 16k tokens both overlapped handoffs expose under 0.3× the one-shot's time after the first token
/// at 100 Gbit/s (met), by layer less than by chunk; with whole prompts (no chunks) by layer
/// exposes its last layer group, a quarter; at 2 Gbit/s the link cannot keep up with the prefill
/// (NOT met, with the shortfall); `handoff.csv` holds a row per handoff; a rate of 0 is refused.
#[test]
fn bench_handoff_prints_the_exposed_time_ratio_and_its_verdict() {
    let tmp = TempDir::new("bench-handoff");
    let run = |gbps: &str, chunks: &str| {
        let out_dir = tmp.join(&format!("out-{gbps}-{chunks}"));
        let args = ["bench", "handoff", "--sim-only", "--lengths", "4096,16384", "--link-gbps", gbps];
        let args = args.iter().copied().chain(["--chunk-tokens", chunks, "--out", path_str(&out_dir)]);
        let out = run_kvfleet(args);
        (out, out_dir)
    };
    // The ratios at 16k tokens, in the order printed (by chunk, then by layer).
    let ratios = |text: &str| -> Vec<f64> {
        let lines = text.lines().filter(|l| l.trim_start().starts_with("16384 tokens:"));
        lines.map(|l| l.rsplit(' ').next().and_then(|r| r.parse().ok()).unwrap_or_else(|| panic!("{text}"))).collect()
    };
    let (fast, out_dir) = run("100", "2048");
    assert_eq!(fast.status.code(), Some(0), "{}", describe(&fast));
    let text = String::from_utf8_lossy(&fast.stdout);
    let [by_chunk, by_layer] = ratios(&text)[..] else { panic!("{text}") };
    assert!(by_chunk > 0.0 && by_chunk <= 0.3, "{text}");
    assert!(by_layer > 0.0 && by_layer < by_chunk, "layer slices of each chunk expose less: {text}");
    assert!(text.contains("target met"), "{text}");
    let csv = Csv::read(&out_dir.join("handoff.csv"));
    assert_eq!(csv.rows.len(), 6, "two lengths, three modes");
    // Whole prompts: no chunk-level overlap; by layer, the last of 4 layer groups is exposed.
    let (whole, _) = run("100", "0");
    let text = String::from_utf8_lossy(&whole.stdout);
    let [by_layer] = ratios(&text)[..] else { panic!("{text}") };
    assert!((0.2..=0.3).contains(&by_layer), "a quarter and the latency: {text}");
    let (slow, _) = run("2", "2048");
    assert_eq!(slow.status.code(), Some(0), "{}", describe(&slow));
    assert!(String::from_utf8_lossy(&slow.stdout).contains("target NOT met"), "{}", describe(&slow));
    let (refused, _) = run("0", "2048");
    assert_eq!(refused.status.code(), Some(2), "{}", describe(&refused));
}

/// `kvfleet bench handoff` between two real worker processes (QUIC, mutual TLS, links shaped to
/// 10 Gbit/s, time dilated 4×), an 8k-token prompt prefilled whole: the handoff that follows the
/// prefill layer by layer moves exactly the one-shot handoff's bytes, sends slices in live stages
/// while the prefill runs (the one-shot one copies it all after), and exposes less after the
/// first token.
#[test]
fn bench_handoff_between_worker_processes_sends_layer_groups_during_the_prefill() {
    let tmp = TempDir::new("bench-handoff-emu");
    let out_dir = tmp.join("out");
    let args = ["bench", "handoff", "--lengths", "8192", "--chunk-tokens", "0", "--link-gbps", "10"];
    let args = args.iter().copied().chain(["--time-dilation", "4", "--out", path_str(&out_dir)]);
    let out = run_kvfleet(args);
    assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
    let csv = Csv::read(&out_dir.join("handoff.csv"));
    let col = |name: &str| csv.header.iter().position(|h| h == name).unwrap_or_else(|| panic!("no {name} column"));
    let row = |mode: &str| csv.rows.iter().find(|r| r[col("mode")] == mode).unwrap_or_else(|| panic!("no {mode} row"));
    let (one, layered) = (row("one-shot"), row("by layer"));
    let num = |r: &Vec<String>, name: &str| -> f64 { r[col(name)].parse().unwrap_or_else(|_| panic!("{name}: {r:?}")) };
    assert_eq!(num(one, "emu_bytes"), num(layered, "emu_bytes"), "the same KV moves");
    assert!(num(layered, "emu_live_stages") >= 2.0, "slices left during the prefill: {layered:?}");
    assert!(
        num(layered, "emu_exposed_ms") < 0.75 * num(one, "emu_exposed_ms"),
        "by layer {layered:?} vs one-shot {one:?}"
    );
}

/// `RUST_LOG=kvfleet::decisions=debug` makes `kvfleet sim` log every placement the controller
/// makes, with the loads it saw (the leader of `kvfleet up` logs the same lines): one per request,
/// in arrival order. Without `RUST_LOG` it logs nothing.
#[test]
fn sim_logs_each_placement_with_its_loads_when_asked() {
    let tmp = TempDir::new("decisions");
    let config = tmp.write("c.toml", "[cluster]\ninstances = 3\n[workload]\nnum_requests = 6\n");
    let out_dir = tmp.join("out");
    let args = ["sim", "--config", path_str(&config), "--no-plots", "-q", "--out", path_str(&out_dir)];
    let bin = kvfleet_bin();
    let out = std::process::Command::new(&bin)
        .args(args)
        .env("RUST_LOG", "kvfleet::decisions=debug")
        .env_remove("NO_COLOR")
        .output()
        .expect("kvfleet sim");
    assert!(out.status.success(), "{}", describe(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let places: Vec<&str> = stderr.lines().filter(|l| l.contains("kind=\"place\"")).collect();
    assert_eq!(places.len(), 6, "{}", describe(&out));
    for (i, line) in places.iter().enumerate() {
        assert!(line.contains(&format!("request={i} ")), "arrival order: {line}");
        let loads = line.split("loads=").nth(1).expect("loads");
        assert_eq!(loads.split_whitespace().count(), 3, "one load per instance: {line}");
    }
    let quiet = std::process::Command::new(&bin).args(args).env_remove("RUST_LOG").output().expect("kvfleet sim");
    assert!(quiet.status.success() && quiet.stderr.is_empty(), "{}", describe(&quiet));
}
