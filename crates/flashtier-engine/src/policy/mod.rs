//! Cache policies: pure decisions, no I/O. The engine asks, the policy answers.

pub mod admission;
mod mode;
mod promotion;
pub mod sequential;

pub use mode::{Mode, ReclaimPolicy};
pub use promotion::PromotionPolicy;
