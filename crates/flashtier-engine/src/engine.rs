//! The engine's shared state, and formatting, opening and closing a cache device.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flashtier_io::{AlignedBuf, BlockDev};
use parking_lot::{Mutex, RwLock};

use crate::backing::Backing;
use crate::guards::Guards;
use crate::health::BackingOp;
use crate::layout::checkpoint::Checkpoint;
use crate::layout::superblock::{BackingIdentity, Superblock};
use crate::layout::Geometry;
use crate::log::{self, Log, LogStart};
use crate::mailbox::Mailbox;
use crate::policy::{Mode, ReclaimPolicy, RequestHistory};
use crate::recover;
use crate::state::State;
use crate::stats::Stats;
use crate::tunables::Tunables;
use crate::writeback_control::WritebackHandle;
use crate::EngineError;

/// Default cache block.
pub const DEFAULT_BLOCK_SIZE: u32 = 4096;
/// Default segment: large enough for sequential device writes and a 1 MiB atomic record.
pub const DEFAULT_SEGMENT_SIZE: u32 = 4 << 20;
/// Largest write applied as one record (all-or-nothing after a crash).
pub const MAX_ATOMIC_WRITE: u32 = 1 << 20;

/// Everything the engine's threads share: each component owns its state and its locks (the
/// log, the index and segments, the backing store, the live parameters, the request history, the
/// reclaim and cleaner mailboxes); this is where they meet. `open_engine` builds it, and
/// `Cache::open` starts the threads that take it (the composition root).
pub struct Engine {
    pub(crate) cache: Arc<dyn BlockDev>,
    pub(crate) backing: Backing,
    pub(crate) geo: Geometry,
    pub(crate) state: Arc<RwLock<State>>,
    pub(crate) log: Arc<Log>,
    pub(crate) guards: Arc<Guards>,
    pub(crate) stats: Arc<Stats>,
    /// The live parameters, the reclaim policy among them.
    pub(crate) tunables: Tunables,
    /// What the request plan remembers between requests.
    pub(crate) history: RequestHistory,
    pub(crate) superblock: Mutex<Superblock>,
    mode: AtomicU8,
    /// Shared by every client write while it decides by the mode and carries it out; exclusive
    /// for what needs no write in flight (a mode switch, detach, forget-lost).
    pub(crate) writes_gate: RwLock<()>,
    /// The blocks each write holds (see `range_lock`): exclusively for a read-modify-write of
    /// partial blocks, shared for whole blocks.
    pub(crate) write_ranges: crate::range_lock::RangeLock,
    /// Cleaning passes run one at a time.
    pub(crate) passes: crate::pass_gate::PassGate,
    /// The reclaim thread's mailbox.
    pub(crate) reclaim: Arc<Mailbox>,
    /// One reclaim at a time (the background thread or `Cache::reclaim_now`): two would pick
    /// the same victim.
    pub(crate) reclaim_turn: Mutex<()>,
    /// The background cleaner's mailbox and report.
    pub(crate) writeback: WritebackHandle,
    pub(crate) started: Instant,
    /// Blocks of the backing store the cache covers (a partial last block is not cached).
    pub(crate) cached_blocks: u64,
    /// Bytes of the largest single record.
    pub(crate) atomic_bytes: u32,
    /// What recovery found damaged when this cache was opened.
    pub(crate) recovery_damage: Vec<crate::recover::Damage>,
    /// Where reclaim hands the clean blocks it evicts (`handoff.rs`), if anywhere.
    pub(crate) victim_sink: RwLock<Option<Arc<dyn crate::victim_sink::VictimSink>>>,
}

impl Engine {
    pub fn mode(&self) -> Mode {
        Mode::from_u8(self.mode.load(Ordering::Acquire)).unwrap_or_default()
    }

    pub(crate) fn set_mode_flag(&self, mode: Mode) {
        self.mode.store(mode as u8, Ordering::Release);
    }

