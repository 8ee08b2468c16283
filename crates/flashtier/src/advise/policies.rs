//! FIFO and S3-FIFO caches of a fixed number of blocks, simulated access by access: unlike LRU
//! they have no stack property, so each cache size is its own run.
//!
//! S3-FIFO (Yang et al., SOSP 2023): a small FIFO of a tenth of the cache takes new blocks; one
//! read or written again while there moves to the main FIFO when it reaches the small FIFO's
//! tail, the others are evicted and remembered in a ghost FIFO (as many entries as the main
//! FIFO holds). A miss of a remembered block goes straight to the main FIFO. The main FIFO
//! reinserts a block with accesses left (a 2-bit counter, decremented by each reinsertion)
//! instead of evicting it.
//!
//! Queues hold `(block, stamp)`; a block removed early (a trim) leaves its entry behind, which
//! the stamp marks as stale when it reaches the tail.

use std::collections::{HashMap, VecDeque};

/// A simulated cache.
pub trait Simulated {
    /// An access (read or write) of `block`; returns whether the cache held it.
    fn access(&mut self, block: u64) -> bool;
    /// The block was trimmed: the cache drops it.
    fn forget(&mut self, block: u64);
}

pub struct Fifo {
    capacity: usize,
    queue: VecDeque<(u64, u64)>,
    held: HashMap<u64, u64>,
    stamp: u64,
}

impl Fifo {
    pub fn new(capacity: usize) -> Fifo {
        Fifo {
            capacity,
            queue: VecDeque::new(),
            held: HashMap::new(),
            stamp: 0,
        }
    }
}

impl Simulated for Fifo {
    fn access(&mut self, block: u64) -> bool {
        if self.held.contains_key(&block) {
            return true;
        }
        if self.capacity == 0 {
            return false;
        }
        while self.held.len() >= self.capacity {
            let (b, stamp) = self.queue.pop_front().expect("a full cache has a queue");
            if self.held.get(&b) == Some(&stamp) {
                self.held.remove(&b);
            }
        }
        self.stamp += 1;
        self.held.insert(block, self.stamp);
        self.queue.push_back((block, self.stamp));
        false
    }

    fn forget(&mut self, block: u64) {
        self.held.remove(&block);
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    stamp: u64,
    /// Accesses since insertion or the last reinsertion, at most 3.
    freq: u8,
    main: bool,
}

pub struct S3Fifo {
    capacity: usize,
    small_capacity: usize,
    small: VecDeque<(u64, u64)>,
    main: VecDeque<(u64, u64)>,
    small_len: usize,
    main_len: usize,
    held: HashMap<u64, Entry>,
    ghost: VecDeque<(u64, u64)>,
    ghosts: HashMap<u64, u64>,
    ghost_capacity: usize,
    stamp: u64,
}

impl S3Fifo {
    pub fn new(capacity: usize) -> S3Fifo {
        let small_capacity = (capacity / 10).max(1);
        S3Fifo {
            capacity,
            small_capacity,
            small: VecDeque::new(),
            main: VecDeque::new(),
            small_len: 0,
            main_len: 0,
            held: HashMap::new(),
            ghost: VecDeque::new(),
            ghosts: HashMap::new(),
            ghost_capacity: capacity.saturating_sub(small_capacity).max(1),
            stamp: 0,
        }
    }

    fn next_stamp(&mut self) -> u64 {
        self.stamp += 1;
        self.stamp
    }

    fn insert(&mut self, block: u64, main: bool) {
        let stamp = self.next_stamp();
        self.held.insert(
            block,
            Entry {
                stamp,
                freq: 0,
                main,
            },
        );
        if main {
            self.main.push_back((block, stamp));
            self.main_len += 1;
        } else {
            self.small.push_back((block, stamp));
            self.small_len += 1;
        }
    }

    /// The live entry at the tail of a queue, skipping stale ones.
    fn pop_live(queue: &mut VecDeque<(u64, u64)>, held: &HashMap<u64, Entry>) -> Option<u64> {
        while let Some((b, stamp)) = queue.pop_front() {
            if held.get(&b).is_some_and(|e| e.stamp == stamp) {
                return Some(b);
            }
        }
        None
    }

