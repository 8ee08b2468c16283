//! kill -9 of the real `flashtier serve` (write-back cache on a file) under a verifying NBD
//! workload, many times over the same cache and backing files.
//!
//! Every 4 KiB block a client writes is self-describing: write id, block number, index within the
//! write, the write's length, the cycle, and a checksum. Every write, read and FLUSH is stamped
//! from one global logical clock when it is sent and when its reply arrives, so "acknowledged
//! before that FLUSH was sent" and "issued after that write was acknowledged" are exact. After
//! each crash the server is restarted on the same files and the whole disk is read back and
//! checked against the model:
//!
//! - **durability**: no block is older than a durable write covering it (one FUA-acknowledged, or
//!   acknowledged before a completed FLUSH was sent; after SIGTERM, every acknowledged write);
//! - **no stale resurrection**: no block shows a write from an earlier cycle other than what it
//!   held when this cycle started, nor zeroes where it held data;
//! - **prefix recovery** (flashtier-engine's contract): no block is older than a write that was
//!   acknowledged before some write visible after recovery was issued;
//! - **atomicity**: no write is torn (some blocks present, others definitely older);
//! - **integrity**: every block is zeroes (never written) or a valid block of a write that covers
//!   exactly that block;
//! - reads during the workload never return data older than a write acknowledged before the read
//!   was sent;
//! - the server reports recovery after an unclean shutdown (or a clean open after SIGTERM).
//!
//! What was read after recovery is flushed and becomes the next cycle's starting state. At the
//! end, the dirty blocks are written back (`--mode passthrough`) and the backing file itself is
//! checked against the model.
//!
//! Hangs fail the test instead of hiding behind the next kill or waiting forever: a server that
//! answers nothing for 15 s under load (checked before each crash), does not exit within 30 s of
//! SIGTERM, or does not finish the read-back has its thread stacks saved (gdb) and is killed. A
//! failing run keeps its files and logs.
//!
//! `kill_9_write_through_with_racing_writes` runs the same cycles all in write-through mode;
//! `kill_9_with_pipelined_writes` all in write-back with one connection of 8 threads, so that
//! small WRITEs arrive together and are logged as a group, every second cycle with a RAM tier
//! (`--ram-cache 8M`) in front of the cache, which the batches pass through.
//!
//! FLASHTIER_LONG=1 runs 500 cycles instead of 20 (100 instead of 10 for the other two);
//! FLASHTIER_CRASH_SEED=N repeats a seed (the kill timing still varies);
//! FLASHTIER_CRASH_TERM_PERCENT=N ends N% of the cycles with SIGTERM (default 15) instead of
//! kill -9. FLASHTIER_CRASH_STALL_MS=N fails a cycle in which any request took longer than N ms
//! (keeping the files and the server's logs), and FLASHTIER_CRASH_LOG=LEVEL runs the servers at
//! that log level (e.g. `debug`): how to catch a seconds-long stall, which the test otherwise
//! tolerates up to `HUNG_AFTER`.

use std::fs;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flashtier_io::BlockDev;
use flashtier_nbd::NbdClient;

use crate::harness::{self, path_str, Rng, Scratch, Server, Watchdog};

const BS: usize = 4096;
const MIB: u64 = 1 << 20;
const DISK_BYTES: u64 = 256 * MIB;
const DISK_BLOCKS: u64 = DISK_BYTES / BS as u64;
const CACHE_BYTES: u64 = 64 * MIB;
/// The usual working set: fits in the cache (overwrites keep reclaim compacting).
const HOT_BLOCKS: u64 = 40 * MIB / BS as u64;
/// The usual clients: 4 connections of 2 synchronous threads each.
const CONNECTIONS: usize = 4;
const THREADS_PER_CONNECTION: usize = 2;
/// 256 KiB, well below the atomic write size (1 MiB, or a little less with 1 MiB segments).
const MAX_WRITE_BLOCKS: u64 = 64;
const MAGIC: [u8; 8] = *b"FTCRASH1";
const NOT_ACKED: u64 = u64::MAX;
/// Where the checksum sits in a block.
const SUM_AT: usize = BS - 8;

// ---------------------------------------------------------------------------------------------
// Randomness and block contents
// ---------------------------------------------------------------------------------------------

fn block_sum(b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for w in b.chunks_exact(8) {
        let w = u64::from_le_bytes(w.try_into().unwrap());
        h = (h ^ w).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29);
    }
    h
}

/// What a block says about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    id: u64,
    lba: u64,
    idx: u32,
    n: u32,
    cycle: u32,
}

fn fill_block(out: &mut [u8], h: Header) {
    out[0..8].copy_from_slice(&MAGIC);
    out[8..16].copy_from_slice(&h.id.to_le_bytes());
    out[16..24].copy_from_slice(&h.lba.to_le_bytes());
    out[24..28].copy_from_slice(&h.idx.to_le_bytes());
    out[28..32].copy_from_slice(&h.n.to_le_bytes());
    out[32..36].copy_from_slice(&h.cycle.to_le_bytes());
    out[36..40].copy_from_slice(&[0; 4]);
    let mut rng = Rng::new(h.id.wrapping_mul(1_000_003) ^ h.idx as u64);
    for w in out[40..SUM_AT].chunks_exact_mut(8) {
        w.copy_from_slice(&rng.next().to_le_bytes());
    }
    let sum = block_sum(&out[..SUM_AT]);
    out[SUM_AT..].copy_from_slice(&sum.to_le_bytes());
}

/// Fills `buf` (whole blocks) with write `id`'s data for the blocks from `lba` on.
fn fill_write(buf: &mut [u8], id: u64, lba: u64, cycle: u32) {
    let n = (buf.len() / BS) as u32;
    for (i, b) in buf.chunks_exact_mut(BS).enumerate() {
        let h = Header {
            id,
            lba: lba + i as u64,
            idx: i as u32,
            n,
            cycle,
        };
        fill_block(b, h);
    }
}

/// `Ok(None)`: all zeroes; `Err`: neither zeroes nor an intact block of ours.
fn decode_block(b: &[u8]) -> Result<Option<Header>, String> {
    if b.iter().all(|&x| x == 0) {
        return Ok(None);
    }
    if b[0..8] != MAGIC {
        return Err(format!("garbage (no magic): starts {:02x?}", &b[..16]));
    }
    let sum = u64::from_le_bytes(b[SUM_AT..].try_into().unwrap());
    if block_sum(&b[..SUM_AT]) != sum {
        return Err(format!(
            "garbage (checksum mismatch) claiming write {}",
            u64::from_le_bytes(b[8..16].try_into().unwrap())
        ));
    }
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
    Ok(Some(Header {
        id: u64::from_le_bytes(b[8..16].try_into().unwrap()),
        lba: u64::from_le_bytes(b[16..24].try_into().unwrap()),
        idx: u32_at(24),
        n: u32_at(28),
        cycle: u32_at(32),
    }))
}

