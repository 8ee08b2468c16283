//! The log writer: one thread turns appended records (see `log`, the handle callers use) into
//! batches on the cache device. A caller that finds the writer idle runs the round itself, on
//! its own thread (see [`Rounds`]); rounds never overlap, so what follows holds for both.
//!
//! Callers append records and (usually) wait; the writer takes everything queued, packs it into
//! batches (one header block plus the records' data, written with one vectored write), applies
//! each batch to the index once it is written, and wakes the waiters. A `sync` waits for one
//! `fdatasync` of the cache device that covers every batch written before it; concurrent syncs
//! share it (group commit).
//!
//! Two queues: *system* records (from reclaim and the cleaner) go first and may use the last
//! [`RESERVE`] free segments; *client* records (writes, promotions) wait when only the reserve is
//! left, so reclaim can always make progress. Checkpoints are taken here, between batches, so
//! their snapshot of the index corresponds to an exact position in the log; the snapshot is
//! copy-on-write (`cow`), and a checkpoint thread encodes and writes it while this thread goes on
//! appending. This thread syncs it afterwards (every sync stays here: a failed sync is seen by the
//! one thread that knows what it may have lost), counts it and raises the threshold below which
//! reclaim may free segments (see `segments`). One checkpoint is in flight at a time; one asked
//! for meanwhile follows it.
//!
//! Reclaim frees segments with FREE records (see `segments`), which this thread applies like any
//! other: the segment joins the free list. Before it opens a segment freed by a FREE record that
//! no synced header vouches for, it syncs, vouches for the record with two headers and syncs
//! again (the record, and the MOVE records before it, must be durable, and recovery sure to
//! replay them, before the segment is overwritten: see [`Writer::seal_head_segment`]), and it
//! waits for the segment's reads in flight. The last free
//! segment is kept for FREE records (and the CLEANED and LOST records that must come before
//! them: see `Log::hint_dropped`), batches of a header and no data: another system batch that
//! would have to open it is refused (reclaim's moves then fail as if the reserve were full), so
//! reclaim can always free what it emptied. When a failed write took even that segment, the next
//! checkpoint frees instead (see [`Writer::begin_checkpoint`]).
//!
//! Errors: a failed batch write fails its waiters and seals the segment over the failed batch, so
//! recovery never stops in front of later, successful batches; if even that fails, or a sync
//! fails, the log enters a failed state and refuses further appends and syncs (a failed
//! `fdatasync` may have lost data, so pretending otherwise would break the durability contract).
//!
//! A failed log recovers without a restart once the device works again (space freed, a path back):
//! the writer retries with backoff. A retry syncs the device, writes the seal it owes (if any),
//! reads back every block written since the last good sync and checks it (the failed sync may
//! have lost some: clean ones are dropped, dirty ones marked lost, never served from a copy that
//! is not there), and writes a checkpoint, which makes the in-memory index durable and puts the
//! doubtful stretch of log behind it. Only then are appends and syncs accepted again.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flashtier_io::{AlignedBuf, BlockDev};
use parking_lot::{Mutex, MutexGuard, RwLock};
use smallvec::SmallVec;

use crate::guards::Guards;
use crate::layout::batch::{self, BatchHeader, Entry, HeaderKind, Kind, OWN_LEN};
use crate::layout::checkpoint::{CheckpointEntry, Frame, LogHead};
use crate::layout::Geometry;
use crate::log::{
    complete, reclaim_low_water, Appended, CheckpointError, Lead, Log, LogError, LogStart, Op,
    Queue, Record, SnapshotMarks, Ticket, Written, DROPPED, RESERVE, VOUCH_ROOM,
};
use crate::mailbox::Mailbox;
use crate::segments::Head;
use crate::state::{Snapshot, State};
use crate::stats::Stats;

/// Most data blocks in one batch (2 MiB at 4 KiB blocks).
const MAX_BATCH_BLOCKS: u32 = 512;
/// Room the writer's queues and scratch vectors start with.
const SCRATCH: usize = 64;
/// The checkpoint thread's nice value: below the clients' threads, so that encoding an image
/// takes idle CPU first, but still scheduled when every CPU is busy.
const CHECKPOINT_NICE: i32 = 10;

/// The largest single write of a checkpoint image (a multiple of every block size).
const CHECKPOINT_WRITE_SLICE: usize = 1 << 20;

/// A checkpoint is written at least this often while the log moves, bounding replay time.
const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(30);
/// When only records nobody waits for are queued (promotions, reclaim bookkeeping), the writer
/// waits this long for more to fill the batch: a 4 KiB promotion alone would cost a 4 KiB header
/// too, halving the cache's capacity (measured: 4082 batches for 4096 promotions, and a working
/// set of half the cache evicted before it could be read twice). 2 ms still gave only 2.3
/// promotions per batch behind a slow disk; the price of 20 ms is that a block read again within
/// 20 ms of its miss misses again.
const LINGER: Duration = Duration::from_millis(20);
/// ... but no longer than it takes to gather this many data blocks.
const LINGER_BLOCKS: u32 = 64;
/// After a sync, the writer waits this long for more work before it writes a note (see
/// `Writer::write_note`): under load the next batch carries the news anyway.
const NOTE_DELAY: Duration = Duration::from_millis(10);
/// Record-less batches written after a sync the backing store relies on (see
/// `Writer::write_vouch`): each vouches for it, so damage must hit every one of them, and the
/// synced batch too, before that sync can pass for a torn tail.
const VOUCHING_HEADERS: u32 = 2;
/// A failed log retries after this long, doubling up to `MAX_RETRY`.
const FIRST_RETRY: Duration = Duration::from_millis(100);
const MAX_RETRY: Duration = Duration::from_secs(5);

/// What the checkpoint thread encodes and writes: a snapshot taken by the log writer at an exact
/// log position (every record before `next_seq` applied and synced, none after).
struct Job {
    number: u64,
    next_seq: u64,
    epoch: u64,
    snap: Snapshot,
}

/// What the log writer keeps of the checkpoint in flight, to finish it once it is written.
struct InFlight {
    number: u64,
    next_seq: u64,
    /// What the snapshot saw (see `Segments::reusable` and `Log::hint_dropped`).
    marks: SnapshotMarks,
    /// Quarantined segments the checkpoint frees once durable: only when the log had no room
    /// left even for a FREE record (see [`Writer::begin_checkpoint`]).
    release: Vec<u32>,
    /// `Writer::blocks_since_checkpoint` at the snapshot.
    blocks_at_snapshot: u64,
    waiters: Vec<Ticket>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// Checks one block of `lba` read back from slot `slot` against `crc`, and handles one that fails
/// (`integrity::check_block`).
pub(crate) type CheckBlock = Arc<dyn Fn(u64, u32, u32, &mut [u8]) + Send + Sync>;

/// What the log writer works with, handed in by `Cache::open` (the composition root): the cache
/// device and its geometry, the index and segments it applies batches to, the log it drains, the
/// counters, the promotion guards it stamps, and the reclaim thread's mailbox it wakes. The
/// engine holds the same handles; the writer needs nothing else of it.
#[derive(Clone)]
pub(crate) struct WriterParts {
    pub(crate) cache: Arc<dyn BlockDev>,
    pub(crate) geo: Geometry,
    pub(crate) state: Arc<RwLock<State>>,
    pub(crate) log: Arc<Log>,
    pub(crate) stats: Arc<Stats>,
    pub(crate) guards: Arc<Guards>,
    pub(crate) reclaim: Arc<Mailbox>,
    /// The engine's start, the origin of LRU ages.
    pub(crate) started: Instant,
    /// What a block read back after a failed sync is checked with: handed in, so that the log
    /// writer depends neither on the engine nor on the module that appends LOST records.
    pub(crate) check_block: CheckBlock,
}

impl WriterParts {
    /// Seconds since the engine started, for LRU ages.
    fn now_secs(&self) -> u32 {
        self.started.elapsed().as_secs() as u32
    }
}

pub struct Writer {
    e: WriterParts,
    next_seq: u64,
    epoch: u64,
    checkpoint_number: u64,
    header: AlignedBuf,
    client_pending: VecDeque<Op>,
    client_blocked: bool,
    /// The system ops of the round being processed. It swaps with the queue's (empty) system
    /// queue each round, so the two buffers rotate instead of being allocated per round; the
    /// same holds for the scratch vectors below, kept empty between uses.
    system_ops: VecDeque<Op>,
    batch_recs: Vec<(Record, Option<Ticket>)>,
    entries: Vec<Entry>,
    wants_sync: Vec<WantsSync>,
    wants_checkpoint: Vec<Option<Ticket>>,
    /// Every record numbered below this was synced to the cache device.
    durable: u64,
    /// The `durable` the last header written carried: a note is due while this lags.
    durable_told: u64,
    /// The `durable` the last batch or seal header written carried. Unlike `durable_told`, notes
    /// do not count: the next batch overwrites a note, and a crash tearing that batch takes the
    /// note with it, so a vouched sync must not count on one (see the run loop).
    durable_in_batch: u64,
    /// The own half of the last batch or seal header written (zeroes: none), which the next
    /// header carries a copy of.
    prev_own: Box<[u8; OWN_LEN]>,
    /// This cache's log id, in every header.
    log_id: u64,
    /// Data slots written since the last good sync, as `(first slot, count)` (a stretch may span
    /// the headers between batches; see `note_unsynced`): after a failed sync, these are what
    /// must be read back and checked before the log goes on.
    unsynced: Vec<(u32, u32)>,
    /// A seal the log owes: a failed batch lies at this head, and sealing over it failed too.
    owed_seal: Option<Head>,
    /// How long to wait before the next retry while failed.
    retry: Duration,
    last_checkpoint: Instant,
    checkpointed_seq: u64,
    /// What the newest durable checkpoint's snapshot saw (zero for the one recovery loaded):
    /// once a newer one is durable, it is the older one's (see `Log::older_checkpoint_saw`).
    newest_checkpoint: SnapshotMarks,
    /// Segments freed by FREE records that no synced header vouches for yet, with the sequence
    /// number after each record's batch: opening one of them waits for that (see
    /// [`Writer::seal_head_segment`]). Kept empty between uses, like the scratch vectors above.
    unvouched_frees: Vec<(u32, u64)>,
    /// The highest `durable` a header known to be on the device carries (as of the last sync).
    vouched: u64,
    /// Log blocks written since the last checkpoint: replay reads at most this much.
    blocks_since_checkpoint: u64,
    /// The checkpoint being written in the background, if any: one at a time, so slots
    /// alternate.
    inflight: Option<InFlight>,
    /// A checkpoint was asked for (by `Log::checkpoint`, `request_checkpoint` or because one is
    /// due) that has not started yet: asked while one was in flight, whose snapshot is older than
    /// the request.
    checkpoint_wanted: bool,
    /// Who waits for that checkpoint.
    checkpoint_waiters: Vec<Ticket>,
}

/// A sync asked for in the round being run.
struct WantsSync {
    ticket: Ticket,
    /// See [`Log::sync_vouched`].
    vouch: bool,
}

/// A client batch found only the reserve left (see [`Writer::write_batch`]).
struct Blocked;

/// Why a batch could not be placed.
enum NoSpace {
    /// Only the reserve is left: client records wait for reclaim.
    Blocked,
    Failed(io::Error),
}

struct Batch {
    recs: Vec<(Record, Option<Ticket>)>,
    data_blocks: u32,
    /// For a batch of no records (see `BatchHeader::ordinal`).
    ordinal: u32,
}

impl Batch {
    fn new() -> Batch {
        Batch {
            recs: Vec::new(),
            data_blocks: 0,
            ordinal: 0,
        }
    }

