//! [`Timed`]: a `BlockDev` that measures whatever it wraps, as the NBD clients see it.
//!
//! `serve` wraps the exported device (the cache, or the backing store in pass-through), so the
//! latencies are end to end below the protocol: cache hits, misses, FLUSH group commits, all of
//! it, and the pass-through export gets the same figures for comparison. Alongside each
//! operation's histogram it counts the bytes moved and the errors returned, the client-side
//! counters that exist whether or not there is a cache, and it records the blocks that reads
//! and writes touch in the working-set sketch ([`crate::working_set`]).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use flashtier_io::{BatchRead, BatchWrite, BlockDev, DevInfo, Extent, ZeroOpts};

use crate::histogram::{HistSnapshot, Histogram};
use crate::trace::{TraceOp, Tracer};
use crate::working_set::LiveSketch;

/// The operations timed, in report order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Reads, from the cache or the backing store.
    Read,
    /// Writes, FUA or not, single or vectored.
    Write,
    /// Flushes: the durability barrier clients ask for.
    Flush,
    /// Discards (NBD TRIM).
    Trim,
    /// Zeroing a range (NBD WRITE_ZEROES).
    WriteZeroes,
}

impl Op {
    /// Every operation, in report order; `op as usize` indexes it.
    pub const ALL: [Op; 5] = [Op::Read, Op::Write, Op::Flush, Op::Trim, Op::WriteZeroes];

    /// The name in reports, metric labels and counter names (`write_zeroes`, not `WriteZeroes`).
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Trim => "trim",
            Op::WriteZeroes => "write_zeroes",
        }
    }
}

/// Per-operation histogram (nanoseconds), bytes and errors.
#[derive(Default)]
struct OpStats {
    latency_ns: Histogram,
    bytes: AtomicU64,
    errors: AtomicU64,
}

/// The measurements of one [`Timed`] device; shared with the control layer.
#[derive(Default)]
pub struct Latencies {
    ops: [OpStats; 5],
}

impl Latencies {
    fn record(&self, op: Op, start: Instant, bytes: u64, ok: bool) {
        let s = &self.ops[op as usize];
        s.latency_ns.record(start.elapsed().as_nanos() as u64);
        if ok {
            s.bytes.fetch_add(bytes, Ordering::Relaxed);
        } else {
            s.errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The latency histogram of `op` so far.
    pub fn histogram(&self, op: Op) -> HistSnapshot {
        self.ops[op as usize].latency_ns.snapshot()
    }

    /// Client-side counters, monotonic: `client_<op>s` (requests), `client_<op>_bytes` (bytes
    /// moved by the ones that succeeded; not for flush) and `client_errors` (failed requests).
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        const NAMES: [(&str, &str); 5] = [
            ("client_reads", "client_read_bytes"),
            ("client_writes", "client_write_bytes"),
            ("client_flushes", ""),
            ("client_trims", "client_trim_bytes"),
            ("client_write_zeroes", "client_write_zeroes_bytes"),
        ];
        let mut out = Vec::with_capacity(10);
        let mut errors = 0;
        for (op, (count_name, bytes_name)) in Op::ALL.into_iter().zip(NAMES) {
            let s = &self.ops[op as usize];
            out.push((count_name, s.latency_ns.snapshot().count));
            if !bytes_name.is_empty() {
                out.push((bytes_name, s.bytes.load(Ordering::Relaxed)));
            }
            errors += s.errors.load(Ordering::Relaxed);
        }
        out.push(("client_errors", errors));
        out
    }
}

/// Wraps a device and records every request's latency into [`Latencies`], the blocks of every
/// successful read and write into the working-set sketch ([`LiveSketch`]), and the request
/// itself into a trace while one runs ([`Tracer`]).
pub struct Timed {
    inner: Arc<dyn BlockDev>,
    lat: Arc<Latencies>,
    working_set: Arc<LiveSketch>,
    tracer: Arc<Tracer>,
}

impl Timed {
    /// Wraps `inner`, with empty measurements; `serve` wraps the exported device, so the
    /// latencies are those of every request below the NBD protocol.
    pub fn new(inner: Arc<dyn BlockDev>) -> Timed {
        Timed {
            inner,
            lat: Arc::default(),
            working_set: Arc::default(),
            tracer: Arc::default(),
        }
    }

    /// The working-set sketch of the current minute, shared: the controller's ticker freezes
    /// it once a minute ([`crate::working_set::WorkingSet`]).
    pub fn working_set(&self) -> Arc<LiveSketch> {
        self.working_set.clone()
    }

    /// The trace recorder of these requests, shared: the controller starts and stops it.
    pub fn tracer(&self) -> Arc<Tracer> {
        self.tracer.clone()
    }

    /// The measurements, shared: the controller reads them while requests keep adding to them.
    pub fn latencies(&self) -> Arc<Latencies> {
        self.lat.clone()
    }

    fn timed<T>(&self, op: Op, bytes: u64, f: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
        let start = Instant::now();
        let r = f();
        self.lat.record(op, start, bytes, r.is_ok());
        r
    }

    /// One read or write of a batch the device served (started with the batch at `start`):
    /// traced, timed and, if it succeeded, added to the working set, as `accessed` does.
    fn batched(&self, op: Op, start: Instant, offset: u64, len: usize, ok: bool) {
        let (n, trace) = (
            len as u64,
            if op == Op::Read {
                TraceOp::Read
            } else {
                TraceOp::Write
            },
        );
        self.tracer.record(trace, offset, n, false);
        self.lat.record(op, start, n, ok);
        if ok {
            self.working_set.record(offset, n);
        }
    }

