//! [`Report::to_prometheus`]: the Prometheus text exposition format, version 0.0.4.
//!
//! Counters are `flashtier_<name>_total` (since the start or the last reset-stats: Prometheus's
//! `rate()` treats a reset like a restart), the status and derived figures are gauges, latency
//! is a summary per operation (`quantile` 0.5, 0.99, 0.999, with `_sum` and `_count`) and the
//! histogram `flashtier_request_duration_seconds` (25 µs to 10 s buckets), and the
//! version, mode, health and parameters are labelled info-style gauges with the value 1 (numeric
//! parameters also as `flashtier_param_value{name}`). Gauges not always known (hit ratios before
//! any I/O, the wear rate in the first minute) are declared without a sample until they are.
//!
//! The working set is the gauge `flashtier_working_set_bytes{window}` (`5min`, `hour`, `day`,
//! `total`): distinct 4 KiB blocks read or written in the window, estimated, in bytes.
//!
//! With a RAM tier, its counters are counters like the others (`flashtier_ram_*`), and its
//! sizes the gauges `flashtier_ram_capacity_bytes`, `flashtier_ram_used_bytes` and
//! `flashtier_ram_memory_bytes`, beside `flashtier_ram_hit_ratio`.
//!
//! With a memcached tier, its counters are counters like the others (`flashtier_memcached_*`,
//! the pool's totals `flashtier_memcached_pool_*`), and each server has
//! `flashtier_memcached_server_<counter>_total{server}`, `flashtier_memcached_server_up{server}`
//! and the histogram `flashtier_memcached_server_duration_seconds{server}` (power-of-two
//! buckets, exact; no `_sum`: the pool does not add latencies up).

use std::fmt::Write as _;

use crate::report::{MemcachedReport, MemcachedServerCounters, RamReport, Report};

