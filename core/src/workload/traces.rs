//! Trace-file parsers: Azure LLM inference CSV, Mooncake JSONL and kvfleet's own CSV.
//!
//! PASCAL (§V) evaluates on request traces with known prompt and output lengths; the public traces
//! we ship (`data/traces/`, provenance in `data/README.md`) give arrival times and token counts but
//! only our own kvfleet CSV states the reasoning/answer split. Every parser returns rows in file
//! order with arrival times in the file's own clock (nanoseconds); [`super::generate`] sorts them and
//! makes them relative to the first request. Malformed input is an error naming the file, the
//! 1-based line and the field — never a panic.

use super::WorkloadError;
use crate::kv::TRACE_BLOCK_TOKENS;
use crate::request::MAX_REQUEST_TOKENS;
use crate::time::RUN_LIMIT;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The three trace layouts kvfleet reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    /// Azure LLM inference trace 2023 (Splitwise): CSV `TIMESTAMP,ContextTokens,GeneratedTokens`,
    /// wall-clock timestamps like `2023-11-16 18:17:03.9799600`. No reasoning split.
    Azure,
    /// Mooncake FAST'25 JSONL: `timestamp` (ms from start), `input_length`, `output_length` and
    /// optionally `hash_ids` (the prompt's content ids, one per 512 tokens). No reasoning split.
    Mooncake,
    /// kvfleet CSV `arrival_s,prompt_tokens,reasoning_tokens,answer_tokens` with explicit lengths;
    /// `#` starts a comment line. Defined in `data/README.md`.
    Kvfleet,
}

impl TraceFormat {
    /// Lowercase name (`azure`, `mooncake`, `kvfleet`), as in configs.
    pub fn name(self) -> &'static str {
        match self {
            TraceFormat::Azure => "azure",
            TraceFormat::Mooncake => "mooncake",
            TraceFormat::Kvfleet => "kvfleet",
        }
    }
}

/// How many tokens a trace row generates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceOutput {
    /// Reasoning + answer together (Azure, Mooncake): the split comes from a reason ratio.
    Total(u32),
    /// Explicit split (kvfleet CSV).
    Split {
        /// Tokens before `</think>`.
        reasoning_tokens: u32,
        /// Tokens after `</think>`.
        answer_tokens: u32,
    },
}

/// One request of a trace, as written in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRow {
    /// Arrival in the trace's own clock, nanoseconds (Azure: since the Unix epoch; Mooncake and
    /// kvfleet: since the trace start).
    pub arrival_ns: u64,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Output length: a total, or split into reasoning and answer tokens.
    pub output: TraceOutput,
    /// The prompt's content ids, one per [`TRACE_BLOCK_TOKENS`] tokens (Mooncake's `hash_ids`),
    /// at most ⌈prompt_tokens / 512⌉ of them. Empty for Azure and kvfleet traces, and for Mooncake
    /// rows without `hash_ids`: nothing of the prompt is shared.
    pub content_ids: Vec<u64>,
}

/// Azure CSV header, exactly as in the published files.
pub const AZURE_HEADER: &str = "TIMESTAMP,ContextTokens,GeneratedTokens";
/// kvfleet CSV header.
pub const KVFLEET_HEADER: &str = "arrival_s,prompt_tokens,reasoning_tokens,answer_tokens";

/// Reads and parses a trace file. A missing or unreadable file is [`WorkloadError::Io`] naming it;
/// a file without any request is [`WorkloadError::File`].
pub fn load_trace(path: &Path, format: TraceFormat) -> Result<Vec<TraceRow>, WorkloadError> {
    let text = read_text(path)?;
    parse_trace(&text, path, format)
}

/// Parses trace text; `path` is only used in error messages.
pub fn parse_trace(text: &str, path: &Path, format: TraceFormat) -> Result<Vec<TraceRow>, WorkloadError> {
    let rows = match format {
        TraceFormat::Azure => parse_azure(text, path)?,
        TraceFormat::Mooncake => parse_mooncake(text, path)?,
        TraceFormat::Kvfleet => parse_kvfleet(text, path)?,
    };
    if rows.is_empty() {
        return Err(WorkloadError::File {
            path: path.to_path_buf(),
            message: format!("{} trace holds no requests", format.name()),
        });
    }
    Ok(rows)
}

