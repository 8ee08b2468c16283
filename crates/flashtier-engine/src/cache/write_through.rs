//! Write-through: the write's record is synced to the cache device, then the backing store is
//! written; the blocks are marked clean after the next backing flush (or at once with FUA).

use std::io;

use crate::cleaner;

use super::Cache;

impl Cache {
    /// A write-through write of whole blocks; the caller holds their turn lock.
    pub(super) fn write_through(&self, lba: u64, data: &[u8], fua: bool) -> io::Result<()> {
        let e = &*self.e;
        let bs = self.block_size();
        let mut busy = e.guards.busy(lba, data.len() as u64 / bs);
        let records = self.log_blocks(lba, data, true)?;
        let blocks = self.written_blocks(&records);
        e.log.sync_vouched(false)?;
        if let Err(err) = self.backing_write(data, lba * bs, fua, Some(&mut busy)) {
            // The client is told this write failed, so the cache must not keep it (and write
            // it back later) as if it had worked: reads go to the backing store again.
            if let Err(inv) = self.invalidate(lba, data.len() as u64 / bs) {
                tracing::error!(lba, error = %inv, "cannot drop a failed write-through write");
            }
            return Err(err);
        }
        if fua {
            cleaner::mark_clean(e, &blocks.0, &blocks.1);
        } else {
            let mut pending = e.backing.unflushed_write_through.lock();
            pending.0.extend(blocks.0);
            pending.1.extend(blocks.1);
        }
        Ok(())
    }
}
