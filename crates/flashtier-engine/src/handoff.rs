//! Reclaim's side of handing evicted clean blocks to a [`VictimSink`]: read them (after the
//! sink took their versions), and offer the ones reclaim then unmapped. Why that makes the data
//! current is in `victim_sink.rs`.

use std::sync::Arc;

use flashtier_io::versions::Tag;
use flashtier_io::AlignedBuf;

use crate::engine::Engine;
use crate::integrity;
use crate::victim_sink::VictimSink;

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
