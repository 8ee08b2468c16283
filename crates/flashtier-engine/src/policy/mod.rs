//! Cache policies: pure decisions, no I/O. The engine asks, the policy answers.

mod mode;

pub use mode::{Mode, ReclaimPolicy};
