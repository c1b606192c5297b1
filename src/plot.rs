//! Training curves and the phase breakdown as PNG files (`wick plot`).
//!
//! Two pictures, drawn with plotters' bitmap backend:
//! - [`plot_metrics`]: train loss and validation loss against step (top panel) and the learning
//!   rate against step (bottom panel, when the metrics have an `lr` column with values);
//! - [`plot_phases`]: a bar chart of the mean milliseconds per step spent in each phase of the
//!   step (data, host-to-device, forward, backward, optimizer, and communication when present),
//!   each bar labelled with its share of the step.
//!
//! The metrics CSV has the header `step,epoch,loss,val_loss,lr,grad_norm,loss_scale,samples_per_s`
//! ([`MetricsRow`]); only `step` is required, any other column may be absent or have empty cells
//! (e.g. `val_loss` only on evaluation steps). Non-finite values (`nan`, `inf`) are skipped.
//!
//! The phases CSV is either the long form written by [`write_phases_csv`] (`phase,ms_per_step`,
//! one row per phase) or a wide per-step log with one column per phase (`data`, `h2d`,
//! `forward`, `backward`, `optimizer`, optionally `comm`; milliseconds), which is averaged.
//!
//! Text (titles, tick labels, legends) needs a TrueType font. plotters is built here without
//! font-kit (no fontconfig or freetype); instead a `.ttf`/`.otf` file is read at run time:
//! `$WICK_PLOT_FONT` if set, else a common system font (DejaVu Sans, Liberation Sans, Noto
//! Sans...) under `/usr/share/fonts`, else DejaVu Sans embedded in the binary (crate `dejavu`),
//! so plots have text on machines without fonts too.

use anyhow::{anyhow, bail, Context, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use serde::{Deserialize, Serialize};
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::profile::PhaseTimes;

/// Default picture size in pixels (width, height).
pub const DEFAULT_SIZE: (u32, u32) = (1200, 800);

/// The environment variable naming a TrueType/OpenType font file for plot text.
pub const FONT_ENV: &str = "WICK_PLOT_FONT";

/// The font family name under which the run-time font is registered with plotters.
const FAMILY: &str = "sans-serif";

/// One row of a metrics CSV (`step,epoch,loss,val_loss,lr,grad_norm,loss_scale,samples_per_s`).
/// Every column but `step` may be missing from the file or empty in a row.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MetricsRow {
    /// Optimizer step (x axis).
    pub step: u64,
    /// Epoch (may be fractional).
    pub epoch: Option<f64>,
    /// Training loss at this step.
    pub loss: Option<f64>,
    /// Validation loss, on evaluation steps.
    pub val_loss: Option<f64>,
    /// Learning rate used at this step.
    pub lr: Option<f64>,
    /// Global gradient L2 norm (before clipping).
    pub grad_norm: Option<f64>,
    /// Loss scale of the dynamic scaler.
    pub loss_scale: Option<f64>,
    /// Throughput.
    pub samples_per_s: Option<f64>,
}

/// Reads a metrics CSV (see [`MetricsRow`]).
pub fn read_metrics(path: &Path) -> Result<Vec<MetricsRow>> {
    let mut rdr = csv::ReaderBuilder::new()
        .trim(csv::Trim::All)
        .from_path(path)
        .with_context(|| format!("opening metrics CSV {}", path.display()))?;
    let headers = rdr
        .headers()
        .with_context(|| format!("reading the header of {}", path.display()))?
        .clone();
    if !headers.iter().any(|h| h == "step") {
        bail!(
            "{}: no `step` column (header is {:?}); expected \
             step,epoch,loss,val_loss,lr,grad_norm,loss_scale,samples_per_s",
            path.display(),
            headers.iter().collect::<Vec<_>>().join(",")
        );
    }
    let mut rows = Vec::new();
    for (i, rec) in rdr.deserialize::<MetricsRow>().enumerate() {
        // Line i + 2: the header is line 1.
        rows.push(rec.with_context(|| format!("{}: line {}", path.display(), i + 2))?);
    }
    Ok(rows)
}

