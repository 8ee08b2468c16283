//! [`Tracer`]: records the export's requests into a trace file while the server runs.
//!
//! Cheap enough to leave on: with no trace running, a request pays one relaxed atomic load. With
//! one running, it takes a short lock to append a 24-byte record to a buffer; a writer thread
//! swaps that buffer for an empty one of the same capacity (the two rotate, so steady recording
//! allocates nothing) and writes it out every 100 ms or whenever a quarter of it is full. A
//! client never waits for the trace file: if the disk falls behind and the buffer is full,
//! records are dropped and counted, and the trace gets a *lost* record where the hole is.
//!
//! The file is created by the server (which may run as root) at a path a control client names,
//! so it is created the way every file the server writes is: `O_CREAT | O_EXCL | O_NOFOLLOW`,
//! mode 0600 set on the open file (a trace shows what a database reads and writes, and when). An
//! existing file is refused, never overwritten; a relative path is refused (the server's working
//! directory means nothing to the client).

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

use super::format::{TraceHeader, TraceOp, TraceRecord, TraceWriter, HEADER_LEN, RECORD_LEN};

/// Records buffered at most before new ones are dropped (24 MiB of them).
const MAX_PENDING: usize = 1 << 20;
/// The writer is woken early once this many are buffered.
const WAKE_AT: usize = MAX_PENDING / 4;
/// How often the writer writes what is buffered when it is not woken early.
const WRITE_EVERY: Duration = Duration::from_millis(100);

/// Why a trace could not start or stop.
#[derive(Debug, thiserror::Error)]
pub enum TraceStartError {
    /// One is running already.
    #[error("a trace is already being recorded to {0}; stop it first (`flashtier trace stop`)")]
    Running(PathBuf),
    /// None is running.
    #[error("no trace is being recorded")]
    NotRunning,
    /// Stopping a trace into one file while the one running goes to another.
    #[error("the trace being recorded goes to {running}, not {asked}; nothing was stopped")]
    OtherFile {
        /// The running trace's file.
        running: PathBuf,
        /// The file named to stop.
        asked: PathBuf,
    },
    /// The path is relative.
    #[error("the trace file's path must be absolute, not {0}")]
    Relative(PathBuf),
    /// The file could not be created (it exists, or the directory is missing or not writable).
    #[error("cannot create the trace file {path}: {err}")]
    Create {
        /// The file.
        path: PathBuf,
        /// What the system said.
        err: io::Error,
    },
    /// Writing the trace failed (when it stops: the error that ended it).
    #[error("writing the trace file {path} failed: {why}")]
    Write {
        /// The file.
        path: PathBuf,
        /// What the system said.
        why: String,
    },
}

/// A trace's state, as `status` and `trace stop` show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceStatus {
    /// The file.
    pub path: PathBuf,
    /// Requests recorded.
    pub requests: u64,
    /// Requests dropped because the file fell behind.
    pub lost: u64,
    /// Bytes of the file once everything buffered is written.
    pub bytes: u64,
    /// Seconds it has been recording (or recorded).
    pub seconds: f64,
    /// Set when writing failed; the trace stopped then.
    pub error: Option<String>,
}

/// What the request path and the writer share.
struct Pending {
    /// Records not yet handed to the writer.
    buf: Vec<TraceRecord>,
    /// Most records `buf` may hold ([`MAX_PENDING`]; less in tests).
    max: usize,
    /// Requests dropped since the last record that made it in.
    dropped: u64,
    requests: u64,
    lost: u64,
    /// Records in the file or on their way (requests and lost-records).
    records: u64,
    started: Instant,
    /// Taking records (false once stopping, or after a write error).
    open: bool,
    stop: bool,
    error: Option<String>,
}

impl Default for Pending {
    /// Taking no records until a trace starts.
    fn default() -> Pending {
        Pending {
            buf: Vec::new(),
            max: MAX_PENDING,
            dropped: 0,
            requests: 0,
            lost: 0,
            records: 0,
            started: Instant::now(),
            open: false,
            stop: false,
            error: None,
        }
    }
}

impl Pending {
    /// Ready for a new trace; the buffer keeps its capacity.
    fn restart(&mut self) {
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        buf.reserve(WAKE_AT);
        *self = Pending {
            buf,
            open: true,
            ..Pending::default()
        };
    }

    fn push(&mut self, r: TraceRecord) {
        self.buf.push(r);
        self.records += 1;
    }

    /// Marks the hole left by dropped requests.
    fn note_dropped(&mut self, t_us: u64) {
        if self.dropped > 0 {
            let len = self.dropped.min(u64::from(u32::MAX)) as u32;
            self.push(TraceRecord {
                t_us,
                op: TraceOp::Lost,
                offset: 0,
                len,
                fua: false,
            });
            self.lost += u64::from(len);
            self.dropped -= u64::from(len);
        }
    }
}

