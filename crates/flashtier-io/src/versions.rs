//! The in-RAM record of writes that decides whether a copy of a block held by a memory tier (a
//! value fetched from memcached, a block in the RAM tier) may be used.
//!
//! A copy is never used because it *exists*: memcached is not trusted to be current (a delete
//! can be lost, a server can restart or come back from a partition holding values from before
//! later writes, another host can share the pool), and a RAM copy can race a write. A copy is used
//! only when the version it carries (or was inserted under) is the version this process holds
//! *now* for its block, and that version changes whenever a write to the block starts or ends.
//!
//! Each slot is one `AtomicU64` covering [`BLOCKS_PER_SLOT`] consecutive blocks and packs two
//! numbers: the writes in flight over those blocks (the top 16
//! bits) and a sequence number bumped by every write's start and end (the low 48). A write
//! calls [`Versions::begin`] before it reaches the store below and [`Versions::end`] after,
//! whether it succeeded or not.
//!
//! The invariant: **a value tagged `t` for block `b` holds the content the store below has for
//! `b` as long as `slot(b) == t`**. It holds because a value is only ever tagged with a word
//! whose in-flight count was 0 when it was taken, and taken *before* the data was read (a read
//! miss) or after the writer's own write ended with no other write having begun or ended in
//! between (checked by the sequence having moved by exactly the writer's two bumps). Any write
//! that starts later bumps the word, so the tag no longer matches; the sequence only grows (48
//! bits: 2.8·10^14 writes per slot before it could wrap), so an old tag never matches again.
//!
//! Slots are shared by design when the device has more ranges than the table has slots (the
//! table is at most [`MAX_SLOTS`] words, 32 MiB): a write then also invalidates the values of
//! the unrelated ranges sharing its slot, which costs misses, never correctness.
//!
//! One block per slot, not one 16 KiB page: a first version with 4 blocks per slot lost most
//! hits of 4 KiB random writes, each write making its three neighbours' fresh values old.

use std::sync::atomic::{AtomicU64, Ordering};

use smallvec::SmallVec;

/// (slot, word) pairs; a write of up to 32 blocks fits inline.
type Slots = SmallVec<[(usize, u64); 8]>;

/// Blocks whose writes share one version.
pub const BLOCKS_PER_SLOT: u64 = 1;
/// The largest table: 2^22 words, 32 MiB, exact (no slot shared) up to 16 GiB at 4 KiB blocks.
pub const MAX_SLOTS: usize = 1 << 22;

const INFLIGHT_SHIFT: u32 = 48;
const SEQ_MASK: u64 = (1 << INFLIGHT_SHIFT) - 1;
/// A write's start: one more in flight, sequence + 1.
const BEGIN: u64 = (1 << INFLIGHT_SHIFT) + 1;
/// A write's end: one fewer in flight, sequence + 1 (wrapping arithmetic on the packed word).
const END: u64 = 1u64.wrapping_sub(1 << INFLIGHT_SHIFT);

/// A slot's word as it was read: what a value is tagged with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tag(pub u64);

impl Tag {
    /// Whether no write to the slot was in flight when the word was read: only such a tag may
    /// be stored with a value.
    pub fn quiet(self) -> bool {
        self.0 >> INFLIGHT_SHIFT == 0
    }

    fn seq(self) -> u64 {
        self.0 & SEQ_MASK
    }
}

/// The version words of a device's blocks.
pub struct Versions {
    slots: Box<[AtomicU64]>,
    mask: u64,
}

/// The slots a write began, to end them afterwards; see [`Versions::begin`].
#[must_use = "a begun write must be ended, or its blocks are never served from a copy again"]
pub struct Begun {
    /// (slot, the word before this write's begin).
    slots: Slots,
}

impl Versions {
    /// A table for a device of `blocks` blocks.
    pub fn new(blocks: u64) -> Versions {
        let ranges = blocks.div_ceil(BLOCKS_PER_SLOT).max(1);
        let len = (ranges.next_power_of_two() as usize).min(MAX_SLOTS);
        Versions {
            slots: (0..len).map(|_| AtomicU64::new(0)).collect(),
            mask: len as u64 - 1,
        }
    }