/// Mean milliseconds per step spent in each phase, in display order.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PhaseBreakdown {
    /// (phase name, mean ms per step).
    pub phases: Vec<(String, f64)>,
}

impl PhaseBreakdown {
    /// The breakdown of `times` summed over `steps` steps.
    pub fn from_times(times: &PhaseTimes, steps: u64) -> Self {
        let steps = steps.max(1) as f64;
        PhaseBreakdown {
            phases: times
                .phases()
                .iter()
                .map(|(n, d)| (n.to_string(), d.as_secs_f64() * 1e3 / steps))
                .collect(),
        }
    }

    /// Sum over the phases (ms per step).
    pub fn total_ms(&self) -> f64 {
        self.phases.iter().map(|(_, v)| v).sum()
    }
}

/// Writes a breakdown as the long-form phases CSV (`phase,ms_per_step`) read by
/// [`read_phases`].
pub fn write_phases_csv(path: &Path, breakdown: &PhaseBreakdown) -> Result<()> {
    let mut w = csv::Writer::from_path(path)
        .with_context(|| format!("creating phases CSV {}", path.display()))?;
    w.write_record(["phase", "ms_per_step"])?;
    for (name, ms) in &breakdown.phases {
        w.write_record([name.as_str(), &format!("{ms}")])?;
    }
    w.flush()
        .with_context(|| format!("writing phases CSV {}", path.display()))?;
    Ok(())
}

/// Canonical display name of a phase column, if the header names one.
fn phase_name(header: &str) -> Option<&'static str> {
    match header.trim().to_ascii_lowercase().as_str() {
        "data" | "data_ms" => Some("data"),
        "h2d" | "h2d_ms" | "host-to-device" | "host_to_device" => Some("host-to-device"),
        "forward" | "forward_ms" | "fwd" => Some("forward"),
        "backward" | "backward_ms" | "bwd" => Some("backward"),
        "optimizer" | "optimizer_ms" | "optim" => Some("optimizer"),
        "comm" | "comm_ms" | "communication" => Some("communication"),
        _ => None,
    }
}

