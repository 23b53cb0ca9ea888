//! SVG plots of a sweep, one line per policy, in the shape of PASCAL's evaluation figures:
//!
//! | file | what | PASCAL |
//! |---|---|---|
//! | `ttft_cdf[-rate-R].svg` | CDF of TTFT (to the first answer token) | Fig. 15(a) |
//! | `tail_ttft[-rate-R].svg` | tail TTFT per 256-token reasoning-length bin ([`TailBin`]) | Fig. 10 |
//! | `slo_violation_vs_rate.svg` | share of requests with QoE < threshold vs arrival rate | Fig. 11, 15(b) |
//! | `tail_ttft_p99_vs_rate.svg` | TTFT P99 vs arrival rate | §V-B |
//!
//! The per-rate plots get a `-rate-R` suffix (`R` = the rate, or `trace`) only when the runs
//! span more than one rate; the vs-rate plots need at least two rates. A latency axis turns
//! logarithmic when its data spans more than two decades (baselines' tail TTFT can be 100× PASCAL's,
//! Fig. 10). Colours are fixed per policy by the sorted order of all policy names, so a policy has
//! the same colour in every plot of a sweep. A plot with no data points is skipped.
//!
//! Rendering uses plotters' SVG backend without font files: text is emitted as SVG `<text>`, so
//! the viewer picks the font.

use crate::report::{file_safe, rate_label};
use anyhow::{anyhow, Context as _};
use kvfleet_core::metrics::{ttft_cdf, TailBin};
use kvfleet_sim::RunResult;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use std::ops::Range;
use std::path::{Path, PathBuf};

const SIZE_PX: (u32, u32) = (900, 600);
/// At most this many points per CDF line: enough to look continuous, small enough that a
/// 100 000-request run does not make a 10 MB SVG.
const MAX_CDF_POINTS: usize = 1000;
/// An axis whose positive data spans more than this ratio (two decades) is drawn logarithmic.
const LOG_AXIS_SPAN: f64 = 100.0;

use kvfleet_otel::plots::PALETTE;

/// One line of a chart.
struct Series {
    name: String,
    color: RGBColor,
    points: Vec<(f64, f64)>,
}

/// How an axis is drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Axis {
    /// Linear from the data's minimum (or 0 when `from_zero`) to its maximum.
    Linear { from_zero: bool },
    /// Fixed linear range (a CDF's 0..1).
    Fixed(f64, f64),
    /// Logarithmic when the data spans more than [`LOG_AXIS_SPAN`], else linear from zero.
    Auto,
}

/// Everything one chart needs besides its data.
struct ChartSpec<'a> {
    title: String,
    x_desc: &'a str,
    y_desc: &'a str,
    x_axis: Axis,
    y_axis: Axis,
    markers: bool,
    legend: SeriesLabelPosition,
}

/// Colours by policy: position of the name among all policies, sorted.
struct Colors(Vec<String>);

impl Colors {
    fn new(runs: &[RunResult]) -> Colors {
        let mut names: Vec<String> = runs.iter().map(|r| r.policy.clone()).collect();
        names.sort();
        names.dedup();
        Colors(names)
    }

    fn of(&self, policy: &str) -> RGBColor {
        let i = self.0.binary_search_by(|n| n.as_str().cmp(policy)).unwrap_or(0);
        PALETTE[i % PALETTE.len()]
    }
}

/// Distinct rates, trace (`None`) first, then ascending.
fn distinct_rates(runs: &[RunResult]) -> Vec<Option<f64>> {
    let mut rates: Vec<Option<f64>> = runs.iter().map(|r| r.rate).collect();
    rates.sort_by(|a, b| match (a, b) {
        (Some(a), Some(b)) => a.total_cmp(b),
        _ => a.is_some().cmp(&b.is_some()),
    });
    rates.dedup_by(|a, b| a.map(f64::to_bits) == b.map(f64::to_bits));
    rates
}

