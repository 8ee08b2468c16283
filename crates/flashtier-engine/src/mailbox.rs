//! A background thread's mailbox: others wake it (there is work, or a parameter changed) or stop
//! it; the thread waits for either, for a timeout, or for a condition it checks.
//!
//! The reclaim thread and the background cleaner each own one. Flags, not a channel: any number
//! of wake-ups before the thread looks are one wake-up, and a stop is never lost behind them.

use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

#[derive(Default)]
pub(crate) struct Mailbox {
    flags: Mutex<Flags>,
    changed: Condvar,
}

#[derive(Default)]
struct Flags {
    wake: bool,
    stop: bool,
}

impl Mailbox {
    /// Wakes the thread (if it waits wakeably) to look for work now.
    pub(crate) fn wake(&self) {
        self.flags.lock().wake = true;
        self.changed.notify_all();
    }

    /// Tells the thread to stop; every wait returns false from now on.
    pub(crate) fn stop(&self) {
        self.flags.lock().stop = true;
        self.changed.notify_all();
    }

    pub(crate) fn stopping(&self) -> bool {
        self.flags.lock().stop
    }

    /// Waits `d`, or less when woken (if `wakeable`: a backoff is not cut short by wake-ups) or
    /// stopped; false when stopped. Takes the wake-up.
    pub(crate) fn wait(&self, d: Duration, wakeable: bool) -> bool {
        let deadline = Instant::now() + d;
        let mut flags = self.flags.lock();
        loop {
            if flags.stop {
                return false;
            }
            if wakeable && flags.wake {
                flags.wake = false;
                return true;
            }
            if self.changed.wait_until(&mut flags, deadline).timed_out() {
                return !flags.stop;
            }
        }
    }

    /// Waits until woken, stopped, or `ready()` holds (checked at once and every `poll`, under
    /// the mailbox's lock: `ready` must not take a lock that is held while waking this mailbox);
    /// false when stopped. Takes the wake-up.
    pub(crate) fn wait_for_work(&self, poll: Duration, ready: impl Fn() -> bool) -> bool {
        let mut flags = self.flags.lock();
        while !flags.wake && !flags.stop && !ready() {
            self.changed.wait_for(&mut flags, poll);
        }
        flags.wake = false;
        !flags.stop
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_wake_before_the_wait_is_not_lost_and_is_taken_once() {
        let m = Mailbox::default();
        m.wake();
        m.wake();
        assert!(m.wait(Duration::from_secs(5), true));
        let began = Instant::now();
        assert!(m.wait(Duration::from_millis(20), true));
        assert!(
            began.elapsed() >= Duration::from_millis(20),
            "the second wait was woken"
        );
    }

    #[test]
    fn a_backoff_ignores_wake_ups_but_not_a_stop() {
        let m = Arc::new(Mailbox::default());
        m.wake();
        let began = Instant::now();
        assert!(m.wait(Duration::from_millis(20), false));
        assert!(began.elapsed() >= Duration::from_millis(20));
        let stopper = {
            let m = m.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                m.stop();
            })
        };
        assert!(!m.wait(Duration::from_secs(30), false));
        stopper.join().unwrap();
        assert!(m.stopping());
        assert!(!m.wait_for_work(Duration::from_secs(30), || false));
    }

    #[test]
    fn waiting_for_work_returns_when_it_is_ready() {
        let m = Mailbox::default();
        assert!(m.wait_for_work(Duration::from_secs(30), || true));
        let polls = std::sync::atomic::AtomicU32::new(0);
        let ready = || polls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= 2;
        assert!(m.wait_for_work(Duration::from_millis(1), ready));
    }
}