// ---------------------------------------------------------------------------------------------
// The workload
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
struct Write {
    id: u64,
    lba: u64,
    n: u32,
    fua: bool,
    /// Logical clock when sent and when acknowledged (NOT_ACKED: no reply).
    issue: u64,
    ack: u64,
}

impl Write {
    fn acked(&self) -> bool {
        self.ack != NOT_ACKED
    }
    fn covers(&self, lba: u64) -> bool {
        (self.lba..self.lba + self.n as u64).contains(&lba)
    }
}

/// A read during the workload: what each block held (0: zeroes, else a write id).
struct ReadObs {
    lba: u64,
    issue: u64,
    ack: u64,
    seen: Vec<u64>,
}

#[derive(Default)]
struct ThreadLog {
    writes: Vec<Write>,
    reads: Vec<ReadObs>,
    flushes: u64,
    /// Slowest request answered, and when it was sent (since the workload started).
    slowest: (Duration, Duration),
    /// What that request was (READ, WRITE, FLUSH).
    slowest_kind: &'static str,
    /// An I/O error before the crash, or garbage read.
    failure: Option<String>,
    /// The request the thread is waiting for, if any.
    in_flight: Option<&'static str>,
}

struct Shared {
    clock: AtomicU64,
    next_id: AtomicU64,
    /// Highest send-time of a FLUSH that completed: writes acknowledged before it are durable.
    flush_floor: AtomicU64,
    crashing: AtomicBool,
    /// When some request last got its reply (milliseconds since `epoch`).
    last_reply_ms: AtomicU64,
    epoch: Instant,
}

impl Shared {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, SeqCst) + 1
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// How long no request has been answered.
    fn idle(&self) -> Duration {
        Duration::from_millis(
            self.now_ms()
                .saturating_sub(self.last_reply_ms.load(SeqCst)),
        )
    }
}

/// Eight clients keep requests in flight all the time, so a server that answers none for this
/// long is hung (the slowest replies seen are well under a second).
const HUNG_AFTER: Duration = Duration::from_secs(15);
/// Before the crash, the server must have answered something this recently; otherwise the
/// crash waits (up to `HUNG_AFTER`) to tell a stall from a hang, which a kill -9 would hide.
const STALL: Duration = Duration::from_secs(1);

#[derive(Clone, Copy)]
struct Workload {
    cycle: u32,
    working_set: u64,
    seed: u64,
}

/// Runs requests until `stop`, recording them in `log`. The log is shared (and locked only
/// between requests) so that a thread stuck in a request can be abandoned with what it did.
fn worker(
    sh: &Shared,
    stop: &AtomicBool,
    client: &NbdClient,
    w: Workload,
    thread: u64,
    log: &Mutex<ThreadLog>,
) {
    let mut rng = Rng::new(w.seed ^ (thread + 1).wrapping_mul(0x1234_5678_9abc_def1));
    let set_in_flight = |what| log.lock().unwrap().in_flight = Some(what);
    let mut buf = vec![0u8; MAX_WRITE_BLOCKS as usize * BS];
    let started = Instant::now();
    while !stop.load(SeqCst) {
        let op = rng.below(100);
        let sent = Instant::now();
        let result = if op < 5 {
            let issue = sh.tick();
            set_in_flight("FLUSH");
            client.flush().map(|()| {
                sh.flush_floor.fetch_max(issue, SeqCst);
                log.lock().unwrap().flushes += 1;
            })
        } else if op < 15 {
            let n = 1 + rng.below(MAX_WRITE_BLOCKS);
            let lba = rng.below(w.working_set - n + 1);
            let data = &mut buf[..n as usize * BS];
            let issue = sh.tick();
            set_in_flight("READ");
            let r = client.read_at(data, lba * BS as u64);
            let ack = sh.tick();
            r.map(|()| {
                let mut seen = Vec::with_capacity(n as usize);
                let mut failure = None;
                for (i, b) in data.chunks_exact(BS).enumerate() {
                    match decode_block(b) {
                        Ok(None) => seen.push(0),
                        Ok(Some(h)) if h.lba == lba + i as u64 => seen.push(h.id),
                        Ok(Some(h)) => {
                            failure.get_or_insert(format!(
                                "read of block {} during the workload returned block {} of \
                                 write {} (meant for block {})",
                                lba + i as u64,
                                h.idx,
                                h.id,
                                h.lba
                            ));
                            seen.push(0);
                        }
                        Err(e) => {
                            failure.get_or_insert(format!(
                                "read of block {} during the workload: {e}",
                                lba + i as u64
                            ));
                            seen.push(0);
                        }
                    }
                }
                let mut l = log.lock().unwrap();
                if l.failure.is_none() {
                    l.failure = failure;
                }
                l.reads.push(ReadObs {
                    lba,
                    issue,
                    ack,
                    seen,
                });
            })
        } else {
            let n = match rng.below(10) {
                0..=4 => 1 + rng.below(4),
                5..=7 => 1 + rng.below(16),
                _ => 1 + rng.below(MAX_WRITE_BLOCKS),
            };
            let lba = rng.below(w.working_set - n + 1);
            let fua = rng.below(10) == 0;
            let id = sh.next_id.fetch_add(1, SeqCst);
            let data = &mut buf[..n as usize * BS];
            fill_write(data, id, lba, w.cycle);
            let write = Write {
                id,
                lba,
                n: n as u32,
                fua,
                issue: sh.tick(),
                ack: NOT_ACKED,
            };
            {
                let mut l = log.lock().unwrap();
                l.writes.push(write);
                l.in_flight = Some("WRITE");
            }
            let r = client.write_at(data, lba * BS as u64, fua);
            if r.is_ok() {
                let ack = sh.tick();
                log.lock().unwrap().writes.last_mut().unwrap().ack = ack;
            }
            r
        };
        let mut l = log.lock().unwrap();
        let kind = l.in_flight.take().unwrap_or("?");
        if result.is_ok() {
            sh.last_reply_ms.fetch_max(sh.now_ms(), SeqCst);
            if sent.elapsed() > l.slowest.0 {
                l.slowest_kind = kind;
                l.slowest = (sent.elapsed(), sent - started);
            }
        }
        if let Err(e) = result {
            if !sh.crashing.load(SeqCst) {
                l.failure
                    .get_or_insert(format!("I/O error before the crash (thread {thread}): {e}"));
            }
            break;
        }
        if l.failure.is_some() {
            break;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Verification
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Kill,
    Term,
}

/// One cycle's history, and what each block held when it started.
struct Cycle<'a> {
    number: u32,
    stop: Stop,
    first_id: u64,
    writes: &'a [Write],
    /// Per block: indices into `writes` of the writes covering it.
    cover: Vec<Vec<u32>>,
    /// Per block: the write id it held at the start of the cycle (0: zeroes).
    base: &'a [u64],
    flush_floor: u64,
}

#[derive(Default)]
struct Violations {
    list: Vec<String>,
    count: u64,
}

impl Violations {
    fn add(&mut self, msg: String) {
        self.count += 1;
        if self.list.len() < 25 {
            self.list.push(msg);
        }
    }
}

impl Cycle<'_> {
    fn write(&self, id: u64) -> Option<&Write> {
        id.checked_sub(self.first_id)
            .and_then(|i| self.writes.get(i as usize))
    }

    fn durable(&self, w: &Write) -> bool {
        match self.stop {
            Stop::Term => w.acked(),
            Stop::Kill => w.acked() && (w.fua || w.ack < self.flush_floor),
        }
    }

    /// Is content `seen` (0: zeroes) certainly older than in-cycle write `d`, i.e. would showing
    /// it mean `d` is lost? Content from before the cycle always is; an in-cycle write is if it
    /// was acknowledged before `d` was sent.
    fn older(&self, seen: u64, d: &Write) -> bool {
        match self.write(seen) {
            None => true,
            Some(w) => w.ack < d.issue,
        }
    }

    fn describe(&self, seen: u64) -> String {
        match self.write(seen) {
            None if seen == 0 => "zeroes".into(),
            None => format!("write {seen} (from an earlier cycle)"),
            Some(w) => format!(
                "write {} (blocks {}+{}, sent @{}, {}{})",
                w.id,
                w.lba,
                w.n,
                w.issue,
                if w.acked() {
                    format!("acked @{}", w.ack)
                } else {
                    "never acked".into()
                },
                if w.fua { ", FUA" } else { "" }
            ),
        }
    }

    /// Checks that `h` (found at block `lba`) is a real block of a write that covers `lba`, and
    /// not a resurrected earlier-cycle write; returns its id.
    fn identify(&self, lba: u64, h: Option<Header>, v: &mut Violations, what: &str) -> u64 {
        let Some(h) = h else {
            if self.base[lba as usize] != 0 {
                v.add(format!(
                    "{what}: block {lba} reads as zeroes, but held write {} when the cycle started",
                    self.base[lba as usize]
                ));
            }
            return 0;
        };
        if h.lba != lba {
            v.add(format!(
                "{what}: block {lba} holds block {} of write {} (meant for block {})",
                h.idx, h.id, h.lba
            ));
            return h.id;
        }
        if h.id < self.first_id {
            if h.id != self.base[lba as usize] {
                v.add(format!(
                    "{what}: block {lba} holds write {} of cycle {} (stale resurrection: it held {} \
                     when cycle {} started)",
                    h.id,
                    h.cycle,
                    self.describe(self.base[lba as usize]),
                    self.number
                ));
            }
            return h.id;
        }
        match self.write(h.id) {
            Some(w)
                if w.covers(lba)
                    && h.idx as u64 == lba - w.lba
                    && h.n == w.n
                    && h.cycle == self.number => {}
            _ => v.add(format!(
                "{what}: block {lba} holds an intact block claiming {h:?}, which no write matches"
            )),
        }
        h.id
    }

    fn covering(&self, lba: u64) -> impl Iterator<Item = &Write> {
        self.cover[lba as usize]
            .iter()
            .map(|&i| &self.writes[i as usize])
    }
}

