//! Segment bookkeeping: which segments are free, which one the log is filling, how many live and
//! dirty blocks each holds, and which reclaim has emptied but may not reuse yet.
//!
//! A segment reclaim has emptied is *quarantined* until reclaim logs a FREE record for it; the
//! log writer applies the record by putting the segment at the end of the free list, and recovery
//! replays it the same way, so the order the log takes free segments in is the checkpoint's free
//! list followed by the FREE records after it, at run time and in replay alike (which is what
//! lets recovery follow the log from segment to segment without scanning). Replayed, a FREE
//! record also unmaps whatever a checkpoint still maps in the segment (evictions are not logged).
//!
//! Two rules make the reuse safe:
//!
//! - **The segment's old log is no longer needed.** Recovery starts from the newest checkpoint,
//!   or from the one before it when the newest is damaged, and walks the log from there. A
//!   segment is freed only once it was sealed before the snapshot of the older of the two newest
//!   durable checkpoints ([`Segments::reusable`] with the log's threshold): no walk recovery may
//!   make reads it, and every checkpoint recovery may start from has it sealed or quarantined, so
//!   the FREE record is replayed after it. Seals are counted ([`Segments::seals`]), a snapshot
//!   records the count and the log writer publishes the older checkpoint's; the segments the
//!   checkpoint recovery loaded had sealed count as sealed at 0, and nothing qualifies until a
//!   checkpoint after opening is durable. (The long power-loss campaign found why the older
//!   checkpoint is the one that counts: with the newest one's, a segment the log had gone
//!   through after the older checkpoint was reused; with the newer one's body damaged, recovery
//!   from the older one met the log overwritten, cut it, and served older data.)
//! - **The FREE record is durable, and vouched for, before the segment is overwritten**, with
//!   the MOVE records before it: before the log writer opens a segment freed by a FREE record
//!   that no synced header vouches for, it syncs, seals the head with two headers saying the
//!   record is durable and syncs again (damage to a batch that nothing vouches for reads as the
//!   torn tail, and the cut would drop the record; see `log_writer`), and it waits for reads of
//!   the segment still in flight.
//!
//! A segment that does not qualify yet waits for checkpoints (reclaim asks for them); most
//! victims, sealed long before, are freed at once. When the log has no room left even for a
//! FREE record, a checkpoint frees them instead (see `log_writer`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::policy::ReclaimPolicy;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegState {
    Free,
    /// The log is appending to it.
    Open,
    /// Full (or sealed early); holds live data until reclaimed.
    Sealed,
    /// Emptied by reclaim; free once its FREE record is applied (see the module's essay).
    Quarantined,
}

/// The log's write position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    pub segment: u32,
    /// Blocks of the segment written so far.
    pub used: u32,
}

pub struct Segments {
    blocks_per_segment: u32,
    state: Vec<SegState>,
    live: Vec<u32>,
    dirty: Vec<u32>,
    /// Sequence number of the first record written to the segment: FIFO age.
    opened_seq: Vec<u64>,
    /// Coarse time (seconds of engine uptime) of the last read hit in the segment, or, if none
    /// since it was opened, the latest read hit's in any segment then: LRU age.
    last_access: Vec<AtomicU32>,
    /// The latest time any `last_access` was set to: a segment opened takes it, so it is as
    /// recent as the most recently read one instead of keeping its previous use's time.
    latest_access: AtomicU32,
    /// Reads of the segment's slots in flight; a quarantined segment is reused only at zero.
    readers: Vec<AtomicU32>,
    /// When the segment's blocks were written, for the cleaner's max age: `(offset, second)`
    /// marks, one per second in which batches were written to it (the batch starting at that
    /// block offset and those after it, up to the next mark, were written in that second of
    /// engine uptime). Segments fill front to back, so this dates every slot to the second at a
    /// cost of one mark per second of writing. Not on the device: a segment recovered from the
    /// log has none, and its blocks count as written when the engine started.
    written: Vec<Vec<(u32, u32)>>,
    free: VecDeque<u32>,
    /// When the segment was sealed, as the value of `seals` then (0: sealed before the checkpoint
    /// recovery loaded): its old log is needed no more once the older checkpoint recovery may
    /// use was snapshotted after it.
    sealed_at: Vec<u64>,
    /// Segments sealed since opening: a clock that only seals move, so that a segment sealed
    /// before a checkpoint's snapshot is told from one sealed after it even when no record was
    /// written in between (sequence numbers do not move then: with them, a segment sealed over
    /// a failed write while clients waited for space never qualified, and reclaim asked for
    /// checkpoints forever, found by the fault sweep).
    seals: u64,
    /// Emptied by reclaim, waiting for their FREE records. In quarantine order.
    quarantine: Vec<u32>,
    pub head: Option<Head>,
}

