//! Shared prompt prefixes: a synthetic workload whose prompts start with one of a few system
//! prompts (`[prefix]` in a workload file), and how much of a workload's prompts a prefix cache
//! could reuse.
//!
//! A request's content is told by [`RequestSpec::content_ids`], one id per
//! [`TRACE_BLOCK_TOKENS`] prompt tokens: equal ids at equal positions are equal text. Here system
//! prompt `p` is the ids `p · 1,000,000 + k` (`k = 0, 1, …`), and the whole 512-token units of a
//! request's suffix get ids `2⁴⁰ + i · 2¹⁵ + k` unique to request `i`, so two requests share
//! exactly their system prompt's KV.

use super::{invalid, positive, WorkloadError};
use crate::kv::{prompt_block_hashes, tiles_content_unit, BlockHash, TRACE_BLOCK_TOKENS};
use crate::request::{RequestSpec, MAX_REQUEST_TOKENS};
use crate::rng::SimRng;
use crate::time::Timestamp;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Most distinct system prompts (their ids stay below the suffix ids).
pub const MAX_SYSTEM_PROMPTS: u32 = 1_000_000;
/// Id stride between system prompts: system prompt `p` has ids `p · SYSTEM_ID_STRIDE + k`.
const SYSTEM_ID_STRIDE: u64 = 1_000_000;
/// First suffix id; request `i`'s suffix units have ids `SUFFIX_ID_BASE + i · SUFFIX_ID_STRIDE + k`.
const SUFFIX_ID_BASE: u64 = 1 << 40;
/// Most content ids one request can hold (2¹⁵): the suffix ids of two requests never overlap.
const SUFFIX_ID_STRIDE: u64 = (MAX_REQUEST_TOKENS / TRACE_BLOCK_TOKENS) as u64;

/// How often each system prompt is chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Popularity {
    /// Every system prompt equally often.
    #[default]
    Uniform,
    /// System prompt `p` (0-based) with weight 1 / (p + 1)^`zipf_s`: prompt 0 is the most popular.
    Zipf,
}

impl Popularity {
    /// Lowercase name (`uniform`, `zipf`), as in configs.
    pub fn name(self) -> &'static str {
        match self {
            Popularity::Uniform => "uniform",
            Popularity::Zipf => "zipf",
        }
    }
}

/// Shared system prompts (`[prefix]` in a workload file, `[workload.prefix]` in a simulation
/// config). Each request's prompt is one system prompt followed by a log-normal user suffix; this
/// replaces the prompt length drawn from `[lengths]`, whose reasoning and answer lengths stay.
///
/// ```toml
/// [prefix]
/// system_prompts = 64
/// system_tokens = 4096
/// popularity = "zipf"
/// zipf_s = 1.0
/// suffix_median = 256.0
/// suffix_sigma = 1.0
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixConfig {
    /// Distinct system prompts (at least 1, at most [`MAX_SYSTEM_PROMPTS`]).
    pub system_prompts: u32,
    /// Length of every system prompt, tokens: a positive multiple of [`TRACE_BLOCK_TOKENS`] (512).
    pub system_tokens: u32,
    /// How the system prompt of a request is chosen.
    pub popularity: Popularity,
    /// Zipf exponent (`popularity = "zipf"`); positive.
    pub zipf_s: f64,
    /// Median length of the user suffix after the system prompt, tokens.
    pub suffix_median: f64,
    /// Sigma of the suffix length's underlying normal (0: every suffix is the median).
    pub suffix_sigma: f64,
    /// Multi-turn conversations (`[workload.prefix.multi_turn]`): each arrival of the arrival
    /// process starts a conversation whose later turns resend its history.
    pub multi_turn: Option<MultiTurn>,
}

