//! The index, the segment table, the blocks' checksums and the lost blocks, changed together,
//! and the one function that applies a log record to them. Live operation and crash recovery
//! both go through [`State::apply`], in log order, so the index recovery rebuilds is the index
//! clients were served from.

use std::time::Duration;

use parking_lot::RwLock;

use crate::cow::CowVec;
use crate::index::{Index, SlotsSnapshot};
use crate::layout::batch::{Entry, Kind};
use crate::lost::LostSet;
use crate::segments::{Head, Segments};

pub struct State {
    pub index: Index,
    pub segs: Segments,
    /// CRC32C of the data in each slot, as written: every read of a slot is checked against it.
    /// Kept for a slot until the slot is written again, so a read that pinned the slot's segment
    /// can still check what it read after the block moved on. In copy-on-write chunks, like the
    /// index's slot words, for [`State::snapshot`].
    pub crcs: CowVec<u32>,
    /// Blocks whose newest data was lost (see `lost`).
    pub lost: LostSet,
}

impl State {
    pub fn new(index: Index, segs: Segments) -> State {
        let crcs = CowVec::new(index.slot_count() as usize);
        State {
            index,
            segs,
            crcs,
            lost: LostSet::default(),
        }
    }

    /// What a checkpoint records, as it is now. Costs O(slots / `cow::CHUNK_LEN` + segments +
    /// lost ranges) under the state lock, not O(slots): the per-slot arrays are shared
    /// copy-on-write, and encoding them happens later, without the lock.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            slots: self.index.snapshot(),
            crcs: self.crcs.clone(),
            open: self.segs.head,
            free: self.segs.free_order(),
            lost: self.lost.ranges().collect(),
            seals: self.segs.seals(),
        }
    }

    /// RAM used by the index and the checksums.
    pub fn memory_bytes(&self) -> usize {
        self.index.memory_bytes() + self.crcs.len() * 4
    }

    /// Maps `lba` to `slot`, keeping the segment counts right.
    fn map(&mut self, lba: u64, slot: u32, dirty: bool, crc: u32) {
        let old = self
            .index
            .get(lba)
            .and_then(|s| self.index.slot(s).map(|info| (s, info.dirty)));
        self.index.insert(lba, slot, dirty);
        self.crcs[slot as usize] = crc;
        if let Some((old_slot, old_dirty)) = old {
            self.segs.on_unmap(old_slot, old_dirty);
        }
        self.segs.on_map(slot, dirty);
    }

    /// Drops `lba` from the cache if it still lives in `slot` (a clean block is re-read from the
    /// backing store next time); returns whether it did and whether the block was dirty.
    pub fn unmap_if(&mut self, lba: u64, slot: u32) -> Option<bool> {
        let dirty = self.index.slot(slot).filter(|i| i.lba == lba)?.dirty;
        self.index.remove_if(lba, slot).then(|| {
            self.segs.on_unmap(slot, dirty);
            dirty
        })
    }

    /// Marks `[lba, lba + n)` lost, dropping whatever the cache maps there.
    pub fn mark_lost(&mut self, lba: u64, n: u64) {
        let segs = &mut self.segs;
        self.index
            .remove_range(lba, n, |_, slot, dirty| segs.on_unmap(slot, dirty));
        self.lost.insert(lba, n);
    }

    /// Clears the dirty flag of `lba` if it is dirty and still lives in `slot`; returns whether it
    /// did. Both the cleaner (in memory) and a replayed CLEANED record come through here, so a
    /// block cleaned twice is counted once.
    pub fn clean(&mut self, lba: u64, slot: u32) -> bool {
        let dirty = self
            .index
            .slot(slot)
            .is_some_and(|i| i.lba == lba && i.dirty);
        if dirty {
            self.index.set_clean_if(lba, slot);
            self.segs.on_clean(slot);
        }
        dirty
    }

    /// Applies one record whose data (if any) starts at `first_slot`; `crcs` are the checksums
    /// of its data blocks (empty for records without data).
    pub fn apply(&mut self, e: &Entry, first_slot: u32, crcs: &[u32]) {
        debug_assert_eq!(crcs.len(), e.data_blocks() as usize);
        match e.kind {
            Kind::Write => {
                self.lost.remove(e.lba, e.nblocks as u64);
                for i in 0..e.nblocks {
                    self.map(e.lba + i as u64, first_slot + i, e.dirty, crcs[i as usize]);
                }
            }
            Kind::Promote => {
                for i in 0..e.nblocks {
                    let (lba, slot) = (e.lba + i as u64, first_slot + i);
                    // A lost block's backing copy is older than the data that was lost.
                    if !self.lost.overlaps(lba, 1) && self.index.insert_if_absent(lba, slot, false)
                    {
                        self.crcs[slot as usize] = crcs[i as usize];
                        self.segs.on_map(slot, false);
                    }
                }
            }
            Kind::Move => {
                for i in 0..e.nblocks {
                    let (lba, from, to) = (e.lba + i as u64, e.aux as u32 + i, first_slot + i);
                    let dirty = self
                        .index
                        .slot(from)
                        .is_some_and(|s| s.lba == lba && s.dirty);
                    if self.index.move_if(lba, from, to) {
                        self.crcs[to as usize] = crcs[i as usize];
                        self.segs.on_unmap(from, dirty);
                        self.segs.on_map(to, dirty);
                    }
                }
            }
            Kind::Invalidate => {
                self.lost.remove(e.lba, e.nblocks as u64);
                let segs = &mut self.segs;
                self.index
                    .remove_range(e.lba, e.nblocks as u64, |_, slot, dirty| {
                        segs.on_unmap(slot, dirty)
                    });
            }
            Kind::Cleaned => {
                for i in 0..e.nblocks {
                    self.clean(e.lba + i as u64, e.aux as u32 + i);
                }
            }
            Kind::Lost => {
                for i in 0..e.nblocks {
                    let (lba, slot) = (e.lba + i as u64, e.aux as u32 + i);
                    if self.unmap_if(lba, slot) == Some(true) {
                        self.lost.insert(lba, 1);
                    }
                }
            }
            Kind::Free => self.free_segment(e.aux),
        }
    }

    /// Applies a FREE record: unmaps what is left in the segment and frees it (see `segments`).
    /// Live, reclaim has emptied it and nothing is left. Replayed, a checkpoint may still map
    /// blocks there that reclaim evicted (clean: the backing store has them) or moved by a
    /// record the replay skipped as damaged or lost in a gap (dirty: the block is lost, since
    /// the segment may be overwritten by now and nothing else holds its data).
    fn free_segment(&mut self, seg: u64) {
        let Ok(seg) = u32::try_from(seg) else { return };
        if !self.segs.freeable(seg) {
            return;
        }
        let bps = self.segs.blocks_per_segment();
        let left: Vec<(u32, u64)> = self
            .index
            .slots_in(seg * bps, bps)
            .map(|(slot, info)| (slot, info.lba))
            .collect();
        for (slot, lba) in left {
            if self.unmap_if(lba, slot) == Some(true) {
                self.lost.insert(lba, 1);
            }
        }
        self.segs.free_by_record(seg);
    }
}