/// Reads a phases CSV: the long form (`phase,ms_per_step`) or a wide per-step log with one
/// column per phase (averaged over rows; empty or non-finite cells are skipped).
pub fn read_phases(path: &Path) -> Result<PhaseBreakdown> {
    let mut rdr = csv::ReaderBuilder::new()
        .trim(csv::Trim::All)
        .from_path(path)
        .with_context(|| format!("opening phases CSV {}", path.display()))?;
    let headers = rdr
        .headers()
        .with_context(|| format!("reading the header of {}", path.display()))?
        .clone();
    let parse = |s: &str, line: usize| -> Result<Option<f64>> {
        if s.is_empty() {
            return Ok(None);
        }
        let v: f64 = s
            .parse()
            .map_err(|_| anyhow!("{}: line {line}: {s:?} is not a number", path.display()))?;
        Ok(v.is_finite().then_some(v))
    };
    let mut out = PhaseBreakdown::default();
    if let Some(name_col) = headers.iter().position(|h| h == "phase") {
        let value_col = headers
            .iter()
            .position(|h| h == "ms_per_step" || h == "ms")
            .ok_or_else(|| {
                anyhow!(
                    "{}: a `phase` column needs a `ms_per_step` column beside it",
                    path.display()
                )
            })?;
        for (i, rec) in rdr.records().enumerate() {
            let rec = rec.with_context(|| format!("{}: line {}", path.display(), i + 2))?;
            let name = rec.get(name_col).unwrap_or("").to_string();
            let v = parse(rec.get(value_col).unwrap_or(""), i + 2)?;
            out.phases.push((name, v.unwrap_or(0.0)));
        }
    } else {
        let cols: Vec<(usize, &'static str)> = headers
            .iter()
            .enumerate()
            .filter_map(|(i, h)| phase_name(h).map(|n| (i, n)))
            .collect();
        if cols.is_empty() {
            bail!(
                "{}: no phase columns; expected `phase,ms_per_step` rows or columns among \
                 data,h2d,forward,backward,optimizer,comm (ms); header is {:?}",
                path.display(),
                headers.iter().collect::<Vec<_>>().join(",")
            );
        }
        let mut sums = vec![(0.0f64, 0u64); cols.len()];
        for (i, rec) in rdr.records().enumerate() {
            let rec = rec.with_context(|| format!("{}: line {}", path.display(), i + 2))?;
            for (k, (c, _)) in cols.iter().enumerate() {
                if let Some(v) = parse(rec.get(*c).unwrap_or(""), i + 2)? {
                    sums[k].0 += v;
                    sums[k].1 += 1;
                }
            }
        }
        for ((_, name), (sum, n)) in cols.iter().zip(sums) {
            out.phases
                .push((name.to_string(), if n > 0 { sum / n as f64 } else { 0.0 }));
        }
    }
    if out.phases.is_empty() {
        bail!("{}: no phases in the file", path.display());
    }
    Ok(out)
}

/// Picture options.
#[derive(Debug, Clone)]
pub struct PlotOptions {
    /// Width and height in pixels (each at least 200).
    pub size: (u32, u32),
    /// Draw text (titles, tick labels, legend) when a font is available. `false` draws lines,
    /// grid and bars only.
    pub labels: bool,
}

impl Default for PlotOptions {
    fn default() -> Self {
        PlotOptions {
            size: DEFAULT_SIZE,
            labels: true,
        }
    }
}

/// What a plot call wrote.
#[derive(Debug, Clone, Serialize)]
pub struct PlotReport {
    /// The PNG written.
    pub path: PathBuf,
    /// Picture size in pixels.
    pub size: (u32, u32),
    /// The font file used for text ([`EMBEDDED_FONT`] when no system font was found and the
    /// embedded DejaVu Sans was used), or `None` when the picture has no text (labels switched
    /// off, or the font could not be registered).
    pub font: Option<PathBuf>,
    /// Number of data points (or bars) drawn.
    pub points: usize,
}

/// Candidate font files, most preferred first.
const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
    "/usr/share/fonts/noto/NotoSans-Regular.ttf",
    "/usr/share/fonts/google-noto/NotoSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
    "/Library/Fonts/Arial.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// Finds a regular sans font: the candidates, then a bounded walk of the font folders.
fn find_font_file() -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os(FONT_ENV) {
        found.push(PathBuf::from(p));
    }
    found.extend(FONT_CANDIDATES.iter().map(PathBuf::from));
    let mut walked = Vec::new();
    for root in ["/usr/share/fonts", "/usr/local/share/fonts"] {
        walk_fonts(Path::new(root), 0, &mut walked);
    }
    // Prefer regular sans faces; anything that parses will do.
    let score = |p: &PathBuf| {
        let n = p
            .file_name()
            .map(|s| s.to_string_lossy().to_ascii_lowercase())
            .unwrap_or_default();
        let mut s = 0;
        for bad in [
            "bold",
            "italic",
            "oblique",
            "mono",
            "math",
            "light",
            "condensed",
        ] {
            if n.contains(bad) {
                s += 1;
            }
        }
        if !n.contains("sans") {
            s += 1;
        }
        s
    };
    walked.sort_by_key(|p| (score(p), p.clone()));
    found.extend(walked);
    found
}

fn walk_fonts(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    if depth > 4 || out.len() > 2000 {
        return;
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let Ok(ft) = e.file_type() else { continue };
        if ft.is_dir() {
            walk_fonts(&p, depth + 1, out);
        } else if p
            .extension()
            .map(|x| {
                let x = x.to_string_lossy().to_ascii_lowercase();
                x == "ttf" || x == "otf"
            })
            .unwrap_or(false)
        {
            out.push(p);
        }
    }
}

