//! The log's handle: what callers append and wait on. One thread, the log writer
//! (`log_writer`), drains the queue into batches on the cache device, unless a caller finds it
//! idle and writes its own op (see [`Lead`]); this module knows nothing of the engine, so the
//! engine can hold the handle without depending on the thread that takes `&Engine`.
//!
//! Callers append records and (usually) wait for them to be written and applied, or wait for a
//! sync: one `fdatasync` of the cache device covering everything appended before it, shared by
//! concurrent syncs (group commit). Two queues: *system* records (from reclaim and the cleaner)
//! go first and may use the last [`RESERVE`] free segments; *client* records (writes,
//! promotions) wait when only the reserve is left, so reclaim can always make progress.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use flashtier_io::{BufPool, PooledBuf};
use parking_lot::{Condvar, Mutex};
use smallvec::SmallVec;

use crate::layout::batch::{self, BlockCrcs, Entry, Kind};
use crate::FormatError;

/// Why the log did not carry out an append, a sync or a checkpoint. Callers match on it (reclaim
/// on [`LogError::ReserveFull`]); errno appears only when it becomes an `io::Error` on its way
/// to a client, so a real ENOSPC from the cache device is never taken for a full reserve.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum LogError {
    /// The cache is closing; nothing more is written.
    #[error("the cache is closing")]
    Shutdown,
    /// Not even the reserve has a free segment for reclaim's own records: reclaim retries once a
    /// checkpoint has freed the segments it emptied.
    #[error("no free segment left for reclaim's records")]
    ReserveFull,
    /// The log failed on a cache device error and refuses work until a retry succeeds.
    #[error(
        "the cache device failed; the cache refuses writes and flushes until it works again \
         (retrying)"
    )]
    Failed,
    /// A cache device error (or a failed reclaim) that failed this operation.
    #[error("{0}")]
    Io(Arc<io::Error>),
}

impl LogError {
    pub(crate) fn io(e: &io::Error) -> LogError {
        LogError::Io(Arc::new(clone_err(e)))
    }
}

impl From<LogError> for io::Error {
    fn from(e: LogError) -> io::Error {
        match e {
            LogError::Shutdown => io::Error::from_raw_os_error(libc::ESHUTDOWN),
            LogError::ReserveFull => io::Error::from_raw_os_error(libc::ENOSPC),
            LogError::Failed => io::Error::other(e),
            LogError::Io(e) => clone_err(&e),
        }
    }
}

/// Free segments kept back for reclaim's own records.
pub const RESERVE: usize = 2;
/// Blocks the head segment keeps free while a FREE record is not vouched for: a record-less
/// batch and the seal (see `log_writer`'s `Writer::seal_head_segment`). A record is at most the
/// segment less this, its header and one block more.
pub const VOUCH_ROOM: u32 = 2;

/// Reclaim runs when free segments drop to this many (of `segment_count`): the reserve, the
/// segment after the head, and a 32nd of the cache, so that reclaim has started well before
/// client records must wait.
pub(crate) fn reclaim_low_water(segment_count: u32) -> usize {
    RESERVE + 1 + segment_count as usize / 32
}

/// What a checkpoint's snapshot saw of the counters that decide when segments may be freed (see
/// [`Log::older_checkpoint_saw`]); zero for the checkpoint recovery loaded.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SnapshotMarks {
    /// Segments sealed (`Segments::seals`).
    pub seals: u64,
    /// CLEANED and LOST records dropped ([`Log::hints_dropped`]).
    pub hints_dropped: u64,
}

/// Where the log writer starts after opening.
pub(crate) struct LogStart {
    pub next_seq: u64,
    pub replayed_blocks: u64,
    pub epoch: u64,
    pub checkpoint_number: u64,
    /// The own half of the log's last header, which the next header carries a copy of.
    pub last_header: Box<[u8; batch::OWN_LEN]>,
    /// Recovery repaired something in memory: a checkpoint makes it durable at once.
    pub checkpoint_now: bool,
    /// This cache's log id (see `layout::batch::log_id`).
    pub log_id: u64,
}

/// A record to append.
pub struct Record {
    pub kind: Kind,
    pub dirty: bool,
    pub lba: u64,
    pub nblocks: u32,
    pub aux: u64,
    /// `nblocks` blocks for WRITE, PROMOTE and MOVE; from [`Log::buffer`], so it goes back to the
    /// log's pool once written.
    pub data: Option<PooledBuf>,
    /// CRC32C of each data block (what reads of the blocks are checked against), and of the
    /// whole record (what recovery checks).
    pub(crate) block_crcs: BlockCrcs,
    pub(crate) crc: u32,
    /// PROMOTE: the guard clock when the backing store was read (see `guards`).
    pub promote_since: Option<u64>,
}