/// The buffer and its wake-up, shared by the request path and the writer thread; one for the
/// tracer's life, reset by each start, so a request takes one lock and never waits for a start
/// or stop in progress.
#[derive(Default)]
struct Shared {
    pending: Mutex<Pending>,
    wake: Condvar,
}

struct Active {
    path: PathBuf,
    writer: JoinHandle<()>,
}

/// Records the requests of one export; see the module documentation.
#[derive(Default)]
pub struct Tracer {
    on: AtomicBool,
    active: Mutex<Option<Active>>,
    shared: Arc<Shared>,
}

impl Tracer {
    /// A tracer recording nothing.
    pub fn new() -> Tracer {
        Tracer::default()
    }

    /// Notes one request as it reaches the export. Never blocks on the file.
    pub fn record(&self, op: TraceOp, offset: u64, len: u64, fua: bool) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let shared = &*self.shared;
        let mut p = shared.pending.lock();
        if !p.open {
            return;
        }
        let t_us = p.started.elapsed().as_micros() as u64;
        // Room for this record and the lost-record before it.
        if p.buf.len() + 2 > p.max {
            p.dropped += 1;
            return;
        }
        p.note_dropped(t_us);
        p.push(TraceRecord {
            t_us,
            op,
            offset,
            // A single request is at most the front end's 32 MiB.
            len: len.min(u64::from(u32::MAX)) as u32,
            fua,
        });
        p.requests += 1;
        if p.buf.len() == p.max / 4 {
            shared.wake.notify_one();
        }
    }

    /// Starts recording to a new file at `path` (absolute; must not exist). `device_size` goes
    /// into the header.
    pub fn start(&self, path: &Path, device_size: u64) -> Result<(), TraceStartError> {
        let mut active = self.active.lock();
        if let Some(a) = active.as_ref() {
            if !a.writer.is_finished() {
                return Err(TraceStartError::Running(a.path.clone()));
            }
        }
        // A trace that failed by itself is reaped here.
        if let Some(old) = active.take() {
            let _ = old.writer.join();
        }
        if !path.is_absolute() {
            return Err(TraceStartError::Relative(path.to_path_buf()));
        }
        let create = |err| TraceStartError::Create {
            path: path.to_path_buf(),
            err,
        };
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(create)?;
        // The mode on the open file: the umask must not widen or narrow it.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(create)?;
        self.start_on(&mut active, path, file, device_size)
    }

    /// Starts recording into `file` (created for `path`), with `active` held and empty.
    fn start_on(
        &self,
        active: &mut Option<Active>,
        path: &Path,
        file: File,
        device_size: u64,
    ) -> Result<(), TraceStartError> {
        let create = |err| TraceStartError::Create {
            path: path.to_path_buf(),
            err,
        };
        let start_unix_us = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        let out = TraceWriter::new(
            BufWriter::with_capacity(1 << 20, file),
            TraceHeader {
                start_unix_us,
                device_size,
            },
        )
        .map_err(create)?;
        // No writer runs now (a failed one was joined), so nobody else touches the buffer but
        // requests, which find it closed until here.
        self.shared.pending.lock().restart();
        let theirs = self.shared.clone();
        let spawned = std::thread::Builder::new()
            .name("trace".into())
            .spawn(move || write_until_stopped(&theirs, out));
        let writer = match spawned {
            Ok(w) => w,
            Err(err) => {
                self.shared.pending.lock().open = false;
                return Err(create(err));
            }
        };
        *active = Some(Active {
            path: path.to_path_buf(),
            writer,
        });
        self.on.store(true, Ordering::Relaxed);
        tracing::info!(path = %path.display(), "trace started");
        Ok(())
    }

    /// Stops recording: everything recorded is written and synced before this returns. With
    /// `only`, stops only a trace into that file (a script stopping its own trace must not end
    /// an operator's).
    pub fn stop(&self, only: Option<&Path>) -> Result<TraceStatus, TraceStartError> {
        let mut active = self.active.lock();
        if let (Some(a), Some(only)) = (active.as_ref(), only) {
            if a.path != only {
                return Err(TraceStartError::OtherFile {
                    running: a.path.clone(),
                    asked: only.to_path_buf(),
                });
            }
        }
        let Some(a) = active.take() else {
            return Err(TraceStartError::NotRunning);
        };
        self.on.store(false, Ordering::Relaxed);
        self.shared.pending.lock().stop = true;
        self.shared.wake.notify_one();
        let _ = a.writer.join();
        let status = status_of(&a.path, &self.shared);
        tracing::info!(path = %a.path.display(), requests = status.requests,
            lost = status.lost, "trace stopped");
        match &status.error {
            Some(why) => Err(TraceStartError::Write {
                path: a.path,
                why: why.clone(),
            }),
            None => Ok(status),
        }
    }

    /// The running trace (one that stopped on a write error, with its error, until it is
    /// stopped or another starts); none otherwise.
    pub fn status(&self) -> Option<TraceStatus> {
        let active = self.active.lock();
        active.as_ref().map(|a| status_of(&a.path, &self.shared))
    }
}