pub(crate) fn read_text(path: &Path) -> Result<String, WorkloadError> {
    std::fs::read_to_string(path).map_err(|source| WorkloadError::Io { path: path.to_path_buf(), source })
}

/// Numbered, non-empty lines (1-based), with `\r` and a leading BOM stripped.
pub(crate) fn lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    text.split('\n')
        .enumerate()
        .map(|(i, l)| (i + 1, l.strip_suffix('\r').unwrap_or(l)))
        .filter(|(_, l)| !l.trim().is_empty())
}

/// Splits a CSV row into exactly `N` fields named by `names`, or says which field is missing.
pub(crate) fn csv_fields<'a, const N: usize>(
    line: &'a str,
    names: [&'static str; N],
    path: &Path,
    line_no: usize,
) -> Result<[&'a str; N], WorkloadError> {
    let mut out = [""; N];
    let mut it = line.split(',');
    for (slot, name) in out.iter_mut().zip(names) {
        match it.next() {
            Some(f) => *slot = f.trim(),
            None => {
                return Err(parse_err(path, line_no, name, format!("missing (expected {N} comma-separated fields)")))
            }
        }
    }
    if it.next().is_some() {
        let found = line.split(',').count();
        return Err(parse_err(path, line_no, "row", format!("expected {N} fields, found {found}")));
    }
    Ok(out)
}

pub(crate) fn expect_header(line: Option<(usize, &str)>, header: &str, path: &Path) -> Result<(), WorkloadError> {
    match line {
        Some((_, l)) if l.trim() == header => Ok(()),
        Some((n, l)) => Err(parse_err(path, n, "header", format!("expected {header:?}, got {:?}", l.trim()))),
        None => Err(WorkloadError::File { path: path.to_path_buf(), message: "empty file".into() }),
    }
}

pub(crate) fn parse_err(path: &Path, line: usize, field: &'static str, message: String) -> WorkloadError {
    WorkloadError::Parse { path: path.to_path_buf(), line, field, message }
}

pub(crate) fn parse_u32(s: &str, path: &Path, line: usize, field: &'static str) -> Result<u32, WorkloadError> {
    s.parse::<u32>().map_err(|e| parse_err(path, line, field, format!("invalid integer {s:?} ({e})")))
}

/// The row, if the request it describes fits [`MAX_REQUEST_TOKENS`] (the sum once wrapped).
fn checked(row: TraceRow, path: &Path, line: usize) -> Result<TraceRow, WorkloadError> {
    let output = match row.output {
        TraceOutput::Total(t) => t as u64,
        TraceOutput::Split { reasoning_tokens, answer_tokens } => reasoning_tokens as u64 + answer_tokens as u64,
    };
    let total = row.prompt_tokens as u64 + output;
    if total > MAX_REQUEST_TOKENS as u64 {
        let message =
            format!("prompt + output = {total} tokens, more than the {MAX_REQUEST_TOKENS} one request may hold");
        return Err(parse_err(path, line, "row", message));
    }
    Ok(row)
}

fn at_least_one(v: u32, path: &Path, line: usize, field: &'static str) -> Result<u32, WorkloadError> {
    if v == 0 {
        return Err(parse_err(path, line, field, "must be >= 1 (a request has a prompt)".into()));
    }
    Ok(v)
}

pub(crate) fn parse_f64(s: &str, path: &Path, line: usize, field: &'static str) -> Result<f64, WorkloadError> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(_) => Err(parse_err(path, line, field, format!("not a finite number: {s:?}"))),
        Err(e) => Err(parse_err(path, line, field, format!("invalid number {s:?} ({e})"))),
    }
}

