//! The index and the segment table, changed together, and the one function that applies a log
//! record to them. Live operation and crash recovery both go through [`State::apply`], in log
//! order, so the index recovery rebuilds is the index clients were served from.

use std::time::Duration;

use parking_lot::RwLock;

use crate::index::Index;
use crate::layout::batch::{Entry, Kind};
use crate::segments::Segments;

pub struct State {
    pub index: Index,
    pub segs: Segments,
}

impl State {
    pub fn new(index: Index, segs: Segments) -> State {
        State { index, segs }
    }

    /// Maps `lba` to `slot`, keeping the segment counts right.
    fn map(&mut self, lba: u64, slot: u32, dirty: bool) {
        let old = self
            .index
            .get(lba)
            .and_then(|s| self.index.slot(s).map(|info| (s, info.dirty)));
        self.index.insert(lba, slot, dirty);
        if let Some((old_slot, old_dirty)) = old {
            self.segs.on_unmap(old_slot, old_dirty);
        }
        self.segs.on_map(slot, dirty);
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

    /// Applies one record whose data (if any) starts at `first_slot`.
    pub fn apply(&mut self, e: &Entry, first_slot: u32) {
        match e.kind {
            Kind::Write => {
                for i in 0..e.nblocks {
                    self.map(e.lba + i as u64, first_slot + i, e.dirty);
                }
            }
            Kind::Promote => {
                for i in 0..e.nblocks {
                    let slot = first_slot + i;
                    if self.index.insert_if_absent(e.lba + i as u64, slot, false) {
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
                        self.segs.on_unmap(from, dirty);
                        self.segs.on_map(to, dirty);
                    }
                }
            }
            Kind::Invalidate => {
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
        }
    }
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
