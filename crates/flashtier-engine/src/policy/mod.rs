//! Cache policies: pure decisions, no I/O. The engine asks, the policy answers.

mod mode;
mod promotion;

pub use mode::{Mode, ReclaimPolicy};
pub use promotion::PromotionPolicy;