fn parse_azure(text: &str, path: &Path) -> Result<Vec<TraceRow>, WorkloadError> {
    let mut it = lines(text);
    expect_header(it.next(), AZURE_HEADER, path)?;
    let mut rows = Vec::new();
    for (n, line) in it {
        let [ts, ctx, gen] = csv_fields(line, ["TIMESTAMP", "ContextTokens", "GeneratedTokens"], path, n)?;
        let arrival_ns = parse_wall_clock_ns(ts).map_err(|m| parse_err(path, n, "TIMESTAMP", m))?;
        let prompt_tokens = at_least_one(parse_u32(ctx, path, n, "ContextTokens")?, path, n, "ContextTokens")?;
        let generated = parse_u32(gen, path, n, "GeneratedTokens")?;
        let output = TraceOutput::Total(generated);
        rows.push(checked(TraceRow { arrival_ns, prompt_tokens, output, content_ids: Vec::new() }, path, n)?);
    }
    Ok(rows)
}

/// `YYYY-MM-DD HH:MM:SS[.fraction]` (UTC, up to 9 fractional digits) → nanoseconds since 1970.
fn parse_wall_clock_ns(s: &str) -> Result<u64, String> {
    let bad = || format!("expected \"YYYY-MM-DD HH:MM:SS.fffffff\", got {s:?}");
    let (date, time) = s.split_once(' ').ok_or_else(bad)?;
    let mut d = date.split('-');
    let (Some(y), Some(mo), Some(day), None) = (d.next(), d.next(), d.next(), d.next()) else {
        return Err(bad());
    };
    let (hms, frac) = match time.split_once('.') {
        Some((hms, frac)) => (hms, frac),
        None => (time, ""),
    };
    let mut t = hms.split(':');
    let (Some(h), Some(mi), Some(sec), None) = (t.next(), t.next(), t.next(), t.next()) else {
        return Err(bad());
    };
    let num = |x: &str, lo: u64, hi: u64| -> Result<u64, String> {
        if x.is_empty() || !x.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        match x.parse::<u64>() {
            Ok(v) if (lo..=hi).contains(&v) => Ok(v),
            _ => Err(bad()),
        }
    };
    let (y, mo, day) = (num(y, 1970, 9999)?, num(mo, 1, 12)?, num(day, 1, 31)?);
    let (h, mi, sec) = (num(h, 0, 23)?, num(mi, 0, 59)?, num(sec, 0, 60)?);
    if frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let frac_ns = if frac.is_empty() { 0 } else { num(frac, 0, 999_999_999)? * 10u64.pow(9 - frac.len() as u32) };
    let days = days_from_civil(y as i64, mo as i64, day as i64);
    let secs = days as u64 * 86_400 + h * 3_600 + mi * 60 + sec;
    secs.checked_mul(1_000_000_000).and_then(|ns| ns.checked_add(frac_ns)).ok_or_else(bad)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Only the fields we use; anything else is skipped without allocating.
/// (A JSON array would deserialize into it positionally: [`parse_mooncake`] asks for an object.)
#[derive(Deserialize)]
struct MooncakeLine {
    timestamp: Option<serde_json::Value>,
    input_length: Option<serde_json::Value>,
    output_length: Option<serde_json::Value>,
    hash_ids: Option<serde_json::Value>,
}

/// A Mooncake row's `hash_ids`: absent or `null` is no ids; otherwise a list of integers in
/// [0, 2⁶⁴), at most ⌈prompt_tokens / 512⌉ of them (one per 512 prompt tokens; fewer leave the
/// rest of the prompt unique).
fn mooncake_hash_ids(
    v: Option<serde_json::Value>,
    prompt_tokens: u32,
    path: &Path,
    line: usize,
) -> Result<Vec<u64>, WorkloadError> {
    let items = match v {
        None | Some(serde_json::Value::Null) => return Ok(Vec::new()),
        Some(serde_json::Value::Array(items)) => items,
        Some(other) => {
            let message = format!("expected a list of non-negative integers below 2^64, got {other}");
            return Err(parse_err(path, line, "hash_ids", message));
        }
    };
    let bound = prompt_tokens.div_ceil(TRACE_BLOCK_TOKENS) as usize;
    if items.len() > bound {
        let message = format!(
            "{} ids for {prompt_tokens} input tokens, more than the {bound} (one per {TRACE_BLOCK_TOKENS} tokens) \
             the prompt can hold",
            items.len()
        );
        return Err(parse_err(path, line, "hash_ids", message));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_u64().ok_or_else(|| {
                let message = format!("element {i} is {x}: expected a non-negative integer below 2^64");
                parse_err(path, line, "hash_ids", message)
            })
        })
        .collect()
}

