//! Tests of [`generate`] and [`WorkloadConfig`]: determinism, scaling, length statistics against
//! `data/README.md`, caps, trace replay and config validation.

use super::*;

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data")
}

fn cfg(toml_text: &str) -> WorkloadConfig {
    WorkloadConfig::from_toml_str(toml_text, "test").unwrap()
}

fn gen(toml_text: &str) -> Vec<RequestSpec> {
    generate(&cfg(toml_text), &data_dir()).unwrap()
}

fn quantile(sorted: &[u32], q: f64) -> u32 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn assert_well_formed(reqs: &[RequestSpec]) {
    for (i, r) in reqs.iter().enumerate() {
        assert_eq!(r.id, RequestId(i as u64));
        assert!(r.answer_tokens >= 1 && r.prompt_tokens >= 1, "{r:?}");
    }
    assert!(reqs.windows(2).all(|w| w[0].arrival <= w[1].arrival), "sorted by arrival");
}

#[test]
fn defaults_are_valid_and_generate_1000_servegen_requests() {
    let c = WorkloadConfig::default();
    c.validate().unwrap();
    assert_eq!(cfg(""), c);
    let reqs = generate(&c, Path::new("/nonexistent")).unwrap();
    assert_eq!(reqs.len(), DEFAULT_NUM_REQUESTS as usize);
    assert_well_formed(&reqs);
    assert!(c.describe().contains("comonotonic draws"), "{}", c.describe());
}

#[test]
fn same_seed_same_workload_different_seed_different() {
    let text = "seed = 42\nnum_requests = 500\n[arrivals]\nkind = \"gamma\"\nrate = 3.0\ncv = 2.0\n";
    let a = gen(text);
    assert_eq!(a, gen(text));
    let b = gen(&text.replace("seed = 42", "seed = 43"));
    assert_eq!(b.len(), a.len());
    assert_ne!(a.iter().map(|r| r.arrival).collect::<Vec<_>>(), b.iter().map(|r| r.arrival).collect::<Vec<_>>());
    assert_ne!(
        a.iter().map(|r| r.reasoning_tokens).collect::<Vec<_>>(),
        b.iter().map(|r| r.reasoning_tokens).collect::<Vec<_>>()
    );
}

#[test]
fn arrival_and_length_streams_are_independent() {
    // Changing the length source must not move a single arrival.
    let poisson = "seed = 9\nnum_requests = 300\n[arrivals]\nkind = \"poisson\"\nrate = 5.0\n";
    let a = gen(poisson);
    let b = gen(&format!("{poisson}[lengths]\nkind = \"lognormal\"\n"));
    assert!(a.iter().zip(&b).all(|(x, y)| x.arrival == y.arrival));
    assert_ne!(a[0].reasoning_tokens, b[0].reasoning_tokens);
}

#[test]
fn rate_scale_doubles_the_rate_of_synthetic_arrivals() {
    let base = "num_requests = 20000\n[arrivals]\nkind = \"poisson\"\nrate = 2.0\n";
    let slow = gen(base);
    let fast = gen(&format!("rate_scale = 2.0\n{base}"));
    let span = |r: &[RequestSpec]| r.last().unwrap().arrival.as_secs_f64();
    // Same draws, exactly half the gaps: the achieved rate doubles.
    assert!((span(&slow) / span(&fast) - 2.0).abs() < 1e-6);
    let achieved = 20_000.0 / span(&fast);
    assert!((achieved - 4.0).abs() < 0.1, "achieved {achieved} req/s");
}

#[test]
fn duration_bounds_synthetic_arrivals() {
    let reqs = gen("duration_s = 60.0\n[arrivals]\nkind = \"poisson\"\nrate = 10.0\n");
    assert!((500..700).contains(&reqs.len()), "{}", reqs.len());
    assert!(reqs.last().unwrap().arrival <= Timestamp::from_secs_f64(60.0));
    let both = gen("duration_s = 60.0\nnum_requests = 100\n[arrivals]\nkind = \"poisson\"\nrate = 10.0\n");
    assert_eq!(both.len(), 100);
}

