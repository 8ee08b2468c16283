//! Reclaim: empties segments so the log always has somewhere to go.
//!
//! A background thread wakes when free segments drop to the low-water mark, and empties victim
//! segments (FIFO: oldest; LRU: least recently read; empty ones first) until enough are free or
//! waiting for a checkpoint. For each victim: dirty blocks are written back first (never dropped),
//! blocks read since they were written are copied forward when the policy is LRU, and the rest are
//! evicted. The victim is then quarantined until a checkpoint no longer references it.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use flashtier_io::AlignedBuf;

use crate::cleaner::{self, DirtyBlock};
use crate::engine::Engine;
use crate::layout::batch::Kind;
use crate::log::{Record, RESERVE};
use crate::policy::ReclaimPolicy;
use crate::stats::Stats;

/// How long reclaim waits before retrying after an error (e.g. the backing store failed).
const RETRY_AFTER_ERROR: Duration = Duration::from_secs(1);

pub(crate) fn spawn(e: Arc<Engine>) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name("reclaim".into())
        .spawn(move || run(&e))
        .expect("cannot spawn the reclaim thread")
}

fn run(e: &Engine) {
    loop {
        {
            let mut ctl = e.reclaim.lock();
            while !ctl.wake && !ctl.stop && !needs_reclaim(e) {
                e.reclaim_cv.wait_for(&mut ctl, Duration::from_secs(1));
            }
            if ctl.stop {
                return;
            }
            ctl.wake = false;
        }
        if let Err(err) = reclaim_until_target(e) {
            tracing::warn!(error = %err, "reclaim failed; retrying");
            e.log.reclaim_failed(&err);
            std::thread::sleep(RETRY_AFTER_ERROR);
        }
    }
}

fn needs_reclaim(e: &Engine) -> bool {
    let st = e.state.read();
    st.segs.free_count() <= e.reclaim_low_water()
}

/// Empties victims until enough segments are free or quarantined, then checkpoints so the
/// quarantined ones become free.
pub(crate) fn reclaim_until_target(e: &Engine) -> io::Result<()> {
    let _turn = e.reclaim_turn.lock();
    loop {
        if e.reclaim.lock().stop {
            // Closing: the final checkpoint and the next start take it from here.
            return Ok(());
        }
        let (free, quarantined, victim) = {
            let st = e.state.read();
            (
                st.segs.free_count(),
                st.segs.quarantined_count(),
                st.segs.pick_victim(e.reclaim_policy()),
            )
        };
        if free + quarantined >= e.reclaim_target() {
            break;
        }
        // Copying blocks forward needs room; what earlier victims gave back only becomes free
        // with a checkpoint, so take one before the reserve runs out.
        if free <= RESERVE && quarantined > 0 {
            e.log.checkpoint()?;
            e.log.kick();
            continue;
        }
        let Some(victim) = victim else { break };
        reclaim_segment(e, victim)?;
    }
    if e.state.read().segs.quarantined_count() > 0 {
        e.log.checkpoint()?;
    }
    e.log.kick();
    Ok(())
}

/// Empties one sealed segment and quarantines it.
pub(crate) fn reclaim_segment(e: &Engine, victim: u32) -> io::Result<()> {
    let geo = e.geo;
    let first = geo.first_slot(victim);
    let bps = geo.blocks_per_segment();

    // 1. Dirty blocks go back to the backing store first.
    cleaner::clean_pass(e, |st| {
        st.index
            .slots_in(first, bps)
            .filter(|(_, i)| i.dirty)
            .map(|(slot, i)| DirtyBlock { lba: i.lba, slot })
            .collect()
    })?;

    // 2. Recently read blocks are copied forward (LRU), at most half a segment of them, so every
    //    victim frees at least half a segment even when all of it was read recently (a hot set
    //    larger than the cache), and none when no free segment is left to copy into.
    let room = if e.state.read().segs.free_count() == 0 {
        0
    } else {
        bps as usize / 2
    };
    if room > 0 && e.reclaim_policy() == ReclaimPolicy::Lru {
        let keep: Vec<DirtyBlock> = {
            let st = e.state.read();
            st.index
                .slots_in(first, bps)
                .filter(|(_, i)| !i.dirty && i.referenced)
                .map(|(slot, i)| DirtyBlock { lba: i.lba, slot })
                .take(room)
                .collect()
        };
        match move_forward(e, &keep) {
            Ok(()) => {}
            // Out of room: what did not move is evicted below, like any other clean block.
            Err(err) if err.raw_os_error() == Some(libc::ENOSPC) => {
                tracing::debug!(
                    segment = victim,
                    "no room to copy recently read blocks forward"
                )
            }
            Err(err) => return Err(err),
        }
    }

    // 3. Every clean block still in the victim is evicted; eviction needs no log space.
    let mut st = e.state.write();
    let remaining: Vec<DirtyBlock> = st
        .index
        .slots_in(first, bps)
        .filter(|(_, i)| !i.dirty)
        .map(|(slot, i)| DirtyBlock { lba: i.lba, slot })
        .collect();
    let mut evicted = 0u64;
    for b in &remaining {
        if st.index.remove_if(b.lba, b.slot) {
            st.segs.on_unmap(b.slot, false);
            evicted += 1;
        }
    }
    Stats::add(&e.stats.evicted_blocks, evicted);
    if st.segs.live(victim) == 0 {
        st.segs.quarantine(victim);
        Stats::add(&e.stats.reclaimed_segments, 1);
        return Ok(());
    }
    // Left: blocks that are dirty again because their write-back failed.
    Err(io::Error::other(format!(
        "segment {victim} still holds {} dirty blocks after reclaim",
        st.segs.live(victim)
    )))
}

/// Copies clean blocks into the log head as MOVE records (applied only where the block still
/// lives in the victim).
fn move_forward(e: &Engine, blocks: &[DirtyBlock]) -> io::Result<()> {
    let bs = e.geo.block_size as usize;
    let max = (e.atomic_bytes as usize / bs).max(1);
    let mut sorted = blocks.to_vec();
    sorted.sort_unstable_by_key(|b| b.slot);
    let mut i = 0;
    while i < sorted.len() {
        // Consecutive in both slot and address, so one record (and one read) covers the run.
        let mut j = i + 1;
        while j < sorted.len()
            && j - i < max
            && sorted[j].slot == sorted[j - 1].slot + 1
            && sorted[j].lba == sorted[j - 1].lba + 1
        {
            j += 1;
        }
        let run = &sorted[i..j];
        let mut data = AlignedBuf::zeroed(run.len() * bs);
        cleaner::read_slots(e, run, &mut data)?;
        let rec = Record::new(Kind::Move, run[0].lba, run.len() as u32, Some(data))
            .aux(run[0].slot as u64);
        // Queued together so they share batch headers; waiting for the last one waits for all
        // (the log applies in order). One that fails leaves its blocks in the victim, which then
        // is not quarantined and is retried.
        if j == sorted.len() {
            e.log.append(rec, true)?;
        } else {
            e.log.append_async(rec, true);
        }
        Stats::add(&e.stats.moved_blocks, run.len() as u64);
        i = j;
    }
    Ok(())
}