/// Multi-turn conversations (ours): a conversation's first turn is a system prompt plus a suffix;
/// each later turn arrives an exponential think time after the one before (open loop: counted
/// from that turn's arrival, not its completion) with prompt = the previous prompt + its answer +
/// a new log-normal message, so it shares the whole previous prompt. Turns per conversation are
/// geometric; a conversation that would outgrow a request ends early.
///
/// ```toml
/// [prefix.multi_turn]
/// turns_mean = 4.0
/// think_time_s = 15.0
/// message_median = 200.0
/// message_sigma = 1.0
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MultiTurn {
    /// Mean turns per conversation (geometric on 1, 2, …); at least 1.
    pub turns_mean: f64,
    /// Mean think time between a turn's arrival and the next turn's, seconds (exponential); ≥ 0.
    pub think_time_s: f64,
    /// Median length of a later turn's new message, tokens.
    pub message_median: f64,
    /// Sigma of the message length's underlying normal.
    pub message_sigma: f64,
}

impl Default for MultiTurn {
    fn default() -> Self {
        MultiTurn { turns_mean: 4.0, think_time_s: 15.0, message_median: 200.0, message_sigma: 1.0 }
    }
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            system_prompts: 64,
            system_tokens: 4096,
            popularity: Popularity::Uniform,
            zipf_s: 1.0,
            suffix_median: 256.0,
            suffix_sigma: 1.0,
            multi_turn: None,
        }
    }
}

impl PrefixConfig {
    /// Checks every value; messages name the field by its dotted path (`prefix.system_tokens`).
    pub fn validate(&self) -> Result<(), WorkloadError> {
        if !(1..=MAX_SYSTEM_PROMPTS).contains(&self.system_prompts) {
            let message = format!("must be in [1, {MAX_SYSTEM_PROMPTS}], got {}", self.system_prompts);
            return Err(invalid("prefix.system_prompts", message));
        }
        let most = MAX_REQUEST_TOKENS - TRACE_BLOCK_TOKENS;
        let t = self.system_tokens;
        if t == 0 || !t.is_multiple_of(TRACE_BLOCK_TOKENS) || t > most {
            let message = format!("must be a positive multiple of {TRACE_BLOCK_TOKENS} up to {most}, got {t}");
            return Err(invalid("prefix.system_tokens", message));
        }
        positive("prefix.zipf_s", self.zipf_s)?;
        positive("prefix.suffix_median", self.suffix_median)?;
        if !(self.suffix_sigma.is_finite() && self.suffix_sigma >= 0.0) {
            let message = format!("must be finite and >= 0, got {}", self.suffix_sigma);
            return Err(invalid("prefix.suffix_sigma", message));
        }
        if let Some(m) = &self.multi_turn {
            if !(m.turns_mean.is_finite() && (1.0..=1e6).contains(&m.turns_mean)) {
                let message = format!("must be in [1, 1e6], got {}", m.turns_mean);
                return Err(invalid("prefix.multi_turn.turns_mean", message));
            }
            if !(m.think_time_s.is_finite() && (0.0..=1e7).contains(&m.think_time_s)) {
                let message = format!("must be in [0, 1e7] seconds, got {}", m.think_time_s);
                return Err(invalid("prefix.multi_turn.think_time_s", message));
            }
            positive("prefix.multi_turn.message_median", m.message_median)?;
            if !(m.message_sigma.is_finite() && m.message_sigma >= 0.0) {
                let message = format!("must be finite and >= 0, got {}", m.message_sigma);
                return Err(invalid("prefix.multi_turn.message_sigma", message));
            }
        }
        Ok(())
    }

    /// One clause for [`super::WorkloadConfig::describe`].
    pub(super) fn describe(&self) -> String {
        let popularity = match self.popularity {
            Popularity::Uniform => "uniform".to_string(),
            Popularity::Zipf => format!("zipf s = {}", self.zipf_s),
        };
        let turns = self.multi_turn.as_ref().map_or(String::new(), |m| {
            format!(
                "; multi-turn: {} turns per conversation (mean, geometric), think time {} s (mean, \
                 exponential), messages log-normal (median {}, sigma {})",
                m.turns_mean, m.think_time_s, m.message_median, m.message_sigma
            )
        });
        format!(
            "content ids: {} shared system prompts of {} tokens ({popularity}) + log-normal suffixes \
             (median {}, sigma {}){turns}",
            self.system_prompts, self.system_tokens, self.suffix_median, self.suffix_sigma
        )
    }
}