fn parse_mooncake(text: &str, path: &Path) -> Result<Vec<TraceRow>, WorkloadError> {
    let mut rows = Vec::new();
    for (n, line) in lines(text) {
        if !line.trim_start().starts_with('{') {
            return Err(parse_err(path, n, "json", "not a JSON object".into()));
        }
        let rec: MooncakeLine =
            serde_json::from_str(line).map_err(|e| parse_err(path, n, "json", format!("not a JSON object: {e}")))?;
        let max_ms = RUN_LIMIT.as_secs_f64() * 1e3;
        let ms = match rec.timestamp {
            Some(v) => match v.as_f64() {
                Some(ms) if ms.is_finite() && (0.0..=max_ms).contains(&ms) => ms,
                _ => {
                    return Err(parse_err(
                        path,
                        n,
                        "timestamp",
                        format!("expected milliseconds in [0, {max_ms:e}], got {v}"),
                    ))
                }
            },
            None => return Err(parse_err(path, n, "timestamp", "missing".into())),
        };
        let tokens = |v: Option<serde_json::Value>, field: &'static str| -> Result<u32, WorkloadError> {
            let v = v.ok_or_else(|| parse_err(path, n, field, "missing".into()))?;
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| parse_err(path, n, field, format!("expected a non-negative integer, got {v}")))
        };
        let prompt_tokens = at_least_one(tokens(rec.input_length, "input_length")?, path, n, "input_length")?;
        let output = TraceOutput::Total(tokens(rec.output_length, "output_length")?);
        let content_ids = mooncake_hash_ids(rec.hash_ids, prompt_tokens, path, n)?;
        let arrival_ns = (ms * 1e6).round() as u64;
        rows.push(checked(TraceRow { arrival_ns, prompt_tokens, output, content_ids }, path, n)?);
    }
    Ok(rows)
}

