//! `--plot FILE.png`: the sustained run's timeline as a chart, IOPS per second above and p99
//! latency per second below, the median and the dip threshold marked.
//!
//! Drawn with the crate's own small PNG canvas (`crate::png`).

use std::path::Path;

use anyhow::Context;

use crate::png::{Canvas, BLACK, BLUE, GREEN, GREY, RED};

use super::measure::Rate;
use super::verdict::median;

const W: usize = 900;
const H: usize = 560;
const LEFT: usize = 90;
const RIGHT: usize = 20;
/// `12.5K`, `340`, `1.2M`: short enough for the axis.
fn short(v: f64) -> String {
    match v {
        v if v >= 1e6 => format!("{:.1}M", v / 1e6),
        v if v >= 1e4 => format!("{:.0}K", v / 1e3),
        v if v >= 1e3 => format!("{:.1}K", v / 1e3),
        v if v >= 10.0 || v == 0.0 => format!("{v:.0}"),
        v => format!("{v:.2}"),
    }
}

/// One panel: `values` per second between `top` and `top + height`, y from 0 to the largest
/// value. `marks`: horizontal reference lines (value, colour). Points below `low` are red.
fn panel(
    c: &mut Canvas,
    top: i64,
    height: i64,
    title: &str,
    values: &[f64],
    marks: &[(f64, u8)],
    low: f64,
) {
    let (left, right) = (LEFT as i64, (W - RIGHT) as i64);
    let bottom = top + height;
    let max = values.iter().copied().fold(0.0f64, f64::max).max(1e-9) * 1.1;
    let y_of = |v: f64| bottom - (v / max * height as f64).round() as i64;
    let n = values.len().max(2) as i64;
    let x_of = |i: usize| left + (i as i64 * (right - left)) / (n - 1);
    c.text(left, top - 22, title, BLACK);
    for k in 0..=4 {
        let v = max * k as f64 / 4.0;
        let y = y_of(v);
        c.line((left, y), (right, y), GREY, false);
        let label = short(v);
        c.text(left - 8 - Canvas::text_width(&label), y - 7, &label, BLACK);
    }
    for &(v, colour) in marks {
        let y = y_of(v);
        c.line((left, y), (right, y), colour, true);
    }
    c.line((left, top), (left, bottom), BLACK, false);
    c.line((left, bottom), (right, bottom), BLACK, false);
    let mut prev = None;
    for (i, &v) in values.iter().enumerate() {
        let p = (x_of(i), y_of(v));
        if let Some(q) = prev {
            c.line(q, p, BLUE, false);
        }
        c.dot(p.0, p.1, if v < low { RED } else { BLUE });
        prev = Some(p);
    }
    // Second labels: about ten along the axis.
    let every = values.len().div_ceil(10).max(1);
    for i in (0..values.len()).step_by(every) {
        let label = (i + 1).to_string();
        c.text(
            x_of(i) - Canvas::text_width(&label) / 2,
            bottom + 6,
            &label,
            BLACK,
        );
    }
}

/// Draws the timeline and writes it to `path` as a PNG.
pub fn write(path: &Path, timeline: &[Rate], dip_fraction: f64) -> anyhow::Result<()> {
    let mut c = Canvas::new(W, H);
    let iops: Vec<f64> = timeline.iter().map(|r| r.iops).collect();
    let p99_ms: Vec<f64> = timeline.iter().map(|r| r.latency.p99_us / 1000.0).collect();
    let med = median(&iops);
    panel(
        &mut c,
        40,
        200,
        "4K RANDOM WRITE IOPS PER SECOND - MEDIAN GREEN, DIP THRESHOLD RED",
        &iops,
        &[(med, GREEN), (med * dip_fraction, RED)],
        med * dip_fraction,
    );
    panel(
        &mut c,
        310,
        200,
        "P99 LATENCY MS PER SECOND",
        &p99_ms,
        &[],
        f64::MIN,
    );
    c.text(W as i64 / 2 - 40, H as i64 - 24, "SECONDS", BLACK);
    std::fs::write(path, c.encode()).with_context(|| format!("cannot write {}", path.display()))
}