/// Draws each request's system prompt and suffix (validated config only).
pub(super) struct PrefixSampler<'a> {
    cfg: &'a PrefixConfig,
    /// Zipf: cumulative weights of the system prompts (empty for uniform popularity).
    cumulative: Vec<f64>,
}

impl<'a> PrefixSampler<'a> {
    /// Whether requests come in multi-turn conversations.
    pub(super) fn multi_turn(&self) -> bool {
        self.cfg.multi_turn.is_some()
    }

    pub(super) fn new(cfg: &'a PrefixConfig) -> Self {
        let cumulative = match cfg.popularity {
            Popularity::Uniform => Vec::new(),
            Popularity::Zipf => (1..=cfg.system_prompts)
                .scan(0.0, |sum, rank| {
                    *sum += f64::from(rank).powf(-cfg.zipf_s);
                    Some(*sum)
                })
                .collect(),
        };
        PrefixSampler { cfg, cumulative }
    }

    /// Prompt length and content ids of request `i`, whose output holds `output_tokens`: the
    /// suffix has at least one token and is clipped so that the request fits
    /// [`MAX_REQUEST_TOKENS`]. Draws from `rng` only (a system prompt, then a suffix length).
    pub(super) fn draw(&self, i: usize, output_tokens: u32, rng: &mut SimRng) -> (u32, Vec<u64>) {
        let n = self.cfg.system_prompts;
        let p = match self.cfg.popularity {
            Popularity::Uniform => rng.below(u64::from(n)),
            Popularity::Zipf => {
                let total = self.cumulative.last().copied().unwrap_or(0.0);
                let target = rng.f64() * total;
                self.cumulative.partition_point(|&c| c <= target).min(n as usize - 1) as u64
            }
        };
        let system = self.cfg.system_tokens;
        let room = MAX_REQUEST_TOKENS.saturating_sub(system).saturating_sub(output_tokens).max(1);
        // `as u32` saturates (and maps NaN to 0) before the clamp: never panics.
        let suffix = (rng.lognormal(self.cfg.suffix_median, self.cfg.suffix_sigma).round() as u32).clamp(1, room);
        let system_units = system / TRACE_BLOCK_TOKENS;
        let suffix_units = suffix / TRACE_BLOCK_TOKENS;
        let mut ids = Vec::with_capacity((system_units + suffix_units) as usize);
        ids.extend((0..u64::from(system_units)).map(|k| p * SYSTEM_ID_STRIDE + k));
        let base = SUFFIX_ID_BASE + i as u64 * SUFFIX_ID_STRIDE;
        ids.extend((0..u64::from(suffix_units)).map(|k| base + k));
        (system + suffix, ids)
    }
}

/// One request of a multi-turn workload before ids are given: (arrival, prompt tokens, reasoning
/// tokens, answer tokens, content ids).
pub(super) type Turn = (Timestamp, u32, u32, u32, Vec<u64>);

