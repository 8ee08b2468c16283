//! Handing the clean blocks reclaim evicts to a slower tier that keeps victims (the memcached
//! tier's `victim` mode), through a narrow handle, [`VictimSink`].
//!
//! The sink stores a block only with a version it took *before* the block was read from the
//! cache device, and uses the value later only while that version is still current. What makes
//! the pair (version, data) right is one rule every write path of the engine already keeps for
//! its own crash safety: **a path that writes the backing store drops or replaces the block's
//! mapping before its backing write begins** (write-around and pass-through apply their
//! INVALIDATE first; write-through maps the new data before writing the backing store; a trim
//! invalidates its whole blocks first; write-back writes reach the backing store only by
//! cleaning, which writes dirty blocks, never a clean mapping's). So when reclaim unmaps a clean
//! block under the state lock and finds it still in the slot it read, no backing write of that
//! block began since the mapping existed, in particular none since the version was taken: the
//! data is what the backing store held then. A write after that bumps the version, and the
//! value is old before anyone can use it.
//!
//! What it costs reclaim: one read of the span of the victim's clean blocks from the cache
//! device, and the sink's send (for memcached, one pipelined batch per server, bounded by
//! `memcached_timeout_ms`), per victim segment. It takes no lock a writer waits on beyond the
//! state lock's usual moments, so it delays freeing space but cannot block it. (A first version
//! skipped it while free segments were at the reserve; in a cache under read-miss churn,
//! reclaim's victims are nearly always taken there, and nothing was ever handed down.) A failed
//! read or a block failing its checksum is simply not offered.

use std::sync::Arc;

use flashtier_io::versions::Tag;
use flashtier_io::AlignedBuf;

use crate::engine::Engine;
use crate::integrity;

/// A tier that keeps what the SSD tier evicts.
pub trait VictimSink: Send + Sync {
    /// Whether the sink takes victims now; asked once per victim segment, before anything is
    /// read for it.
    fn wants(&self) -> bool;
    /// Appends to `out` the versions of the sink's blocks covering `[offset, offset + len)` of
    /// the backing store, as they are now; false (the caller then offers nothing of this range)
    /// if a write to any of them is in flight or the range is not whole blocks of the sink's.
    fn tags(&self, offset: u64, len: usize, out: &mut Vec<Tag>) -> bool;
    /// Offers `data`, the content of `[offset, offset + data.len())`, with the versions `tags`
    /// took before it was read. Only queues: called right after reclaim unmapped the blocks.
    fn offer(&self, offset: u64, tags: &[Tag], data: &[u8]);
    /// Sends what was offered (outside the engine's locks).
    fn ship(&self);
}

/// A clean block read for the hand-off.
struct Candidate {
    lba: u64,
    slot: u32,
    /// Its versions' position in `Handoff::tags`.
    tags: std::ops::Range<usize>,
}

/// The clean blocks of one victim segment, read before reclaim evicts them.
pub(crate) struct Handoff {
    sink: Arc<dyn VictimSink>,
    /// The slot `buf` starts at.
    first: u32,
    buf: AlignedBuf,
    block_size: usize,
    candidates: Vec<Candidate>,
    tags: Vec<Tag>,
    /// Indices into `candidates` that reclaim unmapped from the slot read.
    evicted: Vec<usize>,
}

/// Reads the clean blocks of the segment starting at slot `first` (`bps` slots), each with the
/// sink's versions taken before the read, if a sink wants them.
pub(crate) fn read_clean(e: &Engine, first: u32, bps: u32) -> Option<Handoff> {
    let sink = e.victim_sink.read().clone()?;
    if !sink.wants() {
        return None;
    }
    let bs = e.geo.block_size as usize;
    let pinned = e.geo.segment_of(first);
    let clean: Vec<(u64, u32, u32)> = {
        let st = e.state.read();
        let clean: Vec<(u64, u32, u32)> = st
            .index
            .slots_in(first, bps)
            .filter(|(_, i)| !i.dirty)
            .map(|(slot, i)| (i.lba, slot, st.crcs[slot as usize]))
            .collect();
        if clean.is_empty() {
            return None;
        }
        st.segs.reader_enter(pinned);
        clean
    };
    let mut tags = Vec::with_capacity(clean.len());
    let mut candidates = Vec::with_capacity(clean.len());
    let mut crcs = Vec::with_capacity(clean.len());
    for &(lba, slot, crc) in &clean {
        let start = tags.len();
        if sink.tags(lba * bs as u64, bs, &mut tags) {
            candidates.push(Candidate {
                lba,
                slot,
                tags: start..tags.len(),
            });
            crcs.push(crc);
        } else {
            tags.truncate(start);
        }
    }
    let read = candidates.first().zip(candidates.last()).map(|(lo, hi)| {
        let mut buf = AlignedBuf::zeroed((hi.slot - lo.slot + 1) as usize * bs);
        e.cache
            .read_at(&mut buf, e.geo.slot_offset(lo.slot))
            .map(|()| (lo.slot, buf))
    });
    e.state.read().segs.reader_exit(pinned);
    let (first_read, buf) = match read? {
        Ok(r) => r,
        Err(err) => {
            tracing::debug!(segment = pinned, %err, "evicted blocks not handed down");
            return None;
        }
    };
    // A block that fails its checksum is not offered (reclaim evicts it anyway; the backing
    // store holds it).
    let mut kept = Vec::with_capacity(candidates.len());
    for (c, crc) in candidates.into_iter().zip(crcs) {
        let at = (c.slot - first_read) as usize * bs;
        if integrity::intact(&buf[at..at + bs], crc) {
            kept.push(c);
        }
    }
    Some(Handoff {
        sink,
        first: first_read,
        buf,
        block_size: bs,
        candidates: kept,
        tags,
        evicted: Vec::new(),
    })
}

impl Handoff {
    /// Reclaim unmapped `lba` from `slot` (under the state lock): it may be offered.
    pub(crate) fn evicted(&mut self, lba: u64, slot: u32) {
        // Candidates are in slot order (the index lists a segment's slots in order).
        if let Ok(i) = self.candidates.binary_search_by_key(&slot, |c| c.slot) {
            if self.candidates[i].lba == lba {
                self.evicted.push(i);
            }
        }
    }

    /// Offers the blocks evicted and ships them; outside the state lock.
    pub(crate) fn ship(self) {
        if self.evicted.is_empty() {
            return;
        }
        let bs = self.block_size;
        for &i in &self.evicted {
            let c = &self.candidates[i];
            let at = (c.slot - self.first) as usize * bs;
            self.sink.offer(
                c.lba * bs as u64,
                &self.tags[c.tags.clone()],
                &self.buf[at..at + bs],
            );
        }
        self.sink.ship();
    }
}
