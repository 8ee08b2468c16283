//! Power loss while concurrent writers are running.
//!
//! Each run formats a tiny cache (1 or 2 MiB, segments of 64 or 128 KiB) in front of a 4 MiB
//! backing store and starts 2 to 4 writer threads. Each writes verifiable data: every 512-byte
//! sector carries a stamp (unit id, block, sector) followed by bytes derived from it, so any
//! sector of a recovered image says exactly which write (or the initial content, or zeroes) it
//! came from, and a torn sector is garbage. Writers mostly write in a private region (sequential
//! per block), sometimes in a region shared by all of them; sizes run up to twice the atomic
//! size; some are FUA; a quarter of the others go in a batch with 1 to 4 more writes
//! (`write_batch`, as the NBD server batches pipelined WRITEs; the batch's writes do not overlap
//! one another, and each is an op that started and ended with the batch); they flush, trim, write zeroes, read back their private blocks (checked)
//! and call `write_back_all`. The workload writes ~10x the cache size, so reclaim (cleaning,
//! eviction, copy-forward) and checkpoints run all the time. Some runs switch modes live from a
//! controller thread (all four modes). Half the runs set a sequential write cutoff (4 to 64 KiB;
//! writes then often continue the thread's previous one), so writes past it go around the cache
//! in write-back and write-through; the check treats every write that may have (longer than the
//! cutoff, or continuing a write that started before it ended) as a bypass.
//!
//! **Power losses.** Both devices sit on one power rail (see `common`): a power loss is the pair
//! of crash images taken at one instant while the rail is held, so no request of either device is
//! half-done and I/O is in flight on the other threads. The run then continues on the live
//! devices (equivalent for what the images contain, and many power losses per run);
//! `power_cut_under_concurrent_writers` below instead kills the devices under the writers. Power
//! is lost at:
//! - random instants, from a controller thread;
//! - right after the Nth device write (random N over the whole run);
//! - in the middle of a checkpoint (right after a write to a checkpoint slot, before its flush);
//! - in the middle of reclaim / cleaning (right after a write to the backing store);
//! - during a mode switch (the Kth device write after `set_mode` started);
//!
//! each with a policy drawn from drop / keep / tear (512-byte and 4 KiB sectors) / mixed. Each
//! image pair is opened and the whole export read. Then, for many of them, **power is lost again
//! during recovery** (right after the Kth write that `Cache::open` makes), and again right after
//! the recovered cache was read, repeatedly: the first must still satisfy the contract, the others
//! must read exactly like the first recovery.
//!
//! **The check** (clock: one atomic counter; every operation records when it started and when it
//! returned; a power loss happens at one tick `T`):
//! - no garbage: every sector is a valid stamp of its own position, zeroes, or the initial data;
//! - no phantom: a stamp's write started before `T`;
//! - durability: a write acknowledged before `T` with FUA, or followed by a FLUSH that started
//!   after it returned and was acknowledged before `T`, shows in each of its sectors, unless a
//!   write that may be newer (did not end before it started) shows there instead;
//! - atomicity: a write that went through the cache's log (write-back, write-through; each atomic
//!   unit of it) is all there or not at all (a sector may show a possibly newer write instead);
//! - prefix consistency: if any write W shows anywhere, every logged write that returned before W
//!   started is entirely there (or replaced by possibly newer writes); the atomic units of one
//!   write are applied in order;
//! - no stale data: follows from the above (an older value in place of a durable or required
//!   write is an error); write-zeroes reads as zero; trimmed blocks accept anything until a
//!   durable write covers them.
//! - at the end of each run (no crash), every sector shows a write that no other write of that
//!   sector followed (the device behaves like a disk).
//!
//! Nothing is steered around: writers read back blocks that a write-around write may have left
//! volatile on the backing store, FLUSHes run concurrently, writes are in flight while the mode
//! switches (also to pass-through), several threads write the same blocks in every mode, and
//! whole-export reads use the run's reclaim policy (LRU or FIFO).
//!
//! Default: >= 1000 power losses checked; `FLASHTIER_LONG=1`: >= 50,000. A failed run does not
//! stop the campaign; every failure is printed with the base seed and the run number, and
//! `FLASHTIER_SEED=<seed> FLASHTIER_RUN=<run>` repeats just that run. A run that takes longer
//! than `FLASHTIER_RUN_TIMEOUT` seconds (default 120; runs take well under one) counts as hung;
//! the report says what it was doing (and the live cache's status and counters).

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use flashtier_engine::internals::batch::{self, BatchHeader};
use flashtier_engine::internals::checkpoint::Checkpoint;
use flashtier_engine::Geometry;
use flashtier_engine::{read_superblock, Cache, Damage, Mode, ReclaimPolicy, Superblock};
use flashtier_io::{BatchWrite, BlockDev, ZeroOpts};
use flashtier_testkit::{CrashDev, CrashPolicy};

const BACKING: u64 = 4 << 20;
const BLOCKS: u64 = BACKING / BS;
const SECTOR: u64 = 512;
const SPB: u64 = BS / SECTOR;
const MAGIC: u32 = 0x5453_5446;
/// Unit 0: the initial content of the backing store.
const INIT: u32 = 0;

// ---------------------------------------------------------------------------------------------
// Stamped data
// ---------------------------------------------------------------------------------------------

fn stamp_sector(out: &mut [u8], unit: u32, lba: u64, sector: u64) {
    out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&unit.to_le_bytes());
    out[8..16].copy_from_slice(&lba.to_le_bytes());
    out[16..20].copy_from_slice(&(sector as u32).to_le_bytes());
    let mut r = Rng::new(mix(unit as u64, lba * SPB + sector));
    for w in out[20..].chunks_mut(8) {
        let v = r.next_u64().to_le_bytes();
        w.copy_from_slice(&v[..w.len()]);
    }
}

