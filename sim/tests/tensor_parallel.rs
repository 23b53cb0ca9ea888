//! Instances of several GPUs (tensor parallelism) through the whole simulator: a decode pool of
//! two-GPU instances behind one-GPU prefill instances (Arrow's heterogeneous deployment) decodes
//! faster and prefills as before, under a static split and under Arrow.

use kvfleet_sim::config::SimConfig;
use kvfleet_sim::{run_one, RunResult};
use std::path::Path;

/// 2 prefill + 2 decode H20s serving Qwen3-32B; the decoders span `decode_tp` GPUs.
fn config(decode_tp: u32, policy: &str) -> SimConfig {
    let text = format!(
        r#"
[cluster]
instances = 4
model = "qwen3-32b"
gpu = "h20-141gb"
timing = "analytic"
decode_tensor_parallel_size = {decode_tp}

[scheduler]
policy = "fcfs+least-kv"

[pd]
prefill_instances = 2
policy = "{policy}"

[slo]
ttft_s = 6.0
tpot_s = 0.175

[workload]
seed = 5
num_requests = 120
[workload.arrivals]
kind = "poisson"
rate = 0.5
[workload.lengths]
kind = "lognormal"
prompt_median = 1500.0
prompt_sigma = 0.5
reasoning_median = 1.0
reasoning_sigma = 0.0
answer_median = 200.0
answer_sigma = 0.3
"#
    );
    SimConfig::parse(&text, "tensor-parallel test").expect("valid config")
}

fn run(cfg: &SimConfig) -> RunResult {
    run_one(cfg, &cfg.scheduler.policy, None, Path::new("."), |_| {}).expect("runs")
}

fn p50(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds from the first token to the last, per output token after the first.
fn tpot_p50(r: &RunResult) -> f64 {
    p50(r
        .records
        .iter()
        .filter_map(|q| {
            let (first, last) = (q.first_token?, q.finish?);
            let n = (q.reasoning_tokens + q.answer_tokens).checked_sub(1).filter(|&n| n > 0)?;
            Some(last.saturating_since(first).as_secs_f64() / f64::from(n))
        })
        .collect())
}

fn first_token_p50(r: &RunResult) -> f64 {
    p50(r.records.iter().map(|q| q.first_token.expect("finished").saturating_since(q.arrival).as_secs_f64()).collect())
}

#[test]
fn two_gpu_decoders_decode_faster_and_leave_prefill_alone() {
    for policy in ["static", "arrow"] {
        let (one, two) = (run(&config(1, policy)), run(&config(2, policy)));
        for r in [&one, &two] {
            assert_eq!(r.records.len(), 120, "{policy}: every request once");
            assert!(r.records.iter().all(|q| q.finish.is_some()), "{policy}: every request finished");
        }
        let (t1, t2) = (tpot_p50(&one), tpot_p50(&two));
        assert!(t2 < 0.8 * t1, "{policy}: TPOT p50 {t1:.4} s with one GPU per decoder, {t2:.4} s with two");
        if policy == "static" {
            // The prefill instances are the same hardware in both runs, and lightly loaded.
            let (f1, f2) = (first_token_p50(&one), first_token_p50(&two));
            assert!((f1 - f2).abs() < 0.01 * f1, "first token p50 {f1:.3} vs {f2:.3} s");
        }
    }
}

#[test]
fn a_decode_degree_needs_a_decode_pool() {
    let mut cfg = config(2, "static");
    cfg.pd.prefill_instances = 0;
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.contains("decode_tensor_parallel_size") && e.contains("prefill_instances"), "{e}");
}
