//! The RAM tier's store: a bounded set of 4 KiB block copies, spread over shards by block number,
//! each shard evicting in LRU or FIFO order.
//!
//! Memory is bounded and allocated up front: a shard of `cap` slots holds one `cap × 4 KiB`
//! buffer (zeroed by the kernel page by page as slots are first used, so an idle tier costs
//! little resident memory), a slot table of 16 bytes per slot and a map of at most `cap`
//! entries. Nothing grows per request; an insert into a full shard reuses its victim's slot.
//!
//! A shard is a doubly linked list of its slots threaded through `Slot::prev`/`next` (indices,
//! not pointers): the head is the most recently inserted (and, under LRU, used) block, the tail
//! the next victim. Shards are independent, so eviction is LRU/FIFO per shard, an approximation
//! of the global order that keeps every lock short and uncontended.

use std::collections::HashMap;

use parking_lot::{Mutex, MutexGuard};

/// The size of a block copy.
pub const BLOCK: usize = 4096;

const NIL: u32 = u32::MAX;

/// The order a full shard evicts in (the SSD tier's `reclaim_policy` family).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RamPolicy {
    /// Least recently read first: a hit moves its block to the head.
    #[default]
    Lru,
    /// Oldest inserted first: hits do not reorder.
    Fifo,
}

/// The values the policy takes, for errors and help.
pub const POLICIES: &str = "lru | fifo";

impl std::str::FromStr for RamPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lru" => Ok(RamPolicy::Lru),
            "fifo" => Ok(RamPolicy::Fifo),
            _ => Err(format!(
                "invalid value '{s}' for ram_cache_policy: allowed {POLICIES}"
            )),
        }
    }
}

impl std::fmt::Display for RamPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RamPolicy::Lru => "lru",
            RamPolicy::Fifo => "fifo",
        })
    }
}

#[derive(Clone, Copy)]
struct Slot {
    block: u64,
    prev: u32,
    next: u32,
}

/// One shard: `cap` slots, the map from block to slot, and the eviction list.
pub struct Shard {
    map: HashMap<u64, u32>,
    slots: Vec<Slot>,
    data: Box<[u8]>,
    cap: u32,
    head: u32,
    tail: u32,
}

