//! The probe's results for a person (a table) and for a program (`--json`).

use flashtier_control::render::{fmt_us, table};
use serde_json::{json, Value};

use super::device::DeviceFacts;
use super::measure::{Latency, Measurements, Rate, QD};
use super::verdict::{median, Verdict};
use crate::units::fmt_bytes;

/// What was probed, for both renderings.
pub struct Probed<'a> {
    pub path: &'a str,
    pub kind: &'a str,
    pub size: u64,
    pub device: &'a DeviceFacts,
    pub m: &'a Measurements,
    pub verdict: &'a Verdict,
}

fn yes_no(v: Option<bool>) -> String {
    v.map_or("?", |b| if b { "yes" } else { "no" }).to_string()
}

fn lat_row(name: &str, l: &Latency) -> Vec<String> {
    vec![
        name.to_string(),
        fmt_us(l.p50_us),
        fmt_us(l.p99_us),
        fmt_us(l.max_us),
        l.samples.to_string(),
    ]
}

fn rate_row(name: &str, r: &Rate) -> Vec<String> {
    vec![
        name.to_string(),
        format!("{:.0}", r.iops),
        fmt_us(r.latency.p50_us),
        fmt_us(r.latency.p99_us),
        fmt_us(r.latency.max_us),
    ]
}

pub fn text(p: &Probed) -> String {
    let (d, m) = (p.device, p.m);
    let mut out = format!(
        "flashtier probe of {} ({}, {}; tests over its first {})\n",
        p.path,
        p.kind,
        fmt_bytes(p.size),
        fmt_bytes(m.span)
    );
    out += &format!(
        "device: {} (model {}): rotational {}, write cache {}, FUA {}, discard {}\n\n",
        d.name.as_deref().unwrap_or("none found"),
        d.model.as_deref().unwrap_or("?"),
        yes_no(d.rotational),
        d.write_cache.as_deref().unwrap_or("?"),
        yes_no(d.fua),
        d.discard_max_bytes.map_or("?".into(), |n| if n == 0 {
            "no".into()
        } else {
            fmt_bytes(n)
        }),
    );
    out += &table(
        &[
            vec![
                "synchronous 4K write, QD1".into(),
                "p50".into(),
                "p99".into(),
                "max".into(),
                "samples".into(),
            ],
            lat_row("write + fsync", &m.fsync),
            lat_row("write + fdatasync", &m.fdatasync),
            lat_row("O_DSYNC write", &m.dsync),
            lat_row("O_DIRECT|O_DSYNC write (FUA)", &m.direct_dsync),
        ],
        true,
    );
    out.push('\n');
    out += &table(
        &[
            vec![
                "4K O_DIRECT, random".into(),
                "IOPS".into(),
                "p50".into(),
                "p99".into(),
                "max".into(),
            ],
            rate_row("read, QD1", &m.randread_qd1),
            rate_row(&format!("read, QD{QD} ({QD} threads)"), &m.randread_qd32),
            rate_row("write, QD1", &m.randwrite_qd1),
            rate_row(&format!("write, QD{QD} ({QD} threads)"), &m.randwrite_qd32),
        ],
        true,
    );
    out += &format!(
        "\nsequential write (1 MiB O_DIRECT, then fdatasync): {:.0} MB/s\n",
        m.seqwrite_mb_s
    );
    if !m.timeline.is_empty() {
        let iops: Vec<f64> = m.timeline.iter().map(|r| r.iops).collect();
        let (low, high) = iops
            .iter()
            .fold((f64::MAX, 0.0f64), |(l, h), &v| (l.min(v), h.max(v)));
        out += &format!(
            "\nsustained 4K random write, QD{QD}, {} s: median {:.0} IOPS, lowest {low:.0}, \
             highest {high:.0}\n",
            m.timeline.len(),
            median(&iops)
        );
        let mut rows = vec![vec![
            "second".into(),
            "IOPS".into(),
            "p50".into(),
            "p99".into(),
            "max".into(),
        ]];
        rows.extend(
            m.timeline
                .iter()
                .enumerate()
                .map(|(i, r)| rate_row(&(i + 1).to_string(), r)),
        );
        out += &table(&rows, true);
    }
    out += &format!(
        "\nverdict for a write-back cache device: {}\n",
        p.verdict.level.as_str()
    );
    for r in &p.verdict.reasons {
        out += &format!("  - {r}\n");
    }
    for n in &p.verdict.notes {
        out += &format!("  note: {n}\n");
    }
    out
}

fn lat_json(l: &Latency) -> Value {
    json!({"p50_us": l.p50_us, "p99_us": l.p99_us, "max_us": l.max_us, "samples": l.samples})
}

fn rate_json(r: &Rate) -> Value {
    json!({"iops": r.iops, "p50_us": r.latency.p50_us, "p99_us": r.latency.p99_us,
           "max_us": r.latency.max_us})
}

/// The summary keys at the top level (what scripts compare), the details below them.
pub fn json(p: &Probed) -> Value {
    let (d, m) = (p.device, p.m);
    json!({
        "path": p.path,
        "kind": p.kind,
        "size_bytes": p.size,
        "span_bytes": m.span,
        "fsync_p50_us": m.fsync.p50_us,
        "fdatasync_p50_us": m.fdatasync.p50_us,
        "fdatasync_p99_us": m.fdatasync.p99_us,
        "randread_qd1_iops": m.randread_qd1.iops,
        "randread_qd32_iops": m.randread_qd32.iops,
        "randwrite_qd1_iops": m.randwrite_qd1.iops,
        "randwrite_qd32_iops": m.randwrite_qd32.iops,
        "seqwrite_mb_s": m.seqwrite_mb_s,
        "verdict": p.verdict.level.as_str(),
        "reasons": p.verdict.reasons,
        "notes": p.verdict.notes,
        "qd32_method": format!("{QD} threads, pread/pwrite on one O_DIRECT descriptor"),
        "latency": {
            "write_fsync": lat_json(&m.fsync),
            "write_fdatasync": lat_json(&m.fdatasync),
            "o_dsync": lat_json(&m.dsync),
            "o_direct_o_dsync": lat_json(&m.direct_dsync),
        },
        "random": {
            "read_qd1": rate_json(&m.randread_qd1),
            "read_qd32": rate_json(&m.randread_qd32),
            "write_qd1": rate_json(&m.randwrite_qd1),
            "write_qd32": rate_json(&m.randwrite_qd32),
        },
        "sustained": m.timeline.iter().map(rate_json).collect::<Vec<_>>(),
        "device": {
            "name": d.name,
            "model": d.model,
            "rotational": d.rotational,
            "write_cache": d.write_cache,
            "fua": d.fua,
            "discard_max_bytes": d.discard_max_bytes,
        },
    })
}
