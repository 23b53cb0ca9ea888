//! Per-request token lengths: prompt, reasoning (before `</think>`) and answer (after it).
//!
//! PASCAL's scheduling decisions hinge on the reasoning/answer split (§III: the reasoning phase is
//! invisible to the user, the answering phase is paced); its evaluation traces (§V, Fig. 8) have
//! more than 70 % of requests below 1,000 reasoning tokens with a long tail. No public per-request
//! (reasoning, answer) table exists (see `data/README.md`, "Reasoning lengths"), so the default
//! source is the ServeGen DeepSeek-R1 production distributions: input tokens, output tokens and
//! `reason_ratio` (reasoning ÷ output), from which reasoning = round(output × ratio) and
//! answer = output − reasoning (at least one). [`LengthPmf`] parses that file once into cumulative
//! tables and samples by inverse CDF with a binary search.

use super::traces::{csv_fields, expect_header, lines, parse_err, parse_f64, parse_u32, read_text, TraceFormat};
use super::WorkloadError;
use crate::rng::SimRng;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Where each request's lengths come from (`[lengths]` in TOML, selected by `kind`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum LengthConfig {
    /// ServeGen DeepSeek-R1 whole-day length distributions (production data, the default).
    Servegen {
        /// `field,value,probability` PMF file; relative paths resolve against the config file's
        /// directory. Absent: the copy of `data/traces/servegen_deepseek_r1/length_pmf.csv`
        /// compiled into kvfleet.
        #[serde(default)]
        pmf: Option<PathBuf>,
        /// How input, output and reason_ratio are drawn jointly.
        #[serde(default)]
        joint: Joint,
    },
    /// Synthetic log-normal lengths (the README's fallback; say it is synthetic when reporting).
    Lognormal(LognormalLengths),
    /// The same lengths for every request (tests, microbenchmarks).
    Fixed(FixedLengths),
    /// Lengths from a trace file, taken row by row in file order (wrapping around when more
    /// requests than rows are asked for, unless arrivals also come from this trace).
    Trace(TraceLengths),
}

impl Default for LengthConfig {
    fn default() -> Self {
        LengthConfig::Servegen { pmf: None, joint: Joint::default() }
    }
}

/// Joint law of the three ServeGen marginals. The source publishes only per-client marginals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Joint {
    /// One uniform for all three fields (ServeGen's own generator, `servegen/construct.py`):
    /// long prompts, long outputs and high reason ratios go together.
    #[default]
    Comonotonic,
    /// Three independent uniforms.
    Independent,
}

impl Joint {
    /// Lowercase name (`comonotonic`, `independent`), as in configs.
    pub fn name(self) -> &'static str {
        match self {
            Joint::Comonotonic => "comonotonic",
            Joint::Independent => "independent",
        }
    }
}

/// Log-normal lengths, each rounded and clipped to `[min, max]`. Defaults are the README's synthetic
/// fallback for reasoning and answer; the prompt default matches ServeGen's median (208) and p90
/// (≈2,100) input length.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LognormalLengths {
    /// Median prompt length, tokens.
    pub prompt_median: f64,
    /// Sigma of the prompt length's underlying normal.
    pub prompt_sigma: f64,
    /// Smallest prompt, tokens (at least 1).
    pub prompt_min: u32,
    /// Largest prompt, tokens.
    pub prompt_max: u32,
    /// Median reasoning length, tokens.
    pub reasoning_median: f64,
    /// Sigma of the reasoning length's underlying normal.
    pub reasoning_sigma: f64,
    /// Smallest reasoning length, tokens (0 allows non-reasoning requests).
    pub reasoning_min: u32,
    /// Largest reasoning length, tokens.
    pub reasoning_max: u32,
    /// Median answer length, tokens.
    pub answer_median: f64,
    /// Sigma of the answer length's underlying normal.
    pub answer_sigma: f64,
    /// Smallest answer, tokens (at least 1).
    pub answer_min: u32,
    /// Largest answer, tokens.
    pub answer_max: u32,
    /// What a draw outside `[min, max]` becomes: `clip` (the bound; piles the tail onto it) or
    /// `resample` (draw again: a truncated log-normal).
    pub overflow: Overflow,
}

/// What a log-normal draw outside its `[min, max]` becomes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Overflow {
    /// Clamp to the bound.
    #[default]
    Clip,
    /// Draw again (at most [`RESAMPLE_TRIES`] times, then clamp).
    Resample,
}