    /// Empties a written batch: its records (and their buffers) are dropped, the vector kept.
    fn clear(&mut self) {
        self.recs.clear();
        self.data_blocks = 0;
        self.ordinal = 0;
    }

    /// Whether `rec` may join the batch. An empty batch takes any record (the engine makes none
    /// larger than a batch): written empty, it would be a header of no records.
    fn fits(&self, rec: &Record, max_blocks: u32) -> bool {
        self.recs.is_empty()
            || self.recs.len() < batch::MAX_ENTRIES
                && self.data_blocks + rec.data_blocks() <= max_blocks
    }
}

/// The writer's state and who may run a round with it: the log-writer thread, or a caller that
/// finds the writer idle and nothing queued (leader/follower, as in group-commit databases).
/// A caller that leads writes its own record or syncs the device on its own thread, sparing the
/// two thread switches of handing its op to the writer and being woken by it, a large part of a
/// QD1 commit's time (bench/results/qd1_leader/: +29 to +33% commits/s). Under load the queue is
/// seldom empty, so the thread batches as before.
///
/// `Queue::leading` says a round is running; only its runner holds `writer`. The thread takes
/// `writer` only while holding the queue with `leading` false, and a caller only sets `leading`
/// while holding the queue, so neither waits for `writer` while the other holds it.
struct Rounds {
    writer: Mutex<Writer>,
    log: Arc<Log>,
}

/// What the thread does after `Writer::decide`.
enum Decision {
    /// A round: ops are queued, a checkpoint needs finishing or starting, or the log stops.
    Work,
    /// Nothing to do: sleep up to `wait`, and if nothing comes meanwhile, do `then`.
    Idle {
        wait: Duration,
        then: Option<AfterIdle>,
    },
}

#[derive(Clone, Copy)]
enum AfterIdle {
    /// Retry the failed log.
    Recover,
    /// Write a note of the last sync.
    Note,
}

impl Rounds {
    /// The log-writer thread.
    fn run(&self) {
        let log = &self.log;
        let mut q = log.queue.lock();
        loop {
            if q.leading {
                // A caller's round: it wakes this thread if it leaves anything for it. The timeout
                // keeps the checkpoint schedule going if it leaves nothing.
                log.work.wait_for(&mut q, Duration::from_secs(1));
                continue;
            }
            // Nobody leads, and nobody can start to while this thread holds the queue.
            let mut w = self.writer.lock();
            if let Decision::Idle { wait, then } = w.decide(&mut q) {
                drop(w);
                let noting = matches!(then, Some(AfterIdle::Note));
                q.noting = noting;
                let mut deadline = Instant::now() + wait;
                let timed_out = loop {
                    let timed_out = log.work.wait_until(&mut q, deadline).timed_out();
                    // Callers' rounds meanwhile pushed the note back (a QD1 commit's FLUSH
                    // woke the thread for it every time, costing the commit a futex wake).
                    let later = q.last_led.map(|t| t + NOTE_DELAY);
                    match later {
                        Some(later) if noting && timed_out && later > Instant::now() => {
                            deadline = later;
                        }
                        _ => break timed_out,
                    }
                };
                q.noting = false;
                let quiet = q.system.is_empty() && q.client.is_empty() && !q.stop && !q.leading;
                let Some(then) = then.filter(|_| timed_out && quiet) else {
                    continue;
                };
                w = self.writer.lock();
                // A caller's round meanwhile may have carried the news a note would.
                let still_due = match then {
                    AfterIdle::Recover => log.failed(),
                    AfterIdle::Note => w.note_due(),
                };
                if !still_due {
                    continue;
                }
            }
            q.leading = true;
            let (written, round) = w.gather(&mut q);
            drop(q);
            let done = w.round(written, round);
            drop(w);
            q = log.queue.lock();
            q.leading = false;
            if done {
                return;
            }
        }
    }
}

impl Lead for Rounds {
    fn lead(&self, system: bool, ops: &mut dyn Iterator<Item = Op>) -> bool {
        let log = &self.log;
        let mut q = log.queue.lock();
        if q.leading || q.has_work() {
            return false;
        }
        // Free: the thread holds it only while it holds the queue or leads.
        let Some(mut w) = self.writer.try_lock() else {
            return false;
        };
        if !w.ready_for_a_leader() {
            return false;
        }
        q.leading = true;
        drop(q);
        if system {
            w.system_ops.extend(ops);
        } else {
            w.client_pending.extend(ops);
        }
        w.run_ops();
        let (thread_needed, note_due) = (w.thread_needed(), w.note_due());
        drop(w);
        let mut q = log.queue.lock();
        q.leading = false;
        q.last_led = Some(Instant::now());
        let wake = thread_needed || (note_due && !q.noting) || q.has_work();
        drop(q);
        if wake {
            log.work.notify_one();
        }
        true
    }
}

impl Writer {
    pub(crate) fn new(e: WriterParts, start: &LogStart) -> Writer {
        let bs = e.geo.block_size as usize;
        if start.checkpoint_now {
            // What recovery repaired (lost blocks, a damaged checkpoint slot) made durable now,
            // not at the next checkpoint the log's movement would bring.
            e.log.request_checkpoint();
        }
        Writer {
            e,
            next_seq: start.next_seq,
            epoch: start.epoch,
            checkpoint_number: start.checkpoint_number,
            header: AlignedBuf::zeroed(bs),
            // Room from the start, as for the log's queues: a caller that leads a round must
            // not be the one whose op makes them grow.
            client_pending: VecDeque::with_capacity(SCRATCH),
            client_blocked: false,
            system_ops: VecDeque::with_capacity(SCRATCH),
            batch_recs: Vec::with_capacity(SCRATCH),
            entries: Vec::with_capacity(SCRATCH),
            wants_sync: Vec::with_capacity(SCRATCH),
            wants_checkpoint: Vec::new(),
            unsynced: Vec::with_capacity(SCRATCH),
            // Opening synced what recovery found, so all of it is durable.
            durable: start.next_seq,
            durable_told: start.next_seq,
            durable_in_batch: start.next_seq,
            prev_own: start.last_header.clone(),
            log_id: start.log_id,
            owed_seal: None,
            retry: FIRST_RETRY,
            last_checkpoint: Instant::now(),
            // What recovery replayed is still behind the last checkpoint.
            checkpointed_seq: if start.replayed_blocks > 0 {
                0
            } else {
                start.next_seq
            },
            newest_checkpoint: SnapshotMarks::default(),
            unvouched_frees: Vec::with_capacity(SCRATCH),
            vouched: start.next_seq,
            blocks_since_checkpoint: start.replayed_blocks,
            inflight: None,
            checkpoint_wanted: false,
            checkpoint_waiters: Vec::new(),
        }
    }

    /// Starts the log-writer thread, and lets callers that find it idle run their own op (see
    /// [`Rounds`]).
    pub fn spawn(self) -> std::thread::JoinHandle<()> {
        let log = self.e.log.clone();
        let rounds = Arc::new(Rounds {
            writer: Mutex::new(self),
            log: log.clone(),
        });
        let lead: Arc<dyn Lead> = rounds.clone();
        log.set_leader(Arc::downgrade(&lead));
        std::thread::Builder::new()
            .name("log-writer".into())
            .spawn(move || rounds.run())
            .expect("cannot spawn the log writer")
    }

    fn log(&self) -> &Log {
        &self.e.log
    }

    /// Whether the thread has work now, or how long it may sleep (and what it does if nothing
    /// comes meanwhile).
    fn decide(&mut self, q: &mut Queue) -> Decision {
        let log = &self.e.log;
        if q.kicked {
            q.kicked = false;
            self.client_blocked = false;
        }
        let reclaim_failed = q.reclaim_failed.take();
        if self.client_blocked && (reclaim_failed.is_some() || log.failed()) {
            // Waiting would hang them: the space they wait for may never come.
            let err =
                reclaim_failed.unwrap_or_else(|| log.check_failed().expect_err("the log failed"));
            // Syncs among them are carried out, not failed with reclaim's error: they promise
            // only acknowledged records, and a FLUSH must learn from the device itself whether
            // it holds them (found as a flaky test: a FLUSH failed with the backing store's EIO,
            // and the dead cache device went unnoticed).
            let (syncs, blocked): (VecDeque<Op>, VecDeque<Op>) = self
                .client_pending
                .drain(..)
                .partition(|op| matches!(op, Op::Sync(..)));
            self.fail_ops(blocked.into(), &err);
            self.client_pending = syncs;
            self.client_blocked = false;
        }
        let client_ready =
            !self.client_blocked && (!q.client.is_empty() || !self.client_pending.is_empty());
        if !q.system.is_empty() || client_ready || q.stop {
            return Decision::Work;
        }
        // The checkpoint in flight was written, or one waited for it to finish.
        if q.checkpoint_written.is_some() || (self.checkpoint_wanted && self.inflight.is_none()) {
            return Decision::Work;
        }
        if self.checkpoint_due() {
            q.system.push_back(Op::Checkpoint(None));
            return Decision::Work;
        }
        if log.failed() {
            return Decision::Idle {
                wait: self.retry,
                then: Some(AfterIdle::Recover),
            };
        }
        if self.note_due() {
            return Decision::Idle {
                wait: NOTE_DELAY,
                then: Some(AfterIdle::Note),
            };
        }
        Decision::Idle {
            wait: Duration::from_secs(1),
            then: None,
        }
    }

