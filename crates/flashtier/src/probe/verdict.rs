//! The verdict: is the device fit to be a write-back cache device, and why not. A pure
//! function of the measurements and what the device says of itself, so every rule is tested on
//! made-up numbers.

use super::device::DeviceFacts;
use super::measure::{Latency, Measurements};
use crate::units::fmt_bytes;
use flashtier_control::render::fmt_us;

/// A synchronous flush at or above 1 ms caps a database that commits synchronously at 1000
/// commits/s per stream; NVMe drives with power-loss protection flush in tens of µs and
/// consumer SSDs in a few hundred, so a cache device slower than this throttles every FLUSH the
/// cache serves from its log.
const WARN_FLUSH_US: f64 = 1_000.0;
/// A 7200 rpm disk flushes its cache in about a rotation and the write (10-15 ms); at 20 ms
/// (≤ 50 commits/s) the cache would serve FLUSH slower than the spinning disk it is meant to
/// hide. Set above a disk's figure, not at it: a busy shared SSD's flush tail reaches
/// several ms (measured on a loaded virtual disk: p50 1.8-4 ms).
const UNFIT_FLUSH_US: f64 = 20_000.0;
/// Emptying a volatile write cache to flash takes at least a few hundred µs; a flush returning
/// faster than this on a device reporting such a cache (and not RAM) probably never reached
/// stable media: a hypervisor's cache=unsafe, or a drive that ignores FLUSH.
const SUSPICIOUS_FLUSH_US: f64 = 60.0;
/// A spinning disk's 4K random read at QD1 costs a seek and half a turn (≥ 5 ms: ≤ 200/s;
/// short-stroked, with its own cache helping, a few hundred). Beyond 1000 it cannot be a disk:
/// the rotational flag is then a driver's default (virtio-blk reports 1 unless told
/// otherwise), not a fact.
const ROTATIONAL_MAX_READ_IOPS: f64 = 1_000.0;
/// A cache hit must be much faster than the slow store's miss: below 1000 reads/s at QD1
/// (1 ms each) it is hardly faster than a network volume.
const LOW_READ_QD1_IOPS: f64 = 1_000.0;
/// Bursts of random writes land on the cache device; a SATA SSD takes tens of thousands a
/// second at QD32, and below 5000 the cache stalls the bursts it exists to absorb.
const LOW_WRITE_QD32_IOPS: f64 = 5_000.0;
/// The log is written sequentially: its bandwidth caps how fast writes are absorbed and how
/// fast a full cache takes new data.
const LOW_SEQWRITE_MB_S: f64 = 100.0;
/// A second of the sustained run below this share of its median is a dip: garbage collection
/// or a full SLC cache, what an average over the run hides and a database sees as a stall.
pub const DIP_FRACTION: f64 = 0.3;
/// Dips are judged only over a run of at least this many seconds (a median of fewer means
/// little).
const MIN_TIMELINE_SECS: usize = 3;
/// An fdatasync p99 above this is a stall a committing database feels, whatever the median.
const STALL_P99_US: f64 = 50_000.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Ok,
    Warn,
    Unfit,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Ok => "ok",
            Level::Warn => "warn",
            Level::Unfit => "unfit",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub level: Level,
    /// Why the level is not ok, worst first.
    pub reasons: Vec<String>,
    /// Facts worth knowing that do not change the level.
    pub notes: Vec<String>,
}

/// The rules [`judge`] applies, for `flashtier probe --help`.
pub fn rules_text() -> String {
    format!(
        "The verdict for a write-back cache device is ok, warn or unfit, with reasons: fsync or \
         fdatasync p50 from {warn} warns (every FLUSH costs that: at most 1e6/p50 synchronous \
         commits/s), from {unfit} is unfit; fdatasync p50 under {fast} on a device reporting a \
         volatile (write back) cache, not a RAM disk, warns that flushes are probably not \
         reaching stable media; a rotational device is unfit when its random reads agree (under \
         {ROTATIONAL_MAX_READ_IOPS}/s at QD1), else noted; fewer than {LOW_READ_QD1_IOPS} random \
         reads/s at QD1, fewer than {LOW_WRITE_QD32_IOPS} random writes/s at QD32, sequential \
         writes under {LOW_SEQWRITE_MB_S} MB/s, an fdatasync p99 of {stall} or more, and a \
         second of the sustained run under {dip}% of its median (runs of {MIN_TIMELINE_SECS} s \
         or more) each warn. Notes (no FUA, no discard, a rotational flag the reads contradict) \
         do not change it.",
        warn = fmt_us(WARN_FLUSH_US),
        unfit = fmt_us(UNFIT_FLUSH_US),
        fast = fmt_us(SUSPICIOUS_FLUSH_US),
        stall = fmt_us(STALL_P99_US),
        dip = DIP_FRACTION * 100.0,
    )
}

