//! A thread's batch of reads, submitted through io_uring in one system call.
//!
//! A thread answering N cache hits with `pread` makes N system calls and sleeps and wakes N
//! times. Here it queues all N on its own ring, submits them with one `io_uring_enter` and sleeps
//! once until the last completes; the device sees them all at once.
//!
//! Each thread has its own ring, opened on its first batch and kept for the thread's life: no
//! locking and no allocation per batch. io_uring may be missing or forbidden (`IORING_OP_READ`
//! needs Linux 5.6; seccomp profiles often refuse `io_uring_setup`), so [`available`] probes once
//! per process and the callers fall back to `pread`. `FLASHTIER_NO_IO_URING=1` (any value but
//! empty or `0`) makes the probe fail, to compare the two paths.
//!
//! Memory safety rests on one rule: [`read_batch`] never returns while the kernel may still
//! write into a buffer of the batch. It waits for every entry the kernel took; entries still
//! queued after a failed submission are thrown away with the ring itself (the kernel only
//! reads the submission queue inside `io_uring_enter`, so a closed ring never runs them).

use std::cell::RefCell;
use std::ffi::OsString;
use std::io;
use std::os::unix::io::RawFd;
use std::sync::OnceLock;

use io_uring::{opcode, types, EnterFlags, IoUring, Probe};

use crate::dev::BatchRead;

/// Reads in flight at once; a larger batch goes in chunks of this many.
pub(crate) const RING_ENTRIES: usize = 32;

const DISABLE_VAR: &str = "FLASHTIER_NO_IO_URING";

/// Whether this process can use io_uring (decided once).
pub(crate) fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| match probe(std::env::var_os(DISABLE_VAR)) {
        Ok(()) => true,
        Err(why) => {
            tracing::info!("io_uring not used ({why}): batched reads fall back to one pread each");
            false
        }
    })
}

/// `disable`: the value of `FLASHTIER_NO_IO_URING`.
fn probe(disable: Option<OsString>) -> Result<(), String> {
    if disable.is_some_and(|v| !v.is_empty() && v != "0") {
        return Err(format!("{DISABLE_VAR} is set"));
    }
    let ring =
        IoUring::new(RING_ENTRIES as u32).map_err(|e| format!("cannot create a ring: {e}"))?;
    let mut probe = Probe::new();
    ring.submitter()
        .register_probe(&mut probe)
        .map_err(|e| format!("cannot list its operations: {e}"))?;
    if !probe.is_supported(opcode::Read::CODE) {
        return Err("the kernel has no IORING_OP_READ".into());
    }
    Ok(())
}

// One per thread, never moved: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Ring {
    Unopened,
    Open(IoUring),
    /// Creating it failed (e.g. RLIMIT_MEMLOCK on old kernels): not retried for every batch.
    Failed,
}

thread_local! {
    static RING: RefCell<Ring> = const { RefCell::new(Ring::Unopened) };
}