impl PrefixSampler<'_> {
    /// Up to `n` requests of multi-turn conversations (`multi_turn` must be set), in arrival order:
    /// conversation `c` starts at `starts[c]` (conversations are started until `n` turns exist);
    /// `output(k)` draws the (reasoning, answer) tokens of the k-th turn generated. Content ids of
    /// a conversation are its own (`2⁴⁰ + c · 2¹⁵ + k` for whole 512-token units of its history
    /// after the system prompt), so every turn repeats the ids of the turn before.
    pub(super) fn conversations(
        &self,
        starts: &[Timestamp],
        n: usize,
        mut output: impl FnMut(usize) -> (u32, u32),
        rng: &mut SimRng,
    ) -> Vec<Turn> {
        let m = self.cfg.multi_turn.as_ref().expect("multi-turn conversations configured");
        // Geometric on 1, 2, …: P(another turn) = 1 − 1 / mean.
        let more = 1.0 - 1.0 / m.turns_mean;
        let mut turns = Vec::with_capacity(n);
        for (c, &start) in starts.iter().enumerate() {
            if turns.len() >= n {
                break;
            }
            let (reasoning, answer) = output(turns.len());
            let (mut prompt, mut ids) = self.draw(c, reasoning.saturating_add(answer), rng);
            let mut at = start;
            turns.push((at, prompt, reasoning, answer, ids.clone()));
            let base = SUFFIX_ID_BASE + c as u64 * SUFFIX_ID_STRIDE;
            let system_units = (self.cfg.system_tokens / TRACE_BLOCK_TOKENS) as usize;
            let mut last_answer = answer;
            while turns.len() < n && rng.f64() < more {
                let message = (rng.lognormal(m.message_median, m.message_sigma).round() as u32).max(1);
                let think = if m.think_time_s > 0.0 { rng.exponential(1.0 / m.think_time_s) } else { 0.0 };
                let (reasoning, answer) = output(turns.len());
                let next = prompt.saturating_add(last_answer).saturating_add(message);
                if u64::from(next) + u64::from(reasoning) + u64::from(answer) > u64::from(MAX_REQUEST_TOKENS) {
                    break; // the conversation outgrew a request
                }
                prompt = next;
                at += crate::time::TimeSpan::from_secs_f64(think);
                // The history's whole units past the system prompt: this conversation's ids.
                let units = (prompt / TRACE_BLOCK_TOKENS) as usize;
                ids.truncate(system_units);
                ids.extend((0..units.saturating_sub(system_units) as u64).map(|k| base + k));
                turns.push((at, prompt, reasoning, answer, ids.clone()));
                last_answer = answer;
            }
        }
        turns.sort_by_key(|t| t.0);
        turns
    }
}

/// Share of all prompt tokens of `requests` that an unbounded prefix cache of `block_size`-token
/// blocks would serve: requests are taken in arrival order (ties in slice order); a request hits
/// the leading run of its full blocks ([`prompt_block_hashes`]) that an earlier request already
/// held, at most ⌊(prompt − 1) / block_size⌋ blocks (the last prompt token is always computed, as
/// in vLLM). 0 without content ids, or when `block_size` does not divide [`TRACE_BLOCK_TOKENS`].
pub fn unbounded_prefix_reuse(requests: &[RequestSpec], block_size: u32) -> f64 {
    prefix_reuse(requests, block_size).0
}

/// [`unbounded_prefix_reuse`] with and without the cap of one computed prompt token: (capped,
/// uncapped).
///
/// Exactly the set-of-every-block-hash-seen computation, in less memory: since block hashes chain,
/// block `u · per + s` (`per` blocks to a content id) of an earlier request has the hash of this
/// request's block iff that request had the same hash at block `u · per` and held at least `s + 1`
/// blocks of unit `u`. So one entry per unit (its first block's hash → most blocks of it seen).
pub(super) fn prefix_reuse(requests: &[RequestSpec], block_size: u32) -> (f64, f64) {
    let total: u64 = requests.iter().map(|r| u64::from(r.prompt_tokens)).sum();
    if total == 0 || !tiles_content_unit(block_size) {
        return (0.0, 0.0);
    }
    let per = (TRACE_BLOCK_TOKENS / block_size) as usize;
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by_key(|&i| requests[i].arrival);
    let mut seen: HashMap<BlockHash, usize> = HashMap::new();
    let (mut capped_blocks, mut hit_blocks) = (0u64, 0u64);
    for i in order {
        let r = &requests[i];
        if r.content_ids.is_empty() {
            continue;
        }
        let hashes = prompt_block_hashes(&r.content_ids, r.prompt_tokens, block_size);
        let mut hits = 0usize;
        for unit in hashes.chunks(per) {
            let held = seen.get(&unit[0]).copied().unwrap_or(0).min(unit.len());
            hits += held;
            if held < unit.len() {
                break;
            }
        }
        hit_blocks += hits as u64;
        capped_blocks += hits.min((r.prompt_tokens.saturating_sub(1) / block_size) as usize) as u64;
        for unit in hashes.chunks(per) {
            let held = seen.entry(unit[0]).or_insert(0);
            *held = (*held).max(unit.len());
        }
    }
    let share = |blocks: u64| (blocks * u64::from(block_size)) as f64 / total as f64;
    (share(capped_blocks), share(hit_blocks))
}