/// Tallies of a verified cycle.
#[derive(Default, Debug)]
struct Tally {
    writes: u64,
    acked: u64,
    durable: u64,
    in_flight: u64,
    /// In-flight (unacknowledged) writes that made it.
    in_flight_present: u64,
    /// Acknowledged, not durable, and wholly gone (allowed).
    acked_lost: u64,
    reads: u64,
    flushes: u64,
}

/// Checks the state read after recovery (`seen`, one write id or 0 per block) and the reads
/// made during the workload against the cycle's history.
fn verify(c: &Cycle, seen: &[u64], reads: &[ReadObs], v: &mut Violations) -> Tally {
    let mut t = Tally {
        writes: c.writes.len() as u64,
        reads: reads.len() as u64,
        ..Tally::default()
    };
    // Prefix recovery: every write acknowledged before the newest visible write was sent.
    let newest_visible = seen
        .iter()
        .filter_map(|&id| c.write(id))
        .map(|w| w.issue)
        .max()
        .unwrap_or(0);

    for (lba, &s) in seen.iter().enumerate() {
        let lba = lba as u64;
        for d in c.covering(lba) {
            if d.id == s || !c.older(s, d) {
                continue;
            }
            if c.durable(d) {
                v.add(format!(
                    "cycle {}: block {lba} lost durable {}; it holds {}",
                    c.number,
                    c.describe(d.id),
                    c.describe(s)
                ));
            } else if d.ack < newest_visible {
                v.add(format!(
                    "cycle {}: block {lba} holds {}, older than {}, which was acknowledged before \
                     the newest surviving write was sent (not a prefix of the history)",
                    c.number,
                    c.describe(s),
                    c.describe(d.id)
                ));
            }
        }
    }

    // Atomicity, per write.
    for w in c.writes {
        let (mut present, mut absent) = (0u32, 0u32);
        for lba in w.lba..w.lba + w.n as u64 {
            let s = seen[lba as usize];
            if s == w.id {
                present += 1;
            } else if c.older(s, w) {
                absent += 1;
            }
        }
        if present > 0 && absent > 0 {
            let detail: Vec<String> = (w.lba..w.lba + w.n as u64)
                .map(|lba| format!("{lba}: {}", c.describe(seen[lba as usize])))
                .take(8)
                .collect();
            v.add(format!(
                "cycle {}: torn {}: {present} blocks present, {absent} blocks older ({})",
                c.number,
                c.describe(w.id),
                detail.join("; ")
            ));
        }
        if w.acked() {
            t.acked += 1;
            if c.durable(w) {
                t.durable += 1;
            } else if present == 0 && absent == w.n {
                t.acked_lost += 1;
            }
        } else {
            t.in_flight += 1;
            if present > 0 {
                t.in_flight_present += 1;
            }
        }
    }

    // Reads during the workload: never older than a write acknowledged before the read was sent,
    // never a write sent after the read was answered.
    for r in reads {
        for (i, &s) in r.seen.iter().enumerate() {
            let lba = r.lba + i as u64;
            if let Some(w) = c.write(s) {
                if w.issue > r.ack {
                    v.add(format!(
                        "cycle {}: read of block {lba} (sent @{}, answered @{}) returned {}, sent \
                         after the read was answered",
                        c.number,
                        r.issue,
                        r.ack,
                        c.describe(s)
                    ));
                }
            } else if s != 0 && s != c.base[lba as usize] {
                v.add(format!(
                    "cycle {}: read of block {lba} during the workload returned write {s} from \
                     an earlier cycle; it held {} when the cycle started",
                    c.number,
                    c.describe(c.base[lba as usize])
                ));
            } else if s == 0 && c.base[lba as usize] != 0 {
                v.add(format!(
                    "cycle {}: read of block {lba} during the workload returned zeroes; it held {} \
                     when the cycle started",
                    c.number,
                    c.describe(c.base[lba as usize])
                ));
            }
            for d in c.covering(lba) {
                if d.id != s && d.ack < r.issue && c.older(s, d) {
                    v.add(format!(
                        "cycle {}: read of block {lba} (sent @{}) returned {}, older than {}, \
                         acknowledged before the read was sent",
                        c.number,
                        r.issue,
                        c.describe(s),
                        c.describe(d.id)
                    ));
                }
            }
        }
    }
    t
}