fn stamp_blocks(unit: u32, lba: u64, n: u64, out: &mut [u8]) {
    for b in 0..n {
        for s in 0..SPB {
            let at = ((b * SPB + s) * SECTOR) as usize;
            stamp_sector(&mut out[at..at + SECTOR as usize], unit, lba + b, s);
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum V {
    Zero,
    Unit(u32),
    Garbage,
}

fn parse(image: &[u8], lba: u64, s: u64, scratch: &mut [u8]) -> V {
    parse_in(image, lba, lba, s, scratch)
}

/// Sector `s` of the `index`th block of `buf`, which holds block `lba`.
fn parse_in(buf: &[u8], index: u64, lba: u64, s: u64, scratch: &mut [u8]) -> V {
    let at = ((index * SPB + s) * SECTOR) as usize;
    let image = buf;
    let sec = &image[at..at + SECTOR as usize];
    if sec.iter().all(|&b| b == 0) {
        return V::Zero;
    }
    if sec[0..4] != MAGIC.to_le_bytes() {
        return V::Garbage;
    }
    let unit = u32::from_le_bytes(sec[4..8].try_into().unwrap());
    stamp_sector(scratch, unit, lba, s);
    if scratch == sec {
        V::Unit(unit)
    } else {
        V::Garbage
    }
}

// ---------------------------------------------------------------------------------------------
// The record of what happened
// ---------------------------------------------------------------------------------------------

/// What damage to the cache device may legitimately break in [`History::check_damaged`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Relax {
    /// Nothing: the full contract.
    None,
    /// Recovery ended the log at a damaged batch no header vouched for (indistinguishable from a
    /// torn tail): what comes back is still a prefix of the history, but flushed writes from the
    /// cut on may be gone.
    Durability,
    /// Records lost with their headers (`Damage::Unknown`): their blocks may read older data, so
    /// neither durability nor prefix order holds; no garbage, no phantom and atomicity still do
    /// (but for writes the backing store may hold torn: see `History::backing_may_hold_torn`).
    Order,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Write,
    Zeroes,
    Trim,
    Flush,
}

#[derive(Debug, Clone)]
struct OpRec {
    thread: usize,
    kind: Kind,
    lba: u64,
    n: u64,
    fua: bool,
    /// Atomic units (chunks) of a write: `(unit id, first block, blocks)`.
    units: Vec<(u32, u64, u64)>,
    start: u64,
    end: u64,
    ok: bool,
}

#[derive(Debug, Clone, Copy)]
struct Switch {
    start: u64,
    end: u64,
    to: Mode,
}

struct Snap {
    t: u64,
    label: String,
    images: Vec<Vec<u8>>,
}

/// Everything the checks need, frozen after the run.
struct History {
    ops: Vec<OpRec>,
    /// unit id → op index.
    unit_op: HashMap<u32, usize>,
    /// Per block: indices of write/zero/trim ops touching it, in start order.
    per_block: Vec<Vec<usize>>,
    initial_mode: Mode,
    switches: Vec<Switch>,
    /// Per op: a write that may have gone around the cache past the write cutoff.
    maybe_past_cutoff: Vec<bool>,
}

impl History {
    /// `cutoff`: the sequential write cutoff in bytes (0: off).
    fn new(mut ops: Vec<OpRec>, initial_mode: Mode, switches: Vec<Switch>, cutoff: u64) -> History {
        ops.sort_by_key(|o| o.start);
        // Past the cutoff: longer than it, or continuing a write that started before this one
        // ended (the engine's stream table is shared by all threads).
        let maybe_past_cutoff = ops
            .iter()
            .map(|o| {
                cutoff > 0
                    && o.kind == Kind::Write
                    && (o.n * BS > cutoff
                        || ops.iter().any(|p| {
                            p.kind == Kind::Write && p.lba + p.n == o.lba && p.start < o.end
                        }))
            })
            .collect();
        let mut unit_op = HashMap::new();
        let mut per_block = vec![Vec::new(); BLOCKS as usize];
        for (i, o) in ops.iter().enumerate() {
            for &(u, _, _) in &o.units {
                unit_op.insert(u, i);
            }
            if o.kind != Kind::Flush {
                for b in o.lba..o.lba + o.n {
                    per_block[b as usize].push(i);
                }
            }
        }
        History {
            ops,
            unit_op,
            per_block,
            initial_mode,
            switches,
            maybe_past_cutoff,
        }
    }

    /// Whether the write went through the cache's log (known mode write-back / write-through,
    /// no mode switch overlapping it, surely not past the write cutoff).
    fn logged(&self, i: usize) -> bool {
        let o = &self.ops[i];
        if o.kind != Kind::Write || self.maybe_past_cutoff[i] {
            return false;
        }
        matches!(self.mode_of(i), Some(Mode::WriteBack | Mode::WriteThrough))
    }

    /// The mode op `i` ran in; `None` if a mode switch overlapped it.
    fn mode_of(&self, i: usize) -> Option<Mode> {
        let o = &self.ops[i];
        let mut mode = self.initial_mode;
        for s in &self.switches {
            if s.start < o.end && o.start < s.end {
                return None;
            }
            if s.end < o.start {
                mode = s.to;
            }
        }
        Some(mode)
    }

    /// A logged write the backing store may hold torn at `t`. Its log record is what keeps it
    /// whole; once records are lost with their headers (`Relax::Order`) the cache's copy of it
    /// may be gone and reads see the backing store's. A write-through write: written there but
    /// not flushed (found by the long campaign: two damaged headers and a write torn at power
    /// loss). A write-back write: the cleaner may have been writing it back, and it marks blocks
    /// clean only after flushing the backing store, so a power loss in between may leave part of
    /// it there (found by the long campaign, seed 0xb0a710ad run 1445: a batch header and its
    /// copy damaged, the write in it shown half by the backing store).
    fn backing_may_hold_torn(&self, i: usize, t: u64) -> bool {
        self.logged(i)
            && match self.mode_of(i) {
                Some(Mode::WriteThrough) => !self.durable(i, t),
                Some(Mode::WriteBack) => true,
                _ => false,
            }
    }

    /// Durable at `t`: acknowledged with FUA, or followed by an acknowledged FLUSH.
    fn durable(&self, i: usize, t: u64) -> bool {
        let o = &self.ops[i];
        if !o.ok || o.end >= t {
            return false;
        }
        if o.fua && o.kind != Kind::Trim {
            return true;
        }
        self.ops
            .iter()
            .any(|f| f.kind == Kind::Flush && f.ok && f.start > o.end && f.end < t)
    }

    /// `v` (at a sector of a block written by op `x`) is `x`'s own data or possibly newer.
    fn not_older(&self, x: usize, v: V, block: u64, t: u64) -> bool {
        let ox = &self.ops[x];
        match v {
            V::Garbage => false,
            V::Unit(INIT) => false,
            V::Unit(u) => match self.unit_op.get(&u) {
                Some(&z) => z == x || self.ops[z].end >= ox.start,
                None => false,
            },
            V::Zero => self.per_block[block as usize].iter().any(|&z| {
                let oz = &self.ops[z];
                matches!(oz.kind, Kind::Zeroes | Kind::Trim)
                    && oz.start < t
                    && (z == x || oz.end >= ox.start)
            }),
        }
    }

    /// Blocks whose content is unspecified at `t`: trimmed, not covered by a durable write since.
    fn free_blocks(&self, t: u64) -> Vec<bool> {
        self.free_blocks_unless(t, |_| true)
    }

    /// [`History::free_blocks`], counting only the durable writes `kept` says are there as
    /// covering a trim.
    fn free_blocks_unless(&self, t: u64, kept: impl Fn(usize) -> bool) -> Vec<bool> {
        let mut free = vec![false; BLOCKS as usize];
        for (b, ops) in self.per_block.iter().enumerate() {
            for &i in ops {
                let tr = &self.ops[i];
                if tr.kind != Kind::Trim || tr.start >= t {
                    continue;
                }
                let covered = ops.iter().any(|&j| {
                    let o = &self.ops[j];
                    o.kind != Kind::Trim && o.start > tr.end && self.durable(j, t) && kept(j)
                });
                if !covered {
                    free[b] = true;
                }
            }
        }
        free
    }

    fn describe(&self, i: usize) -> String {
        let o = &self.ops[i];
        format!(
            "op {i} (thread {} {:?} blocks {}+{}{} [{}..{}] {} {})",
            o.thread,
            o.kind,
            o.lba,
            o.n,
            if o.fua { " fua" } else { "" },
            o.start,
            o.end,
            if o.ok { "ok" } else { "FAILED" },
            if self.logged(i) { "logged" } else { "bypass" }
        )
    }

    /// Every operation on block `b` and every mode switch, for failure messages.
    fn block_story(&self, b: u64) -> String {
        let mut out = format!("operations on block {b}:");
        for &i in &self.per_block[b as usize] {
            out += &format!("\n  {}", self.describe(i));
        }
        out += &format!("\nmode switches (initially {}):", self.initial_mode);
        for s in &self.switches {
            out += &format!("\n  [{}..{}] -> {}", s.start, s.end, s.to);
        }
        out
    }

    fn describe_v(&self, v: V) -> String {
        match v {
            V::Unit(INIT) => "initial data".into(),
            V::Unit(u) => match self.unit_op.get(&u) {
                Some(&i) => format!("unit {u} of {}", self.describe(i)),
                None => format!("unknown unit {u}"),
            },
            v => format!("{v:?}"),
        }
    }

    /// Checks a recovered image against the history at power-loss time `t`.
    fn check(&self, image: &[u8], t: u64) -> Result<(), String> {
        self.check_damaged(image, t, &vec![false; BLOCKS as usize], Relax::None)
    }

    /// [`History::check`] of an image recovered from a damaged cache device: blocks in `lost`
    /// (reads failed with EIO) are not looked at, and `relax` drops what the damage may
    /// legitimately have broken.
    fn check_damaged(
        &self,
        image: &[u8],
        t: u64,
        lost: &[bool],
        relax: Relax,
    ) -> Result<(), String> {
        let mut scratch = vec![0u8; SECTOR as usize];
        let vals: Vec<V> = (0..BLOCKS * SPB)
            .map(|i| parse(image, i / SPB, i % SPB, &mut scratch))
            .collect();
        let at = |b: u64, s: u64| vals[(b * SPB + s) as usize];
        // Whether unit `u` shows in a sector of blocks `[first, first + n)` that is not lost.
        let unit_shows = |u: u32, first: u64, n: u64| {
            (first..first + n)
                .any(|b| !lost[b as usize] && (0..SPB).any(|s| at(b, s) == V::Unit(u)))
        };
        // Whether any unit of op `x` shows in the blocks it wrote.
        let shows_anywhere =
            |x: usize| (self.ops[x].units.iter()).any(|&(u, first, n)| unit_shows(u, first, n));
        // A lost block is treated like a trimmed one: its content is not looked at. With the
        // contract relaxed, a durable write after a trim may be gone (cut with the log): the
        // trimmed block is covered only by one that shows. (Found by the long campaign, seed
        // 0xb0a710ad run 1792: a FUA write over trimmed blocks, cut with a damaged unvouched
        // batch, left them as the trim did, which the prefix check then took for an older
        // write torn.)
        let mut free = if relax == Relax::None {
            self.free_blocks(t)
        } else {
            self.free_blocks_unless(t, shows_anywhere)
        };
        for (f, &l) in free.iter_mut().zip(lost) {
            *f |= l;
        }
        let mut present_max_start = 0u64;
        let mut present_by = 0usize;
        for b in 0..BLOCKS {
            if lost[b as usize] {
                continue;
            }
            for s in 0..SPB {
                match at(b, s) {
                    V::Garbage => {
                        return Err(format!(
                            "block {b} sector {s}: garbage (torn or foreign data)"
                        ))
                    }
                    V::Unit(INIT) | V::Zero => {}
                    V::Unit(u) => {
                        let Some(&i) = self.unit_op.get(&u) else {
                            return Err(format!("block {b} sector {s}: unknown unit {u}"));
                        };
                        let o = &self.ops[i];
                        if o.start >= t {
                            return Err(format!(
                                "block {b} sector {s}: phantom data of {} which started after the \
                                 power loss at {t}",
                                self.describe(i)
                            ));
                        }
                        if o.start > present_max_start {
                            present_max_start = o.start;
                            present_by = i;
                        }
                    }
                }
            }
        }
        // "Intact": every sector of op x shows x's own data or possibly newer data.
        // Err: the block and what is wrong there.
        let intact = |x: usize| -> Result<(), (u64, String)> {
            let o = &self.ops[x];
            for b in o.lba..o.lba + o.n {
                if free[b as usize] {
                    continue;
                }
                for s in 0..SPB {
                    let v = at(b, s);
                    if !self.not_older(x, v, b, t) {
                        return Err((
                            b,
                            format!("block {b} sector {s} shows {} instead", self.describe_v(v)),
                        ));
                    }
                }
            }
            Ok(())
        };
        for (x, o) in self.ops.iter().enumerate() {
            if o.kind == Kind::Flush || o.kind == Kind::Trim || o.start >= t {
                continue;
            }
            if relax == Relax::None && self.durable(x, t) {
                intact(x).map_err(|(b, e)| {
                    format!(
                        "durable {} lost at power loss {t}: {e}\n{}",
                        self.describe(x),
                        self.block_story(b)
                    )
                })?;
            }
            if !self.logged(x) {
                continue;
            }
            // Atomic units, applied in order. Except with records lost with their headers
            // (`Relax::Order`): replay goes on past such a gap, so an op's unit in the gap may be
            // gone while a later unit of it, after the gap, is applied; each unit that shows is
            // still all there, unless the backing store may hold it torn (then, if its record
            // was in the gap, reads see that).
            if relax == Relax::Order && self.backing_may_hold_torn(x, t) {
                continue;
            }
            let shows = |u: u32| unit_shows(u, o.lba, o.n);
            if let Some(last) = o.units.iter().rposition(|&(u, _, _)| shows(u)) {
                for &(u, first, n) in &o.units[..=last] {
                    if relax == Relax::Order && !shows(u) {
                        continue;
                    }
                    for b in first..first + n {
                        if free[b as usize] {
                            continue;
                        }
                        for s in 0..SPB {
                            let v = at(b, s);
                            if v != V::Unit(u) && !self.not_older(x, v, b, t) {
                                return Err(format!(
                                    "{} is torn or applied out of order: unit {u} block {b} \
                                     sector {s} shows {} (its unit {} is present)\n{}",
                                    self.describe(x),
                                    self.describe_v(v),
                                    o.units[last].0,
                                    self.block_story(b)
                                ));
                            }
                        }
                    }
                }
            }
            // Prefix: it returned before the newest write that shows started.
            if relax != Relax::Order && o.ok && o.end < present_max_start {
                intact(x).map_err(|(b, e)| {
                    format!(
                        "not a prefix: {} returned before {} started, which shows, but: {e}\n{}",
                        self.describe(x),
                        self.describe(present_by),
                        self.block_story(b)
                    )
                })?;
            }
        }
        Ok(())
    }

    /// At the end of a run (no power loss): each sector shows a write no other write of it
    /// followed.
    fn check_final(&self, image: &[u8]) -> Result<(), String> {
        let t = u64::MAX;
        let free = self.free_blocks(t);
        let mut scratch = vec![0u8; SECTOR as usize];
        for b in 0..BLOCKS {
            if free[b as usize] {
                continue;
            }
            for s in 0..SPB {
                let v = parse(image, b, s, &mut scratch);
                for &x in &self.per_block[b as usize] {
                    if self.ops[x].kind == Kind::Trim {
                        continue;
                    }
                    if !self.not_older(x, v, b, t) {
                        return Err(format!(
                            "live read: block {b} sector {s} shows {}, older than {}\n{}",
                            self.describe_v(v),
                            self.describe(x),
                            self.block_story(b)
                        ));
                    }
                }
                if v == V::Garbage {
                    return Err(format!("live read: block {b} sector {s} is garbage"));
                }
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// A run
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Cfg {
    seed: u64,
    threads: usize,
    ops_per_thread: usize,
    cache_size: usize,
    segment: u32,
    mode: Mode,
    reclaim: ReclaimPolicy,
    switch_modes: bool,
    /// Power losses to take (besides the recovery-time ones).
    points: usize,
    /// `sequential_cutoff_write_kib` (0: off).
    write_cutoff_kib: u32,
}

#[derive(Debug, Clone, Copy)]
enum Trigger {
    /// After the Nth rail write.
    NthWrite(u64),
    /// After the Kth write to a checkpoint slot.
    Checkpoint(u64),
    /// After the Kth write to the backing store.
    Backing(u64),
    /// After the Kth device write during a mode switch.
    Switching(u64),
    /// After the Kth write into segments the log wrote before, from the first batch over a
    /// segment reclaim freed on: its FREE record (and the MOVE records before it) must be
    /// durable and vouched for by then (the long campaign's seed 0x90e510c5, run 2727, lost
    /// durable blocks to one damaged header while the batches over a freed segment were torn).
    Reuse(u64),
}

struct Shared {
    clock: AtomicU64,
    snaps: Mutex<Vec<Snap>>,
    switching: AtomicBool,
}

impl Shared {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst)
    }
}

/// `ckpt`: the checkpoint area's offsets `[start, end)`; `segments`: the data area's offset and
/// the segment size in bytes.
fn make_hook(
    shared: Arc<Shared>,
    mut triggers: Vec<(Trigger, u64, CrashPolicy)>,
    ckpt: (u64, u64),
    segments: (u64, u64),
) -> Hook {
    let (mut ck, mut bk, mut sw, mut reuses) = (0u64, 0u64, 0u64, 0u64);
    // Segments whose first slot the log has written, and whether it has written it again.
    let mut started: HashMap<u64, bool> = HashMap::new();
    Box::new(move |ev: &Event, ctx: &RailCtx<'_>| {
        if matches!(ev.req, Req::Flush) {
            return;
        }
        let offset = match ev.req {
            Req::Write { offset, .. } | Req::Trim { offset, .. } | Req::Zeroes { offset, .. } => {
                offset
            }
            Req::Flush => 0,
        };
        if ev.dev == 0 && offset >= ckpt.0 && offset < ckpt.1 {
            ck += 1;
        }
        if ev.dev == 1 {
            bk += 1;
        }
        if shared.switching.load(Ordering::SeqCst) {
            sw += 1;
        }
        let (data, seg_bytes) = segments;
        let mut reused = false;
        if ev.dev == 0 && matches!(ev.req, Req::Write { .. }) && offset >= data {
            let seg = (offset - data) / seg_bytes;
            if (offset - data) % seg_bytes == 0 {
                // A segment's first batch: the log starts it, or starts it over.
                started
                    .entry(seg)
                    .and_modify(|again| *again = true)
                    .or_insert(false);
            }
            reused = started.get(&seg) == Some(&true);
        }
        if reused {
            reuses += 1;
        }
        let mut fired = Vec::new();
        triggers.retain(|&(tr, seed, pol)| {
            let hit = match tr {
                Trigger::NthWrite(n) => ev.writes == n,
                Trigger::Checkpoint(k) => {
                    ev.dev == 0 && offset >= ckpt.0 && offset < ckpt.1 && ck == k
                }
                Trigger::Backing(k) => ev.dev == 1 && bk == k,
                Trigger::Switching(k) => shared.switching.load(Ordering::SeqCst) && sw == k,
                Trigger::Reuse(k) => reused && reuses == k,
            };
            if hit {
                fired.push((tr, seed, pol));
            }
            !hit
        });
        for (tr, seed, pol) in fired {
            if matches!(tr, Trigger::Reuse(_)) {
                bump(&REUSE_POINTS, 1);
            }
            let t = shared.tick();
            let images = ctx.crash_images(seed, pol);
            shared.snaps.lock().unwrap().push(Snap {
                t,
                label: format!("{tr:?} {pol:?} seed {seed:#x}"),
                images,
            });
        }
    })
}

struct Outcome {
    points: u64,
}

/// Power losses taken by [`Trigger::Reuse`], over all runs (the summary line): the campaign
/// reaches segment reuse only when runs wrap their log.
static REUSE_POINTS: AtomicU64 = AtomicU64::new(0);

/// What the current run is doing, and its live cache while the writers run (reported if the run
/// hangs).
static PROGRESS: Mutex<(String, Option<std::sync::Weak<Cache>>)> =
    Mutex::new((String::new(), None));

fn progress(what: String, cache: Option<&Arc<Cache>>) {
    *PROGRESS.lock().unwrap() = (what, cache.map(Arc::downgrade));
}

/// The last [`progress`], with the live cache's status and counters if it still exists.
fn progress_report() -> String {
    let p = PROGRESS.lock().unwrap();
    match p.1.as_ref().and_then(|w| w.upgrade()) {
        Some(c) => format!("{}\n  {:?}\n  {:?}", p.0, c.status(), c.stats()),
        None => p.0.clone(),
    }
}

fn run(cfg: &Cfg) -> Result<Outcome, String> {
    let mut rng = Rng::new(cfg.seed);
    let cdev = Arc::new(CrashDev::new(cfg.cache_size));
    let mut initial = vec![0u8; BACKING as usize];
    stamp_blocks(INIT, 0, BLOCKS, &mut initial);
    let bdev = Arc::new(CrashDev::from_image(initial));
    format_cache(&*cdev, BACKING, cfg.segment, cfg.mode, cfg.reclaim)?;
    let geo = read_superblock(&*cdev).unwrap().geometry;
    let ckpt_area = (geo.checkpoint_offset, geo.data_offset);
    let rail = Rail::new();
    let shared = Arc::new(Shared {
        clock: AtomicU64::new(1),
        snaps: Mutex::new(Vec::new()),
        switching: AtomicBool::new(false),
    });
    // Triggers: spread over the run (a run issues a few thousand device writes).
    let mut triggers = Vec::new();
    let rail_points = cfg.points * 3 / 4;
    for i in 0..rail_points {
        let seed = rng.next_u64();
        let pol = policy(rng.below(8));
        let tr = match i % 6 {
            0..=1 => Trigger::NthWrite(rng.range(5, 2500)),
            2 => Trigger::Reuse(rng.range(1, 40)),
            3 => Trigger::Checkpoint(rng.range(1, 40)),
            4 => Trigger::Backing(rng.range(1, 300)),
            _ if cfg.switch_modes => Trigger::Switching(rng.range(1, 30)),
            _ => Trigger::NthWrite(rng.range(1, 600)),
        };
        triggers.push((tr, seed, pol));
    }
    let segments = (geo.data_offset, u64::from(geo.segment_size));
    rail.set_hook(Some(make_hook(
        shared.clone(),
        triggers,
        ckpt_area,
        segments,
    )));
    let cache = Arc::new(
        open(rail.attach(cdev.clone()), rail.attach(bdev.clone()), None)
            .map_err(|e| format!("open: {e}"))?,
    );
    cache
        .set_param(
            "sequential_cutoff_write_kib",
            &cfg.write_cutoff_kib.to_string(),
        )
        .map_err(|e| format!("set_param: {e}"))?;
    let streams = cfg.write_cutoff_kib > 0;
    progress("writers running".into(), Some(&cache));
    let atomic_blocks = cache.atomic_write_bytes() as u64 / BS;
    let ops = Arc::new(Mutex::new(Vec::<OpRec>::new()));
    let next_unit = Arc::new(AtomicU32::new(1));
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let bad_blocks = Arc::new(Mutex::new(Vec::<u64>::new()));
    let done = Arc::new(AtomicBool::new(false));
    let private = (768 / cfg.threads as u64).min(256);
    let shared_region = (768u64, 256u64);

    let mut handles = Vec::new();
    for th in 0..cfg.threads {
        let (cache, ops, next_unit, errors, bad_blocks, shared) = (
            cache.clone(),
            ops.clone(),
            next_unit.clone(),
            errors.clone(),
            bad_blocks.clone(),
            shared.clone(),
        );
        let mut r = Rng::new(mix(cfg.seed, th as u64 + 100));
        let n_ops = cfg.ops_per_thread;
        handles.push(std::thread::spawn(move || {
            let region = (th as u64 * private, private);
            // What this thread last did to each of its private blocks (to check its reads).
            let mut mine: HashMap<u64, V> = HashMap::new();
            let mut trimmed: std::collections::HashSet<u64> = Default::default();
            // Where this thread's last write ended (with a write cutoff, writes often continue
            // there: sequential streams).
            let mut last_end = u64::MAX;
            for _ in 0..n_ops {
                let roll = r.below(100);
                let in_shared = r.chance(0.3);
                let (base, span) = if in_shared { shared_region } else { region };
                let n = r.range(1, (2 * atomic_blocks).min(span));
                let mut lba = base + r.below(span - n + 1);
                if streams && (base..=base + span - n).contains(&last_end) && r.chance(0.5) {
                    lba = last_end;
                }
                let mut rec = OpRec {
                    thread: th,
                    kind: Kind::Write,
                    lba,
                    n,
                    fua: false,
                    units: Vec::new(),
                    start: 0,
                    end: 0,
                    ok: true,
                };
                // Writes batched with this one (`write_batch`, as the NBD server batches
                // pipelined WRITEs): each its own op, all started and ended together.
                let mut batched: Vec<(OpRec, Vec<u8>)> = Vec::new();
                let result = if roll < 72 {
                    rec.fua = r.chance(0.12);
                    let extra = if rec.fua || !r.chance(0.25) {
                        0
                    } else {
                        r.range(1, 4)
                    };
                    for _ in 0..extra {
                        // At most the atomic size, which a cache takes into a batch.
                        let n = r.range(1, atomic_blocks.min(span));
                        let lba = base + r.below(span - n + 1);
                        // Writes of one batch may land in either order: none overlaps another,
                        // so that what this thread reads back of its blocks is known.
                        let overlaps = std::iter::once((rec.lba, rec.n))
                            .chain(batched.iter().map(|(b, _)| (b.lba, b.n)))
                            .any(|(l, k)| lba < l + k && l < lba + n);
                        if overlaps {
                            continue;
                        }
                        let rec = OpRec {
                            lba,
                            n,
                            units: Vec::new(),
                            ..rec.clone()
                        };
                        batched.push((rec, Vec::new()));
                    }
                    let mut buf = Vec::new();
                    for (rec, buf) in std::iter::once((&mut rec, &mut buf))
                        .chain(batched.iter_mut().map(|(rec, buf)| (rec, buf)))
                    {
                        let (lba, n) = (rec.lba, rec.n);
                        *buf = vec![0u8; (n * BS) as usize];
                        let mut b = 0;
                        while b < n {
                            let k = atomic_blocks.min(n - b);
                            let u = next_unit.fetch_add(1, Ordering::SeqCst);
                            stamp_blocks(
                                u,
                                lba + b,
                                k,
                                &mut buf[(b * BS) as usize..((b + k) * BS) as usize],
                            );
                            rec.units.push((u, lba + b, k));
                            b += k;
                        }
                    }
                    rec.start = shared.tick();
                    let res = if batched.is_empty() {
                        cache.write_at(&buf, lba * BS, rec.fua)
                    } else {
                        let bufs = std::iter::once((lba, &buf))
                            .chain(batched.iter().map(|(rec, buf)| (rec.lba, buf)));
                        let mut writes: Vec<BatchWrite<'_>> = bufs
                            .map(|(lba, buf)| BatchWrite::new(buf, lba * BS))
                            .collect();
                        cache.write_batch(&mut writes);
                        let mut results = writes
                            .into_iter()
                            .map(|w| match w.result {
                                Some(result) => result,
                                None => cache.write_at(w.buf, w.offset, false),
                            })
                            .collect::<Vec<_>>()
                            .into_iter();
                        let mut first = results.next().expect("the first write");
                        for ((rec, _), result) in batched.iter_mut().zip(results) {
                            rec.ok = result.is_ok();
                            // Reported (and the thread stopped) as the first write's failure.
                            if first.is_ok() {
                                first = result;
                            }
                        }
                        first
                    };
                    last_end = lba + n;
                    let units = std::iter::once(&rec)
                        .chain(batched.iter().map(|(rec, _)| rec))
                        .flat_map(|rec| &rec.units);
                    if !in_shared {
                        for (u, f, k) in units {
                            for x in *f..f + k {
                                mine.insert(x, V::Unit(*u));
                                trimmed.remove(&x);
                            }
                        }
                    }
                    res
                } else if roll < 84 {
                    rec.kind = Kind::Flush;
                    rec.n = 0;
                    rec.start = shared.tick();
                    cache.flush()
                } else if roll < 88 && !in_shared {
                    rec.kind = Kind::Trim;
                    rec.start = shared.tick();
                    let res = cache.trim(lba * BS, n * BS);
                    for x in lba..lba + n {
                        trimmed.insert(x);
                    }
                    res
                } else if roll < 92 && !in_shared {
                    rec.kind = Kind::Zeroes;
                    rec.fua = r.chance(0.3);
                    let opts = ZeroOpts {
                        may_trim: r.chance(0.5),
                        fua: rec.fua,
                        ..Default::default()
                    };
                    rec.start = shared.tick();
                    let res = cache.write_zeroes(lba * BS, n * BS, opts);
                    for x in lba..lba + n {
                        mine.insert(x, V::Zero);
                        trimmed.remove(&x);
                    }
                    res
                } else if roll < 97 {
                    // Read back private blocks.
                    let (lba, n) = (region.0 + r.below(region.1 - 8), 8);
                    let mut buf = vec![0u8; (n * BS) as usize];
                    let start = shared.tick();
                    if let Err(e) = cache.read_at(&mut buf, lba * BS) {
                        errors.lock().unwrap().push(format!("read failed: {e}"));
                        return;
                    }
                    let end = shared.tick();
                    let mut scratch = vec![0u8; SECTOR as usize];
                    for b in 0..n {
                        let x = lba + b;
                        if trimmed.contains(&x) {
                            continue;
                        }
                        let want = *mine.get(&x).unwrap_or(&V::Unit(INIT));
                        for s in 0..SPB {
                            let got = parse_in(&buf, b, x, s, &mut scratch);
                            if got != want {
                                errors.lock().unwrap().push(format!(
                                    "thread {th}: read [{start}..{end}] of its own block {x} \
                                     sector {s} returned {got:?}, its last write there was \
                                     {want:?}"
                                ));
                                bad_blocks.lock().unwrap().push(x);
                                return;
                            }
                        }
                    }
                    continue;
                } else {
                    if let Err(e) = cache.write_back_all() {
                        errors
                            .lock()
                            .unwrap()
                            .push(format!("write_back_all failed: {e}"));
                        return;
                    }
                    continue;
                };
                rec.end = shared.tick();
                rec.ok = result.is_ok();
                for (mut b, _) in batched {
                    (b.start, b.end) = (rec.start, rec.end);
                    ops.lock().unwrap().push(b);
                }
                if let Err(e) = result {
                    errors.lock().unwrap().push(format!(
                        "thread {th}: {:?} failed: {e} ({:?})",
                        rec.kind,
                        cache.status()
                    ));
                    ops.lock().unwrap().push(rec);
                    return;
                }
                ops.lock().unwrap().push(rec);
            }
        }));
    }

    // The controller: power losses at random instants, mode switches.
    let switches = Arc::new(Mutex::new(Vec::<Switch>::new()));
    let controller = {
        let (cache, rail, shared, done, switches, errors) = (
            cache.clone(),
            rail.clone(),
            shared.clone(),
            done.clone(),
            switches.clone(),
            errors.clone(),
        );
        let mut r = Rng::new(mix(cfg.seed, 7));
        let (random_points, switch_modes) = (cfg.points - rail_points, cfg.switch_modes);
        std::thread::spawn(move || {
            let mut taken = 0;
            let mut mode = cache.mode();
            while !done.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_micros(r.range(100, 3000)));
                if taken < random_points {
                    let (seed, pol) = (r.next_u64(), policy(r.below(8)));
                    let (t, images) =
                        rail.frozen(|ctx| (shared.tick(), ctx.crash_images(seed, pol)));
                    shared.snaps.lock().unwrap().push(Snap {
                        t,
                        label: format!("random instant {pol:?} seed {seed:#x}"),
                        images,
                    });
                    taken += 1;
                }
                if switch_modes && r.chance(0.15) {
                    let to = *r.pick(&Mode::ALL);
                    if to == mode {
                        continue;
                    }
                    shared.switching.store(true, Ordering::SeqCst);
                    let start = shared.tick();
                    let res = cache.set_mode(to);
                    let end = shared.tick();
                    shared.switching.store(false, Ordering::SeqCst);
                    if let Err(e) = res {
                        errors
                            .lock()
                            .unwrap()
                            .push(format!("set_mode({to}) failed: {e}"));
                        return;
                    }
                    mode = to;
                    switches.lock().unwrap().push(Switch { start, end, to });
                }
            }
        })
    };
    for h in handles {
        if h.join().is_err() {
            errors.lock().unwrap().push("a writer panicked".into());
        }
    }
    done.store(true, Ordering::SeqCst);
    controller
        .join()
        .map_err(|_| "controller panicked".to_string())?;
    rail.set_hook(None);
    let history = History::new(
        std::mem::take(&mut *ops.lock().unwrap()),
        cfg.mode,
        switches.lock().unwrap().clone(),
        cfg.write_cutoff_kib as u64 * 1024,
    );
    let errs = errors.lock().unwrap().clone();
    if !errs.is_empty() {
        let stories: Vec<String> = bad_blocks
            .lock()
            .unwrap()
            .iter()
            .map(|&b| history.block_story(b))
            .collect();
        return Err(format!("{}\n{}", errs.join("\n"), stories.join("\n")));
    }

    // The final state, read live.
    progress("final read of the live cache".into(), Some(&cache));
    let live = read_export(&cache).map_err(|e| format!("final read: {e}"))?;
    history.check_final(&live)?;
    progress("closing the live cache".into(), Some(&cache));
    let cache = Arc::try_unwrap(cache).map_err(|_| "cache still shared".to_string())?;
    cache.close().map_err(|e| format!("close: {e}"))?;

    // Every power loss.
    let snaps = std::mem::take(&mut *shared.snaps.lock().unwrap());
    let mut points = 0;
    let n = snaps.len();
    for (i, snap) in snaps.into_iter().enumerate() {
        progress(
            format!("recovering power loss {} of {n} ({})", i + 1, snap.label),
            None,
        );
        let mut r2 = Rng::new(mix(cfg.seed, 1000 + i as u64));
        points += recover_and_check(&history, snap, &mut r2)?;
    }
    Ok(Outcome { points })
}

fn open_images(images: &[Vec<u8>], rail: &Arc<Rail>) -> Result<Cache, String> {
    let c = rail.attach(Arc::new(CrashDev::from_image(images[0].clone())));
    let b = rail.attach(Arc::new(CrashDev::from_image(images[1].clone())));
    open(c, b, None).map_err(|e| format!("recovery refused the crashed cache: {e}"))
}

/// Reads the whole export (4 MiB through the small cache, with the run's reclaim policy); the
/// cache must not fail doing so.
fn read_export(c: &Cache) -> Result<Vec<u8>, String> {
    let r = read_all(c).map_err(|e| format!("reading the whole export: {e}"))?;
    if c.status().failed {
        return Err(format!("the cache failed while reading: {:?}", c.status()));
    }
    Ok(r)
}

/// Recovers `snap`, checks it; sometimes loses power again during recovery and right after.
/// Returns the number of recovered images checked.
fn recover_and_check(h: &History, snap: Snap, r: &mut Rng) -> Result<u64, String> {
    let ctx = |e: String| format!("power loss at {} ({}): {e}", snap.t, snap.label);
    let step = |what: &str| {
        progress(
            format!("power loss at {} ({}): {what}", snap.t, snap.label),
            None,
        )
    };
    let mut points = 0;
    // Maybe lose power again while `open` runs (after its Kth write).
    let during_open = r
        .chance(0.3)
        .then(|| (r.range(1, 3), r.next_u64(), policy(r.below(8))));
    let rail = Rail::new();
    let inner: Arc<Mutex<Option<Vec<Vec<u8>>>>> = Arc::default();
    if let Some((k, seed, pol)) = during_open {
        let inner = inner.clone();
        rail.set_hook(Some(Box::new(move |ev: &Event, ctx: &RailCtx<'_>| {
            if ev.writes == k && !matches!(ev.req, Req::Flush) {
                *inner.lock().unwrap() = Some(ctx.crash_images(seed, pol));
            }
        })));
    }
    step("recovering");
    let cache = open_images(&snap.images, &rail).map_err(ctx)?;
    rail.set_hook(None);
    step("reading the recovered export");
    let first = read_export(&cache).map_err(ctx)?;
    h.check(&first, snap.t).map_err(ctx)?;
    points += 1;
    // The same crash image again, damaged before recovery (the corruption campaign).
    let baseline = Baseline {
        image: &first,
        log_end: cache.report().log_end,
        lost: lost_mask(&cache.lost_ranges()),
    };
    step("recovering a damaged copy");
    damage_and_check(h, &snap, &baseline, r).map_err(|e| {
        bump(&DAMAGE.failed, 1);
        ctx(e)
    })?;
    if let Some(images) = inner.lock().unwrap().take() {
        step("recovering after a power loss during recovery");
        let rail2 = Rail::new();
        let c2 = open_images(&images, &rail2)
            .map_err(|e| ctx(format!("after a power loss during recovery: {e}")))?;
        let img = read_export(&c2).map_err(ctx)?;
        h.check(&img, snap.t)
            .map_err(|e| ctx(format!("after a power loss during recovery: {e}")))?;
        points += 1;
    }
    // Lose power again right after recovery, repeatedly: nothing may change.
    let free = h.free_blocks(snap.t);
    let mut cache = cache;
    let mut rail = rail;
    let again = if r.chance(0.4) { r.range(1, 2) } else { 0 };
    for round in 0..again {
        let pol = policy(r.below(8));
        let images = rail.crash_images(r.next_u64(), pol);
        step(&format!("dropping the recovered cache (round {round})"));
        drop(cache);
        rail = Rail::new();
        step(&format!("recovering again (round {round})"));
        cache = open_images(&images, &rail).map_err(ctx)?;
        let img = read_export(&cache).map_err(ctx)?;
        points += 1;
        for (b, &is_free) in free.iter().enumerate() {
            let range = b * BS as usize..(b + 1) * BS as usize;
            if !is_free && img[range.clone()] != first[range] {
                return Err(ctx(format!(
                    "power loss #{} right after recovery ({pol:?}) changed block {b}",
                    round + 1
                )));
            }
        }
    }
    step("dropping the recovered cache");
    drop(cache);
    Ok(points)
}

