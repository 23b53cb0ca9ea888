//! Random prefill/decode clusters run to the end: whatever the split, Arrow or a static one,
//! pulled or pushed handoffs, overlap, disaggregation rule, memory and prompt sizes (up to nearly
//! an instance's whole KV), instances whose handoffs fail their checksum (retried, then prefilled
//! again elsewhere), every request of the workload finishes or is rejected exactly once;
//! a run never stops with requests held for a handoff nobody takes ([`kvfleet_sim::cluster::Stalled`]).

use kvfleet_sim::config::SimConfig;
use kvfleet_sim::run_one;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Pd {
    instances: u32,
    prefill: u32,
    kv_gb: &'static str,
    cpu_gb: &'static str,
    chunk: Option<u32>,
    arrow: bool,
    push: bool,
    overlap: &'static str,
    disaggregate: &'static str,
    interval_s: &'static str,
    gbps: &'static str,
    seed: u64,
    requests: u32,
    rate: &'static str,
    prompt: &'static str,
    answer: &'static str,
    /// Instances sending corrupt blocks, as a bit mask over the instance ids.
    corrupt: u32,
}

impl Pd {
    fn toml(&self) -> String {
        let chunk = self.chunk.map_or(String::new(), |c| format!("[scheduler.intra]\nchunked_prefill_tokens = {c}\n"));
        // Overlap by chunk needs chunks.
        let overlap = if self.overlap == "chunk" && self.chunk.is_none() { "none" } else { self.overlap };
        let corrupt: Vec<String> =
            (0..self.instances).filter(|i| self.corrupt & (1 << i) != 0).map(|i| i.to_string()).collect();
        let corrupt = format!("[migration]\ncorrupt_sends_from = [{}]\n", corrupt.join(", "));
        format!(
            "[cluster]\ninstances = {}\nmodel = \"r1-distill-qwen-32b\"\ngpu = \"h100-80gb\"\nkv_cache_gb = {}\n\
             cpu_swap_gb = {}\n[scheduler]\npolicy = \"fcfs+least-kv\"\n{chunk}[pd]\nprefill_instances = {}\n\
             policy = \"{}\"\nhandoff = \"{}\"\noverlap = \"{overlap}\"\ndisaggregate = \"{}\"\n\
             [pd.arrow]\nslo_ttft_s = 1.5\ncooldown_s = 2.0\ninterval_s = {}\n[slo]\nttft_s = 1.5\ntpot_s = 0.15\n\
             [link]\nbandwidth_gbps = {}\n{corrupt}[workload]\nseed = {}\nnum_requests = {}\n[workload.arrivals]\n\
             kind = \"gamma\"\nrate = {}\ncv = 3.0\n[workload.lengths]\nkind = \"lognormal\"\nprompt_median = {}\n\
             prompt_sigma = 0.8\nprompt_max = 3900\nreasoning_median = 20.0\nreasoning_sigma = 0.5\n\
             reasoning_max = 100\nanswer_median = {}\nanswer_sigma = 0.8\nanswer_max = 150\n",
            self.instances,
            self.kv_gb,
            self.cpu_gb,
            self.prefill,
            if self.arrow { "arrow" } else { "static" },
            if self.push { "push" } else { "pull" },
            self.disaggregate,
            self.interval_s,
            self.gbps,
            self.seed,
            self.requests,
            self.rate,
            self.prompt,
            self.answer,
        )
    }
}

fn pd() -> impl Strategy<Value = Pd> {
    let shape = (2..=5u32).prop_flat_map(|n| (Just(n), 1..n));
    (
        shape,
        // 4,096 tokens of this model per GiB: 2,048 to 16,384.
        prop::sample::select(&["0.536870912", "1.073741824", "4.294967296"][..]),
        prop::sample::select(&["0", "0.004194304", "1.073741824"][..]),
        prop::option::of(prop::sample::select(&[256u32, 2048][..])),
        (any::<bool>(), any::<bool>()),
        prop::sample::select(&["none", "chunk", "layer"][..]),
        prop::sample::select(&["always", "never", "prefix-threshold"][..]),
        (prop::sample::select(&["0.25", "1.0"][..]), prop::sample::select(&["2", "100"][..])),
        (any::<u64>(), 5..25u32, prop::sample::select(&["1.0", "4.0", "16.0"][..])),
        (prop::sample::select(&["200.0", "1000.0", "3000.0"][..]), prop::sample::select(&["20.0", "100.0"][..])),
        // Mostly none; else any subset (all of them too).
        prop_oneof![3 => Just(0u32), 1 => 0..32u32],
    )
        .prop_map(
            |(
                (instances, prefill),
                kv_gb,
                cpu_gb,
                chunk,
                (arrow, push),
                overlap,
                disaggregate,
                (interval_s, gbps),
                (seed, requests, rate),
                (prompt, answer),
                corrupt,
            )| Pd {
                instances,
                prefill,
                kv_gb,
                cpu_gb,
                chunk,
                arrow,
                push,
                overlap,
                disaggregate,
                interval_s,
                gbps,
                seed,
                requests,
                rate,
                prompt,
                answer,
                corrupt,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_request_finishes_or_is_rejected_once_whatever_the_split(case in pd()) {
        let text = case.toml();
        let dir = std::env::temp_dir();
        let cfg: SimConfig = match SimConfig::parse(&text, "pd-fuzz") {
            Ok(cfg) => cfg,
            Err(e) => return Err(TestCaseError::fail(format!("{e}\n{text}"))),
        };
        let r = run_one(&cfg, &cfg.scheduler.policy, None, &dir, |_| {})
            .map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        let mut ids: Vec<u64> = r.records.iter().map(|rec| rec.id.0).collect();
        ids.sort_unstable();
        prop_assert_eq!(ids, (0..u64::from(case.requests)).collect::<Vec<_>>(), "each once\n{}", text);
        for rec in &r.records {
            prop_assert!(rec.rejected || rec.finished_on.is_some(), "{:?}\n{}", rec, text);
        }
    }
}