/// Registers a run-time font with plotters once per process; the path of the font, or `None`.
fn font() -> Option<&'static Path> {
    static FONT: OnceLock<Option<PathBuf>> = OnceLock::new();
    FONT.get_or_init(|| {
        for p in find_font_file() {
            let Ok(mut f) = fs::File::open(&p) else {
                continue;
            };
            let mut bytes = Vec::new();
            // Fonts are small; refuse anything absurd.
            if f.by_ref().take(64 << 20).read_to_end(&mut bytes).is_err() || bytes.is_empty() {
                continue;
            }
            // plotters keeps `&'static` font data: this one allocation lives for the process.
            let data: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font(FAMILY, FontStyle::Normal, data).is_ok() {
                return Some(p);
            }
        }
        // no usable system font (GPU containers often have none): the embedded DejaVu Sans
        plotters::style::register_font(FAMILY, FontStyle::Normal, dejavu::sans::regular())
            .ok()
            .map(|_| PathBuf::from(EMBEDDED_FONT))
    })
    .as_deref()
}

/// What [`PlotReport::font`] names when the embedded DejaVu Sans (crate `dejavu` 2.37) drew
/// the text because no system font file was found.
pub const EMBEDDED_FONT: &str = "<embedded DejaVu Sans 2.37>";

fn check_size(size: (u32, u32)) -> Result<()> {
    if size.0 < 200 || size.1 < 200 || size.0 > 16384 || size.1 > 16384 {
        bail!(
            "picture size {}x{} is out of range: each side must be within 200..=16384 pixels",
            size.0,
            size.1
        );
    }
    Ok(())
}

/// Maps a plotters error (not `Send`) into anyhow with context, by its message (not its
/// Debug form, which nests the backend's enums).
fn draw_err<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> anyhow::Error + '_ {
    move |e| anyhow!("drawing {what}: {e}")
}

/// Checks that the picture `out` can be written: its folder exists and `out` is not a folder.
/// Errors name the path and the fix (before anything is drawn).
fn check_output(out: &Path) -> Result<()> {
    if out.is_dir() {
        bail!(
            "cannot write the plot to {}: it is a folder; give a file name ending in .png",
            out.display()
        );
    }
    let dir = out.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        if !dir.is_dir() {
            bail!(
                "cannot write the plot to {}: the folder {} does not exist; create it \
                 (mkdir -p {}) or choose another output path",
                out.display(),
                dir.display(),
                dir.display()
            );
        }
    }
    Ok(())
}

/// Maps the error of writing the picture file into a message that names the file.
fn write_err<E: std::fmt::Display>(out: &Path) -> impl FnOnce(E) -> anyhow::Error + '_ {
    move |e| anyhow!("writing the plot to {}: {e}", out.display())
}

/// A finite, non-empty [lo, hi] range around `values` with a small margin.
fn range_of(values: impl Iterator<Item = f64>, pad_zero: bool) -> Option<(f64, f64)> {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() || !hi.is_finite() {
        return None;
    }
    if pad_zero {
        lo = lo.min(0.0);
    }
    let span = hi - lo;
    if span <= f64::EPSILON * hi.abs().max(1.0) {
        let d = if hi.abs() > 0.0 { hi.abs() * 0.1 } else { 1.0 };
        return Some((lo - d, hi + d));
    }
    Some((lo - 0.05 * span, hi + 0.05 * span))
}

/// Tick labels for an axis spanning [lo, hi]: scientific notation for very small or large
/// magnitudes, else as many decimals as the tick spacing (about a tenth of the span) needs.
fn tick_format(lo: f64, hi: f64) -> impl Fn(&f64) -> String {
    let mag = lo.abs().max(hi.abs());
    let sci = mag > 0.0 && !(1e-2..1e5).contains(&mag);
    let step = ((hi - lo).abs() / 10.0).max(f64::MIN_POSITIVE);
    let decimals = (-step.log10().floor()).clamp(0.0, 6.0) as usize;
    move |v: &f64| {
        if *v == 0.0 {
            "0".to_string()
        } else if sci {
            format!("{v:.1e}")
        } else {
            format!("{v:.decimals$}")
        }
    }
}