/// Most draws `Overflow::Resample` makes for one length before it clamps.
pub const RESAMPLE_TRIES: u32 = 64;

impl Default for LognormalLengths {
    fn default() -> Self {
        LognormalLengths {
            prompt_median: 208.0,
            prompt_sigma: 1.8,
            prompt_min: 4,
            prompt_max: 32_768,
            reasoning_median: 600.0,
            reasoning_sigma: 1.0,
            reasoning_min: 16,
            reasoning_max: 16_384,
            answer_median: 450.0,
            answer_sigma: 0.7,
            answer_min: 8,
            answer_max: 4_096,
            overflow: Overflow::Clip,
        }
    }
}

/// Constant lengths.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FixedLengths {
    /// Prompt tokens of every request (at least 1).
    pub prompt_tokens: u32,
    /// Reasoning tokens of every request (0 = non-reasoning).
    pub reasoning_tokens: u32,
    /// Answer tokens of every request (at least 1).
    pub answer_tokens: u32,
}

impl Default for FixedLengths {
    fn default() -> Self {
        FixedLengths { prompt_tokens: 512, reasoning_tokens: 600, answer_tokens: 200 }
    }
}

/// Lengths read from a trace file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceLengths {
    /// Trace file; relative paths resolve against the config file's directory.
    pub path: PathBuf,
    /// `azure`, `mooncake` or `kvfleet`.
    pub format: TraceFormat,
    /// How Azure/Mooncake output lengths split into reasoning and answer (they record only the
    /// total). Absent: sampled from the ServeGen `reason_ratio` PMF, independently of the row.
    /// Must be absent for `kvfleet`, whose rows carry the split.
    #[serde(default)]
    pub reason_ratio: Option<ReasonRatioConfig>,
}

/// Reasoning share of the output for traces without a split.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ReasonRatioConfig {
    /// The same ratio for every request, in [0, 1] (0: a non-reasoning workload).
    Fixed {
        /// Reasoning tokens ÷ output tokens.
        value: f64,
    },
    /// Drawn from the `reason_ratio` rows of a ServeGen PMF file.
    Servegen {
        /// PMF file; absent: the built-in ServeGen DeepSeek-R1 copy.
        #[serde(default)]
        pmf: Option<PathBuf>,
    },
}

/// The three fields of a ServeGen length PMF.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PmfField {
    /// Prompt length, tokens.
    InputTokens,
    /// Output length (reasoning + answer), tokens.
    OutputTokens,
    /// Share of the output that is reasoning (reasoning ÷ output, in [0, 1]).
    ReasonRatio,
}

impl PmfField {
    /// Name of the field as written in PMF files.
    pub fn name(self) -> &'static str {
        match self {
            PmfField::InputTokens => "input_tokens",
            PmfField::OutputTokens => "output_tokens",
            PmfField::ReasonRatio => "reason_ratio",
        }
    }
}

/// A discrete distribution as sorted values with their cumulative probability (last = 1).
#[derive(Clone, Debug, Default, PartialEq)]
struct CumTable {
    values: Vec<f64>,
    cum: Vec<f64>,
}

impl CumTable {
    fn build(mut pairs: Vec<(f64, f64)>) -> Option<CumTable> {
        pairs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let total: f64 = pairs.iter().map(|p| p.1).sum();
        if !(total > 0.0 && total.is_finite()) {
            return None;
        }
        let mut acc = 0.0;
        let mut cum = Vec::with_capacity(pairs.len());
        for &(_, p) in &pairs {
            acc += p;
            cum.push(acc / total);
        }
        // Exactly 1 at the end so that every u in [0, 1) finds a bin; zero-probability values
        // share their predecessor's cumulative value and are never picked.
        let last_positive = pairs.iter().rposition(|p| p.1 > 0.0)?;
        for c in &mut cum[last_positive..] {
            *c = 1.0;
        }
        Some(CumTable { values: pairs.into_iter().map(|p| p.0).collect(), cum })
    }

    /// Inverse CDF: the smallest value whose cumulative probability exceeds `u` ∈ [0, 1).
    #[inline]
    fn quantile(&self, u: f64) -> f64 {
        let i = self.cum.partition_point(|&c| c <= u);
        self.values[i.min(self.values.len() - 1)]
    }

    fn mean(&self) -> f64 {
        let mut prev = 0.0;
        let mut m = 0.0;
        for (v, c) in self.values.iter().zip(&self.cum) {
            m += v * (c - prev);
            prev = *c;
        }
        m
    }
}

