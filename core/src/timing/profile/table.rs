//! Parsing of the profile CSV tables (`decode.csv`, `prefill.csv`, `copy.csv`).
//!
//! Hand-written rather than a CSV crate: the files are three numeric columns, and every error
//! must name the file, the 1-based line and the field.
//! The first non-blank, non-`#` line is the header; columns are found by name (any order, extra
//! columns ignored), so a profiler may add columns such as a p90 without breaking readers.

use super::TimingError;
use std::collections::HashSet;
use std::str::FromStr;

/// One measured decode iteration: `batch` sequences, each at `context` tokens (counting the new one).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodePoint {
    /// Decoding sequences in the iteration.
    pub batch: u32,
    /// Context length of each sequence, tokens.
    pub context: u32,
    /// Measured iteration time, ms.
    pub iter_ms: f64,
}

/// One measured prefill iteration of a single prompt of `tokens` tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillPoint {
    /// Prompt length, tokens.
    pub tokens: u32,
    /// Measured iteration time, ms.
    pub iter_ms: f64,
}

/// Direction of a measured copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CopyDirection {
    /// Host → device: KV reload.
    H2d,
    /// Device → host: KV offload.
    D2h,
    /// Device → device (not used for timing; kept so the file round-trips).
    D2d,
}

/// One measured copy rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CopyPoint {
    /// Which way the bytes went.
    pub direction: CopyDirection,
    /// Size of the measured copy, bytes.
    pub bytes: u64,
    /// Payload rate, GB/s = 1e9 bytes/s.
    pub gbps: f64,
}

/// Data rows of a CSV text: `(line number, fields in the order of `columns`)`.
fn rows<'a, const N: usize>(
    file: &str,
    text: &'a str,
    columns: [&str; N],
) -> Result<Vec<(usize, [&'a str; N])>, TimingError> {
    let mut lines =
        text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())).filter(|(_, l)| !l.is_empty() && !l.starts_with('#'));
    let Some((header_line, header)) = lines.next() else {
        return Err(TimingError::Table {
            file: file.into(),
            message: format!("empty; expected a header `{}`", columns.join(",")),
        });
    };
    let names: Vec<String> = header.split(',').map(|s| s.trim().to_ascii_lowercase()).collect();
    let mut index = [0usize; N];
    for (slot, col) in index.iter_mut().zip(columns) {
        *slot = names.iter().position(|n| n == col).ok_or_else(|| TimingError::Parse {
            file: file.into(),
            line: header_line,
            field: col.into(),
            message: format!("missing column (header is `{header}`, expected `{}`)", columns.join(",")),
        })?;
    }
    let mut out = Vec::new();
    for (line, l) in lines {
        let fields: Vec<&str> = l.split(',').map(str::trim).collect();
        if fields.len() != names.len() {
            return Err(TimingError::Parse {
                file: file.into(),
                line,
                field: "row".into(),
                message: format!("expected {} fields like the header, found {}", names.len(), fields.len()),
            });
        }
        out.push((line, index.map(|i| fields[i])));
    }
    if out.is_empty() {
        return Err(TimingError::Table { file: file.into(), message: "header but no data rows".into() });
    }
    Ok(out)
}

fn num<T: FromStr>(file: &str, line: usize, field: &str, raw: &str) -> Result<T, TimingError> {
    raw.parse::<T>().map_err(|_| TimingError::Parse {
        file: file.into(),
        line,
        field: field.into(),
        message: format!("`{raw}` is not a valid {}", std::any::type_name::<T>()),
    })
}

fn positive_int<T: FromStr + Default + PartialOrd>(
    file: &str,
    line: usize,
    field: &str,
    raw: &str,
) -> Result<T, TimingError> {
    let v: T = num(file, line, field, raw)?;
    if v <= T::default() {
        return Err(TimingError::Parse {
            file: file.into(),
            line,
            field: field.into(),
            message: format!("must be > 0, got {raw}"),
        });
    }
    Ok(v)
}

fn positive_f64(file: &str, line: usize, field: &str, raw: &str) -> Result<f64, TimingError> {
    let v: f64 = num(file, line, field, raw)?;
    if !(v.is_finite() && v > 0.0) {
        return Err(TimingError::Parse {
            file: file.into(),
            line,
            field: field.into(),
            message: format!("must be a positive finite number, got {raw}"),
        });
    }
    Ok(v)
}

fn duplicate(file: &str, line: usize, what: String) -> TimingError {
    TimingError::Parse { file: file.into(), line, field: "row".into(), message: format!("duplicate point {what}") }
}

/// Parses `batch,context,iter_ms`.
pub fn parse_decode(file: &str, text: &str) -> Result<Vec<DecodePoint>, TimingError> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (line, [b, c, t]) in rows(file, text, ["batch", "context", "iter_ms"])? {
        let p = DecodePoint {
            batch: positive_int(file, line, "batch", b)?,
            context: positive_int(file, line, "context", c)?,
            iter_ms: positive_f64(file, line, "iter_ms", t)?,
        };
        if !seen.insert((p.batch, p.context)) {
            return Err(duplicate(file, line, format!("(batch {}, context {})", p.batch, p.context)));
        }
        out.push(p);
    }
    Ok(out)
}