const TRAIN: RGBColor = RGBColor(31, 119, 180);
const VAL: RGBColor = RGBColor(255, 127, 14);
const LR: RGBColor = RGBColor(44, 160, 44);

/// Draws train loss and validation loss against step (and lr in a lower panel) into a PNG.
pub fn plot_metrics(rows: &[MetricsRow], out: &Path, opts: &PlotOptions) -> Result<PlotReport> {
    check_size(opts.size)?;
    check_output(out)?;
    let pts = |f: fn(&MetricsRow) -> Option<f64>| -> Vec<(f64, f64)> {
        rows.iter()
            .filter_map(|r| f(r).filter(|v| v.is_finite()).map(|v| (r.step as f64, v)))
            .collect()
    };
    let train = pts(|r| r.loss);
    let val = pts(|r| r.val_loss);
    let lr = pts(|r| r.lr);
    if train.is_empty() && val.is_empty() {
        bail!(
            "no finite `loss` or `val_loss` values among {} rows: nothing to plot",
            rows.len()
        );
    }
    let font = if opts.labels { font() } else { None };
    let text = font.is_some();

    let all = train.iter().chain(&val).chain(&lr);
    let (x0, x1) = range_of(all.map(|p| p.0), false).unwrap_or((0.0, 1.0));
    let (y0, y1) = range_of(train.iter().chain(&val).map(|p| p.1), false).unwrap_or((0.0, 1.0));

    let root = BitMapBackend::new(out, opts.size).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err("the background"))?;
    let (top, bottom) = if lr.is_empty() {
        (root.clone(), None)
    } else {
        let (t, b) = root.split_vertically((opts.size.1 as f64 * 0.68) as u32);
        (t, Some(b))
    };

    // Loss panel.
    {
        let mut cb = ChartBuilder::on(&top);
        cb.margin(16);
        if text {
            cb.caption("loss", (FAMILY, 22))
                .x_label_area_size(36)
                .y_label_area_size(70);
        }
        let mut chart = cb
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(draw_err("the loss axes"))?;
        mesh(&mut chart, text, "step", "loss")?;
        let s = chart
            .draw_series(LineSeries::new(
                train.iter().copied(),
                TRAIN.stroke_width(2),
            ))
            .map_err(draw_err("the train loss"))?;
        if text && !train.is_empty() {
            s.label("train loss").legend(|(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], TRAIN.stroke_width(2))
            });
        }
        if !val.is_empty() {
            let s = chart
                .draw_series(LineSeries::new(val.iter().copied(), VAL.stroke_width(2)))
                .map_err(draw_err("the validation loss"))?;
            if text {
                s.label("val loss").legend(|(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], VAL.stroke_width(2))
                });
            }
            chart
                .draw_series(val.iter().map(|p| Circle::new(*p, 3, VAL.filled())))
                .map_err(draw_err("the validation points"))?;
        }
        if text {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .label_font((FAMILY, 16))
                .position(SeriesLabelPosition::UpperRight)
                .draw()
                .map_err(draw_err("the legend"))?;
        }
    }

    // Learning-rate panel.
    if let Some(bottom) = bottom {
        let (l0, l1) = range_of(lr.iter().map(|p| p.1), true).unwrap_or((0.0, 1.0));
        let mut cb = ChartBuilder::on(&bottom);
        cb.margin(16);
        if text {
            cb.caption("learning rate", (FAMILY, 18))
                .x_label_area_size(36)
                .y_label_area_size(70);
        }
        let mut chart = cb
            .build_cartesian_2d(x0..x1, l0..l1)
            .map_err(draw_err("the lr axes"))?;
        mesh(&mut chart, text, "step", "lr")?;
        chart
            .draw_series(LineSeries::new(lr.iter().copied(), LR.stroke_width(2)))
            .map_err(draw_err("the learning rate"))?;
    }
    root.present().map_err(write_err(out))?;
    Ok(PlotReport {
        path: out.to_path_buf(),
        size: opts.size,
        font: font.map(Path::to_path_buf),
        points: train.len() + val.len() + lr.len(),
    })
}