/// ServeGen-style length PMF (`field,value,probability`), parsed once into cumulative tables.
#[derive(Clone, Debug, PartialEq)]
pub struct LengthPmf {
    input: CumTable,
    output: CumTable,
    ratio: CumTable,
}

const PMF_HEADER: &str = "field,value,probability";
const BUILTIN_PMF: &str = include_str!("../../../data/traces/servegen_deepseek_r1/length_pmf.csv");

impl LengthPmf {
    /// Parses PMF text; `path` is only used in error messages. Rows may come in any order;
    /// probabilities are normalised per field.
    pub fn parse(text: &str, path: &Path) -> Result<LengthPmf, WorkloadError> {
        let mut it = lines(text);
        expect_header(it.next(), PMF_HEADER, path)?;
        let mut pairs: [Vec<(f64, f64)>; 3] = Default::default();
        for (n, line) in it {
            let [field, value, prob] = csv_fields(line, ["field", "value", "probability"], path, n)?;
            let slot = match field {
                "input_tokens" => 0,
                "output_tokens" => 1,
                "reason_ratio" => 2,
                other => {
                    return Err(parse_err(
                        path,
                        n,
                        "field",
                        format!("unknown field {other:?} (expected input_tokens, output_tokens or reason_ratio)"),
                    ))
                }
            };
            let v = if slot == 2 {
                let r = parse_f64(value, path, n, "value")?;
                if !(0.0..=1.0).contains(&r) {
                    return Err(parse_err(path, n, "value", format!("reason_ratio must be in [0, 1], got {value}")));
                }
                r
            } else {
                parse_u32(value, path, n, "value")? as f64
            };
            let p = parse_f64(prob, path, n, "probability")?;
            if p < 0.0 {
                return Err(parse_err(path, n, "probability", format!("must be >= 0, got {prob}")));
            }
            pairs[slot].push((v, p));
        }
        let [i, o, r] = pairs;
        let table = |pairs: Vec<(f64, f64)>, field: PmfField| {
            CumTable::build(pairs).ok_or_else(|| WorkloadError::File {
                path: path.to_path_buf(),
                message: format!("no `{}` rows with positive probability", field.name()),
            })
        };
        Ok(LengthPmf {
            input: table(i, PmfField::InputTokens)?,
            output: table(o, PmfField::OutputTokens)?,
            ratio: table(r, PmfField::ReasonRatio)?,
        })
    }

    /// Reads and parses a PMF file.
    pub fn load(path: &Path) -> Result<LengthPmf, WorkloadError> {
        LengthPmf::parse(&read_text(path)?, path)
    }

    /// The ServeGen DeepSeek-R1 whole-day PMF compiled into kvfleet, parsed on first use.
    pub fn builtin() -> Result<&'static LengthPmf, WorkloadError> {
        static PMF: OnceLock<Result<LengthPmf, String>> = OnceLock::new();
        let path = Path::new("<built-in>/servegen_deepseek_r1/length_pmf.csv");
        PMF.get_or_init(|| LengthPmf::parse(BUILTIN_PMF, path).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|message| WorkloadError::File { path: path.to_path_buf(), message: message.clone() })
    }

    /// Inverse CDF of one field at `u` ∈ [0, 1).
    #[inline]
    pub fn quantile(&self, field: PmfField, u: f64) -> f64 {
        self.table(field).quantile(u)
    }

    /// Mean of one field.
    pub fn mean(&self, field: PmfField) -> f64 {
        self.table(field).mean()
    }

    fn table(&self, field: PmfField) -> &CumTable {
        match field {
            PmfField::InputTokens => &self.input,
            PmfField::OutputTokens => &self.output,
            PmfField::ReasonRatio => &self.ratio,
        }
    }
}

/// Splits `output` tokens by `ratio`: reasoning = round(output × ratio), answer the rest, and the
/// answer always keeps at least one token (an output of 0 counts as 1).
#[inline]
pub fn split_output(output: u32, ratio: f64) -> (u32, u32) {
    let output = output.max(1);
    let reasoning = ((output as f64 * ratio.clamp(0.0, 1.0)).round() as u32).min(output - 1);
    (reasoning, output - reasoning)
}