fn status_of(path: &Path, shared: &Shared) -> TraceStatus {
    let p = shared.pending.lock();
    TraceStatus {
        path: path.to_path_buf(),
        requests: p.requests,
        lost: p.lost + p.dropped,
        bytes: (HEADER_LEN + RECORD_LEN * p.records as usize) as u64,
        seconds: p.started.elapsed().as_secs_f64(),
        error: p.error.clone(),
    }
}

/// The writer thread: hands buffers back and forth with the request path and writes them out,
/// until stopped (then syncs) or until a write fails (then stops taking records).
fn write_until_stopped(shared: &Shared, mut out: TraceWriter<BufWriter<File>>) {
    let mut spare: Vec<TraceRecord> = Vec::with_capacity(WAKE_AT);
    loop {
        let stopping = {
            let mut p = shared.pending.lock();
            if !p.stop && p.buf.len() < p.max / 4 {
                shared.wake.wait_for(&mut p, WRITE_EVERY);
            }
            if p.stop {
                // Whatever was dropped since the last record is marked at the end.
                let t_us = p.started.elapsed().as_micros() as u64;
                p.open = false;
                p.note_dropped(t_us);
            }
            std::mem::swap(&mut p.buf, &mut spare);
            p.stop
        };
        let written = spare.iter().try_for_each(|r| out.write(r)).and_then(|()| {
            if stopping {
                flush_and_sync(&mut out)
            } else {
                Ok(())
            }
        });
        spare.clear();
        if let Err(e) = written {
            tracing::error!(error = %e, "writing the trace failed; tracing stopped");
            let mut p = shared.pending.lock();
            p.open = false;
            p.error = Some(e.to_string());
            return;
        }
        if stopping {
            return;
        }
    }
}