type Chart2d<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// Grid, and with a font the tick labels and axis descriptions.
fn mesh(chart: &mut Chart2d<'_, '_>, text: bool, x: &str, y: &str) -> Result<()> {
    let (xr, yr) = (chart.x_range(), chart.y_range());
    let xfmt = tick_format(xr.start, xr.end);
    let yfmt = tick_format(yr.start, yr.end);
    let mut m = chart.configure_mesh();
    m.light_line_style(BLACK.mix(0.06))
        .bold_line_style(BLACK.mix(0.15));
    if text {
        m.x_desc(x)
            .y_desc(y)
            .x_label_formatter(&xfmt)
            .y_label_formatter(&yfmt)
            .label_style((FAMILY, 14))
            .axis_desc_style((FAMILY, 15));
    } else {
        // No font: no grid or text (plotters would fail on the tick labels); a frame only.
        m.x_labels(0).y_labels(0).disable_axes();
    }
    m.draw().map_err(draw_err("the grid"))?;
    if !text {
        chart
            .plotting_area()
            .draw(&Rectangle::new(
                [(xr.start, yr.start), (xr.end, yr.end)],
                BLACK.mix(0.4).stroke_width(1),
            ))
            .map_err(draw_err("the frame"))?;
    }
    Ok(())
}

/// Draws the phase breakdown as a bar chart (mean ms per step, % of the step above each bar).
pub fn plot_phases(b: &PhaseBreakdown, out: &Path, opts: &PlotOptions) -> Result<PlotReport> {
    check_size(opts.size)?;
    check_output(out)?;
    if b.phases.is_empty() {
        bail!("the phase breakdown is empty: nothing to plot");
    }
    if let Some((n, v)) = b.phases.iter().find(|(_, v)| !v.is_finite() || *v < 0.0) {
        bail!("phase {n:?} has {v} ms per step; expected a finite value >= 0");
    }
    let font = if opts.labels { font() } else { None };
    let text = font.is_some();
    let total = b.total_ms();
    let n = b.phases.len();
    let ymax = b.phases.iter().map(|(_, v)| *v).fold(0.0f64, f64::max);
    let ymax = if ymax > 0.0 { ymax * 1.15 } else { 1.0 };

    let root = BitMapBackend::new(out, opts.size).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err("the background"))?;
    draw_bars(&root, b, text, total, ymax)?;
    root.present().map_err(write_err(out))?;
    Ok(PlotReport {
        path: out.to_path_buf(),
        size: opts.size,
        font: font.map(Path::to_path_buf),
        points: n,
    })
}