/// Whether two runs' rates are the same (both a trace's arrivals, or bit-equal).
pub fn same_rate(a: Option<f64>, b: Option<f64>) -> bool {
    a.map(f64::to_bits) == b.map(f64::to_bits)
}

fn rate_title(rate: Option<f64>) -> String {
    match rate {
        Some(r) => format!("{r} req/s"),
        None => "trace".to_string(),
    }
}

/// Every `len / MAX_CDF_POINTS`-th point, always keeping the first and last.
fn thin(points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    let n = points.len();
    if n <= MAX_CDF_POINTS {
        return points;
    }
    let last = (MAX_CDF_POINTS - 1) as f64;
    (0..MAX_CDF_POINTS).map(|i| points[((i as f64) * (n - 1) as f64 / last).round() as usize]).collect()
}

/// Midpoint of a bin, in tokens.
fn bin_mid(b: &TailBin) -> f64 {
    (f64::from(b.lo) + f64::from(b.hi) + 1.0) / 2.0
}

/// Writes every plot the runs support into `out_dir` (created if missing) and returns the paths
/// written; plots without data are skipped.
pub fn write_plots(out_dir: &Path, runs: &[RunResult]) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating output directory {}", out_dir.display()))?;
    let colors = Colors::new(runs);
    let rates = distinct_rates(runs);
    let mut written = Vec::new();
    let mut emit = |name: String, spec: ChartSpec, series: Vec<Series>| -> anyhow::Result<()> {
        let path = out_dir.join(name);
        if let Some(svg) = render(&spec, series).with_context(|| format!("drawing {}", path.display()))? {
            std::fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))?;
            written.push(path);
        }
        Ok(())
    };

    for &rate in &rates {
        let group: Vec<&RunResult> = runs.iter().filter(|r| same_rate(r.rate, rate)).collect();
        let suffix = if rates.len() > 1 { format!("-rate-{}", file_safe(&rate_label(rate))) } else { String::new() };
        let cdf = group
            .iter()
            .map(|r| Series { name: r.policy.clone(), color: colors.of(&r.policy), points: thin(ttft_cdf(&r.records)) })
            .collect();
        let spec = ChartSpec {
            title: format!("TTFT CDF, {}", rate_title(rate)),
            x_desc: "TTFT to first answer token (s)",
            y_desc: "fraction of requests",
            x_axis: Axis::Auto,
            y_axis: Axis::Fixed(0.0, 1.02),
            markers: false,
            legend: SeriesLabelPosition::LowerRight,
        };
        emit(format!("ttft_cdf{suffix}.svg"), spec, cdf)?;

        let tail = group
            .iter()
            .map(|r| Series {
                name: r.policy.clone(),
                color: colors.of(&r.policy),
                points: r.tail_ttft.iter().map(|b| (bin_mid(b), b.ttft_s)).collect(),
            })
            .collect();
        let spec = ChartSpec {
            title: format!("Tail TTFT by reasoning length, {}", rate_title(rate)),
            x_desc: "reasoning length (tokens, 256-token bin midpoints)",
            y_desc: "tail TTFT (s; max/P90/P95/P99 by bin size)",
            x_axis: Axis::Linear { from_zero: true },
            y_axis: Axis::Auto,
            markers: true,
            legend: SeriesLabelPosition::UpperLeft,
        };
        emit(format!("tail_ttft{suffix}.svg"), spec, tail)?;
    }

    if rates.iter().flatten().count() >= 2 {
        let vs_rate = |value: &dyn Fn(&RunResult) -> Option<f64>| -> Vec<Series> {
            colors
                .0
                .iter()
                .map(|policy| {
                    let mut points: Vec<(f64, f64)> = runs
                        .iter()
                        .filter(|r| &r.policy == policy)
                        .filter_map(|r| Some((r.rate?, value(r)?)))
                        .collect();
                    points.sort_by(|a, b| a.0.total_cmp(&b.0));
                    Series { name: policy.clone(), color: colors.of(policy), points }
                })
                .collect()
        };
        let slo = vs_rate(&|r| r.summary.slo_violation_rate.map(|v| v * 100.0));
        let p99 = vs_rate(&|r| r.summary.ttft_p99_s);
        let spec = ChartSpec {
            title: "SLO violation vs arrival rate".to_string(),
            x_desc: "arrival rate (req/s)",
            y_desc: "SLO violation (% of finished requests, QoE below threshold)",
            x_axis: Axis::Linear { from_zero: false },
            y_axis: Axis::Linear { from_zero: true },
            markers: true,
            legend: SeriesLabelPosition::UpperLeft,
        };
        emit("slo_violation_vs_rate.svg".to_string(), spec, slo)?;
        let spec = ChartSpec {
            title: "TTFT P99 vs arrival rate".to_string(),
            x_desc: "arrival rate (req/s)",
            y_desc: "TTFT P99 (s)",
            x_axis: Axis::Linear { from_zero: false },
            y_axis: Axis::Auto,
            markers: true,
            legend: SeriesLabelPosition::UpperLeft,
        };
        emit("tail_ttft_p99_vs_rate.svg".to_string(), spec, p99)?;
    }
    Ok(written)
}