// ---------------------------------------------------------------------------------------------
// The corruption campaign: damage between crash and recovery
// ---------------------------------------------------------------------------------------------

/// What the undamaged recovery of a crash image read: the reference for the damaged one.
struct Baseline<'a> {
    image: &'a [u8],
    log_end: u64,
    lost: Vec<bool>,
}

fn lost_mask(ranges: &[(u64, u64)]) -> Vec<bool> {
    let mut m = vec![false; BLOCKS as usize];
    for &(first, n) in ranges {
        for b in first..(first + n).min(BLOCKS) {
            m[b as usize] = true;
        }
    }
    m
}

/// Where on the cache device a damage landed (what the campaign aims at).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Region {
    Superblock,
    Checkpoint,
    Header,
    Data,
    Anywhere,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Harm {
    /// One byte XOR a non-zero value.
    Flip,
    /// A 512-byte sector zeroed.
    ZeroSector,
    /// A 4 KiB block zeroed.
    ZeroBlock,
    /// A 512-byte sector copied over another (a misdirected write).
    DupSector,
    /// A 4 KiB block copied over another.
    DupBlock,
}

/// One damage: bytes `[at, at + len)` of the cache device changed.
#[derive(Debug, Clone, Copy)]
#[allow(dead_code)] // `region` and `harm` are for failure messages
struct Hit {
    region: Region,
    harm: Harm,
    at: u64,
    len: u64,
}

