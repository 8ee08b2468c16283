//! One cleaning pass at a time, and whether another is waiting for its turn.
//!
//! Passes run one at a time: two passes writing the same block back could land its versions out
//! of order. A background pass paced to the write-back rate takes about a second on purpose
//! (its writes spread evenly instead of in one burst); a pass that reclaim, a flush or a detach
//! needs must not wait that long, so the paced pass asks [`PassGate::contended`] between writes
//! and finishes at full speed once someone waits.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{Mutex, MutexGuard};

#[derive(Default)]
pub(crate) struct PassGate {
    turn: Mutex<()>,
    waiting: AtomicUsize,
}

impl PassGate {
    /// Waits for the turn to run a pass; the pass runs while the guard lives.
    pub(crate) fn enter(&self) -> MutexGuard<'_, ()> {
        if let Some(g) = self.turn.try_lock() {
            return g;
        }
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let g = self.turn.lock();
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        g
    }

    /// Whether another pass waits for the one running.
    pub(crate) fn contended(&self) -> bool {
        self.waiting.load(Ordering::Acquire) > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_waiting_pass_is_seen_until_it_has_its_turn() {
        let gate = Arc::new(PassGate::default());
        let running = gate.enter();
        assert!(!gate.contended());
        let g = gate.clone();
        let waiter = std::thread::spawn(move || {
            let _turn = g.enter();
        });
        let mut seen = false;
        for _ in 0..1000 {
            if gate.contended() {
                seen = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(seen, "the waiting pass was never seen");
        drop(running);
        waiter.join().unwrap();
        assert!(!gate.contended());
    }
}