impl Record {
    /// A record; its data (if any) is checksummed here, on the caller's thread, so many
    /// writers share the cost.
    pub fn new(kind: Kind, lba: u64, nblocks: u32, data: Option<PooledBuf>) -> Record {
        let block_crcs = match &data {
            Some(d) => batch::block_crcs(d, d.len() / nblocks.max(1) as usize),
            None => BlockCrcs::new(),
        };
        // One more hardware pass over the data, not `crc32c_combine` of the block CRCs: the
        // combine is done in software and took 19% of the server's CPU under MariaDB with 16 KiB
        // pages (bench/results/oltp_profile.md).
        let crc = match (&data, &block_crcs[..]) {
            (Some(_), [one]) => *one,
            (Some(d), _) => batch::data_crc(d),
            (None, _) => 0,
        };
        Record {
            kind,
            dirty: false,
            lba,
            nblocks,
            aux: 0,
            data,
            block_crcs,
            crc,
            promote_since: None,
        }
    }

    pub fn dirty(mut self, dirty: bool) -> Record {
        self.dirty = dirty;
        self
    }

    pub fn aux(mut self, aux: u64) -> Record {
        self.aux = aux;
        self
    }

    pub(crate) fn entry(&self) -> Entry {
        Entry {
            kind: self.kind,
            dirty: self.dirty,
            lba: self.lba,
            nblocks: self.nblocks,
            aux: self.aux,
            volume: 0,
            data_crc: self.crc,
        }
    }

    pub(crate) fn data_blocks(&self) -> u32 {
        if self.kind.has_data() {
            self.nblocks
        } else {
            0
        }
    }
}

/// Where an appended record landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    /// Sequence number (0: a promotion dropped because a write raced with it).
    pub seq: u64,
    /// Slot of the record's first data block (`None`: a record without data, or dropped).
    pub slot: Option<u32>,
}

pub(crate) const DROPPED: Appended = Appended { seq: 0, slot: None };

/// Where a thread waits for its records and syncs: one per thread, made on its first wait and
/// reused by every later one, so a client write allocates none.
///
/// Each wait takes a new [`Ticket`]; the writer completes the ticket, not the waiter, and a
/// completion for an older ticket (a wait that already ended) is ignored. So a reused waiter
/// never returns a result meant for an earlier wait, whatever the writer does late.
pub struct Waiter {
    slot: Mutex<Slot>,
    ready: Condvar,
}

struct Slot {
    /// The wait in progress (or the last one).
    ticket: u64,
    result: Option<Result<Appended, LogError>>,
}

/// Most records one [`Log::append_group`] appends (and waits for) at once.
pub const MAX_GROUP: usize = 8;

thread_local! {
    static WAITER: Arc<Waiter> = Arc::new(Waiter::new());
    /// A group's waiters after the first (`WAITER`), made on the thread's first group.
    static GROUP: RefCell<Vec<Arc<Waiter>>> = const { RefCell::new(Vec::new()) };
}

impl Waiter {
    fn new() -> Waiter {
        Waiter {
            slot: Mutex::new(Slot {
                ticket: 0,
                result: None,
            }),
            ready: Condvar::new(),
        }
    }

    /// A ticket for a new wait on this thread's waiter (a fresh waiter while the thread is
    /// being torn down).
    pub(crate) fn ticket() -> Ticket {
        let waiter = WAITER
            .try_with(Arc::clone)
            .unwrap_or_else(|_| Arc::new(Waiter::new()));
        Waiter::ticket_on(waiter)
    }

    /// A ticket for the `i`th wait of a group this thread waits for together (`i` <
    /// [`MAX_GROUP`]): each on a waiter of its own, the first the thread's usual one.
    fn ticket_of_group(i: usize) -> Ticket {
        if i == 0 {
            return Waiter::ticket();
        }
        let waiter = GROUP
            .try_with(|group| {
                let mut group = group.borrow_mut();
                while group.len() < i {
                    group.push(Arc::new(Waiter::new()));
                }
                Arc::clone(&group[i - 1])
            })
            .unwrap_or_else(|_| Arc::new(Waiter::new()));
        Waiter::ticket_on(waiter)
    }

