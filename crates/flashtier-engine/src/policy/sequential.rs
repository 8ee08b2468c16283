//! Sequential stream detection, for the sequential cutoffs (bcache's `sequential_cutoff` with its
//! table of recent I/O, FlashCache's `skip_seq_thresh_kb`).
//!
//! A table of the [`STREAMS`] most recently used streams remembers, for each, where it ends and
//! how many bytes it has run. A request that starts exactly where a stream ends continues it
//! (the stream now ends after the request and has run that much longer); any other request
//! starts a new stream in place of the least recently used one. So up to [`STREAMS`] sequential
//! readers or writers interleaved with each other, and with random I/O, are each recognised: a
//! stream loses its entry only after [`STREAMS`] other streams were used since its last request.
//!
//! NBD requests carry no process identity, so "stream" means contiguous addresses, whoever
//! sends them: several clients reading consecutive blocks in turn make one stream, as they would
//! for bcache.
//!
//! One short mutex around a linear scan of the table: 64 entries are 1.5 KiB, scanned in well
//! under the time of one uncontended lock round trip across cores, and the lock is held for
//! nothing else.

use parking_lot::Mutex;

/// Streams remembered at once.
pub const STREAMS: usize = 64;

#[derive(Debug, Clone, Copy, Default)]
struct Stream {
    /// The byte after its last request.
    end: u64,
    /// Bytes it has run; 0 marks an unused entry (requests have a length).
    run: u64,
    /// The table's clock when it was last used (the LRU order).
    used: u64,
}

/// Recently seen streams of one kind of request (reads or writes).
pub struct StreamDetector {
    table: Mutex<Table>,
}

struct Table {
    streams: [Stream; STREAMS],
    clock: u64,
}

impl Default for StreamDetector {
    fn default() -> Self {
        StreamDetector {
            table: Mutex::new(Table {
                streams: [Stream::default(); STREAMS],
                clock: 0,
            }),
        }
    }
}

impl StreamDetector {
    /// Records a request of `len` bytes at `offset`; returns the bytes its stream has run, this
    /// request included (`len` for a request that starts a stream, 0 for an empty request, which
    /// is not recorded).
    pub fn observe(&self, offset: u64, len: u64) -> u64 {
        if len == 0 {
            return 0;
        }
        let mut t = self.table.lock();
        t.clock += 1;
        let now = t.clock;
        let mut continued: Option<usize> = None;
        let mut lru = 0;
        for (i, s) in t.streams.iter().enumerate() {
            // Two streams can end at the same byte (two readers of the same file); the one used
            // last is the likelier owner of the next request.
            if s.run != 0 && s.end == offset && continued.is_none_or(|c| s.used > t.streams[c].used)
            {
                continued = Some(i);
            }
            if s.used < t.streams[lru].used {
                lru = i;
            }
        }
        let s = match continued {
            Some(i) => {
                let s = &mut t.streams[i];
                s.run = s.run.saturating_add(len);
                s
            }
            None => {
                let s = &mut t.streams[lru];
                s.run = len;
                s
            }
        };
        s.end = offset.saturating_add(len);
        s.used = now;
        s.run
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_stream_grows_by_each_request_that_continues_it() {
        let d = StreamDetector::default();
        assert_eq!(d.observe(1000, 100), 100);
        assert_eq!(d.observe(1100, 50), 150);
        assert_eq!(d.observe(1150, 4096), 4246);
        // A gap, an overlap or a re-read starts a new stream.
        assert_eq!(d.observe(5247, 10), 10);
        assert_eq!(d.observe(5250, 10), 10);
        assert_eq!(d.observe(1150, 10), 10);
        assert_eq!(d.observe(0, 0), 0, "empty requests are not streams");
        // The long stream is still there.
        assert_eq!(d.observe(5246, 1), 4247);
    }

    #[test]
    fn interleaved_sequential_streams_are_each_detected() {
        let d = StreamDetector::default();
        let readers = STREAMS as u64;
        for step in 1..=20u64 {
            for r in 0..readers {
                // Reader r reads 4 KiB at a time from its own 1 GiB area.
                let offset = (r << 30) + (step - 1) * 4096;
                assert_eq!(
                    d.observe(offset, 4096),
                    step * 4096,
                    "reader {r} step {step}"
                );
            }
        }
    }

    #[test]
    fn random_requests_push_out_only_the_least_recently_used_stream() {
        let d = StreamDetector::default();
        d.observe(0, 8192);
        d.observe(1 << 40, 8192);
        // STREAMS - 2 random requests fill the table without displacing either stream.
        for i in 0..STREAMS as u64 - 2 {
            d.observe((i + 7) << 32, 512);
        }
        assert_eq!(d.observe(8192, 8192), 16384);
        // One more new stream displaces the least recently used: the one at 1 << 40.
        d.observe(3 << 50, 512);
        assert_eq!(d.observe((1 << 40) + 8192, 4096), 4096);
        assert_eq!(d.observe(16384, 4096), 20480);
    }

    #[test]
    fn of_two_streams_ending_at_the_same_byte_the_last_used_continues() {
        let d = StreamDetector::default();
        d.observe(0, 4096); // stream A: 0..4096, run 4096
        d.observe(2048, 2048); // stream B: 2048..4096, run 2048
        assert_eq!(d.observe(4096, 4096), 6144, "B, used last");
        assert_eq!(d.observe(4096, 4096), 8192, "then A");
    }

    /// The model: streams in LRU order (front = least recently used), at most `STREAMS`.
    fn model_observe(m: &mut Vec<(u64, u64)>, offset: u64, len: u64) -> u64 {
        if len == 0 {
            return 0;
        }
        let run = match m.iter().rposition(|&(end, _)| end == offset) {
            Some(i) => m.remove(i).1 + len,
            None => {
                if m.len() == STREAMS {
                    m.remove(0);
                }
                len
            }
        };
        m.push((offset + len, run));
        run
    }

    proptest! {
        #[test]
        fn matches_a_model(
            reqs in proptest::collection::vec(
                // A few streams continued often, and random requests among them.
                (0..80u64, 0..3u8, 0..5000u64, 0..3u64),
                1..600,
            )
        ) {
            let d = StreamDetector::default();
            let mut m: Vec<(u64, u64)> = Vec::new();
            // Where each of the 80 candidate streams would continue.
            let mut next: Vec<u64> = (0..80).map(|i| i << 32).collect();
            for (k, kind, len, gap) in reqs {
                let k = k as usize;
                let offset = match kind {
                    0 => next[k] + gap,
                    _ => next[k],
                };
                let got = d.observe(offset, len);
                let want = model_observe(&mut m, offset, len);
                prop_assert_eq!(got, want, "request {}+{}", offset, len);
                next[k] = offset + len;
            }
        }
    }
}