fn parse_kvfleet(text: &str, path: &Path) -> Result<Vec<TraceRow>, WorkloadError> {
    let mut it = lines(text).filter(|(_, l)| !l.trim_start().starts_with('#'));
    expect_header(it.next(), KVFLEET_HEADER, path)?;
    let mut rows = Vec::new();
    for (n, line) in it {
        let [a, p, r, ans] =
            csv_fields(line, ["arrival_s", "prompt_tokens", "reasoning_tokens", "answer_tokens"], path, n)?;
        let arrival_s = parse_f64(a, path, n, "arrival_s")?;
        if !(0.0..=RUN_LIMIT.as_secs_f64()).contains(&arrival_s) {
            let max = RUN_LIMIT.as_secs_f64();
            return Err(parse_err(path, n, "arrival_s", format!("must be in [0, {max:e}], got {a}")));
        }
        let prompt_tokens = at_least_one(parse_u32(p, path, n, "prompt_tokens")?, path, n, "prompt_tokens")?;
        let reasoning_tokens = parse_u32(r, path, n, "reasoning_tokens")?;
        let answer_tokens = parse_u32(ans, path, n, "answer_tokens")?;
        if answer_tokens == 0 {
            return Err(parse_err(path, n, "answer_tokens", "must be >= 1 (every request streams an answer)".into()));
        }
        let arrival_ns = (arrival_s * 1e9).round() as u64;
        let output = TraceOutput::Split { reasoning_tokens, answer_tokens };
        rows.push(checked(TraceRow { arrival_ns, prompt_tokens, output, content_ids: Vec::new() }, path, n)?);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn data(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../data").join(rel)
    }

    #[test]
    fn real_azure_code_trace_parses_every_row() {
        let rows = load_trace(&data("traces/AzureLLMInferenceTrace_code.csv"), TraceFormat::Azure).unwrap();
        assert_eq!(rows.len(), 8_819);
        // First row: 2023-11-16 18:17:03.9799600,4808,10
        assert_eq!(rows[0].prompt_tokens, 4808);
        assert_eq!(rows[0].output, TraceOutput::Total(10));
        assert_eq!(rows[0].arrival_ns, 1_700_158_623_979_960_000);
        let span_s = (rows[rows.len() - 1].arrival_ns - rows[0].arrival_ns) as f64 * 1e-9;
        assert!((3_000.0..3_700.0).contains(&span_s), "about an hour, got {span_s}");
    }

    #[test]
    fn real_azure_conv_trace_parses_every_row_without_trailing_newline() {
        let path = data("traces/AzureLLMInferenceTrace_conv.csv");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.ends_with('\n'), "the published file has no trailing newline");
        let rows = parse_trace(&text, &path, TraceFormat::Azure).unwrap();
        assert_eq!(rows.len(), 19_366);
        // Last row: 2023-11-16 19:14:08.4025270,197,183
        let last = &rows[rows.len() - 1];
        assert_eq!((last.prompt_tokens, last.output), (197, TraceOutput::Total(183)));
        assert!(rows.iter().all(|r| r.content_ids.is_empty()), "Azure traces carry no content ids");
    }

    #[test]
    fn real_mooncake_trace_parses_every_row() {
        let rows = load_trace(&data("traces/mooncake_conversation_trace.jsonl"), TraceFormat::Mooncake).unwrap();
        assert_eq!(rows.len(), 12_031);
        // First line: {"timestamp": 0, "input_length": 6758, "output_length": 500,
        // "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}
        assert_eq!(
            rows[0],
            TraceRow {
                arrival_ns: 0,
                prompt_tokens: 6758,
                output: TraceOutput::Total(500),
                content_ids: (0..14).collect()
            }
        );
        assert_eq!(rows[rows.len() - 1].arrival_ns, 3_536_999 * 1_000_000);
        // Every row carries ids, and all of them: one per 512 prompt tokens.
        for (i, r) in rows.iter().enumerate() {
            assert_eq!(r.content_ids.len() as u32, r.prompt_tokens.div_ceil(TRACE_BLOCK_TOKENS), "row {i}");
        }
        // Row 2 starts with row 1's first id: the two prompts share their first 512 tokens.
        assert_eq!(rows[1].content_ids[..2], [0, 14]);
    }

    /// Bad `hash_ids` on line 2 of a trace whose prompt has 1000 tokens (room for ⌈1000 / 512⌉ = 2
    /// ids): (value, words the message must contain).
    #[test]
    fn malformed_hash_ids_name_the_line_and_field() {
        let table: &[(&str, &str)] = &[
            ("\"0,1\"", "got \"0,1\""),
            ("[-1]", "element 0 is -1"),
            ("[1.5]", "element 0 is 1.5"),
            ("[null]", "element 0 is null"),
            ("[3, null]", "element 1 is null"),
            ("{}", "got {}"),
            ("[18446744073709551616]", "below 2^64"),
            ("[1, 2, 3]", "3 ids for 1000 input tokens, more than the 2"),
        ];
        let first = r#"{"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]}"#;
        let row =
            |ids: &str| format!(r#"{{"timestamp": 5, "input_length": 1000, "output_length": 5, "hash_ids": {ids}}}"#);
        for &(ids, words) in table {
            let text = format!("{first}\n{}\n", row(ids));
            let err = parse_trace(&text, Path::new("m.jsonl"), TraceFormat::Mooncake).expect_err(ids);
            let msg = err.to_string();
            assert!(msg.contains("m.jsonl:2: field `hash_ids`"), "{ids}: {msg}");
            assert!(msg.contains(words), "{ids}: {msg}");
            assert!(matches!(err, WorkloadError::Parse { line: 2, field: "hash_ids", .. }), "{ids}: {err:?}");
        }
        // Exactly the bound is fine.
        let rows = parse_trace(&format!("{first}\n{}\n", row("[0, 1]")), Path::new("m.jsonl"), TraceFormat::Mooncake);
        assert_eq!(rows.unwrap()[1].content_ids, vec![0, 1]);
    }

    #[test]
    fn missing_null_short_and_empty_hash_ids_are_accepted() {
        let text = concat!(
            "{\"timestamp\": 0, \"input_length\": 2000, \"output_length\": 5}\n",
            "{\"timestamp\": 1, \"input_length\": 2000, \"output_length\": 5, \"hash_ids\": null}\n",
            "{\"timestamp\": 2, \"input_length\": 2000, \"output_length\": 5, \"hash_ids\": []}\n",
            "{\"timestamp\": 3, \"input_length\": 2000, \"output_length\": 5, \"hash_ids\": [7]}\n",
            "{\"timestamp\": 4, \"input_length\": 2000, \"output_length\": 5, \"hash_ids\": [18446744073709551615, 0, 9, 9]}\n",
        );
        let rows = parse_trace(text, Path::new("m.jsonl"), TraceFormat::Mooncake).unwrap();
        let ids: Vec<&[u64]> = rows.iter().map(|r| r.content_ids.as_slice()).collect();
        assert_eq!(ids, vec![&[][..], &[], &[], &[7], &[u64::MAX, 0, 9, 9]]);
    }

    #[test]
    fn good_fixtures_parse() {
        let kv = load_trace(&data("fixtures/kvfleet_sample.csv"), TraceFormat::Kvfleet).unwrap();
        assert_eq!(kv.len(), 6);
        assert_eq!(
            kv[0],
            TraceRow {
                arrival_ns: 0,
                prompt_tokens: 128,
                output: TraceOutput::Split { reasoning_tokens: 600, answer_tokens: 200 },
                content_ids: Vec::new()
            }
        );
        assert!(kv.iter().any(|r| matches!(r.output, TraceOutput::Split { reasoning_tokens: 0, .. })));
        let az = load_trace(&data("fixtures/azure_sample.csv"), TraceFormat::Azure).unwrap();
        assert_eq!(az.len(), 4);
        assert_eq!(az[1].arrival_ns - az[0].arrival_ns, 52_000_000);
        let mc = load_trace(&data("fixtures/mooncake_sample.jsonl"), TraceFormat::Mooncake).unwrap();
        assert_eq!(mc.len(), 4);
        assert_eq!(mc[3].arrival_ns, 2_500_500_000);
        let ids: Vec<&[u64]> = mc.iter().map(|r| r.content_ids.as_slice()).collect();
        assert_eq!(ids, vec![&[0, 1, 2][..], &[0, 14], &[], &[7]]);
    }

    /// Malformed fixtures: (file, format, line, field, words the message must contain).
    #[test]
    fn malformed_fixtures_name_file_line_and_field() {
        let table: &[(&str, TraceFormat, usize, &str, &str)] = &[
            ("azure_bad_digit.csv", TraceFormat::Azure, 3, "ContextTokens", "\"12a\""),
            ("azure_bad_timestamp.csv", TraceFormat::Azure, 2, "TIMESTAMP", "2023-11-16T18:17:04"),
            ("azure_bad_header.csv", TraceFormat::Azure, 1, "header", "TIMESTAMP,ContextTokens,GeneratedTokens"),
            ("azure_missing_field.csv", TraceFormat::Azure, 4, "GeneratedTokens", "missing"),
            ("mooncake_bad_field.jsonl", TraceFormat::Mooncake, 2, "output_length", "\"many\""),
            ("mooncake_missing_field.jsonl", TraceFormat::Mooncake, 3, "input_length", "missing"),
            ("mooncake_bad_json.jsonl", TraceFormat::Mooncake, 2, "json", "JSON"),
            ("kvfleet_bad_header.csv", TraceFormat::Kvfleet, 2, "header", "arrival_s"),
            ("kvfleet_zero_answer.csv", TraceFormat::Kvfleet, 4, "answer_tokens", ">= 1"),
            ("kvfleet_extra_field.csv", TraceFormat::Kvfleet, 3, "row", "found 5"),
            ("kvfleet_negative_arrival.csv", TraceFormat::Kvfleet, 2, "arrival_s", "-1.5"),
        ];
        for &(file, format, line, field, words) in table {
            let path = data(&format!("fixtures/{file}"));
            let err = load_trace(&path, format).expect_err(file);
            let msg = err.to_string();
            assert!(msg.contains(&format!("{file}:{line}: field `{field}`")), "{file}: {msg}");
            assert!(msg.contains(words), "{file}: {msg}");
            assert!(
                matches!(err, WorkloadError::Parse { line: l, field: f, .. } if l == line && f == field),
                "{file}: {err:?}"
            );
        }
    }

    #[test]
    fn missing_and_empty_files_are_errors_naming_the_path() {
        let path = data("fixtures/does_not_exist.csv");
        let err = load_trace(&path, TraceFormat::Azure).unwrap_err();
        assert!(matches!(err, WorkloadError::Io { .. }));
        assert!(err.to_string().contains("does_not_exist.csv"), "{err}");
        let empty = data("fixtures/kvfleet_header_only.csv");
        let err = load_trace(&empty, TraceFormat::Kvfleet).unwrap_err();
        assert!(
            err.to_string().contains("kvfleet_header_only.csv") && err.to_string().contains("no requests"),
            "{err}"
        );
        let err = parse_trace("", Path::new("x.csv"), TraceFormat::Azure).unwrap_err();
        assert!(err.to_string().contains("x.csv: empty file"), "{err}");
    }

    #[test]
    fn crlf_bom_blank_lines_and_comments_are_tolerated() {
        let text = "\u{feff}# kvfleet trace\r\narrival_s,prompt_tokens,reasoning_tokens,answer_tokens\r\n\r\n0.5, 10 ,0,1\r\n# done\r\n";
        let rows = parse_trace(text, Path::new("t.csv"), TraceFormat::Kvfleet).unwrap();
        assert_eq!(
            rows,
            vec![TraceRow {
                arrival_ns: 500_000_000,
                prompt_tokens: 10,
                output: TraceOutput::Split { reasoning_tokens: 0, answer_tokens: 1 },
                content_ids: Vec::new()
            }]
        );
    }

    #[test]
    fn wall_clock_timestamps_convert_exactly() {
        let table: &[(&str, Option<u64>)] = &[
            ("1970-01-01 00:00:00", Some(0)),
            ("1970-01-02 00:00:01.5", Some(86_401_500_000_000)),
            ("2000-03-01 00:00:00.000000001", Some(951_868_800_000_000_001)),
            ("2023-11-16 18:17:03.9799600", Some(1_700_158_623_979_960_000)),
            ("2023-13-16 18:17:03.9", None),
            ("2023-11-16 18:17", None),
            ("2023-11-16 18:17:03.1234567890", None),
            ("2023-11-16 18:17:-3", None),
            ("1969-12-31 23:59:59", None),
            ("", None),
        ];
        for &(s, want) in table {
            assert_eq!(parse_wall_clock_ns(s).ok(), want, "{s}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// The decoders never panic, whatever the bytes.
        #[test]
        fn parsers_never_panic(body in "[ -~\\n\\r\\u{7f}-\\u{3000}]{0,200}", pick in 0usize..3) {
            let header = [AZURE_HEADER, "", KVFLEET_HEADER][pick];
            let text = format!("{header}\n{body}");
            for f in [TraceFormat::Azure, TraceFormat::Mooncake, TraceFormat::Kvfleet] {
                let _ = parse_trace(&text, Path::new("fuzz"), f);
                let _ = parse_trace(&body, Path::new("fuzz"), f);
            }
        }
    }
}
