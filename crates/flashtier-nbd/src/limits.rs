//! What one client may cost the server: memory for requests in flight, threads, and a slot.
//!
//! A client that sends large READs and never reads the replies, or opens hundreds of connections
//! and sits on them, must not take the server's memory or lock other clients out. Three limits:
//! - [`Budget`]: bytes of request payload being read, executed or answered — per connection and
//!   server-wide. A connection that cannot take budget stops reading requests (so a client that
//!   does not read its replies stops being read from) until its replies drain.
//! - [`WorkerPool`]: threads beyond each connection's first, server-wide.
//! - the connection table itself (`max_connections`), whose reclaim policy lives in the server;
//!   [`ConnState`] is what the server knows about each connection to choose whom to reclaim.
//!
//! When a budget or the pool runs dry, the `on_pressure` hook tells the server, which may reclaim
//! a connection that is stalled (not reading its replies) to free what it holds.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

/// How often a thread waiting for budget re-checks whether its connection is closing, and
/// reports pressure again.
const WAIT_TICK: Duration = Duration::from_millis(100);

/// Which limit ran dry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pressure {
    /// The server-wide request memory budget.
    Memory,
    /// The server-wide worker pool.
    Threads,
}

/// Bytes that may be in flight at once; a request larger than the whole budget is admitted
/// alone, so nothing waits forever.
///
/// Freed bytes go to the waiter with the lowest `priority` first; connections pass what they
/// would hold in all once admitted, so the client asking for least goes first: otherwise memory
/// freed by reclaiming a stalled client would go straight to the other stalled clients queued for
/// more 32 MiB READs, and a newcomer's 4 KiB request would wait behind all of them.
///
/// Taking and giving back are lock-free while nobody waits (every request does both); the mutex
/// is only for waiters.
pub struct Budget {
    limit: u64,
    used: AtomicU64,
    /// Threads queued in `waiting`; when zero, `release` need not wake anyone.
    waiters: AtomicUsize,
    /// Waiters by priority (lowest first), with their count.
    waiting: Mutex<BTreeMap<u64, usize>>,
    freed: Condvar,
}

impl Budget {
    pub fn new(limit: u64) -> Budget {
        Budget {
            limit: limit.max(1),
            used: AtomicU64::new(0),
            waiters: AtomicUsize::new(0),
            waiting: Mutex::new(BTreeMap::new()),
            freed: Condvar::new(),
        }
    }

    pub fn unlimited() -> Budget {
        Budget::new(u64::MAX)
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Takes `n` bytes if they fit (or nothing is held).
    fn try_take(&self, n: u64) -> bool {
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| {
                (u == 0 || u.saturating_add(n) <= self.limit).then_some(u + n)
            })
            .is_ok()
    }

    /// Takes `n` bytes, waiting while they do not fit (and others hold some) or a waiter with a
    /// lower `priority` is queued. Gives up (false) once `abort()` holds; calls `waiting()` every
    /// tick spent waiting.
    pub fn acquire(
        &self,
        n: u64,
        priority: u64,
        abort: &dyn Fn() -> bool,
        waiting: &dyn Fn(),
    ) -> bool {
        if n == 0 {
            return true;
        }
        if self.waiters.load(Ordering::SeqCst) == 0 && self.try_take(n) {
            return true;
        }
        let mut queue = self.waiting.lock();
        self.waiters.fetch_add(1, Ordering::SeqCst);
        *queue.entry(priority).or_insert(0) += 1;
        let admitted = loop {
            if queue.range(..priority).next().is_none() && self.try_take(n) {
                break true;
            }
            if abort() {
                break false;
            }
            if self.freed.wait_for(&mut queue, WAIT_TICK).timed_out() {
                parking_lot::MutexGuard::unlocked(&mut queue, waiting);
            }
        };
        if let Some(count) = queue.get_mut(&priority) {
            *count -= 1;
            if *count == 0 {
                queue.remove(&priority);
            }
        }
        self.waiters.fetch_sub(1, Ordering::SeqCst);
        drop(queue);
        // Waiters behind us may go now.
        self.freed.notify_all();
        admitted
    }

    pub fn release(&self, n: u64) {
        if n == 0 {
            return;
        }
        self.used.fetch_sub(n, Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            // Under the lock: a waiter is either before its check (and sees what was freed) or
            // already waiting (and is woken).
            drop(self.waiting.lock());
            self.freed.notify_all();
        }
    }
}

/// Server-wide count of extra worker threads (each connection's first thread is not counted:
/// every connection can always make progress on its own).
pub struct WorkerPool {
    max: usize,
    used: AtomicUsize,
}

impl WorkerPool {
    pub fn new(max: usize) -> WorkerPool {
        WorkerPool {
            max,
            used: AtomicUsize::new(0),
        }
    }