/// Shrinks reasoning + answer to at most `max_output` tokens keeping their proportion; the
/// answer keeps at least one token.
#[inline]
pub fn cap_output(reasoning: u32, answer: u32, max_output: u32) -> (u32, u32) {
    let output = reasoning as u64 + answer as u64;
    if output <= max_output as u64 {
        return (reasoning, answer);
    }
    split_output(max_output, reasoning as f64 / output as f64)
}

/// A PMF that is either the built-in one or loaded from a file.
pub(crate) enum PmfRef {
    Builtin(&'static LengthPmf),
    Owned(Box<LengthPmf>),
}

impl PmfRef {
    pub(crate) fn open(path: Option<&Path>) -> Result<PmfRef, WorkloadError> {
        match path {
            None => LengthPmf::builtin().map(PmfRef::Builtin),
            Some(p) => LengthPmf::load(p).map(|pmf| PmfRef::Owned(Box::new(pmf))),
        }
    }

    pub(crate) fn get(&self) -> &LengthPmf {
        match self {
            PmfRef::Builtin(p) => p,
            PmfRef::Owned(p) => p,
        }
    }
}

/// Draws one request's (prompt, reasoning, answer) from the ServeGen PMF.
#[inline]
pub(crate) fn sample_servegen(pmf: &LengthPmf, joint: Joint, rng: &mut SimRng) -> (u32, u32, u32) {
    let (ui, uo, ur) = match joint {
        Joint::Comonotonic => {
            let u = rng.f64();
            (u, u, u)
        }
        Joint::Independent => (rng.f64(), rng.f64(), rng.f64()),
    };
    let prompt = pmf.quantile(PmfField::InputTokens, ui) as u32;
    let output = pmf.quantile(PmfField::OutputTokens, uo) as u32;
    let (reasoning, answer) = split_output(output, pmf.quantile(PmfField::ReasonRatio, ur));
    (prompt, reasoning, answer)
}

/// Draws one request's (prompt, reasoning, answer) from the log-normal model.
#[inline]
pub(crate) fn sample_lognormal(l: &LognormalLengths, rng: &mut SimRng) -> (u32, u32, u32) {
    let resample = l.overflow == Overflow::Resample;
    let mut draw = |median: f64, sigma: f64, lo: u32, hi: u32| -> u32 {
        let hi = hi.max(lo);
        let mut x = rng.lognormal(median, sigma).round();
        if resample {
            let mut tries = 1;
            while !(f64::from(lo)..=f64::from(hi)).contains(&x) && tries < RESAMPLE_TRIES {
                x = rng.lognormal(median, sigma).round();
                tries += 1;
            }
        }
        // `as u32` saturates (and maps NaN to 0) before the clamp: never panics.
        (x as u32).clamp(lo, hi)
    };
    let prompt = draw(l.prompt_median, l.prompt_sigma, l.prompt_min, l.prompt_max);
    let reasoning = draw(l.reasoning_median, l.reasoning_sigma, l.reasoning_min, l.reasoning_max);
    let answer = draw(l.answer_median, l.answer_sigma, l.answer_min, l.answer_max);
    (prompt, reasoning, answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/fixtures").join(name)
    }

    #[test]
    fn builtin_pmf_matches_the_readme_table() {
        let pmf = LengthPmf::builtin().unwrap();
        // data/README.md: input mean 1,268 p50 208; output mean 1,527 p50 792 p99 12,607;
        // reason_ratio mean 0.70 p50 0.76.
        assert!((pmf.mean(PmfField::InputTokens) - 1_268.0).abs() < 5.0);
        assert!((pmf.mean(PmfField::OutputTokens) - 1_527.0).abs() < 5.0);
        assert!((pmf.mean(PmfField::ReasonRatio) - 0.70).abs() < 0.01);
        assert_eq!(pmf.quantile(PmfField::InputTokens, 0.5), 208.0);
        assert_eq!(pmf.quantile(PmfField::OutputTokens, 0.5), 792.0);
        assert_eq!(pmf.quantile(PmfField::OutputTokens, 0.99), 12_607.0);
        assert!((pmf.quantile(PmfField::ReasonRatio, 0.5) - 0.76).abs() < 0.01);
        // The extremes of u stay inside the support.
        assert_eq!(pmf.quantile(PmfField::OutputTokens, 0.0), 9.0);
        assert_eq!(pmf.quantile(PmfField::OutputTokens, 1.0 - f64::EPSILON), 32_768.0);
    }

    #[test]
    fn the_copied_pmf_file_parses_like_the_builtin() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/traces/servegen_deepseek_r1/length_pmf.csv");
        assert_eq!(&LengthPmf::load(&path).unwrap(), LengthPmf::builtin().unwrap());
    }

