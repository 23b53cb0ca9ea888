//! Random configs, model and GPU TOMLs and trace files through the loader and the first simulated
//! second: every input is either accepted and runs, or refused with one line of error, never a
//! panic, an allocation failure or a loop.
//!
//! Values are drawn from pools of the numbers that broke the loader before (0, 2³²−1, 10⁹ GB,
//! 10⁻⁹ TFLOP/s, 10³⁰⁰ ms, NaN…) mixed with sane ones, so most cases reach the simulation.

use kvfleet_core::time::Timestamp;
use kvfleet_sim::config::SimConfig;
use kvfleet_sim::run_one_until;
use proptest::prelude::*;
use std::path::{Path, PathBuf};

/// TOML literals for numeric fields: sane values four times in five (so most cases get past the
/// first check and reach later ones), the absurd ones otherwise.
const SANE: &[&str] = &["1", "2", "4", "16", "64", "1000"];
const ABSURD: &[&str] = &[
    "0",
    "-1",
    "0.5",
    "1e-9",
    "1e9",
    "1e300",
    "nan",
    "inf",
    "4294967295",
    "4294967296",
    "18446744073709551615",
    "0.001",
];

fn number() -> impl Strategy<Value = &'static str> {
    prop_oneof![4 => prop::sample::select(SANE), 1 => prop::sample::select(ABSURD)]
}

/// A `key = value` line, or nothing (the default).
fn field(key: &'static str, value: impl Strategy<Value = String>) -> impl Strategy<Value = String> {
    prop::option::weighted(0.3, value).prop_map(move |v| v.map_or(String::new(), |v| format!("{key} = {v}\n")))
}

fn num_field(key: &'static str) -> impl Strategy<Value = String> {
    field(key, number().prop_map(str::to_string))
}

fn quoted(options: &'static [&'static str]) -> impl Strategy<Value = String> {
    prop::sample::select(options).prop_map(|s| format!("\"{s}\""))
}

fn model_toml() -> impl Strategy<Value = String> {
    let shape = ["layers", "hidden", "q_heads", "kv_heads", "head_dim", "intermediate", "vocab", "dtype_bytes"];
    let sane = ["64", "5120", "40", "8", "128", "27648", "152064", "2"];
    prop::collection::vec(prop::option::weighted(0.3, number()), shape.len()).prop_map(move |over| {
        let mut t = String::from("name = \"fuzz\"\n");
        for ((k, s), o) in shape.iter().zip(sane).zip(over) {
            t += &format!("{k} = {}\n", o.unwrap_or(s));
        }
        t
    })
}

fn gpu_toml() -> impl Strategy<Value = String> {
    let figures = ["memory_gb", "bf16_tflops", "hbm_tbytes_per_s", "host_link_gbytes_per_s"];
    let sane = ["80", "989", "3.35", "53.7"];
    prop::collection::vec(prop::option::weighted(0.4, number()), figures.len()).prop_map(move |over| {
        let mut t = String::from("name = \"fuzz-gpu\"\n");
        for ((k, s), o) in figures.iter().zip(sane).zip(over) {
            t += &format!("{k} = {}\n", o.unwrap_or(s));
        }
        t
    })
}

/// A trace of a few rows, some of them broken.
fn trace(format: &'static str) -> impl Strategy<Value = String> {
    let row =
        (number(), number(), number(), number(), 0..12u8).prop_map(move |(a, p, r, ans, kind)| match (format, kind) {
            (_, 0) => "[1,2,3]".to_string(),
            (_, 1) => "{".to_string(),
            ("mooncake", _) => format!("{{\"timestamp\": {a}, \"input_length\": {p}, \"output_length\": {r}}}"),
            _ => format!("{a},{p},{r},{ans}"),
        });
    prop::collection::vec(row, 1..8).prop_map(move |rows| {
        let header = if format == "kvfleet" { "arrival_s,prompt_tokens,reasoning_tokens,answer_tokens\n" } else { "" };
        format!("{header}{}\n", rows.join("\n"))
    })
}

#[derive(Debug, Clone)]
struct Case {
    config: String,
    model: String,
    gpu: String,
    trace: String,
}