impl Hit {
    fn overlaps(&self, from: u64, len: u64) -> bool {
        self.at < from + len && from < self.at + self.len
    }
}

/// The batch headers of this cache's log found on a device image (every block boundary of the
/// data area tried; stale headers of earlier passes over a segment included).
struct LogMap {
    bs: u64,
    /// (offset of the header block, header).
    headers: Vec<(u64, BatchHeader)>,
}

impl LogMap {
    fn scan(image: &[u8], geo: &Geometry, log: u64) -> LogMap {
        let bps = geo.blocks_per_segment();
        let headers = (0..geo.slot_count())
            .filter_map(|slot| {
                let at = geo.slot_offset(slot);
                let h = BatchHeader::decode(&image[at as usize..(at + BS) as usize]).ok()?;
                // Only headers that fit their segment (the walk refuses others).
                (h.log == log && slot % bps + 1 + h.data_blocks() <= bps).then_some((at, h))
            })
            .collect();
        LogMap { bs: BS, headers }
    }

    /// The indices of the `n` newest headers (by epoch and sequence number), newest first.
    fn newest(&self, n: usize) -> Vec<usize> {
        let mut newest: Vec<usize> = (0..self.headers.len()).collect();
        newest.sort_by_key(|&i| {
            let h = &self.headers[i].1;
            std::cmp::Reverse((h.epoch, h.seq_first))
        });
        newest.truncate(n);
        newest
    }