    pub fn reclaim_policy(&self) -> ReclaimPolicy {
        self.tunables.reclaim_policy()
    }

    /// Seconds since the engine started, for LRU ages and n-hit windows.
    pub(crate) fn now_secs(&self) -> u32 {
        self.started.elapsed().as_secs() as u32
    }

    /// Reclaim runs when free segments drop to this many.
    pub(crate) fn reclaim_low_water(&self) -> usize {
        log::reclaim_low_water(self.geo.segment_count)
    }

    /// Reclaim stops once this many segments are free or waiting for a checkpoint.
    pub(crate) fn reclaim_target(&self) -> usize {
        self.reclaim_low_water() + 1 + self.geo.segment_count as usize / 64
    }

    /// Counts and records a backing store error (which degrades the volume until the backing
    /// store works again).
    pub(crate) fn backing_failed(&self, op: BackingOp, err: &std::io::Error) {
        Stats::add(&self.stats.backing_errors, 1);
        self.backing.health.failed(op, err);
    }
}

/// Parameters of `format`.
#[derive(Debug, Clone, Copy)]
pub struct FormatOptions {
    /// Cache block size in bytes (a power of two, 4 KiB..64 KiB).
    pub block_size: u32,
    /// Segment size in bytes (a multiple of the block size, at least 16 blocks).
    pub segment_size: u32,
    /// The mode the cache opens in unless told otherwise.
    pub mode: Mode,
    /// Which segment reclaim empties first.
    pub reclaim: ReclaimPolicy,
}

impl Default for FormatOptions {
    fn default() -> Self {
        FormatOptions {
            block_size: DEFAULT_BLOCK_SIZE,
            segment_size: DEFAULT_SEGMENT_SIZE,
            mode: Mode::WriteBack,
            reclaim: ReclaimPolicy::Lru,
        }
    }
}

/// Writes an empty cache onto `dev` for `backing`: an empty checkpoint in both slots, then both
/// superblock copies. Overwrites whatever was there; the caller checks first.
pub fn format(
    dev: &dyn BlockDev,
    backing: BackingIdentity,
    opts: FormatOptions,
) -> Result<Superblock, EngineError> {
    let geometry = Geometry::compute(dev.info().size, opts.block_size, opts.segment_size)?;
    if backing.size / opts.block_size as u64 > crate::index::Index::MAX_LBA {
        return Err(EngineError::Invalid(format!(
            "the backing store ({} bytes) has more blocks than the index can address; use a \
             larger --block-size",
            backing.size
        )));
    }
    if backing.size < opts.block_size as u64 {
        return Err(EngineError::Invalid(format!(
            "the backing store ({} bytes) is smaller than one cache block",
            backing.size
        )));
    }
    let mut uuid = [0u8; 16];
    flashtier_io::sys::fill_random(&mut uuid).map_err(EngineError::CacheIo)?;
    let empty = Checkpoint {
        number: 0,
        next_seq: 1,
        epoch: 1,
        open: None,
        free: (0..geometry.segment_count).collect(),
        entries: Vec::new(),
        lost: Vec::new(),
    };
    let bytes = empty.encode();
    let mut buf = AlignedBuf::zeroed(bytes.len());
    buf.copy_from_slice(&bytes);
    let io = EngineError::CacheIo;
    // Checkpoint number 0 belongs in slot 0; slot 1 is cleared so an old cache's checkpoint
    // cannot be mistaken for this one's.
    dev.write_at(&buf, geometry.checkpoint_slot_offset(0), false)
        .map_err(io)?;
    let zero = AlignedBuf::zeroed(4096);
    dev.write_at(&zero, geometry.checkpoint_slot_offset(1), false)
        .map_err(io)?;
    // The first header of segment 0 must not look like a batch of a previous cache.
    dev.write_at(
        &AlignedBuf::zeroed(geometry.block_size as usize),
        geometry.data_offset,
        false,
    )
    .map_err(io)?;
    dev.flush().map_err(io)?;
    let mut sb = Superblock {
        generation: 1,
        uuid,
        geometry,
        device_size: dev.info().size,
        backing,
        epoch: 1,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        default_mode: opts.mode,
        reclaim: opts.reclaim,
        clean_shutdown: true,
    };
    recover::write_superblock(dev, &sb).map_err(io)?;
    sb.generation = 2;
    recover::write_superblock(dev, &sb).map_err(io)?;
    Ok(sb)
}