impl Segments {
    /// All segments free, in order.
    #[cfg(test)]
    pub fn new(count: u32, blocks_per_segment: u32) -> Segments {
        Segments::with_free(count, blocks_per_segment, (0..count).collect())
    }

    /// Segments in `free` are free in that order; the others start sealed (their live counts come
    /// from the index as it is rebuilt).
    pub fn with_free(count: u32, blocks_per_segment: u32, free: Vec<u32>) -> Segments {
        let n = count as usize;
        let mut state = vec![SegState::Sealed; n];
        for &s in &free {
            state[s as usize] = SegState::Free;
        }
        Segments {
            blocks_per_segment,
            state,
            live: vec![0; n],
            dirty: vec![0; n],
            opened_seq: vec![0; n],
            last_access: (0..n).map(|_| AtomicU32::new(0)).collect(),
            latest_access: AtomicU32::new(0),
            readers: (0..n).map(|_| AtomicU32::new(0)).collect(),
            written: vec![Vec::new(); n],
            free: free.into(),
            sealed_at: vec![0; n],
            seals: 0,
            quarantine: Vec::new(),
            head: None,
        }
    }

    pub fn count(&self) -> u32 {
        self.state.len() as u32
    }

    pub fn blocks_per_segment(&self) -> u32 {
        self.blocks_per_segment
    }

    /// Whether a FREE record may free `seg`: it is neither free nor the log's head (only a
    /// damaged log could name one that is).
    pub fn freeable(&self, seg: u32) -> bool {
        self.state
            .get(seg as usize)
            .is_some_and(|s| matches!(s, SegState::Sealed | SegState::Quarantined))
    }

    #[cfg(test)]
    pub fn state(&self, seg: u32) -> SegState {
        self.state[seg as usize]
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn quarantined_count(&self) -> usize {
        self.quarantine.len()
    }

    pub fn live(&self, seg: u32) -> u32 {
        self.live[seg as usize]
    }

    pub fn dirty(&self, seg: u32) -> u32 {
        self.dirty[seg as usize]
    }

    pub fn total_dirty(&self) -> u64 {
        self.dirty.iter().map(|&d| d as u64).sum()
    }

    pub fn total_live(&self) -> u64 {
        self.live.iter().map(|&d| d as u64).sum()
    }

    /// Blocks the log can still write without reclaim emptying another segment: the free
    /// segments, those emptied and waiting for their FREE records, and what the open segment has
    /// not written yet.
    pub fn unwritten_blocks(&self) -> u64 {
        let bps = u64::from(self.blocks_per_segment);
        let empty = (self.free.len() + self.quarantine.len()) as u64;
        let head_rest = self.head.map_or(0, |h| {
            u64::from(self.blocks_per_segment.saturating_sub(h.used))
        });
        empty * bps + head_rest
    }

    /// The order the log takes the free segments in, as a checkpoint records it.
    pub fn free_order(&self) -> Vec<u32> {
        self.free.iter().copied().collect()
    }

    /// How many segments were sealed so far: a checkpoint's snapshot records it (see
    /// [`Segments::reusable`]).
    pub fn seals(&self) -> u64 {
        self.seals
    }

    /// The quarantined segments that may be freed now, in quarantine order: sealed before the
    /// snapshot of the older checkpoint recovery may start from, which saw `seals_then` seals (see
    /// the module's essay); `None` before the first checkpoint after opening, when the older one
    /// may be the checkpoint before the one recovery loaded, of which nothing is known.
    pub fn reusable(&self, seals_then: Option<u64>) -> impl Iterator<Item = u32> + '_ {
        self.quarantine
            .iter()
            .copied()
            .filter(move |&s| self.sealed_before(s, seals_then))
    }