    /// Takes the round's ops off the queue (lingering first when only records nobody waits for
    /// are queued). `None`: nothing to write, only a note or a retry of the failed log.
    fn gather(
        &mut self,
        q: &mut MutexGuard<'_, Queue>,
    ) -> (Option<Result<Written, CheckpointError>>, Option<bool>) {
        let log = &self.e.log;
        let written = q.checkpoint_written.take();
        let checkpoint_news = written.is_some() || self.checkpoint_wanted;
        let idle = q.system.is_empty()
            && q.client.is_empty()
            && !q.stop
            && (self.client_blocked || self.client_pending.is_empty());
        if idle && (self.note_due() || log.failed()) {
            return (written, None);
        }
        if !q.stop && !checkpoint_news && only_unawaited(q, &self.client_pending) {
            let deadline = Instant::now() + LINGER;
            while !q.stop
                && only_unawaited(q, &self.client_pending)
                && unawaited_blocks(q) < LINGER_BLOCKS
                && !log.work.wait_until(q, deadline).timed_out()
            {}
        }
        self.client_pending.extend(q.client.drain(..));
        debug_assert!(self.system_ops.is_empty());
        std::mem::swap(&mut q.system, &mut self.system_ops);
        (written, Some(q.stop))
    }

    /// One round of the thread's: what `gather` took. True once the log is stopped and done.
    fn round(
        &mut self,
        written: Option<Result<Written, CheckpointError>>,
        round: Option<bool>,
    ) -> bool {
        if let Some(result) = written {
            self.finish_checkpoint(result);
        }
        self.maybe_start_checkpoint();
        let Some(stop) = round else {
            if self.log().failed() {
                self.try_recover();
            } else {
                self.write_note();
            }
            return false;
        };
        self.run_ops();
        if self.checkpoint_due() {
            self.checkpoint_wanted = true;
        }
        self.maybe_start_checkpoint();
        if stop {
            // Records still waiting for space when the cache closes will not get it.
            let leftover: Vec<Op> = self.client_pending.drain(..).collect();
            self.fail_ops(leftover, &LogError::Shutdown);
            let q = self.e.log.queue.lock();
            if q.client.is_empty() && q.system.is_empty() {
                drop(q);
                // Nothing is left behind: the checkpoint in flight finishes, and one still asked
                // for is written.
                self.wait_for_checkpoint();
                if self.checkpoint_wanted {
                    self.start_checkpoint();
                    self.wait_for_checkpoint();
                }
                return true;
            }
        }
        false
    }

    /// Whether a caller may run its op here and now: nothing is left over for the thread (no
    /// ops waiting for space, no checkpoint to start, the log healthy).
    fn ready_for_a_leader(&self) -> bool {
        self.client_pending.is_empty()
            && !self.client_blocked
            && !self.checkpoint_wanted
            && !self.checkpoint_due()
            && !self.log().failed()
    }

    /// After a caller's round: whether the thread has something to do that it would not
    /// otherwise wake for (besides a note, whose timer it may have started already).
    fn thread_needed(&self) -> bool {
        !self.client_pending.is_empty()
            || self.checkpoint_due()
            || self.checkpoint_wanted
            || self.log().failed()
    }

    /// Writes the system ops and client ops taken (appends into batches), then syncs and asks
    /// for checkpoints as the round's syncs and checkpoint ops want.
    fn run_ops(&mut self) {
        let mut wants_sync = std::mem::take(&mut self.wants_sync);
        let mut wants_checkpoint = std::mem::take(&mut self.wants_checkpoint);
        let mut system = std::mem::take(&mut self.system_ops);
        self.process(&mut system, true, &mut wants_sync, &mut wants_checkpoint);
        debug_assert!(system.is_empty(), "system ops never wait for space");
        self.system_ops = system;
        if !self.client_blocked {
            let mut client = std::mem::take(&mut self.client_pending);
            self.process(&mut client, false, &mut wants_sync, &mut wants_checkpoint);
            if self.client_pending.is_empty() {
                // Not blocked (a blocked batch put what is left back in `client_pending`): keep
                // the buffer.
                self.client_pending = client;
            }
        } else {
            // Syncs never wait behind blocked records: they only promise durability for records
            // already acknowledged, and blocked ones are not.
            let (syncs, rest): (Vec<Op>, Vec<Op>) = self
                .client_pending
                .drain(..)
                .partition(|op| matches!(op, Op::Sync(..)));
            self.client_pending = rest.into();
            self.process(
                &mut syncs.into(),
                false,
                &mut wants_sync,
                &mut wants_checkpoint,
            );
        }
        // (A checkpoint syncs the device itself, before its snapshot.)
        if !wants_sync.is_empty() {
            let mut result = self.sync_device();
            // Vouched unless a batch header already says this much is durable: a note saying it
            // does not do (found by the power-loss campaign: a sync in between, here a
            // background checkpoint's, advanced `durable`, the idle writer noted it, the vouched
            // sync then wrote no vouching headers, the next batch overwrote the note and the
            // crash tore that batch; damage to an older vouching header then cut the log before
            // a write the backing store's later bypass write relied on).
            let mut unvouched = false;
            if result.is_ok()
                && wants_sync.iter().any(|s| s.vouch)
                && self.durable > self.durable_in_batch
                && !self.log().failed()
            {
                self.write_vouch();
                // No room for a header anywhere, not even in the reserve (found by the long
                // campaign: a write-through write's sync returned unvouched, its backing write
                // followed, and damage to its batch then cut the log before it, bringing back an
                // older cached copy of what the backing store already held).
                unvouched = self.durable > self.durable_in_batch;
                result = self.sync_device();
            }
            for s in wants_sync.drain(..) {
                if unvouched && s.vouch && result.is_ok() {
                    self.unvouched(s.ticket);
                } else {
                    s.ticket
                        .complete(result.as_ref().map(|_| DROPPED).map_err(LogError::io));
                }
            }
        }
        self.wants_sync = wants_sync;
        for w in wants_checkpoint.drain(..) {
            self.checkpoint_wanted = true;
            self.checkpoint_waiters.extend(w);
        }
        self.wants_checkpoint = wants_checkpoint;
    }

    /// Completes ops that will not be carried out with `err`.
    fn fail_ops(&self, ops: Vec<Op>, err: &LogError) {
        for op in ops {
            match op {
                Op::Append(r, w) => {
                    self.unwritten(&r);
                    complete(&w, Err(err.clone()));
                }
                Op::Sync(w, _) => w.complete(Err(err.clone())),
                Op::Checkpoint(w) => complete(&w, Err(err.clone())),
            }
        }
    }

    /// A checkpoint is due when the log has moved for [`CHECKPOINT_INTERVAL`], or an eighth of the
    /// cache has been written since the last one: that bounds both recovery time and how much log
    /// a crash leaves to replay.
    fn checkpoint_due(&self) -> bool {
        let moved = self.next_seq != self.checkpointed_seq;
        let by_time = self.last_checkpoint.elapsed() >= CHECKPOINT_INTERVAL;
        let by_volume = self.blocks_since_checkpoint >= self.e.geo.slot_count() as u64 / 8;
        moved
            && (by_time || by_volume)
            && !self.log().failed()
            && self.inflight.is_none()
            && !self.checkpoint_wanted
    }

    /// Runs ops in order: appends are packed into batches; syncs and checkpoints are collected
    /// for the end of the round. Leaves blocked client ops in `client_pending`.
    fn process(
        &mut self,
        ops: &mut VecDeque<Op>,
        system: bool,
        wants_sync: &mut Vec<WantsSync>,
        wants_checkpoint: &mut Vec<Option<Ticket>>,
    ) {
        let max_blocks = MAX_BATCH_BLOCKS.min(self.e.geo.blocks_per_segment() - 1 - VOUCH_ROOM);
        let mut batch = Batch {
            recs: std::mem::take(&mut self.batch_recs),
            ..Batch::new()
        };
        let mut cap = None;
        while let Some(op) = ops.pop_front() {
            match op {
                Op::Append(rec, w) => {
                    if self.log().failed() {
                        self.unwritten(&rec);
                        complete(&w, self.log().check_failed().map(|()| DROPPED));
                        continue;
                    }
                    if rec.kind == Kind::Free && !self.log().frees_allowed() {
                        // A CLEANED or LOST record was lost since the older checkpoint's snapshot
                        // (see `Log::hint_dropped`): reclaim frees it after checkpoints.
                        complete(&w, Err(LogError::ReserveFull));
                        continue;
                    }
                    if !self.promotion_still_safe(&rec) {
                        Stats::add(&self.e.stats.promotions_dropped, 1);
                        self.release_promotion(&rec);
                        complete(&w, Ok(DROPPED));
                        continue;
                    }
                    let limit = *cap.get_or_insert_with(|| {
                        let first = batch.recs.first().map_or(&rec, |(r, _)| r);
                        self.batch_cap(first, max_blocks)
                    });
                    if !batch.fits(&rec, limit) {
                        if let Err(Blocked) = self.write_batch(&mut batch, system) {
                            self.requeue_blocked(batch, Some((rec, w)), ops, system);
                            return;
                        }
                        batch.clear();
                        cap = Some(self.batch_cap(&rec, max_blocks));
                    }
                    batch.data_blocks += rec.data_blocks();
                    batch.recs.push((rec, w));
                }
                Op::Sync(ticket, vouch) => wants_sync.push(WantsSync { ticket, vouch }),
                Op::Checkpoint(w) => wants_checkpoint.push(w),
            }
        }
        if !batch.recs.is_empty() {
            if let Err(Blocked) = self.write_batch(&mut batch, system) {
                self.requeue_blocked(batch, None, ops, system);
                return;
            }
            batch.clear();
        }
        self.batch_recs = batch.recs;
    }