impl Shard {
    fn new(cap: u32) -> Shard {
        Shard {
            map: HashMap::with_capacity(cap as usize),
            slots: Vec::with_capacity(cap as usize),
            data: vec![0u8; cap as usize * BLOCK].into_boxed_slice(),
            cap,
            head: NIL,
            tail: NIL,
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the shard holds nothing.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    fn bytes(&self, slot: u32) -> &[u8] {
        &self.data[slot as usize * BLOCK..(slot as usize + 1) * BLOCK]
    }

    fn unlink(&mut self, s: u32) {
        let Slot { prev, next, .. } = self.slots[s as usize];
        match prev {
            NIL => self.head = next,
            p => self.slots[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.slots[n as usize].prev = prev,
        }
    }

    fn push_head(&mut self, s: u32) {
        self.slots[s as usize].prev = NIL;
        self.slots[s as usize].next = self.head;
        match self.head {
            NIL => self.tail = s,
            h => self.slots[h as usize].prev = s,
        }
        self.head = s;
    }

    /// Copies `block` into `out` if held; under LRU the block becomes the most recent.
    pub fn get(&mut self, block: u64, policy: RamPolicy, out: &mut [u8]) -> bool {
        let Some(&s) = self.map.get(&block) else {
            return false;
        };
        out.copy_from_slice(self.bytes(s));
        if policy == RamPolicy::Lru && self.head != s {
            self.unlink(s);
            self.push_head(s);
        }
        true
    }

    /// Whether `block` is held.
    pub fn contains(&self, block: u64) -> bool {
        self.map.contains_key(&block)
    }

    /// Drops `block`'s copy; whether there was one. Its slot goes to the tail, the next to be
    /// reused.
    pub fn remove(&mut self, block: u64) -> bool {
        let Some(s) = self.map.remove(&block) else {
            return false;
        };
        self.slots[s as usize].block = u64::MAX;
        self.unlink(s);
        // A free slot waits at the tail: the next insert takes it before any victim.
        self.slots[s as usize].next = NIL;
        self.slots[s as usize].prev = self.tail;
        match self.tail {
            NIL => self.head = s,
            t => self.slots[t as usize].next = s,
        }
        self.tail = s;
        true
    }

    /// Drops every copy of a block in `lo..hi`; how many.
    pub fn remove_range(&mut self, lo: u64, hi: u64) -> u64 {
        let doomed: Vec<u64> = self
            .map
            .keys()
            .copied()
            .filter(|b| (lo..hi).contains(b))
            .collect();
        doomed.iter().filter(|&&b| self.remove(b)).count() as u64
    }

    /// Stores `data` as `block`'s copy (replacing a copy it holds) at the head. A full shard
    /// first evicts its tail, calling `evicted` with the victim's block and data (a free slot
    /// at the tail is reused without a call). Returns whether a block was evicted.
    pub fn insert(&mut self, block: u64, data: &[u8], evicted: impl FnOnce(u64, &[u8])) -> bool {
        debug_assert_eq!(data.len(), BLOCK);
        if let Some(&s) = self.map.get(&block) {
            self.data[s as usize * BLOCK..(s as usize + 1) * BLOCK].copy_from_slice(data);
            if self.head != s {
                self.unlink(s);
                self.push_head(s);
            }
            return false;
        }
        let mut did_evict = false;
        let s = if (self.slots.len() as u32) < self.cap {
            self.slots.push(Slot {
                block,
                prev: NIL,
                next: NIL,
            });
            (self.slots.len() - 1) as u32
        } else {
            let victim = self.tail;
            let old = self.slots[victim as usize].block;
            if old != u64::MAX {
                self.map.remove(&old);
                evicted(old, self.bytes(victim));
                did_evict = true;
            }
            self.unlink(victim);
            victim
        };
        self.slots[s as usize].block = block;
        self.data[s as usize * BLOCK..(s as usize + 1) * BLOCK].copy_from_slice(data);
        self.push_head(s);
        self.map.insert(block, s);
        did_evict
    }

    /// The blocks held, most recent first (for tests and checks).
    pub fn order(&self) -> Vec<u64> {
        let mut out = Vec::new();
        let mut s = self.head;
        while s != NIL {
            let b = self.slots[s as usize].block;
            if b != u64::MAX {
                out.push(b);
            }
            s = self.slots[s as usize].next;
        }
        out
    }
}

/// The shards, and which one holds a block.
pub struct Store {
    shards: Box<[Mutex<Shard>]>,
    capacity: u64,
    /// What `new` allocated (fixed: nothing grows afterwards).
    memory_bytes: u64,
}

/// Slots per shard below which the store is not split further: a shard of fewer would evict
/// far from the global order.
const MIN_SHARD_SLOTS: u64 = 256;
/// The most shards: enough that two cores and a few NBD workers rarely meet on one lock.
const MAX_SHARDS: u64 = 64;

impl Store {
    /// A store of `capacity` blocks (at least 1).
    pub fn new(capacity: u64) -> Store {
        let capacity = capacity.max(1);
        // The largest power of two of shards that leaves each at least MIN_SHARD_SLOTS.
        let want = (capacity / MIN_SHARD_SLOTS).clamp(1, MAX_SHARDS);
        let n = 1u64 << (63 - want.leading_zeros());
        let shards: Box<[Mutex<Shard>]> = (0..n)
            .map(|i| {
                // The remainder goes to the first shards, so the total is exactly `capacity`.
                let cap = capacity / n + u64::from(i < capacity % n);
                Mutex::new(Shard::new(cap as u32))
            })
            .collect();
        // hashbrown: 8 + 4 bytes of entry (padded to 16) and 1 control byte per bucket, buckets
        // = capacity * 8 / 7 rounded up to a power of two.
        let memory_bytes = shards
            .iter()
            .map(|s| {
                let cap = u64::from(s.lock().cap);
                let buckets = (cap * 8 / 7 + 1).next_power_of_two();
                cap * (BLOCK as u64 + std::mem::size_of::<Slot>() as u64) + buckets * 17
            })
            .sum();
        Store {
            shards,
            capacity,
            memory_bytes,
        }
    }

    /// Blocks the store can hold.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The number of shards.
    pub fn shards(&self) -> usize {
        self.shards.len()
    }

    /// The shard of `block`, locked. Neighbouring blocks go to different shards (a multi-block
    /// read spreads its locks), and a multiplicative hash keeps strided patterns from piling up
    /// on one.
    pub fn shard(&self, block: u64) -> MutexGuard<'_, Shard> {
        let h = block.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        self.shards[(h as usize) & (self.shards.len() - 1)].lock()
    }

    /// Every shard in turn, locked (for trims longer than the store and for counts).
    pub fn each_shard(&self, mut f: impl FnMut(&mut Shard)) {
        for s in self.shards.iter() {
            f(&mut s.lock());
        }
    }

    /// Blocks held now.
    pub fn len(&self) -> u64 {
        let mut n = 0;
        self.each_shard(|s| n += s.len() as u64);
        n
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// An estimate of the memory the store allocated: the slot buffers, the slot tables and the
    /// maps at their reserved capacity.
    pub fn memory_bytes(&self) -> u64 {
        self.memory_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(b: u64) -> Vec<u8> {
        let mut v = vec![0u8; BLOCK];
        v[..8].copy_from_slice(&b.to_le_bytes());
        v
    }

    #[test]
    fn lru_evicts_the_least_recently_read() {
        let mut s = Shard::new(3);
        let mut out = vec![0u8; BLOCK];
        for b in 1..=3 {
            assert!(!s.insert(b, &block(b), |_, _| panic!("room left")));
        }
        assert!(s.get(1, RamPolicy::Lru, &mut out));
        assert_eq!(out, block(1));
        let mut victim = None;
        assert!(s.insert(4, &block(4), |b, d| victim = Some((b, d.to_vec()))));
        assert_eq!(victim, Some((2, block(2))), "1 was read after 2");
        assert_eq!(s.order(), vec![4, 1, 3]);
    }

    #[test]
    fn fifo_ignores_reads() {
        let mut s = Shard::new(3);
        let mut out = vec![0u8; BLOCK];
        for b in 1..=3 {
            s.insert(b, &block(b), |_, _| {});
        }
        assert!(s.get(1, RamPolicy::Fifo, &mut out));
        let mut victim = None;
        s.insert(4, &block(4), |b, _| victim = Some(b));
        assert_eq!(victim, Some(1));
    }

    #[test]
    fn a_removed_block_frees_its_slot_without_an_eviction() {
        let mut s = Shard::new(2);
        s.insert(1, &block(1), |_, _| {});
        s.insert(2, &block(2), |_, _| {});
        assert!(s.remove(1));
        assert!(!s.remove(1));
        assert!(!s.insert(3, &block(3), |_, _| panic!("slot 1 was free")));
        assert_eq!(s.order(), vec![3, 2]);
        let mut out = vec![0u8; BLOCK];
        assert!(!s.get(1, RamPolicy::Lru, &mut out));
    }

    #[test]
    fn reinserting_replaces_the_copy() {
        let mut s = Shard::new(2);
        s.insert(1, &block(1), |_, _| {});
        s.insert(1, &block(9), |_, _| panic!());
        let mut out = vec![0u8; BLOCK];
        assert!(s.get(1, RamPolicy::Lru, &mut out));
        assert_eq!(out, block(9));
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn the_store_holds_exactly_its_capacity() {
        for cap in [1u64, 7, 255, 256, 257, 1000, 20_000, 100_000] {
            let st = Store::new(cap);
            let mut total = 0;
            st.each_shard(|s| total += u64::from(s.cap));
            assert_eq!(total, cap, "cap {cap}");
            assert!(st.shards().is_power_of_two() && st.shards() as u64 <= MAX_SHARDS);
            assert!(cap < MIN_SHARD_SLOTS || cap / st.shards() as u64 >= MIN_SHARD_SLOTS);
        }
    }

    proptest::proptest! {
        /// Against a model (a list in recency order): the same hits, the same victims.
        #[test]
        fn a_shard_is_an_exact_lru_or_fifo(
            cap in 1u32..8,
            lru in proptest::bool::ANY,
            ops in proptest::collection::vec((0u8..3, 0u64..12), 1..300),
        ) {
            let policy = if lru { RamPolicy::Lru } else { RamPolicy::Fifo };
            let mut s = Shard::new(cap);
            let mut model: Vec<u64> = Vec::new(); // most recent first
            let mut out = vec![0u8; BLOCK];
            for (op, b) in ops {
                match op {
                    0 => {
                        let hit = s.get(b, policy, &mut out);
                        let pos = model.iter().position(|&m| m == b);
                        proptest::prop_assert_eq!(hit, pos.is_some());
                        if let Some(p) = pos {
                            proptest::prop_assert_eq!(&out, &block(b));
                            if lru {
                                model.remove(p);
                                model.insert(0, b);
                            }
                        }
                    }
                    1 => {
                        let mut victim = None;
                        s.insert(b, &block(b), |v, d| victim = Some((v, d.to_vec())));
                        let expect = if let Some(p) = model.iter().position(|&m| m == b) {
                            model.remove(p);
                            None
                        } else if model.len() == cap as usize {
                            model.pop()
                        } else {
                            None
                        };
                        model.insert(0, b);
                        proptest::prop_assert_eq!(victim.as_ref().map(|v| v.0), expect);
                        if let Some((v, d)) = victim {
                            proptest::prop_assert_eq!(d, block(v));
                        }
                    }
                    _ => {
                        let had = s.remove(b);
                        let pos = model.iter().position(|&m| m == b);
                        proptest::prop_assert_eq!(had, pos.is_some());
                        if let Some(p) = pos {
                            model.remove(p);
                        }
                    }
                }
                proptest::prop_assert_eq!(s.order(), model.clone());
            }
        }
    }
}
