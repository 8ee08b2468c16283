//! bcache-style windows: what the counters did in the last 5 minutes, hour and day.
//!
//! The counters themselves only ever grow; a [`Sampler`] keeps copies of them, one per second
//! for 5 minutes and one per minute for a day (about 1,700 samples), and a window is the
//! difference between now and the oldest sample inside it. While the server has been up for
//! less than a window, that window is everything since the start (its `secs` says how long it
//! really covers, so rates stay right). `reset-stats` restarts the history, so every window and
//! the total begin at the reset, as bcache's `clear_stats` does.
//!
//! Time is passed in (whole seconds on any monotonic clock), which keeps this testable.

use std::collections::VecDeque;

/// The windows reported, shortest first, with their lengths in seconds.
pub const WINDOWS: [(&str, u64); 3] = [("5min", 300), ("hour", 3600), ("day", 86_400)];

/// The name of the window since the start (or the last reset).
pub const TOTAL: &str = "total";

const SECOND_HISTORY: u64 = 300;
const MINUTE: u64 = 60;
const MINUTE_HISTORY: u64 = 86_400;

/// Counters as `(name, value)` pairs, in a fixed order.
pub type Counters = Vec<(&'static str, u64)>;

#[derive(Debug, Clone)]
struct Sample {
    t: u64,
    values: Vec<u64>,
}

/// One window's counter deltas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowDelta {
    /// The window's name in reports: one of [`WINDOWS`], or [`TOTAL`].
    pub name: &'static str,
    /// Seconds the window really covers (less than its length early on).
    pub secs: u64,
    /// How much each counter grew over the window, in the counters' order.
    pub deltas: Counters,
}

/// Counter history for the windows.
#[derive(Debug)]
pub struct Sampler {
    names: Vec<&'static str>,
    /// The start of the history: the server's start or the last reset.
    origin: Sample,
    seconds: VecDeque<Sample>,
    minutes: VecDeque<Sample>,
}