    /// [`Self::timed`] for a read or a write of `len` bytes at `offset`: what it touched joins
    /// the working set once it succeeded (a refused request touched nothing a cache could keep).
    fn accessed(
        &self,
        op: Op,
        offset: u64,
        len: u64,
        f: impl FnOnce() -> io::Result<()>,
    ) -> io::Result<()> {
        let r = self.timed(op, len, f);
        if r.is_ok() {
            self.working_set.record(offset, len);
        }
        r
    }
}

impl BlockDev for Timed {
    fn info(&self) -> &DevInfo {
        self.inner.info()
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let n = buf.len() as u64;
        self.tracer.record(TraceOp::Read, offset, n, false);
        self.accessed(Op::Read, offset, n, || self.inner.read_at(buf, offset))
    }

    fn read_batch_max(&self) -> usize {
        self.inner.read_batch_max()
    }

    /// Each read served is traced, timed (the batch's time), and joins the working set, as
    /// through `read_at`; those left are, when the caller reads them with `read_at`.
    fn read_batch(&self, reads: &mut [BatchRead<'_>], leave: &mut dyn FnMut(&[usize])) {
        let start = Instant::now();
        self.inner.read_batch(reads, leave);
        for r in reads.iter() {
            if let Some(result) = &r.result {
                self.batched(Op::Read, start, r.offset, r.buf.len(), result.is_ok());
            }
        }
    }

    fn write_batch_max(&self) -> usize {
        self.inner.write_batch_max()
    }

    /// Each write done is traced, timed (the batch's time), and joins the working set, as
    /// through `write_at`; those left are, when the caller writes them with `write_at`.
    fn write_batch(&self, writes: &mut [BatchWrite<'_>]) {
        let start = Instant::now();
        self.inner.write_batch(writes);
        for w in writes.iter() {
            if let Some(result) = &w.result {
                self.batched(Op::Write, start, w.offset, w.buf.len(), result.is_ok());
            }
        }
    }

    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        self.tracer
            .record(TraceOp::Write, offset, buf.len() as u64, fua);
        self.accessed(Op::Write, offset, buf.len() as u64, || {
            self.inner.write_at(buf, offset, fua)
        })
    }

    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let n = bufs.iter().map(|b| b.len() as u64).sum();
        self.tracer.record(TraceOp::Write, offset, n, false);
        self.accessed(Op::Write, offset, n, || {
            self.inner.write_vectored_at(bufs, offset)
        })
    }

    fn flush(&self) -> io::Result<()> {
        self.tracer.record(TraceOp::Flush, 0, 0, false);
        self.timed(Op::Flush, 0, || self.inner.flush())
    }

    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        self.tracer.record(TraceOp::Trim, offset, len, false);
        self.timed(Op::Trim, len, || self.inner.trim(offset, len))
    }

    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
        self.tracer
            .record(TraceOp::WriteZeroes, offset, len, opts.fua);
        self.timed(Op::WriteZeroes, len, || {
            self.inner.write_zeroes(offset, len, opts)
        })
    }

    fn prefetch(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.prefetch(offset, len)
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
        out: &mut Vec<Extent>,
    ) -> io::Result<()> {
        self.inner.extents(offset, len, max_extents, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashtier_testkit::MemDev;

    #[test]
    fn every_operation_is_counted_with_its_bytes_and_errors() {
        let t = Timed::new(Arc::new(MemDev::new(1 << 20)));
        let mut buf = vec![0u8; 4096];
        t.read_at(&mut buf, 0).unwrap();
        t.write_at(&buf, 4096, false).unwrap();
        t.write_vectored_at(&[&buf, &buf], 8192).unwrap();
        t.flush().unwrap();
        t.trim(0, 8192).unwrap();
        t.write_zeroes(0, 512, ZeroOpts::default()).unwrap();
        assert!(t.read_at(&mut buf, 1 << 20).is_err(), "out of range");
        let lat = t.latencies();
        let c: std::collections::HashMap<_, _> = lat.counters().into_iter().collect();
        assert_eq!(c["client_reads"], 2);
        assert_eq!(c["client_read_bytes"], 4096);
        assert_eq!(c["client_writes"], 2);
        assert_eq!(c["client_write_bytes"], 3 * 4096);
        assert_eq!(c["client_flushes"], 1);
        assert_eq!(c["client_trims"], 1);
        assert_eq!(c["client_trim_bytes"], 8192);
        assert_eq!(c["client_write_zeroes"], 1);
        assert_eq!(c["client_write_zeroes_bytes"], 512);
        assert_eq!(c["client_errors"], 1);
        for op in Op::ALL {
            assert!(lat.histogram(op).count >= 1, "{}", op.name());
        }
    }

    /// Reads and writes that succeed count their blocks in the working set; trims, zeroing,
    /// flushes and failed requests do not.
    #[test]
    fn reads_and_writes_make_the_working_set() {
        let t = Timed::new(Arc::new(MemDev::new(1 << 20)));
        let mut buf = vec![0u8; 8192];
        t.read_at(&mut buf, 0).unwrap(); // blocks 0, 1
        t.write_at(&buf[..100], 4096 + 4000, false).unwrap(); // blocks 1, 2
        t.write_vectored_at(&[&buf[..4096], &buf[..4096]], 16 << 12)
            .unwrap(); // blocks 16, 17
        t.flush().unwrap();
        t.trim(64 << 12, 8 << 12).unwrap();
        t.write_zeroes(128 << 12, 4096, ZeroOpts::default())
            .unwrap();
        assert!(t.read_at(&mut buf, 1 << 20).is_err(), "out of range");
        let mut expected = crate::working_set::Sketch::default();
        for block in [0, 1, 2, 16, 17] {
            expected.insert(block);
        }
        assert_eq!(t.working_set().snapshot(), expected);
        assert_eq!(t.working_set().snapshot().blocks(), 5);
    }
}