/// Judges `m` measured on a device described by `d`.
pub fn judge(m: &Measurements, d: &DeviceFacts) -> Verdict {
    let mut found: Vec<(Level, String)> = Vec::new();
    let mut notes = Vec::new();

    let read_qd1 = m.randread_qd1.iops;
    match d.rotational {
        Some(true) if read_qd1 < ROTATIONAL_MAX_READ_IOPS => found.push((
            Level::Unfit,
            format!(
                "the device is rotational (a spinning disk: {read_qd1:.0} random reads/s at \
                 QD1): a cache on it is no faster than the slow store"
            ),
        )),
        Some(true) => notes.push(format!(
            "the device reports itself rotational, but {read_qd1:.0} random reads/s at QD1 \
             rule out a spinning disk (virtual disks often report rotational by default)"
        )),
        _ => {}
    }

    for (name, lat) in [("fsync", &m.fsync), ("fdatasync", &m.fdatasync)] {
        flush_cost(name, lat, &mut found);
    }
    if m.fdatasync.samples > 0
        && m.fdatasync.p50_us < SUSPICIOUS_FLUSH_US
        && d.volatile_write_cache()
        && !d.ram_backed
    {
        found.push((
            Level::Warn,
            format!(
                "fdatasync p50 {} on a device reporting a volatile write cache: flushes are \
                 probably not reaching stable media (a crash or power loss could lose \
                 acknowledged writes)",
                fmt_us(m.fdatasync.p50_us)
            ),
        ));
    }
    if m.fdatasync.p99_us >= STALL_P99_US && m.fdatasync.p50_us < UNFIT_FLUSH_US {
        found.push((
            Level::Warn,
            format!(
                "fdatasync p99 {} (p50 {}): some flushes stall that long, and commits with them",
                fmt_us(m.fdatasync.p99_us),
                fmt_us(m.fdatasync.p50_us)
            ),
        ));
    }

    if read_qd1 < LOW_READ_QD1_IOPS && found.iter().all(|(l, _)| *l != Level::Unfit) {
        found.push((
            Level::Warn,
            format!(
                "{read_qd1:.0} random 4K reads/s at QD1 ({} each): a cache hit is hardly faster \
                 than a miss on a network volume",
                fmt_us(m.randread_qd1.latency.p50_us)
            ),
        ));
    }
    if m.randwrite_qd32.iops < LOW_WRITE_QD32_IOPS {
        found.push((
            Level::Warn,
            format!(
                "{:.0} random 4K writes/s at QD32: bursts of writes will queue behind the cache \
                 device",
                m.randwrite_qd32.iops
            ),
        ));
    }
    if m.seqwrite_mb_s < LOW_SEQWRITE_MB_S {
        found.push((
            Level::Warn,
            format!(
                "sequential writes at {:.0} MB/s: the cache's log cannot absorb writes faster",
                m.seqwrite_mb_s
            ),
        ));
    }
    if let Some(dip) = worst_dip(&m.timeline) {
        found.push((
            Level::Warn,
            format!(
                "sustained random writes dipped to {:.0} IOPS in second {} ({:.0}% of the \
                 median {:.0}; {} of {} seconds below {:.0}%): expect stalls under steady write \
                 load",
                dip.iops,
                dip.second + 1,
                dip.iops / dip.median * 100.0,
                dip.median,
                dip.count,
                m.timeline.len(),
                DIP_FRACTION * 100.0
            ),
        ));
    }

    if d.volatile_write_cache() && d.fua == Some(false) {
        notes.push(
            "no FUA: each FUA write the cache issues costs a write and a full flush".to_string(),
        );
    }
    match d.discard_max_bytes {
        Some(0) => notes.push(
            "no discard: the device is never told which segments the cache freed, so its own \
             garbage collection copies dead data"
                .to_string(),
        ),
        Some(n) => notes.push(format!("discard up to {} per request", fmt_bytes(n))),
        None => {}
    }
    if d.name.is_none() {
        notes.push(
            "no block device found under the path (tmpfs, FUSE, NFS?): nothing is known of \
             its write cache"
                .to_string(),
        );
    }

    found.sort_by_key(|f| std::cmp::Reverse(f.0));
    Verdict {
        level: found.first().map_or(Level::Ok, |f| f.0),
        reasons: found.into_iter().map(|f| f.1).collect(),
        notes,
    }
}