fn draw_bars(
    root: &DrawingArea<BitMapBackend<'_>, Shift>,
    b: &PhaseBreakdown,
    text: bool,
    total: f64,
    ymax: f64,
) -> Result<()> {
    let n = b.phases.len() as i32;
    let mut cb = ChartBuilder::on(root);
    cb.margin(20);
    let title = format!("time per step by phase ({total:.3} ms per step)");
    if text {
        cb.caption(&title, (FAMILY, 22))
            .x_label_area_size(40)
            .y_label_area_size(70);
    }
    // One segment per phase; tick labels sit at the segment centres.
    let mut chart = cb
        // Integer ranges are inclusive in plotters: 0..n-1 is n segments.
        .build_cartesian_2d((0..n - 1).into_segmented(), 0f64..ymax)
        .map_err(draw_err("the phase axes"))?;
    let name_of = |v: &SegmentValue<i32>| match v {
        SegmentValue::CenterOf(i) => b
            .phases
            .get(*i as usize)
            .map(|(name, _)| name.clone())
            .unwrap_or_default(),
        _ => String::new(),
    };
    let yfmt = tick_format(0.0, ymax);
    {
        let mut m = chart.configure_mesh();
        m.disable_x_mesh()
            .light_line_style(BLACK.mix(0.06))
            .bold_line_style(BLACK.mix(0.15));
        if text {
            m.x_labels(b.phases.len() + 1)
                .x_label_formatter(&name_of)
                .y_desc("ms per step")
                .y_label_formatter(&yfmt)
                .label_style((FAMILY, 15))
                .axis_desc_style((FAMILY, 15));
        } else {
            m.x_labels(0).y_labels(0).disable_axes();
        }
        m.draw().map_err(draw_err("the grid"))?;
    }
    let palette = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
    ];
    // Bars fill 70% of their segment.
    let seg_px = (root.dim_in_pixel().0 as f64 / n.max(1) as f64 * 0.15) as u32;
    chart
        .draw_series(b.phases.iter().enumerate().map(|(i, (_, v))| {
            let c = palette[i % palette.len()];
            let i = i as i32;
            let mut r = Rectangle::new(
                [
                    (SegmentValue::Exact(i), 0.0),
                    (SegmentValue::Exact(i + 1), *v),
                ],
                c.filled(),
            );
            r.set_margin(0, 0, seg_px, seg_px);
            r
        }))
        .map_err(draw_err("the bars"))?;
    if text {
        let style =
            TextStyle::from((FAMILY, 15).into_font()).pos(plotters::style::text_anchor::Pos::new(
                plotters::style::text_anchor::HPos::Center,
                plotters::style::text_anchor::VPos::Bottom,
            ));
        chart
            .draw_series(b.phases.iter().enumerate().map(|(i, (_, v))| {
                let pct = if total > 0.0 { 100.0 * v / total } else { 0.0 };
                Text::new(
                    format!("{v:.3} ms ({pct:.1}%)"),
                    (SegmentValue::CenterOf(i as i32), v + ymax * 0.01),
                    style.clone(),
                )
            }))
            .map_err(draw_err("the bar values"))?;
    }
    Ok(())
}