/// A TOML `steps` process: phases in order, none after the last; without `num_requests` the
/// phases bound the workload (not the 1,000 requests a plain process defaults to).
#[test]
fn stepped_arrivals_from_toml() {
    let text = "[arrivals]\nkind = \"steps\"\nphases = [ { rate = 20.0, duration_s = 50 }, { rate = 100.0, duration_s = 30 } ]\n";
    let c = cfg(text);
    assert!(matches!(&c.arrivals, ArrivalConfig::Steps { cv: None, phases } if phases.len() == 2));
    let said = c.describe();
    assert!(said.contains("rate steps: 20 req/s for 50 s, then 100 req/s for 30 s"), "{said}");
    let reqs = gen(text);
    assert!((3_700..4_300).contains(&reqs.len()), "{}", reqs.len());
    let early = reqs.iter().filter(|r| r.arrival < Timestamp::from_secs_f64(50.0)).count();
    assert!((900..1_100).contains(&early), "{early}");
    assert!(reqs.last().unwrap().arrival <= Timestamp::from_secs_f64(80.0));
    assert_well_formed(&reqs);
}

/// data/README.md, "Reasoning lengths": the ServeGen PMF. With one uniform over the whole-day
/// mixture (not per client-window, as the README's table did) the coupling is stronger than
/// ServeGen's: 63 % of requests reason for < 1,000 tokens and answers cluster around 100–215
/// tokens. Independent draws give 71 %, within the README's 71–76 % band.
#[test]
fn servegen_sampling_reproduces_the_readme_roughly() {
    for (joint, share_range, answer_p50_range) in
        [("comonotonic", (0.60, 0.67), (150, 230)), ("independent", (0.66, 0.76), (150, 260))]
    {
        let reqs = gen(&format!(
            "num_requests = 100000\n[arrivals]\nkind = \"poisson\"\nrate = 100.0\n[lengths]\nkind = \"servegen\"\njoint = \"{joint}\"\n"
        ));
        assert_well_formed(&reqs);
        let n = reqs.len() as f64;
        let share = reqs.iter().filter(|r| r.reasoning_tokens < 1_000).count() as f64 / n;
        assert!((share_range.0..share_range.1).contains(&share), "{joint}: share < 1000 = {share}");
        let mut output: Vec<u32> = reqs.iter().map(|r| r.output_tokens()).collect();
        output.sort_unstable();
        let p50 = quantile(&output, 0.5);
        assert!((760..=830).contains(&p50), "{joint}: output p50 {p50}");
        let mut prompt: Vec<u32> = reqs.iter().map(|r| r.prompt_tokens).collect();
        prompt.sort_unstable();
        assert!((190..=230).contains(&quantile(&prompt, 0.5)), "{joint}: prompt p50");
        let mut answer: Vec<u32> = reqs.iter().map(|r| r.answer_tokens).collect();
        answer.sort_unstable();
        let a50 = quantile(&answer, 0.5);
        assert!((answer_p50_range.0..=answer_p50_range.1).contains(&a50), "{joint}: answer p50 {a50}");
        let mean_ratio = reqs.iter().map(|r| r.reasoning_tokens as f64 / r.output_tokens() as f64).sum::<f64>() / n;
        assert!((0.66..0.74).contains(&mean_ratio), "{joint}: mean ratio {mean_ratio}");
    }
}

#[test]
fn caps_are_honoured() {
    let reqs = gen(
        "num_requests = 20000\nmax_prompt_tokens = 4096\nmax_output_tokens = 2048\n[lengths]\nkind = \"servegen\"\njoint = \"independent\"\n",
    );
    assert_well_formed(&reqs);
    assert!(reqs.iter().all(|r| r.prompt_tokens <= 4096 && r.output_tokens() <= 2048));
    assert!(reqs.iter().any(|r| r.prompt_tokens == 4096), "the cap binds for long prompts");
    assert!(reqs.iter().any(|r| r.output_tokens() == 2048), "the cap binds for long outputs");
    let tiny = gen("num_requests = 50\nmax_output_tokens = 1\n[lengths]\nkind = \"fixed\"\nreasoning_tokens = 900\n");
    assert!(tiny.iter().all(|r| (r.reasoning_tokens, r.answer_tokens) == (0, 1)));
}