    /// Whether a hit fell on the header or data of a batch holding records `from..to`.
    fn hit_between(&self, hits: &[Hit], from: u64, to: u64) -> bool {
        self.headers.iter().any(|(at, h)| {
            let span = (1 + h.data_blocks()) as u64 * self.bs;
            h.seq_first < to && from < h.seq_end() && hits.iter().any(|x| x.overlaps(*at, span))
        })
    }

    /// Blocks that losing records touched by `hits` may lose: every record whose header or data
    /// a hit overlaps, and the records of the header before a damaged one (its copy lives in
    /// the damaged header's second half).
    fn may_lose(&self, hits: &[Hit]) -> Vec<bool> {
        let mut m = vec![false; BLOCKS as usize];
        let mut mark = |e: &batch::Entry| {
            for b in e.lba..(e.lba + e.nblocks as u64).min(BLOCKS) {
                m[b as usize] = true;
            }
        };
        for (at, h) in &self.headers {
            if hits.iter().any(|x| x.overlaps(*at, self.bs)) {
                h.entries.iter().for_each(&mut mark);
                for (_, p) in &self.headers {
                    if p.seq_end() == h.seq_first && p.epoch <= h.epoch {
                        p.entries.iter().for_each(&mut mark);
                    }
                }
            }
            let mut data = at + self.bs;
            for e in &h.entries {
                let len = e.data_blocks() as u64 * self.bs;
                if len > 0 && hits.iter().any(|x| x.overlaps(data, len)) {
                    mark(e);
                }
                data += len;
            }
        }
        m
    }
}

/// A place to damage, weighted so that the log (headers and record data) is hit most.
fn pick_place(r: &mut Rng, geo: &Geometry, image: &[u8], map: &LogMap) -> (Region, u64) {
    let roll = r.below(100);
    let data_end = geo.used_size();
    // The newest headers matter most (replayed after the checkpoint); older ones still map
    // live blocks.
    let newest = map.newest(8);
    let header = |r: &mut Rng, with_data: bool| -> Option<usize> {
        let ok = |i: &usize| !with_data || map.headers[*i].1.data_blocks() > 0;
        let pool: Vec<usize> = if r.chance(0.6) {
            newest.iter().copied().filter(ok).collect()
        } else {
            (0..map.headers.len()).filter(ok).collect()
        };
        (!pool.is_empty()).then(|| *r.pick(&pool))
    };
    if roll < 8 {
        // Either copy; mostly the fields (the backing store name and fingerprint are long).
        let copy = r.below(2) * 4096;
        let off = if r.chance(0.7) {
            r.below(128)
        } else {
            r.below(4096)
        };
        return (Region::Superblock, copy + off);
    }
    if roll < 20 {
        let slot = r.below(2) as u32;
        let at = geo.checkpoint_slot_offset(slot);
        let head = &image[at as usize..at as usize + 4096];
        let used = match Checkpoint::decode_header(head) {
            Ok(h) => 4096 + h.body_len,
            Err(_) => 4096,
        }
        .min(geo.checkpoint_slot_size);
        return (Region::Checkpoint, at + r.below(used));
    }
    if roll < 50 {
        if let Some(i) = header(r, false) {
            let (at, _) = map.headers[i];
            // The own half mostly, the copy of the previous header sometimes.
            let off = if r.chance(0.7) {
                r.below(2048)
            } else {
                2048 + r.below(2048)
            };
            return (Region::Header, at + off);
        }
    }
    if roll < 90 {
        if let Some(i) = header(r, true) {
            let (at, ref h) = map.headers[i];
            let k = r.below(h.data_blocks() as u64);
            return (Region::Data, at + BS * (1 + k) + r.below(BS));
        }
    }
    let off = geo.data_offset + r.below(data_end - geo.data_offset);
    (Region::Anywhere, off)
}

