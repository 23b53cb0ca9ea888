//! SVG plots of an [`Analysis`]:
//!
//! | file | what |
//! |---|---|
//! | `downtime_vs_kv_tokens.svg` | downtime against sequence length (`kvfleet.migration.kv_tokens`), one colour per policy; hollow marks are not committed |
//! | `gantt_slowest.svg` | the phases of the N slowest migrations on a common time axis (source lane, target lane, downtime lane) |
//! | `cdf_downtime.svg` | CDF of downtime per policy |
//! | `cdf_total.svg` | CDF of total migration time per policy |
//!
//! A plot without data is not written. Text is SVG `<text>` (no font files), as in
//! cli/src/plots.rs.

use crate::model::{Analysis, TracedMigration};
use crate::TracesError;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::ops::Range;
use std::path::{Path, PathBuf};

const SIZE_PX: (u32, u32) = (900, 600);
/// Points per CDF line at most (a 100 000-migration run must not make a 10 MB SVG).
const MAX_CDF_POINTS: usize = 1000;

/// Tableau 10: distinguishable, and readable in print (the CLI's plots use it too).
pub const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Gantt colours by phase; `target` is the target span's whole life, drawn under its phases.
const PHASE_COLORS: [(&str, RGBColor); 11] = [
    ("target", RGBColor(210, 210, 210)),
    ("prepare", PALETTE[0]),
    ("stage", PALETTE[9]),
    ("pause", PALETTE[1]),
    ("stop_copy", PALETTE[3]),
    ("commit", PALETTE[2]),
    ("abort", RGBColor(0, 0, 0)),
    ("reserve", PALETTE[4]),
    ("verify", PALETTE[6]),
    ("attach", PALETTE[8]),
    ("downtime", PALETTE[5]),
];

fn plot_err(name: &str) -> impl Fn(String) -> TracesError + '_ {
    move |what| TracesError::Plot { name: name.to_string(), what }
}

/// `0 ..= max·1.05` (`0..1` without positive data).
fn upto(values: impl Iterator<Item = f64>) -> Range<f64> {
    let max = values.filter(|v| v.is_finite()).fold(0.0, f64::max);
    0.0..if max > 0.0 { max * 1.05 } else { 1.0 }
}

/// Policies, sorted, each with its colour.
fn policies(a: &Analysis) -> Vec<(String, RGBColor)> {
    a.by_policy.iter().enumerate().map(|(i, g)| (g.key.clone(), PALETTE[i % PALETTE.len()])).collect()
}

/// Writes every plot the analysis has data for into `dir` (created if missing); `slowest` is
/// the number of migrations in the Gantt chart.
pub fn write_plots(dir: &Path, a: &Analysis, slowest: usize) -> Result<Vec<PathBuf>, TracesError> {
    std::fs::create_dir_all(dir).map_err(|e| TracesError::io(dir, e))?;
    let mut written = Vec::new();
    let path = dir.join("downtime_vs_kv_tokens.svg");
    if downtime_vs_tokens(&path, a)? {
        written.push(path);
    }
    let path = dir.join("gantt_slowest.svg");
    if gantt(&path, &a.slowest(slowest))? {
        written.push(path);
    }
    let path = dir.join("cdf_downtime.svg");
    if cdf(&path, a, "downtime", |m| m.downtime_ms)? {
        written.push(path);
    }
    let path = dir.join("cdf_total.svg");
    if cdf(&path, a, "total migration time", |m| Some(m.total_ms))? {
        written.push(path);
    }
    Ok(written)
}