#[test]
fn fixed_lengths_are_constant() {
    let reqs = gen("num_requests = 10\n[lengths]\nkind = \"fixed\"\nprompt_tokens = 100\nreasoning_tokens = 0\nanswer_tokens = 7\n");
    assert!(reqs.iter().all(|r| (r.prompt_tokens, r.reasoning_tokens, r.answer_tokens) == (100, 0, 7)));
}

#[test]
fn azure_trace_replays_its_own_timestamps() {
    let text = "[arrivals]\nkind = \"trace\"\n[lengths]\nkind = \"trace\"\npath = \"traces/AzureLLMInferenceTrace_code.csv\"\nformat = \"azure\"\nreason_ratio = { kind = \"fixed\", value = 0.5 }\n";
    let reqs = gen(text);
    assert_eq!(reqs.len(), 8_819);
    assert_well_formed(&reqs);
    assert_eq!(reqs[0].arrival, Timestamp::ZERO);
    // First row: 4808 context tokens, 10 generated → 5 + 5.
    assert_eq!((reqs[0].prompt_tokens, reqs[0].reasoning_tokens, reqs[0].answer_tokens), (4808, 5, 5));
    // Second row is 52 ms later.
    assert_eq!(reqs[1].arrival, Timestamp(52_000_000));
    let span = reqs.last().unwrap().arrival.as_secs_f64();
    let fast = gen(&format!("rate_scale = 2.0\n{text}"));
    assert!((fast.last().unwrap().arrival.as_secs_f64() - span / 2.0).abs() < 1e-6);
    let slow = gen(&format!("time_scale = 3.0\n{text}"));
    assert!((slow.last().unwrap().arrival.as_secs_f64() - span * 3.0).abs() < 1e-6);
    let first_minute = gen(&format!("duration_s = 60.0\n{text}"));
    assert!(first_minute.len() < 1_000 && first_minute.last().unwrap().arrival <= Timestamp::from_secs_f64(60.0));
    assert_eq!(gen(&format!("num_requests = 10\n{text}")).len(), 10);
}

#[test]
fn mooncake_trace_with_servegen_ratio_splits_output() {
    let text = "[arrivals]\nkind = \"trace\"\n[lengths]\nkind = \"trace\"\npath = \"traces/mooncake_conversation_trace.jsonl\"\nformat = \"mooncake\"\n";
    let reqs = gen(text);
    assert_eq!(reqs.len(), 12_031);
    assert_well_formed(&reqs);
    assert_eq!(reqs[0].output_tokens(), 500);
    // Row 1's `hash_ids` ([0, 1, …, 13]) become its content ids; every row carries them.
    assert_eq!(reqs[0].content_ids, (0..14).collect::<Vec<u64>>());
    assert!(reqs.iter().all(|r| r.content_ids.len() as u32 == r.prompt_tokens.div_ceil(TRACE_BLOCK_TOKENS)));
    let mean_ratio =
        reqs.iter().map(|r| r.reasoning_tokens as f64 / r.output_tokens() as f64).sum::<f64>() / reqs.len() as f64;
    assert!((0.65..0.75).contains(&mean_ratio), "mean reason ratio {mean_ratio}");
    assert_eq!(reqs, gen(text), "deterministic");
}

#[test]
fn clipped_mooncake_prompts_keep_the_ids_of_what_is_left() {
    let text = "max_prompt_tokens = 1000\n[arrivals]\nkind = \"trace\"\n[lengths]\nkind = \"trace\"\npath = \"fixtures/mooncake_sample.jsonl\"\nformat = \"mooncake\"\n";
    let got: Vec<(u32, Vec<u64>)> = gen(text).into_iter().map(|r| (r.prompt_tokens, r.content_ids)).collect();
    assert_eq!(got, vec![(1000, vec![0, 1]), (1000, vec![0, 14]), (300, vec![]), (44, vec![7])]);
}