/// One line on what the prompts of `requests` share, for run summaries: how many carry content ids
/// and the [`unbounded_prefix_reuse`] with `block_size`-token blocks, or that nothing is shared.
pub fn describe_content(requests: &[RequestSpec], block_size: u32) -> String {
    let with_ids = requests.iter().filter(|r| !r.content_ids.is_empty()).count();
    if with_ids == 0 {
        return "no content ids: nothing shared".into();
    }
    let reuse = unbounded_prefix_reuse(requests, block_size) * 100.0;
    format!(
        "content ids: {} of {} requests, {reuse:.1} % of prompt tokens reusable by an unbounded cache of \
         {block_size}-token blocks",
        thousands(with_ids),
        thousands(requests.len())
    )
}

/// `12031` → `12,031`.
fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (k, c) in digits.chars().enumerate() {
        if k > 0 && (digits.len() - k).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::RequestId;
    use crate::time::Timestamp;
    use crate::workload::{generate, WorkloadConfig};
    use std::collections::HashSet;
    use std::path::Path;

    fn data_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../data")
    }

    fn gen(toml_text: &str) -> Vec<RequestSpec> {
        generate(&WorkloadConfig::from_toml_str(toml_text, "test").unwrap(), &data_dir()).unwrap()
    }

    fn conversation_trace() -> Vec<RequestSpec> {
        gen(concat!(
            "[arrivals]\nkind = \"trace\"\n",
            "[lengths]\nkind = \"trace\"\npath = \"traces/mooncake_conversation_trace.jsonl\"\nformat = \"mooncake\"\n"
        ))
    }

    /// The computation as the definition states it: a set of every block hash seen so far.
    fn reuse_with_a_set(requests: &[RequestSpec], block_size: u32, capped: bool) -> f64 {
        let mut order: Vec<&RequestSpec> = requests.iter().collect();
        order.sort_by_key(|r| r.arrival);
        let mut seen: HashSet<BlockHash> = HashSet::new();
        let (mut hits, mut total) = (0u64, 0u64);
        for r in order {
            total += u64::from(r.prompt_tokens);
            let hashes = prompt_block_hashes(&r.content_ids, r.prompt_tokens, block_size);
            let mut h = hashes.iter().take_while(|x| seen.contains(*x)).count() as u64;
            if capped {
                h = h.min(u64::from((r.prompt_tokens - 1) / block_size));
            }
            hits += h;
            seen.extend(hashes);
        }
        (hits * u64::from(block_size)) as f64 / total as f64
    }

    fn spec(i: u64, prompt_tokens: u32, content_ids: Vec<u64>) -> RequestSpec {
        RequestSpec {
            id: RequestId(i),
            arrival: Timestamp(i),
            prompt_tokens,
            reasoning_tokens: 0,
            answer_tokens: 1,
            content_ids,
        }
    }

    /// The unbounded-cache reuse of the Mooncake conversation trace: about 37 % of its prompt
    /// tokens repeat an earlier request's prefix.
    #[test]
    fn conversation_trace_reuse_is_about_37_percent() {
        let reqs = conversation_trace();
        let (capped, uncapped) = prefix_reuse(&reqs, 16);
        assert_eq!(capped, unbounded_prefix_reuse(&reqs, 16));
        println!("conversation trace, unbounded 16-token-block cache: {capped:.6} capped, {uncapped:.6} uncapped");
        assert!((0.35..0.40).contains(&capped), "capped reuse {capped}");
        assert!((0.35..0.40).contains(&uncapped), "uncapped reuse {uncapped}");
        assert!(capped <= uncapped);
        let line = describe_content(&reqs, 16);
        assert!(line.starts_with("content ids: 12,031 of 12,031 requests, 37."), "{line}");
        // The per-unit map agrees with the plain set of hashes (on a prefix of the trace, to keep
        // the set small).
        let head = &reqs[..1_500];
        let (capped, uncapped) = prefix_reuse(head, 16);
        assert_eq!(capped, reuse_with_a_set(head, 16, true));
        assert_eq!(uncapped, reuse_with_a_set(head, 16, false));
    }

    #[test]
    fn reuse_counts_leading_blocks_seen_before_and_caps_the_last_token() {
        // Request 1 repeats request 0's 1024-token prompt: 64 blocks seen, 63 reusable (the last
        // token is computed). Request 2 shares the first id only, then a partial unit of request 0:
        // 32 + 0 blocks. Request 3 has no ids.
        let reqs = vec![
            spec(0, 1024, vec![1, 2]),
            spec(1, 1024, vec![1, 2]),
            spec(2, 1000, vec![1, 9]),
            spec(3, 1000, Vec::new()),
        ];
        let total = (1024 + 1024 + 1000 + 1000) as f64;
        assert_eq!(unbounded_prefix_reuse(&reqs, 16), (63 + 32) as f64 * 16.0 / total);
        assert_eq!(prefix_reuse(&reqs, 16).1, (64 + 32) as f64 * 16.0 / total);
        // A shorter earlier prompt covers only its own full blocks of a shared unit.
        let reqs = vec![spec(0, 100, vec![5]), spec(1, 512, vec![5])];
        assert_eq!(prefix_reuse(&reqs, 16).1, 6.0 * 16.0 / 612.0);
        assert_eq!(reuse_with_a_set(&reqs, 16, false), 6.0 * 16.0 / 612.0);
        // Arrival order, not slice order, decides who was first.
        let mut swapped = vec![spec(1, 512, vec![5]), spec(0, 100, vec![5])];
        swapped[0].arrival = Timestamp(1);
        swapped[1].arrival = Timestamp(0);
        assert_eq!(prefix_reuse(&swapped, 16).1, 6.0 * 16.0 / 612.0);
        // Block sizes that do not divide 512 hash nothing.
        assert_eq!(unbounded_prefix_reuse(&reqs, 48), 0.0);
        assert_eq!(unbounded_prefix_reuse(&[], 16), 0.0);
    }

    const PREFIX: &str = concat!(
        "num_requests = 2000\n[arrivals]\nkind = \"poisson\"\nrate = 10.0\n",
        "[prefix]\nsystem_prompts = 64\nsystem_tokens = 4096\n"
    );

    #[test]
    fn requests_with_the_same_system_prompt_share_exactly_its_blocks() {
        let reqs = gen(PREFIX);
        let system_of = |r: &RequestSpec| r.content_ids[0] / SYSTEM_ID_STRIDE;
        let a = &reqs[0];
        let b =
            reqs[1..].iter().find(|r| system_of(r) == system_of(a)).expect("a second request with prompt 0's system");
        let (ha, hb) = (
            prompt_block_hashes(&a.content_ids, a.prompt_tokens, 16),
            prompt_block_hashes(&b.content_ids, b.prompt_tokens, 16),
        );
        let shared = ha.iter().zip(&hb).take_while(|(x, y)| x == y).count();
        assert_eq!(shared, 4096 / 16);
        let c = reqs.iter().find(|r| system_of(r) != system_of(a)).unwrap();
        let hc = prompt_block_hashes(&c.content_ids, c.prompt_tokens, 16);
        assert_ne!(ha[0], hc[0], "different system prompts share nothing");
        for (i, r) in reqs.iter().enumerate() {
            assert!(r.prompt_tokens > 4096, "request {i}: {r:?}");
            let units = r.prompt_tokens / TRACE_BLOCK_TOKENS;
            assert_eq!(r.content_ids.len(), units as usize, "request {i}: one id per whole unit");
            let suffix = &r.content_ids[8..];
            let base = SUFFIX_ID_BASE + i as u64 * SUFFIX_ID_STRIDE;
            assert!(suffix.iter().enumerate().all(|(k, &id)| id == base + k as u64), "request {i}");
        }
    }

    #[test]
    fn uniform_popularity_over_64_prompts_is_mostly_reusable() {
        let reqs = gen(PREFIX);
        let reuse = unbounded_prefix_reuse(&reqs, 16);
        assert!(reuse > 0.7, "reuse {reuse}");
        let used: HashSet<u64> = reqs.iter().map(|r| r.content_ids[0] / SYSTEM_ID_STRIDE).collect();
        assert_eq!(used.len(), 64);
    }

    #[test]
    fn zipf_popularity_favours_prompt_zero() {
        let reqs = gen(&format!("{PREFIX}popularity = \"zipf\"\nzipf_s = 1.2\n"));
        let mut counts = vec![0u32; 64];
        for r in &reqs {
            counts[(r.content_ids[0] / SYSTEM_ID_STRIDE) as usize] += 1;
        }
        let top = counts.iter().enumerate().max_by_key(|&(p, &c)| (c, std::cmp::Reverse(p))).unwrap().0;
        assert_eq!(top, 0, "{counts:?}");
        // Weight of prompt 0: 1 / Σ (p+1)^-1.2 ≈ 0.27.
        assert!((450..640).contains(&counts[0]), "{counts:?}");
        assert!(2 * counts[0] > 3 * counts[1] && counts[1] > counts[10], "{counts:?}");
    }

    #[test]
    fn the_prefix_table_keeps_arrivals_and_output_lengths() {
        let base = "seed = 4\nnum_requests = 300\n[arrivals]\nkind = \"gamma\"\nrate = 3.0\ncv = 2.0\n";
        let plain = gen(base);
        let prefixed = gen(&format!("{base}[prefix]\nsuffix_sigma = 0.0\n"));
        for (a, b) in plain.iter().zip(&prefixed) {
            assert_eq!(
                (a.arrival, a.reasoning_tokens, a.answer_tokens),
                (b.arrival, b.reasoning_tokens, b.answer_tokens)
            );
            assert!(a.content_ids.is_empty());
            assert_eq!(b.prompt_tokens, 4096 + 256);
        }
        assert!(plain.iter().any(|r| r.prompt_tokens != 4096 + 256));
    }

    #[test]
    fn prompts_are_capped_and_their_ids_cut_to_match() {
        let reqs = gen(&format!("max_prompt_tokens = 1000\n{PREFIX}"));
        assert!(reqs.iter().all(|r| r.prompt_tokens == 1000 && r.content_ids.len() == 2));
        // A suffix far too long for a request is clipped so that the request still fits.
        let huge = gen(concat!(
            "num_requests = 5\n[lengths]\nkind = \"fixed\"\nprompt_tokens = 1\nreasoning_tokens = 1000\nanswer_tokens = 10\n",
            "[prefix]\nsuffix_median = 1e12\nsuffix_sigma = 0.0\n"
        ));
        for r in &huge {
            assert_eq!(r.max_context_tokens(), MAX_REQUEST_TOKENS, "{r:?}");
            assert_eq!(r.content_ids.len() as u32, r.prompt_tokens / TRACE_BLOCK_TOKENS);
        }
    }

    const MULTI: &str = concat!(
        "seed = 9\nnum_requests = 2000\n[arrivals]\nkind = \"poisson\"\nrate = 2.0\n",
        "[prefix]\nsystem_prompts = 8\nsystem_tokens = 1024\nsuffix_median = 600.0\nsuffix_sigma = 0.0\n",
        "[prefix.multi_turn]\n"
    );

    /// Multi-turn conversations: every later turn's prompt is the previous prompt + its answer + a
    /// message and repeats all of its content ids; turns arrive in order, each a think time after
    /// the one before; turns and think times have the configured means; the history makes most
    /// prompt tokens reusable.
    #[test]
    fn later_turns_resend_the_conversation_so_far() {
        let reqs = gen(MULTI);
        assert_eq!(reqs.len(), 2000);
        assert!(
            reqs.windows(2).all(|w| w[0].arrival <= w[1].arrival)
                && reqs.iter().enumerate().all(|(i, r)| r.id.0 == i as u64)
        );
        // A first turn is 1,024 + 600 tokens: its third id (the first unit after the system
        // prompt) names the conversation, which every later turn repeats.
        let mut by_conv: HashMap<u64, Vec<&RequestSpec>> = HashMap::new();
        for r in &reqs {
            by_conv.entry(r.content_ids[2]).or_default().push(r);
        }
        assert!(by_conv.values().all(|turns| turns[0].prompt_tokens == 1624), "each conversation starts afresh");
        let mut later = 0;
        for turns in by_conv.values() {
            for w in turns.windows(2) {
                let (a, b) = (w[0], w[1]);
                later += 1;
                assert!(b.arrival >= a.arrival);
                assert!(b.prompt_tokens > a.prompt_tokens + a.answer_tokens, "{a:?} → {b:?}");
                assert_eq!(&b.content_ids[..a.content_ids.len()], &a.content_ids[..], "the history is resent");
                let (ha, hb) = (
                    prompt_block_hashes(&a.content_ids, a.prompt_tokens, 16),
                    prompt_block_hashes(&b.content_ids, b.prompt_tokens, 16),
                );
                assert_eq!(ha[..], hb[..ha.len()], "every full block of the earlier prompt is shared");
            }
        }
        assert!(later > 100, "conversations go on: {later}");
        // Mean turns 4 (geometric): about 500 conversations (± 20 for one standard deviation).
        let starts = by_conv.len();
        assert!((430..=580).contains(&starts), "{starts} conversations of 2000 requests");
        // Think times: exponential, mean 15 s (the later turns' gaps, ± 10 %).
        let gaps: Vec<f64> = by_conv
            .values()
            .flat_map(|t| {
                t.windows(2).map(|w| w[1].arrival.saturating_since(w[0].arrival).as_secs_f64()).collect::<Vec<_>>()
            })
            .collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!((13.5..16.5).contains(&mean), "mean think time {mean} s");
        let plain = gen(&MULTI.replace("[prefix.multi_turn]\n", ""));
        let (reuse, reuse_plain) = (unbounded_prefix_reuse(&reqs, 16), unbounded_prefix_reuse(&plain, 16));
        assert!(reuse > reuse_plain + 0.1, "history reuse {reuse} vs system prompts alone {reuse_plain}");
    }

    #[test]
    fn multi_turn_values_are_checked() {
        for (field, bad) in [
            ("turns_mean", "turns_mean = 0.5"),
            ("think_time_s", "think_time_s = -1.0"),
            ("message_median", "message_median = 0.0"),
            ("message_sigma", "message_sigma = nan"),
        ] {
            let text = format!("{MULTI}{bad}\n");
            let e = WorkloadConfig::from_toml_str(&text, "w.toml").and_then(|c| c.validate().map(|()| c)).unwrap_err();
            assert!(e.to_string().contains(&format!("prefix.multi_turn.{field}")), "{field}: {e}");
        }
    }

    #[test]
    fn thousands_separators() {
        let got: Vec<String> = [0, 7, 999, 1_000, 12_031, 1_234_567].into_iter().map(thousands).collect();
        assert_eq!(got, ["0", "7", "999", "1,000", "12,031", "1,234,567"]);
    }
}