    /// The memory the table takes.
    pub fn memory_bytes(&self) -> u64 {
        (self.slots.len() * std::mem::size_of::<AtomicU64>()) as u64
    }

    fn slot(&self, block: u64) -> usize {
        ((block / BLOCKS_PER_SLOT) & self.mask) as usize
    }

    /// The word of `block`'s slot now.
    pub fn tag(&self, block: u64) -> Tag {
        Tag(self.slots[self.slot(block)].load(Ordering::Acquire))
    }

    /// Whether a value tagged `tag` is still the newest data of `block`.
    pub fn current(&self, block: u64, tag: Tag) -> bool {
        tag.quiet() && self.tag(block) == tag
    }

    /// Whether no write to blocks `first..first + tags.len()` began or ended since `tags` were
    /// taken (one per block, in order). A read that answered some blocks from a copy and the
    /// others from the store below checks this afterwards: if a write ran meanwhile, its blocks
    /// may mix data from before and after it (a torn read of an atomic write), and the read is
    /// made again from below.
    pub fn unchanged(&self, first: u64, tags: &[Tag]) -> bool {
        tags.iter()
            .enumerate()
            .all(|(i, &t)| self.tag(first + i as u64) == t)
    }

    /// Marks a write of blocks `first..first + count` as started; call before the store below
    /// sees it.
    pub fn begin(&self, first: u64, count: u64) -> Begun {
        let mut slots = Slots::new();
        let last = first + count.max(1) - 1;
        let start = first / BLOCKS_PER_SLOT;
        // Each slot once, even if the range wraps the table (a write longer than the table's
        // reach bumps every slot once).
        let ranges = (last / BLOCKS_PER_SLOT - start + 1).min(self.slots.len() as u64);
        for range in start..start + ranges {
            let i = (range & self.mask) as usize;
            let before = self.slots[i].fetch_add(BEGIN, Ordering::AcqRel);
            slots.push((i, before));
        }
        Begun { slots }
    }

