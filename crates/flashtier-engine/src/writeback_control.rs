//! What the engine holds of the background cleaner (`writeback`): its mailbox (wake, stop, the
//! cancel flag of the pass in progress) and what it reports for `status`. Apart from the
//! cleaner, so that the engine holds these without depending on the thread that takes `&Engine`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::mailbox::Mailbox;

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
    mailbox: Mailbox,
    /// Set when the cleaner stops: cancels its pass in progress.
    pub(crate) cancel: AtomicBool,
    /// What the cleaner is doing, for `status`.
    pub(crate) status: Mutex<WritebackStatus>,
}

impl WritebackHandle {
    /// Makes the cleaner plan again now (a parameter changed).
    pub(crate) fn wake(&self) {
        self.mailbox.wake();
    }

    /// Stops the cleaner: its pass in progress stops before its next backing write, and it
    /// plans no more.
    pub(crate) fn stop(&self) {
        self.cancel.store(true, Ordering::Release);
        self.mailbox.stop();
    }

    pub(crate) fn stopping(&self) -> bool {
        self.mailbox.stopping()
    }

    /// Waits `d`, or less when woken (if `wakeable`) or stopped; false when stopped.
    pub(crate) fn wait(&self, d: Duration, wakeable: bool) -> bool {
        self.mailbox.wait(d, wakeable)
    }
}