/// Without `[prefix]` and a Mooncake trace, no request has content ids.
#[test]
fn workloads_without_ids_have_none() {
    for text in [
        "",
        "num_requests = 200\n[arrivals]\nkind = \"gamma\"\nrate = 3.0\ncv = 2.0\n[lengths]\nkind = \"lognormal\"\n",
        "num_requests = 20\n[lengths]\nkind = \"fixed\"\nprompt_tokens = 4096\n",
        "[arrivals]\nkind = \"trace\"\n[lengths]\nkind = \"trace\"\npath = \"fixtures/kvfleet_sample.csv\"\nformat = \"kvfleet\"\n",
        "[arrivals]\nkind = \"trace\"\n[lengths]\nkind = \"trace\"\npath = \"fixtures/azure_sample.csv\"\nformat = \"azure\"\n",
        "[arrivals]\nkind = \"trace\"\npath = \"fixtures/mooncake_sample.jsonl\"\nformat = \"mooncake\"\n",
    ] {
        let reqs = gen(text);
        assert!(reqs.iter().all(|r| r.content_ids.is_empty()), "{text:?}");
        assert_eq!(describe_content(&reqs, 16), "no content ids: nothing shared");
        assert_eq!(unbounded_prefix_reuse(&reqs, 16), 0.0);
        assert!(cfg(text).describe().ends_with("; no content ids: nothing shared"), "{}", cfg(text).describe());
    }
}

#[test]
fn describe_says_where_content_ids_come_from() {
    let mooncake =
        "[arrivals]\nkind = \"trace\"\n[lengths]\nkind = \"trace\"\npath = \"t.jsonl\"\nformat = \"mooncake\"\n";
    assert!(cfg(mooncake).describe().ends_with("; content ids from the trace's `hash_ids`"));
    let d = cfg("[prefix]\npopularity = \"zipf\"\nzipf_s = 1.5\n").describe();
    assert!(
        d.ends_with(
            "; content ids: 64 shared system prompts of 4096 tokens (zipf s = 1.5) + log-normal suffixes (median 256, sigma 1)"
        ),
        "{d}"
    );
}

#[test]
fn kvfleet_trace_keeps_explicit_lengths_sorted_by_arrival() {
    let text = "[arrivals]\nkind = \"trace\"\n[lengths]\nkind = \"trace\"\npath = \"fixtures/kvfleet_sample.csv\"\nformat = \"kvfleet\"\n";
    let reqs = gen(text);
    let got: Vec<(u64, u32, u32, u32)> = reqs
        .iter()
        .map(|r| (r.arrival.as_nanos() / 1_000_000, r.prompt_tokens, r.reasoning_tokens, r.answer_tokens))
        .collect();
    // Rows 1.75 s and 1.5 s are out of order in the file; ties (0.25 s) keep file order.
    assert_eq!(
        got,
        vec![
            (0, 128, 600, 200),
            (250, 2048, 1500, 300),
            (250, 64, 0, 40),
            (1500, 900, 350, 1),
            (1750, 512, 12000, 800),
            (3000, 16, 20, 5)
        ]
    );
}

#[test]
fn trace_lengths_with_synthetic_arrivals_wrap_in_file_order() {
    let reqs = gen("num_requests = 14\n[lengths]\nkind = \"trace\"\npath = \"fixtures/kvfleet_sample.csv\"\nformat = \"kvfleet\"\n");
    let prompts: Vec<u32> = reqs.iter().map(|r| r.prompt_tokens).collect();
    assert_eq!(prompts, vec![128, 2048, 64, 512, 900, 16, 128, 2048, 64, 512, 900, 16, 128, 2048]);
}

#[test]
fn arrivals_from_one_trace_lengths_from_servegen() {
    let text = "[arrivals]\nkind = \"trace\"\npath = \"fixtures/azure_sample.csv\"\nformat = \"azure\"\n";
    let reqs = gen(text);
    let ms: Vec<u64> = reqs.iter().map(|r| r.arrival.as_nanos() / 1_000_000).collect();
    assert_eq!(ms, vec![0, 52, 76, 1520]);
}