    /// Whether `seg` was sealed before the snapshot that saw `seals_then` seals: emptied, it
    /// could be freed at once (see [`Segments::reusable`]).
    pub fn sealed_before(&self, seg: u32, seals_then: Option<u64>) -> bool {
        seals_then.is_some_and(|then| self.sealed_at[seg as usize] <= then)
    }

    fn seg_of(&self, slot: u32) -> usize {
        (slot / self.blocks_per_segment) as usize
    }

    /// A slot gained a live block.
    pub fn on_map(&mut self, slot: u32, dirty: bool) {
        let s = self.seg_of(slot);
        self.live[s] += 1;
        if dirty {
            self.dirty[s] += 1;
        }
    }

    /// A slot lost its live block.
    pub fn on_unmap(&mut self, slot: u32, dirty: bool) {
        let s = self.seg_of(slot);
        debug_assert!(self.live[s] > 0, "live count underflow in segment {s}");
        self.live[s] = self.live[s].saturating_sub(1);
        if dirty {
            debug_assert!(self.dirty[s] > 0, "dirty count underflow in segment {s}");
            self.dirty[s] = self.dirty[s].saturating_sub(1);
        }
    }

    /// A live block became clean.
    pub fn on_clean(&mut self, slot: u32) {
        let s = self.seg_of(slot);
        debug_assert!(self.dirty[s] > 0, "dirty count underflow in segment {s}");
        self.dirty[s] = self.dirty[s].saturating_sub(1);
    }

    /// Restores the log head from a checkpoint.
    pub fn set_head(&mut self, head: Head) {
        self.state[head.segment as usize] = SegState::Open;
        self.head = Some(head);
    }

    /// Takes the next free segment for the log, if any.
    pub fn open_next(&mut self, first_seq: u64) -> Option<u32> {
        let seg = self.free.pop_front()?;
        debug_assert_eq!(self.state[seg as usize], SegState::Free);
        self.open(seg, first_seq);
        Some(seg)
    }

    /// Opens `seg` for the log although it is not next in the free list: recovery found the log
    /// going on there (replaying from an older checkpoint than the newest, which freed it).
    /// Whatever the checkpoint still counted in it must be unmapped by the caller first.
    pub fn open_specific(&mut self, seg: u32, first_seq: u64) {
        if let Some(at) = self.free.iter().position(|&s| s == seg) {
            self.free.remove(at);
        }
        self.quarantine.retain(|&s| s != seg);
        self.open(seg, first_seq);
    }

    fn open(&mut self, seg: u32, first_seq: u64) {
        self.state[seg as usize] = SegState::Open;
        self.opened_seq[seg as usize] = first_seq;
        self.last_access[seg as usize].store(
            self.latest_access.load(Ordering::Relaxed),
            Ordering::Relaxed,
        );
        // Cleared, not replaced: the marks' room is kept for the segment's next use.
        self.written[seg as usize].clear();
        self.head = Some(Head {
            segment: seg,
            used: 0,
        });
    }

    /// The segment `open_next` would take.
    pub fn next_free(&self) -> Option<u32> {
        self.free.front().copied()
    }

    /// The log left the open segment.
    pub fn seal_head(&mut self) {
        if let Some(h) = self.head.take() {
            self.state[h.segment as usize] = SegState::Sealed;
            self.seals += 1;
            self.sealed_at[h.segment as usize] = self.seals;
        }
    }