impl Sampler {
    /// Starts the history at `now` with `counters`.
    pub fn new(now: u64, counters: &[(&'static str, u64)]) -> Sampler {
        let origin = Sample {
            t: now,
            values: counters.iter().map(|c| c.1).collect(),
        };
        Sampler {
            names: counters.iter().map(|c| c.0).collect(),
            seconds: VecDeque::from([origin.clone()]),
            minutes: VecDeque::from([origin.clone()]),
            origin,
        }
    }

    /// Forgets the history: every window starts again at `now` (reset-stats).
    pub fn restart(&mut self, now: u64, counters: &[(&'static str, u64)]) {
        *self = Sampler::new(now, counters);
    }

    /// Keeps a sample (call about once a second; extra calls within a second are ignored).
    ///
    /// Counters that appear (a cache attached to a server that had none) were zero in every
    /// earlier sample: they count from the moment they appear. A sample missing some known
    /// counters (read just before they appeared) is skipped; any other change of names restarts
    /// the history rather than mixing names.
    pub fn record(&mut self, now: u64, counters: &[(&'static str, u64)]) {
        if !self.same_names(counters) {
            let has = |set: &[&str], name: &str| set.contains(&name);
            let new: Vec<&'static str> = counters.iter().map(|c| c.0).collect();
            if self.names.iter().all(|n| has(&new, n)) {
                self.adopt(&new);
            } else if new.iter().all(|n| has(&self.names, n)) {
                return;
            } else {
                tracing::warn!("the set of counters changed; restarting the stats windows");
                self.restart(now, counters);
                return;
            }
        }
        let sample = || Sample {
            t: now,
            values: counters.iter().map(|c| c.1).collect(),
        };
        if self.seconds.back().is_none_or(|s| now > s.t) {
            self.seconds.push_back(sample());
        }
        if self.minutes.back().is_none_or(|s| now >= s.t + MINUTE) {
            self.minutes.push_back(sample());
        }
        trim(&mut self.seconds, now.saturating_sub(SECOND_HISTORY));
        trim(&mut self.minutes, now.saturating_sub(MINUTE_HISTORY));
    }

    /// Counters since the start of the history (the total window).
    pub fn total(&self, counters: &[(&'static str, u64)]) -> Counters {
        self.delta(&self.origin, counters)
    }

    /// The deltas of every window of [`WINDOWS`] and then [`TOTAL`], at `now`.
    pub fn windows(&self, now: u64, counters: &[(&'static str, u64)]) -> Vec<WindowDelta> {
        let mut out: Vec<WindowDelta> = WINDOWS
            .iter()
            .map(|&(name, len)| {
                let ring = if len <= SECOND_HISTORY {
                    &self.seconds
                } else {
                    &self.minutes
                };
                let since = now.saturating_sub(len);
                let start = ring
                    .iter()
                    .find(|s| s.t >= since)
                    .or(ring.back())
                    .unwrap_or(&self.origin);
                WindowDelta {
                    name,
                    secs: now.saturating_sub(start.t),
                    deltas: self.delta(start, counters),
                }
            })
            .collect();
        out.push(WindowDelta {
            name: TOTAL,
            secs: now.saturating_sub(self.origin.t),
            deltas: self.total(counters),
        });
        out
    }

    /// Re-keys every sample to `names` (a superset of the current names), new ones at zero.
    fn adopt(&mut self, names: &[&'static str]) {
        let old = std::mem::replace(&mut self.names, names.to_vec());
        let rekey = |s: &mut Sample| {
            s.values = names
                .iter()
                .map(|n| old.iter().position(|o| o == n).map_or(0, |i| s.values[i]))
                .collect();
        };
        rekey(&mut self.origin);
        self.seconds.iter_mut().for_each(rekey);
        self.minutes.iter_mut().for_each(rekey);
    }

    fn same_names(&self, counters: &[(&'static str, u64)]) -> bool {
        self.names.len() == counters.len()
            && self.names.iter().zip(counters).all(|(a, b)| *a == b.0)
    }

    fn delta(&self, start: &Sample, counters: &[(&'static str, u64)]) -> Counters {
        if !self.same_names(counters) {
            // By name: a counter the history does not know yet counts from zero.
            return counters
                .iter()
                .map(|&(name, v)| {
                    let i = self.names.iter().position(|n| *n == name);
                    (name, v.saturating_sub(i.map_or(0, |i| start.values[i])))
                })
                .collect();
        }
        counters
            .iter()
            .zip(&start.values)
            .map(|(&(name, v), &s)| (name, v.saturating_sub(s)))
            .collect()
    }
}

fn trim(ring: &mut VecDeque<Sample>, keep_from: u64) {
    // Always keep one sample, so a stalled sampler still has a start for every window.
    while ring.len() > 1 && ring[0].t < keep_from {
        ring.pop_front();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(n: u64) -> Counters {
        vec![("reads", n), ("writes", 2 * n)]
    }

    fn window<'a>(w: &'a [WindowDelta], name: &str) -> &'a WindowDelta {
        w.iter().find(|d| d.name == name).unwrap()
    }

    #[test]
    fn early_windows_cover_everything_since_the_start() {
        let s = Sampler::new(100, &c(10));
        let w = s.windows(110, &c(25));
        for name in ["5min", "hour", "day", "total"] {
            assert_eq!(window(&w, name).deltas, vec![("reads", 15), ("writes", 30)]);
            assert_eq!(window(&w, name).secs, 10);
        }
    }

    #[test]
    fn windows_slide_with_one_read_per_second() {
        // One read per second for two days, sampled every second.
        let mut s = Sampler::new(0, &c(0));
        let end = 2 * 86_400;
        for t in 1..=end {
            s.record(t, &c(t));
        }
        let w = s.windows(end, &c(end));
        assert_eq!(window(&w, "5min").deltas[0], ("reads", 300));
        assert_eq!(window(&w, "5min").secs, 300);
        assert_eq!(window(&w, "hour").deltas[0], ("reads", 3600));
        assert_eq!(window(&w, "day").deltas[0], ("reads", 86_400));
        assert_eq!(window(&w, "total").deltas[0], ("reads", end));
        assert_eq!(window(&w, "total").secs, end);
        // Bounded memory: 5 minutes of seconds, a day of minutes.
        assert!(s.seconds.len() <= 301, "{}", s.seconds.len());
        assert!(s.minutes.len() <= 1441, "{}", s.minutes.len());
    }

    #[test]
    fn a_window_reports_the_seconds_it_really_covers() {
        // Samples every 7 s: the 5 min window starts at the first sample inside it.
        let mut s = Sampler::new(0, &c(0));
        for t in (7..=1000).step_by(7) {
            s.record(t, &c(t));
        }
        let w = s.windows(1001, &c(1001));
        let five = window(&w, "5min");
        assert!(five.secs <= 300 && five.secs > 290, "{}", five.secs);
        assert_eq!(five.deltas[0].1, five.secs, "one read per second");
    }

    #[test]
    fn restart_begins_every_window_again() {
        let mut s = Sampler::new(0, &c(0));
        for t in 1..=100 {
            s.record(t, &c(t));
        }
        s.restart(100, &c(100));
        let w = s.windows(105, &c(105));
        for name in ["5min", "hour", "day", "total"] {
            assert_eq!(window(&w, name).deltas[0], ("reads", 5), "{name}");
        }
        assert_eq!(s.total(&c(130)), vec![("reads", 30), ("writes", 60)]);
    }

    #[test]
    fn a_changed_counter_set_restarts_instead_of_mixing_names() {
        let mut s = Sampler::new(0, &c(5));
        let other = vec![("reads", 7), ("trims", 1)];
        s.record(1, &other);
        assert_eq!(s.total(&other), vec![("reads", 0), ("trims", 0)]);
    }

    /// A cache attached to a server that had none: its counters appear and count from zero,
    /// while the others keep their history.
    #[test]
    fn counters_that_appear_count_from_zero() {
        let mut s = Sampler::new(0, &c(5));
        s.record(1, &c(6));
        let more = vec![("hits", 3), ("reads", 8), ("writes", 16)];
        // Reported before the next sample: by name.
        assert_eq!(
            s.total(&more),
            vec![("hits", 3), ("reads", 3), ("writes", 6)]
        );
        s.record(2, &more);
        // A sample read just before they appeared is skipped.
        s.record(3, &c(9));
        let later = vec![("hits", 4), ("reads", 9), ("writes", 18)];
        assert_eq!(
            s.total(&later),
            vec![("hits", 4), ("reads", 4), ("writes", 8)]
        );
        let w = s.windows(4, &later);
        assert_eq!(
            window(&w, "5min").deltas,
            vec![("hits", 4), ("reads", 4), ("writes", 8)]
        );
    }
}