/// The state at one log position, as a checkpoint records it (see [`State::snapshot`]).
pub struct Snapshot {
    /// Every slot's block and dirty flag.
    pub slots: SlotsSnapshot,
    /// Every slot's checksum.
    pub crcs: CowVec<u32>,
    /// The segment the log was filling.
    pub open: Option<Head>,
    /// Free segments in the order the log takes them.
    pub free: Vec<u32>,
    /// Ranges of lost blocks.
    pub lost: Vec<(u64, u64)>,
    /// Segments sealed so far (not on the device: see `Segments::reusable`).
    pub seals: u64,
}

/// Waits until no read started before `segments` were emptied is still running, so their slots
/// may be rewritten.
///
/// The state lock is taken afresh for each look and never held while sleeping: a reader leaves
/// its segment under a read lock, and parking_lot queues new readers behind a waiting writer, so
/// a read lock held across the wait (while any thread waits to write, e.g. to mark blocks clean)
/// would keep the reader from ever leaving — the whole engine then hung.
pub(crate) fn wait_for_readers(state: &RwLock<State>, segments: &[u32]) {
    for &s in segments {
        while state.read().segs.readers(s) > 0 {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::sync::Arc;

    fn entry(kind: Kind, lba: u64, nblocks: u32, aux: u64, dirty: bool) -> Entry {
        Entry {
            kind,
            dirty,
            lba,
            nblocks,
            aux,
            volume: 0,
            data_crc: 0,
        }
    }

    /// Replayed after a checkpoint that still maps blocks into the segment, a FREE record drops
    /// the clean ones (the backing store has them) and loses the dirty ones (the record that
    /// moved or cleaned them did not replay, and the segment may hold new log by now), then frees
    /// the segment; it leaves alone a segment that is free or the log's head.
    #[test]
    fn a_free_record_unmaps_its_segment_and_frees_it() {
        let mut st = State::new(Index::new(64), Segments::new(4, 16));
        for seg in 0..3 {
            st.segs.open_next(seg as u64);
            st.segs.seal_head();
        }
        st.segs.open_next(3);
        st.apply(&entry(Kind::Write, 100, 2, 0, false), 16, &[0, 0]);
        st.apply(&entry(Kind::Write, 200, 1, 0, true), 18, &[0]);
        st.apply(&entry(Kind::Write, 300, 1, 0, true), 48, &[0]);
        st.apply(&entry(Kind::Free, 0, 1, 1, false), 0, &[]);
        assert_eq!(st.index.get(100), None);
        assert_eq!(st.index.get(200), None);
        assert!(st.lost.overlaps(200, 1), "the dirty block is lost");
        assert!(!st.lost.overlaps(100, 2), "the clean ones are not");
        assert_eq!(st.segs.free_order(), vec![1]);
        assert_eq!((st.segs.live(1), st.segs.dirty(1)), (0, 0));
        // The head (segment 3) and a free segment are not freed again.
        st.apply(&entry(Kind::Free, 0, 1, 3, false), 0, &[]);
        st.apply(&entry(Kind::Free, 0, 1, 1, false), 0, &[]);
        assert_eq!(st.index.get(300), Some(48));
        assert_eq!(st.segs.free_order(), vec![1]);
    }

    /// A reader leaving its segment while another thread waits to write the state must not
    /// deadlock with the wait for readers (this hung the server under a write-through load: the
    /// log writer waited for readers holding a read lock, a write-through write queued for the
    /// write lock, and the reader's exit queued behind it).
    #[test]
    fn waiting_for_readers_does_not_block_a_reader_behind_a_queued_writer() {
        let state = Arc::new(RwLock::new(State::new(
            Index::new(64),
            Segments::new(4, 16),
        )));
        state.read().segs.reader_enter(2);
        let (done_tx, done_rx) = mpsc::channel();
        let waiter = {
            let state = state.clone();
            let done_tx = done_tx.clone();
            std::thread::spawn(move || {
                wait_for_readers(&state, &[2]);
                done_tx.send("waiter").unwrap();
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        let writer = {
            let state = state.clone();
            std::thread::spawn(move || {
                drop(state.write());
                done_tx.send("writer").unwrap();
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        let (exit_tx, exit_rx) = mpsc::channel();
        let reader = {
            let state = state.clone();
            std::thread::spawn(move || {
                state.read().segs.reader_exit(2);
                exit_tx.send(()).unwrap();
            })
        };
        let limit = Duration::from_secs(10);
        exit_rx
            .recv_timeout(limit)
            .expect("the reader could not leave its segment: deadlock");
        for _ in 0..2 {
            done_rx.recv_timeout(limit).expect("deadlock");
        }
        for t in [waiter, writer, reader] {
            t.join().unwrap();
        }
    }
}

/// A dirty block: which block, and the slot its newest version lives in (what the cleaner
/// writes back, reclaim copies forward, and a write-through write owes a backing flush).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct DirtyBlock {
    pub lba: u64,
    pub slot: u32,
}