/// Parses `tokens,iter_ms`.
pub fn parse_prefill(file: &str, text: &str) -> Result<Vec<PrefillPoint>, TimingError> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (line, [n, t]) in rows(file, text, ["tokens", "iter_ms"])? {
        let p = PrefillPoint {
            tokens: positive_int(file, line, "tokens", n)?,
            iter_ms: positive_f64(file, line, "iter_ms", t)?,
        };
        if !seen.insert(p.tokens) {
            return Err(duplicate(file, line, format!("(tokens {})", p.tokens)));
        }
        out.push(p);
    }
    Ok(out)
}

/// Parses `direction,bytes,gbps` (`direction` ∈ h2d, d2h, d2d, any case).
pub fn parse_copy(file: &str, text: &str) -> Result<Vec<CopyPoint>, TimingError> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (line, [d, n, r]) in rows(file, text, ["direction", "bytes", "gbps"])? {
        let direction = match d.to_ascii_lowercase().as_str() {
            "h2d" => CopyDirection::H2d,
            "d2h" => CopyDirection::D2h,
            "d2d" => CopyDirection::D2d,
            _ => {
                return Err(TimingError::Parse {
                    file: file.into(),
                    line,
                    field: "direction".into(),
                    message: format!("`{d}` is not one of h2d, d2h, d2d"),
                })
            }
        };
        let p = CopyPoint {
            direction,
            bytes: positive_int(file, line, "bytes", n)?,
            gbps: positive_f64(file, line, "gbps", r)?,
        };
        if !seen.insert((p.direction, p.bytes)) {
            return Err(duplicate(file, line, format!("({d}, {} bytes)", p.bytes)));
        }
        out.push(p);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_with_reordered_and_extra_columns_comments_and_blank_lines() {
        let text = "# measured somewhere\n\ncontext, batch ,iter_ms,p90_ms\n128,1,24.5,25\n\n512,2,26.0,27\n";
        let pts = parse_decode("d.csv", text).unwrap();
        assert_eq!(
            pts,
            vec![
                DecodePoint { batch: 1, context: 128, iter_ms: 24.5 },
                DecodePoint { batch: 2, context: 512, iter_ms: 26.0 },
            ]
        );
        let c = parse_copy("c.csv", "direction,bytes,gbps\nH2D,1024,50.5\n").unwrap();
        assert_eq!(c[0].direction, CopyDirection::H2d);
    }

    /// Each malformed input and the (line, field) its error must name.
    #[test]
    fn errors_name_file_line_and_field() {
        type Parser = fn(&str, &str) -> Result<(), TimingError>;
        let dec: Parser = |f, t| parse_decode(f, t).map(|_| ());
        let pre: Parser = |f, t| parse_prefill(f, t).map(|_| ());
        let cpy: Parser = |f, t| parse_copy(f, t).map(|_| ());
        let cases: &[(Parser, &str, usize, &str)] = &[
            (dec, "batch,context,iter_ms\n1,128,24.0\n2,abc,25.0\n", 3, "context"),
            (dec, "batch,context,iter_ms\n1,128,24.0\n0,128,25.0\n", 3, "batch"),
            (dec, "batch,context,iter_ms\n1,128,-3\n", 2, "iter_ms"),
            (dec, "batch,context,iter_ms\n1,128,NaN\n", 2, "iter_ms"),
            (dec, "batch,context,iter_ms\n1,128\n", 2, "row"),
            (dec, "batch,context,iter_ms\n1,128,24\n1,128,25\n", 3, "row"),
            (dec, "# c\nbatch,ctx,iter_ms\n1,128,24\n", 2, "context"),
            (pre, "tokens,iter_ms\n128,27.5\n256,\n", 3, "iter_ms"),
            (pre, "tokens,iter_ms\n1.5,27.5\n", 2, "tokens"),
            (cpy, "direction,bytes,gbps\nh2d,1024,50\nup,1024,50\n", 3, "direction"),
            (cpy, "direction,bytes,gbps\nh2d,-1,50\n", 2, "bytes"),
        ];
        for (i, (parse, text, line, field)) in cases.iter().enumerate() {
            match parse("some.csv", text) {
                Err(TimingError::Parse { file, line: l, field: f, message }) => {
                    assert_eq!((file.as_str(), l, f.as_str()), ("some.csv", *line, *field), "case {i}: {message}");
                    let shown = TimingError::Parse { file, line: l, field: f, message }.to_string();
                    assert!(shown.contains(&format!("some.csv:{line}")) && shown.contains(field), "case {i}: {shown}");
                }
                other => panic!("case {i}: expected a parse error, got {other:?}"),
            }
        }
    }

    #[test]
    fn empty_tables_are_rejected() {
        assert!(matches!(parse_decode("d.csv", ""), Err(TimingError::Table { .. })));
        assert!(matches!(parse_prefill("p.csv", "tokens,iter_ms\n"), Err(TimingError::Table { .. })));
    }
}