    /// The most data blocks the batch starting with `first` may hold. A batch that does not fit
    /// the rest of the head segment seals it, and what the seal leaves unused is lost until
    /// reclaim empties the segment (reclaim's moves and large promotions, up to
    /// `MAX_BATCH_BLOCKS`, would lose up to that much per segment): so a batch ends where the
    /// head segment does, unless its first record does not fit there at all.
    fn batch_cap(&self, first: &Record, max_blocks: u32) -> u32 {
        let bps = self.e.geo.blocks_per_segment();
        // Assuming the batch is that record's size: a batch as large as the head's room keeps
        // it only if the record leaves the room needed.
        let needed = 1 + first.data_blocks();
        let room = self.vouch_room(true, first.kind == Kind::Free, needed);
        match self.e.state.read().segs.head {
            // One slot for the batch's header.
            Some(h) if h.used + needed + room <= bps => max_blocks.min(bps - h.used - 1 - room),
            _ => max_blocks,
        }
    }

    /// A client batch found only the reserve left: put it (and everything after it) back at the
    /// front of the pending client ops and wait for reclaim.
    fn requeue_blocked(
        &mut self,
        blocked: Batch,
        next: Option<(Record, Option<Ticket>)>,
        rest: &mut VecDeque<Op>,
        system: bool,
    ) {
        debug_assert!(!system, "system batches may use the reserve");
        let mut front: VecDeque<Op> = blocked
            .recs
            .into_iter()
            .map(|(r, w)| Op::Append(r, w))
            .collect();
        if let Some((r, w)) = next {
            front.push_back(Op::Append(r, w));
        }
        front.extend(rest.drain(..));
        front.extend(self.client_pending.drain(..));
        self.client_pending = front;
        self.client_blocked = true;
        self.e.reclaim.wake();
    }

    fn promotion_still_safe(&self, rec: &Record) -> bool {
        match rec.promote_since {
            Some(since) => self
                .e
                .guards
                .promotion_safe(rec.lba, rec.nblocks as u64, since),
            None => true,
        }
    }

    /// `rec` will not be written.
    fn unwritten(&self, rec: &Record) {
        self.release_promotion(rec);
        if matches!(rec.kind, Kind::Cleaned | Kind::Lost) {
            self.log().hint_dropped();
        }
    }

