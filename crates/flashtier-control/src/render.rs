//! Human renderings of a [`Report`]: `flashtier status`, the `flashtier stats` table, and the
//! `name value` stats file; and sizes as people write them ([`fmt_bytes`], [`parse_size`]),
//! shared with the command line and the config file.

use std::fmt::Write as _;

use crate::report::{
    read_hit_pct, write_hit_pct, LatencyReport, MemcachedReport, MemcachedServerReport,
    MemcachedTierCounters, Ordered, RamCounters, RamReport, Report, WorkingSetReport,
};
use crate::windows::TOTAL;

/// `1.50 GiB`, `512 B`.
pub fn fmt_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.2} {}", UNITS[unit])
}

/// Parses `4096`, `512K`, `64M`, `1G`, `2T` (binary multiples; an optional trailing `iB`/`B`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (digits, shift) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 10),
        Some('M') => (&t[..t.len() - 1], 20),
        Some('G') => (&t[..t.len() - 1], 30),
        Some('T') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let n: u64 = digits
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 4096, 512K, 64M, 1G)"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("'{s}' is too large"))
}

/// `3d 04h`, `1h 02m`, `5m 07s`, `12s`.
pub fn fmt_duration(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    match () {
        _ if d > 0 => format!("{d}d {h:02}h"),
        _ if h > 0 => format!("{h}h {m:02}m"),
        _ if m > 0 => format!("{m}m {s:02}s"),
        _ => format!("{s}s"),
    }
}

/// Microseconds as `850 µs`, `1.20 ms`, `2.50 s`.
pub fn fmt_us(us: f64) -> String {
    if us < 1000.0 {
        format!("{us:.1} µs")
    } else if us < 1e6 {
        format!("{:.2} ms", us / 1e3)
    } else {
        format!("{:.2} s", us / 1e6)
    }
}

/// `12,345`: counts a person compares at a glance.
pub fn fmt_count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn fmt_pct(p: Option<f64>) -> String {
    p.map_or_else(|| "-".to_string(), |p| format!("{p:.1}%"))
}

/// A counter's value as a person reads it: bytes in binary units, the rest as plain numbers.
fn fmt_counter(name: &str, v: u64) -> String {
    if name.ends_with("_bytes") {
        fmt_bytes(v)
    } else {
        v.to_string()
    }
}

/// Left-aligned first column, the others right-aligned (numbers) or left-aligned (text),
/// widths from the content.
pub fn table(rows: &[Vec<String>], right: bool) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let align: Vec<bool> = (0..cols).map(|i| i > 0 && right).collect();
    table_aligned(rows, &align)
}