    pub fn in_use(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    pub(crate) fn try_take(&self) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |u| {
                (u < self.max).then_some(u + 1)
            })
            .is_ok()
    }

    pub(crate) fn give_back(&self) {
        self.used.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The server-wide limits every connection shares.
pub struct Limits {
    pub memory: Budget,
    /// Request memory one connection may hold.
    pub memory_per_connection: u64,
    pub workers: WorkerPool,
    on_pressure: Box<dyn Fn(Pressure) + Send + Sync>,
}

impl Limits {
    pub fn new(
        memory: u64,
        memory_per_connection: u64,
        workers: usize,
        on_pressure: Box<dyn Fn(Pressure) + Send + Sync>,
    ) -> Limits {
        Limits {
            memory: Budget::new(memory),
            memory_per_connection,
            workers: WorkerPool::new(workers),
            on_pressure,
        }
    }

    /// No limits (tests and fuzzing).
    pub fn unlimited() -> Limits {
        Limits::new(u64::MAX, u64::MAX, usize::MAX, Box::new(|_| {}))
    }

    pub(crate) fn pressure(&self, p: Pressure) {
        (self.on_pressure)(p)
    }
}

/// Milliseconds on the coarse monotonic clock: a timestamp that fits an atomic and costs a few
/// nanoseconds (every request takes two); its few milliseconds of resolution are plenty for
/// thresholds of seconds.
pub fn now_ms() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec to a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut t) };
    // +1 so that 0 can mean "never".
    t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000 + 1
}

const PHASE_HANDSHAKE: u8 = 0;
const PHASE_TRANSMISSION: u8 = 1;

/// One connection as the server sees it, updated by the connection's threads.
pub struct ConnState {
    /// When the connection was accepted ([`now_ms`]).
    pub accepted_ms: u64,
    phase: AtomicU8,
    requests: AtomicU64,
    /// Requests executed serially (the reader kept the seat: see `transmission`).
    serial: AtomicU64,
    /// Serial requests whose seat a follower took, the request having run past the patience
    /// (`transmission`): a test's way to tell a run the machine starved.
    #[cfg(test)]
    serial_taken: AtomicU64,
    in_flight: AtomicU64,
    last_active_ms: AtomicU64,
    /// When the reply being written started ([`now_ms`]), 0 when none is.
    writing_since_ms: AtomicU64,
    closing: AtomicBool,
    /// This connection's request memory.
    pub memory: Budget,
}

/// A snapshot of [`ConnState`] for the reclaim policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnView {
    pub in_handshake: bool,
    pub accepted_ms: u64,
    pub requests: u64,
    pub in_flight: u64,
    pub last_active_ms: u64,
    pub writing_since_ms: u64,
}

impl ConnState {
    pub fn new(memory_limit: u64) -> ConnState {
        let now = now_ms();
        ConnState {
            accepted_ms: now,
            phase: AtomicU8::new(PHASE_HANDSHAKE),
            requests: AtomicU64::new(0),
            serial: AtomicU64::new(0),
            #[cfg(test)]
            serial_taken: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            last_active_ms: AtomicU64::new(now),
            writing_since_ms: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            memory: Budget::new(memory_limit),
        }
    }

    pub fn view(&self) -> ConnView {
        ConnView {
            in_handshake: self.phase.load(Ordering::Relaxed) == PHASE_HANDSHAKE,
            accepted_ms: self.accepted_ms,
            requests: self.requests.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            last_active_ms: self.last_active_ms.load(Ordering::Relaxed),
            writing_since_ms: self.writing_since_ms.load(Ordering::Relaxed),
        }
    }

    pub fn entered_transmission(&self) {
        self.last_active_ms.store(now_ms(), Ordering::Relaxed);
        self.phase.store(PHASE_TRANSMISSION, Ordering::Relaxed);
    }

    /// Asks every thread of the connection to stop waiting for budget; the server also shuts
    /// the socket down so that threads blocked in I/O return.
    pub fn close(&self) {
        self.closing.store(true, Ordering::Release);
        self.memory.freed.notify_all();
    }

    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Requests read and not yet answered.
    pub(crate) fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Acquire)
    }

    pub(crate) fn request_read(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.last_active_ms.store(now_ms(), Ordering::Relaxed);
    }

    pub(crate) fn executed_serially(&self) {
        self.serial.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests executed serially so far.
    #[cfg(test)]
    pub(crate) fn serial_requests(&self) -> u64 {
        self.serial.load(Ordering::Relaxed)
    }

    /// A follower took the seat from a serial request.
    #[cfg(test)]
    pub(crate) fn serial_seat_taken(&self) {
        self.serial_taken.fetch_add(1, Ordering::Relaxed);
    }

    /// Serial requests whose seat a follower took so far.
    #[cfg(test)]
    pub(crate) fn serial_seats_taken(&self) -> u64 {
        self.serial_taken.load(Ordering::Relaxed)
    }

    pub(crate) fn request_done(&self) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.last_active_ms.store(now_ms(), Ordering::Relaxed);
    }

    pub(crate) fn writing(&self, yes: bool) {
        let v = if yes { now_ms() } else { 0 };
        self.writing_since_ms.store(v, Ordering::Relaxed);
    }
}