    fn release_promotion(&self, rec: &Record) {
        if rec.kind == Kind::Promote {
            let bytes = rec.nblocks as u64 * self.e.geo.block_size as u64;
            self.log()
                .queued_promotion_bytes
                .fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    /// Writes a batch, applies it, and completes its waiters (the caller then clears it).
    /// `Err(Blocked)`: a client batch found only the reserve left, and was not written.
    fn write_batch(&mut self, batch: &mut Batch, system: bool) -> Result<(), Blocked> {
        let needed = 1 + batch.data_blocks;
        // FREE records, and the CLEANED and LOST records that must precede them (see
        // `Log::hint_dropped`): a header and no data.
        let bookkeeping = !batch.recs.is_empty()
            && batch
                .recs
                .iter()
                .all(|(r, _)| matches!(r.kind, Kind::Free | Kind::Cleaned | Kind::Lost));
        let vouch_room = self.vouch_room(
            !batch.recs.is_empty(),
            batch.recs.iter().any(|(r, _)| r.kind == Kind::Free),
            needed,
        );
        let head = match self.place(needed, vouch_room, system, bookkeeping) {
            Ok(h) => h,
            Err(NoSpace::Blocked) if !system => return Err(Blocked),
            Err(NoSpace::Blocked) => {
                // Reclaim itself ran out of room: its records fail (and it retries once a
                // checkpoint has freed what it emptied); the log stays healthy.
                tracing::debug!("no free segment for reclaim's records");
                for (r, w) in &batch.recs {
                    self.unwritten(r);
                    complete(w, Err(LogError::ReserveFull));
                }
                return Ok(());
            }
            Err(NoSpace::Failed(e)) => {
                for (r, w) in &batch.recs {
                    self.unwritten(r);
                    complete(w, Err(LogError::io(&e)));
                }
                return Ok(());
            }
        };
        let geo = self.e.geo;
        let mut entries = std::mem::take(&mut self.entries);
        entries.extend(batch.recs.iter().map(|(r, _)| r.entry()));
        let header = BatchHeader {
            seq_first: self.next_seq,
            epoch: self.epoch,
            kind: HeaderKind::Batch,
            durable: self.durable,
            log: self.log_id,
            entries,
            ordinal: batch.ordinal,
        };
        header.encode(&self.prev_own[..], &mut self.header);
        self.entries = header.entries;
        self.entries.clear();
        let first_slot = geo.first_slot(head.segment) + head.used;
        // Inline for the batches a few clients' 4 KiB writes make.
        let mut iov: SmallVec<[&[u8]; 64]> = SmallVec::new();
        iov.push(&self.header);
        for (r, _) in &batch.recs {
            if let Some(d) = &r.data {
                iov.push(d);
            }
        }
        let written = self
            .e
            .cache
            .write_vectored_at(&iov, geo.slot_offset(first_slot));
        drop(iov);
        if let Err(e) = written {
            Stats::add(&self.e.stats.cache_errors, 1);
            tracing::error!(error = %e, segment = head.segment, "cache device write failed");
            self.abandon_segment_after_failure(head);
            for (r, w) in &batch.recs {
                self.unwritten(r);
                complete(w, Err(LogError::io(&e)));
            }
            return Ok(());
        }
        self.header_written();
        if batch.data_blocks > 0 {
            self.note_unsynced(first_slot + 1, batch.data_blocks);
        }
        let bytes = needed as u64 * geo.block_size as u64;
        self.blocks_since_checkpoint += needed as u64;
        Stats::add(&self.e.stats.cache_writes, 1);
        Stats::add(&self.e.stats.cache_write_bytes, bytes);
        Stats::add(&self.e.stats.batches, 1);
        Stats::add(&self.e.stats.records, batch.recs.len() as u64);
        let batch_end = self.next_seq + batch.recs.len() as u64;
        {
            let mut st = self.e.state.write();
            st.segs
                .note_written(head.segment, head.used, self.e.now_secs());
            let mut slot = first_slot + 1;
            for (r, _) in &batch.recs {
                if r.kind == Kind::Free {
                    debug_assert_eq!(
                        st.index
                            .slots_in(geo.first_slot(r.aux as u32), geo.blocks_per_segment())
                            .count(),
                        0,
                        "reclaim freed a segment with blocks in it"
                    );
                    self.unvouched_frees.push((r.aux as u32, batch_end));
                    // Room for the client batches waiting for space.
                    self.client_blocked = false;
                    Stats::add(&self.e.stats.freed_segments, 1);
                }
                st.apply(&r.entry(), slot, &r.block_crcs);
                if r.kind == Kind::Write {
                    // Stamped as the index changes, not before: a read miss that found these
                    // blocks unmapped looked before this, so its clock (taken before it looked)
                    // is older than the stamp, and its promotion is dropped (see `guards`).
                    self.e.guards.stamp(r.lba, r.nblocks as u64);
                }
                slot += r.data_blocks();
            }
            if let Some(h) = st.segs.head.as_mut() {
                h.used += needed;
            }
        }
        // The data is on the device: the buffers go back to the pool before the waiters wake,
        // so a client's next write finds one there instead of allocating while this batch
        // still holds them.
        for (r, _) in &mut batch.recs {
            r.data = None;
        }
        let first_seq = self.next_seq;
        self.next_seq += batch.recs.len() as u64;
        self.log()
            .applied_seq
            .store(self.next_seq - 1, Ordering::Release);
        let mut slot = first_slot + 1;
        for (i, (r, w)) in batch.recs.iter().enumerate() {
            if r.kind == Kind::Promote {
                Stats::add(&self.e.stats.promoted_blocks, r.nblocks as u64);
                self.release_promotion(r);
            }
            let appended = Appended {
                seq: first_seq + i as u64,
                slot: (r.data_blocks() > 0).then_some(slot),
            };
            slot += r.data_blocks();
            complete(w, Ok(appended));
        }
        Ok(())
    }

    /// Adds `count` data slots from `first` to those to check after a failed sync. A stretch that
    /// continues the last one in the same segment (past the header between them, which nothing
    /// maps) extends it, so the list holds one entry per segment written since the last sync and
    /// does not grow with every batch.
    fn note_unsynced(&mut self, first: u32, count: u32) {
        let geo = self.e.geo;
        if let Some((from, n)) = self.unsynced.last_mut() {
            let end = *from + *n;
            if first >= end && first - end <= 1 && geo.segment_of(*from) == geo.segment_of(first) {
                *n = first + count - *from;
                return;
            }
        }
        self.unsynced.push((first, count));
    }

    /// Finds room for `needed` blocks at the log head, sealing the open segment (so recovery
    /// knows the log went on elsewhere) and opening the next free one if it does not fit.
    /// `vouch_room` more blocks must stay free after it in the head segment (see
    /// [`Writer::vouch_room`]).
    fn place(
        &mut self,
        needed: u32,
        vouch_room: u32,
        system: bool,
        bookkeeping: bool,
    ) -> Result<Head, NoSpace> {
        let bps = self.e.geo.blocks_per_segment();
        loop {
            let head = self.e.state.read().segs.head;
            match head {
                // Whatever is left after a batch (if anything) can always hold a seal.
                Some(h) if h.used + needed + vouch_room <= bps => return Ok(h),
                Some(h) => {
                    // A client batch that could not open the next segment anyway keeps the head:
                    // sealed now, the head's room would be lost and the segment, holding only
                    // what reclaim had just moved into it, would be reclaim's next victim. That
                    // was a livelock: reclaim moved a few blocks from segment to segment, each
                    // sealed almost empty by the same waiting batch, two checkpoints a round,
                    // while no client write completed for up to 10 s
                    // (bench/results/reclaim_livelock/). Retried, the batch is sized to the
                    // head's room.
                    if !system && self.e.state.read().segs.free_count() <= RESERVE {
                        return Err(NoSpace::Blocked);
                    }
                    self.seal_head_segment(h).map_err(NoSpace::Failed)?;
                }
                None => {}
            }
            let (free, next) = {
                let st = self.e.state.read();
                (st.segs.free_count(), st.segs.next_free())
            };
            if !system && free <= RESERVE {
                return Err(NoSpace::Blocked);
            }
            // The last free segment is kept for FREE records (see the module's essay).
            if system && !bookkeeping && free <= 1 {
                return Err(NoSpace::Blocked);
            }
            let Some(next) = next else {
                return Err(NoSpace::Blocked);
            };
            // Sealing vouched for the record that freed it, unless a failed write sealed the
            // head instead (see `abandon_segment_after_failure`): then the record is at least
            // made durable.
            if self.freed_unvouched(next) {
                self.sync_device().map_err(NoSpace::Failed)?;
            }
            crate::state::wait_for_readers(&self.e.state, &[next]);
            // Only this thread takes free segments, so `next` is still the first.
            let mut st = self.e.state.write();
            if st.segs.open_next(self.next_seq).is_none() {
                return Err(NoSpace::Blocked);
            }
            let free = st.segs.free_count();
            drop(st);
            if free <= reclaim_low_water(self.e.geo.segment_count) {
                self.e.reclaim.wake();
            }
        }
    }

    /// Seals the head segment `h` (unless full) as the log leaves it for the next free one.
    ///
    /// That one may be a segment a FREE record freed, and overwriting it is safe only once
    /// recovery is sure to replay the record (and the MOVE records before it), or it would
    /// replay a checkpoint that maps blocks into the segment, or the log that moved them out,
    /// without the record that freed it. A sync makes the record durable, but that is not
    /// enough: damage to a synced batch that no header vouches for reads as the torn tail, and
    /// the cut drops the record along with it (the long power-loss campaign, seed 0x90e510c5
    /// run 2727: a zeroed seal just before the FREE record's batch cut the log there, and the
    /// dirty blocks the cut log left in the freed segment had been overwritten). So the seal
    /// vouches: a sync, a record-less batch and the seal (two headers saying the record is
    /// durable, as for [`Writer::write_vouch`]), and a sync, before the segment is opened. The
    /// head keeps room for them while a FREE record is not vouched for ([`Writer::vouch_room`]);
    /// a batch that fills it anyway (only records larger than the engine writes) leaves room for
    /// fewer. Costs one more sync than opening did before, only when the next free segment is
    /// one no header vouches for: a small free list (steady reclaim) and no sync since its FREE
    /// record.
    fn seal_head_segment(&mut self, h: Head) -> io::Result<()> {
        let bps = self.e.geo.blocks_per_segment();
        let next = self.e.state.read().segs.next_free();
        let vouch = next.is_some_and(|s| self.freed_unvouched(s));
        let mut h = h;
        if vouch {
            self.sync_device()?;
            if h.used + 1 < bps {
                let mut batch = Batch {
                    ordinal: 1,
                    ..Batch::new()
                };
                // A failure sealed the segment over the batch, and failed the log if that failed.
                let written = self.write_batch(&mut batch, true);
                debug_assert!(written.is_ok(), "system batches are never blocked");
                match self.e.state.read().segs.head {
                    Some(now) if now.segment == h.segment => h = now,
                    _ => return self.log().check_failed().map_err(Into::into),
                }
            }
        }
        if h.used < bps {
            self.write_seal(h)?;
            Stats::add(&self.e.stats.sealed_unused_blocks, u64::from(bps - h.used));
        }
        if vouch {
            self.sync_device()?;
        }
        self.e.state.write().segs.seal_head();
        Ok(())
    }

    /// Whether `segment` was freed by a FREE record that no header on the device vouches for.
    fn freed_unvouched(&self, segment: u32) -> bool {
        // Entries a sync vouched for are gone already: `flush_device` drops them as it moves
        // `vouched`, the only place it moves.
        self.unvouched_frees.iter().any(|&(s, _)| s == segment)
    }

    /// Blocks a batch leaves free in the head segment for the headers that vouch for a FREE
    /// record before the segment it freed is opened (see [`Writer::seal_head_segment`]): while
    /// one is not vouched for, or the batch holds one (`frees`). None for a batch of no records,
    /// which is one of those headers. `needed` is the batch's size (header included).
    fn vouch_room(&self, records: bool, frees: bool, needed: u32) -> u32 {
        let pending = frees || !self.unvouched_frees.is_empty();
        if !records || !pending {
            return 0;
        }
        VOUCH_ROOM.min(self.e.geo.blocks_per_segment().saturating_sub(needed))
    }

    /// This header (in `self.header`) is on the device: the next one carries a copy of it.
    fn header_written(&mut self) {
        self.prev_own.copy_from_slice(&self.header[..OWN_LEN]);
        self.durable_told = self.durable;
        self.durable_in_batch = self.durable;
    }

    fn write_seal(&mut self, h: Head) -> io::Result<()> {
        BatchHeader {
            seq_first: self.next_seq,
            epoch: self.epoch,
            kind: HeaderKind::Seal,
            durable: self.durable,
            log: self.log_id,
            entries: Vec::new(),
            ordinal: 0,
        }
        .encode(&self.prev_own[..], &mut self.header);
        let slot = self.e.geo.first_slot(h.segment) + h.used;
        let result = self
            .e
            .cache
            .write_at(&self.header, self.e.geo.slot_offset(slot), false);
        match &result {
            Ok(()) => {
                self.header_written();
                Stats::add(&self.e.stats.cache_writes, 1);
                Stats::add(&self.e.stats.cache_write_bytes, self.header.len() as u64)
            }
            Err(e) => {
                Stats::add(&self.e.stats.cache_errors, 1);
                self.fail(&format!("cannot seal segment {}: {e}", h.segment));
            }
        }
        result
    }

    /// After a failed batch write the space may hold a torn batch that would stop recovery in
    /// front of everything written later; seal over it and move on to the next segment.
    fn abandon_segment_after_failure(&mut self, head: Head) {
        if self.write_seal(head).is_ok() {
            self.e.state.write().segs.seal_head();
        } else {
            self.owed_seal = Some(head);
        }
    }

    fn fail(&self, why: &str) {
        let log = self.log();
        *log.failure.lock() = Some((why.to_string(), Instant::now()));
        if !log.failed.swap(true, Ordering::AcqRel) {
            tracing::error!(
                "cache log failed: {why}; writes and flushes fail with EIO until the device works \
                 again"
            );
        }
    }

    /// Tries to bring a failed log back (see the module documentation); on failure the log
    /// stays failed and the next try comes after a longer wait.
    fn try_recover(&mut self) {
        // The log stays failed until the recovery worked: `status` must not flicker to healthy
        // during each try (found as a flaky test), and appends queue up meanwhile and are
        // handled after this (failed again if it fails).
        match self.recover_log() {
            Ok(()) => {
                self.log().failed.store(false, Ordering::Release);
                self.retry = FIRST_RETRY;
                *self.log().failure.lock() = None;
                Stats::add(&self.e.stats.log_recoveries, 1);
                tracing::warn!("the cache device works again: the cache log resumed");
            }
            Err(e) => {
                self.fail(&format!("cache device still failing: {e}"));
                self.retry = (self.retry * 2).min(MAX_RETRY);
            }
        }
    }

    fn recover_log(&mut self) -> io::Result<()> {
        self.e.cache.flush()?;
        if let Some(head) = self.owed_seal {
            self.write_seal(head)?;
            self.e.state.write().segs.seal_head();
            self.owed_seal = None;
        }
        // What the failed sync may have lost: read it back now that a sync worked.
        for (first, count) in std::mem::take(&mut self.unsynced) {
            self.check_written(first, count)?;
        }
        self.write_checkpoint_now()
    }

    /// Reads back `count` slots from `first` (one segment's) and checks every block still
    /// mapped there against its checksum; what fails is handled like any damaged block.
    fn check_written(&mut self, first: u32, count: u32) -> io::Result<()> {
        let e = &self.e;
        let bs = e.geo.block_size as usize;
        let seg = e.geo.segment_of(first);
        let expected: Vec<Option<(u64, u32)>> = {
            let st = e.state.read();
            st.segs.reader_enter(seg);
            (first..first + count)
                .map(|s| st.index.slot(s).map(|i| (i.lba, st.crcs[s as usize])))
                .collect()
        };
        let mut data = AlignedBuf::zeroed(count as usize * bs);
        let read = e.cache.read_at(&mut data, e.geo.slot_offset(first));
        if read.is_ok() {
            for (i, (block, want)) in data.chunks_mut(bs).zip(expected).enumerate() {
                if let Some((lba, crc)) = want {
                    (e.check_block)(lba, first + i as u32, crc, block);
                }
            }
        }
        e.state.read().segs.reader_exit(seg);
        read
    }

    fn sync_device(&mut self) -> io::Result<()> {
        self.log().check_failed()?;
        self.flush_device()
    }

    /// [`Writer::sync_device`] without refusing a failed log: for recovering it.
    fn flush_device(&mut self) -> io::Result<()> {
        let result = self.e.cache.flush();
        Stats::add(&self.e.stats.cache_syncs, 1);
        match &result {
            // Every batch is written before the sync that follows it is issued.
            Ok(()) => {
                self.durable = self.next_seq;
                self.unsynced.clear();
                // Every header written so far is on the device now.
                self.vouched = self.durable_in_batch;
                let vouched = self.vouched;
                self.unvouched_frees.retain(|&(_, end)| end > vouched);
            }
            Err(e) => {
                Stats::add(&self.e.stats.cache_errors, 1);
                self.fail(&format!("cache device sync failed: {e}"));
            }
        }
        result
    }

    /// A sync made records durable that no header on the device vouches for yet.
    fn note_due(&self) -> bool {
        self.durable > self.durable_told && !self.log().failed()
    }

    /// Writes a note at the log head: no records, just how far the log is durable, so that
    /// recovery can tell damage to the last synced batches (which lose only the damaged records)
    /// from a crash tearing unsynced ones (where the log simply ends). Under load the next
    /// batch's header says the same; the note covers the writer going idle. It is not synced,
    /// and the next batch overwrites it (the log does not move). When the open segment is full,
    /// the note goes to the first block of the next free segment, where recovery looks for the
    /// log's continuation (and the next batch overwrites it there).
    fn write_note(&mut self) {
        let place = {
            let st = self.e.state.read();
            match st.segs.head {
                Some(h) if h.used < self.e.geo.blocks_per_segment() => Some((h.segment, h.used)),
                _ => st.segs.next_free().map(|seg| (seg, 0)),
            }
        };
        let Some((segment, used)) = place else {
            // No free segment: the next batch says it, wherever it goes.
            self.durable_told = self.durable;
            return;
        };
        BatchHeader {
            seq_first: self.next_seq,
            epoch: self.epoch,
            kind: HeaderKind::Note,
            durable: self.durable,
            log: self.log_id,
            entries: Vec::new(),
            ordinal: 0,
        }
        .encode(&self.prev_own[..], &mut self.header);
        let slot = self.e.geo.first_slot(segment) + used;
        match self
            .e
            .cache
            .write_at(&self.header, self.e.geo.slot_offset(slot), false)
        {
            Ok(()) => {
                Stats::add(&self.e.stats.cache_writes, 1);
                Stats::add(&self.e.stats.cache_write_bytes, self.header.len() as u64);
            }
            // Only a hint: a failed note changes nothing (the next batch is written there anyway).
            Err(e) => {
                Stats::add(&self.e.stats.cache_errors, 1);
                tracing::debug!(error = %e, "note write failed");
            }
        }
        self.durable_told = self.durable;
    }

    /// Vouches for a sync the backing store is about to rely on with a batch of no records (its
    /// header carries `durable`), after which the log goes on. Not a note: the next batch
    /// overwrites a note, and a crash tearing that batch would take the vouching with it, so
    /// damage to the synced batch would then look like a torn tail and undo what the backing
    /// store relied on (found by the corruption campaign). Two such batches, in two blocks, so
    /// that one more fault (damage to the synced batch and to one vouching header) still leaves
    /// a header that vouches; with one, the long campaign found that double fault bringing back
    /// an older dirty copy over a write-through write the backing store held. Costs two blocks of
    /// log (one more write, no more syncs) per such sync. When not even the reserve has room it
    /// writes a note at most, which vouches for nothing: a checkpoint then answers the syncs (see
    /// [`Writer::unvouched`]).
    fn write_vouch(&mut self) {
        for ordinal in 1..=VOUCHING_HEADERS {
            let mut vouch = Batch {
                ordinal,
                ..Batch::new()
            };
            if self.write_batch(&mut vouch, true).is_err() {
                break;
            }
        }
        if self.note_due() {
            self.write_note();
        }
    }

    /// A vouched sync whose vouching headers found no room (the whole log full, reserve
    /// included) is answered by the next checkpoint instead: once it is durable, recovery starts
    /// after every record the sync covers, so no damage to them can pass for a torn tail. It needs
    /// no log space, frees what reclaim emptied, and waits for nothing a caller may hold (making
    /// the sync wait for reclaim instead would deadlock the cleaner, whose passes reclaim needs).
    fn unvouched(&mut self, ticket: Ticket) {
        self.checkpoint_wanted = true;
        self.checkpoint_waiters.push(ticket);
    }

    /// Starts the checkpoint asked for, unless one is in flight (it starts once that one is
    /// done). With the log failed, its waiters fail at once, as other work does.
    fn maybe_start_checkpoint(&mut self) {
        if self.checkpoint_wanted && self.inflight.is_none() {
            self.start_checkpoint();
        }
    }

    /// Takes the snapshot (after a sync) and hands it to a checkpoint thread, which encodes and
    /// writes it while the log goes on; [`Writer::finish_checkpoint`] completes it. Only the sync
    /// and the snapshot (O(chunks), see `cow`) hold up appends: encoding and writing a large
    /// index took 107 ms at 48 GiB and 310 ms at 1 TiB when this thread did them.
    fn start_checkpoint(&mut self) {
        debug_assert!(self.inflight.is_none(), "one checkpoint at a time");
        self.checkpoint_wanted = false;
        let waiters = std::mem::take(&mut self.checkpoint_waiters);
        let begun = self
            .log()
            .check_failed()
            .map_err(io::Error::from)
            .and_then(|()| self.begin_checkpoint(waiters.clone()));
        let (job, mut inflight) = match begun {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "checkpoint failed");
                for w in &waiters {
                    w.complete(Err(LogError::io(&e)));
                }
                return;
            }
        };
        let job = Arc::new(Mutex::new(Some(job)));
        let e = self.e.clone();
        let theirs = job.clone();
        let spawned = std::thread::Builder::new()
            .name("checkpoint".into())
            .spawn(move || {
                // Encoding a large index is tens of milliseconds of CPU: at the default priority
                // it took one of two CPUs from the clients and doubled their worst write latency
                // near a checkpoint. The log goes on without it, so it can wait its turn.
                if let Err(err) = flashtier_io::sys::lower_thread_priority(CHECKPOINT_NICE) {
                    tracing::debug!(error = %err, "checkpoint thread keeps its priority");
                }
                let job = theirs.lock().take();
                let result = job.map_or(Err(CheckpointError::Panicked), |job| {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| write_image(&e, &job)))
                        .unwrap_or(Err(CheckpointError::Panicked))
                    // The snapshot goes here, before the writer learns of the result: once a
                    // checkpoint is finished, no chunk is still shared with it and changes stop
                    // costing copies.
                });
                e.log.queue.lock().checkpoint_written = Some(result);
                e.log.work.notify_one();
            });
        match spawned {
            Ok(thread) => inflight.thread = Some(thread),
            Err(err) => {
                // No thread to be had: write it here (clients wait, as they did before there was
                // a checkpoint thread).
                tracing::warn!(error = %err, "cannot spawn a checkpoint thread; checkpointing inline");
                let result = match job.lock().take() {
                    Some(job) => write_image(&self.e, &job),
                    None => Err(CheckpointError::Panicked),
                };
                self.log().queue.lock().checkpoint_written = Some(result);
            }
        }
        self.inflight = Some(inflight);
    }

    /// Syncs the device and snapshots the state: the first half of a checkpoint.
    fn begin_checkpoint(&mut self, waiters: Vec<Ticket>) -> io::Result<(Job, InFlight)> {
        // The snapshot may only reference records that are durable.
        let began = Instant::now();
        self.flush_device()?;
        let synced = Instant::now();
        Stats::add(&self.e.stats.checkpoint_sync_us, micros(synced - began));
        let number = self.checkpoint_number + 1;
        let (snap, release) = {
            let st = self.e.state.read();
            let mut snap = st.snapshot();
            // No open segment and no free one: not even a FREE record can be written (a write
            // that failed sealed the segment a FREE record had opened, the last free one; found
            // by the fault sweep, reclaim asking for checkpoints forever). Then this checkpoint
            // frees what may be reused, as every checkpoint did before FREE records: recorded at
            // the end of its free list, free once it is durable. Nothing can be written until
            // then, so the log's free order is still the one it records; a walk from the older
            // checkpoint misses them, and scans, as for any damaged newest checkpoint.
            // (A CLEANED or LOST record not yet queued could come after the reuse: see
            // `Log::hint_made`; reclaim asks again.)
            let stuck =
                st.segs.head.is_none() && st.segs.free_count() == 0 && self.log().hints_queued();
            let release: Vec<u32> = if stuck {
                st.segs
                    .reusable(self.log().seals_at_older_checkpoint())
                    .collect()
            } else {
                Vec::new()
            };
            snap.free.extend(&release);
            (snap, release)
        };
        Stats::add(
            &self.e.stats.checkpoint_snapshot_us,
            micros(synced.elapsed()),
        );
        let inflight = InFlight {
            number,
            next_seq: self.next_seq,
            marks: SnapshotMarks {
                seals: snap.seals,
                hints_dropped: self.log().hints_dropped(),
            },
            release,
            blocks_at_snapshot: self.blocks_since_checkpoint,
            waiters,
            thread: None,
        };
        let job = Job {
            number,
            next_seq: self.next_seq,
            epoch: self.epoch,
            snap,
        };
        Ok((job, inflight))
    }

    /// Waits for the checkpoint in flight (if any) and finishes it.
    fn wait_for_checkpoint(&mut self) {
        if self.inflight.is_none() {
            return;
        }
        let result = {
            let log = &self.e.log;
            let mut q = log.queue.lock();
            loop {
                if let Some(r) = q.checkpoint_written.take() {
                    break r;
                }
                log.work.wait(&mut q);
            }
        };
        self.finish_checkpoint(result);
    }

    /// The checkpoint thread is done with the checkpoint in flight: sync it, release what it
    /// made free, and tell its waiters.
    fn finish_checkpoint(&mut self, result: Result<Written, CheckpointError>) {
        let Some(mut inflight) = self.inflight.take() else {
            return;
        };
        if let Some(thread) = inflight.thread.take() {
            // It has nothing left to do but exit.
            let _ = thread.join();
        }
        let outcome = if self.log().failed() && result.is_ok() {
            // The log failed meanwhile: what it wrote stays unused (not counted, nothing
            // released); bringing the log back writes a checkpoint of its own.
            Err(io::Error::from(LogError::Failed))
        } else {
            self.complete_checkpoint(&inflight, result)
        };
        if let Err(e) = &outcome {
            tracing::error!(error = %e, "checkpoint failed");
        }
        for w in &inflight.waiters {
            w.complete(outcome.as_ref().map(|_| DROPPED).map_err(LogError::io));
        }
    }

    /// The second half of a checkpoint, once its image is written (or failed): a failed write
    /// fails the log; otherwise the device is synced, which makes the checkpoint durable: the one
    /// before it becomes the older one recovery may use, and segments sealed before it may be
    /// freed.
    fn complete_checkpoint(
        &mut self,
        inflight: &InFlight,
        result: Result<Written, CheckpointError>,
    ) -> io::Result<()> {
        let written = match result {
            Ok(w) => w,
            Err(e) => {
                self.fail(&e.to_string());
                return Err(e.to_io());
            }
        };
        let began = Instant::now();
        self.flush_device()?;
        Stats::add(&self.e.stats.checkpoint_sync_us, micros(began.elapsed()));
        self.checkpoint_number = inflight.number;
        self.checkpointed_seq = inflight.next_seq;
        self.last_checkpoint = Instant::now();
        // What was written while it was in flight is replayed after it.
        self.blocks_since_checkpoint = self
            .blocks_since_checkpoint
            .saturating_sub(inflight.blocks_at_snapshot);
        Stats::add(&self.e.stats.checkpoints, 1);
        let older = std::mem::replace(&mut self.newest_checkpoint, inflight.marks);
        self.log().older_checkpoint_saw(older);
        if !inflight.release.is_empty() {
            {
                let mut st = self.e.state.write();
                for &seg in &inflight.release {
                    st.segs.free_by_record(seg);
                }
            }
            crate::state::wait_for_readers(&self.e.state, &inflight.release);
            Stats::add(&self.e.stats.freed_segments, inflight.release.len() as u64);
            self.client_blocked = false;
        }
        tracing::debug!(
            number = inflight.number,
            entries = written.entries,
            older_seals = older.seals,
            "checkpoint"
        );
        Ok(())
    }

    /// A whole checkpoint on this thread, for bringing a failed log back ([`Writer::recover_log`]):
    /// nothing else is written meanwhile, and it does not refuse a failed log.
    fn write_checkpoint_now(&mut self) -> io::Result<()> {
        self.wait_for_checkpoint();
        let (job, inflight) = self.begin_checkpoint(Vec::new())?;
        let result = write_image(&self.e, &job);
        drop(job);
        self.complete_checkpoint(&inflight, result)
    }
}