    fn remember(&mut self, block: u64) {
        let stamp = self.next_stamp();
        self.ghosts.insert(block, stamp);
        self.ghost.push_back((block, stamp));
        while self.ghosts.len() > self.ghost_capacity {
            let (b, s) = self.ghost.pop_front().expect("ghosts are queued");
            if self.ghosts.get(&b) == Some(&s) {
                self.ghosts.remove(&b);
            }
        }
    }

    /// Makes room for one block.
    fn evict(&mut self) {
        if self.small_len >= self.small_capacity || self.main_len == 0 {
            let Some(b) = Self::pop_live(&mut self.small, &self.held) else {
                return;
            };
            self.small_len -= 1;
            let e = self.held[&b];
            if e.freq >= 1 {
                self.insert(b, true);
            } else {
                self.held.remove(&b);
                self.remember(b);
            }
        } else {
            let Some(b) = Self::pop_live(&mut self.main, &self.held) else {
                return;
            };
            let stamp = self.next_stamp();
            let e = self.held.get_mut(&b).expect("a live entry");
            if e.freq > 0 {
                e.freq -= 1;
                e.stamp = stamp;
                self.main.push_back((b, stamp));
            } else {
                self.held.remove(&b);
                self.main_len -= 1;
            }
        }
    }
}

impl Simulated for S3Fifo {
    fn access(&mut self, block: u64) -> bool {
        if let Some(e) = self.held.get_mut(&block) {
            e.freq = (e.freq + 1).min(3);
            return true;
        }
        if self.capacity == 0 {
            return false;
        }
        while self.held.len() >= self.capacity {
            self.evict();
        }
        let ghost = self.ghosts.remove(&block).is_some();
        self.insert(block, ghost);
        false
    }

    fn forget(&mut self, block: u64) {
        if let Some(e) = self.held.remove(&block) {
            if e.main {
                self.main_len -= 1;
            } else {
                self.small_len -= 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    impl Fifo {
        fn len(&self) -> usize {
            self.held.len()
        }
    }

    impl S3Fifo {
        fn len(&self) -> usize {
            self.held.len()
        }
    }

    #[test]
    fn fifo_evicts_in_insertion_order_whatever_is_read() {
        let mut f = Fifo::new(2);
        assert!(!f.access(1));
        assert!(!f.access(2));
        assert!(f.access(1));
        assert!(!f.access(3)); // evicts 1, although it was just read
        assert!(!f.access(1));
        assert!(f.access(3));
        f.forget(3);
        assert!(!f.access(3));
        assert_eq!(f.len(), 2);
    }

    #[test]
    fn s3fifo_keeps_a_reread_block_and_drops_one_hit_wonders() {
        let mut s = S3Fifo::new(10); // small FIFO of 1
        assert!(!s.access(100));
        assert!(s.access(100)); // read again while in the small FIFO
        for b in 0..30 {
            assert!(!s.access(b), "one-hit wonder {b}");
        }
        assert!(s.access(100), "moved to the main FIFO, kept");
        // A block evicted from the small FIFO is remembered: its next miss goes to main and
        // survives a scan that a plain FIFO would not.
        assert!(!s.access(29 + 1000));
        assert!(!s.access(5), "5 was evicted");
        for b in 2000..2005 {
            s.access(b);
        }
        assert!(s.access(5), "a ghost hit went straight to the main FIFO");
    }

    proptest! {
        /// Never more blocks than its capacity, a hit only for a held block, and (a model) the
        /// blocks it holds are exactly those it says it holds.
        #[test]
        fn s3fifo_respects_its_capacity_and_tells_the_truth(
            capacity in 1usize..30,
            ops in prop::collection::vec((0u64..60, any::<bool>()), 0..600),
        ) {
            let mut s = S3Fifo::new(capacity);
            let mut held = std::collections::HashSet::new();
            for (b, trim) in ops {
                if trim && b % 7 == 0 {
                    s.forget(b);
                    held.remove(&b);
                } else {
                    let hit = s.access(b);
                    prop_assert_eq!(hit, held.contains(&b));
                    held.insert(b);
                    held.retain(|x| s.held.contains_key(x));
                }
                prop_assert!(s.len() <= capacity);
                prop_assert_eq!(s.len(), held.len());
                prop_assert_eq!(s.small_len + s.main_len, s.len());
                prop_assert!(s.ghosts.len() <= s.ghost_capacity);
            }
        }
    }
}