/// Applies 1 to 3 damages to a cache device image.
fn damage(image: &mut [u8], geo: &Geometry, map: &LogMap, r: &mut Rng) -> Vec<Hit> {
    let n = *r.pick(&[1, 1, 1, 2, 2, 3]);
    let mut hits = Vec::new();
    for _ in 0..n {
        let (region, at) = pick_place(r, geo, image, map);
        let roll = r.below(100);
        let harm = match roll {
            0..=39 => Harm::Flip,
            40..=64 => Harm::ZeroSector,
            65..=74 => Harm::ZeroBlock,
            75..=94 => Harm::DupSector,
            _ => Harm::DupBlock,
        };
        let hit = match harm {
            Harm::Flip => {
                image[at as usize] ^= r.range(1, 255) as u8;
                Hit {
                    region,
                    harm,
                    at,
                    len: 1,
                }
            }
            Harm::ZeroSector | Harm::ZeroBlock | Harm::DupSector | Harm::DupBlock => {
                let len = if matches!(harm, Harm::ZeroSector | Harm::DupSector) {
                    SECTOR
                } else {
                    BS
                };
                let at = at / len * len;
                if matches!(harm, Harm::DupSector | Harm::DupBlock) {
                    // From another place the campaign aims at (a header over data, data over
                    // a header, a checkpoint over another...).
                    let (_, from) = pick_place(r, geo, image, map);
                    let from = from / len * len;
                    image.copy_within(from as usize..(from + len) as usize, at as usize);
                } else {
                    image[at as usize..(at + len) as usize].fill(0);
                }
                Hit {
                    region,
                    harm,
                    at,
                    len,
                }
            }
        };
        hits.push(hit);
    }
    hits
}

/// Zeroes one sector of the own half of one of the 4 newest headers on the image (by epoch and
/// sequence number).
fn damage_a_newest_header(image: &mut [u8], map: &LogMap, r: &mut Rng) -> Vec<Hit> {
    let newest = map.newest(4);
    if newest.is_empty() {
        return Vec::new();
    }
    let header = map.headers[*r.pick(&newest)].0;
    let at = header + r.below(2048 / SECTOR) * SECTOR;
    image[at as usize..(at + SECTOR) as usize].fill(0);
    vec![Hit {
        region: Region::Header,
        harm: Harm::ZeroSector,
        at,
        len: SECTOR,
    }]
}

/// Outcomes of the corruption campaign, over all runs (the summary line).
#[derive(Default)]
struct DamageStats {
    images: AtomicU64,
    hits: AtomicU64,
    /// Recovery reported something damaged and repaired it from a good copy (nothing lost).
    repaired: AtomicU64,
    /// Recoveries with lost blocks, and lost blocks in all.
    with_lost: AtomicU64,
    lost_blocks: AtomicU64,
    /// Clean records dropped (read from the backing store again).
    clean_dropped: AtomicU64,
    /// The log ended earlier than without the damage (an unvouched last batch: a torn tail).
    cut: AtomicU64,
    /// The log ended later than without the damage: it restored a torn batch's missing bytes.
    restored: AtomicU64,
    /// Records lost with their headers.
    unknown: AtomicU64,
    /// Recovery refused the device (both copies of the superblock or checkpoint hit).
    refused: AtomicU64,
    /// Nothing to see: the damage fell where nothing reads it, or on data read from elsewhere.
    unnoticed: AtomicU64,
    lost_rewritten: AtomicU64,
    /// Failed checks (wrong data served or written back, lost blocks outside damaged records,
    /// recovery refusing a repairable device...): must stay 0.
    failed: AtomicU64,
}

static DAMAGE: DamageStats = DamageStats {
    images: AtomicU64::new(0),
    hits: AtomicU64::new(0),
    repaired: AtomicU64::new(0),
    with_lost: AtomicU64::new(0),
    lost_blocks: AtomicU64::new(0),
    clean_dropped: AtomicU64::new(0),
    cut: AtomicU64::new(0),
    restored: AtomicU64::new(0),
    unknown: AtomicU64::new(0),
    refused: AtomicU64::new(0),
    unnoticed: AtomicU64::new(0),
    lost_rewritten: AtomicU64::new(0),
    failed: AtomicU64::new(0),
};

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl DamageStats {
    fn summary(&self) -> String {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        format!(
            "{} damaged images ({} damages): {} repaired, {} with lost blocks ({} blocks), {} \
             clean records dropped, {} torn-tail cuts, {} torn batches restored, {} unknown gaps, \
             {} refused (both copies hit), {} unnoticed; {} lost blocks rewritten; failed checks \
             (wrong data, ...): {}",
            g(&self.images),
            g(&self.hits),
            g(&self.repaired),
            g(&self.with_lost),
            g(&self.lost_blocks),
            g(&self.clean_dropped),
            g(&self.cut),
            g(&self.restored),
            g(&self.unknown),
            g(&self.refused),
            g(&self.unnoticed),
            g(&self.lost_rewritten),
            g(&self.failed),
        )
    }
}

/// Reads the whole export, block by block where a large read fails: the content (zeroes where
/// a read failed) and the blocks whose reads failed.
fn read_tolerant(c: &Cache) -> (Vec<u8>, Vec<Option<String>>) {
    let mut out = vec![0u8; BACKING as usize];
    let mut failed = vec![None; BLOCKS as usize];
    let chunk = 64u64;
    for first in (0..BLOCKS).step_by(chunk as usize) {
        let range = (first * BS) as usize..((first + chunk) * BS) as usize;
        if c.read_at(&mut out[range.clone()], first * BS).is_ok() {
            continue;
        }
        for b in first..first + chunk {
            let range = (b * BS) as usize..((b + 1) * BS) as usize;
            if let Err(e) = c.read_at(&mut out[range.clone()], b * BS) {
                out[range].fill(0);
                failed[b as usize] = Some(e.to_string());
            }
        }
    }
    (out, failed)
}

/// Whether every valid copy of the superblock, or of the checkpoint, in the undamaged `image`
/// was hit: the only damage recovery may refuse (with a typed error) instead of repairing. (A
/// checkpoint slot may hold nothing valid without damage: never written yet, or torn by the
/// power loss in the middle of a checkpoint.)
fn every_copy_hit(hits: &[Hit], geo: &Geometry, image: &[u8]) -> bool {
    let hit = |from: u64, len: u64| hits.iter().any(|x| x.overlaps(from, len));
    let sb = (0..2u64).all(|c| {
        let at = (c * 4096) as usize;
        Superblock::decode(&image[at..at + 4096]).is_err() || hit(at as u64, 4096)
    });
    let ck = (0..2).all(|s| {
        let at = geo.checkpoint_slot_offset(s);
        let valid = Checkpoint::decode_header(&image[at as usize..at as usize + 4096])
            .ok()
            .filter(|h| 4096 + h.body_len <= geo.checkpoint_slot_size)
            .and_then(|h| {
                let body = &image[at as usize + 4096..(at + 4096 + h.body_len) as usize];
                Checkpoint::decode_body(&h, body).ok()
            })
            .is_some();
        !valid || hit(at, geo.checkpoint_slot_size)
    });
    sb || ck
}

/// Keeps a failed damage case for `damaged_image_recovers` (the runs are not repeatable: the
/// writers' timing decides what the images hold): the undamaged cache image, the damaged one and
/// the backing image, in a new directory under the temp directory. Returns where, for the message.
fn dump_damage(snap: &Snap, damaged: &[u8], what: &str) -> String {
    let dir = std::env::temp_dir().join(format!(
        "flashtier-damage-{}-{}",
        std::process::id(),
        DAMAGE.failed.load(Ordering::Relaxed)
    ));
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join("cache.img"), &snap.images[0]))
        .and_then(|()| std::fs::write(dir.join("damaged.img"), damaged))
        .and_then(|()| std::fs::write(dir.join("backing.img"), &snap.images[1]))
        .and_then(|()| std::fs::write(dir.join("damage.txt"), what));
    match written {
        Ok(()) => format!(
            "\n(images kept: FLASHTIER_DAMAGE_DIR={} cargo test --release -p flashtier-engine \
             --test power_loss -- --ignored --nocapture damaged_image_recovers)",
            dir.display()
        ),
        Err(e) => format!("\n(could not keep the images in {}: {e})", dir.display()),
    }
}

/// Every slot of `image` that holds a header of this cache's log, one line each: where, its
/// sequence numbers, kind, `durable`, and whether its copy of the previous header decodes (and
/// which batch that copy is).
fn dump_log(image: &[u8]) -> String {
    let Ok(sb) = read_superblock(&CrashDev::from_image(image.to_vec())) else {
        return "no superblock".into();
    };
    let geo = sb.geometry;
    let log = batch::log_id(&sb.uuid);
    let mut out = String::new();
    for slot in 0..geo.slot_count() {
        let at = geo.slot_offset(slot);
        let b = &image[at as usize..(at + BS) as usize];
        let own = match BatchHeader::decode(b) {
            Ok(h) if h.log == log => h,
            Ok(_) | Err(batch::BatchError::NoBatch) => continue,
            Err(e) => {
                out += &format!("\n  slot {slot} @{at}: own {e:?}");
                continue;
            }
        };
        let prev = match BatchHeader::decode_prev(b) {
            Ok(p) => format!("prev {}..{} e{}", p.seq_first, p.seq_end(), p.epoch),
            Err(e) => format!("prev {e:?}"),
        };
        out += &format!(
            "\n  slot {slot} @{at}: {}..{} e{} {:?} durable {} data {} ord {} | {prev}",
            own.seq_first,
            own.seq_end(),
            own.epoch,
            own.kind,
            own.durable,
            own.data_blocks(),
            own.ordinal
        );
        let mut data_slot = slot + 1;
        for e in &own.entries {
            out += &format!(
                "\n      {:?}{} lba {}+{} aux {} data@{}",
                e.kind,
                if e.dirty { " dirty" } else { "" },
                e.lba,
                e.nblocks,
                e.aux,
                data_slot
            );
            data_slot += e.data_blocks();
        }
    }
    out
}

