//! `kvfleet up`: real processes (coordinators, workers, etcd when installed) on loopback.
//!
//! Every test checks that every submitted request completed exactly once and that no process
//! outlives the command (the pids `kvfleet up` wrote are all gone).

use kvfleet_tests::{describe, etcd_installed, process_alive, run_kvfleet, TempDir};
use std::path::Path;

/// Small, fast cluster arguments shared by the tests.
fn base_args(out: &Path, workers: u32, requests: u32) -> Vec<String> {
    [
        "up",
        "--workers",
        &workers.to_string(),
        "--requests",
        &requests.to_string(),
        "--rate",
        "8",
        "--kv-memory",
        "512MiB",
        "--cpu-memory",
        "512MiB",
        "--kv-fill",
        "stamp",
        "-q",
        "--out",
        out.to_str().expect("utf-8 temp path"),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn summary(out: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(out.join("results.json")).expect("results.json written");
    let runs: serde_json::Value = serde_json::from_str(&text).expect("results.json parses");
    runs[0]["summary"].clone()
}

/// Ids in the per-request CSV, which must be 0..n exactly once.
fn assert_each_request_once(out: &Path, n: u64) {
    let csv = kvfleet_tests::requests_csv(out);
    let text = std::fs::read_to_string(csv).expect("readable");
    let mut ids: Vec<u64> =
        text.lines().skip(1).map(|l| l.split(',').next().expect("id column").parse().expect("numeric id")).collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..n).collect::<Vec<_>>(), "every request exactly once");
}

fn assert_no_process_left(out: &Path) {
    let pids = std::fs::read_to_string(out.join("pids.txt")).expect("pids.txt written");
    for line in pids.lines() {
        let pid = line.split_whitespace().next().expect("pid");
        assert!(!process_alive(pid), "process left behind: {line}");
    }
}