    fn ticket_on(waiter: Arc<Waiter>) -> Ticket {
        let mut slot = waiter.slot.lock();
        slot.ticket += 1;
        slot.result = None;
        let ticket = slot.ticket;
        drop(slot);
        Ticket { waiter, ticket }
    }
}

/// One wait on a [`Waiter`]: the caller waits on it, the writer completes it.
#[derive(Clone)]
pub(crate) struct Ticket {
    waiter: Arc<Waiter>,
    ticket: u64,
}

impl Ticket {
    pub(crate) fn complete(&self, result: Result<Appended, LogError>) {
        let mut slot = self.waiter.slot.lock();
        if slot.ticket != self.ticket {
            return;
        }
        slot.result = Some(result);
        drop(slot);
        self.waiter.ready.notify_one();
    }

    /// Whether the writer completed this wait (and nobody took the result yet).
    #[cfg(test)]
    pub(crate) fn is_done(&self) -> bool {
        let slot = self.waiter.slot.lock();
        slot.ticket == self.ticket && slot.result.is_some()
    }

    pub(crate) fn wait(&self) -> Result<Appended, LogError> {
        let mut slot = self.waiter.slot.lock();
        loop {
            if slot.ticket == self.ticket {
                if let Some(result) = slot.result.take() {
                    return result;
                }
            }
            self.waiter.ready.wait(&mut slot);
        }
    }
}

pub(crate) fn complete(w: &Option<Ticket>, result: Result<Appended, LogError>) {
    if let Some(w) = w {
        w.complete(result);
    }
}

pub(crate) enum Op {
    Append(Record, Option<Ticket>),
    /// `true`: vouched (see [`Log::sync_vouched`]).
    Sync(Ticket, bool),
    Checkpoint(Option<Ticket>),
}

#[derive(Default)]
pub(crate) struct Queue {
    pub(crate) client: VecDeque<Op>,
    pub(crate) system: VecDeque<Op>,
    pub(crate) stop: bool,
    /// Reclaim freed space: blocked client records may proceed.
    pub(crate) kicked: bool,
    /// Reclaim failed: blocked client records fail with this rather than wait for space that
    /// may never come (the next ones try again).
    pub(crate) reclaim_failed: Option<LogError>,
    /// The checkpoint thread wrote (or failed to write) the checkpoint in flight.
    pub(crate) checkpoint_written: Option<Result<Written, CheckpointError>>,
    /// A round of the writer's is running, on its thread or a caller's (see [`Lead`]).
    pub(crate) leading: bool,
    /// The writer's thread sleeps until its note is due, and wakes by itself: a caller's round
    /// that leaves it only a note need not wake it, only push the note back (`last_led`).
    pub(crate) noting: bool,
    /// When the last caller's round ended: a note waits for a quiet while after it.
    pub(crate) last_led: Option<Instant>,
}

impl Queue {
    /// Something for the writer's thread: ops, news of reclaim or a checkpoint, or a stop.
    pub(crate) fn has_work(&self) -> bool {
        !self.client.is_empty()
            || !self.system.is_empty()
            || self.stop
            || self.kicked
            || self.reclaim_failed.is_some()
            || self.checkpoint_written.is_some()
    }
}

/// Runs a caller's op on the caller's own thread when the log writer is idle, as the writer's
/// thread would (`log_writer::Rounds`); a narrow handle, so this module needs nothing of the
/// writer.
pub(crate) trait Lead: Send + Sync {
    /// Runs every op of `ops` in one round and returns true; or false, `ops` untouched, when
    /// the writer is busy or has work queued (queue them for its thread then).
    fn lead(&self, system: bool, ops: &mut dyn Iterator<Item = Op>) -> bool;
}

/// Why writing a checkpoint failed (each fails the log, as a failed batch write does).
#[derive(Debug, thiserror::Error)]
pub(crate) enum CheckpointError {
    #[error("checkpoint does not fit its slot ({len} bytes, the slot has {slot})")]
    TooBig { len: u64, slot: u64 },
    #[error("checkpoint encoding failed: {0}")]
    Encode(FormatError),
    #[error("checkpoint write failed: {0}")]
    Write(io::Error),
    #[error("the checkpoint thread panicked")]
    Panicked,
}

impl CheckpointError {
    pub(crate) fn to_io(&self) -> io::Error {
        match self {
            CheckpointError::Write(e) => clone_err(e),
            other => io::Error::other(other.to_string()),
        }
    }
}