    #[test]
    fn small_pmf_quantiles_are_exact() {
        let pmf = LengthPmf::load(&fixture("pmf_sample.csv")).unwrap();
        let table: &[(PmfField, f64, f64)] = &[
            (PmfField::InputTokens, 0.0, 10.0),
            (PmfField::InputTokens, 0.4999, 10.0),
            (PmfField::InputTokens, 0.5, 100.0),
            (PmfField::OutputTokens, 0.2499, 200.0),
            (PmfField::OutputTokens, 0.25, 1000.0),
            (PmfField::ReasonRatio, 0.99, 1.0),
        ];
        for &(field, u, want) in table {
            assert_eq!(pmf.quantile(field, u), want, "{field:?} at {u}");
        }
        assert!((pmf.mean(PmfField::OutputTokens) - 800.0).abs() < 1e-9);
    }

    #[test]
    fn zero_probability_values_are_never_drawn() {
        let text = "field,value,probability\ninput_tokens,1,0\ninput_tokens,5,1\ninput_tokens,9,0\n\
                    output_tokens,7,1\nreason_ratio,0.5,1\n";
        let pmf = LengthPmf::parse(text, Path::new("z.csv")).unwrap();
        for u in [0.0, 0.3, 0.999_999] {
            assert_eq!(pmf.quantile(PmfField::InputTokens, u), 5.0);
        }
    }

    #[test]
    fn malformed_pmf_files_name_file_line_and_field() {
        let table: &[(&str, &str)] = &[
            ("pmf_bad_ratio.csv", "pmf_bad_ratio.csv:4: field `value`: reason_ratio must be in [0, 1], got 1.2"),
            ("pmf_bad_probability.csv", "pmf_bad_probability.csv:4: field `probability`: must be >= 0"),
            ("pmf_unknown_field.csv", "pmf_unknown_field.csv:4: field `field`: unknown field \"reasoning_ratio\""),
            ("pmf_missing_ratio.csv", "pmf_missing_ratio.csv: no `reason_ratio` rows"),
            ("kvfleet_sample.csv", "kvfleet_sample.csv:1: field `header`"),
        ];
        for &(file, want) in table {
            let msg = LengthPmf::load(&fixture(file)).unwrap_err().to_string();
            assert!(msg.contains(want), "{file}: {msg}");
        }
        let msg = LengthPmf::load(&fixture("nope.csv")).unwrap_err().to_string();
        assert!(msg.contains("nope.csv"), "{msg}");
    }

    #[test]
    fn split_and_cap_keep_one_answer_token() {
        // (output, ratio) -> (reasoning, answer)
        let split: &[(u32, f64, (u32, u32))] = &[
            (1000, 0.7, (700, 300)),
            (3, 0.5, (2, 1)),
            (1, 1.0, (0, 1)),
            (0, 0.5, (0, 1)),
            (10, 0.0, (0, 10)),
            (10, 1.0, (9, 1)),
            (10, 7.0, (9, 1)),
        ];
        for &(out, r, want) in split {
            assert_eq!(split_output(out, r), want, "split({out}, {r})");
        }
        // (reasoning, answer, cap) -> capped
        let cap: &[(u32, u32, u32, (u32, u32))] = &[
            (600, 200, 1000, (600, 200)),
            (600, 200, 400, (300, 100)),
            (5000, 0, 100, (99, 1)),
            (u32::MAX, u32::MAX, 10, (5, 5)),
            (3, 1, 1, (0, 1)),
        ];
        for &(r, a, c, want) in cap {
            assert_eq!(cap_output(r, a, c), want, "cap({r}, {a}, {c})");
        }
    }

    #[test]
    fn lognormal_defaults_are_clipped_and_centred() {
        let l = LognormalLengths::default();
        let mut rng = SimRng::seed_from_u64(3);
        let n = 50_000;
        let mut reasoning: Vec<u32> = Vec::with_capacity(n);
        for _ in 0..n {
            let (p, r, a) = sample_lognormal(&l, &mut rng);
            assert!((4..=32_768).contains(&p) && (16..=16_384).contains(&r) && (8..=4_096).contains(&a));
            reasoning.push(r);
        }
        reasoning.sort_unstable();
        let median = reasoning[n / 2] as f64;
        assert!((median - 600.0).abs() < 25.0, "reasoning median {median}");
    }
}