/// [`table`] with each column's alignment given: `right[i]` right-aligns column `i` (columns
/// past the end of `right` are left-aligned).
pub fn table_aligned(rows: &[Vec<String>], right: &[bool]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let width: Vec<usize> = (0..cols)
        .map(|i| {
            rows.iter()
                .filter_map(|r| r.get(i))
                .map(|c| c.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (i, cell) in r.iter().enumerate() {
            let pad = width[i] - cell.chars().count();
            if !right.get(i).copied().unwrap_or(false) {
                if i > 0 {
                    line.push_str("   ");
                }
                line.push_str(cell);
                line.push_str(&" ".repeat(pad));
            } else {
                line.push_str(&" ".repeat(pad + 3));
                line.push_str(cell);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The `capacity` line of `flashtier status`: where the cache's slots are, as shares of the
/// capacity (cached, kept unwritten for the log, stale until reclaim empties their segments).
fn render_capacity(c: &crate::report::CacheStatus) -> String {
    let pct = |n: u64| n as f64 * 100.0 / c.capacity_blocks.max(1) as f64;
    format!(
        "{:.1}% cached, {:.1}% unwritten (free segments, emptied ones, the open one's rest), \
         {:.1}% stale (old data, log headers, unused segment ends)",
        pct(c.cached_blocks),
        pct(c.unwritten_blocks),
        pct(c.stale_blocks)
    )
}

/// The `write-back` line of `flashtier status`: what the cleaner does, its rate and target.
fn render_writeback(c: &crate::report::CacheStatus) -> String {
    let w = &c.writeback;
    let target = fmt_bytes(w.target_blocks * c.block_size as u64);
    match w.state.as_str() {
        "controller" => format!(
            "controller at {}/s toward the target of {target}",
            fmt_bytes(w.rate_bytes_per_sec)
        ),
        "watermark" => "full speed: dirty above the high watermark".into(),
        "age" => "writing back blocks older than the max age".into(),
        "backing-idle" => "the backing store is idle: writing back".into(),
        "retrying" => "retrying after a failed write-back (backing off)".into(),
        "off" | "" => "off (not write-back mode)".into(),
        other => format!("{other} (target {target})"),
    }
}

/// Lost ranges shown in `flashtier status` (all of them are in the JSON).
const LOST_RANGES_SHOWN: usize = 16;

/// `2 blocks: offset 36864 (block 9), 4.00 KiB; offset 409600 (block 100), 4.00 KiB`.
fn render_lost(c: &crate::report::CacheStatus) -> String {
    let bs = c.block_size as u64;
    let ranges: Vec<String> = c
        .lost_ranges
        .iter()
        .take(LOST_RANGES_SHOWN)
        .map(|&[first, n]| {
            format!(
                "offset {} (block {first}{}), {}",
                first * bs,
                if n > 1 {
                    format!("..{}", first + n - 1)
                } else {
                    String::new()
                },
                fmt_bytes(n * bs)
            )
        })
        .collect();
    let more = c.lost_ranges.len().saturating_sub(LOST_RANGES_SHOWN);
    format!(
        "{} block{}: {}{}; reads fail until written again or `flashtier forget-lost`",
        c.lost_blocks,
        if c.lost_blocks == 1 { "" } else { "s" },
        ranges.join("; "),
        if more > 0 {
            format!("; and {more} more ranges (`flashtier stats --json` lists them all)")
        } else {
            String::new()
        }
    )
}

/// One line about the trace being recorded, or the one that failed.
pub fn render_trace(t: &crate::trace::TraceStatus) -> String {
    let lost = if t.lost > 0 {
        format!(", {} dropped (the file could not keep up)", t.lost)
    } else {
        String::new()
    };
    match &t.error {
        None => format!(
            "recording to {}: {} requests in {:.0} s, {}{lost}",
            t.path.display(),
            t.requests,
            t.seconds,
            fmt_bytes(t.bytes)
        ),
        Some(e) => format!(
            "FAILED writing {} after {} requests: {e}",
            t.path.display(),
            t.requests
        ),
    }
}

/// `lru, 1.50 GiB of 4.00 GiB held, 4.05 GiB of memory, hits 12,345 of 20,000 blocks looked up
/// (61.7%), 678 evicted`: the RAM tier in one line.
pub fn render_ram(r: &RamReport) -> String {
    let c = &r.counters;
    let lookups = match r.hit_pct {
        Some(p) => format!(
            "hits {} of {} blocks looked up ({p:.1}%)",
            fmt_count(c.hit_blocks),
            fmt_count(c.lookup_blocks)
        ),
        None => "no blocks looked up yet".into(),
    };
    format!(
        "{}, {} of {} held, {} of memory, {lookups}, {} evicted",
        r.policy,
        fmt_bytes(r.used_bytes),
        fmt_bytes(r.capacity_bytes),
        fmt_bytes(r.memory_bytes),
        fmt_count(c.evicted_blocks)
    )
}

/// `inclusive, on, 3 servers (2 up, 1 down), hits 12,345 of 20,000 blocks looked up (61.7%), 0
/// stale, 0 corrupt`: the memcached tier in one line.
pub fn render_memcached(m: &MemcachedReport) -> String {
    let n = m.servers.len();
    let up = m.servers_up();
    let t = &m.tier;
    let lookups = match t.hit_pct() {
        Some(p) => format!(
            "hits {} of {} blocks looked up ({p:.1}%)",
            fmt_count(t.hit_blocks),
            fmt_count(t.lookup_blocks)
        ),
        None => "no blocks looked up yet".into(),
    };
    format!(
        "{}, {}, {n} server{} ({up} up, {} down), {lookups}, {} stale, {} corrupt",
        m.mode,
        if m.enabled { "on" } else { "off" },
        if n == 1 { "" } else { "s" },
        n - up,
        fmt_count(t.stale_values),
        fmt_count(t.corrupt_values)
    )
}

/// A server's health as a person reads it: `up`, or `down 1m 05s, retry in 3s`.
fn memcached_health(s: &MemcachedServerReport) -> String {
    match (s.health.as_str(), s.down_secs, s.retry_in_secs) {
        ("down", Some(down), Some(retry)) => format!(
            "down {}, retry in {}",
            fmt_duration(down as u64),
            fmt_duration(retry.ceil() as u64)
        ),
        (health, ..) => health.to_string(),
    }
}

/// `10.0.0.5:11211 up: 1,234 gets (61.7% hit), 56 sets, 0 errors, 0 timeouts, p50 256.0 µs,
/// p99 1.02 ms`, and the last error of a server that is down.
fn render_memcached_server(s: &MemcachedServerReport) -> String {
    let c = &s.counters;
    let hit = if c.gets > 0 {
        format!(" ({:.1}% hit)", c.hits as f64 * 100.0 / c.gets as f64)
    } else {
        String::new()
    };
    let mut line = format!(
        "{} {}: {} gets{hit}, {} sets, {} errors, {} timeouts, p50 {}, p99 {}",
        s.addr,
        memcached_health(s),
        fmt_count(c.gets),
        fmt_count(c.sets),
        fmt_count(c.errors),
        fmt_count(c.timeouts),
        fmt_latency(s.latency.p50_us),
        fmt_latency(s.latency.p99_us)
    );
    if let Some(e) = &s.last_error {
        let _ = write!(line, "; last error: {e}");
    }
    line
}

fn fmt_latency(us: Option<f64>) -> String {
    us.map_or_else(|| "-".into(), fmt_us)
}

impl MemcachedReport {
    /// `flashtier memcached list`: one line per server (address, health, gets, hits, misses,
    /// sets, errors, timeouts, p50 and p99 latency), then the last error of each server down.
    pub fn render_servers(&self) -> String {
        if self.servers.is_empty() {
            return "no memcached servers (`flashtier memcached add HOST:PORT` adds one)\n".into();
        }
        let mut rows = vec![[
            "server", "health", "gets", "hits", "misses", "sets", "errors", "timeouts", "p50",
            "p99",
        ]
        .map(String::from)
        .to_vec()];
        for s in &self.servers {
            let c = &s.counters;
            let mut row = vec![s.addr.clone(), memcached_health(s)];
            row.extend([c.gets, c.hits, c.misses, c.sets, c.errors, c.timeouts].map(fmt_count));
            row.extend([fmt_latency(s.latency.p50_us), fmt_latency(s.latency.p99_us)]);
            rows.push(row);
        }
        let mut out = table_aligned(
            &rows,
            &[false, false, true, true, true, true, true, true, true, true],
        );
        for s in &self.servers {
            if let Some(e) = &s.last_error {
                let _ = writeln!(out, "{}: last error: {e}", s.addr);
            }
        }
        out
    }
}

/// How a cache of `capacity` bytes compares with the hour's working set of `hour` bytes:
/// `29% of the hour's`, `3.2x the hour's`.
fn share_of_hour(capacity: u64, hour: u64) -> String {
    let r = capacity as f64 / hour as f64;
    if r < 0.1 {
        format!("{:.1}% of the hour's", r * 100.0)
    } else if r < 1.0 {
        format!("{:.0}% of the hour's", r * 100.0)
    } else {
        format!("{r:.1}x the hour's")
    }
}

/// `5min 1.20 GiB, hour 3.40 GiB, day 3.40 GiB (estimated, standard error 1.6%)`, then how each
/// cache tier's capacity (`(name, bytes)`) compares with the hour's: `; cache 1.00 GiB = 29% of
/// the hour's`.
pub fn render_working_set(ws: &WorkingSetReport, caches: &[(&str, u64)]) -> String {
    let windows: Vec<String> = ws
        .windows
        .iter()
        .filter(|(name, _)| *name != TOTAL)
        .map(|(name, w)| format!("{name} {}", fmt_bytes(w.bytes)))
        .collect();
    let mut out = format!(
        "{} (estimated, standard error {:.1}%)",
        windows.join(", "),
        ws.standard_error_pct
    );
    if let Some(hour) = ws.bytes("hour").filter(|&b| b > 0) {
        for &(name, capacity) in caches {
            let _ = write!(
                out,
                "; {name} {} = {}",
                fmt_bytes(capacity),
                share_of_hour(capacity, hour)
            );
        }
    }
    out
}

/// One line about the running or last scrub (`flashtier status`, `flashtier scrub --status`).
pub fn render_scrub(s: &crate::report::ScrubStatus) -> String {
    let found = format!(
        "checked {} blocks, {} damaged clean blocks dropped, {} dirty blocks lost",
        s.checked_blocks, s.dropped_blocks, s.lost_blocks
    );
    match (s.done, &s.error) {
        (false, _) => format!(
            "running{}: segment {} of {}, {found}, {:.0} s so far{}",
            if s.cancelled { " (cancelling)" } else { "" },
            s.segments_done,
            s.segments_total,
            s.elapsed_secs,
            s.rate_bytes_per_sec
                .map(|r| format!(", at most {}/s", fmt_bytes(r)))
                .unwrap_or_default()
        ),
        (true, Some(e)) => format!("last scrub FAILED after {found}: {e}"),
        (true, None) => format!(
            "last scrub {} in {:.1} s: {found}",
            if s.cancelled { "cancelled" } else { "done" },
            s.elapsed_secs
        ),
    }
}

impl Report {
    /// `flashtier status`: what is served, how full, how healthy, what is in progress.
    pub fn render_status(&self) -> String {
        let s = &self.status;
        let mut rows = vec![
            vec!["device".into(), s.device.clone()],
            vec!["size".into(), fmt_bytes(s.size_bytes)],
            vec![
                "mode".into(),
                s.mode
                    .clone()
                    .unwrap_or_else(|| match s.cache_state.as_str() {
                        "detached" => "pass-through (cache detached)".into(),
                        _ => "no cache (pass-through)".into(),
                    }),
            ],
            vec!["health".into(), s.health.clone()],
            vec!["uptime".into(), fmt_duration(s.uptime_secs)],
        ];
        if !s.version.is_empty() {
            rows.push(vec!["version".into(), s.version.clone()]);
        }
        if s.cache_state == "detached" {
            rows.push(vec![
                "cache".into(),
                "detached: the backing store is served directly; `flashtier attach` brings the \
                 cache back (empty)"
                    .into(),
            ]);
        }
        if let Some(c) = &s.cache_status {
            let bs = c.block_size as u64;
            let mut cache = format!(
                "{} of {} used ({:.1}%, {} of {} blocks of {})",
                fmt_bytes(c.cached_blocks * bs),
                fmt_bytes(c.capacity_blocks * bs),
                c.used_pct,
                c.cached_blocks,
                c.capacity_blocks,
                fmt_bytes(bs)
            );
            // Engines that count them say how many misses a cache twice the size would have
            // hit; read from the counters by name, so older engines show nothing of it.
            if let Some(ghost) = self.counters.get("ghost_hit_blocks") {
                let misses = self.counters.get("read_miss_blocks").copied().unwrap_or(0);
                let _ = write!(
                    cache,
                    "; read misses {} blocks, ghost hits {} (would hit with 2x cache)",
                    fmt_count(misses),
                    fmt_count(*ghost)
                );
            }
            rows.extend([
                vec!["cache".into(), cache],
                vec![
                    "dirty".into(),
                    format!("{} ({} blocks)", fmt_bytes(c.dirty_bytes), c.dirty_blocks),
                ],
                vec![
                    "segments".into(),
                    format!(
                        "{} free of {} ({} each)",
                        c.free_segments,
                        c.segments,
                        fmt_bytes(c.segment_size as u64)
                    ),
                ],
                vec!["capacity".into(), render_capacity(c)],
                vec!["write-back".into(), render_writeback(c)],
                vec!["reclaim".into(), c.reclaim_policy.clone()],
                vec!["index RAM".into(), fmt_bytes(c.index_bytes)],
                vec![
                    "atomic writes".into(),
                    format!("up to {}", fmt_bytes(c.atomic_write_bytes as u64)),
                ],
            ]);
            if c.lost_blocks > 0 {
                rows.push(vec!["lost".into(), render_lost(c)]);
            }
            if !c.recovery.is_empty() {
                rows.push(vec!["recovery".into(), c.recovery.join("; ")]);
            }
        }
        rows.push(vec!["in progress".into(), self.render_job()]);
        if let Some(scrub) = &self.scrub {
            rows.push(vec!["scrub".into(), render_scrub(scrub)]);
        }
        if let Some(t) = &self.trace {
            rows.push(vec!["trace".into(), render_trace(t)]);
        }
        if let Some(r) = &self.ram {
            rows.push(vec!["ram".into(), render_ram(r)]);
        }
        if let Some(m) = &self.memcached {
            rows.push(vec!["memcached".into(), render_memcached(m)]);
            rows.extend(
                m.servers
                    .iter()
                    .map(|s| vec![String::new(), render_memcached_server(s)]),
            );
        }
        if let Some(ws) = &self.working_set {
            rows.push(vec![
                "working set".into(),
                render_working_set(ws, &self.cache_capacities()),
            ]);
        }
        table(&rows, false)
    }

    /// The capacity of each cache tier the server has, as `render_working_set` compares them.
    fn cache_capacities(&self) -> Vec<(&'static str, u64)> {
        let mut out = Vec::new();
        if let Some(c) = &self.status.cache_status {
            out.push(("cache", c.capacity_blocks * c.block_size as u64));
        }
        if let Some(r) = &self.ram {
            out.push(("ram", r.capacity_bytes));
        }
        out
    }

    /// One line about the job (mode switch or flush), running or last.
    pub fn render_job(&self) -> String {
        let Some(j) = &self.job else {
            return "nothing".into();
        };
        match (j.done, &j.error) {
            (false, _) => format!(
                "{}{}: {} dirty blocks left to write back (of {}), {:.1} s so far",
                j.what,
                if j.cancelled { " (cancelling)" } else { "" },
                j.dirty_blocks_left,
                j.dirty_blocks_at_start,
                j.elapsed_secs
            ),
            (true, None) if j.cancelled => format!(
                "nothing (last: {} cancelled after {:.1} s, {} dirty blocks left)",
                j.what, j.elapsed_secs, j.dirty_blocks_left
            ),
            (true, None) => format!(
                "nothing (last: {}, done in {:.1} s)",
                j.what, j.elapsed_secs
            ),
            (true, Some(e)) => format!("nothing (last: {} FAILED: {e})", j.what),
        }
    }

    /// `flashtier stats`: counters with total and window columns, hit rates, the working set,
    /// latencies, wear.
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let total_secs = self.window_secs.get("total").copied().unwrap_or(0);
        let _ = writeln!(
            out,
            "{} | {} | health {} | counting for {} (since start or reset-stats)\n",
            self.status.device,
            self.status.mode.as_deref().unwrap_or("pass-through"),
            self.status.health,
            fmt_duration(total_secs),
        );
        // Columns: total first, then the windows shortest first.
        let mut columns: Vec<(&str, &Ordered<u64>)> = Vec::new();
        if let Some(t) = self.windows.get("total") {
            columns.push(("total", t));
        }
        for (name, w) in self.windows.iter().filter(|(n, _)| *n != "total") {
            columns.push((name, w));
        }
        let mut header = vec!["counter".to_string()];
        header.extend(columns.iter().map(|(n, _)| n.to_string()));
        let mut rows = vec![header];
        for (name, _) in self.counters.iter() {
            let mut row = vec![name.to_string()];
            row.extend(
                columns
                    .iter()
                    .map(|(_, w)| fmt_counter(name, w.get(name).copied().unwrap_or(0))),
            );
            rows.push(row);
        }
        if self.status.cache {
            for (label, f) in [
                (
                    "read hit %",
                    read_hit_pct as fn(&Ordered<u64>) -> Option<f64>,
                ),
                ("write hit %", write_hit_pct),
            ] {
                let mut row = vec![label.to_string()];
                row.extend(columns.iter().map(|(_, w)| fmt_pct(f(w))));
                rows.push(row);
            }
        }
        if self.ram.is_some() {
            let mut row = vec!["ram hit %".to_string()];
            row.extend(
                columns
                    .iter()
                    .map(|(_, w)| fmt_pct(RamCounters::from_counters(w).hit_pct())),
            );
            rows.push(row);
        }
        if self.memcached.is_some() {
            let mut row = vec!["memcached hit %".to_string()];
            row.extend(
                columns
                    .iter()
                    .map(|(_, w)| fmt_pct(MemcachedTierCounters::from_counters(w).hit_pct())),
            );
            rows.push(row);
        }
        if let Some(ws) = &self.working_set {
            let mut row = vec!["working set (est.)".to_string()];
            row.extend(
                columns
                    .iter()
                    .map(|(name, _)| ws.bytes(name).map_or_else(|| "-".to_string(), fmt_bytes)),
            );
            rows.push(row);
        }
        out.push_str(&table(&rows, true));

        let mut rows = vec![vec![
            "latency".to_string(),
            "count".into(),
            "p50".into(),
            "p99".into(),
            "p99.9".into(),
            "max".into(),
        ]];
        for (op, l) in self.latency.iter() {
            let LatencyReport {
                count,
                p50_us,
                p99_us,
                p999_us,
                max_us,
                ..
            } = l;
            let cells = if *count == 0 {
                vec!["-".to_string(); 4]
            } else {
                [p50_us, p99_us, p999_us, max_us]
                    .iter()
                    .map(|v| fmt_us(**v))
                    .collect()
            };
            let mut row = vec![op.to_string(), count.to_string()];
            row.extend(cells);
            rows.push(row);
        }
        out.push('\n');
        out.push_str(&table(&rows, true));
        if let Some(r) = &self.ram {
            let _ = writeln!(out, "\nram: {}", render_ram(r));
        }
        if let Some(m) = &self.memcached {
            let _ = writeln!(out, "\nmemcached: {}", render_memcached(m));
            out.push_str(&m.render_servers());
        }
        out.push('\n');
        out.push_str(&self.render_wear());
        out.push('\n');
        out
    }

    /// One line: bytes written to the cache device, the rate and the forecast.
    pub fn render_wear(&self) -> String {
        let w = &self.wear;
        if !self.status.cache {
            return "wear: no cache device".into();
        }
        let mut s = format!(
            "wear: {} written to the cache device by this server since it started",
            fmt_bytes(w.cache_bytes_written)
        );
        if let Some(rate) = w.bytes_per_day {
            let _ = write!(s, ", {}/day lately", fmt_bytes(rate as u64));
        }
        if let Some(x) = w.write_amplification {
            let _ = write!(s, ", {x:.1}× what the clients wrote");
        }
        match (w.endurance_tbw, w.days_to_rated_tbw) {
            (Some(tbw), Some(days)) => {
                let _ = write!(
                    s,
                    "; rated {tbw} TBW reached in {days:.0} days ({:.1} years) at this rate",
                    days / 365.25
                );
            }
            (Some(tbw), None) => {
                let _ = write!(s, "; rated {tbw} TBW (forecast after a minute of writes)");
            }
            (None, _) => s.push_str(" (give --endurance-tbw for a forecast)"),
        }
        s
    }

    /// The stats file: `name value` per line, every counter first (the same numbers as
    /// `counters` in the JSON), then the status, derived figures, the working set
    /// (`working_set_<window>_blocks` and `_bytes`), latencies and wear.
    pub fn to_stats_text(&self) -> String {
        let mut out = String::new();
        let mut line = |k: &str, v: &dyn std::fmt::Display| {
            let _ = writeln!(out, "{k} {v}");
        };
        for (k, v) in self.counters.iter() {
            line(k, v);
        }
        let s = &self.status;
        line("mode", &s.mode.as_deref().unwrap_or("none"));
        line("health", &s.health);
        line("uptime_secs", &s.uptime_secs);
        line("size_bytes", &s.size_bytes);
        if let Some(c) = &s.cache_status {
            line("block_size", &c.block_size);
            line("capacity_blocks", &c.capacity_blocks);
            line("cached_blocks", &c.cached_blocks);
            line("dirty_blocks", &c.dirty_blocks);
            line("dirty_bytes", &c.dirty_bytes);
            line("used_pct", &format!("{:.2}", c.used_pct));
            line("unwritten_blocks", &c.unwritten_blocks);
            line("stale_blocks", &c.stale_blocks);
            line("free_segments", &c.free_segments);
            line("writeback_state", &c.writeback.state);
            line(
                "writeback_rate_bytes_per_sec",
                &c.writeback.rate_bytes_per_sec,
            );
            line("dirty_target_blocks", &c.writeback.target_blocks);
            line("lost_blocks", &c.lost_blocks);
            line("lost_ranges", &c.lost_ranges.len());
        }
        let opt = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.2}"));
        line("read_hit_pct", &opt(self.derived.read_hit_pct));
        line("write_hit_pct", &opt(self.derived.write_hit_pct));
        if let Some(ws) = &self.working_set {
            for (name, w) in ws.windows.iter() {
                line(&format!("working_set_{name}_blocks"), &w.blocks);
                line(&format!("working_set_{name}_bytes"), &w.bytes);
            }
        }
        for (op, l) in self.latency.iter() {
            line(&format!("latency_{op}_count"), &l.count);
            line(&format!("latency_{op}_p50_us"), &format!("{:.1}", l.p50_us));
            line(&format!("latency_{op}_p99_us"), &format!("{:.1}", l.p99_us));
            line(
                &format!("latency_{op}_p999_us"),
                &format!("{:.1}", l.p999_us),
            );
            line(&format!("latency_{op}_max_us"), &format!("{:.1}", l.max_us));
        }
        let w = &self.wear;
        line("wear_cache_bytes_written", &w.cache_bytes_written);
        line("wear_bytes_per_day", &opt(w.bytes_per_day));
        line("wear_endurance_tbw", &opt(w.endurance_tbw));
        line("wear_days_to_rated_tbw", &opt(w.days_to_rated_tbw));
        line("wear_write_amplification", &opt(w.write_amplification));
        if let Some(sc) = &self.scrub {
            line("scrub_done", &sc.done);
            line("scrub_checked_blocks", &sc.checked_blocks);
            line("scrub_dropped_blocks", &sc.dropped_blocks);
            line("scrub_lost_blocks", &sc.lost_blocks);
        }
        if let Some(r) = &self.ram {
            line("ram_policy", &r.policy);
            line("ram_capacity_bytes", &r.capacity_bytes);
            line("ram_used_bytes", &r.used_bytes);
            line("ram_memory_bytes", &r.memory_bytes);
            line("ram_hit_pct", &opt(r.hit_pct));
        }
        if let Some(m) = &self.memcached {
            line("memcached_enabled", &m.enabled);
            line("memcached_mode", &m.mode);
            line("memcached_servers", &m.servers.len());
            line("memcached_servers_up", &m.servers_up());
            line("memcached_hit_pct", &opt(m.tier.hit_pct()));
        }
        if let Some(t) = &self.trace {
            line("trace_requests", &t.requests);
            line("trace_lost", &t.lost);
            line("trace_bytes", &t.bytes);
        }
        if let Some(j) = &self.job {
            line("job", &j.what);
            line("job_done", &j.done);
            line("job_cancelled", &j.cancelled);
            line("job_dirty_blocks_left", &j.dirty_blocks_left);
            if let Some(e) = &j.error {
                line("job_error", e);
            }
        }
        line("generated_unix_ms", &self.generated_unix_ms);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::tests::{cached, passthrough};
    use flashtier_io::BlockDev;

    #[test]
    fn formats() {
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(1536), "1.50 KiB");
        assert_eq!(fmt_duration(3725), "1h 02m");
        assert_eq!(fmt_duration(7), "7s");
        assert_eq!(fmt_us(850.0), "850.0 µs");
        assert_eq!(fmt_us(1200.0), "1.20 ms");
        let rows = [
            vec!["a".into(), "1".into()],
            vec!["long".into(), "100".into()],
        ];
        assert_eq!(table(&rows, true), "a        1\nlong   100\n");
        assert_eq!(table(&rows, false), "a      1\nlong   100\n");
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512K"), Ok(512 << 10));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(1536), "1.50 KiB");
        assert_eq!(fmt_bytes(1 << 30), "1.00 GiB");
    }

    #[test]
    fn renderings_show_every_counter() {
        let (c, dev) = cached(None);
        dev.write_at(&[1u8; 4096], 0, false).unwrap();
        let r = c.report();
        let table = r.render_table();
        let text = r.to_stats_text();
        for (k, v) in r.counters.iter() {
            assert!(table.contains(k), "{k} missing from the table");
            assert!(
                text.contains(&format!("\n{k} {v}\n")) || text.starts_with(&format!("{k} {v}\n"))
            );
        }
        for what in ["5min", "hour", "day", "read hit %", "p99.9", "wear:"] {
            assert!(table.contains(what), "{what} missing:\n{table}");
        }
        let status = r.render_status();
        assert!(
            status.contains("writeback") && status.contains("health"),
            "{status}"
        );
        assert!(status.contains("nothing"), "{status}");

        let r = passthrough().0.report();
        assert!(r.render_status().contains("no cache"));
        assert!(!r.render_table().contains("hit %"));
    }

    /// The write amplification shows in the wear line, the stats file and Prometheus once the
    /// server knows it, and nowhere before (a minute of client writes).
    #[test]
    fn write_amplification_shows_once_known() {
        let (c, dev) = cached(None);
        dev.write_at(&[1u8; 4096], 0, false).unwrap();
        let mut r = c.report();
        assert_eq!(r.wear.write_amplification, None, "the first minute");
        assert!(!r.render_wear().contains("what the clients wrote"));
        assert!(r.to_stats_text().contains("\nwear_write_amplification -\n"));
        r.wear.bytes_per_day = Some(2e12);
        r.wear.write_amplification = Some(3.667);
        assert!(
            r.render_wear()
                .contains("/day lately, 3.7× what the clients wrote"),
            "{}",
            r.render_wear()
        );
        assert!(r
            .to_stats_text()
            .contains("\nwear_write_amplification 3.67\n"));
        let metrics = r.to_prometheus();
        assert!(
            metrics.contains("\nflashtier_wear_write_amplification 3.667\n"),
            "{metrics}"
        );
    }

    /// The cache row names ghost hits only when the engine counts them (`ghost_hit_blocks`),
    /// next to the read misses.
    #[test]
    fn ghost_hits_show_beside_the_misses_when_counted() {
        let (c, dev) = cached(None);
        dev.read_at(&mut [0u8; 8192], 0).unwrap();
        let mut r = c.report();
        let cache_row = |r: &Report| {
            let status = r.render_status();
            let row = status.lines().find_map(|l| l.strip_prefix("cache "));
            row.unwrap_or_else(|| panic!("no cache row:\n{status}"))
                .to_string()
        };
        r.counters.0.retain(|(k, _)| k != "ghost_hit_blocks");
        assert!(!cache_row(&r).contains("ghost"), "{}", cache_row(&r));
        let misses = r.counters.get("read_miss_blocks").copied().unwrap();
        assert!(misses >= 2);
        r.counters.0.push(("ghost_hit_blocks".into(), 1234));
        let row = cache_row(&r);
        assert!(
            row.ends_with(&format!(
                "; read misses {} blocks, ghost hits 1,234 (would hit with 2x cache)",
                fmt_count(misses)
            )),
            "{row}"
        );
    }

    #[test]
    fn a_cache_is_compared_with_the_hours_working_set() {
        assert_eq!(share_of_hour(1 << 30, 4 << 30), "25% of the hour's");
        assert_eq!(share_of_hour(1 << 20, 1 << 30), "0.1% of the hour's");
        assert_eq!(share_of_hour(5 << 30, 2 << 30), "2.5x the hour's");
        let (c, dev) = cached(None);
        let r = c.report();
        let ws = r.working_set.as_ref().unwrap();
        // Nothing touched yet: no comparison with nothing.
        assert!(!render_working_set(ws, &[("cache", 1 << 30)]).contains("hour's"));
        dev.write_at(&vec![1u8; 1 << 20], 0, false).unwrap();
        let r = c.report();
        let ws = r.working_set.as_ref().unwrap();
        let hour = ws.bytes("hour").unwrap();
        let line = render_working_set(ws, &[("cache", hour / 4), ("ram", hour * 3)]);
        assert!(
            line.ends_with(&format!(
                "; cache {} = 25% of the hour's; ram {} = 3.0x the hour's",
                fmt_bytes(hour / 4),
                fmt_bytes(hour * 3)
            )),
            "{line}"
        );
    }
}