/// A checkpoint on the device, not yet synced.
#[derive(Debug)]
pub(crate) struct Written {
    pub(crate) entries: u64,
}

/// Idle bytes each size class of [`Log::buffer`]'s pool keeps (so at most this per class stays
/// allocated after a burst): a thousand 4 KiB writes in flight reuse their buffers.
const POOLED_BYTES_PER_CLASS: usize = 4 << 20;

/// Ops each queue has room for before it grows.
const QUEUED_OPS: usize = 64;

/// The handle callers use; the writer thread owns the rest.
pub struct Log {
    pub(crate) queue: Mutex<Queue>,
    pub(crate) work: Condvar,
    pub(crate) failed: AtomicBool,
    /// Why the log failed, and since when (while `failed`).
    pub(crate) failure: Mutex<Option<(String, Instant)>>,
    /// Sequence number of the last record applied (0: none yet).
    pub applied_seq: AtomicU64,
    /// The seals the older checkpoint recovery may start from had seen at its snapshot, plus
    /// one (0 until a checkpoint after opening is durable): read it with
    /// [`Log::seals_at_older_checkpoint`], set by [`Log::older_checkpoint_saw`].
    reuse_threshold: AtomicU64,
    /// CLEANED and LOST records whose change the state already shows but which are not queued
    /// yet (see [`Log::hint_made`]).
    unqueued_hints: AtomicU64,
    /// CLEANED and LOST records never written (no room, a failed write, a failed log): see
    /// [`Log::hint_dropped`].
    hints_dropped: AtomicU64,
    /// `hints_dropped` at the snapshot of the older checkpoint recovery may start from.
    hints_dropped_at_older: AtomicU64,
    /// Promotion data queued but not yet written, to bound memory.
    pub queued_promotion_bytes: AtomicU64,
    /// Where records' data buffers come from and return to once written.
    buffers: Arc<BufPool>,
    /// Set once the writer runs. Weak: the writer holds the engine, which holds this.
    leader: OnceLock<Weak<dyn Lead>>,
}

impl Log {
    /// How many segments the older of the two newest durable checkpoints (the one recovery may
    /// fall back to) had seen sealed at its snapshot; `None` until a checkpoint since opening is
    /// durable. A segment sealed before it may be freed (see `Segments::reusable`).
    pub(crate) fn seals_at_older_checkpoint(&self) -> Option<u64> {
        self.reuse_threshold.load(Ordering::Acquire).checked_sub(1)
    }

    /// A checkpoint became durable; the one before it, now the older one recovery may start
    /// from, had seen `marks` at its snapshot. Segments sealed before it may be freed, and FREE
    /// records are written again if no CLEANED or LOST record was dropped since.
    pub(crate) fn older_checkpoint_saw(&self, marks: SnapshotMarks) {
        self.reuse_threshold
            .store(marks.seals + 1, Ordering::Release);
        self.hints_dropped_at_older
            .store(marks.hints_dropped, Ordering::Release);
    }

    /// A log handle whose records carry at most `largest_record` bytes of data.
    pub(crate) fn new(largest_record: usize) -> Log {
        Log {
            // Room from the start: callers that lead (see `Lead`) seldom queue, so the queues
            // would otherwise first grow, allocating, on some later client write.
            queue: Mutex::new(Queue {
                client: VecDeque::with_capacity(QUEUED_OPS),
                system: VecDeque::with_capacity(QUEUED_OPS),
                ..Queue::default()
            }),
            work: Condvar::new(),
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            applied_seq: AtomicU64::new(0),
            reuse_threshold: AtomicU64::new(0),
            unqueued_hints: AtomicU64::new(0),
            hints_dropped: AtomicU64::new(0),
            hints_dropped_at_older: AtomicU64::new(0),
            queued_promotion_bytes: AtomicU64::new(0),
            buffers: BufPool::new(largest_record, POOLED_BYTES_PER_CLASS),
            leader: OnceLock::new(),
        }
    }

    /// A buffer for a record's `len` bytes of data, its contents unspecified (the caller fills
    /// it): from the pool, back to the pool when the record has been written.
    pub fn buffer(&self, len: usize) -> PooledBuf {
        self.buffers.take(len)
    }

    pub(crate) fn set_leader(&self, leader: Weak<dyn Lead>) {
        let _ = self.leader.set(leader);
    }