#[test]
fn relative_paths_resolve_against_base_dir_and_missing_files_are_named() {
    let c = cfg("[arrivals]\nkind = \"trace\"\n[lengths]\nkind = \"trace\"\npath = \"fixtures/kvfleet_sample.csv\"\nformat = \"kvfleet\"\n");
    assert_eq!(generate(&c, &data_dir()).unwrap().len(), 6);
    let err = generate(&c, Path::new("/no/such/dir")).unwrap_err();
    assert!(matches!(err, WorkloadError::Io { .. }));
    assert!(err.to_string().contains("/no/such/dir/fixtures/kvfleet_sample.csv"), "{err}");
    let bad = cfg("[lengths]\nkind = \"servegen\"\npmf = \"fixtures/pmf_bad_ratio.csv\"\n");
    let err = generate(&bad, &data_dir()).unwrap_err().to_string();
    assert!(err.contains("pmf_bad_ratio.csv:4: field `value`"), "{err}");
    let bad = cfg("[arrivals]\nkind = \"trace\"\n[lengths]\nkind = \"trace\"\npath = \"fixtures/azure_bad_digit.csv\"\nformat = \"azure\"\n");
    let err = generate(&bad, &data_dir()).unwrap_err().to_string();
    assert!(
        err.ends_with(
            "azure_bad_digit.csv:3: field `ContextTokens`: invalid integer \"12a\" (invalid digit found in string)"
        ),
        "{err}"
    );
}

#[test]
fn lognormal_lengths_follow_the_synthetic_fallback() {
    let reqs =
        gen("num_requests = 40000\n[lengths]\nkind = \"lognormal\"\nprompt_median = 1000.0\nprompt_sigma = 0.0\n");
    assert!(reqs.iter().all(|r| r.prompt_tokens == 1000));
    let mut reasoning: Vec<u32> = reqs.iter().map(|r| r.reasoning_tokens).collect();
    reasoning.sort_unstable();
    let mut answer: Vec<u32> = reqs.iter().map(|r| r.answer_tokens).collect();
    answer.sort_unstable();
    assert!((570..=630).contains(&quantile(&reasoning, 0.5)));
    assert!((430..=470).contains(&quantile(&answer, 0.5)));
    assert!(reasoning[0] >= 16 && *reasoning.last().unwrap() <= 16_384);
    assert!(answer[0] >= 8 && *answer.last().unwrap() <= 4_096);
}

#[test]
fn lognormal_overflow_clips_onto_the_bound_or_resamples_below_it() {
    let with = |overflow: &str| {
        let text = format!(
            "num_requests = 20000\n[lengths]\nkind = \"lognormal\"\nreasoning_max = 2000\noverflow = \"{overflow}\"\n"
        );
        let reasoning: Vec<u32> = gen(&text).iter().map(|r| r.reasoning_tokens).collect();
        assert!(reasoning.iter().all(|&r| (16..=2000).contains(&r)), "{overflow}: out of bounds");
        reasoning.iter().filter(|&&r| r == 2000).count()
    };
    // P(lognormal(600, 1) > 2000) ≈ 11.5 %: clipping piles those requests onto 2000 tokens,
    // resampling spreads them below it.
    let (clipped, resampled) = (with("clip"), with("resample"));
    assert!((1800..2800).contains(&clipped), "clip put {clipped} of 20000 at the bound");
    assert!(resampled < 20, "resample put {resampled} of 20000 at the bound");
}

#[test]
fn full_toml_round_trips() {
    let text = r#"
seed = 3
num_requests = 10
duration_s = 120.0
rate_scale = 1.5
time_scale = 1.0
max_prompt_tokens = 8192
max_output_tokens = 16384

[prefix]
system_prompts = 8
system_tokens = 1024
popularity = "zipf"
zipf_s = 0.8
suffix_median = 100.0
suffix_sigma = 0.5

[arrivals]
kind = "gamma"
rate = 2.0
cv = 3.0

[lengths]
kind = "trace"
path = "traces/AzureLLMInferenceTrace_conv.csv"
format = "azure"
reason_ratio = { kind = "servegen" }
"#;
    let c = cfg(text);
    assert_eq!(c.arrivals, ArrivalConfig::Gamma { rate: 2.0, cv: 3.0 });
    assert_eq!(
        c.lengths,
        LengthConfig::Trace(TraceLengths {
            path: "traces/AzureLLMInferenceTrace_conv.csv".into(),
            format: TraceFormat::Azure,
            reason_ratio: Some(ReasonRatioConfig::Servegen { pmf: None }),
        })
    );
    assert_eq!(
        c.prefix,
        Some(PrefixConfig {
            system_prompts: 8,
            system_tokens: 1024,
            popularity: Popularity::Zipf,
            zipf_s: 0.8,
            suffix_median: 100.0,
            suffix_sigma: 0.5,
            multi_turn: None,
        })
    );
    assert_eq!(cfg("[prefix]\n").prefix, Some(PrefixConfig::default()));
    let back = toml::to_string(&c).unwrap();
    assert_eq!(cfg(&back), c);
    assert_eq!(generate(&c, &data_dir()).unwrap().len(), 10);
}