/// A resolved axis: its range and whether it is logarithmic.
#[derive(Clone, Debug, PartialEq)]
struct Resolved {
    range: Range<f64>,
    log: bool,
}

/// The range an axis shows for `values` (all finite, at least one).
fn resolve(axis: Axis, values: &[f64]) -> Resolved {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let linear = |lo: f64, hi: f64| {
        let pad = if hi > lo { (hi - lo) * 0.05 } else { hi.abs().max(1.0) * 0.1 };
        let lo = if lo >= 0.0 && lo - pad < 0.0 { 0.0 } else { lo - pad };
        Resolved { range: lo..hi + pad, log: false }
    };
    match axis {
        Axis::Fixed(lo, hi) => Resolved { range: lo..hi, log: false },
        Axis::Linear { from_zero: true } => linear(min.min(0.0), max),
        Axis::Linear { from_zero: false } => linear(min, max),
        Axis::Auto => {
            let min_pos = values.iter().copied().filter(|&v| v > 0.0).fold(f64::INFINITY, f64::min);
            if min_pos.is_finite() && max / min_pos > LOG_AXIS_SPAN {
                Resolved { range: min_pos / 1.25..max * 1.25, log: true }
            } else {
                linear(min.min(0.0), max)
            }
        }
    }
}

/// A tick label without float noise: `0.25`, `3`, `1.5e4`.
fn tick_label(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".to_string()
    } else if !(1e-3..1e5).contains(&a) {
        format!("{v:.1e}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// The chart as an SVG document, or `None` when no series has a finite point.
fn render(spec: &ChartSpec, series: Vec<Series>) -> anyhow::Result<Option<String>> {
    let mut series: Vec<Series> = series
        .into_iter()
        .map(|mut s| {
            s.points.retain(|(x, y)| x.is_finite() && y.is_finite());
            s
        })
        .filter(|s| !s.points.is_empty())
        .collect();
    if series.is_empty() {
        return Ok(None);
    }
    let xs: Vec<f64> = series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).collect();
    let ys: Vec<f64> = series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).collect();
    let (x, y) = (resolve(spec.x_axis, &xs), resolve(spec.y_axis, &ys));
    // A log axis cannot show zero: pin such points to the bottom of the range.
    for s in &mut series {
        for p in &mut s.points {
            if x.log {
                p.0 = p.0.max(x.range.start);
            }
            if y.log {
                p.1 = p.1.max(y.range.start);
            }
        }
    }
    let (xr, yr) = (x.range.clone(), y.range.clone());
    let svg = match (x.log, y.log) {
        (false, false) => draw(spec, &series, xr, yr),
        (true, false) => draw(spec, &series, xr.log_scale(), yr),
        (false, true) => draw(spec, &series, xr, yr.log_scale()),
        (true, true) => draw(spec, &series, xr.log_scale(), yr.log_scale()),
    }?;
    Ok(Some(svg))
}

