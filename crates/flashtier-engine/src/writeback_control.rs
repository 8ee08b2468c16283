//! What the engine holds of the background cleaner (`writeback`): its mailbox (wake, stop, the
//! cancel flag of the pass in progress), what it reports for `status`, and the count of client
//! I/O at the backing store that it gives way to. Apart from the cleaner, so that the engine holds
//! these without depending on the thread that takes `&Engine`.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// What the background cleaner is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WritebackState {
    /// Not in write-back mode.
    #[default]
    Off,
    /// Nothing to write back.
    Idle,
    /// Dirty data above the high watermark: draining to the low one at full speed.
    Watermark,
    /// The backing store has been idle for `writeback_idle_delay_ms`: draining while it is.
    BackingIdle,
    /// Blocks older than `writeback_max_age_secs`.
    Age,
    /// The rate controller drains towards its target.
    Controller,
    /// The last pass failed; backing off before the next.
    Retrying,
}

impl WritebackState {
    /// The name `status`, the stats file and metrics show.
    pub fn as_str(self) -> &'static str {
        match self {
            WritebackState::Off => "off",
            WritebackState::Idle => "idle",
            WritebackState::Watermark => "watermark",
            WritebackState::BackingIdle => "backing-idle",
            WritebackState::Age => "age",
            WritebackState::Controller => "controller",
            WritebackState::Retrying => "retrying",
        }
    }
}

impl std::fmt::Display for WritebackState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for WritebackState {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// What the cleaner is doing, for `status`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WritebackStatus {
    /// What the cleaner is doing now.
    pub state: WritebackState,
    /// The controller's current rate (bytes/s; 0 when it is not running).
    pub rate_bytes_per_sec: u64,
    /// The controller's target in blocks.
    pub target_blocks: u64,
}

/// The cleaner's mailbox and report.
#[derive(Default)]
pub(crate) struct WritebackHandle {
    control: Mutex<Control>,
    changed: Condvar,
    /// Set when the cleaner stops: cancels its pass in progress.
    pub(crate) cancel: AtomicBool,
    /// What the cleaner is doing, for `status`.
    pub(crate) status: Mutex<WritebackStatus>,
}

#[derive(Default)]
struct Control {
    wake: bool,
    stop: bool,
}

impl WritebackHandle {
    /// Makes the cleaner plan again now (a parameter changed).
    pub(crate) fn wake(&self) {
        self.control.lock().wake = true;
        self.changed.notify_all();
    }

    /// Stops the cleaner: its pass in progress stops before its next backing write, and it
    /// plans no more.
    pub(crate) fn stop(&self) {
        self.cancel.store(true, Ordering::Release);
        self.control.lock().stop = true;
        self.changed.notify_all();
    }

    pub(crate) fn stopping(&self) -> bool {
        self.control.lock().stop
    }

    /// Waits `d`, or less when woken (if `wakeable`) or stopped; false when stopped.
    pub(crate) fn wait(&self, d: Duration, wakeable: bool) -> bool {
        let deadline = Instant::now() + d;
        let mut ctl = self.control.lock();
        loop {
            if ctl.stop {
                return false;
            }
            if wakeable && ctl.wake {
                ctl.wake = false;
                return true;
            }
            if self.changed.wait_until(&mut ctl, deadline).timed_out() {
                return !ctl.stop;
            }
        }
    }
}

/// Client I/O to the backing store: how much is in flight, and when the last finished.
pub(crate) struct Foreground {
    inflight: AtomicU32,
    /// Milliseconds since `epoch` when the last request started or finished.
    last_ms: AtomicU64,
    epoch: Instant,
}

impl Default for Foreground {
    fn default() -> Foreground {
        Foreground {
            inflight: AtomicU32::new(0),
            last_ms: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

/// Held while a client request is at the backing store.
pub(crate) struct ForegroundIo<'a> {
    f: &'a Foreground,
}

impl Drop for ForegroundIo<'_> {
    fn drop(&mut self) {
        self.f.last_ms.store(self.f.now_ms(), Ordering::Release);
        self.f.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Foreground {
    /// Marks a client request to the backing store in flight until the guard drops.
    pub(crate) fn begin(&self) -> ForegroundIo<'_> {
        self.inflight.fetch_add(1, Ordering::AcqRel);
        self.last_ms.store(self.now_ms(), Ordering::Release);
        ForegroundIo { f: self }
    }

    pub(crate) fn busy(&self) -> bool {
        self.inflight.load(Ordering::Acquire) > 0
    }

    /// Milliseconds since the last client backing I/O (0 while some is in flight).
    pub(crate) fn idle_ms(&self) -> u64 {
        if self.busy() {
            return 0;
        }
        self.now_ms()
            .saturating_sub(self.last_ms.load(Ordering::Acquire))
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}