/// Bad configs: (TOML, words the error must contain — the field's name first).
#[test]
fn invalid_configs_name_the_field() {
    let table: &[(&str, &str)] = &[
        ("[arrivals]\nkind = \"poisson\"\nrate = -1.0\n", "`arrivals.rate`: must be a positive finite number, got -1"),
        ("[arrivals]\nkind = \"poisson\"\nrate = 0.0\n", "`arrivals.rate`"),
        ("[arrivals]\nkind = \"gamma\"\nrate = 1.0\ncv = 0.0\n", "`arrivals.cv`"),
        ("[arrivals]\nkind = \"gamma\"\nrate = 1.0\ncv = -2.0\n", "`arrivals.cv`"),
        ("rate_scale = 0.0\n", "`rate_scale`"),
        ("time_scale = -1.0\n", "`time_scale`"),
        ("duration_s = 0.0\n", "`duration_s`"),
        ("num_requests = 0\n", "`num_requests`"),
        ("num_requests = 1000000000000\n", "`num_requests`"),
        ("duration_s = 1e12\n[arrivals]\nkind = \"poisson\"\nrate = 1000.0\n", "`duration_s`: about 1.000e15 requests"),
        ("[arrivals]\nkind = \"steps\"\nphases = []\n", "`arrivals.phases`: needs at least one"),
        (
            "[arrivals]\nkind = \"steps\"\nphases = [{ rate = 1.0, duration_s = 5 }, { rate = -1.0, duration_s = 5 }]\n",
            "`arrivals.phases[1].rate`: must be a finite number >= 0, got -1",
        ),
        ("[arrivals]\nkind = \"steps\"\nphases = [{ rate = nan, duration_s = 5 }]\n", "`arrivals.phases[0].rate`"),
        ("[arrivals]\nkind = \"steps\"\nphases = [{ rate = 1.0, duration_s = 0 }]\n", "`arrivals.phases[0].duration_s`"),
        ("[arrivals]\nkind = \"steps\"\nphases = [{ rate = 1.0, duration_s = inf }]\n", "`arrivals.phases[0].duration_s`"),
        ("[arrivals]\nkind = \"steps\"\nphases = [{ rate = 0.0, duration_s = 5 }]\n", "`arrivals.phases`: every phase has rate 0"),
        ("[arrivals]\nkind = \"steps\"\ncv = 0.0\nphases = [{ rate = 1.0, duration_s = 5 }]\n", "`arrivals.cv`"),
        ("[arrivals]\nkind = \"steps\"\nphases = [{ rate = 1e9, duration_s = 1e9 }]\n", "`arrivals.phases`: about"),
        ("[arrivals]\nkind = \"trace\"\n", "`arrivals.path`"),
        ("[arrivals]\nkind = \"trace\"\npath = \"x.csv\"\n", "`arrivals.format`"),
        ("max_prompt_tokens = 0\n", "`max_prompt_tokens`"),
        ("max_output_tokens = 0\n", "`max_output_tokens`"),
        ("[lengths]\nkind = \"fixed\"\nanswer_tokens = 0\n", "`lengths.answer_tokens`"),
        ("[lengths]\nkind = \"fixed\"\nprompt_tokens = 0\n", "`lengths.prompt_tokens`"),
        ("[lengths]\nkind = \"lognormal\"\nreasoning_sigma = -1.0\n", "`lengths.reasoning_sigma`"),
        ("[lengths]\nkind = \"lognormal\"\nanswer_median = 0.0\n", "`lengths.answer_median`"),
        ("[lengths]\nkind = \"lognormal\"\nprompt_min = 100\nprompt_max = 10\n", "`lengths.prompt_min`"),
        ("[lengths]\nkind = \"lognormal\"\nanswer_min = 0\n", "`lengths.answer_min`"),
        (
            "[lengths]\nkind = \"trace\"\npath = \"a.csv\"\nformat = \"azure\"\nreason_ratio = { kind = \"fixed\", value = 1.5 }\n",
            "`lengths.reason_ratio.value`: must be in [0, 1], got 1.5",
        ),
        (
            "[lengths]\nkind = \"trace\"\npath = \"a.csv\"\nformat = \"kvfleet\"\nreason_ratio = { kind = \"fixed\", value = 0.5 }\n",
            "`lengths.reason_ratio`: not used",
        ),
        ("[prefix]\nsystem_prompts = 0\n", "`prefix.system_prompts`: must be in [1, 1000000], got 0"),
        ("[prefix]\nsystem_prompts = 1000001\n", "`prefix.system_prompts`"),
        ("[prefix]\nsystem_tokens = 0\n", "`prefix.system_tokens`: must be a positive multiple of 512"),
        ("[prefix]\nsystem_tokens = 1000\n", "`prefix.system_tokens`: must be a positive multiple of 512"),
        ("[prefix]\nsystem_tokens = 16777216\n", "`prefix.system_tokens`"),
        ("[prefix]\nzipf_s = 0.0\n", "`prefix.zipf_s`: must be a positive finite number"),
        ("[prefix]\npopularity = \"zipf\"\nzipf_s = -1.0\n", "`prefix.zipf_s`"),
        ("[prefix]\nzipf_s = inf\n", "`prefix.zipf_s`"),
        ("[prefix]\nsuffix_median = 0.0\n", "`prefix.suffix_median`"),
        ("[prefix]\nsuffix_median = nan\n", "`prefix.suffix_median`"),
        ("[prefix]\nsuffix_sigma = -0.5\n", "`prefix.suffix_sigma`: must be finite and >= 0, got -0.5"),
        ("[prefix]\nsuffix_sigma = inf\n", "`prefix.suffix_sigma`"),
    ];
    for &(text, want) in table {
        let err = WorkloadConfig::from_toml_str(text, "bad.toml").expect_err(text).to_string();
        assert!(err.contains(want), "{text:?}: {err}");
    }
}