/// Encodes a checkpoint straight into the buffer it is written from (one pass over the
/// snapshot, no intermediate copy) and writes it to its slot, unsynced. Runs on the checkpoint
/// thread, without the state lock.
fn write_image(e: &WriterParts, job: &Job) -> Result<Written, CheckpointError> {
    let began = Instant::now();
    let geo = e.geo;
    let snap = &job.snap;
    let frame = Frame {
        number: job.number,
        next_seq: job.next_seq,
        epoch: job.epoch,
        open: snap.open.map(|h| LogHead {
            segment: h.segment,
            used: h.used,
        }),
        free: &snap.free,
        entry_count: snap.slots.len() as u64,
        lost: &snap.lost,
    };
    let len = frame.encoded_len();
    if len > geo.checkpoint_slot_size {
        return Err(CheckpointError::TooBig {
            len,
            slot: geo.checkpoint_slot_size,
        });
    }
    let mut buf = AlignedBuf::zeroed(len as usize);
    let entries = snap.slots.live().map(|(slot, info)| CheckpointEntry {
        slot,
        lba: info.lba,
        dirty: info.dirty,
        crc: snap.crcs[slot as usize],
    });
    frame
        .encode_into(entries, &mut buf)
        .map_err(CheckpointError::Encode)?;
    let offset = geo.checkpoint_slot_offset((job.number % 2) as u32);
    // In slices, so that the log's writes queue behind one slice rather than behind the whole
    // image (tens of megabytes at a terabyte). A torn image is no worse than a torn single write:
    // the slot is only trusted once its checksum matches, and the other slot holds the last one.
    for (i, slice) in buf.chunks(CHECKPOINT_WRITE_SLICE).enumerate() {
        let at = offset + (i * CHECKPOINT_WRITE_SLICE) as u64;
        if let Err(err) = e.cache.write_at(slice, at, false) {
            Stats::add(&e.stats.cache_errors, 1);
            return Err(CheckpointError::Write(err));
        }
        Stats::add(&e.stats.cache_writes, 1);
        Stats::add(&e.stats.cache_write_bytes, slice.len() as u64);
    }
    Stats::add(&e.stats.checkpoint_write_us, micros(began.elapsed()));
    Ok(Written {
        entries: frame.entry_count,
    })
}

