//! Write-back: one dirty WRITE record per request (split at the atomic size), acknowledged once
//! written to the cache device; FUA waits for a sync. The cleaner writes it back later.

use std::io;

use super::Cache;

impl Cache {
    /// A write-back write of whole blocks from `lba`.
    pub(super) fn write_back(&self, lba: u64, data: &[u8], fua: bool) -> io::Result<()> {
        self.log_blocks(lba, data, true)?;
        if fua {
            self.e.log.sync(false)?;
        }
        Ok(())
    }
}