/// Serves `reads` through this thread's ring, in chunks of [`RING_ENTRIES`].
///
/// `fd_for` gives each read's descriptor, or `None` to leave it out (having set its `result`).
/// Once its chunk has completed, `finish` gets every read not left out with what happened:
/// `Some(Ok(n))`: its first `n` bytes were read (`n` may be short of its length),
/// `Some(Err(e))`: it failed, `None`: it was not done (interrupted, or never submitted) and should
/// be done synchronously.
///
/// Without io_uring or a ring for this thread, neither is called and the batch is left as it was
/// (a chunk after a ring was lost mid-batch is left too).
pub(crate) fn read_batch(
    reads: &mut [BatchRead<'_>],
    mut fd_for: impl FnMut(&mut BatchRead<'_>) -> Option<RawFd>,
    mut finish: impl FnMut(&mut BatchRead<'_>, Option<io::Result<usize>>),
) {
    if reads.is_empty() || !available() {
        return;
    }
    // try_with: a thread being torn down has no ring any more, and reads synchronously.
    let _ = RING.try_with(|cell| {
        let Ok(mut ring) = cell.try_borrow_mut() else {
            return;
        };
        for chunk in reads.chunks_mut(RING_ENTRIES) {
            if matches!(*ring, Ring::Unopened) {
                *ring = match IoUring::new(RING_ENTRIES as u32) {
                    Ok(r) => Ring::Open(r),
                    Err(e) => {
                        tracing::debug!("cannot create this thread's io_uring: {e}");
                        Ring::Failed
                    }
                };
            }
            let Ring::Open(uring) = &mut *ring else {
                return;
            };
            let intact = read_chunk(uring, chunk, &mut fd_for, &mut finish);
            if !intact {
                *ring = Ring::Unopened;
            }
        }
    });
}

#[derive(Clone, Copy)]
enum Slot {
    /// Left out by `fd_for`.
    Skip,
    /// To be submitted; still so at the end only if it never was.
    Queued,
    Done(i32),
}

/// One chunk: submits it, waits for all of it, then finishes it. Returns false when entries may
/// remain in the submission queue (a failed submission): the caller must then drop the ring.
fn read_chunk(
    ring: &mut IoUring,
    chunk: &mut [BatchRead<'_>],
    fd_for: &mut impl FnMut(&mut BatchRead<'_>) -> Option<RawFd>,
    finish: &mut impl FnMut(&mut BatchRead<'_>, Option<io::Result<usize>>),
) -> bool {
    debug_assert!(chunk.len() <= RING_ENTRIES);
    // All of the caller's code runs before the first entry is queued, so nothing can unwind
    // between queuing and waiting.
    let mut fds = [None; RING_ENTRIES];
    for (fd, read) in fds.iter_mut().zip(chunk.iter_mut()) {
        *fd = fd_for(read);
    }
    let mut slots = [Slot::Skip; RING_ENTRIES];
    let mut unsubmitted = 0;
    {
        let mut sq = ring.submission();
        for (i, read) in chunk.iter_mut().enumerate() {
            let Some(fd) = fds[i] else { continue };
            // A longer buffer is read short, and its caller reads the rest.
            let len = read.buf.len().min(u32::MAX as usize) as u32;
            let sqe = opcode::Read::new(types::Fd(fd), read.buf.as_mut_ptr(), len)
                .offset(read.offset)
                .build()
                .user_data(i as u64);
            // SAFETY: the buffer stays borrowed until this function returns, and it returns only
            // once the kernel has completed every entry it took; entries it did not take are
            // dropped with the ring (see the module doc). The queue is empty at the start of
            // every chunk, so it has room for the whole chunk.
            if unsafe { sq.push(&sqe) }.is_ok() {
                slots[i] = Slot::Queued;
                unsubmitted += 1;
            }
        }
    }

    let mut in_flight = 0;
    let mut submit_failed = false;
    while in_flight + unsubmitted > 0 {
        let waited = if unsubmitted > 0 && !submit_failed {
            // The completion queue is empty here, so this waits for all of them. The kernel
            // returns an error only when it took none of the entries.
            ring.submit_and_wait(in_flight + unsubmitted).map(|n| {
                unsubmitted -= n;
                in_flight += n;
            })
        } else if in_flight > 0 {
            // SAFETY: submits nothing and passes no argument: a plain wait for completions.
            unsafe {
                ring.submitter().enter::<libc::sigset_t>(
                    0,
                    in_flight as u32,
                    EnterFlags::GETEVENTS.bits(),
                    None,
                )
            }
            .map(drop)
        } else {
            break; // a failed submission, and nothing left in flight
        };
        if let Err(e) = waited {
            // EINTR: try again. A failed submission: stop submitting, still wait for what the
            // kernel took, and let the caller read the rest. A failed wait (never seen): waiting
            // again is the only safe thing to do, since returning would release buffers the
            // kernel may still write.
            if e.raw_os_error() != Some(libc::EINTR) && unsubmitted > 0 && !submit_failed {
                tracing::warn!("io_uring submission failed, reading synchronously: {e}");
                submit_failed = true;
            }
        }
        // Every entry taken gives exactly one completion, so counting them cannot hang even if
        // one's index were wrong (its read would then be redone synchronously).
        for cqe in ring.completion() {
            in_flight -= 1;
            if let Some(slot) = slots.get_mut(cqe.user_data() as usize) {
                *slot = Slot::Done(cqe.result());
            }
        }
    }
    debug_assert!(submit_failed || !slots.iter().any(|s| matches!(s, Slot::Queued)));

    for (slot, read) in slots.iter().zip(chunk.iter_mut()) {
        let outcome = match *slot {
            Slot::Skip => continue,
            Slot::Queued => None,
            Slot::Done(res) if res >= 0 => Some(Ok(res as usize)),
            Slot::Done(res) if -res == libc::EINTR || -res == libc::EAGAIN => None,
            Slot::Done(res) => Some(Err(io::Error::from_raw_os_error(-res))),
        };
        finish(read, outcome);
    }
    !submit_failed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environment_variable_disables_io_uring() {
        assert!(probe(Some("1".into())).unwrap_err().contains(DISABLE_VAR));
        assert_eq!(probe(Some("0".into())), probe(None));
        assert_eq!(probe(Some("".into())), probe(None));
    }
}