/// Draws the chart on whichever coordinate types `x` and `y` are (linear or log).
fn draw<X, Y>(spec: &ChartSpec, series: &[Series], x: X, y: Y) -> anyhow::Result<String>
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    // plotters' errors borrow nothing but are not `'static` over the backend's lifetime; keep
    // their text.
    let plot_err = |e: &dyn std::fmt::Display| anyhow!("plotting: {e}");
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE_PX).into_drawing_area();
        root.fill(&WHITE).map_err(|e| plot_err(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&spec.title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d(x, y)
            .map_err(|e| plot_err(&e))?;
        let fmt = |v: &f64| tick_label(*v);
        chart
            .configure_mesh()
            .x_desc(spec.x_desc)
            .y_desc(spec.y_desc)
            .x_label_formatter(&fmt)
            .y_label_formatter(&fmt)
            .light_line_style(RGBColor(235, 235, 235))
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 17))
            .draw()
            .map_err(|e| plot_err(&e))?;
        for (i, s) in series.iter().enumerate() {
            let color = s.color;
            // Earlier lines are drawn wider, so a policy whose curve coincides with a later one's
            // still shows as an outline instead of vanishing.
            let width = 2 + (series.len() - 1 - i).min(3) as u32;
            let style = ShapeStyle::from(&color).stroke_width(width);
            chart
                .draw_series(LineSeries::new(s.points.iter().copied(), style))
                .map_err(|e| plot_err(&e))?
                .label(s.name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
            if spec.markers {
                chart
                    .draw_series(s.points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                    .map_err(|e| plot_err(&e))?;
            }
        }
        chart
            .configure_series_labels()
            .position(spec.legend.clone())
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()
            .map_err(|e| plot_err(&e))?;
        root.present().map_err(|e| plot_err(&e))?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::fixtures::{self, TempDir};

    fn names(paths: &[PathBuf]) -> Vec<String> {
        paths.iter().map(|p| p.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string()).collect()
    }

    fn assert_svg(path: &Path, must_contain: &[&str]) -> String {
        let svg = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(svg.starts_with("<svg") || svg.starts_with("<?xml"), "{}", &svg[..svg.len().min(80)]);
        assert!(svg.trim_end().ends_with("</svg>"), "{}", path.display());
        for s in must_contain {
            assert!(svg.contains(s), "{} lacks {s}", path.display());
        }
        svg
    }

    #[test]
    fn sweep_writes_every_plot_with_each_policy() {
        let runs = fixtures::sweep();
        let dir = TempDir::new("plots");
        let paths = write_plots(&dir.0, &runs).expect("plots");
        assert_eq!(
            names(&paths),
            [
                "ttft_cdf-rate-1.svg",
                "tail_ttft-rate-1.svg",
                "ttft_cdf-rate-2.5.svg",
                "tail_ttft-rate-2.5.svg",
                "slo_violation_vs_rate.svg",
                "tail_ttft_p99_vs_rate.svg",
            ]
        );
        for p in &paths {
            assert_svg(p, &["pascal", "fcfs", "req/s"]);
        }
        // Titles and axis labels with units.
        assert_svg(&paths[0], &["TTFT CDF, 1 req/s", "TTFT to first answer token (s)", "fraction of requests"]);
        assert_svg(&paths[4], &["SLO violation vs arrival rate", "arrival rate (req/s)"]);
    }

    #[test]
    fn one_rate_has_no_suffix_and_no_vs_rate_plots() {
        let runs = vec![
            fixtures::run("pascal", None, fixtures::records(30, 1.0), Vec::new()),
            fixtures::run("rr", None, fixtures::records(30, 2.0), Vec::new()),
        ];
        let dir = TempDir::new("plots-one");
        let paths = write_plots(&dir.0, &runs).expect("plots");
        assert_eq!(names(&paths), ["ttft_cdf.svg", "tail_ttft.svg"]);
        assert_svg(&paths[0], &["pascal", "rr", "trace"]);
    }

    #[test]
    fn empty_data_is_skipped_without_panicking() {
        let dir = TempDir::new("plots-empty");
        assert!(write_plots(&dir.0, &[]).expect("no runs").is_empty());
        let empty = vec![
            fixtures::run("pascal", Some(1.0), Vec::new(), Vec::new()),
            fixtures::run("fcfs", Some(2.0), Vec::new(), Vec::new()),
        ];
        assert!(write_plots(&dir.0, &empty).expect("empty runs").is_empty());
        // One policy with data, one without: only the one with data is drawn.
        let mixed = vec![
            fixtures::run("pascal", Some(1.0), fixtures::records(20, 1.0), Vec::new()),
            fixtures::run("fcfs", Some(1.0), Vec::new(), Vec::new()),
        ];
        let paths = write_plots(&dir.0, &mixed).expect("mixed");
        assert_eq!(names(&paths), ["ttft_cdf.svg", "tail_ttft.svg"]);
        let svg = assert_svg(&paths[0], &["pascal"]);
        assert!(!svg.contains("fcfs"));
    }

    #[test]
    fn axes_go_logarithmic_past_two_decades() {
        // (axis, data, expected log?, expected range start)
        let table: &[(Axis, &[f64], bool, f64)] = &[
            (Axis::Auto, &[0.5, 40.0], false, 0.0),
            (Axis::Auto, &[0.1, 50.0], true, 0.08),
            (Axis::Auto, &[0.0, 0.01, 2.0], true, 0.008),
            (Axis::Auto, &[0.0, 0.0], false, 0.0),
            (Axis::Linear { from_zero: false }, &[1.0, 3.0], false, 0.9),
            (Axis::Linear { from_zero: true }, &[1.0, 1.0], false, 0.0),
            (Axis::Fixed(0.0, 1.02), &[0.3], false, 0.0),
        ];
        for (axis, data, log, start) in table {
            let r = resolve(*axis, data);
            assert_eq!(r.log, *log, "{axis:?} {data:?}");
            assert!((r.range.start - start).abs() < 1e-9, "{axis:?} {data:?}: {r:?}");
            assert!(r.range.end > r.range.start, "{axis:?} {data:?}: {r:?}");
        }
    }

    #[test]
    fn log_axis_plot_renders_with_zero_values() {
        let series =
            vec![Series { name: "p".into(), color: PALETTE[0], points: vec![(0.0, 0.5), (0.01, 0.7), (10.0, 1.0)] }];
        let spec = ChartSpec {
            title: "t".into(),
            x_desc: "x (s)",
            y_desc: "y",
            x_axis: Axis::Auto,
            y_axis: Axis::Auto,
            markers: true,
            legend: SeriesLabelPosition::LowerRight,
        };
        let svg = render(&spec, series).expect("render").expect("has data");
        assert!(svg.contains("<svg") && svg.contains("\np\n"), "{}", &svg[..200]);
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
    }

    #[test]
    fn colours_follow_sorted_policy_names_and_cdf_is_thinned() {
        let runs = vec![
            fixtures::run("rr", None, Vec::new(), Vec::new()),
            fixtures::run("fcfs", None, Vec::new(), Vec::new()),
            fixtures::run("pascal", None, Vec::new(), Vec::new()),
        ];
        let c = Colors::new(&runs);
        assert_eq!((c.of("fcfs"), c.of("pascal"), c.of("rr")), (PALETTE[0], PALETTE[1], PALETTE[2]));
        let many: Vec<(f64, f64)> = (0..5000).map(|i| (i as f64, i as f64 / 4999.0)).collect();
        let thinned = thin(many);
        assert_eq!(thinned.len(), MAX_CDF_POINTS);
        assert_eq!((thinned[0], thinned[MAX_CDF_POINTS - 1]), ((0.0, 0.0), (4999.0, 1.0)));
        assert!(thinned.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(tick_label(0.25), "0.25");
        assert_eq!(tick_label(3.0), "3");
        assert_eq!(tick_label(150000.0), "1.5e5");
    }
}