    /// Carries out an awaited op on this thread if the writer is idle, else queues it.
    fn submit(&self, system: bool, op: Op) {
        self.submit_all(system, &mut std::iter::once(op));
    }

    /// Runs `ops` in a round on this thread if the writer is idle, else queues them for it: in
    /// one batch either way when they fit one.
    fn submit_all(&self, system: bool, ops: &mut dyn Iterator<Item = Op>) {
        if let Some(leader) = self.leader.get().and_then(Weak::upgrade) {
            if leader.lead(system, ops) {
                return;
            }
        }
        self.push_all(system, ops);
    }

    pub(crate) fn push(&self, system: bool, op: Op) {
        self.push_all(system, &mut std::iter::once(op));
    }

    fn push_all(&self, system: bool, ops: &mut dyn Iterator<Item = Op>) {
        let mut q = self.queue.lock();
        if q.stop {
            drop(q);
            for op in ops {
                match op {
                    Op::Append(_, w) | Op::Checkpoint(w) => complete(&w, Err(LogError::Shutdown)),
                    Op::Sync(w, _) => w.complete(Err(LogError::Shutdown)),
                }
            }
            return;
        }
        let queue = if system { &mut q.system } else { &mut q.client };
        queue.extend(ops);
        drop(q);
        self.work.notify_one();
    }

    pub(crate) fn check_failed(&self) -> Result<(), LogError> {
        if self.failed.load(Ordering::Acquire) {
            return Err(LogError::Failed);
        }
        Ok(())
    }

    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Why the log failed and how long ago, while it is failed.
    pub fn failure(&self) -> Option<String> {
        if !self.failed() {
            return None;
        }
        let f = self.failure.lock().clone()?;
        Some(format!(
            "{} ({:.1} s ago; retrying, writes resume once the device works again)",
            f.0,
            f.1.elapsed().as_secs_f64()
        ))
    }

    /// Appends a record and waits until it is written and applied.
    pub fn append(&self, rec: Record, system: bool) -> Result<Appended, LogError> {
        self.check_failed()?;
        let w = Waiter::ticket();
        self.submit(system, Op::Append(rec, Some(w.clone())));
        w.wait()
    }

    /// Appends client records together (in one batch when they fit one; see
    /// [`MAX_GROUP`]) and waits until all are written and applied: each one's result, in order.
    pub fn append_group(
        &self,
        recs: impl ExactSizeIterator<Item = Record>,
        results: &mut impl Extend<Result<Appended, LogError>>,
    ) {
        let n = recs.len();
        assert!(
            n <= MAX_GROUP,
            "a group of {n} records (at most {MAX_GROUP})"
        );
        if let Err(e) = self.check_failed() {
            results.extend((0..n).map(|_| Err(e.clone())));
            return;
        }
        let tickets: SmallVec<[Ticket; MAX_GROUP]> = (0..n).map(Waiter::ticket_of_group).collect();
        // Made before the queue or the writer is held: `recs` may copy data.
        let ops: SmallVec<[Op; MAX_GROUP]> = recs
            .zip(&tickets)
            .map(|(rec, w)| Op::Append(rec, Some(w.clone())))
            .collect();
        self.submit_all(false, &mut ops.into_iter());
        results.extend(tickets.iter().map(Ticket::wait));
    }

    /// Appends a record without waiting for it.
    pub fn append_async(&self, rec: Record, system: bool) {
        if self.failed() {
            if matches!(rec.kind, Kind::Cleaned | Kind::Lost) {
                self.hint_dropped();
            }
            return;
        }
        self.push(system, Op::Append(rec, None));
    }

    /// A CLEANED or LOST record is about to be queued for a change just made to the state: call
    /// under the state's write lock, with the change, and [`Log::hint_queued`] once the record is
    /// queued (or dropped with a failed log). Those records are queued after the lock is
    /// released, so reclaim could otherwise evict the block (clean now, or gone), free its
    /// segment and have the log reuse it before the record is queued: replayed, the FREE record
    /// would find the block still dirty there and lose it, and applied after the reuse, the
    /// record (conditional on the slot) would clean or lose a newer write of the same block in
    /// the same slot. Reclaim waits for [`Log::hints_queued`] before it frees segments.
    pub(crate) fn hint_made(&self) {
        self.unqueued_hints.fetch_add(1, Ordering::AcqRel);
    }

