//! Human-friendly sizes on the command line and in output.

/// `1.50 GiB`, `512 B` (shared with the control plane's tables); and `4096`, `512K`, `64M`,
/// `1G`, `2T` parsed (binary multiples; shared with the config file's sizes).
pub use flashtier_control::render::{fmt_bytes, parse_size};