/// Why a connection may be reclaimed, in the order the server prefers victims.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reclaim {
    /// Still negotiating after [`Policy::handshake_min`].
    Handshaking,
    /// Finished the handshake but never sent a request, for [`Policy::idle_min`].
    NeverUsed,
    /// Has not taken a reply for [`Policy::stalled_min`]: holds memory and threads.
    Stalled,
    /// No request in flight for [`Policy::idle_long`].
    Idle,
}

/// Thresholds of the reclaim policy: below them a connection is never reclaimed.
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    pub handshake_min: Duration,
    pub idle_min: Duration,
    pub stalled_min: Duration,
    pub idle_long: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            handshake_min: Duration::from_secs(1),
            idle_min: Duration::from_secs(1),
            stalled_min: Duration::from_secs(2),
            idle_long: Duration::from_secs(10),
        }
    }
}

impl Policy {
    /// Whether `c` may be reclaimed at `now` and why; with it, its age in that state (the oldest
    /// goes first within a reason).
    pub fn classify(&self, c: &ConnView, now: u64) -> Option<(Reclaim, u64)> {
        let since = |t: u64| now.saturating_sub(t);
        let ms = |d: Duration| d.as_millis() as u64;
        if c.in_handshake {
            let age = since(c.accepted_ms);
            return (age >= ms(self.handshake_min)).then_some((Reclaim::Handshaking, age));
        }
        if c.writing_since_ms != 0 && since(c.writing_since_ms) >= ms(self.stalled_min) {
            return Some((Reclaim::Stalled, since(c.writing_since_ms)));
        }
        let idle = since(c.last_active_ms);
        if c.in_flight == 0 && c.requests == 0 && idle >= ms(self.idle_min) {
            return Some((Reclaim::NeverUsed, idle));
        }
        if c.in_flight == 0 && idle >= ms(self.idle_long) {
            return Some((Reclaim::Idle, idle));
        }
        None
    }