/// Unknown or misspelt keys are rejected by serde, naming the key.
#[test]
fn unknown_fields_are_rejected() {
    let table: &[(&str, &str)] = &[
        ("num_request = 5\n", "num_request"),
        ("[arrivals]\nkind = \"poisson\"\nrate = 1.0\ncv = 2.0\n", "cv"),
        ("[arrivals]\nkind = \"uniform\"\n", "uniform"),
        ("[arrivals]\nkind = \"steps\"\nphases = [{ rate = 1.0, duration = 5 }]\n", "duration"),
        ("[arrivals]\nkind = \"steps\"\n", "phases"),
        ("[lengths]\nkind = \"servegen\"\njoint = \"gaussian\"\n", "gaussian"),
        ("[lengths]\nkind = \"lognormal\"\nreasoning_mean = 3.0\n", "reasoning_mean"),
        ("[lengths]\nkind = \"fixed\"\nprompt = 3\n", "prompt"),
        ("[lengths]\nkind = \"trace\"\npath = \"a\"\nformat = \"burstgpt\"\n", "burstgpt"),
        ("[prefix]\npopularity = \"pareto\"\n", "popularity"),
        ("[prefix]\npopularity = \"pareto\"\n", "pareto"),
        ("[prefix]\nsystem_prompt = 3\n", "system_prompt"),
        ("[prefix]\nsystem_prompts = -3\n", "system_prompts"),
        ("[prefix]\nsystem_tokens = 1.5\n", "system_tokens"),
        ("prefix = 3\n", "prefix"),
    ];
    for &(text, want) in table {
        let err = WorkloadConfig::from_toml_str(text, "bad.toml").expect_err(text);
        assert!(matches!(err, WorkloadError::Toml { .. }), "{text:?}: {err:?}");
        let msg = err.to_string();
        assert!(msg.contains("bad.toml") && msg.contains(want), "{text:?}: {msg}");
    }
}