/// A reason when a flush of kind `name` costs too much.
fn flush_cost(name: &str, lat: &Latency, found: &mut Vec<(Level, String)>) {
    if lat.samples == 0 || lat.p50_us < WARN_FLUSH_US {
        return;
    }
    let level = if lat.p50_us >= UNFIT_FLUSH_US {
        Level::Unfit
    } else {
        Level::Warn
    };
    found.push((
        level,
        format!(
            "{name} p50 {}: every FLUSH will cost that; expect ≤ {:.0} synchronous commits/s",
            fmt_us(lat.p50_us),
            (1e6 / lat.p50_us).floor()
        ),
    ));
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dip {
    /// 0-based.
    pub second: usize,
    pub iops: f64,
    pub median: f64,
    /// Seconds below the threshold.
    pub count: usize,
}

/// The lowest second of the timeline if it is below [`DIP_FRACTION`] of the median.
pub fn worst_dip(timeline: &[super::measure::Rate]) -> Option<Dip> {
    if timeline.len() < MIN_TIMELINE_SECS {
        return None;
    }
    let iops: Vec<f64> = timeline.iter().map(|r| r.iops).collect();
    let median = median(&iops);
    let threshold = median * DIP_FRACTION;
    let (second, &low) = iops.iter().enumerate().min_by(|a, b| a.1.total_cmp(b.1))?;
    (low < threshold).then(|| Dip {
        second,
        iops: low,
        median,
        count: iops.iter().filter(|&&v| v < threshold).count(),
    })
}

/// The median (the mean of the middle two for an even count); 0 for none.
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::super::measure::Rate;
    use super::*;

    fn lat(p50_us: f64) -> Latency {
        Latency {
            samples: 100,
            p50_us,
            p99_us: p50_us * 2.0,
            max_us: p50_us * 3.0,
        }
    }

    fn rate(iops: f64) -> Rate {
        Rate {
            iops,
            latency: lat(1e6 / iops),
        }
    }

    /// A healthy NVMe drive with power-loss protection.
    fn good() -> Measurements {
        Measurements {
            span: 1 << 30,
            seqwrite_mb_s: 1500.0,
            fsync: lat(300.0),
            fdatasync: lat(150.0),
            dsync: lat(150.0),
            direct_dsync: lat(100.0),
            randread_qd1: rate(12_000.0),
            randread_qd32: rate(300_000.0),
            randwrite_qd1: rate(40_000.0),
            randwrite_qd32: rate(200_000.0),
            timeline: vec![rate(180_000.0); 10],
        }
    }

    fn ssd() -> DeviceFacts {
        DeviceFacts {
            name: Some("nvme0n1".into()),
            model: Some("Fast NVMe".into()),
            rotational: Some(false),
            write_cache: Some("write back".into()),
            fua: Some(true),
            discard_max_bytes: Some(2 << 40),
            ram_backed: false,
        }
    }

    #[test]
    fn a_fast_honest_ssd_is_ok() {
        let v = judge(&good(), &ssd());
        assert_eq!(v.level, Level::Ok, "{v:?}");
        assert!(v.reasons.is_empty());
    }

    #[test]
    fn slow_flushes_warn_then_disqualify_with_the_commit_rate() {
        let mut m = good();
        m.fsync = lat(3500.0);
        let v = judge(&m, &ssd());
        assert_eq!(v.level, Level::Warn);
        assert_eq!(
            v.reasons,
            ["fsync p50 3.50 ms: every FLUSH will cost that; expect ≤ 285 synchronous commits/s"]
        );
        m.fdatasync = lat(25_000.0);
        let v = judge(&m, &ssd());
        assert_eq!(v.level, Level::Unfit);
        assert!(v.reasons[0].starts_with("fdatasync p50 25.00 ms"), "{v:?}");
        assert!(v.reasons[0].contains("≤ 40 synchronous commits/s"), "{v:?}");
    }

    #[test]
    fn a_flush_too_fast_for_a_volatile_cache_is_suspect_unless_ram_or_write_through() {
        let mut m = good();
        m.fdatasync = lat(40.0);
        let v = judge(&m, &ssd());
        assert_eq!(v.level, Level::Warn);
        assert!(v.reasons[0].contains("not reaching stable media"), "{v:?}");
        let through = DeviceFacts {
            write_cache: Some("write through".into()),
            ..ssd()
        };
        assert_eq!(judge(&m, &through).level, Level::Ok);
        let ram = DeviceFacts {
            name: Some("zram0".into()),
            ram_backed: true,
            ..ssd()
        };
        assert_eq!(judge(&m, &ram).level, Level::Ok);
    }

    #[test]
    fn rotational_is_unfit_only_when_the_reads_agree() {
        let disk = DeviceFacts {
            rotational: Some(true),
            ..ssd()
        };
        let mut m = good();
        let v = judge(&m, &disk);
        assert_eq!(v.level, Level::Ok, "a virtual disk's default flag: {v:?}");
        assert!(v.notes.iter().any(|n| n.contains("rotational")));
        m.randread_qd1 = rate(150.0);
        let v = judge(&m, &disk);
        assert_eq!(v.level, Level::Unfit);
        assert!(v.reasons[0].contains("rotational"), "{v:?}");
        assert_eq!(
            v.reasons.len(),
            1,
            "no second reason for the same slow reads: {v:?}"
        );
    }

    #[test]
    fn low_throughput_warns() {
        let mut m = good();
        m.randwrite_qd32 = rate(1200.0);
        m.seqwrite_mb_s = 40.0;
        m.randread_qd1 = rate(500.0);
        let v = judge(&m, &ssd());
        assert_eq!(v.level, Level::Warn);
        assert_eq!(v.reasons.len(), 3, "{v:?}");
    }

    #[test]
    fn dips_in_the_sustained_run_warn_and_an_even_run_does_not() {
        let mut m = good();
        m.timeline = [100.0, 100.0, 20.0, 100.0, 90.0, 25.0]
            .iter()
            .map(|&v| rate(v * 1000.0))
            .collect();
        let v = judge(&m, &ssd());
        assert_eq!(v.level, Level::Warn);
        assert!(
            v.reasons[0].starts_with("sustained random writes dipped to 20000 IOPS in second 3"),
            "{v:?}"
        );
        assert!(v.reasons[0].contains("2 of 6 seconds"), "{v:?}");
        m.timeline = vec![rate(100_000.0), rate(40_000.0), rate(100_000.0)];
        assert_eq!(judge(&m, &ssd()).level, Level::Ok);
        m.timeline = vec![rate(100_000.0), rate(1.0)];
        assert_eq!(judge(&m, &ssd()).level, Level::Ok, "too short to judge");
    }

    #[test]
    fn stalls_in_the_flush_tail_warn() {
        let mut m = good();
        m.fdatasync.p99_us = 80_000.0;
        let v = judge(&m, &ssd());
        assert_eq!(v.level, Level::Warn);
        assert!(v.reasons[0].starts_with("fdatasync p99 80.00 ms"), "{v:?}");
    }

    #[test]
    fn notes_do_not_change_the_level() {
        let d = DeviceFacts {
            fua: Some(false),
            discard_max_bytes: Some(0),
            ..ssd()
        };
        let v = judge(&good(), &d);
        assert_eq!(v.level, Level::Ok);
        assert_eq!(v.notes.len(), 2, "{v:?}");
        let v = judge(&good(), &DeviceFacts::default());
        assert!(v.notes[0].contains("no block device"), "{v:?}");
    }

    #[test]
    fn medians() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