    /// Marks a sealed segment emptied by reclaim.
    pub fn quarantine(&mut self, seg: u32) {
        debug_assert_eq!(self.state[seg as usize], SegState::Sealed);
        debug_assert_eq!(
            self.live[seg as usize], 0,
            "quarantining a segment with live data"
        );
        self.state[seg as usize] = SegState::Quarantined;
        self.quarantine.push(seg);
    }

    /// Applies a FREE record for `seg` (its blocks already unmapped), or a checkpoint that freed
    /// it: it joins the end of the free list. A segment already free or open is left as it is
    /// (only a damaged log could name one: recovery found the log going on there by a scan).
    pub fn free_by_record(&mut self, seg: u32) -> bool {
        if !self.freeable(seg) {
            return false;
        }
        debug_assert_eq!(
            self.live[seg as usize], 0,
            "freeing a segment with live data"
        );
        self.quarantine.retain(|&s| s != seg);
        self.state[seg as usize] = SegState::Free;
        self.free.push_back(seg);
        true
    }

    /// A batch was written to `seg` from block offset `at`, in second `now` of engine uptime.
    pub fn note_written(&mut self, seg: u32, at: u32, now: u32) {
        let marks = &mut self.written[seg as usize];
        if marks.last().is_none_or(|&(_, t)| t != now) {
            marks.push((at, now));
        }
    }

    /// The second of engine uptime in which the block in `slot` was written (0 for blocks
    /// recovered from the log).
    pub fn written_at(&self, slot: u32) -> u32 {
        let marks = &self.written[self.seg_of(slot)];
        let offset = slot % self.blocks_per_segment;
        match marks.partition_point(|&(at, _)| at <= offset) {
            0 => 0,
            i => marks[i - 1].1,
        }
    }

    /// The segment holding dirty blocks that the log wrote first.
    pub fn oldest_dirty_segment(&self) -> Option<u32> {
        (0..self.count())
            .filter(|&s| {
                self.dirty[s as usize] > 0
                    && matches!(self.state[s as usize], SegState::Sealed | SegState::Open)
            })
            .min_by_key(|&s| self.opened_seq[s as usize])
    }

    /// The segments holding dirty blocks (sealed or open), in the given order: log order (FIFO:
    /// oldest first) or least recently read first (LRU, ties in log order).
    pub fn dirty_segments(&self, order: ReclaimPolicy) -> Vec<u32> {
        let mut segs: Vec<u32> = (0..self.count())
            .filter(|&s| {
                self.dirty[s as usize] > 0
                    && matches!(self.state[s as usize], SegState::Sealed | SegState::Open)
            })
            .collect();
        match order {
            ReclaimPolicy::Fifo => segs.sort_unstable_by_key(|&s| self.opened_seq[s as usize]),
            ReclaimPolicy::Lru => segs.sort_unstable_by_key(|&s| {
                (
                    self.last_access[s as usize].load(Ordering::Relaxed),
                    self.opened_seq[s as usize],
                )
            }),
        }
        segs
    }

    pub fn note_access(&self, seg: u32, now: u32) {
        self.last_access[seg as usize].store(now, Ordering::Relaxed);
        // Read before written: it moves at most once a second, and every reader would otherwise
        // write its cache line.
        if self.latest_access.load(Ordering::Relaxed) < now {
            self.latest_access.fetch_max(now, Ordering::Relaxed);
        }
    }

    pub fn reader_enter(&self, seg: u32) {
        self.readers[seg as usize].fetch_add(1, Ordering::AcqRel);
    }

    pub fn reader_exit(&self, seg: u32) {
        self.readers[seg as usize].fetch_sub(1, Ordering::AcqRel);
    }

    pub fn readers(&self, seg: u32) -> u32 {
        self.readers[seg as usize].load(Ordering::Acquire)
    }

    /// The sealed segment reclaim should empty next: one without live blocks if there is one
    /// (free to take), else the oldest (FIFO) or least recently read (LRU).
    /// Changes each time the segment is reused: a slot remembered with its segment's generation
    /// still holds what it held then only while the generation is the same.
    pub fn generation(&self, seg: u32) -> u64 {
        self.opened_seq[seg as usize]
    }