    /// The connection to reclaim among `conns` for `why` (None: connection slots), if any.
    pub fn victim<K: Copy>(
        &self,
        conns: impl Iterator<Item = (K, ConnView)>,
        now: u64,
        why: Option<Pressure>,
    ) -> Option<(K, Reclaim, u64)> {
        conns
            .filter_map(|(k, c)| self.classify(&c, now).map(|(r, age)| (k, r, age)))
            // Memory and threads are held by stalled connections only: reclaiming an idle one
            // would free nothing.
            .filter(|(_, r, _)| why.is_none() || *r == Reclaim::Stalled)
            .min_by(|a, b| a.1.cmp(&b.1).then(b.2.cmp(&a.2)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn budget_admits_what_fits_and_one_oversized_request_alone() {
        let b = Budget::new(100);
        let never = || false;
        assert!(b.acquire(60, 60, &never, &|| {}));
        assert!(b.acquire(40, 40, &never, &|| {}));
        assert_eq!(b.used(), 100);
        b.release(100);
        // Larger than the whole budget: admitted when nothing else is held.
        assert!(b.acquire(500, 500, &never, &|| {}));
        b.release(500);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn budget_waits_until_released_and_reports_pressure() {
        let b = Arc::new(Budget::new(100));
        assert!(b.acquire(80, 80, &|| false, &|| {}));
        let waits = Arc::new(AtomicUsize::new(0));
        let (b2, w2) = (b.clone(), waits.clone());
        let t = std::thread::spawn(move || {
            b2.acquire(50, 50, &|| false, &|| {
                w2.fetch_add(1, Ordering::Relaxed);
            })
        });
        std::thread::sleep(Duration::from_millis(350));
        assert!(!t.is_finished(), "acquired budget that was not there");
        assert!(waits.load(Ordering::Relaxed) >= 2, "pressure not reported");
        b.release(80);
        assert!(t.join().unwrap());
        assert_eq!(b.used(), 50);
    }

    #[test]
    fn budget_wait_gives_up_when_aborted() {
        let b = Budget::new(10);
        assert!(b.acquire(10, 10, &|| false, &|| {}));
        let abort = AtomicBool::new(false);
        let started = Instant::now();
        let got = b.acquire(5, 5, &|| abort.load(Ordering::Relaxed), &|| {
            abort.store(true, Ordering::Relaxed)
        });
        assert!(!got);
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(b.used(), 10);
    }

    #[test]
    fn freed_budget_goes_to_whoever_would_hold_least() {
        let b = Arc::new(Budget::new(100));
        assert!(b.acquire(100, 100, &|| false, &|| {}));
        // A client already holding 60 queues first, then a newcomer; 40 bytes come free: the
        // newcomer gets them.
        let holder = {
            let b = b.clone();
            std::thread::spawn(move || b.acquire(40, 100, &|| false, &|| {}))
        };
        std::thread::sleep(Duration::from_millis(50));
        let newcomer = {
            let b = b.clone();
            std::thread::spawn(move || b.acquire(40, 40, &|| false, &|| {}))
        };
        std::thread::sleep(Duration::from_millis(50));
        b.release(40);
        assert!(newcomer.join().unwrap());
        std::thread::sleep(Duration::from_millis(150));
        assert!(
            !holder.is_finished(),
            "the holder took memory before the newcomer"
        );
        b.release(40);
        assert!(holder.join().unwrap());
        assert_eq!(b.used(), 100);
    }

    #[test]
    fn freed_budget_goes_to_the_smallest_request_first() {
        let b = Arc::new(Budget::new(100));
        assert!(b.acquire(100, 100, &|| false, &|| {}));
        let big = {
            let b = b.clone();
            std::thread::spawn(move || b.acquire(60, 60, &|| false, &|| {}))
        };
        std::thread::sleep(Duration::from_millis(50));
        let small = {
            let b = b.clone();
            std::thread::spawn(move || b.acquire(10, 10, &|| false, &|| {}))
        };
        std::thread::sleep(Duration::from_millis(50));
        // 10 bytes free: the small request goes though the big one asked first.
        b.release(10);
        assert!(small.join().unwrap());
        std::thread::sleep(Duration::from_millis(150));
        assert!(!big.is_finished());
        b.release(60);
        assert!(big.join().unwrap());
        assert_eq!(b.used(), 100);
    }

    #[test]
    fn worker_pool_is_bounded() {
        let p = WorkerPool::new(2);
        assert!(p.try_take());
        assert!(p.try_take());
        assert!(!p.try_take());
        p.give_back();
        assert!(p.try_take());
        assert_eq!(p.in_use(), 2);
    }

    fn view(in_handshake: bool) -> ConnView {
        ConnView {
            in_handshake,
            accepted_ms: 1,
            requests: 0,
            in_flight: 0,
            last_active_ms: 1,
            writing_since_ms: 0,
        }
    }

    #[test]
    fn reclaim_prefers_handshakes_then_unused_then_stalled_then_idle() {
        let p = Policy::default();
        let now = 60_000;
        let handshake_old = ConnView {
            accepted_ms: 100,
            ..view(true)
        };
        let handshake_young = ConnView {
            accepted_ms: now - 10,
            ..view(true)
        };
        let unused = ConnView {
            last_active_ms: 50_000,
            ..view(false)
        };
        let stalled = ConnView {
            requests: 5,
            in_flight: 3,
            writing_since_ms: 40_000,
            last_active_ms: 59_000,
            ..view(false)
        };
        let idle = ConnView {
            requests: 5,
            last_active_ms: 20_000,
            ..view(false)
        };
        let busy = ConnView {
            requests: 5,
            in_flight: 1,
            last_active_ms: now - 5,
            ..view(false)
        };
        assert_eq!(p.classify(&handshake_young, now), None);
        assert_eq!(p.classify(&busy, now), None);
        let all = [
            (1, idle),
            (2, stalled),
            (3, unused),
            (4, handshake_old),
            (5, handshake_young),
            (6, busy),
        ];
        let pick = |n: usize, why| {
            p.victim(all[..n].iter().copied(), now, why)
                .map(|(k, r, _)| (k, r))
        };
        assert_eq!(pick(6, None), Some((4, Reclaim::Handshaking)));
        assert_eq!(pick(3, None), Some((3, Reclaim::NeverUsed)));
        assert_eq!(pick(2, None), Some((2, Reclaim::Stalled)));
        assert_eq!(pick(1, None), Some((1, Reclaim::Idle)));
        // Memory pressure reclaims only what holds memory.
        assert_eq!(pick(6, Some(Pressure::Memory)), Some((2, Reclaim::Stalled)));
        assert_eq!(pick(1, Some(Pressure::Threads)), None);
        // Within a reason, the oldest goes first.
        let older_idle = ConnView {
            last_active_ms: 10_000,
            ..idle
        };
        assert_eq!(
            p.victim([(1, idle), (2, older_idle)].into_iter(), now, None)
                .map(|v| v.0),
            Some(2)
        );
    }
}