/// Reads the whole export; returns one write id (0: zeroes) per block, checking each block's
/// identity.
fn read_all(uri: &str, c: &Cycle, v: &mut Violations, what: &str) -> Vec<u64> {
    let chunk = 4 * MIB as usize;
    let readers = 2;
    let per = DISK_BYTES as usize / readers;
    // Plain threads: if the server hangs, the watchdog kills it, and a reader that still does not
    // return makes the test fail rather than hang.
    let handles: Vec<_> = (0..readers)
        .map(|r| {
            let (uri, what) = (uri.to_string(), what.to_string());
            std::thread::spawn(move || {
                let client = NbdClient::connect(&uri)
                    .unwrap_or_else(|e| panic!("cannot connect to {uri}: {e}"));
                let mut buf = vec![0u8; chunk];
                let mut out = Vec::with_capacity(per / BS);
                let mut at = r * per;
                while at < (r + 1) * per {
                    client
                        .read_at(&mut buf, at as u64)
                        .unwrap_or_else(|e| panic!("{what}: read at {at} failed: {e}"));
                    for b in buf.chunks_exact(BS) {
                        out.push(decode_block(b).map_err(|e| format!("block {}: {e}", at / BS)));
                        at += BS;
                    }
                }
                out
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(150);
    while handles.iter().any(|h| !h.is_finished()) {
        assert!(
            Instant::now() < deadline,
            "{what}: reading back the disk did not finish in 150 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let parts: Vec<Vec<Result<Option<Header>, String>>> = handles
        .into_iter()
        .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
        .collect();
    parts
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(lba, h)| match h {
            Ok(h) => c.identify(lba as u64, h, v, what),
            Err(e) => {
                v.add(format!("{what}: {e}"));
                0
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The test
// ---------------------------------------------------------------------------------------------

/// The unsigned integer after `key=` in `log`'s last line containing `line`.
fn log_field(log: &str, line: &str, key: &str) -> Option<u64> {
    let l = log.lines().rev().find(|l| l.contains(line))?;
    let at = l.find(&format!("{key}="))? + key.len() + 1;
    let digits: String = l[at..].chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

struct Files {
    cache: PathBuf,
    backing: PathBuf,
    socket: PathBuf,
    control: PathBuf,
}

fn start(f: &Files, mode: &str) -> Server {
    start_with(f, mode, &[])
}

/// [`start`] with more serve options.
fn start_with(f: &Files, mode: &str, extra: &[&str]) -> Server {
    let mut args = vec![
        "--cache",
        path_str(&f.cache),
        "--backing",
        path_str(&f.backing),
        "--listen",
        path_str(&f.socket),
        "--mode",
        mode,
        // Our clients always read their replies, so a SIGTERM that takes more than a moment is a
        // hang; a long grace keeps the server in that state until `signal_and_wait` gives up
        // after 30 s and takes its thread stacks.
        "--shutdown-grace",
        "120",
        "--control-socket",
        path_str(&f.control),
    ];
    args.extend_from_slice(extra);
    match std::env::var("FLASHTIER_CRASH_LOG") {
        Ok(level) => Server::start_with_env(&args, &[("FLASHTIER_LOG", &level)]),
        Err(_) => Server::start(&args),
    }
}

/// The server's `batched_writes` counter (WRITEs it took in a batch since it started) and its
/// RAM tier's hit blocks (0 without one), or `None` when `flashtier stats` could not ask it.
fn batched_writes_and_ram_hits(f: &Files) -> Option<(u64, u64)> {
    let out = harness::ctl(&f.control, &["stats", "--json"]);
    if !out.status.success() {
        return None;
    }
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let batched = stats["counters"]["batched_writes"].as_u64()?;
    Some((
        batched,
        stats["ram"]["counters"]["hit_blocks"].as_u64().unwrap_or(0),
    ))
}

/// Fails the test, keeping the files for a post-mortem.
fn fail(dir: &Scratch, msg: String) -> ! {
    panic!(
        "{msg}\n(cache, backing file and server logs kept in {:?})",
        dir.path()
    );
}

/// How a crash run varies its cycles.
struct Plan {
    cycles: u32,
    /// Percent of cycles served in write-through mode (the rest write-back).
    write_through_percent: u64,
    /// Percent of cycles ended by SIGTERM (the rest by kill -9).
    term_percent: u64,
    connections: usize,
    /// Synchronous threads sharing each connection: the requests a connection has in flight.
    threads_per_connection: usize,
    /// The cycles must have reached the server's write batches (`batched_writes`), which only
    /// pipelined WRITEs do: a test meant for them that stopped reaching them would pass unseen.
    needs_batched_writes: bool,
    /// Every second cycle serves with a RAM tier (`--ram-cache`) in front of the cache, which
    /// the batches pass through.
    ram_tier: bool,
}

/// FLASHTIER_CRASH_STALL_MS=N fails a cycle in which a request took longer than N ms (off by
/// default: the test tolerates stalls up to `HUNG_AFTER`).
fn stall_limit() -> Option<Duration> {
    std::env::var("FLASHTIER_CRASH_STALL_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis)
}

/// FLASHTIER_CRASH_TERM_PERCENT=N ends N% of the cycles with SIGTERM instead of kill -9.
fn term_percent() -> u64 {
    std::env::var("FLASHTIER_CRASH_TERM_PERCENT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15)
}

#[test]
fn kill_9_under_verifying_workload() {
    let long = std::env::var("FLASHTIER_LONG").is_ok_and(|v| v == "1");
    crash_cycles(Plan {
        cycles: if long { 500 } else { 20 },
        write_through_percent: 25,
        term_percent: term_percent(),
        connections: CONNECTIONS,
        threads_per_connection: THREADS_PER_CONNECTION,
        needs_batched_writes: false,
        ram_tier: false,
    });
}

/// The same crash cycles, all in write-through mode, writers racing on the same blocks: the kill
/// -9 path to a write-through bug this found (racing writes logged in one order and written to
/// the backing store in another, the newer cached copy then marked clean over an older backing
/// copy: stale data after recovery or reclaim).
#[test]
fn kill_9_write_through_with_racing_writes() {
    let long = std::env::var("FLASHTIER_LONG").is_ok_and(|v| v == "1");
    crash_cycles(Plan {
        cycles: if long { 100 } else { 10 },
        write_through_percent: 100,
        term_percent: term_percent(),
        connections: CONNECTIONS,
        threads_per_connection: THREADS_PER_CONNECTION,
        needs_batched_writes: false,
        ram_tier: false,
    });
}

/// The same crash cycles in write-back mode with one connection of 8 threads: up to 8 requests
/// in flight on it, so small WRITEs arrive together and the server logs them as one group
/// (`transmission/batch.rs`, `cache/write_batch.rs`), acknowledging them in one write. With 2
/// threads a connection (above) that path is seldom taken. Every second cycle has a RAM tier in
/// front of the cache (the batches pass through it: `flashtier-ram`'s `tier.rs`).
#[test]
fn kill_9_with_pipelined_writes() {
    let long = std::env::var("FLASHTIER_LONG").is_ok_and(|v| v == "1");
    crash_cycles(Plan {
        cycles: if long { 100 } else { 10 },
        write_through_percent: 0,
        term_percent: term_percent(),
        connections: 1,
        threads_per_connection: 8,
        needs_batched_writes: true,
        ram_tier: true,
    });
}

fn crash_cycles(plan: Plan) {
    let cycles = plan.cycles;
    let seed = harness::seed_from_env("FLASHTIER_CRASH_SEED");
    println!("crash: {cycles} cycles, seed {seed} (FLASHTIER_CRASH_SEED={seed} to repeat)");
    let started = Instant::now();
    let mut rng = Rng::new(seed);

    let dir = Scratch::new();
    let f = Files {
        cache: dir.path().join("cache.img"),
        backing: dir.path().join("backing.img"),
        socket: dir.path().join("ft.sock"),
        control: dir.path().join("control.sock"),
    };
    let logs = dir.path().join("logs");
    fs::create_dir(&logs).unwrap();
    harness::sparse_file(&f.backing, DISK_BYTES);
    harness::run(Command::new(harness::BIN).args([
        "format",
        "--no-probe",
        "--cache",
        path_str(&f.cache),
        "--size",
        &CACHE_BYTES.to_string(),
        "--backing",
        path_str(&f.backing),
        "--segment-size",
        "1M",
    ]));

    let sh = Arc::new(Shared {
        clock: AtomicU64::new(0),
        next_id: AtomicU64::new(1),
        flush_floor: AtomicU64::new(0),
        crashing: AtomicBool::new(false),
        last_reply_ms: AtomicU64::new(0),
        epoch: Instant::now(),
    });
    let mut base = vec![0u64; DISK_BLOCKS as usize];
    let pick_mode = |rng: &mut Rng| {
        if rng.below(100) < plan.write_through_percent {
            "writethrough"
        } else {
            "writeback"
        }
    };
    // A RAM tier small beside the hot set, so it hits, misses and evicts.
    let ram = |cycle: u32| -> &'static [&'static str] {
        if plan.ram_tier && cycle % 2 == 1 {
            &["--ram-cache", "8M"]
        } else {
            &[]
        }
    };
    let mut mode = pick_mode(&mut rng);
    let mut server = start_with(&f, mode, ram(0));
    let mut ram_cycles = 0;
    let mut total = Tally::default();
    let (mut kills, mut terms, mut recoveries, mut replayed) = (0u64, 0u64, 0u64, 0u64);
    let mut writethrough_cycles = 0;
    let mut big_cycles = 0;
    let mut verified_blocks = 0u64;
    let (mut batched, mut ram_hits) = (0u64, 0u64);

    for cycle in 0..cycles {
        let stop = if rng.below(100) < plan.term_percent {
            Stop::Term
        } else {
            Stop::Kill
        };
        let big = cycle % 5 == 3;
        let working_set = if big { DISK_BLOCKS } else { HOT_BLOCKS };
        let delay = Duration::from_millis(200 + rng.below(1800));
        let w = Workload {
            cycle,
            working_set,
            seed: rng.next(),
        };
        let first_id = sh.next_id.load(SeqCst);
        sh.crashing.store(false, SeqCst);
        sh.flush_floor.store(0, SeqCst);
        if mode == "writethrough" {
            writethrough_cycles += 1;
        }
        big_cycles += big as u32;

        // The workload, then the crash (or the clean stop) while it runs.
        let clients: Vec<Arc<NbdClient>> = (0..plan.connections)
            .map(|_| {
                Arc::new(NbdClient::connect(&server.uri).unwrap_or_else(|e| {
                    panic!("cannot connect to {}: {e}\n{}", server.uri, server.log())
                }))
            })
            .collect();
        let t0 = Instant::now();
        sh.last_reply_ms.store(sh.now_ms(), SeqCst);
        // Plain threads, not scoped ones: a thread stuck in a request the server will never
        // answer can be left behind (see below). Each cycle has its own stop flag.
        let stop_workers = Arc::new(AtomicBool::new(false));
        let workers = plan.connections * plan.threads_per_connection;
        let thread_logs: Vec<Arc<Mutex<ThreadLog>>> = (0..workers)
            .map(|_| Arc::new(Mutex::new(ThreadLog::default())))
            .collect();
        let handles: Vec<_> = (0..workers)
            .map(|t| {
                let (client, sh) = (clients[t % plan.connections].clone(), sh.clone());
                let (stop, log) = (stop_workers.clone(), thread_logs[t].clone());
                std::thread::spawn(move || worker(&sh, &stop, &client, w, t as u64, &log))
            })
            .collect();
        std::thread::sleep(delay);
        // A kill -9 would hide a server that stopped answering: tell a stall from a hang first,
        // and take a hung server's thread stacks before it is killed.
        while sh.idle() > STALL && sh.idle() < HUNG_AFTER {
            std::thread::sleep(Duration::from_millis(50));
        }
        let hung = (sh.idle() >= HUNG_AFTER).then(|| {
            let stacks = logs.join(format!("cycle-{cycle}-hung-stacks.txt"));
            fs::write(&stacks, harness::thread_stacks(server.pid())).unwrap();
            stacks
        });
        if plan.needs_batched_writes && hung.is_none() {
            let (b, r) = batched_writes_and_ram_hits(&f)
                .unwrap_or_else(|| fail(&dir, format!("cycle {cycle}: `flashtier stats` failed")));
            batched += b;
            ram_hits += r;
        }
        ram_cycles += !ram(cycle).is_empty() as u32;
        sh.crashing.store(true, SeqCst);
        let status = server.signal_and_wait(match (stop, &hung) {
            (Stop::Kill, _) | (_, Some(_)) => libc::SIGKILL,
            (Stop::Term, None) => libc::SIGTERM,
        });
        stop_workers.store(true, SeqCst);
        // With the server gone every request fails at once (a READ whose reply was cut in the
        // middle of its data included: `nbd_client_read_cut_off_by_a_crash_fails`); a request
        // that never returns is a failure.
        let deadline = Instant::now() + Duration::from_secs(10);
        while handles.iter().any(|h| !h.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        for (t, h) in handles.into_iter().enumerate() {
            if h.is_finished() {
                h.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
                continue;
            }
            let in_flight = thread_logs[t].lock().unwrap().in_flight;
            fail(
                &dir,
                format!(
                    "cycle {cycle}: thread {t}'s {in_flight:?} request got no answer and no \
                     error within 10 s of {stop:?}"
                ),
            );
        }
        let thread_logs: Vec<ThreadLog> = thread_logs
            .iter()
            .map(|l| std::mem::take(&mut *l.lock().unwrap()))
            .collect();
        drop(clients);
        if let Some(stacks) = hung {
            fail(
                &dir,
                format!(
                    "cycle {cycle}: flashtier answered no request for {HUNG_AFTER:?} under load \
                     (hung; thread stacks in {stacks:?}); its log:\n{}",
                    server.log()
                ),
            );
        }
        let old_log = server.log();
        fs::write(logs.join(format!("cycle-{cycle}.log")), &old_log).unwrap();
        if stop == Stop::Term && !status.success() {
            fail(
                &dir,
                format!("cycle {cycle}: SIGTERM: flashtier exited {status}:\n{old_log}"),
            );
        }
        let ran = t0.elapsed();
        if let Some(limit) = stall_limit() {
            let worst = thread_logs.iter().max_by_key(|l| l.slowest.0);
            if let Some(w) = worst.filter(|w| w.slowest.0 > limit) {
                fail(
                    &dir,
                    format!(
                        "cycle {cycle}: a {} took {:?} (sent {:?} into the cycle), over \
                         FLASHTIER_CRASH_STALL_MS; the server's log is logs/cycle-{cycle}.log",
                        w.slowest_kind, w.slowest.0, w.slowest.1
                    ),
                );
            }
        }

        let mut writes: Vec<Write> = Vec::new();
        let mut reads: Vec<ReadObs> = Vec::new();
        let mut flushes = 0;
        let mut slowest = (Duration::ZERO, Duration::ZERO);
        let mut slowest_kind = "-";
        for l in thread_logs {
            if l.slowest > slowest {
                (slowest, slowest_kind) = (l.slowest, l.slowest_kind);
            }
            if let Some(why) = l.failure {
                fail(
                    &dir,
                    format!("cycle {cycle}: {why}\n--- server log\n{old_log}"),
                );
            }
            writes.extend(l.writes);
            reads.extend(l.reads);
            flushes += l.flushes;
        }
        writes.sort_by_key(|w| w.id);
        let next_id = sh.next_id.load(SeqCst);
        assert_eq!(
            writes.len() as u64,
            next_id - first_id,
            "a write went unrecorded"
        );
        assert!(writes
            .iter()
            .enumerate()
            .all(|(i, w)| w.id == first_id + i as u64));
        let mut cover = vec![Vec::new(); DISK_BLOCKS as usize];
        for (i, w) in writes.iter().enumerate() {
            for lba in w.lba..w.lba + w.n as u64 {
                cover[lba as usize].push(i as u32);
            }
        }

        // Restart on the same files, in the next cycle's mode.
        let next_mode = pick_mode(&mut rng);
        let t1 = Instant::now();
        server = start_with(&f, next_mode, ram(cycle + 1));
        let restart = t1.elapsed();
        let log = server.log();
        let recovered = log.contains("cache recovered after an unclean shutdown");
        let replayed_now = log_field(
            &log,
            "cache recovered after an unclean shutdown",
            "replayed_records",
        );
        match stop {
            Stop::Kill if !recovered => fail(
                &dir,
                format!("cycle {cycle}: no \"cache recovered after an unclean shutdown\" after kill -9:\n{log}"),
            ),
            Stop::Term if !log.contains("cache opened after a clean shutdown") => fail(
                &dir,
                format!("cycle {cycle}: no \"cache opened after a clean shutdown\" after SIGTERM:\n--- before\n{old_log}\n--- after\n{log}"),
            ),
            _ => {}
        }
        if recovered {
            let Some(n) = replayed_now else {
                fail(
                    &dir,
                    format!("no replayed_records in the recovery line:\n{log}"),
                );
            };
            recoveries += 1;
            replayed += n;
        }
        match stop {
            Stop::Kill => kills += 1,
            Stop::Term => terms += 1,
        }

        // Verify everything against the model.
        let t2 = Instant::now();
        let c = Cycle {
            number: cycle,
            stop,
            first_id,
            writes: &writes,
            cover,
            base: &base,
            flush_floor: sh.flush_floor.load(SeqCst),
        };
        let mut v = Violations::default();
        let what = format!("cycle {cycle} after {stop:?}");
        // Reading back 256 MiB takes well under a second; a server that hangs is killed, which
        // fails the reads instead of leaving the test waiting forever.
        let watchdog = Watchdog::arm(
            format!("{what}: reading back the disk"),
            Duration::from_secs(120),
            &[server.pid()],
            &logs,
        );
        let seen = read_all(&server.uri, &c, &mut v, &what);
        let mut t = verify(&c, &seen, &reads, &mut v);
        t.flushes = flushes;
        if v.count > 0 {
            let msg = format!(
                "cycle {cycle} ({mode}, {stop:?} after {ran:?}, working set {} MiB): {} violations:\n  {}\n--- server log before\n{old_log}\n--- server log after\n{log}",
                working_set * BS as u64 / MIB,
                v.count,
                v.list.join("\n  "),
            );
            fail(&dir, msg);
        }
        // What survived is the next cycle's starting point: make it durable.
        NbdClient::connect(&server.uri)
            .expect("connect")
            .flush()
            .unwrap_or_else(|e| panic!("flush after verification failed: {e}"));
        drop(watchdog);
        base = seen;
        verified_blocks += DISK_BLOCKS;
        println!(
            "cycle {cycle:3}: {mode:12} {:4} {:>5} MiB set, {:5} ms: {:5} writes ({} acked, {} \
             durable, {} in flight/{} landed, {} acked lost), {} flushes, {} reads, slowest {} ms {slowest_kind} \
             (sent at {} ms); restart {} ms (replayed {}), verify {} ms",
            format!("{stop:?}"),
            working_set * BS as u64 / MIB,
            ran.as_millis(),
            t.writes,
            t.acked,
            t.durable,
            t.in_flight,
            t.in_flight_present,
            t.acked_lost,
            t.flushes,
            t.reads,
            slowest.0.as_millis(),
            slowest.1.as_millis(),
            restart.as_millis(),
            replayed_now.map_or("-".to_string(), |n| n.to_string()),
            t2.elapsed().as_millis(),
        );
        total.writes += t.writes;
        total.acked += t.acked;
        total.durable += t.durable;
        total.in_flight += t.in_flight;
        total.in_flight_present += t.in_flight_present;
        total.acked_lost += t.acked_lost;
        total.reads += t.reads;
        total.flushes += t.flushes;
        mode = next_mode;
    }

    // Finally: write every dirty block back (pass-through keeps none) and check the backing file
    // itself against the model.
    server.stop();
    let server = start(&f, "passthrough");
    let log = server.log();
    server.stop();
    let backing = fs::read(&f.backing).unwrap();
    let mut mismatches = Vec::new();
    for (lba, b) in backing.chunks_exact(BS).enumerate() {
        let got = match decode_block(b) {
            Ok(None) => 0,
            Ok(Some(h)) if h.lba == lba as u64 => h.id,
            Ok(Some(h)) => {
                mismatches.push(format!("block {lba}: holds {h:?}"));
                continue;
            }
            Err(e) => {
                mismatches.push(format!("block {lba}: {e}"));
                continue;
            }
        };
        if got != base[lba] {
            mismatches.push(format!(
                "block {lba}: write {got} instead of write {}",
                base[lba]
            ));
        }
    }
    if !mismatches.is_empty() {
        let n = mismatches.len();
        mismatches.truncate(20);
        fail(
            &dir,
            format!(
                "backing file after writing everything back: {n} blocks differ from the model:\n  {}\n--- passthrough log\n{log}",
                mismatches.join("\n  ")
            ),
        );
    }

    println!(
        "crash summary: {cycles} cycles ({kills} kill -9, {terms} SIGTERM; {writethrough_cycles} \
         write-through, {big_cycles} with a working set larger than the cache), {} writes \
         verified ({} acked, {} durable, {} in flight of which {} landed, {} acked-not-durable \
         lost), {} flushes, {} reads checked, {verified_blocks} blocks verified, {recoveries} \
         recoveries replaying {replayed} records, backing file verified after write-back; {:.1} s",
        total.writes,
        total.acked,
        total.durable,
        total.in_flight,
        total.in_flight_present,
        total.acked_lost,
        total.flushes,
        total.reads,
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        recoveries, kills,
        "every kill -9 must be followed by a recovery"
    );
    if plan.needs_batched_writes {
        println!(
            "crash: {batched} writes taken in batches before the crashes; {ram_cycles} cycles \
             with a RAM tier, which answered {ram_hits} blocks"
        );
        assert!(
            batched > 0,
            "no cycle reached the server's write batches: the test no longer tests them"
        );
        assert!(
            ram_cycles == 0 || ram_hits > 0,
            "the RAM tier answered nothing in {ram_cycles} cycles"
        );
    }
}

/// The checker itself: it must catch a lost durable write, a torn write, stale resurrection,
/// garbage, a prefix violation and a stale read, and accept what the contract allows.
#[test]
fn crash_checker_catches_what_it_should() {
    // Blocks 0..8. Cycle 1 starts with block 0 holding write 1 (an earlier cycle's).
    let mut base = vec![0u64; 8];
    base[0] = 1;
    let wr = |id, lba, n, fua, issue, ack| Write {
        id,
        lba,
        n,
        fua,
        issue,
        ack,
    };
    let writes = [
        wr(10, 0, 2, false, 1, 2), // acked, then covered by the flush sent at 5
        wr(11, 2, 2, true, 3, 4),  // FUA: durable
        wr(12, 4, 2, false, 6, 7), // acked after the flush: not durable
        wr(13, 4, 2, false, 8, NOT_ACKED), // in flight at the crash
        wr(14, 6, 1, false, 9, NOT_ACKED), // in flight
    ];
    let mut cover = vec![Vec::new(); 8];
    for (i, w) in writes.iter().enumerate() {
        for lba in w.lba..w.lba + w.n as u64 {
            cover[lba as usize].push(i as u32);
        }
    }
    let c = Cycle {
        number: 1,
        stop: Stop::Kill,
        first_id: 10,
        writes: &writes,
        cover,
        base: &base,
        flush_floor: 5,
    };
    let check = |seen: [u64; 8], reads: &[ReadObs]| {
        let mut v = Violations::default();
        verify(&c, &seen, reads, &mut v);
        v
    };
    // Allowed: durable writes present; 12 lost entirely (not durable, nothing later visible);
    // in-flight 13 landed whole; in-flight 14 did not.
    assert_eq!(check([10, 10, 11, 11, 13, 13, 0, 0], &[]).count, 0);
    assert_eq!(check([10, 10, 11, 11, 0, 0, 0, 0], &[]).count, 0);
    assert_eq!(check([10, 10, 11, 11, 12, 12, 14, 0], &[]).count, 0);
    // Lost durable write (block 0 back to the earlier cycle's write 1), and torn write 10.
    let v = check([1, 10, 11, 11, 0, 0, 0, 0], &[]);
    assert!(
        v.list.iter().any(|m| m.contains("lost durable")),
        "{:?}",
        v.list
    );
    assert!(v.list.iter().any(|m| m.contains("torn")), "{:?}", v.list);
    // Lost FUA write.
    let v = check([10, 10, 0, 0, 0, 0, 0, 0], &[]);
    assert!(
        v.list.iter().any(|m| m.contains("lost durable")),
        "{:?}",
        v.list
    );
    // Prefix: 14 (sent at 9) survived but 12 (acked at 7) did not.
    let v = check([10, 10, 11, 11, 0, 0, 14, 0], &[]);
    assert!(v.list.iter().any(|m| m.contains("prefix")), "{:?}", v.list);
    // Torn in-flight write.
    let v = check([10, 10, 11, 11, 13, 0, 0, 0], &[]);
    assert!(v.list.iter().any(|m| m.contains("torn")), "{:?}", v.list);
    // Identity: stale resurrection, zeroes over data, garbage, misplaced blocks.
    let mut v = Violations::default();
    let h = |id, lba, idx, n, cycle| Header {
        id,
        lba,
        idx,
        n,
        cycle,
    };
    c.identify(0, Some(h(2, 0, 0, 1, 0)), &mut v, "t");
    assert!(v.list.last().unwrap().contains("stale resurrection"));
    c.identify(0, None, &mut v, "t");
    assert!(v.list.last().unwrap().contains("zeroes"));
    c.identify(3, Some(h(11, 2, 0, 2, 1)), &mut v, "t");
    assert!(v.list.last().unwrap().contains("meant for block 2"));
    c.identify(3, Some(h(11, 3, 0, 2, 1)), &mut v, "t");
    assert!(v.list.last().unwrap().contains("no write matches"));
    assert_eq!(v.count, 4);
    let mut b = vec![0u8; BS];
    fill_block(&mut b, h(11, 3, 1, 2, 1));
    let before = v.count;
    c.identify(3, decode_block(&b).unwrap(), &mut v, "t");
    assert_eq!(v.count, before, "{:?}", v.list);
    b[100] ^= 1;
    assert!(decode_block(&b).unwrap_err().contains("checksum"));
    // A read sent after write 10 was acked must not see what block 0 held before it.
    let stale_read = ReadObs {
        lba: 0,
        issue: 3,
        ack: 4,
        seen: vec![1],
    };
    let v = check([10, 10, 11, 11, 0, 0, 0, 0], &[stale_read]);
    assert!(
        v.list.iter().any(|m| m.contains("older than")),
        "{:?}",
        v.list
    );
    let fine_read = ReadObs {
        lba: 0,
        issue: 1,
        ack: 3,
        seen: vec![1],
    };
    assert_eq!(check([10, 10, 11, 11, 0, 0, 0, 0], &[fine_read]).count, 0);
}

// ---------------------------------------------------------------------------------------------
// The client: a READ cut off by a crash
// ---------------------------------------------------------------------------------------------

/// When the server dies in the middle of a READ reply's data, `NbdClient` must fail that READ
/// like every other request in flight. (It used to wait forever: the reader thread took the
/// request out of the pending set before reading its data, and on the truncated data failed only
/// the requests still pending.) Kills a server while 4 MiB reads run, many times.
#[test]
fn nbd_client_read_cut_off_by_a_crash_fails() {
    let dir = harness::scratch();
    let backing = dir.path().join("backing.img");
    harness::random_file(&backing, 64 << 20, 7);
    let mut rng = Rng::new(harness::seed_from_env("FLASHTIER_CRASH_SEED"));
    for attempt in 1..=200 {
        let mut server = Server::on_socket(dir.path(), path_str(&backing), &[]);
        let client = Arc::new(NbdClient::connect(&server.uri).expect("connect"));
        let readers: Vec<_> = (0..8)
            .map(|t| {
                let client = client.clone();
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 4 << 20];
                    while client.read_at(&mut buf, t << 22).is_ok() {}
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(5 + rng.below(20)));
        server.signal_and_wait(libc::SIGKILL);
        let deadline = Instant::now() + Duration::from_secs(5);
        while readers.iter().any(|r| !r.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let stuck = readers.iter().filter(|r| !r.is_finished()).count();
        assert!(
            stuck == 0,
            "attempt {attempt}: {stuck} of 8 READs (4 MiB) in flight when the server was killed \
             neither returned nor failed within 5 s"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Write-through: concurrent writes to the same blocks
// ---------------------------------------------------------------------------------------------

/// In write-through mode, several connections write the same few blocks at the same instant
/// (one fresh range per round, so every round is an independent chance of the race); then a FLUSH
/// (which marks write-through blocks clean), a read of everything through the cache, a clean
/// stop, and a restart in pass-through mode (which writes dirty blocks back, then reads the
/// backing store directly): every block must read the same as it did through the cache. Nothing
/// crashes; a crash, or reclaim evicting the clean block, exposes the same divergence (that is
/// how `kill_9_under_verifying_workload` found the bug this guards against).
#[test]
fn write_through_racing_writes_keep_cache_and_backing_equal() {
    let differ = write_through_race(4, 2048);
    assert!(differ.is_empty(), "{}", differ.join("\n"));
}

/// Runs the race; returns a description of each block that differs.
fn write_through_race(threads: usize, rounds: u64) -> Vec<String> {
    const RANGE: u64 = 4;
    let region = rounds * RANGE;
    let dir = Scratch::new();
    let f = Files {
        cache: dir.path().join("cache.img"),
        backing: dir.path().join("backing.img"),
        socket: dir.path().join("ft.sock"),
        control: dir.path().join("control.sock"),
    };
    harness::sparse_file(&f.backing, region * BS as u64);
    harness::run(Command::new(harness::BIN).args([
        "format",
        "--no-probe",
        "--cache",
        path_str(&f.cache),
        "--size",
        "256M",
        "--backing",
        path_str(&f.backing),
        "--segment-size",
        "1M",
        "--mode",
        "writethrough",
    ]));
    let server = start(&f, "writethrough");
    let barrier = std::sync::Barrier::new(threads);
    std::thread::scope(|s| {
        for t in 0..threads {
            let uri = server.uri.clone();
            let barrier = &barrier;
            s.spawn(move || {
                let client = NbdClient::connect(&uri).expect("connect");
                let mut buf = vec![0u8; RANGE as usize * BS];
                for round in 0..rounds {
                    let lba = round * RANGE;
                    let id = round * threads as u64 + t as u64 + 1;
                    fill_write(&mut buf, id, lba, 0);
                    barrier.wait();
                    client
                        .write_at(&buf, lba * BS as u64, false)
                        .expect("write");
                }
            });
        }
    });
    let read_region = |uri: &str| -> Vec<u64> {
        let client = NbdClient::connect(uri).expect("connect");
        let mut buf = vec![0u8; region as usize * BS];
        client.read_at(&mut buf, 0).expect("read");
        buf.chunks_exact(BS)
            .map(|b| decode_block(b).expect("intact").map_or(0, |h| h.id))
            .collect()
    };
    NbdClient::connect(&server.uri)
        .expect("connect")
        .flush()
        .expect("flush");
    let through_cache = read_region(&server.uri);
    server.stop();

    let server = start(&f, "passthrough");
    let from_backing = read_region(&server.uri);
    server.stop();
    let differ: Vec<String> = (0..region as usize)
        .filter(|&i| through_cache[i] != from_backing[i])
        .map(|i| {
            format!(
                "block {i}: write {} through the cache, write {} from the backing store once the \
                 cache is bypassed",
                through_cache[i], from_backing[i]
            )
        })
        .collect();
    println!(
        "write-through race: {rounds} rounds of {threads} simultaneous {RANGE}-block writes; {} \
         blocks read differently after a flush, a clean stop and a restart in pass-through mode",
        differ.len()
    );
    differ
}