    /// The sealed segment with the fewest live blocks (the cheapest to empty).
    pub fn sparsest_sealed(&self) -> Option<u32> {
        self.sparsest_sealed_where(|_| true)
    }

    /// [`Segments::sparsest_sealed`] among those `keep` keeps.
    pub fn sparsest_sealed_where(&self, keep: impl Fn(u32) -> bool) -> Option<u32> {
        (0..self.count())
            .filter(|&s| self.state[s as usize] == SegState::Sealed && keep(s))
            .min_by_key(|&s| (self.live[s as usize], self.opened_seq[s as usize]))
    }

    pub fn pick_victim(&self, policy: ReclaimPolicy) -> Option<u32> {
        let sealed = (0..self.count()).filter(|&s| self.state[s as usize] == SegState::Sealed);
        if let Some(empty) = sealed.clone().find(|&s| self.live[s as usize] == 0) {
            return Some(empty);
        }
        match policy {
            ReclaimPolicy::Fifo => sealed.min_by_key(|&s| self.opened_seq[s as usize]),
            ReclaimPolicy::Lru => sealed.min_by_key(|&s| {
                (
                    self.last_access[s as usize].load(Ordering::Relaxed),
                    self.opened_seq[s as usize],
                )
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifecycle_free_open_sealed_quarantined_free() {
        let mut s = Segments::new(4, 16);
        assert_eq!(s.free_count(), 4);
        assert_eq!(s.open_next(10), Some(0));
        assert_eq!(s.state(0), SegState::Open);
        s.on_map(3, true);
        s.on_map(4, false);
        assert_eq!((s.live(0), s.dirty(0)), (2, 1));
        s.on_clean(3);
        s.on_unmap(3, false);
        s.on_unmap(4, false);
        s.seal_head();
        assert_eq!(s.state(0), SegState::Sealed);
        assert_eq!(s.pick_victim(ReclaimPolicy::Fifo), Some(0));
        s.quarantine(0);
        assert_eq!(s.state(0), SegState::Quarantined);
        assert!(s.free_by_record(0));
        assert_eq!(s.state(0), SegState::Free);
        assert_eq!(s.free_order(), vec![1, 2, 3, 0]);
        assert_eq!(s.quarantined_count(), 0);
        assert!(!s.free_by_record(0), "a free segment is not freed twice");
        assert_eq!(s.free_count(), 4);
    }

    /// Unwritten: free segments, emptied ones waiting for FREE records, the open one's rest;
    /// sealed segments count nothing, however little of them is live.
    #[test]
    fn unwritten_blocks_are_free_emptied_and_the_open_segments_rest() {
        let mut s = Segments::new(4, 16);
        assert_eq!(s.unwritten_blocks(), 64);
        s.open_next(1);
        assert_eq!(
            s.unwritten_blocks(),
            64,
            "an open segment nothing was written to yet"
        );
        s.head.as_mut().unwrap().used = 5;
        assert_eq!(s.unwritten_blocks(), 48 + 11);
        s.seal_head();
        assert_eq!(
            s.unwritten_blocks(),
            48,
            "a sealed segment's rest is stale, not unwritten"
        );
        s.quarantine(0);
        assert_eq!(
            s.unwritten_blocks(),
            64,
            "an emptied segment is unwritten again"
        );
        assert!(s.free_by_record(0));
        assert_eq!(s.unwritten_blocks(), 64);
    }

    /// A quarantined segment is reusable once the older checkpoint recovery may start from was
    /// snapshotted after it was sealed, whether or not records were written in between.
    #[test]
    fn a_segment_is_reusable_once_sealed_before_the_older_checkpoint() {
        let mut s = Segments::new(5, 16);
        let loaded = s.seals();
        for seq in [1, 2, 3] {
            s.open_next(seq);
            s.seal_head();
        }
        s.quarantine(2);
        s.quarantine(0);
        assert_eq!(s.reusable(None).count(), 0, "no checkpoint since opening");
        assert_eq!(s.reusable(Some(loaded)).count(), 0, "sealed after it");
        let snapshot = s.seals();
        s.open_next(4);
        s.seal_head();
        s.quarantine(3);
        assert_eq!(
            s.reusable(Some(snapshot)).collect::<Vec<_>>(),
            vec![2, 0],
            "in quarantine order; not the one sealed after the snapshot"
        );
        // Segments the checkpoint loaded at opening had sealed count as sealed before it.
        let mut r = Segments::with_free(3, 16, vec![2]);
        r.quarantine(1);
        assert_eq!(r.reusable(Some(0)).collect::<Vec<_>>(), vec![1]);
    }

    /// Three segments of 16 blocks, opened with these first sequence numbers and sealed, each
    /// holding one live block (dirty or clean).
    fn sealed_in_order(first_seqs: [u64; 3], dirty: bool) -> Segments {
        let mut s = Segments::new(3, 16);
        for seq in first_seqs {
            let seg = s.open_next(seq).unwrap();
            s.on_map(seg * 16, dirty);
            s.seal_head();
        }
        s
    }

    #[test]
    fn victims_follow_the_policy_but_empty_segments_come_first() {
        let mut s = sealed_in_order([100, 50, 75], false);
        assert_eq!(s.pick_victim(ReclaimPolicy::Fifo), Some(1));
        s.note_access(1, 9);
        s.note_access(2, 5);
        s.note_access(0, 7);
        assert_eq!(s.pick_victim(ReclaimPolicy::Lru), Some(2));
        s.on_unmap(32, false);
        assert_eq!(s.pick_victim(ReclaimPolicy::Lru), Some(2));
        s.on_unmap(0, false);
        assert_eq!(s.pick_victim(ReclaimPolicy::Fifo), Some(0), "empty first");
    }

    #[test]
    fn a_reused_segment_is_as_recent_as_its_opening() {
        let mut s = sealed_in_order([10, 20, 30], false);
        s.note_access(0, 5);
        s.note_access(1, 100);
        s.note_access(2, 100);
        s.on_unmap(0, false);
        s.quarantine(0);
        s.free_by_record(0);
        assert_eq!(s.open_next(40), Some(0));
        s.on_map(0, false);
        s.seal_head();
        // Last read at second 5 in its previous use, opened at 100 in this one: as recent as
        // the others, and the newest of them in the log.
        assert_eq!(s.pick_victim(ReclaimPolicy::Lru), Some(1));
        s.note_access(1, 101);
        s.note_access(2, 101);
        assert_eq!(s.pick_victim(ReclaimPolicy::Lru), Some(0));
    }

    #[test]
    fn blocks_are_dated_by_the_second_their_batch_was_written() {
        let mut s = Segments::new(2, 16);
        s.open_next(1);
        assert_eq!(s.written_at(5), 0, "recovered blocks date from the start");
        s.note_written(0, 0, 7);
        s.note_written(0, 2, 7);
        s.note_written(0, 4, 9);
        s.note_written(0, 10, 12);
        assert_eq!(
            [0, 1, 3, 4, 9, 10, 15].map(|o| s.written_at(o)),
            [7, 7, 7, 9, 9, 12, 12]
        );
        s.seal_head();
        s.quarantine(0);
        s.free_by_record(0);
        s.open_next(2);
        s.open_next(3);
        assert_eq!(s.written_at(3), 0, "marks go when the segment is reused");
    }

    #[test]
    fn dirty_segments_in_log_or_access_order() {
        let mut s = sealed_in_order([100, 50, 75], true);
        assert_eq!(s.dirty_segments(ReclaimPolicy::Fifo), vec![1, 2, 0]);
        s.note_access(1, 9);
        assert_eq!(s.dirty_segments(ReclaimPolicy::Lru), vec![2, 0, 1]);
        s.on_clean(32);
        assert_eq!(s.dirty_segments(ReclaimPolicy::Fifo), vec![1, 0]);
        assert_eq!(s.oldest_dirty_segment(), Some(1));
    }
}