/// What opening a cache found.
#[derive(Debug, Clone)]
pub struct OpenReport {
    /// Whether the cache was closed cleanly (nothing to replay beyond the checkpoint).
    pub clean_shutdown: bool,
    /// The checkpoint recovery started from.
    pub checkpoint_number: u64,
    /// Log batches replayed on top of it.
    pub replayed_batches: u64,
    /// Records in those batches.
    pub replayed_records: u64,
    /// How long opening took.
    pub recovery_time: Duration,
    /// Blocks cached once opened.
    pub cached_blocks: u64,
    /// Of those, blocks not yet written back.
    pub dirty_blocks: u64,
    /// What recovery found damaged, and how it handled it (empty when all was well).
    pub damage: Vec<crate::recover::Damage>,
    /// Blocks whose newest data is lost (reads fail until they are written again).
    pub lost_blocks: u64,
    /// Segments recovery found the log in by scanning the device (see `recover`).
    pub segments_found_by_scan: u64,
    /// Where replay ended: the sequence number of the first record not recovered (the log goes
    /// on from there).
    pub log_end: u64,
}

/// Reads the superblock, checks it belongs to `backing`, recovers, and marks the cache in use
/// (a new epoch, the clean-shutdown flag cleared). Nothing is written unless every check passes.
pub(crate) fn open_engine(
    cache: Arc<dyn BlockDev>,
    backing: Arc<dyn BlockDev>,
    identity: &BackingIdentity,
    mode: Option<Mode>,
) -> Result<(Arc<Engine>, LogStart, OpenReport), EngineError> {
    let (sb, sb_damage) = recover::read_superblock_checked(&*cache)?;
    // The device itself has the last word on its size.
    let real = BackingIdentity {
        size: backing.info().size,
        ..identity.clone()
    };
    let check = sb.backing.check(&real);
    if !check.mismatches.is_empty() {
        return Err(EngineError::WrongBacking {
            expected: Box::new(sb.backing.clone()),
            found: Box::new(real),
            mismatches: check.mismatches,
        });
    }
    if cache.info().read_only {
        return Err(EngineError::Invalid("the cache device is read-only".into()));
    }
    // Whatever the backing store holds in its volatile cache (written before a restart of this
    // process) becomes durable now: promotions may cache it, and a FLUSH after this open need
    // not know what was written before it.
    backing.flush().map_err(EngineError::BackingIo)?;
    let mut recovered = recover::recover(&*cache, &sb)?;
    let geo = sb.geometry;
    let mut damage = sb_damage;
    damage.append(&mut recovered.damage);
    for d in &damage {
        if d.loses_data() {
            tracing::error!("recovery: {d}");
        } else {
            tracing::warn!("recovery: {d}");
        }
    }

    // From here on the device changes: repair a torn tail, then start a new epoch.
    if let Some((offset, header)) = &recovered.truncate_batch {
        cache
            .write_at(header, *offset, false)
            .and_then(|()| cache.flush())
            .map_err(EngineError::CacheIo)?;
    }
    let mut new_sb = sb.clone();
    if !check.changes.is_empty() {
        let changes: Vec<String> = check.changes.iter().map(ToString::to_string).collect();
        tracing::warn!(
            "the backing store changed in ways that leave it the same store: {} (recorded)",
            changes.join("; ")
        );
        new_sb.backing = real;
    }
    new_sb.generation += 1;
    // A damaged superblock copy may have been the newer one, whose epoch (one more than the
    // other's, at most) some batches may carry: never reuse it.
    let lost_epoch = damage
        .iter()
        .any(|d| matches!(d, recover::Damage::SuperblockCopy { .. })) as u64;
    new_sb.epoch = (sb.epoch + lost_epoch).max(recovered.epoch) + 1;
    new_sb.clean_shutdown = false;
    // Written to the copy the chosen one is not: this repairs a damaged copy.
    recover::write_superblock(&*cache, &new_sb).map_err(EngineError::CacheIo)?;

    let report = {
        let st = &recovered.state;
        OpenReport {
            clean_shutdown: sb.clean_shutdown,
            checkpoint_number: recovered.checkpoint_number,
            replayed_batches: recovered.replayed_batches,
            replayed_records: recovered.replayed_records,
            recovery_time: recovered.elapsed,
            cached_blocks: st.segs.total_live(),
            dirty_blocks: st.segs.total_dirty(),
            damage: damage.clone(),
            lost_blocks: st.lost.blocks(),
            segments_found_by_scan: recovered.segments_found_by_scan,
            log_end: recovered.next_seq,
        }
    };
    // A record and its header, with room left for a seal and for vouching (see `log_writer`).
    let atomic_bytes = MAX_ATOMIC_WRITE
        .min((geo.blocks_per_segment() - 2 - crate::log::VOUCH_ROOM) * geo.block_size);
    let engine = Engine {
        cache,
        backing: Backing::new(backing),
        geo,
        state: Arc::new(RwLock::new(recovered.state)),
        log: Arc::new(Log::new(atomic_bytes as usize)),
        guards: Arc::default(),
        stats: Arc::default(),
        tunables: Tunables::opened_with(new_sb.reclaim),
        history: RequestHistory::new(geo.slot_count() as u64),
        superblock: Mutex::new(new_sb.clone()),
        mode: AtomicU8::new(mode.unwrap_or(new_sb.default_mode) as u8),
        writes_gate: RwLock::new(()),
        write_ranges: Default::default(),
        passes: Default::default(),
        reclaim: Arc::default(),
        reclaim_turn: Mutex::new(()),
        writeback: Default::default(),
        started: Instant::now(),
        cached_blocks: sb.backing.size / geo.block_size as u64,
        atomic_bytes,
        recovery_damage: damage,
        victim_sink: RwLock::new(None),
    };
    let engine_damage_empty = engine.recovery_damage.is_empty();
    let lost_at_open: u64 = engine
        .recovery_damage
        .iter()
        .map(|d| match d {
            recover::Damage::Record { blocks, .. } => *blocks as u64,
            _ => 0,
        })
        .sum();
    Stats::add(&engine.stats.lost_blocks, lost_at_open);
    let start = LogStart {
        next_seq: recovered.next_seq,
        replayed_blocks: recovered.replayed_blocks,
        epoch: new_sb.epoch,
        checkpoint_number: recovered.checkpoint_number,
        last_header: recovered.last_header,
        log_id: crate::layout::batch::log_id(&new_sb.uuid),
        checkpoint_now: !engine_damage_empty,
    };
    Ok((Arc::new(engine), start, report))
}

/// Flushes the backing store; afterwards promotions may cache what it holds.
pub(crate) fn flush_backing(e: &Engine) -> std::io::Result<()> {
    let began = e.guards.flush_begins();
    e.backing
        .dev
        .flush()
        .inspect_err(|err| e.backing_failed(BackingOp::Flush, err))?;
    Stats::add(&e.stats.backing_flushes, 1);
    e.guards.flushed(began);
    Ok(())
}

/// Marks the cache cleanly shut down (after the final checkpoint).
pub(crate) fn mark_clean(e: &Engine) -> std::io::Result<()> {
    let mut sb = e.superblock.lock();
    sb.generation += 1;
    sb.clean_shutdown = true;
    sb.default_mode = e.mode();
    sb.reclaim = e.reclaim_policy();
    recover::write_superblock(&*e.cache, &sb)
}