/// Width and height of a PNG file, read from its IHDR chunk.
pub fn png_dimensions(path: &Path) -> Result<(u32, u32)> {
    let mut head = [0u8; 24];
    fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .with_context(|| format!("reading the PNG header of {}", path.display()))?;
    if head[..8] != [0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a] || &head[12..16] != b"IHDR" {
        bail!("{} is not a PNG file", path.display());
    }
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    Ok((be(&head[16..20]), be(&head[20..24])))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("wick-plot-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn sample_csv(dir: &Path) -> PathBuf {
        let p = dir.join("metrics.csv");
        let mut s =
            String::from("step,epoch,loss,val_loss,lr,grad_norm,loss_scale,samples_per_s\n");
        for i in 0..50u64 {
            let loss = 2.3 * (-(i as f64) / 20.0).exp() + 0.1;
            let val = if i % 10 == 9 {
                format!("{}", loss * 1.1)
            } else {
                String::new()
            };
            let lr = 1e-3 * (1.0 - i as f64 / 50.0);
            s.push_str(&format!("{i},{},{loss},{val},{lr},,65536,\n", i / 25));
        }
        fs::write(&p, s).unwrap();
        p
    }

    #[test]
    fn reads_metrics_with_empty_cells_and_missing_columns() {
        let d = tmpdir("read");
        let p = sample_csv(&d);
        let rows = read_metrics(&p).unwrap();
        assert_eq!(rows.len(), 50);
        assert!(rows[9].val_loss.is_some());
        assert_eq!(rows[0].val_loss, None);
        assert_eq!(rows[0].grad_norm, None);
        let q = d.join("short.csv");
        fs::write(&q, "step,loss\n1,0.5\n2,nan\n").unwrap();
        let rows = read_metrics(&q).unwrap();
        assert_eq!(rows[0].loss, Some(0.5));
        assert!(rows[1].loss.unwrap().is_nan());
        assert_eq!(rows[1].lr, None);
        let bad = d.join("bad.csv");
        fs::write(&bad, "epoch,loss\n1,0.5\n").unwrap();
        assert!(read_metrics(&bad)
            .unwrap_err()
            .to_string()
            .contains("no `step`"));
        fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn metrics_png_has_requested_size_with_and_without_text() {
        let d = tmpdir("png");
        let rows = read_metrics(&sample_csv(&d)).unwrap();
        for labels in [true, false] {
            let out = d.join(format!("loss-{labels}.png"));
            let opts = PlotOptions {
                size: (640, 480),
                labels,
            };
            let r = plot_metrics(&rows, &out, &opts).unwrap();
            assert_eq!(png_dimensions(&out).unwrap(), (640, 480));
            assert_eq!(r.points, 50 + 5 + 50);
            if !labels {
                assert!(r.font.is_none());
            }
        }
        // Only val_loss, a single point, no lr: still draws.
        let one = vec![MetricsRow {
            step: 3,
            val_loss: Some(1.0),
            ..Default::default()
        }];
        let out = d.join("one.png");
        plot_metrics(&one, &out, &PlotOptions::default()).unwrap();
        assert_eq!(png_dimensions(&out).unwrap(), DEFAULT_SIZE);
        // No loss at all: a clear error, no file.
        let none = vec![MetricsRow {
            step: 1,
            lr: Some(1.0),
            ..Default::default()
        }];
        let err = plot_metrics(&none, &d.join("none.png"), &PlotOptions::default()).unwrap_err();
        assert!(err.to_string().contains("nothing to plot"), "{err}");
        fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn phases_roundtrip_and_bar_chart() {
        let d = tmpdir("phases");
        let t = PhaseTimes {
            data: Duration::from_millis(10),
            h2d: Duration::from_millis(2),
            forward: Duration::from_millis(30),
            backward: Duration::from_millis(50),
            optimizer: Duration::from_millis(8),
        };
        let b = PhaseBreakdown::from_times(&t, 2);
        assert!((b.total_ms() - 50.0).abs() < 1e-9);
        let p = d.join("phases.csv");
        write_phases_csv(&p, &b).unwrap();
        let back = read_phases(&p).unwrap();
        assert_eq!(back.phases.len(), 5);
        assert!((back.phases[3].1 - 25.0).abs() < 1e-9);
        // Wide per-step form is averaged.
        let w = d.join("wide.csv");
        fs::write(
            &w,
            "step,data,h2d,forward,backward,optimizer\n1,1,0.5,3,5,1\n2,3,,5,7,1\n",
        )
        .unwrap();
        let wb = read_phases(&w).unwrap();
        assert_eq!(wb.phases[0], ("data".to_string(), 2.0));
        assert_eq!(wb.phases[1], ("host-to-device".to_string(), 0.5));
        for labels in [true, false] {
            let out = d.join(format!("phases-{labels}.png"));
            plot_phases(
                &b,
                &out,
                &PlotOptions {
                    size: (800, 500),
                    labels,
                },
            )
            .unwrap();
            assert_eq!(png_dimensions(&out).unwrap(), (800, 500));
        }
        assert!(check_size((10, 10)).is_err());
        fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn ranges_are_never_empty() {
        assert_eq!(range_of([2.0].into_iter(), false), Some((1.8, 2.2)));
        assert_eq!(range_of([0.0].into_iter(), false), Some((-1.0, 1.0)));
        assert_eq!(range_of([f64::NAN].into_iter(), false), None);
        let (lo, hi) = range_of([1e-4, 1e-3].into_iter(), true).unwrap();
        assert!(lo < 0.0 && hi > 1e-3);
    }
}