/// Recovers a damaged image kept by a failed campaign run (`FLASHTIER_DAMAGE_DIR`), the undamaged
/// one beside it, and prints what each recovery reported, for debugging recovery.
#[test]
#[ignore = "needs FLASHTIER_DAMAGE_DIR from a failed campaign run"]
fn damaged_image_recovers() {
    let dir = std::path::PathBuf::from(
        std::env::var("FLASHTIER_DAMAGE_DIR").expect("FLASHTIER_DAMAGE_DIR"),
    );
    let load = |name: &str| std::fs::read(dir.join(name)).unwrap();
    eprintln!("{}", String::from_utf8_lossy(&load("damage.txt")));
    for name in ["cache.img", "damaged.img"] {
        eprintln!("{name}: {}", dump_log(&load(name)));
        let rail = Rail::new();
        let backing = rail.attach(Arc::new(CrashDev::from_image(load("backing.img"))));
        let opened = open(
            rail.attach(Arc::new(CrashDev::from_image(load(name)))),
            backing.clone(),
            None,
        );
        match opened {
            Ok(c) => {
                eprintln!(
                    "{name}: log_end {} damage {:?} lost {:?}",
                    c.report().log_end,
                    c.report().damage,
                    c.lost_ranges()
                );
                // And the write-back check of the campaign: what reads return, the backing
                // store holds afterwards (lost blocks aside).
                let lost = c.lost_ranges();
                let is_lost = |b: u64| lost.iter().any(|&(f, n)| b >= f && b < f + n);
                let mut got = vec![0u8; BS as usize];
                let mut want = Vec::new();
                for b in 0..BLOCKS {
                    // A block found damaged by this read is lost from here on.
                    if !is_lost(b) && c.read_at(&mut got, b * BS).is_ok() {
                        want.push((b, got.clone()));
                    }
                }
                eprintln!("{name}: after reads, lost {:?}", c.lost_ranges());
                let written = c.write_back_all().unwrap();
                let differ: Vec<u64> = want
                    .iter()
                    .filter(|(b, data)| {
                        let mut on = vec![0u8; BS as usize];
                        backing.read_at(&mut on, b * BS).unwrap();
                        on != *data
                    })
                    .map(|(b, _)| *b)
                    .collect();
                eprintln!(
                    "{name}: write_back_all wrote {written} blocks, {} still dirty; backing \
                     differs from reads at blocks {differ:?}",
                    c.status().dirty_blocks
                );
            }
            Err(e) => eprintln!("{name}: refused: {e}"),
        }
    }
}

/// Damages a copy of the crash image's cache device (1 to 3 damages), recovers it and checks:
/// - recovery succeeds unless both copies of the superblock or of the checkpoint were hit (then
///   it may refuse with an error, never panic or open garbage);
/// - every read returns data, or EIO exactly for the blocks `lost_ranges` lists;
/// - confinement: blocks lost (beyond what the undamaged recovery lost) all belong to records
///   whose header or data bytes were hit;
/// - every block that reads is exactly what the undamaged recovery read, unless the log was cut
///   at an unvouched batch (then a prefix of the history, [`Relax::Durability`]) or records
///   were lost with their headers ([`Relax::Order`]); either way [`History::check_damaged`];
/// - after `write_back_all`, the backing store holds what reads return, and for lost blocks
///   some stamped data that was written before the power loss (never garbage);
/// - writing a lost block makes it read again, and empties `lost_ranges` in the end.
fn damage_and_check(
    h: &History,
    snap: &Snap,
    base: &Baseline<'_>,
    r: &mut Rng,
) -> Result<(), String> {
    let mut image = snap.images[0].clone();
    let sb = read_superblock(&CrashDev::from_image(image.clone()))
        .map_err(|e| format!("the undamaged crash image has no superblock: {e}"))?;
    let geo = sb.geometry;
    let map = LogMap::scan(&image, &geo, batch::log_id(&sb.uuid));
    // At the reuse of a freed segment, half the images lose a sector of one of the newest
    // headers: the FREE and MOVE records' batches and those vouching for them (run 2727).
    let hits = if snap.label.starts_with("Reuse") && r.chance(0.5) {
        damage_a_newest_header(&mut image, &map, r)
    } else {
        damage(&mut image, &geo, &map, r)
    };
    bump(&DAMAGE.images, 1);
    bump(&DAMAGE.hits, hits.len() as u64);
    let what = format!("damage {hits:?}");
    let ctx = |e: String| format!("{what}: {e}{}", dump_damage(snap, &image, &what));

    let rail = Rail::new();
    let bdev = rail.attach(Arc::new(CrashDev::from_image(snap.images[1].clone())));
    let c = match open(
        rail.attach(Arc::new(CrashDev::from_image(image.clone()))),
        bdev.clone(),
        None,
    ) {
        Ok(c) => c,
        Err(e) if every_copy_hit(&hits, &geo, &snap.images[0]) => {
            bump(&DAMAGE.refused, 1);
            let _ = e;
            return Ok(());
        }
        Err(e) => return Err(ctx(format!("recovery refused the damaged cache: {e}"))),
    };
    let report = c.report().clone();
    let unknown = report
        .damage
        .iter()
        .any(|d| matches!(d, Damage::Unknown { .. }));
    let cut = report.log_end < base.log_end;
    // Damage can only end the log sooner, except where it happens to write back the very bytes
    // a torn batch lacked (zeroes over a torn all-zero block: the long campaign's run 4098,
    // seed 0x90e510c5): then the batch checks out and replays, with what follows it, records
    // that were written before the power loss but not synced, so a prefix of the history.
    let further = report.log_end > base.log_end;
    if further && !map.hit_between(&hits, base.log_end, report.log_end) {
        return Err(ctx(format!(
            "the damaged log replayed further (to {}) than the undamaged one ({}), and no \
             damage fell on the batches in between",
            report.log_end, base.log_end
        )));
    }

    if cut {
        // A cut is only for a batch no header vouches for: its direct successor (a batch, seal
        // or note whose copy of the previous header is that batch's), if intact, must not say
        // it was synced.
        let log = batch::log_id(&sb.uuid);
        for slot in 0..geo.slot_count() {
            let at = geo.slot_offset(slot);
            let b = &image[at as usize..(at + BS) as usize];
            let (Ok(next), Ok(prev)) = (BatchHeader::decode(b), BatchHeader::decode_prev(b)) else {
                continue;
            };
            let c = report.log_end;
            if next.log == log
                && prev.log == log
                && next.epoch >= prev.epoch
                && next.seq_first == prev.seq_end()
                && (prev.seq_first..prev.seq_end()).contains(&c)
                && next.durable > c
                && !hits.iter().any(|x| x.overlaps(at, BS))
            {
                return Err(ctx(format!(
                    "the log was cut at record {c} (undamaged: {}), but the intact header at \
                     {at} follows its batch and vouches for it (durable {})",
                    base.log_end, next.durable
                )));
            }
        }
    }

    let (got, failed) = read_tolerant(&c);
    if c.status().failed {
        return Err(ctx(format!(
            "the cache failed while reading: {:?}",
            c.status()
        )));
    }
    let lost = lost_mask(&c.lost_ranges());
    let may_lose = map.may_lose(&hits);
    let mut newly_lost = 0;
    for b in 0..BLOCKS as usize {
        match (&failed[b], lost[b]) {
            (Some(e), false) => {
                return Err(ctx(format!(
                    "block {b} failed to read but is not lost: {e}"
                )))
            }
            (None, true) => {
                return Err(ctx(format!("block {b} is lost but read without an error")))
            }
            _ => {}
        }
        if lost[b] && !base.lost[b] {
            newly_lost += 1;
            if !may_lose[b] {
                return Err(ctx(format!(
                    "block {b} is lost, but no record writing it was damaged (report: {:?})",
                    report.damage
                )));
            }
        }
    }

    // The data.
    let relax = if unknown {
        Relax::Order
    } else if cut || further {
        Relax::Durability
    } else {
        Relax::None
    };
    if relax == Relax::None {
        for (b, &is_lost) in lost.iter().enumerate() {
            let range = b * BS as usize..(b + 1) * BS as usize;
            if !is_lost && got[range.clone()] != base.image[range.clone()] {
                let mut scratch = vec![0u8; SECTOR as usize];
                let (v, w) = (
                    parse(&got, b as u64, 0, &mut scratch),
                    parse(base.image, b as u64, 0, &mut scratch),
                );
                return Err(ctx(format!(
                    "WRONG DATA: block {b} reads {} where the undamaged recovery read {} \
                     (report: {:?})\n{}",
                    h.describe_v(v),
                    h.describe_v(w),
                    report.damage,
                    h.block_story(b as u64)
                )));
            }
        }
    }
    h.check_damaged(&got, snap.t, &lost, relax).map_err(|e| {
        ctx(format!(
            "WRONG DATA ({relax:?}, report {:?}): {e}",
            report.damage
        ))
    })?;

    // Write-back never writes garbage; lost blocks are never written back.
    c.write_back_all()
        .map_err(|e| ctx(format!("write_back_all: {e}")))?;
    let mut backing = vec![0u8; BACKING as usize];
    bdev.read_at(&mut backing, 0)
        .map_err(|e| ctx(format!("reading the backing store: {e}")))?;
    let mut scratch = vec![0u8; SECTOR as usize];
    for b in 0..BLOCKS {
        let range = (b * BS) as usize..((b + 1) * BS) as usize;
        if !lost[b as usize] {
            if backing[range.clone()] != got[range] {
                return Err(ctx(format!(
                    "after write-back, backing block {b} differs from what the cache read"
                )));
            }
            continue;
        }
        for s in 0..SPB {
            match parse(&backing, b, s, &mut scratch) {
                V::Garbage => {
                    return Err(ctx(format!(
                        "after write-back, lost block {b} sector {s} holds garbage"
                    )))
                }
                V::Unit(u) if u != INIT => {
                    let ok = h.unit_op.get(&u).is_some_and(|&i| h.ops[i].start < snap.t);
                    if !ok {
                        return Err(ctx(format!(
                            "after write-back, lost block {b} sector {s} holds {}",
                            h.describe_v(V::Unit(u))
                        )));
                    }
                }
                _ => {}
            }
        }
    }

    // Writing a lost block makes it whole.
    let ranges = c.lost_ranges();
    for &(first, n) in &ranges {
        let data = pattern(mix(first, n), (n * BS) as usize);
        c.write_at(&data, first * BS, false)
            .map_err(|e| ctx(format!("rewriting lost blocks {first}+{n}: {e}")))?;
        let mut back = vec![0u8; data.len()];
        c.read_at(&mut back, first * BS)
            .map_err(|e| ctx(format!("reading rewritten lost blocks {first}+{n}: {e}")))?;
        if back != data {
            return Err(ctx(format!("rewritten lost blocks {first}+{n} read wrong")));
        }
        bump(&DAMAGE.lost_rewritten, n);
    }
    if !c.lost_ranges().is_empty() {
        return Err(ctx(format!(
            "lost ranges remain after rewriting them: {:?}",
            c.lost_ranges()
        )));
    }

    // Outcome counts.
    let dropped = report
        .damage
        .iter()
        .filter(|d| matches!(d, Damage::CleanRecord { .. }))
        .count() as u64;
    bump(&DAMAGE.clean_dropped, dropped);
    if unknown {
        bump(&DAMAGE.unknown, 1);
    }
    if cut {
        bump(&DAMAGE.cut, 1);
    }
    if further {
        bump(&DAMAGE.restored, 1);
    }
    if newly_lost > 0 {
        bump(&DAMAGE.with_lost, 1);
        bump(&DAMAGE.lost_blocks, newly_lost);
    }
    if !report.damage.is_empty() && !report.damage.iter().any(Damage::loses_data) && newly_lost == 0
    {
        bump(&DAMAGE.repaired, 1);
    }
    if report.damage.is_empty() && newly_lost == 0 && !cut && !further {
        bump(&DAMAGE.unnoticed, 1);
    }
    drop(c);
    Ok(())
}