/// The embedded store (one coordinator, no etcd), with a worker stopped (SIGSTOP) past its
/// registration's TTL: the coordinator re-places its requests; resumed, the worker's renewal is
/// refused (that registration is gone), so it drops its stale copies before it registers anew.
#[test]
fn up_with_the_embedded_store_runs_a_workload_end_to_end_past_a_paused_worker() {
    let tmp = TempDir::new("up-embedded");
    let out = tmp.join("out");
    let mut args = base_args(&out, 2, 24);
    args.extend(["--no-etcd", "--pause-worker-after-s", "1", "--pause-for-s", "5"].map(String::from));
    let o = run_kvfleet(&args);
    assert!(o.status.success(), "{}", describe(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("embedded store"), "says it runs the embedded store: {stdout}");
    assert!(stdout.contains("chaos: SIGCONT worker-0"), "{stdout}");
    let log = std::fs::read_to_string(out.join("logs/worker-0.log")).expect("worker-0's log");
    assert!(
        log.contains("registration gone") && log.contains("registration expired: dropped"),
        "worker-0 did not drop its stale copies on resuming:\n{log}"
    );
    let s = summary(&out);
    assert_eq!(s["requests_finished"], 24, "{s}");
    assert_eq!(s["requests_rejected"], 0, "{s}");
    assert_each_request_once(&out, 24);
    assert_no_process_left(&out);
}

/// `kvfleet up ARGS` started in the background, its output piped (`keep_output`) or dropped, and
/// its `pids.txt` once every process it starts is up.
fn up_in_background(args: &[String], out: &Path, keep_output: bool) -> (std::process::Child, String) {
    let stdio = || if keep_output { std::process::Stdio::piped() } else { std::process::Stdio::null() };
    let mut up = std::process::Command::new(kvfleet_tests::kvfleet_bin())
        .args(args)
        .stdout(stdio())
        .stderr(stdio())
        .spawn()
        .expect("kvfleet up starts");
    let pids = out.join("pids.txt");
    let started = std::time::Instant::now();
    while !pids.exists() {
        assert!(started.elapsed().as_secs() < 120, "kvfleet up did not start its processes in 120 s");
        assert!(up.try_wait().expect("waitable").is_none(), "kvfleet up exited before its processes were up");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    (up, std::fs::read_to_string(&pids).expect("pids.txt readable"))
}

/// `kvfleet up` killed with SIGKILL (no chance to clean up) takes every process it started with
/// it: they get SIGTERM when it dies (PR_SET_PDEATHSIG).
#[test]
fn a_killed_up_leaves_no_process_behind() {
    let tmp = TempDir::new("up-kill9");
    let out = tmp.join("out");
    let mut args = base_args(&out, 2, 2000);
    args.push("--no-etcd".into());
    let (mut up, text) = up_in_background(&args, &out, false);
    let started: Vec<&str> = text.lines().filter_map(|l| l.split_whitespace().next()).collect();
    assert!(started.len() >= 3, "coordinators and workers: {text}");
    up.kill().expect("SIGKILL");
    up.wait().expect("reaped");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let alive: Vec<&&str> = started.iter().filter(|pid| process_alive(pid)).collect();
        if alive.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still running 15 s after kvfleet up was killed: {alive:?} of\n{text}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[test]
fn up_with_etcd_survives_a_leader_kill() {
    if !etcd_installed() {
        eprintln!("skipping: etcd not installed (apt-get install etcd-server)");
        return;
    }
    let tmp = TempDir::new("up-failover");
    let out = tmp.join("out");
    let mut args = base_args(&out, 2, 40);
    args.extend(["--kill-leader-after-s".into(), "2".into()]);
    let o = run_kvfleet(&args);
    assert!(o.status.success(), "{}", describe(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("failover: new leader"), "a standby took over: {stdout}");
    let s = summary(&out);
    assert_eq!(s["requests_finished"], 40, "{s}");
    assert_each_request_once(&out, 40);
    assert_no_process_left(&out);
}

#[test]
fn up_with_etcd_replaces_the_requests_of_a_killed_worker() {
    if !etcd_installed() {
        eprintln!("skipping: etcd not installed (apt-get install etcd-server)");
        return;
    }
    let tmp = TempDir::new("up-worker-kill");
    let out = tmp.join("out");
    let mut args = base_args(&out, 3, 30);
    args.extend(["--kill-worker-after-s".into(), "2".into()]);
    let o = run_kvfleet(&args);
    assert!(o.status.success(), "{}", describe(&o));
    let s = summary(&out);
    assert_eq!(s["requests_finished"], 30, "{s}");
    assert_each_request_once(&out, 30);
    // The requests it ran started over elsewhere, and their records say so.
    let csv = std::fs::read_to_string(kvfleet_tests::requests_csv(&out)).expect("requests");
    let again: Vec<&str> = csv.lines().skip(1).filter(|l| l.rsplit(',').next() != Some("0")).collect();
    assert!(!again.is_empty(), "no request started over:\n{csv}");
    assert!(again.iter().all(|l| l.split(',').nth(6) != Some("0")), "finished elsewhere: {again:?}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains(&format!("; {} started over on another instance;", again.len())), "{stdout}");
    assert_no_process_left(&out);
}

/// etcd killed from outside mid-run, and never started again: the requests it failed are
/// reported with their cause, one line naming etcd, exit 2 (not "no leader elected yet" alone).
#[test]
fn up_names_a_process_killed_from_outside_as_the_cause_of_its_failures() {
    if !etcd_installed() {
        eprintln!("skipping: etcd not installed (apt-get install etcd-server)");
        return;
    }
    let tmp = TempDir::new("up-etcd-killed");
    let out = tmp.join("out");
    let mut args = base_args(&out, 2, 2000);
    args.extend(["--stall-timeout-s".into(), "5".into()]);
    let (up, text) = up_in_background(&args, &out, true);
    let etcd = text.lines().find_map(|l| l.strip_suffix(" etcd")).expect("etcd's pid").to_string();
    let killed = std::process::Command::new("kill").args(["-KILL", &etcd]).status().expect("kill runs");
    assert!(killed.success());
    let o = up.wait_with_output().expect("kvfleet up ends");
    assert_eq!(o.status.code(), Some(2), "{}", describe(&o));
    let stderr = String::from_utf8_lossy(&o.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: ")
            && last.contains("requests did not complete")
            && last.contains(&format!("etcd (pid {etcd}) exited at")),
        "{}",
        describe(&o)
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains(&format!("unplanned: etcd (pid {etcd}) exited at")), "{stdout}");
    assert_no_process_left(&out);
}

#[test]
fn up_with_etcd_survives_an_etcd_restart() {
    if !etcd_installed() {
        eprintln!("skipping: etcd not installed (apt-get install etcd-server)");
        return;
    }
    let tmp = TempDir::new("up-etcd-restart");
    let out = tmp.join("out");
    let mut args = base_args(&out, 2, 30);
    args.extend(["--restart-etcd-after-s".into(), "2".into()]);
    let o = run_kvfleet(&args);
    assert!(o.status.success(), "{}", describe(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("chaos: etcd restarted"), "etcd came back: {stdout}");
    let s = summary(&out);
    assert_eq!(s["requests_finished"], 30, "{s}");
    assert_each_request_once(&out, 30);
    assert_no_process_left(&out);
}

/// A worker stopped (SIGSTOP) longer than its registration lease has its requests re-placed; when
/// it resumes, its late copies must not count: every request completes once and the result etcd
/// stores is the one its client got (`kvfleet up` audits it and fails otherwise).
#[test]
fn up_with_etcd_a_paused_worker_s_late_copies_do_not_count() {
    if !etcd_installed() {
        eprintln!("skipping: etcd not installed (apt-get install etcd-server)");
        return;
    }
    let tmp = TempDir::new("up-worker-pause");
    let out = tmp.join("out");
    let mut args = base_args(&out, 3, 30);
    args.extend(["--pause-worker-after-s", "2", "--pause-for-s", "6"].map(String::from));
    let o = run_kvfleet(&args);
    assert!(o.status.success(), "{}", describe(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("chaos: SIGSTOP worker-0") && stdout.contains("chaos: SIGCONT worker-0"), "{stdout}");
    assert!(stdout.contains("etcd results: 30 match what the clients got, 0 differ, 0 missing"), "{stdout}");
    // Resumed, it asked etcd, learnt its registration had expired and dropped its stale copies.
    let log = std::fs::read_to_string(out.join("logs/worker-0.log")).expect("worker-0's log");
    assert!(log.contains("registration expired"), "worker-0 did not notice its registration expired:\n{log}");
    let s = summary(&out);
    assert_eq!(s["requests_finished"], 30, "{s}");
    assert_each_request_once(&out, 30);
    assert_no_process_left(&out);
}

/// A leader stopped (SIGSTOP) for longer than the whole run: a standby takes over, and its
/// clients' streams — quiet, not closed, since the stopped process's kernel still ACKs — are
/// dropped by HTTP/2 keep-alive pings and resumed through the new leader. The run ends while the
/// old leader is still stopped.
#[test]
fn up_with_etcd_moves_the_clients_of_a_paused_leader() {
    if !etcd_installed() {
        eprintln!("skipping: etcd not installed (apt-get install etcd-server)");
        return;
    }
    let tmp = TempDir::new("up-leader-pause");
    let out = tmp.join("out");
    let pause_s = 120.0;
    let mut args = base_args(&out, 2, 30);
    args.extend(["--pause-leader-after-s".to_string(), "2".into(), "--pause-for-s".into(), pause_s.to_string()]);
    let o = run_kvfleet(&args);
    assert!(o.status.success(), "{}", describe(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("chaos: SIGSTOP the leader"), "{stdout}");
    let line = stdout.lines().find(|l| l.contains("requests finished,")).expect("the run's summary line");
    let wall: f64 =
        line.split(" in ").nth(1).and_then(|t| t.split(' ').next()).and_then(|t| t.parse().ok()).expect(line);
    assert!(wall < pause_s, "the clients waited for the stopped leader: {line}");
    let resumed: u64 = line
        .split("; ")
        .find(|p| p.contains("resumed after a leader change"))
        .and_then(|p| p.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect(line);
    assert!(resumed > 0, "no client moved to the new leader: {line}");
    let s = summary(&out);
    assert_eq!(s["requests_finished"], 30, "{s}");
    assert_each_request_once(&out, 30);
    assert_no_process_left(&out);
}

/// `--chaos SEED`: a seeded schedule of leader kills and pauses, worker kills, pauses and
/// restarts, and etcd restarts; the cluster must complete every request exactly once with etcd
/// holding what the clients got, and say so in its chaos table and `chaos.json`.
/// Every process's log lines about the requests `out/failed.txt` names (a run's temporary folder
/// is gone once the test ends: a failure must carry its evidence).
fn failed_requests_in_logs(out: &Path) -> String {
    let Ok(failed) = std::fs::read_to_string(out.join("failed.txt")) else { return String::new() };
    let ids: Vec<String> =
        failed.lines().filter_map(|l| l.strip_prefix("request ")?.split(':').next().map(str::to_string)).collect();
    let mut text = String::from("\n--- log lines of the failed requests\n");
    let Ok(logs) = std::fs::read_dir(out.join("logs")) else { return text };
    let mut logs: Vec<_> = logs.flatten().map(|e| e.path()).collect();
    logs.sort();
    for log in logs {
        let Ok(body) = std::fs::read_to_string(&log) else { continue };
        let name = log.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        for line in body.lines() {
            let about = ids.iter().any(|id| {
                line.contains(&format!("request={id} "))
                    || line.contains(&format!("req-{id} "))
                    || line.contains(&format!("request_id={id} "))
            });
            if about {
                text.push_str(&format!("{name}: {line}\n"));
            }
        }
    }
    text
}

fn survives_chaos(seed: u64) {
    if !etcd_installed() {
        eprintln!("skipping: etcd not installed (apt-get install etcd-server)");
        return;
    }
    let tmp = TempDir::new(&format!("up-chaos-{seed}"));
    let out = tmp.join("out");
    let mut args = base_args(&out, 3, 30);
    args.extend([
        "--chaos".to_string(),
        seed.to_string(),
        "--chaos-faults".into(),
        "4".into(),
        "--chaos-span-s".into(),
        "6".into(),
    ]);
    let o = run_kvfleet(&args);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}{}", describe(&o), failed_requests_in_logs(&out));
    assert!(stdout.contains(&format!("chaos (seed {seed}, 4 faults): survived")), "{stdout}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("chaos.json")).expect("chaos.json")).unwrap();
    assert_eq!((report["completed_once"].as_u64(), report["executed_twice"].as_u64()), (Some(30), Some(0)), "{report}");
    assert_eq!(report["lost"], 0, "{report}");
    assert_each_request_once(&out, 30);
    assert_no_process_left(&out);
}

#[test]
fn up_with_etcd_survives_chaos_seed_11() {
    survives_chaos(11);
}

#[test]
fn up_with_etcd_survives_chaos_seed_12() {
    survives_chaos(12);
}

#[test]
fn up_with_etcd_survives_chaos_seed_13() {
    survives_chaos(13);
}

/// Per-request E2E seconds of a run's requests CSV, by id.
fn e2e_by_id(out: &Path) -> std::collections::BTreeMap<u64, f64> {
    let text = std::fs::read_to_string(kvfleet_tests::requests_csv(out)).expect("readable");
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().expect("a header").split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap_or_else(|| panic!("no `{name}` column"));
    let (id, e2e) = (col("id"), col("e2e_s"));
    lines
        .map(|l| l.split(',').collect::<Vec<_>>())
        .filter(|f| !f[e2e].is_empty())
        .map(|f| (f[id].parse().expect("numeric id"), f[e2e].parse().expect("numeric e2e")))
        .collect()
}

/// `--time-dilation 3`: the cluster lives three real seconds per emulated one (the run takes at
/// least 2.5 × its emulated span), and what it reports is emulated time — each request's E2E
/// that of the simulator's run of the same config (the fixture's 2-instance FCFS cluster).
/// Breaking the dilation of the worker clock, of the replay's arrivals or of the reported span
/// fails it.
#[test]
fn up_with_time_dilation_reports_emulated_time() {
    let tmp = TempDir::new("up-dilation");
    let config = kvfleet_tests::fixture("parity.toml");
    let config = config.to_str().expect("utf-8 path");
    let (sim, emu) = (tmp.join("sim"), tmp.join("emu"));
    let o =
        run_kvfleet(["sim", "--config", config, "--requests", "8", "--no-plots", "-q", "--out", sim.to_str().unwrap()]);
    assert!(o.status.success(), "{}", describe(&o));
    let started = std::time::Instant::now();
    let o = run_kvfleet([
        "up",
        "--config",
        config,
        "--requests",
        "8",
        "--no-etcd",
        "--no-traces",
        "--kv-memory",
        "512MiB",
        "--cpu-memory",
        "512MiB",
        "--kv-fill",
        "stamp",
        "--time-dilation",
        "3",
        "-q",
        "--out",
        emu.to_str().unwrap(),
    ]);
    let real_s = started.elapsed().as_secs_f64();
    assert!(o.status.success(), "{}", describe(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("time dilation 3:"), "says it ran dilated: {stdout}");
    let runs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(emu.join("results.json")).expect("results.json")).expect("JSON");
    let span_s = runs[0]["span_s"].as_f64().expect("span_s");
    assert!(real_s >= 2.5 * span_s, "{real_s:.1} s of real time for {span_s:.1} s emulated at K = 3");
    let (sim, emu) = (e2e_by_id(&sim), e2e_by_id(&emu));
    assert_eq!(emu.len(), 8, "every request finished: {emu:?}");
    let mut errors: Vec<f64> = sim.iter().map(|(id, s)| (emu[id] - s).abs() / s).collect();
    errors.sort_by(f64::total_cmp);
    let median = errors[errors.len() / 2];
    println!("E2E relative errors (sorted): {errors:?}; real {real_s:.1} s, emulated span {span_s:.1} s");
    assert!(median < 0.10, "median E2E error {:.1} % (sim {sim:?}, emu {emu:?})", 100.0 * median);
}

/// `--time-dilation auto` measures this host's QUIC goodput between two processes (a sender with
/// a worker certificate, which the KV port requires) and says which K it chose for the link.
#[test]
fn up_with_time_dilation_auto_measures_the_transport_and_says_its_k() {
    let tmp = TempDir::new("up-dilation-auto");
    let out = tmp.join("out");
    let mut args = base_args(&out, 2, 4);
    args.extend(["--no-etcd", "--no-traces", "--link-gbps", "2", "--time-dilation", "auto"].map(String::from));
    let o = run_kvfleet(&args);
    assert!(o.status.success(), "{}", describe(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("time dilation: this host's QUIC carries"))
        .unwrap_or_else(|| panic!("no line naming the measured goodput and the K chosen: {stdout}"));
    assert!(line.contains("to emulate 2 Gbit/s links K = "), "{line}");
    assert_eq!(summary(&out)["requests_finished"], 4);
}

/// Prefill/decode disaggregation with Arrow on real processes: 4 workers start as 2 prefill + 2
/// decode; each request is prefilled, held, and handed off (its KV copied live over QUIC) to a
/// decoder. A TTFT SLO no prompt can meet forces Arrow to flip a decoder to prefill at the first
/// arrival; the leader is killed mid-run (the new one reads the roles back from etcd and takes
/// over the held requests and open handoffs). Every request completes exactly once, the handoffs
/// are counted, the flip is recorded (and etcd's results match the clients', or `kvfleet up`
/// fails). The decode pool's workers span two GPUs each, the prefill pool's one; prompts are
/// prefilled in chunks and their handoffs overlap the prefill.
#[test]
fn up_with_arrow_hands_requests_off_and_flips_a_decoder() {
    if !etcd_installed() {
        eprintln!("skipping: etcd not installed (apt-get install etcd-server)");
        return;
    }
    let tmp = TempDir::new("up-arrow");
    let out = tmp.join("out");
    let example = arrow_example();
    let cfg = std::fs::read_to_string(&example).expect("examples/arrow-up-4.toml");
    assert!(cfg.contains("slo_ttft_s = 1.5"), "the example's Arrow TTFT SLO moved; update this test");
    let config = tmp.join("arrow.toml");
    // The decode pool spans two GPUs per instance, the prefill pool one (Arrow's heterogeneous
    // setup): each worker runs its own timing, and handoffs cross tensor-parallel degrees. Prompts
    // are prefilled in chunks of 256 tokens and handed off overlapped: a move starts after the
    // first chunk and follows the prefill.
    let cfg = cfg
        .replace("slo_ttft_s = 1.5", "slo_ttft_s = 0.001")
        .replace("[cluster]\n", "[cluster]\ndecode_tensor_parallel_size = 2\n")
        .replace("policy = \"arrow\"\n", "policy = \"arrow\"\noverlap = \"chunk\"\n")
        .replace("[scheduler]\n", "[scheduler.intra]\nchunked_prefill_tokens = 256\n\n[scheduler]\n");
    assert!(cfg.contains("overlap = ") && cfg.contains("chunked_prefill_tokens"), "{cfg}");
    std::fs::write(&config, cfg).unwrap();
    let config = config.to_str().unwrap();
    let args =
        ["up", "-c", config, "--requests", "60", "--kill-leader-after-s", "8", "-q", "--out", out.to_str().unwrap()];
    let o = run_kvfleet(args);
    assert!(o.status.success(), "{}", describe(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("failover: new leader"), "a standby took over: {stdout}");
    let s = summary(&out);
    assert_eq!(s["requests_finished"], 60, "{s}");
    assert_each_request_once(&out, 60);
    let (line, handoffs, overlapped) = handoff_line(&stdout);
    // Measured 24–46 of 60: the rest were prefilled on an instance Arrow flipped to decode
    // meanwhile (2 to decode in the runs with fewer), which decodes them where they are.
    assert!(handoffs >= 15, "many requests were handed off over QUIC: {line}");
    // Moves decided after a first chunk, committed.
    assert!(overlapped >= 5, "handoffs overlapped with their prefill: {line}");
    let runs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let changes = runs[0]["role_changes"].as_array().cloned().unwrap_or_default();
    // Flips made by either leader (the first one's at the first arrival, read back by the next).
    assert!(changes.iter().any(|c| c["role"] == "prefill"), "a decoder flipped to prefill: {changes:?}");
    let migrations = runs[0]["live_migrations"]["committed"].as_u64().unwrap_or(0);
    assert!(migrations >= handoffs, "each handoff is a committed live migration: {}", runs[0]["live_migrations"]);
    // The leader killed at 8 s stored the migrations it settled and the handoffs it counted; the
    // next one read them back, so the run's log covers the requests that migrated (a move in
    // flight at the kill may have left no record).
    let moved = std::fs::read_to_string(kvfleet_tests::requests_csv(&out))
        .unwrap()
        .lines()
        .skip(1)
        .filter(|l| l.split(',').nth(13).and_then(|m| m.parse::<u32>().ok()).unwrap_or(0) > 0)
        .count() as u64;
    assert!(migrations * 10 >= moved * 9, "{migrations} migrations logged for {moved} requests that moved");
    // Each worker measured Arrow's profile of itself on its own timing (or read it from the
    // cache), and a leader weighs the instance with it.
    let leaders: String = (0..3)
        .map(|i| std::fs::read_to_string(out.join(format!("logs/coordinator-{i}.log"))).unwrap_or_default())
        .collect();
    let mut prefill_b = Vec::new();
    for (worker, tp) in [(0, 1), (1, 1), (2, 2), (3, 2)] {
        let log = std::fs::read_to_string(out.join(format!("logs/worker-{worker}.log"))).unwrap_or_default();
        let ready =
            log.lines().find(|l| l.contains("worker ready")).unwrap_or_else(|| panic!("worker-{worker}: {log}"));
        assert!(ready.contains(&format!("tensor_parallel_size={tp}")), "worker-{worker} spans {tp} GPUs: {ready}");
        let profile = log
            .lines()
            .find(|l| l.contains("Arrow profile of this instance"))
            .unwrap_or_else(|| panic!("worker-{worker} measured no Arrow profile: {log}"));
        let b = profile.split("prefill_b=").nth(1).and_then(|t| t.split_whitespace().next()).unwrap_or_default();
        prefill_b.push(b.to_string());
        let used = format!("instance={worker} ");
        assert!(
            leaders.lines().any(|l| l.contains("Arrow weighs the instance with its own profile") && l.contains(&used)),
            "no leader used worker-{worker}'s profile ({profile})"
        );
    }
    assert!(
        prefill_b[0] == prefill_b[1] && prefill_b[2] == prefill_b[3] && prefill_b[0] != prefill_b[2],
        "{prefill_b:?}"
    );
    assert_no_process_left(&out);
}

/// Arrow with a prefill worker stopped (SIGSTOP) past its 2 s registration lease while it held
/// requests for their handoffs and copied some: the leader re-places them, and the worker,
/// resumed, drops the copies the cluster no longer counts; every request completes exactly once.
/// The stall this guards against (the worker's memory full of copies held for handoffs nobody
/// decides: 16–18 of 60 requests with no token) reproduced in release builds only; in session 22's
/// debug build (full KV fill) the same run passed with the fixes removed, so the ledger's cluster property test and the
/// controller's `a_held_copy_the_cluster_re_placed_elsewhere_is_dropped_where_it_is_held` are what
/// pin the fix (`docs/results/chaos/README.md`).
#[test]
fn up_with_arrow_a_prefill_worker_paused_past_its_lease_completes_every_request_once() {
    if !etcd_installed() {
        eprintln!("skipping: etcd not installed (apt-get install etcd-server)");
        return;
    }
    let tmp = TempDir::new("up-arrow-pause");
    let out = tmp.join("out");
    let example = arrow_example();
    let config = example.to_str().unwrap();
    let args = [
        "up",
        "-c",
        config,
        "--requests",
        "30",
        "--pause-worker-after-s",
        "6",
        "--pause-for-s",
        "5",
        // Exactly-once under the pause is the point here, not the bytes: each token slot written
        // only where it is identified (the workers' memory 1/64 resident).
        "--kv-fill",
        "stamp",
        "-q",
        "--out",
        out.to_str().unwrap(),
    ];
    let o = run_kvfleet(args);
    assert!(o.status.success(), "{}", describe(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("chaos: SIGCONT worker-0"), "{stdout}");
    let log = std::fs::read_to_string(out.join("logs/worker-0.log")).expect("worker-0's log");
    assert!(log.contains("registration expired"), "worker-0 did not notice its registration expired:\n{log}");
    let s = summary(&out);
    assert_eq!(s["requests_finished"], 30, "{s}");
    assert_each_request_once(&out, 30);
    assert_no_process_left(&out);
}

/// The shipped Arrow emulator example (`examples/arrow-up-4.toml`).
fn arrow_example() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/arrow-up-4.toml")
}

/// `kvfleet up`'s `prefill/decode:` line, the handoffs it counts, and of them those overlapped
/// with their prefill ("(N overlapped with their prefill)").
fn handoff_line(stdout: &str) -> (&str, u64, u64) {
    let line = stdout.lines().find(|l| l.starts_with("prefill/decode:")).unwrap_or_else(|| panic!("{stdout}"));
    let handoffs: u64 = line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).unwrap_or(0);
    let overlapped: u64 = line
        .split(" overlapped")
        .next()
        .and_then(|head| head.rsplit('(').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    (line, handoffs, overlapped)
}

/// Handoffs that follow the prefill layer by layer on real processes
/// (`tests/fixtures/static-layer.toml`: a static split of 2 prefill + 2 decode workers, prompts
/// prefilled whole, `[pd] overlap = "layer"`): each worker is told the layer groups; the leader
/// hands requests off as their prefill starts, the moves carry layer-group slices over QUIC while
/// the prefill runs, and every request completes exactly once, every handoff committed.
#[test]
fn up_hands_requests_off_layer_by_layer() {
    let tmp = TempDir::new("up-layer");
    let out = tmp.join("out");
    let config = kvfleet_tests::fixture("static-layer.toml");
    let args = ["up", "-c", config.to_str().expect("utf-8"), "--no-etcd", "-q", "--out", out.to_str().expect("utf-8")];
    let o = run_kvfleet(args);
    assert!(o.status.success(), "{}", describe(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let s = summary(&out);
    assert_eq!(s["requests_finished"], 16, "{s}");
    assert_each_request_once(&out, 16);
    let (line, handoffs, overlapped) = handoff_line(&stdout);
    assert!(handoffs >= 12 && overlapped >= 6, "handed off as their prefills started: {line}");
    let mut sliced = 0;
    for worker in 0..4 {
        let log = std::fs::read_to_string(out.join(format!("logs/worker-{worker}.log"))).unwrap_or_default();
        let ready = log.lines().find(|l| l.contains("worker ready")).unwrap_or_else(|| panic!("{log}"));
        assert!(ready.contains("handoff_layer_groups=4"), "worker-{worker}: {ready}");
        // A prefill worker's settled moves: more stages than a one-shot copy's.
        sliced += log.lines().filter(|l| l.contains("outcome=committed") && !l.contains("stages=1 ")).count();
    }
    assert!(sliced >= 6, "moves that sent slices while the prefill ran: {sliced}");
    eprintln!("{line}; {sliced} moves sent slices during the prefill");
    assert_no_process_left(&out);
}

/// Pushed handoffs into full decoders on real processes (`tests/fixtures/static-push.toml`: 1
/// prefill + 2 decode workers whose arenas hold about three requests each, a burst of 16,
/// `[pd] handoff = "push"`): the leader sends each handoff to a decoder whether it has room or
/// not; a full one refuses the PREPARE over QUIC (nothing copied), the prefill worker keeps the
/// KV, and the leader tries the other decoder 50 ms later, until one takes it. Every request is
/// handed off once and completes exactly once.
#[test]
fn up_pushes_handoffs_into_full_decoders_and_retries_each_refusal_on_the_next() {
    let tmp = TempDir::new("up-push");
    let out = tmp.join("out");
    let config = kvfleet_tests::fixture("static-push.toml");
    let args = [
        "up",
        "-c",
        config.to_str().expect("utf-8"),
        "--no-etcd",
        "--cpu-memory",
        "4MiB",
        "--kv-fill",
        "stamp",
        "-q",
        "--out",
        out.to_str().expect("utf-8"),
    ];
    let o = run_kvfleet(args);
    assert!(o.status.success(), "{}", describe(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_each_request_once(&out, 16);
    let (line, handoffs, _) = handoff_line(&stdout);
    assert_eq!(handoffs, 16, "{line}");
    // request,from,to,bytes,start_s,end_s,transfer_s,aborted: one row per move tried.
    #[derive(Debug)]
    struct Try {
        to: u32,
        bytes: u64,
        start: f64,
        end: f64,
        aborted: bool,
    }
    let csv = std::fs::read_to_string(out.join("migrations-fcfs+least-kv-8.csv")).expect("the moves' CSV");
    let mut tries: std::collections::BTreeMap<u64, Vec<Try>> = Default::default();
    for row in csv.lines().skip(1) {
        let f: Vec<&str> = row.split(',').collect();
        let n = |i: usize| f[i].parse::<f64>().unwrap_or_else(|e| panic!("{row}: {e}"));
        let t = Try { to: n(2) as u32, bytes: n(3) as u64, start: n(4), end: n(5), aborted: f[7] == "true" };
        tries.entry(n(0) as u64).or_default().push(t);
    }
    let mut refused = 0;
    for (id, t) in &mut tries {
        t.sort_by(|a, b| a.start.total_cmp(&b.start));
        let (last, before) = t.split_last().expect("a row per request");
        assert!(!last.aborted && last.bytes > 0 && last.to >= 1, "request {id}: its last try committed: {t:?}");
        for (i, r) in before.iter().enumerate() {
            refused += 1;
            assert!(r.aborted && r.bytes == 0, "request {id}: each earlier try refused, nothing copied: {t:?}");
            let next = &t[i + 1];
            assert_ne!(next.to, r.to, "request {id}: the next try goes to the other decoder: {t:?}");
            assert!(next.start - r.end >= 0.049, "request {id}: retried 50 ms after the refusal: {t:?}");
        }
    }
    assert_eq!(tries.len(), 16);
    assert!(refused >= 4, "the burst fills both decoders: {refused} refusals\n{stdout}");
    eprintln!("{line}; {refused} refusals");
    assert_no_process_left(&out);
}

/// Handoffs whose bytes fail their checksum, on real processes (`tests/fixtures/corrupt-handoffs.toml`:
/// 2 prefill + 2 decode workers, prefill worker 0 started with `--corrupt-sent-blocks`). Each
/// handoff out of worker 0 aborts at its decoder on a checksum mismatch and is tried once more on
/// the other decoder; then the request is prefilled again on worker 1 (worker 0's copy dropped),
/// whose handoff commits. Every request completes once, on a decoder.
#[test]
fn up_prefills_again_a_request_whose_handoffs_fail_their_checksum_twice() {
    let tmp = TempDir::new("up-corrupt");
    let out = tmp.join("out");
    let config = kvfleet_tests::fixture("corrupt-handoffs.toml");
    let args = ["up", "-c", config.to_str().expect("utf-8"), "--no-etcd", "--kv-fill", "stamp", "-q", "--out"];
    let o = run_kvfleet(args.iter().copied().chain([out.to_str().expect("utf-8")]));
    assert!(o.status.success(), "{}", describe(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_each_request_once(&out, 12);
    // request,source,target,outcome,…,abort_reason: one row per move tried.
    let csv = std::fs::read_to_string(out.join("live-migrations.csv")).expect("the moves' CSV");
    let mut tries: std::collections::BTreeMap<u64, Vec<(u32, u32, String)>> = Default::default();
    for row in csv.lines().skip(1) {
        let f: Vec<&str> = row.splitn(14, ',').collect();
        let n = |i: usize| f[i].parse::<u32>().unwrap_or_else(|e| panic!("{row}: {e}"));
        let checksum = f[13].contains("CHECKSUM_MISMATCH");
        let how = if f[3] == "committed" { "committed".to_string() } else { format!("{} {checksum}", f[3]) };
        tries.entry(u64::from(n(0))).or_default().push((n(1), n(2), how));
    }
    let requests = std::fs::read_to_string(kvfleet_tests::requests_csv(&out)).expect("requests");
    let mut again = 0;
    for row in requests.lines().skip(1) {
        let f: Vec<&str> = row.split(',').collect();
        let (id, placed_on, finished_on): (u64, u32, u32) =
            (f[0].parse().unwrap(), f[5].parse().unwrap(), f[6].parse().unwrap());
        let replaced: u32 = f[17].parse().unwrap_or_else(|e| panic!("{row}: {e}"));
        let t = tries.get(&id).unwrap_or_else(|| panic!("request {id} was handed off: {tries:?}"));
        assert!(finished_on >= 2, "request {id} finished on a decoder: {row}");
        let (last, before) = t.split_last().expect("a try");
        assert_eq!((last.0, last.2.as_str()), (1, "committed"), "request {id}: handed off from worker 1: {t:?}");
        assert_eq!(placed_on, 1, "request {id}: its finishing copy was prefilled on worker 1: {row}");
        if before.is_empty() {
            assert_eq!(replaced, 0, "request {id}: {row}");
            continue;
        }
        again += 1;
        assert_eq!(replaced, 1, "request {id}: its record counts the start over: {row}");
        assert!(before.iter().all(|b| b.0 == 0 && b.2 != "committed"), "request {id}: {t:?}");
        let corrupt = before.iter().filter(|b| b.2 == "aborted true").count();
        assert!(corrupt >= 2 && before.last().unwrap().2 == "aborted true", "request {id}: {t:?}");
        assert!(before.len() <= 3, "request {id}: one retry (and a try lost to a race at most): {t:?}");
    }
    assert!(again >= 2, "requests prefilled on worker 0 were prefilled again on worker 1: {again}\n{stdout}");
    assert!(stdout.contains(&format!("; {again} started over on another instance;")), "{again}:\n{stdout}");
    let counted = format!("| {again} prefilled again after checksum mismatches");
    assert!(stdout.lines().any(|l| l.contains("handoffs: ") && l.ends_with(&counted)), "{counted}:\n{stdout}");
    eprintln!("{again} of 12 prefilled again after two checksum mismatches");
    assert_no_process_left(&out);
}

/// Cache-aware placement (`tests/fixtures/cache-aware.toml`): the leader has a worker copy a
/// cached prompt prefix from the worker holding it before it submits the request; the bytes move
/// between the worker processes over QUIC, whole 4 MiB blocks, every one passing its checks, and
/// every request still completes exactly once.
#[test]
fn up_with_cache_aware_copies_prefixes_between_workers() {
    let tmp = TempDir::new("up-cache-aware");
    let out = tmp.join("out");
    let config = kvfleet_tests::fixture("cache-aware.toml");
    let args = [
        "up",
        "-c",
        config.to_str().expect("utf-8"),
        "--kv-memory",
        "512MiB",
        "--cpu-memory",
        "512MiB",
        "--kv-fill",
        "stamp",
        "--no-etcd",
        "-q",
        "--out",
        out.to_str().expect("utf-8 temp path"),
    ];
    let o = run_kvfleet(args);
    assert!(o.status.success(), "{}", describe(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let s = summary(&out);
    assert_eq!(s["requests_finished"], 40, "{s}");
    assert_each_request_once(&out, 40);
    let fetches = s["prefix_fetches"].as_u64().expect("prefix_fetches");
    let bytes = s["prefix_fetch_bytes"].as_u64().expect("prefix_fetch_bytes");
    // Measured 5-6 (the simulator: 4-6 over seeds); what the timing of a loaded host leaves.
    assert!(fetches >= 1, "no placement copied a prefix: {s}\n{stdout}");
    assert!(stdout.contains(&format!("cache-aware: {fetches} placements copied")), "{stdout}");
    assert!(bytes > 0 && bytes.is_multiple_of(4 << 20), "whole 4 MiB blocks: {bytes}");
    // What the workers counted: fetches made, bytes received, no KV error anywhere.
    let (mut worker_fetches, mut kv_errors) = (0.0, 0.0);
    for entry in std::fs::read_dir(out.join("metrics")).expect("metrics saved") {
        let path = entry.expect("entry").path();
        if !path.file_name().and_then(|f| f.to_str()).is_some_and(|f| f.starts_with("worker-")) {
            continue;
        }
        let page = std::fs::read_to_string(&path).expect("readable");
        let value = |name: &str| -> f64 {
            page.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.rsplit(' ').next())
                .map_or(0.0, |v| v.parse().expect("a number"))
        };
        worker_fetches += value("kvfleet_prefix_fetches_total");
        kv_errors += value("kvfleet_kv_errors_total") + value("kvfleet_prefix_fetch_errors_total");
    }
    assert!(worker_fetches >= 1.0, "the workers copied: {worker_fetches}");
    assert_eq!(kv_errors, 0.0, "every copied block checked out");
    assert_no_process_left(&out);
}