    /// The record announced by [`Log::hint_made`] is queued.
    pub(crate) fn hint_queued(&self) {
        self.unqueued_hints.fetch_sub(1, Ordering::AcqRel);
    }

    /// A CLEANED or LOST record will never be written, though the state shows its change (a
    /// block clean, or lost). A checkpoint records that change; replay of the log alone would
    /// not, and a FREE record replayed after it would find the block dirty in the segment it
    /// frees and lose it (found by the integrity tests: CLEANED records refused for lack of room,
    /// then blocks lost after a crash). So no FREE record is written until both checkpoints
    /// recovery may start from were snapshotted after the last such loss.
    pub(crate) fn hint_dropped(&self) {
        self.hints_dropped.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn hints_dropped(&self) -> u64 {
        self.hints_dropped.load(Ordering::Acquire)
    }

    /// Whether a FREE record may be written now (see [`Log::hint_dropped`]).
    pub(crate) fn frees_allowed(&self) -> bool {
        self.hints_dropped() == self.hints_dropped_at_older.load(Ordering::Acquire)
    }

    /// Whether every record announced by [`Log::hint_made`] is queued.
    pub(crate) fn hints_queued(&self) -> bool {
        self.unqueued_hints.load(Ordering::Acquire) == 0
    }

    /// Waits until everything appended before this call is durable on the cache device.
    pub fn sync(&self, system: bool) -> Result<(), LogError> {
        self.sync_op(system, false)
    }

    /// [`Log::sync`], and headers on the device vouch for it (two empty batches, synced too): for a
    /// sync that something outside the log then relies on (a write to the backing store).
    /// Without it, damage to the last synced batch before a crash would look like a torn tail
    /// and recovery would end the log before it, while the backing store already holds what
    /// followed it: a write seen in part, or an INVALIDATE undone over newer backing data.
    pub fn sync_vouched(&self, system: bool) -> Result<(), LogError> {
        self.sync_op(system, true)
    }

    pub(crate) fn sync_op(&self, system: bool, vouch: bool) -> Result<(), LogError> {
        self.check_failed()?;
        let w = Waiter::ticket();
        self.submit(system, Op::Sync(w.clone(), vouch));
        w.wait().map(drop)
    }

    /// Writes a checkpoint (after making the log durable) and waits for it.
    pub fn checkpoint(&self) -> Result<(), LogError> {
        self.check_failed()?;
        let w = Waiter::ticket();
        self.push(true, Op::Checkpoint(Some(w.clone())));
        w.wait().map(drop)
    }

    pub fn request_checkpoint(&self) {
        self.push(true, Op::Checkpoint(None));
    }

    /// Tells the writer that free segments may have appeared.
    pub fn kick(&self) {
        self.queue.lock().kicked = true;
        self.work.notify_one();
    }

    /// Reclaim could not free space: fails the client records waiting for it.
    pub fn reclaim_failed(&self, err: &io::Error) {
        self.queue.lock().reclaim_failed = Some(LogError::io(err));
        self.work.notify_one();
    }

    /// Asks the writer to finish what is queued and exit.
    pub fn stop(&self) {
        self.queue.lock().stop = true;
        self.work.notify_one();
    }
}

pub(crate) fn clone_err(e: &io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(code) => io::Error::from_raw_os_error(code),
        None => io::Error::new(e.kind(), e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Appended = Appended {
        seq: 1,
        slot: Some(7),
    };
    const B: Appended = Appended { seq: 2, slot: None };
    const C: Appended = Appended {
        seq: 3,
        slot: Some(9),
    };

    #[test]
    fn a_thread_reuses_its_waiter_and_a_late_completion_of_an_old_wait_is_ignored() {
        let first = Waiter::ticket();
        first.complete(Ok(A));
        assert_eq!(first.wait().unwrap(), A);

        let second = Waiter::ticket();
        assert!(
            Arc::ptr_eq(&first.waiter, &second.waiter),
            "one waiter per thread"
        );
        // The writer completing the first wait again (late, or twice) must not end the second.
        first.complete(Ok(B));
        let writer = {
            let second = second.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(20));
                second.complete(Ok(C));
            })
        };
        assert_eq!(second.wait().unwrap(), C);
        writer.join().unwrap();
    }

    #[test]
    fn threads_have_their_own_waiters() {
        let mine = Waiter::ticket();
        let theirs = std::thread::spawn(Waiter::ticket).join().unwrap();
        assert!(!Arc::ptr_eq(&mine.waiter, &theirs.waiter));
    }
}