fn case() -> impl Strategy<Value = Case> {
    let cluster = (
        field(
            "instances",
            prop_oneof![4 => prop::sample::select(&["1", "2", "3"][..]), 1 => prop::sample::select(&["0", "65537", "4294967295"][..])]
                .prop_map(str::to_string),
        ),
        num_field("kv_cache_gb"),
        num_field("cpu_swap_gb"),
        num_field("block_size"),
        num_field("max_num_seqs"),
        num_field("max_batched_tokens"),
        num_field("gpu_memory_utilization"),
        field("model", quoted(&["qwen-7b", "llama-3-8b", "model.toml", "missing.toml"])),
        field("gpu", quoted(&["h100-80gb", "gpu.toml", "tpu"])),
        field("timing", quoted(&["analytic", "profile", "auto", "bogus"])),
    )
        .prop_map(|f| format!("[cluster]\n{}{}{}{}{}{}{}{}{}{}", f.0, f.1, f.2, f.3, f.4, f.5, f.6, f.7, f.8, f.9));
    let scheduler = (
        field("policy", quoted(&["pascal", "fcfs", "rr", "pascal-nomigration", "sjf", "rr+random"])),
        num_field("quantum_tokens"),
        num_field("demotion_tokens"),
    )
        .prop_map(|(p, q, d)| format!("[scheduler]\n{p}[scheduler.intra]\n{q}{d}"));
    let rest = (
        num_field("tpot_s"),
        num_field("bandwidth_gbps"),
        num_field("latency_us"),
        num_field("stop_copy_ms"),
        num_field("timeout_ms"),
    )
        .prop_map(|(t, b, l, s, m)| format!("[slo]\n{t}[link]\n{b}{l}[migration]\n{s}{m}"));
    let pd = (
        num_field("prefill_instances"),
        field("policy", quoted(&["static", "arrow", "dynamo"])),
        field("handoff", quoted(&["pull", "push", "shove"])),
        field("overlap", quoted(&["none", "chunk", "layer", "both"])),
        field("disaggregate", quoted(&["always", "never", "prefix-threshold", "sometimes"])),
        num_field("min_prompt_tokens"),
        (num_field("interval_s"), num_field("cooldown_s"), num_field("l_expand"), num_field("l_shrink")),
    )
        .prop_map(|(n, p, h, o, d, m, (i, c, e, s))| format!("[pd]\n{n}{p}{h}{o}{d}{m}[pd.arrow]\n{i}{c}{e}{s}"));
    let workload = (
        prop::sample::select(&["1", "5", "20", "0", "4294967296"][..]),
        num_field("time_scale"),
        0..4u8,
        prop::sample::select(&["kvfleet", "mooncake"][..]),
        (number(), number(), number()),
    )
        .prop_map(|(n, scale, kind, format, (rate, duration, cv))| {
            let lengths = match kind {
                3 => format!(
                    "[workload.arrivals]\nkind = \"steps\"\ncv = {cv}\nphases = [{{ rate = {rate}, duration_s = {duration} }}, {{ rate = 0, duration_s = {duration} }}]\n"
                ),
                0 => format!("[workload.arrivals]\nkind = \"trace\"\n[workload.lengths]\nkind = \"trace\"\npath = \"trace.txt\"\nformat = \"{format}\"\n"),
                1 => "[workload.arrivals]\nkind = \"poisson\"\nrate = 4.0\n[workload.lengths]\nkind = \"fixed\"\nprompt_tokens = 100\nreasoning_tokens = 50\nanswer_tokens = 20\n".into(),
                _ => "[workload.arrivals]\nkind = \"poisson\"\nrate = 1e-300\n".into(),
            };
            (format!("[workload]\nnum_requests = {n}\n{scale}{lengths}"), format)
        });
    (cluster, scheduler, rest, pd, workload, model_toml(), gpu_toml(), trace("kvfleet"), trace("mooncake")).prop_map(
        |(c, s, r, pd, (w, format), model, gpu, kv_trace, mc_trace)| Case {
            config: format!("{c}{s}{r}{pd}{w}"),
            model,
            gpu,
            trace: if format == "kvfleet" { kv_trace } else { mc_trace },
        },
    )
}

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvfleet-input-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Load and, if accepted, run the first simulated second. `Err` is the one-line message.
fn load_and_run(dir: &Path, case: &Case) -> Result<(), String> {
    for (name, text) in
        [("model.toml", &case.model), ("gpu.toml", &case.gpu), ("trace.txt", &case.trace), ("c.toml", &case.config)]
    {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let cfg = SimConfig::load(&dir.join("c.toml")).map_err(|e| e.to_string())?;
    for point in cfg.runs() {
        run_one_until(
            &cfg.with_seed(point.seed),
            &point.policy,
            point.rate,
            dir,
            Timestamp::from_secs_f64(1.0),
            |_| {},
        )
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_input_runs_or_is_refused_in_one_line(case in case()) {
        let dir = scratch();
        if let Err(message) = load_and_run(&dir, &case) {
            prop_assert!(!message.trim().is_empty(), "an empty error");
            prop_assert!(!message.contains('\n'), "a multi-line error: {message}");
        }
    }
}

/// The inputs that crashed, hung or vanished before, each refused with the field it names.
#[test]
fn inputs_that_broke_the_loader_name_their_field() {
    let dir = scratch().join("regressions");
    std::fs::create_dir_all(&dir).unwrap();
    let base = Case {
        config: String::new(),
        model: "name = \"m\"\nlayers = 64\nhidden = 5120\nq_heads = 40\nkv_heads = 8\nhead_dim = 128\nintermediate = 27648\nvocab = 152064\ndtype_bytes = 2\n".into(),
        gpu: "name = \"g\"\nmemory_gb = 80\nbf16_tflops = 989\nhbm_tbytes_per_s = 3.35\nhost_link_gbytes_per_s = 53.7\n".into(),
        trace: "arrival_s,prompt_tokens,reasoning_tokens,answer_tokens\n0,100,10,10\n".into(),
    };
    let trace_cfg = |format: &str| {
        format!("[workload]\nnum_requests = 2\n[workload.arrivals]\nkind = \"trace\"\n[workload.lengths]\nkind = \"trace\"\npath = \"trace.txt\"\nformat = \"{format}\"\n")
    };
    let cases: Vec<(Case, &str)> = vec![
        // KV bytes per token overflowed to 0 and divided by it.
        (
            Case {
                config: "[cluster]\nmodel = \"model.toml\"\n".into(),
                model: base.model.replace("layers = 64", "layers = 4294967295"),
                ..base.clone()
            },
            "`layers` must be in 1..=4096",
        ),
        // A prompt + output reaching 2^32 wrapped and vanished from every count.
        (
            Case {
                config: trace_cfg("kvfleet"),
                trace: "arrival_s,prompt_tokens,reasoning_tokens,answer_tokens\n0,4294967295,1,1\n".into(),
                ..base.clone()
            },
            "more than the 16777216 one request may hold",
        ),
        // Block tables sized from an unbounded count: allocation failure.
        (Case { config: "[cluster]\nkv_cache_gb = 1e9\n".into(), ..base.clone() }, "`cluster.kv_cache_gb`"),
        (Case { config: "[cluster]\ncpu_swap_gb = 1e9\n".into(), ..base.clone() }, "`cluster.cpu_swap_gb`"),
        (
            Case {
                config: "[cluster]\ngpu = \"gpu.toml\"\n".into(),
                gpu: base.gpu.replace("memory_gb = 80", "memory_gb = 1e12"),
                ..base.clone()
            },
            "`memory_gb` must be in",
        ),
        (
            Case {
                config: "[cluster]\nmodel = \"model.toml\"\n".into(),
                model: base
                    .model
                    .lines()
                    .map(|l| {
                        l.split('=').next().unwrap().to_string()
                            + if l.starts_with("name") { "= \"ones\"\n" } else { "= 1\n" }
                    })
                    .collect(),
                ..base.clone()
            },
            "one pool may hold",
        ),
        // A silent busy loop at a saturated clock.
        (
            Case {
                config: "[cluster]\ngpu = \"gpu.toml\"\ntiming = \"analytic\"\n".into(),
                gpu: base.gpu.replace("bf16_tflops = 989", "bf16_tflops = 1e-9"),
                ..base.clone()
            },
            "`bf16_tflops` must be in",
        ),
        (
            Case {
                config: "[cluster]\ngpu = \"gpu.toml\"\ntiming = \"analytic\"\n[workload]\nnum_requests = 3\n".into(),
                gpu: base.gpu.replace("bf16_tflops = 989", "bf16_tflops = 0.001"),
                ..base.clone()
            },
            "simulated time passed",
        ),
        // Mooncake rows: an absurd timestamp, an array, an empty prompt.
        (
            Case {
                config: trace_cfg("mooncake"),
                trace: "{\"timestamp\": 1e300, \"input_length\": 10, \"output_length\": 5}\n".into(),
                ..base.clone()
            },
            "timestamp",
        ),
        (Case { config: trace_cfg("mooncake"), trace: "[1,2,3]\n".into(), ..base.clone() }, "not a JSON object"),
        (
            Case {
                config: trace_cfg("mooncake"),
                trace: "{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 5}\n".into(),
                ..base.clone()
            },
            "input_length",
        ),
        // `quantum_tokens = 0` reached the run and failed there.
        (Case { config: "[scheduler.intra]\nquantum_tokens = 0\n".into(), ..base.clone() }, "quantum_tokens"),
    ];
    for (case, want) in cases {
        let e = load_and_run(&dir, &case).expect_err(want);
        assert!(e.contains(want), "{:?}\n→ {e}\n(wanted {want:?})", case.config);
        assert!(!e.contains('\n'), "{e}");
    }
}

/// A model file named relative to the config resolves against the config's directory, like its
/// trace, whatever the working directory.
#[test]
fn relative_spec_paths_resolve_against_the_config() {
    let dir = scratch().join("nested");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("my-gpu.toml"),
        "name = \"mine\"\nmemory_gb = 80\nbf16_tflops = 989\nhbm_tbytes_per_s = 3.35\nhost_link_gbytes_per_s = 53.7\n",
    )
    .unwrap();
    std::fs::write(dir.join("c.toml"), "[cluster]\ngpu = \"my-gpu.toml\"\nmodel = \"llama-3-8b\"\n").unwrap();
    assert!(!Path::new("my-gpu.toml").exists(), "the test needs the working directory not to hold it");
    let cfg = SimConfig::load(&dir.join("c.toml")).unwrap();
    assert_eq!(cfg.specs().unwrap().1.name, "mine");
}