/// Metric names allow `[a-zA-Z_:][a-zA-Z0-9_:]*`; anything else becomes `_`.
fn metric_name(s: &str) -> String {
    s.chars()
        .enumerate()
        .map(|(i, c)| {
            if c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit()) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Label values escape backslash, double quote and newline.
fn label_value(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// HELP text escapes backslash and newline.
fn help(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n")
}

/// Floats as Prometheus writes them.
fn float(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        format!("{v}")
    }
}

struct Out(String);

impl Out {
    fn family(&mut self, name: &str, kind: &str, text: &str) {
        let _ = writeln!(self.0, "# HELP {name} {}", help(text));
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: String) {
        self.0.push_str(name);
        if !labels.is_empty() {
            let l: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", label_value(v)))
                .collect();
            let _ = write!(self.0, "{{{}}}", l.join(","));
        }
        let _ = writeln!(self.0, " {value}");
    }

    fn gauge(&mut self, name: &str, text: &str, value: f64) {
        self.family(name, "gauge", text);
        self.sample(name, &[], float(value));
    }

    /// A gauge whose value is not always known: the family is declared anyway, so dashboards
    /// and alert rules can rely on its name (a family without samples is valid text format).
    fn gauge_if_known(&mut self, name: &str, text: &str, value: Option<f64>) {
        self.family(name, "gauge", text);
        if let Some(v) = value {
            self.sample(name, &[], float(v));
        }
    }
}

/// The RAM tier's gauges (its counters are among the report's).
fn ram(o: &mut Out, r: &RamReport) {
    for (name, text, v) in [
        (
            "capacity_bytes",
            "What the RAM tier may hold (its size, in whole 4 KiB blocks)",
            r.capacity_bytes,
        ),
        ("used_bytes", "What the RAM tier holds now", r.used_bytes),
        (
            "memory_bytes",
            "Memory the RAM tier allocated: its copies, their index and the version table",
            r.memory_bytes,
        ),
    ] {
        o.gauge(&format!("flashtier_ram_{name}"), text, v as f64);
    }
    o.gauge_if_known(
        "flashtier_ram_hit_ratio",
        "Blocks answered from the RAM tier over blocks looked up there (0..1), since start or \
         reset",
        r.hit_pct.map(|p| p / 100.0),
    );
}

/// The memcached tier's gauges and its servers' series (its counters are among the report's).
fn memcached(o: &mut Out, m: &MemcachedReport) {
    o.gauge(
        "flashtier_memcached_enabled",
        "1 while the memcached tier is on (flashtier memcached on|off), else 0",
        if m.enabled { 1.0 } else { 0.0 },
    );
    o.gauge_if_known(
        "flashtier_memcached_hit_ratio",
        "Blocks answered from memcached over blocks looked up there (0..1), since start or reset",
        m.tier.hit_pct().map(|p| p / 100.0),
    );
    let name = "flashtier_memcached_server_up";
    o.family(
        name,
        "gauge",
        "1 while the memcached server is up, 0 while it is skipped as down",
    );
    for s in &m.servers {
        let up = if s.health == "up" { "1" } else { "0" };
        o.sample(name, &[("server", &s.addr)], up.into());
    }
    let values: Vec<[u64; 10]> = m.servers.iter().map(|s| s.counters.values()).collect();
    for (i, field) in MemcachedServerCounters::NAMES.iter().enumerate() {
        let name = format!("flashtier_memcached_server_{field}_total");
        o.family(
            &name,
            "counter",
            &format!(
                "memcached {} per server, since it was added, the server started or the last \
                 reset-stats (flashtier_memcached_pool_{field}_total: all servers, removed ones \
                 included)",
                field.replace('_', " ")
            ),
        );
        for (s, v) in m.servers.iter().zip(&values) {
            o.sample(&name, &[("server", &s.addr)], v[i].to_string());
        }
    }
    let name = "flashtier_memcached_server_duration_seconds";
    o.family(
        name,
        "histogram",
        "memcached round trips per server, since it was added, the server started or the last \
         reset-stats (power-of-two buckets, exact; no _sum)",
    );
    for s in &m.servers {
        for &[bound_us, n] in &s.latency.buckets {
            let le = float(bound_us as f64 / 1e6);
            o.sample(
                &format!("{name}_bucket"),
                &[("server", &s.addr), ("le", &le)],
                n.to_string(),
            );
        }
        let count = s.latency.count.to_string();
        o.sample(
            &format!("{name}_bucket"),
            &[("server", &s.addr), ("le", "+Inf")],
            count.clone(),
        );
        o.sample(&format!("{name}_count"), &[("server", &s.addr)], count);
    }
}

impl Report {
    /// The report in the Prometheus text exposition format, as `/metrics` answers it.
    pub(crate) fn to_prometheus(&self) -> String {
        let mut o = Out(String::new());
        for (k, v) in self.counters.iter() {
            let name = format!("flashtier_{}_total", metric_name(k));
            o.family(
                &name,
                "counter",
                &format!("flashtier counter {k}, since the server started or the last reset-stats"),
            );
            o.sample(&name, &[], v.to_string());
        }

        let s = &self.status;
        o.family(
            "flashtier_info",
            "gauge",
            "The server's version, the exported device and the cache mode (value always 1)",
        );
        o.sample(
            "flashtier_info",
            &[
                ("version", &s.version),
                ("device", &s.device),
                ("mode", s.mode.as_deref().unwrap_or("none")),
            ],
            "1".into(),
        );
        o.gauge(
            "flashtier_healthy",
            &format!("1 if health is ok, else 0 (health: {})", s.health),
            if s.health == "ok" { 1.0 } else { 0.0 },
        );
        o.gauge(
            "flashtier_cache_failed",
            "1 once the cache device failed (health: failed ...), else 0",
            if s.health.starts_with("failed") {
                1.0
            } else {
                0.0
            },
        );
        let cache = s.cache_status.as_ref();
        o.gauge(
            "flashtier_backing_degraded",
            "1 while the backing store is failing (dirty data kept, write-back retried), else 0",
            if cache.is_some_and(|c| c.backing_degraded.is_some()) {
                1.0
            } else {
                0.0
            },
        );
        o.gauge(
            "flashtier_integrity_degraded",
            "1 while the cache's data is not whole (blocks lost, or records recovery could not \
             place; see flashtier status), else 0",
            if cache.is_some_and(|c| c.integrity.is_some()) {
                1.0
            } else {
                0.0
            },
        );
        o.gauge(
            "flashtier_lost_blocks",
            "Blocks whose newest data was lost: reads fail until rewritten or forget-lost",
            cache.map_or(0.0, |c| c.lost_blocks as f64),
        );
        o.gauge(
            "flashtier_uptime_seconds",
            "Seconds since the server started",
            s.uptime_secs as f64,
        );
        o.gauge(
            "flashtier_size_bytes",
            "Size of the exported device",
            s.size_bytes as f64,
        );
        if let Some(c) = &s.cache_status {
            let bs = c.block_size as f64;
            for (name, text, v) in [
                (
                    "capacity_bytes",
                    "Data capacity of the cache",
                    c.capacity_blocks as f64 * bs,
                ),
                (
                    "cached_blocks",
                    "Blocks in the cache",
                    c.cached_blocks as f64,
                ),
                (
                    "dirty_blocks",
                    "Blocks in the cache not yet written back",
                    c.dirty_blocks as f64,
                ),
                (
                    "dirty_bytes",
                    "Bytes in the cache not yet written back",
                    c.dirty_bytes as f64,
                ),
                (
                    "used_ratio",
                    "Cached blocks over capacity (0..1)",
                    c.used_pct / 100.0,
                ),
                (
                    "free_segments",
                    "Empty segments on the cache device",
                    c.free_segments as f64,
                ),
                (
                    "unwritten_blocks",
                    "Blocks the log can write before reclaim must empty another segment",
                    c.unwritten_blocks as f64,
                ),
                (
                    "stale_blocks",
                    "Blocks neither cached nor unwritten: old data, log headers, unused segment ends",
                    c.stale_blocks as f64,
                ),
                (
                    "index_bytes",
                    "RAM used by the cache index",
                    c.index_bytes as f64,
                ),
                (
                    "writeback_rate_bytes_per_second",
                    "Rate the write-back controller sets (0 when it is not running)",
                    c.writeback.rate_bytes_per_sec as f64,
                ),
                (
                    "dirty_target_blocks",
                    "Dirty blocks the write-back controller aims for",
                    c.writeback.target_blocks as f64,
                ),
            ] {
                o.gauge(&format!("flashtier_{name}"), text, v);
            }
        }
        for (name, text, v) in [
            (
                "read_hit_ratio",
                "Read blocks found in the cache (0..1), since start or reset",
                self.derived.read_hit_pct,
            ),
            (
                "write_hit_ratio",
                "Written blocks that replaced a cached version (0..1), since start or reset",
                self.derived.write_hit_pct,
            ),
        ] {
            o.gauge_if_known(&format!("flashtier_{name}"), text, v.map(|v| v / 100.0));
        }
        if let Some(ws) = &self.working_set {
            let name = "flashtier_working_set_bytes";
            o.family(
                name,
                "gauge",
                &format!(
                    "Distinct 4 KiB blocks the clients read or wrote in the window, in bytes, \
                     estimated (standard error {:.1}%); total: since start or reset",
                    ws.standard_error_pct
                ),
            );
            for (window, w) in ws.windows.iter() {
                o.sample(name, &[("window", window)], w.bytes.to_string());
            }
        }
        if let Some(j) = &self.job {
            // flashtier_mode_switch_* or flashtier_flush_*.
            let job = if j.kind == "flush" {
                "flush"
            } else {
                "mode_switch"
            };
            o.gauge(
                &format!("flashtier_{job}_running"),
                &format!("1 while a {} runs ({})", job.replace('_', " "), j.what),
                if j.done { 0.0 } else { 1.0 },
            );
            o.gauge(
                &format!("flashtier_{job}_dirty_blocks_left"),
                &format!(
                    "Dirty blocks the {} still has to write back",
                    job.replace('_', " ")
                ),
                j.dirty_blocks_left as f64,
            );
        }

        let name = "flashtier_latency_seconds";
        o.family(
            name,
            "summary",
            "Request latency as NBD clients see it, per operation, since start or reset",
        );
        for (op, l) in self.latency.iter() {
            for (q, v) in [("0.5", l.p50_us), ("0.99", l.p99_us), ("0.999", l.p999_us)] {
                o.sample(name, &[("op", op), ("quantile", q)], float(v / 1e6));
            }
            o.sample(&format!("{name}_sum"), &[("op", op)], float(l.sum_us / 1e6));
            o.sample(&format!("{name}_count"), &[("op", op)], l.count.to_string());
        }
        // The same requests as a histogram: a summary's quantiles cover the whole time since
        // the start, buckets let Prometheus take quantiles over any window.
        let name = "flashtier_request_duration_seconds";
        o.family(
            name,
            "histogram",
            "Request latency as NBD clients see it, per operation, since start or reset (a \
             bucket counts requests up to its bound, or at most 1/16 below it)",
        );
        for (op, l) in self.latency.iter() {
            for &[bound_us, n] in &l.buckets {
                let le = float(bound_us as f64 / 1e6);
                o.sample(
                    &format!("{name}_bucket"),
                    &[("op", op), ("le", &le)],
                    n.to_string(),
                );
            }
            o.sample(
                &format!("{name}_bucket"),
                &[("op", op), ("le", "+Inf")],
                l.count.to_string(),
            );
            o.sample(&format!("{name}_sum"), &[("op", op)], float(l.sum_us / 1e6));
            o.sample(&format!("{name}_count"), &[("op", op)], l.count.to_string());
        }
        let name = "flashtier_latency_max_seconds";
        o.family(
            name,
            "gauge",
            "Slowest request per operation, since start or reset",
        );
        for (op, l) in self.latency.iter() {
            o.sample(name, &[("op", op)], float(l.max_us / 1e6));
        }

        if let Some(r) = &self.ram {
            ram(&mut o, r);
        }
        if let Some(m) = &self.memcached {
            memcached(&mut o, m);
        }

        let w = &self.wear;
        o.gauge(
            "flashtier_wear_cache_bytes_written",
            "Bytes this server wrote to the cache device since it started",
            w.cache_bytes_written as f64,
        );
        o.gauge_if_known(
            "flashtier_wear_bytes_per_day",
            "Recent write rate to the cache device, per day (known once it spans a minute)",
            w.bytes_per_day,
        );
        o.gauge_if_known(
            "flashtier_wear_days_to_rated_tbw",
            "Days until the cache device's rated TBW at the recent write rate (needs \
             --endurance-tbw)",
            w.days_to_rated_tbw,
        );
        o.gauge_if_known(
            "flashtier_wear_write_amplification",
            "Bytes written to the cache device per byte clients wrote, recently (known once it \
             spans a minute of client writes)",
            w.write_amplification,
        );

        if !self.params.0.is_empty() {
            let name = "flashtier_param";
            o.family(
                name,
                "gauge",
                "Live parameters (value always 1; see the labels)",
            );
            for (k, v) in self.params.iter() {
                o.sample(name, &[("name", k), ("value", v)], "1".into());
            }
            // The numeric ones again as values, for arithmetic in rules (dirty bytes against
            // the high watermark); a label cannot be compared.
            let name = "flashtier_param_value";
            o.family(name, "gauge", "Live parameters with a numeric value");
            for (k, v) in self.params.iter() {
                if let Ok(v) = v.parse::<f64>() {
                    o.sample(name, &[("name", k)], float(v));
                }
            }
        }
        o.0
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::controller::tests::cached;
    use flashtier_io::BlockDev;

    #[test]
    fn names_and_escapes() {
        assert_eq!(metric_name("9a-b.c"), "_a_b_c");
        assert_eq!(label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        assert_eq!(float(f64::INFINITY), "+Inf");
    }

    /// Every line is a comment or `name{labels} value` with a parsable value, every sample
    /// belongs to a family declared just before it, no family is declared twice, and counters
    /// end in `_total`.
    pub(crate) fn check_exposition(text: &str) {
        let mut declared = std::collections::HashSet::new();
        let mut family = String::new();
        let mut kind = String::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut it = rest.split(' ');
                family = it.next().unwrap().to_string();
                kind = it.next().unwrap().to_string();
                assert!(declared.insert(family.clone()), "{family} declared twice");
                continue;
            }
            if line.starts_with("# HELP ") {
                continue;
            }
            let (name_labels, value) = line.rsplit_once(' ').unwrap();
            let name = name_labels.split('{').next().unwrap();
            assert!(name.starts_with(&family), "{line} outside {family}");
            assert!(value.parse::<f64>().is_ok() || value == "+Inf", "{line}");
            if kind == "counter" {
                assert!(name.ends_with("_total"), "{line}");
            }
        }
    }

    #[test]
    fn exposition_is_well_formed() {
        let (c, dev) = cached(None);
        dev.write_at(&[1u8; 4096], 0, false).unwrap();
        let text = c.report().to_prometheus();
        check_exposition(&text);
        assert!(text.contains("flashtier_writes_total 1\n"), "{text}");
        assert!(text.contains("flashtier_latency_seconds_count{op=\"write\"} 1\n"));
        assert!(text
            .contains("flashtier_request_duration_seconds_bucket{op=\"write\",le=\"+Inf\"} 1\n"));
        assert!(
            text.contains("flashtier_request_duration_seconds_bucket{op=\"write\",le=\"10\"} 1\n")
        );
        assert!(text.contains(
            "flashtier_request_duration_seconds_bucket{op=\"read\",le=\"0.000025\"} 0\n"
        ));
        assert!(text.contains("flashtier_param{name=\"promotion\",value=\"auto\"} 1\n"));
        assert!(text.contains("flashtier_param_value{name=\"writeback_dirty_high_pct\"} 70\n"));
        assert!(!text.contains("flashtier_param_value{name=\"promotion\""));
        // Declared even before their value is known (no rate yet), for dashboards and rules.
        assert!(text.contains("# TYPE flashtier_wear_days_to_rated_tbw gauge\n"));
        assert!(!text.contains("\nflashtier_wear_days_to_rated_tbw "));
    }

    /// With a memcached tier and a server, under a cache: the tier's and the pool's counters
    /// are plain counters, each server has its labelled series, and it all stays well formed.
    #[test]
    fn memcached_series_are_well_formed() {
        let (c, dev, _) = crate::controller::tests::memcached_only();
        c.memcached(crate::protocol::MemcachedRequest::Add {
            server: "127.0.0.1:1".into(),
        })
        .unwrap();
        dev.read_at(&mut [0u8; 4096], 0).unwrap();
        let text = c.report().to_prometheus();
        check_exposition(&text);
        for family in [
            "flashtier_memcached_lookup_blocks_total counter",
            "flashtier_memcached_pool_gets_total counter",
            "flashtier_memcached_server_gets_total counter",
            "flashtier_memcached_server_timeouts_total counter",
            "flashtier_memcached_server_skipped_total counter",
            "flashtier_memcached_server_up gauge",
            "flashtier_memcached_server_duration_seconds histogram",
            "flashtier_memcached_enabled gauge",
        ] {
            assert!(
                text.contains(&format!("# TYPE {family}\n")),
                "{family}:\n{text}"
            );
        }
        // 21 bounds and +Inf.
        let buckets = text
            .lines()
            .filter(|l| l.starts_with("flashtier_memcached_server_duration_seconds_bucket{"))
            .count();
        assert_eq!(buckets, 22, "{text}");
        assert!(text.contains(
            "\nflashtier_memcached_server_duration_seconds_bucket{server=\"127.0.0.1:1\",le=\"0.000016\"} 0\n"
        ));
    }
}
