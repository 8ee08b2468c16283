//! The backing store's health: whether it is failing, and why.
//!
//! Every backing error (a write, flush, trim or read failing) is recorded here with its errno
//! text and when it happened; failed write-back passes are counted in a row. The volume is
//! *degraded* while the last backing error has not been followed by a success that proves the
//! backing store works again: a write-back pass or a direct backing write that succeeds clears
//! it; a successful read clears only a read failure (a store that fails writes often still reads
//! fine, and that must not hide dirty data that cannot be written back). Dirty data is never
//! dropped because of it: reclaim keeps retrying with backoff (see `reclaim`).

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// What failed on the backing store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BackingOp {
    Read,
    Write,
    Flush,
    Trim,
}

impl BackingOp {
    fn name(self) -> &'static str {
        match self {
            BackingOp::Read => "read",
            BackingOp::Write => "write",
            BackingOp::Flush => "flush",
            BackingOp::Trim => "trim",
        }
    }
}

#[derive(Debug, Clone)]
struct Failure {
    op: BackingOp,
    error: String,
    /// The first failure since the backing store last worked.
    since: Instant,
    /// The last one.
    last: Instant,
    /// Write-back passes that failed in a row.
    writeback_failures: u64,
}

#[derive(Default)]
pub(crate) struct BackingHealth {
    failure: Mutex<Option<Failure>>,
    /// `failure.is_some()`, so the I/O paths' successes skip the lock while all is well.
    degraded: AtomicBool,
}

impl BackingHealth {
    /// The backing store failed `op` with `err`.
    pub(crate) fn failed(&self, op: BackingOp, err: &io::Error) {
        let now = Instant::now();
        let mut f = self.failure.lock();
        self.degraded.store(true, Ordering::Release);
        match &mut *f {
            Some(f) => {
                f.op = op;
                f.error = err.to_string();
                f.last = now;
            }
            None => {
                tracing::warn!(op = op.name(), error = %err, "the backing store is failing; degraded");
                *f = Some(Failure {
                    op,
                    error: err.to_string(),
                    since: now,
                    last: now,
                    writeback_failures: 0,
                })
            }
        }
    }

    /// A write-back pass failed on the backing store (after `failed` recorded why).
    pub(crate) fn writeback_failed(&self) {
        if let Some(f) = &mut *self.failure.lock() {
            f.writeback_failures += 1;
        }
    }

    /// A write-back pass or a backing write succeeded: the backing store works again.
    pub(crate) fn write_succeeded(&self) {
        if !self.is_degraded() {
            return;
        }
        let mut f = self.failure.lock();
        if f.is_some() {
            tracing::info!("the backing store accepts writes again; health ok");
            *f = None;
            self.degraded.store(false, Ordering::Release);
        }
    }

    /// A backing read succeeded: clears a read failure only.
    pub(crate) fn read_succeeded(&self) {
        if !self.is_degraded() {
            return;
        }
        let mut f = self.failure.lock();
        if f.as_ref().is_some_and(|f| f.op == BackingOp::Read) {
            *f = None;
            self.degraded.store(false, Ordering::Release);
        }
    }

    pub(crate) fn is_degraded(&self) -> bool {
        self.degraded.load(Ordering::Acquire)
    }

    /// Why the volume is degraded, or `None` while the backing store works.
    pub(crate) fn reason(&self) -> Option<String> {
        let f = self.failure.lock().clone()?;
        let ago = |t: Instant| secs(t.elapsed());
        let mut s = format!(
            "backing store {} failed: {} ({} ago",
            f.op.name(),
            f.error,
            ago(f.last)
        );
        if f.writeback_failures > 0 {
            s += &format!(
                "; {} write-back attempt{} failed in a row, dirty data kept",
                f.writeback_failures,
                if f.writeback_failures == 1 { "" } else { "s" }
            );
        }
        s += &format!("; failing for {})", ago(f.since));
        Some(s)
    }
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn degraded_until_a_write_succeeds() {
        let h = BackingHealth::default();
        assert_eq!(h.reason(), None);
        h.failed(BackingOp::Write, &io::Error::from_raw_os_error(libc::EIO));
        h.writeback_failed();
        h.writeback_failed();
        let r = h.reason().unwrap();
        assert!(r.starts_with("backing store write failed: "), "{r}");
        assert!(r.contains("Input/output error"), "{r}");
        assert!(r.contains("2 write-back attempts failed in a row"), "{r}");
        h.read_succeeded();
        assert!(h.is_degraded(), "a read does not clear a write failure");
        h.write_succeeded();
        assert_eq!(h.reason(), None);
        h.failed(BackingOp::Read, &io::Error::from_raw_os_error(libc::EIO));
        assert!(h.reason().unwrap().starts_with("backing store read failed"));
        h.read_succeeded();
        assert!(!h.is_degraded());
    }
}