    /// Marks the write as ended. Returns, per block of the write, the tag its data may be
    /// stored with (`None` where another write to the slot began or ended meanwhile, or is
    /// still in flight: then which data the store holds is not known from here).
    pub fn end(
        &self,
        begun: Begun,
        first: u64,
        count: u64,
        mut each: impl FnMut(u64, Option<Tag>),
    ) {
        // In `begun`'s order: the slot of range `start + k` (wrapping the table) is at `k`.
        let ended: SmallVec<[Option<Tag>; 8]> = begun
            .slots
            .iter()
            .map(|&(i, before)| {
                let at_end = self.slots[i].fetch_add(END, Ordering::AcqRel);
                let after = Tag(at_end.wrapping_add(END));
                let alone = after.quiet() && after.seq() == (Tag(before).seq() + 2) & SEQ_MASK;
                alone.then_some(after)
            })
            .collect();
        let start = first / BLOCKS_PER_SLOT;
        for block in first..first + count {
            let tag = ended[((block / BLOCKS_PER_SLOT - start) % ended.len() as u64) as usize];
            each(block, tag);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_is_current_until_a_write_to_its_slot_begins() {
        let v = Versions::new(1000);
        let t = v.tag(5);
        assert!(t.quiet() && v.current(5, t));
        let w = v.begin(5, 1);
        assert!(!v.current(5, t));
        assert!(
            !v.tag(5).quiet(),
            "a write in flight: nothing may be tagged"
        );
        let mut tags = Vec::new();
        v.end(w, 5, 1, |b, t| tags.push((b, t)));
        assert!(!v.current(5, t), "an old tag never matches again");
        let (b, t5) = tags[0];
        assert_eq!(b, 5);
        let t5 = t5.expect("a write alone may store its data");
        assert!(v.current(5, t5));
        // Another slot is untouched.
        let t9 = v.tag(9);
        let w = v.begin(0, 1);
        v.end(w, 0, 1, |_, _| {});
        assert!(v.current(9, t9));
    }

    #[test]
    fn overlapping_writes_store_nothing() {
        let v = Versions::new(64);
        let a = v.begin(0, 2);
        let b = v.begin(1, 1);
        let mut got = Vec::new();
        v.end(a, 0, 2, |blk, t| got.push((blk, t)));
        v.end(b, 1, 1, |blk, t| got.push((blk, t)));
        // Block 0 was written by `a` alone; block 1 by both at once.
        assert!(got[0].1.is_some(), "{got:?}");
        assert!(got[1..].iter().all(|(_, t)| t.is_none()), "{got:?}");
        // Quiet again afterwards, and a later read may tag.
        assert!(v.tag(1).quiet());
    }

    #[test]
    fn a_write_that_ended_while_another_ran_through_it_stores_nothing() {
        let v = Versions::new(64);
        let a = v.begin(0, 1);
        let b = v.begin(0, 1);
        v.end(b, 0, 1, |_, t| assert!(t.is_none()));
        v.end(a, 0, 1, |_, t| assert!(t.is_none()));
        // Begin and end of another write strictly inside ours.
        let a = v.begin(0, 1);
        let b = v.begin(0, 1);
        let mut tb = None;
        v.end(b, 0, 1, |_, t| tb = t);
        assert!(tb.is_none(), "a is still in flight");
        v.end(a, 0, 1, |_, t| assert!(t.is_none()));
    }

    #[test]
    fn a_long_write_bumps_each_slot_once_even_past_the_table() {
        let v = Versions::new(4); // 4 slots
        let before: Vec<Tag> = (0..4).map(|b| v.tag(b)).collect();
        let w = v.begin(0, 1000);
        let mut stored = 0;
        v.end(w, 0, 1000, |_, t| stored += t.is_some() as u32);
        assert_eq!(stored, 1000);
        for b in 0..4 {
            assert_eq!(v.tag(b).seq(), before[b as usize].seq() + 2);
        }
    }

    #[test]
    fn big_devices_share_slots_and_only_lose_hits() {
        let v = Versions::new(u64::MAX / 2);
        assert_eq!(v.slots.len(), MAX_SLOTS);
        let far = MAX_SLOTS as u64 * BLOCKS_PER_SLOT;
        let t = v.tag(3);
        let w = v.begin(far + 3, 1);
        v.end(w, far + 3, 1, |_, _| {});
        assert!(
            !v.current(3, t),
            "a shared slot invalidates its other ranges too"
        );
    }

    proptest::proptest! {
        /// Against a model that remembers every write: a tag taken while quiet and still
        /// current means no write began after it was taken.
        #[test]
        fn current_means_no_write_since(ops in proptest::collection::vec((0u64..27, 1u64..6, proptest::bool::ANY), 1..200)) {
            let v = Versions::new(32);
            let mut open: Vec<(Begun, u64, u64)> = Vec::new();
            // (block, tag, writes begun on the block's slot-range since)
            let mut watched: Vec<(u64, Tag, bool)> = Vec::new();
            for (block, count, start) in ops {
                if start || open.is_empty() {
                    for w in watched.iter_mut() {
                        let (s, e) = (block / BLOCKS_PER_SLOT, (block + count - 1) / BLOCKS_PER_SLOT);
                        let r = w.0 / BLOCKS_PER_SLOT;
                        if r >= s && r <= e { w.2 = true; }
                    }
                    open.push((v.begin(block, count), block, count));
                } else {
                    let (b, f, c) = open.remove(0);
                    v.end(b, f, c, |_, _| {});
                }
                let t = v.tag(block);
                if t.quiet() { watched.push((block, t, false)); }
                for &(b, t, written) in &watched {
                    proptest::prop_assert_eq!(v.current(b, t), !written);
                }
            }
        }
    }
}