fn micros(d: Duration) -> u64 {
    d.as_micros().try_into().unwrap_or(u64::MAX)
}

/// True when every queued op is an append nobody waits for.
fn only_unawaited(q: &Queue, pending: &VecDeque<Op>) -> bool {
    q.system
        .iter()
        .chain(&q.client)
        .chain(pending)
        .all(|op| matches!(op, Op::Append(_, None)))
}

fn unawaited_blocks(q: &Queue) -> u32 {
    q.system
        .iter()
        .chain(&q.client)
        .map(|op| match op {
            Op::Append(r, _) => r.data_blocks(),
            _ => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use flashtier_io::BlockDev;
    use flashtier_testkit::{CrashDev, MemDev};

    use super::*;
    use crate::engine::{format, open_engine, FormatOptions};
    use crate::layout::superblock::BackingIdentity;
    use crate::log::Waiter;
    use crate::policy::Mode;

    /// A writer on a new write-through cache of 16-block segments, its thread not started: the
    /// test runs its rounds.
    fn idle_writer() -> Writer {
        let backing: Arc<dyn BlockDev> = Arc::new(MemDev::new(16 << 20));
        writer_on(Arc::new(MemDev::new(4 << 20)), backing, Mode::WriteThrough)
    }

    /// The backing store every test cache here is formatted for (16 MiB).
    fn backing_identity() -> BackingIdentity {
        BackingIdentity {
            size: 16 << 20,
            name: "/b.img".into(),
            fingerprint: Vec::new(),
        }
    }

    /// A writer on a cache of 16-block segments newly formatted on `cache` for `backing`, its
    /// thread not started.
    fn writer_on(cache: Arc<dyn BlockDev>, backing: Arc<dyn BlockDev>, mode: Mode) -> Writer {
        let ident = backing_identity();
        let opts = FormatOptions {
            segment_size: 64 << 10,
            mode,
            ..FormatOptions::default()
        };
        format(&*cache, ident.clone(), opts).unwrap();
        let (e, start, _) = open_engine(cache, backing, &ident, None).unwrap();
        let parts = WriterParts {
            cache: e.cache.clone(),
            geo: e.geo,
            state: e.state.clone(),
            log: e.log.clone(),
            stats: e.stats.clone(),
            guards: e.guards.clone(),
            reclaim: e.reclaim.clone(),
            started: e.started,
            // Nothing here reads blocks back after a failed sync.
            check_block: Arc::new(|_, _, _, _| unreachable!("no failed sync")),
        };
        Writer::new(parts, &start)
    }

    /// A ticket on a thread's waiter of its own, so that several can be outstanding at once.
    fn ticket() -> Ticket {
        std::thread::spawn(Waiter::ticket).join().unwrap()
    }

    /// The long campaign's failure (seed 0xc0ffee26, run 342): the log had no free segment left,
    /// not even in the reserve, so the vouching headers of a write-through write's sync could not
    /// be written; the sync returned anyway, the backing store was written, and damage to the
    /// write's batch then made it look like a torn tail, bringing back an older cached copy.
    #[test]
    fn a_vouched_sync_without_room_for_its_vouching_headers_is_answered_by_a_checkpoint() {
        let mut w = idle_writer();
        let e = w.e.clone();
        let bps = e.geo.blocks_per_segment();
        // Every free segment used up; the head is the last of them, empty.
        use_up_free_segments(&w);
        // Writes whose batches fill the head exactly: the largest batch, and one for the rest.
        let largest = bps - 1 - VOUCH_ROOM;
        let first = queue_write(&mut w, 0, largest);
        let appended = queue_write(&mut w, u64::from(largest), VOUCH_ROOM - 1);
        w.run_ops();
        assert!(first.wait().is_ok());
        let seq = appended.wait().unwrap().seq;
        assert_eq!(e.state.read().segs.head.unwrap().used, bps);

        let (client, system) = (ticket(), ticket());
        w.client_pending.push_back(Op::Sync(client.clone(), true));
        w.system_ops.push_back(Op::Sync(system.clone(), true));
        w.run_ops();
        assert!(w.durable > w.durable_in_batch, "no header vouches");
        assert!(
            !client.is_done() && !system.is_done(),
            "a sync returned unvouched"
        );
        assert!(w.checkpoint_wanted, "a checkpoint is to answer them");

        w.maybe_start_checkpoint();
        w.wait_for_checkpoint();
        assert!(client.wait().is_ok() && system.wait().is_ok());
        assert!(
            w.checkpointed_seq > seq,
            "the checkpoint covers the write ({} <= {seq})",
            w.checkpointed_seq
        );
    }

    /// A client write of `blocks` blocks, queued.
    fn queue_write(w: &mut Writer, lba: u64, blocks: u32) -> Ticket {
        let mut data =
            w.e.log
                .buffer(blocks as usize * w.e.geo.block_size as usize);
        data.fill(lba as u8);
        let rec = Record::new(Kind::Write, lba, blocks, Some(data)).dirty(true);
        let t = ticket();
        w.client_pending.push_back(Op::Append(rec, Some(t.clone())));
        t
    }

    /// Every free segment used up through the state alone (nothing written to them): seals the
    /// head and opens the next until none is free. Returns the segments sealed, in order; the
    /// head is then the last free one, empty.
    fn use_up_free_segments(w: &Writer) -> Vec<u32> {
        let mut st = w.e.state.write();
        let mut sealed = Vec::new();
        while st.segs.free_count() > 0 {
            if let Some(h) = st.segs.head {
                sealed.push(h.segment);
            }
            st.segs.seal_head();
            st.segs.open_next(w.next_seq);
        }
        sealed
    }

    /// Quarantines `segments` (reclaim emptied them) and frees them with FREE records, as
    /// `reclaim::free_reusable` does; returns once the log applied them.
    fn free_by_records(w: &mut Writer, segments: &[u32]) {
        {
            let mut st = w.e.state.write();
            for &s in segments {
                st.segs.quarantine(s);
            }
        }
        let freed: Vec<Ticket> = segments
            .iter()
            .map(|&s| {
                let t = ticket();
                let rec = Record::new(Kind::Free, 0, 1, None).aux(u64::from(s));
                w.system_ops.push_back(Op::Append(rec, Some(t.clone())));
                t
            })
            .collect();
        w.run_ops();
        for t in freed {
            assert!(t.wait().is_ok());
        }
    }

    /// A segment a FREE record freed is overwritten only once the record is durable and synced
    /// headers vouch for it: a crash could otherwise replay a checkpoint that maps blocks into
    /// it without the record, and damage to the record's batch would read as a torn tail and
    /// cut it (the long campaign, seed 0x90e510c5 run 2727).
    #[test]
    fn a_segment_freed_by_a_record_is_opened_once_synced_headers_vouch_for_it() {
        let mut w = idle_writer();
        let bps = w.e.geo.blocks_per_segment();
        // Every free segment used up, four of them emptied and freed.
        let emptied = use_up_free_segments(&w)[..4].to_vec();
        free_by_records(&mut w, &emptied);
        assert_eq!(w.e.state.read().segs.free_order(), emptied);
        let syncs = w.e.stats.cache_syncs.load(Ordering::Relaxed);
        let freed_end = w.next_seq;
        let left = w.e.state.read().segs.head.unwrap();
        assert!(left.used + VOUCH_ROOM <= bps, "the head kept room to vouch");
        // A write that does not fit the head opens the first of them.
        let t = queue_write(&mut w, 0, bps - 1);
        w.run_ops();
        assert!(t.wait().is_ok());
        assert_eq!(w.e.state.read().segs.head.unwrap().segment, emptied[0]);
        // A sync before the vouching headers, one after them.
        assert_eq!(w.e.stats.cache_syncs.load(Ordering::Relaxed), syncs + 2);
        assert!(w.vouched >= freed_end, "the FREE records are vouched for");
        // On the device: a record-less batch and the seal after the FREE records' batch, both
        // saying they are durable.
        let geo = w.e.geo;
        let mut block = AlignedBuf::zeroed(geo.block_size as usize);
        let mut header = |at: u32| {
            let slot = geo.first_slot(left.segment) + at;
            w.e.cache
                .read_at(&mut block, geo.slot_offset(slot))
                .unwrap();
            BatchHeader::decode(&block).unwrap()
        };
        let (vouch, seal) = (header(left.used), header(left.used + 1));
        assert_eq!(
            (vouch.kind, vouch.entries.len(), vouch.ordinal),
            (HeaderKind::Batch, 0, 1)
        );
        assert_eq!(seal.kind, HeaderKind::Seal);
        assert!(vouch.durable >= freed_end && seal.durable >= freed_end);
        // The next segment opened, freed by a record already synced, needs no sync of its own.
        let t = queue_write(&mut w, 0, bps - 1);
        w.run_ops();
        assert!(t.wait().is_ok());
        assert_eq!(w.e.state.read().segs.head.unwrap().segment, emptied[1]);
        assert_eq!(w.e.stats.cache_syncs.load(Ordering::Relaxed), syncs + 2);
    }

    /// Run 2727 of the long power-loss campaign (seed 0x90e510c5), rebuilt step by step: a
    /// durable dirty block, moved out of its segment by reclaim, which then frees the segment
    /// with a FREE record; the log goes on into that segment, and the power is cut after the
    /// new batch's data landed there but before its header did. Then any one sector of the
    /// newest headers before the cut is zeroed. Recovery must still find the block where the
    /// MOVE put it: if it took the damage for a torn tail and ended the log before the MOVE and
    /// FREE records, the block would map into the reused segment, over other data, and be lost.
    /// Before the fix (the head sealed without the vouching batch, then the sync) every header
    /// on the device said "durable up to the MOVE", and a zeroed first sector of the MOVE's own
    /// header did exactly that here (in run 2727 it was a sector of the seal).
    #[test]
    fn a_moved_dirty_block_survives_a_cut_during_reuse_of_its_segment_and_any_damaged_header() {
        const LBA: u64 = 98;
        let dev = Arc::new(CrashDev::new(4 << 20));
        let backing = Arc::new(MemDev::new(16 << 20));
        let mut w = writer_on(dev.clone(), backing.clone(), Mode::WriteBack);
        let e = w.e.clone();
        let geo = e.geo;
        let bps = geo.blocks_per_segment();
        let bs = geo.block_size as usize;
        let sync = |w: &mut Writer| {
            let t = ticket();
            w.client_pending.push_back(Op::Sync(t.clone(), false));
            w.run_ops();
            t.wait().unwrap();
        };

        // A client's write of the block, and its FLUSH.
        let t = queue_write(&mut w, LBA, 1);
        w.run_ops();
        t.wait().unwrap();
        sync(&mut w);
        let from = e.state.read().index.get(LBA).unwrap();
        let victim = geo.segment_of(from);

        // The log goes round: every other free segment used (by the state alone, as in the
        // tests above), and a checkpoint of that, so that recovery replays only what follows.
        use_up_free_segments(&w);
        w.write_checkpoint_now().unwrap();
        sync(&mut w);
        let head = e.state.read().segs.head.unwrap();
        assert_ne!(head.segment, victim);

        // Reclaim moves the block out, as `reclaim::move_forward` does, and frees its segment
        // (first in the free list) and three empty ones.
        let mut data = e.log.buffer(bs);
        dev.read_at(&mut data, geo.slot_offset(from)).unwrap();
        let moved = ticket();
        let rec = Record::new(Kind::Move, LBA, 1, Some(data)).aux(u64::from(from));
        w.system_ops.push_back(Op::Append(rec, Some(moved.clone())));
        w.run_ops();
        moved.wait().unwrap();
        assert_eq!(
            geo.segment_of(e.state.read().index.get(LBA).unwrap()),
            head.segment
        );
        let emptied: Vec<u32> = {
            let st = e.state.read();
            let others = (0..geo.segment_count)
                .filter(|&s| s != victim && s != head.segment && st.segs.live(s) == 0)
                .take(3);
            std::iter::once(victim).chain(others).collect()
        };
        free_by_records(&mut w, &emptied);
        assert_eq!(e.state.read().segs.free_order()[0], victim);

        // A write that does not fit the head opens the freed segment and overwrites it whole.
        let reuse = queue_write(&mut w, 0, bps - 1);
        w.run_ops();
        reuse.wait().unwrap();
        assert_eq!(e.state.read().segs.head.unwrap().segment, victim);

        // The power cut: what was synced, and the new batch's data without its header.
        let mut cut = dev.snapshot_durable();
        let view = dev.view();
        let data_start = geo.slot_offset(geo.first_slot(victim) + 1) as usize;
        let data_end = geo.slot_offset(geo.first_slot(victim) + bps) as usize;
        assert!((data_start..data_end).contains(&(geo.slot_offset(from) as usize)));
        cut[data_start..data_end].copy_from_slice(&view[data_start..data_end]);

        // The headers written after the checkpoint, in the segment the MOVE went to.
        let headers: Vec<u32> = (head.used..bps)
            .map(|at| geo.first_slot(head.segment) + at)
            .filter(|&slot| {
                let at = geo.slot_offset(slot) as usize;
                BatchHeader::decode(&cut[at..at + bs]).is_ok()
            })
            .collect();
        assert!(
            headers.len() >= 3,
            "the MOVE's, the FREE records' and the seal"
        );

        let recovered = |image: &[u8], what: &str| {
            let cache = Arc::new(CrashDev::from_image(image.to_vec()));
            let c = crate::Cache::open(cache, backing.clone(), &backing_identity(), None)
                .unwrap_or_else(|err| panic!("{what}: recovery refused the cache: {err}"));
            let mut block = vec![0u8; bs];
            let read = c.read_at(&mut block, LBA * bs as u64);
            assert!(read.is_ok(), "{what}: the moved block was lost: {read:?}");
            assert!(
                block.iter().all(|&b| b == LBA as u8),
                "{what}: the moved block reads wrong data"
            );
        };
        recovered(&cut, "no damage");
        for &slot in &headers {
            for sector in 0..(bs / 512) {
                let mut damaged = cut.clone();
                let at = geo.slot_offset(slot) as usize + sector * 512;
                damaged[at..at + 512].fill(0);
                recovered(&damaged, &format!("slot {slot} sector {sector} zeroed"));
            }
        }
    }

    #[test]
    fn a_batch_ends_where_the_head_segment_does() {
        let mut w = idle_writer();
        let bps = w.e.geo.blocks_per_segment();
        let first = queue_write(&mut w, 0, bps - 6);
        w.run_ops();
        assert!(first.wait().is_ok());
        let head = w.e.state.read().segs.head.unwrap();
        assert_eq!(head.used, bps - 5);
        // Three 2-block writes in one round: the first two and their header fill the head's last
        // 5 slots exactly, the third starts the next segment. As one batch (7 slots) they would
        // have sealed the head and left its 5 slots unused.
        let tickets: Vec<Ticket> = (0..3)
            .map(|i| queue_write(&mut w, 100 + 2 * i, 2))
            .collect();
        w.run_ops();
        for t in tickets {
            assert!(t.wait().is_ok());
        }
        let st = w.e.state.read();
        assert_eq!(w.e.stats.sealed_unused_blocks.load(Ordering::Relaxed), 0);
        let now = st.segs.head.unwrap();
        assert_ne!(now.segment, head.segment);
        assert_eq!(now.used, 3, "the third write and its header");
        assert_eq!(
            st.segs.state(head.segment),
            crate::segments::SegState::Sealed
        );
    }

    #[test]
    fn a_record_too_large_for_the_head_seals_it_and_counts_what_is_left() {
        let mut w = idle_writer();
        let bps = w.e.geo.blocks_per_segment();
        queue_write(&mut w, 0, bps - 6);
        w.run_ops();
        // 6 slots needed, 5 left: the head is sealed (the seal header is one of the 5).
        let t = queue_write(&mut w, 100, 5);
        w.run_ops();
        assert!(t.wait().is_ok());
        assert_eq!(w.e.stats.sealed_unused_blocks.load(Ordering::Relaxed), 5);
    }

    /// A client batch that does not fit the head when only the reserve is free waits without
    /// sealing the head (bench/results/reclaim_livelock/: sealing it made it reclaim's next
    /// victim, round after round, while the batch kept waiting).
    #[test]
    fn a_client_batch_waiting_for_space_keeps_the_head() {
        let mut w = idle_writer();
        let bps = w.e.geo.blocks_per_segment();
        queue_write(&mut w, 0, bps - 5);
        w.run_ops();
        let head = w.e.state.read().segs.head.expect("a head");
        assert_eq!(head.used, bps - 4, "4 slots left");
        {
            let mut st = w.e.state.write();
            while st.segs.free_count() > RESERVE {
                let s = st.segs.next_free().unwrap();
                st.segs.open_specific(s, 0);
                st.segs.seal_head();
            }
            st.segs.set_head(head);
        }
        let t = queue_write(&mut w, 100, 6);
        w.run_ops();
        assert!(!t.is_done(), "no room: it waits for reclaim");
        assert!(w.client_blocked);
        assert_eq!(
            w.e.state.read().segs.head,
            Some(head),
            "the head was sealed"
        );
        assert_eq!(w.e.stats.sealed_unused_blocks.load(Ordering::Relaxed), 0);
        // A write that fits the head still goes in.
        w.client_blocked = false;
        w.client_pending.clear();
        let small = queue_write(&mut w, 200, 2);
        w.run_ops();
        assert!(small.wait().is_ok());
    }
}