fn cfg_for(seed: u64) -> Cfg {
    let mut r = Rng::new(seed);
    let switch_modes = r.chance(0.3);
    Cfg {
        seed,
        threads: r.range(2, 4) as usize,
        ops_per_thread: r.range(30, 60) as usize,
        cache_size: *r.pick(&[1usize << 20, 2 << 20]),
        segment: *r.pick(&[64u32 << 10, 128 << 10]),
        mode: *r.pick(&[
            Mode::WriteBack,
            Mode::WriteBack,
            Mode::WriteBack,
            Mode::WriteThrough,
            Mode::WriteAround,
        ]),
        reclaim: *r.pick(&[ReclaimPolicy::Lru, ReclaimPolicy::Fifo]),
        switch_modes,
        points: 12,
        write_cutoff_kib: *r.pick(&[0, 0, 0, 4, 16, 64]),
    }
}

/// Runs until `points` power losses (`long_points` with `FLASHTIER_LONG=1`) were checked. A
/// failed run does not stop the campaign (so a long run reports how often, and in how many ways,
/// the engine fails); the test fails at the end if any run did.
fn campaign(default_seed: u64, points: u64, long_points: u64) {
    let base = base_seed(default_seed);
    let want = if is_long() { long_points } else { points };
    let started = std::time::Instant::now();
    let mut checked = 0;
    // `FLASHTIER_RUN=<n>`: only run `n` (as numbered in a failure message).
    let only: Option<u64> = std::env::var("FLASHTIER_RUN")
        .ok()
        .map(|v| v.parse().expect("FLASHTIER_RUN"));
    let first = only.unwrap_or(0);
    // `FLASHTIER_RUN_TIMEOUT=<s>`: how long a run may take before it counts as hung (a run
    // normally takes well under a second).
    let timeout: u64 = std::env::var("FLASHTIER_RUN_TIMEOUT")
        .map(|v| v.parse().expect("FLASHTIER_RUN_TIMEOUT"))
        .unwrap_or(120);
    let mut run_no = first;
    let mut failures = Vec::new();
    while checked < want && only.is_none_or(|n| run_no == n) {
        let seed = mix(base, run_no);
        let cfg = cfg_for(seed);
        let c2 = cfg.clone();
        let out = with_timeout(timeout, move || run(&c2)).unwrap_or_else(|| {
            Err(format!(
                "the run hung for {timeout} s, at: {}",
                progress_report()
            ))
        });
        match out {
            Ok(o) => checked += o.points,
            Err(e) => {
                let msg = format!(
                    "power-loss run failed: FLASHTIER_SEED={base:#x} FLASHTIER_RUN={run_no} \
                     (run seed {seed:#x})\n{cfg:?}\n{e}"
                );
                eprintln!("{msg}\n");
                failures.push(msg);
            }
        }
        run_no += 1;
    }
    let runs = run_no - first;
    eprintln!("corruption: {}", DAMAGE.summary());
    eprintln!(
        "power_loss: {checked} power losses checked in {runs} runs ({} failed; {} at the \
         reuse of a freed segment), {:.1?} (FLASHTIER_SEED={base:#x})",
        failures.len(),
        REUSE_POINTS.load(Ordering::Relaxed),
        started.elapsed()
    );
    assert!(
        failures.is_empty(),
        "{} of {runs} power-loss runs failed; the first:\n{}",
        failures.len(),
        failures[0]
    );
}

/// The campaign lets damaged replay go further than undamaged replay only when a hit fell on a
/// batch holding the records in between (the damage can have restored a torn block there).
#[test]
fn only_damage_to_the_batches_past_the_undamaged_end_excuses_a_longer_replay() {
    let entry = |lba| batch::Entry {
        kind: batch::Kind::Write,
        dirty: true,
        lba,
        nblocks: 1,
        aux: 0,
        volume: 0,
        data_crc: 0,
    };
    let header = |seq_first, records| BatchHeader {
        seq_first,
        epoch: 1,
        kind: batch::HeaderKind::Batch,
        durable: 0,
        log: 7,
        entries: (0..records).map(entry).collect(),
        ordinal: 0,
    };
    // Records 64 and 65 at block 10 (data in 11 and 12), 66 and 67 at block 13 (14 and 15).
    let map = LogMap {
        bs: BS,
        headers: vec![(10 * BS, header(64, 2)), (13 * BS, header(66, 2))],
    };
    let zeroed = |block: u64| Hit {
        region: Region::Data,
        harm: Harm::ZeroBlock,
        at: block * BS,
        len: BS,
    };
    for (block, excused) in [(13, true), (14, true), (15, true), (12, false), (16, false)] {
        assert_eq!(
            map.hit_between(&[zeroed(block)], 66, 68),
            excused,
            "a hit on block {block}"
        );
    }
    let sector = Hit {
        region: Region::Data,
        harm: Harm::ZeroSector,
        at: 15 * BS + 7 * SECTOR,
        len: SECTOR,
    };
    assert!(map.hit_between(&[zeroed(3), sector], 66, 68));
    // The undamaged log ending at 64 (the earlier batch torn): only hits there excuse it.
    assert!(map.hit_between(&[zeroed(11)], 64, 66));
    assert!(!map.hit_between(&[zeroed(14)], 64, 66));
}

#[test]
fn power_loss_with_concurrent_writers() {
    campaign(0x90E5_10C5, 1000, 50_000);
}

/// Power is cut under three writers (64 KiB writes, every fifth FUA, each in its own region):
/// both devices die at one instant (images taken, then every request fails). No writer may
/// hang (each gets an error, also those waiting for log space), dropping the cache finishes, and
/// the images recover with every acknowledged FUA write (or a later write of the same thread)
/// in place and no torn or foreign block.
#[test]
fn power_cut_under_concurrent_writers() {
    const REGION: u64 = 300;
    const N: u64 = 16;
    // Block `lba` of write `i` of thread `t`: a stamp, then bytes derived from it.
    fn block(t: u64, i: u64, lba: u64) -> Vec<u8> {
        let mut b = pattern(mix(mix(t, i), lba), BS as usize);
        b[..8].copy_from_slice(&(t + 1).to_le_bytes());
        b[8..16].copy_from_slice(&i.to_le_bytes());
        b[16..24].copy_from_slice(&lba.to_le_bytes());
        b
    }
    fn first_block(t: u64, i: u64) -> u64 {
        t * REGION + (i * 37) % (REGION - N)
    }
    let base = base_seed(0xF0C7);
    for round in 0..6u64 {
        let seed = mix(base, round);
        let rail = Rail::new();
        let cdev = Arc::new(CrashDev::new(1 << 20));
        let bdev = Arc::new(CrashDev::new(BACKING as usize));
        let mode = if round % 3 == 2 {
            Mode::WriteThrough
        } else {
            Mode::WriteBack
        };
        format_small(&*cdev, BACKING, mode);
        let cache =
            Arc::new(open(rail.attach(cdev.clone()), rail.attach(bdev.clone()), None).unwrap());
        let writers: Vec<_> = (0..3u64)
            .map(|t| {
                let cache = cache.clone();
                std::thread::spawn(move || {
                    // Per block: the last write of this thread acknowledged with FUA.
                    let mut fua_acked: HashMap<u64, u64> = HashMap::new();
                    for i in 0.. {
                        let first = first_block(t, i);
                        let mut buf = Vec::with_capacity((N * BS) as usize);
                        for k in 0..N {
                            buf.extend(block(t, i, first + k));
                        }
                        let fua = i % 5 == 0;
                        if cache.write_at(&buf, first * BS, fua).is_err() {
                            return fua_acked;
                        }
                        if fua {
                            for k in 0..N {
                                fua_acked.insert(first + k, i);
                            }
                        }
                    }
                    unreachable!()
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(5 + 7 * round));
        let pol = policy(seed);
        let images = rail.frozen(|ctx| {
            let images = ctx.crash_images(seed, pol);
            cdev.power_off();
            bdev.power_off();
            images
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while writers.iter().any(|w| !w.is_finished()) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            writers.iter().all(|w| w.is_finished()),
            "round {round}: a writer hung after the power cut: {:?}",
            cache.status()
        );
        let acked: Vec<HashMap<u64, u64>> =
            writers.into_iter().map(|w| w.join().unwrap()).collect();
        let cache = Arc::try_unwrap(cache).ok().unwrap();
        assert!(
            with_timeout(10, move || drop(cache)).is_some(),
            "round {round}: dropping the cache hung after the power cut"
        );
        let recovered = open(
            Arc::new(CrashDev::from_image(images[0].clone())),
            Arc::new(CrashDev::from_image(images[1].clone())),
            None,
        )
        .unwrap_or_else(|e| panic!("round {round}: recovery refused the images: {e}"));
        let all = read_all(&recovered).unwrap();
        for (t, acked) in acked.iter().enumerate() {
            let t = t as u64;
            for lba in t * REGION..(t + 1) * REGION {
                let got = &all[(lba * BS) as usize..((lba + 1) * BS) as usize];
                let ctx = format!("round {round} ({pol:?}, seed {seed:#x}): block {lba}");
                let version = if got.iter().all(|&b| b == 0) {
                    None
                } else {
                    let i = u64::from_le_bytes(got[8..16].try_into().unwrap());
                    let ok = u64::from_le_bytes(got[..8].try_into().unwrap()) == t + 1
                        && (first_block(t, i)..first_block(t, i) + N).contains(&lba)
                        && got == &block(t, i, lba)[..];
                    assert!(ok, "{ctx}: torn or foreign data");
                    Some(i)
                };
                if let Some(&want) = acked.get(&lba) {
                    assert!(
                        version.is_some_and(|v| v >= want),
                        "{ctx}: FUA write {want} acknowledged before the power cut is lost \
                         (found {version:?})"
                    );
                }
            }
        }
        recovered.close().unwrap();
    }
}
