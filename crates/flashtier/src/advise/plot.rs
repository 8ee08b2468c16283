//! `advise --plot`: the miss-ratio curves, cache size on a log scale, the recommended size
//! marked.

use std::path::Path;

use anyhow::Context;

use super::Analysis;
use crate::png::{Canvas, BLACK, BLUE, GREEN, GREY, ORANGE, RED};
use crate::units::fmt_bytes;

const W: usize = 900;
const H: usize = 520;
const LEFT: i64 = 90;
const RIGHT: i64 = 30;
const TOP: i64 = 60;
const BOTTOM: i64 = 80;

pub fn write(path: &Path, a: &Analysis, bs: u64, recommend_blocks: u64) -> anyhow::Result<()> {
    let mut c = Canvas::new(W, H);
    let (left, right, top, bottom) = (LEFT, W as i64 - RIGHT, TOP, H as i64 - BOTTOM);
    let (lo, hi) = match (a.rows.first(), a.rows.last()) {
        (Some(f), Some(l)) if l.blocks > f.blocks => (f.blocks as f64, l.blocks as f64),
        (Some(f), _) => (f.blocks as f64 / 2.0, f.blocks as f64 * 2.0),
        _ => anyhow::bail!("no cache sizes to plot"),
    };
    let x_of = |blocks: f64| {
        let t = (blocks.max(lo).min(hi).ln() - lo.ln()) / (hi.ln() - lo.ln());
        left + (t * (right - left) as f64).round() as i64
    };
    // Headroom above the highest point, but never above 100% (OPT is never the highest).
    let highest = a
        .rows
        .iter()
        .flat_map(|r| {
            [
                r.lru,
                r.fifo,
                r.s3fifo,
                r.engine.map_or(0.0, |e| e.miss_ratio),
            ]
        })
        .fold(0.0f64, f64::max)
        .max(0.01);
    let max = (highest * 1.1).min(1.0);
    let y_of = |ratio: f64| bottom - (ratio / max * (bottom - top) as f64).round() as i64;
    let legend = if a.rows.iter().any(|r| r.engine.is_some()) {
        "LRU BLUE, FIFO GREY, S3-FIFO GREEN, OPT ORANGE, FLASHTIER BLACK"
    } else {
        "LRU BLUE, FIFO GREY, S3-FIFO GREEN, OPT ORANGE"
    };
    c.text(left, 10, "READ MISS RATIO BY CACHE SIZE", BLACK);
    c.text(left, 32, legend, BLACK);
    for k in 0..=4 {
        let v = max * k as f64 / 4.0;
        let y = y_of(v);
        c.line((left, y), (right, y), GREY, true);
        let label = format!("{:.0}%", v * 100.0);
        c.text(left - 8 - Canvas::text_width(&label), y - 7, &label, BLACK);
    }
    c.line((left, top), (left, bottom), BLACK, false);
    c.line((left, bottom), (right, bottom), BLACK, false);
    for (series, colour) in [(0, BLUE), (1, GREY), (2, GREEN), (3, ORANGE), (4, BLACK)] {
        let mut prev = None;
        for r in &a.rows {
            let engine = r.engine.map(|e| e.miss_ratio);
            let Some(v) = [
                Some(r.lru),
                Some(r.fifo),
                Some(r.s3fifo),
                Some(r.opt),
                engine,
            ][series] else {
                prev = None;
                continue;
            };
            let p = (x_of(r.blocks as f64), y_of(v));
            if let Some(q) = prev {
                c.line(q, p, colour, false);
            }
            c.dot(p.0, p.1, colour);
            prev = Some(p);
        }
    }
    let every = a.rows.len().div_ceil(6).max(1);
    for r in a.rows.iter().step_by(every) {
        let label = fmt_bytes(r.blocks * bs).replace(' ', "");
        let x = x_of(r.blocks as f64);
        c.text(
            x - Canvas::text_width(&label) / 2,
            bottom + 8,
            &label,
            BLACK,
        );
    }
    let x = x_of(recommend_blocks as f64);
    c.line((x, top), (x, bottom), RED, true);
    let label = format!(
        "RECOMMENDED {}",
        fmt_bytes(recommend_blocks * bs).replace(' ', "")
    );
    c.text(
        (x - Canvas::text_width(&label) / 2).clamp(left, right - Canvas::text_width(&label)),
        bottom + 34,
        &label,
        RED,
    );
    std::fs::write(path, c.encode()).with_context(|| format!("cannot write {}", path.display()))
}
