//! What the server exports: a device plus the name and policy it is served under.

use std::sync::Arc;

use flashtier_io::BlockDev;

/// The NBD protocol's smallest advertised block: clients that honour it never send sub-sector I/O.
pub const MIN_BLOCK: u32 = 512;
/// Preferred block size unless the device asks for a larger one.
pub const PREFERRED_BLOCK: u32 = 4096;

/// One export. The server serves exactly one; it answers to its name and to the empty (default)
/// name, so `nbd+unix:///?socket=...` works without knowing the name.
pub struct Export {
    pub name: String,
    pub description: String,
    pub dev: Arc<dyn BlockDev>,
    /// Serve read-only even if the device is writable.
    pub force_read_only: bool,
    /// Advertise `CAN_MULTI_CONN`. True whenever a FLUSH on one connection makes writes completed
    /// on every connection durable, which holds for any device whose `flush` covers all writes
    /// that completed before it (every `BlockDev` is required to behave that way).
    pub multi_conn: bool,
}

impl Export {
    pub fn new(name: impl Into<String>, dev: Arc<dyn BlockDev>) -> Export {
        let description = format!("flashtier: {}", dev.describe());
        Export {
            name: name.into(),
            description,
            dev,
            force_read_only: false,
            multi_conn: true,
        }
    }

    pub fn read_only(&self) -> bool {
        self.force_read_only || self.dev.info().read_only
    }

    pub fn answers_to(&self, name: &[u8]) -> bool {
        name.is_empty() || name == self.name.as_bytes()
    }

    /// Minimum and preferred block sizes to advertise.
    pub fn block_sizes(&self) -> (u32, u32) {
        let dev_block = self.dev.info().min_block;
        (MIN_BLOCK, PREFERRED_BLOCK.max(dev_block))
    }
}