fn downtime_vs_tokens(path: &Path, a: &Analysis) -> Result<bool, TracesError> {
    let points: Vec<(&TracedMigration, f64, f64)> = a
        .migrations
        .iter()
        .filter_map(|m| Some((m, m.kv_tokens? as f64, m.downtime_ms?)))
        .filter(|(_, x, y)| x.is_finite() && y.is_finite())
        .collect();
    if points.is_empty() {
        return Ok(false);
    }
    let name = path.display().to_string();
    let err = plot_err(&name);
    let root = SVGBackend::new(path, SIZE_PX).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption("migration downtime vs sequence length", ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(upto(points.iter().map(|p| p.1)), upto(points.iter().map(|p| p.2)))
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("KV tokens (sequence length)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_desc("downtime (ms)")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (policy, color) in policies(a) {
        let mine: Vec<_> = points.iter().filter(|(m, ..)| m.policy == policy).collect();
        let marks = mine.iter().map(|(m, x, y)| {
            let style = if m.outcome == "committed" { color.filled() } else { color.stroke_width(1) };
            Circle::new((*x, *y), 3, style)
        });
        chart
            .draw_series(marks)
            .map_err(|e| err(e.to_string()))?
            .label(policy)
            .legend(move |(x, y)| Circle::new((x + 5, y), 3, color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(true)
}

/// Lane of a phase within a migration's row (fractions of the row height, bottom to top).
fn lane(phase: &str, side: &str) -> (f64, f64) {
    match (phase, side) {
        ("downtime", _) => (0.06, 0.18),
        (_, "target") => (0.22, 0.52),
        _ => (0.56, 0.94),
    }
}

fn gantt(path: &Path, slow: &[&TracedMigration]) -> Result<bool, TracesError> {
    if slow.is_empty() {
        return Ok(false);
    }
    let name = path.display().to_string();
    let err = plot_err(&name);
    let n = slow.len();
    let x_range = upto(slow.iter().flat_map(|m| {
        m.phases
            .iter()
            .map(|p| p.offset_ms + p.duration_ms)
            .chain([m.total_ms, m.end_ns.saturating_sub(m.start_ns) as f64 / 1e6])
    }));
    // Room on the right for the legend, clear of the bars.
    let x_range = x_range.start..x_range.end * 1.3;
    let height = (120 + 48 * n as u32).max(300);
    let root = SVGBackend::new(path, (SIZE_PX.0 + 100, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("phases of the {n} slowest migrations"), ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(190)
        .build_cartesian_2d(x_range, 0.0..n as f64)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("ms since the migration started (rows top to bottom: lanes source, target, downtime)")
        .y_labels(0)
        .disable_y_mesh()
        .draw()
        .map_err(|e| err(e.to_string()))?;
    // Row k from the top is y ∈ [n−1−k, n−k].
    let row = |k: usize| (n - 1 - k) as f64;
    for (phase, color) in PHASE_COLORS {
        let mut bars = Vec::new();
        for (k, m) in slow.iter().enumerate() {
            for p in m.phases.iter().filter(|p| p.name == phase) {
                let (lo, hi) = lane(phase, p.side);
                // A zero-length phase (an abort) still shows as a sliver.
                let x1 = p.offset_ms + p.duration_ms.max(0.0);
                bars.push([(p.offset_ms, row(k) + lo), (x1, row(k) + hi)]);
            }
        }
        if bars.is_empty() {
            continue;
        }
        chart
            .draw_series(bars.iter().map(|&b| Rectangle::new(b, color.filled())))
            .map_err(|e| err(e.to_string()))?
            .label(phase)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        // Outlines keep adjacent stages apart.
        chart
            .draw_series(bars.iter().map(|&b| Rectangle::new(b, WHITE.stroke_width(1))))
            .map_err(|e| err(e.to_string()))?;
    }
    let font = ("sans-serif", 13).into_font();
    for (k, m) in slow.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(0.0, row(k) + 0.5));
        let label = format!("{} {} {}", m.migration_id, m.link, m.outcome);
        let style = font.clone().into_text_style(&root).pos(Pos::new(HPos::Right, VPos::Center));
        root.draw(&Text::new(label, (px - 8, py), style)).map_err(|e| err(e.to_string()))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(true)
}

/// A named, coloured line.
type Series = (String, RGBColor, Vec<(f64, f64)>);

/// Every `len / MAX_CDF_POINTS`-th point, the first and last kept.
fn thin(points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    let n = points.len();
    if n <= MAX_CDF_POINTS {
        return points;
    }
    let last = (MAX_CDF_POINTS - 1) as f64;
    (0..MAX_CDF_POINTS).map(|i| points[((i as f64) * (n - 1) as f64 / last).round() as usize]).collect()
}

fn cdf(path: &Path, a: &Analysis, what: &str, value: fn(&TracedMigration) -> Option<f64>) -> Result<bool, TracesError> {
    let series: Vec<Series> = policies(a)
        .into_iter()
        .filter_map(|(policy, color)| {
            let mut v: Vec<f64> = a
                .migrations
                .iter()
                .filter(|m| m.policy == policy)
                .filter_map(value)
                .filter(|v| v.is_finite())
                .collect();
            if v.is_empty() {
                return None;
            }
            v.sort_by(f64::total_cmp);
            // The empirical CDF as steps: up at each sample, flat in between.
            let n = v.len() as f64;
            let pts = v.iter().enumerate().flat_map(|(i, &x)| [(x, i as f64 / n), (x, (i + 1) as f64 / n)]).collect();
            Some((policy, color, thin(pts)))
        })
        .collect();
    if series.is_empty() {
        return Ok(false);
    }
    let name = path.display().to_string();
    let err = plot_err(&name);
    let root = SVGBackend::new(path, SIZE_PX).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("CDF of {what} per policy"), ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(upto(series.iter().flat_map(|s| s.2.iter().map(|p| p.0))), 0.0..1.0)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc(format!("{what} (ms)"))
        .y_desc("fraction of migrations")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (policy, color, pts) in series {
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(policy)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(true)
}