/// Writes out what is buffered and makes it durable: a stopped trace is whole on disk.
fn flush_and_sync(out: &mut TraceWriter<BufWriter<File>>) -> io::Result<()> {
    let file = out.get_mut();
    file.flush()?;
    file.get_ref().sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::format::TraceReader;

    fn read(path: &Path) -> Vec<TraceRecord> {
        TraceReader::new(io::BufReader::new(File::open(path).unwrap()))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    #[test]
    fn records_what_it_is_told_between_start_and_stop() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.trace");
        let t = Tracer::new();
        t.record(TraceOp::Read, 0, 4096, false); // before the start: not recorded
        t.start(&path, 1 << 30).unwrap();
        t.record(TraceOp::Write, 8192, 4096, true);
        t.record(TraceOp::Flush, 0, 0, false);
        let live = t.status().unwrap();
        assert_eq!((live.requests, live.lost, live.error), (2, 0, None));
        let done = t.stop(None).unwrap();
        t.record(TraceOp::Read, 0, 4096, false); // after the stop: not recorded
        assert_eq!(done.requests, 2);
        assert_eq!(done.bytes, std::fs::metadata(&path).unwrap().len());
        let got = read(&path);
        let ops: Vec<_> = got.iter().map(|r| (r.op, r.offset, r.len, r.fua)).collect();
        assert_eq!(
            ops,
            [
                (TraceOp::Write, 8192, 4096, true),
                (TraceOp::Flush, 0, 0, false)
            ]
        );
        assert!(got[0].t_us <= got[1].t_us);
        assert!(t.status().is_none());
        assert!(matches!(t.stop(None), Err(TraceStartError::NotRunning)));
    }

    #[test]
    fn an_existing_file_a_symlink_or_a_relative_path_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let t = Tracer::new();
        let existing = dir.path().join("exists");
        std::fs::write(&existing, b"precious").unwrap();
        assert!(matches!(
            t.start(&existing, 0),
            Err(TraceStartError::Create { .. })
        ));
        assert_eq!(std::fs::read(&existing).unwrap(), b"precious");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(dir.path().join("target"), &link).unwrap();
        assert!(matches!(
            t.start(&link, 0),
            Err(TraceStartError::Create { .. })
        ));
        assert!(!dir.path().join("target").exists());
        assert!(matches!(
            t.start(Path::new("rel.trace"), 0),
            Err(TraceStartError::Relative(_))
        ));
        let path = dir.path().join("ok");
        t.start(&path, 0).unwrap();
        assert!(matches!(
            t.stop(Some(&dir.path().join("other"))),
            Err(TraceStartError::OtherFile { .. })
        ));
        assert!(
            t.status().is_some(),
            "stopping another file's trace stopped this one"
        );
        assert!(matches!(
            t.start(&dir.path().join("second"), 0),
            Err(TraceStartError::Running(_))
        ));
        t.stop(Some(&path)).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[test]
    fn many_threads_recording_at_once_lose_nothing_and_keep_time_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.trace");
        let t = Arc::new(Tracer::new());
        t.start(&path, 0).unwrap();
        let threads: Vec<_> = (0..8u64)
            .map(|i| {
                let t = t.clone();
                std::thread::spawn(move || {
                    for n in 0..20_000u64 {
                        t.record(TraceOp::Read, (i << 32) | n, 4096, false);
                    }
                })
            })
            .collect();
        for th in threads {
            th.join().unwrap();
        }
        let done = t.stop(None).unwrap();
        let got = read(&path);
        assert_eq!(done.requests, 160_000);
        assert_eq!(
            done.lost, 0,
            "the buffer holds a million: nothing may drop here"
        );
        assert_eq!(got.len(), 160_000);
        assert!(got.windows(2).all(|w| w[0].t_us <= w[1].t_us));
        // Each thread's requests in the order it made them.
        for i in 0..8u64 {
            let mine: Vec<u64> = got
                .iter()
                .filter(|r| r.offset >> 32 == i)
                .map(|r| r.offset & 0xffff_ffff)
                .collect();
            assert_eq!(mine, (0..20_000).collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_trace_whose_writes_fail_stops_taking_records_says_why_and_makes_way() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ro.trace");
        std::fs::write(&path, b"").unwrap();
        let t = Tracer::new();
        // A file open read-only: every write fails (EBADF), as on a full or failing disk. The
        // header and records sit in the 1 MiB buffer until it fills.
        let read_only = File::open(&path).unwrap();
        t.start_on(&mut t.active.lock(), &path, read_only, 0)
            .unwrap();
        for n in 0..100_000u64 {
            t.record(TraceOp::Read, n * 4096, 4096, false);
        }
        harness_wait(|| t.status().unwrap().error.is_some());
        let failed = t.status().unwrap();
        assert!(failed.error.is_some());
        for n in 0..1_000u64 {
            t.record(TraceOp::Write, n * 4096, 4096, false);
        }
        assert_eq!(
            t.status().unwrap().requests,
            failed.requests,
            "recorded after failing"
        );
        match t.stop(None) {
            Err(TraceStartError::Write { path: p, .. }) => assert_eq!(p, path),
            other => panic!("stopping a failed trace: {other:?}"),
        }
        // A new trace starts as usual.
        let next = dir.path().join("next.trace");
        t.start(&next, 0).unwrap();
        t.record(TraceOp::Flush, 0, 0, false);
        assert_eq!(t.stop(None).unwrap().requests, 1);
    }

    /// Waits up to 10 s for `cond`.
    fn harness_wait(cond: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_full_buffer_drops_records_and_says_where() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.trace");
        let t = Tracer::new();
        t.start(&path, 0).unwrap();
        // A buffer of 16: a burst of 5,000 cannot all fit before the writer (every 100 ms, or
        // at 4 buffered) empties it.
        t.shared.pending.lock().max = 16;
        for n in 0..5_000u64 {
            t.record(TraceOp::Read, n * 4096, 4096, false);
        }
        let done = t.stop(None).unwrap();
        let got = read(&path);
        assert!(done.lost > 0, "nothing was dropped: {done:?}");
        assert_eq!(done.requests + done.lost, 5_000);
        let reads: Vec<u64> = got
            .iter()
            .filter(|r| r.op == TraceOp::Read)
            .map(|r| r.offset / 4096)
            .collect();
        let lost: u64 = got
            .iter()
            .filter(|r| r.op == TraceOp::Lost)
            .map(|r| u64::from(r.len))
            .sum();
        assert_eq!((reads.len() as u64, lost), (done.requests, done.lost));
        // Each hole is marked where it is: the requests before a lost record and after it are
        // exactly `len` apart (plus one).
        let mut expect = 0u64;
        for r in &got {
            match r.op {
                TraceOp::Lost => expect += u64::from(r.len),
                _ => {
                    assert_eq!(r.offset / 4096, expect);
                    expect += 1;
                }
            }
        }
        assert_eq!(expect, 5_000);
        assert_eq!(done.bytes, std::fs::metadata(&path).unwrap().len());
    }
}
