//! Opening a cache device: read the superblock, load the newest valid checkpoint, replay the log
//! written after it. Nothing here writes; the caller decides when the device may change.
//!
//! Replay follows the log from the checkpoint's head through the free segments in the order the
//! checkpoint recorded. A batch is accepted only if its header checks out, its first sequence
//! number is exactly the next one expected, and its epoch is not older than the last accepted
//! one; within it, records are applied in order until one whose data fails its checksum. The
//! first batch that fails any of this is where the log ends. Because the log is applied in
//! sequence order and stops at the first gap, the result is always a prefix of the history: no
//! acknowledged-durable write is missing (it was synced, so everything before it is intact too),
//! and no later record can be applied without every earlier one.

use std::io;
use std::time::Instant;

use flashtier_io::{AlignedBuf, BlockDev};

use crate::index::Index;
use crate::layout::batch::{self, BatchError, BatchHeader};
use crate::layout::checkpoint::{self, Checkpoint, CheckpointHeader};
use crate::layout::superblock::{self, Superblock};
use crate::layout::Geometry;
use crate::segments::{Head, Segments};
use crate::state::State;
use crate::{EngineError, FormatError};

/// Reads and validates the superblock (both copies), without checking what it belongs to.
pub fn read_superblock(dev: &dyn BlockDev) -> Result<Superblock, EngineError> {
    if dev.info().size < 2 * superblock::LEN as u64 {
        return Err(FormatError::NotACache.into());
    }
    let mut buf = AlignedBuf::zeroed(2 * superblock::LEN);
    dev.read_at(&mut buf, 0).map_err(EngineError::CacheIo)?;
    let sb = Superblock::choose(&buf[..superblock::LEN], &buf[superblock::LEN..])?;
    if sb.geometry.used_size() > dev.info().size {
        return Err(FormatError::Corrupt(format!(
            "the superblock describes {} bytes but the device has only {}",
            sb.geometry.used_size(),
            dev.info().size
        ))
        .into());
    }
    Ok(sb)
}

/// Writes generation `sb.generation` of the superblock to its copy and syncs.
pub fn write_superblock(dev: &dyn BlockDev, sb: &Superblock) -> io::Result<()> {
    let bytes = sb
        .encode()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    let mut buf = AlignedBuf::zeroed(superblock::LEN);
    buf.copy_from_slice(&bytes);
    dev.write_at(&buf, sb.copy_index() * superblock::LEN as u64, false)?;
    dev.flush()
}

/// What recovery found.
pub struct Recovered {
    pub state: State,
    pub next_seq: u64,
    /// Epoch of the newest accepted batch (or of the checkpoint).
    pub epoch: u64,
    pub checkpoint_number: u64,
    pub replayed_batches: u64,
    pub replayed_records: u64,
    /// Log blocks (headers and data) replayed: they count towards the next checkpoint, so a
    /// crash loop does not replay an ever longer log.
    pub replayed_blocks: u64,
    /// The last batch was only partly valid; its header must be rewritten to hold just the valid
    /// records before anything is appended after them.
    pub truncate_batch: Option<(u64, BatchHeader)>,
    pub elapsed: std::time::Duration,
}

fn corrupt(msg: String) -> EngineError {
    FormatError::Corrupt(msg).into()
}

/// Loads the newest valid checkpoint.
pub fn load_checkpoint(dev: &dyn BlockDev, geo: &Geometry) -> Result<Checkpoint, EngineError> {
    let mut best: Option<(CheckpointHeader, u32)> = None;
    let mut errors = Vec::new();
    let mut head = AlignedBuf::zeroed(checkpoint::HEADER_LEN);
    for slot in 0..2u32 {
        dev.read_at(&mut head, geo.checkpoint_slot_offset(slot))
            .map_err(EngineError::CacheIo)?;
        match Checkpoint::decode_header(&head) {
            Ok(h) if h.body_len + checkpoint::HEADER_LEN as u64 <= geo.checkpoint_slot_size => {
                if best.is_none_or(|(b, _)| h.number > b.number) {
                    best = Some((h, slot));
                }
            }
            Ok(_) => errors.push(format!("slot {slot}: body larger than the slot")),
            Err(e) => errors.push(format!("slot {slot}: {e}")),
        }
    }
    // Try the newest first; a torn body falls back to the older checkpoint.
    let mut candidates: Vec<(CheckpointHeader, u32)> = Vec::new();
    if let Some(b) = best {
        candidates.push(b);
        let other = 1 - b.1;
        dev.read_at(&mut head, geo.checkpoint_slot_offset(other))
            .map_err(EngineError::CacheIo)?;
        if let Ok(h) = Checkpoint::decode_header(&head) {
            if h.body_len + checkpoint::HEADER_LEN as u64 <= geo.checkpoint_slot_size {
                candidates.push((h, other));
            }
        }
    }
    for (h, slot) in candidates {
        let len = (checkpoint::HEADER_LEN as u64 + h.body_len).next_multiple_of(4096) as usize;
        let mut buf = AlignedBuf::zeroed(len);
        dev.read_at(&mut buf, geo.checkpoint_slot_offset(slot))
            .map_err(EngineError::CacheIo)?;
        match Checkpoint::decode_body(&h, &buf[checkpoint::HEADER_LEN..]) {
            Ok(c) => return Ok(c),
            Err(e) => errors.push(format!("slot {slot}: {e}")),
        }
    }
    Err(corrupt(format!(
        "no valid checkpoint ({})",
        errors.join("; ")
    )))
}

/// Rebuilds the index and segment table from the newest checkpoint and the log after it.
pub fn recover(dev: &dyn BlockDev, sb: &Superblock) -> Result<Recovered, EngineError> {
    let started = Instant::now();
    let geo = sb.geometry;
    let ckpt = load_checkpoint(dev, &geo)?;
    let mut state = state_from_checkpoint(&geo, &ckpt)?;
    let backing_blocks = sb.backing.size / geo.block_size as u64;

    let bps = geo.blocks_per_segment();
    let bs = geo.block_size as usize;
    let mut expected = ckpt.next_seq;
    let mut epoch = ckpt.epoch;
    let mut header_buf = AlignedBuf::zeroed(bs);
    let mut data = AlignedBuf::new();
    let mut replayed_batches = 0;
    let mut replayed_records = 0;
    let mut replayed_blocks = 0u64;
    let mut truncate_batch = None;

    'log: loop {
        let head = match state.segs.head {
            Some(h) if h.used < bps => h,
            Some(_) => {
                state.segs.seal_head();
                continue;
            }
            None => {
                if state.segs.open_next(expected).is_none() {
                    break;
                }
                continue;
            }
        };
        let header_slot = geo.first_slot(head.segment) + head.used;
        dev.read_at(&mut header_buf, geo.slot_offset(header_slot))
            .map_err(EngineError::CacheIo)?;
        let hdr = match BatchHeader::decode(&header_buf) {
            Ok(h) => h,
            Err(BatchError::NoBatch) | Err(BatchError::Checksum) => break,
            Err(BatchError::Malformed(why)) => {
                tracing::warn!(segment = head.segment, why, "malformed batch ends the log");
                break;
            }
        };
        if hdr.seq_first != expected || hdr.epoch < epoch {
            break;
        }
        if hdr.seal {
            state.segs.seal_head();
            epoch = hdr.epoch;
            continue;
        }
        let blocks = hdr.data_blocks();
        if head.used + 1 + blocks > bps || !entries_sane(&hdr, &geo, backing_blocks) {
            tracing::warn!(
                segment = head.segment,
                "batch with impossible contents ends the log"
            );
            break;
        }
        data.resize(blocks as usize * bs);
        if blocks > 0 {
            dev.read_at(&mut data, geo.slot_offset(header_slot + 1))
                .map_err(EngineError::CacheIo)?;
        }
        let mut at = 0usize;
        let mut applied = 0;
        let mut torn = false;
        for e in &hdr.entries {
            let len = e.data_blocks() as usize * bs;
            if len > 0 && batch::data_crc(&data[at..at + len]) != e.data_crc {
                torn = true;
                break;
            }
            state.apply(e, header_slot + 1 + (at / bs) as u32);
            at += len;
            applied += 1;
        }
        replayed_batches += 1;
        replayed_records += applied as u64;
        replayed_blocks += 1 + blocks as u64;
        expected += applied as u64;
        epoch = hdr.epoch;
        if torn {
            // Keep the valid prefix; the log continues right after it once the header says so.
            let mut kept = hdr.clone();
            kept.entries.truncate(applied);
            let kept_blocks = kept.data_blocks();
            if applied == 0 {
                break 'log;
            }
            if let Some(h) = state.segs.head.as_mut() {
                h.used += 1 + kept_blocks;
            }
            truncate_batch = Some((geo.slot_offset(header_slot), kept));
            break;
        }
        if let Some(h) = state.segs.head.as_mut() {
            h.used += 1 + blocks;
        }
    }
    Ok(Recovered {
        state,
        next_seq: expected,
        epoch,
        checkpoint_number: ckpt.number,
        replayed_batches,
        replayed_records,
        replayed_blocks,
        truncate_batch,
        elapsed: started.elapsed(),
    })
}

/// Records must stay within the backing store and the cache.
fn entries_sane(h: &BatchHeader, geo: &Geometry, backing_blocks: u64) -> bool {
    h.entries.iter().all(|e| {
        let in_backing = e.lba + e.nblocks as u64 <= backing_blocks;
        let aux_ok = match e.kind {
            batch::Kind::Move | batch::Kind::Cleaned => {
                e.aux + e.nblocks as u64 <= geo.slot_count() as u64
            }
            _ => true,
        };
        in_backing && aux_ok
    })
}

fn state_from_checkpoint(geo: &Geometry, c: &Checkpoint) -> Result<State, EngineError> {
    let count = geo.segment_count;
    let bps = geo.blocks_per_segment();
    let mut seen = vec![false; count as usize];
    for &s in &c.free {
        if s >= count || std::mem::replace(&mut seen[s as usize], true) {
            return Err(corrupt(format!("checkpoint free list has bad segment {s}")));
        }
    }
    let mut segs = Segments::with_free(count, bps, c.free.clone());
    if let Some(h) = c.open {
        if h.segment >= count || h.used > bps || seen[h.segment as usize] {
            return Err(corrupt(format!("checkpoint log head is impossible: {h:?}")));
        }
        segs.set_head(Head {
            segment: h.segment,
            used: h.used,
        });
    }
    let mut index = Index::new(geo.slot_count());
    for e in &c.entries {
        if e.slot >= geo.slot_count() || e.lba > Index::MAX_LBA {
            return Err(corrupt(format!("checkpoint entry out of range: {e:?}")));
        }
        if index.slot(e.slot).is_some() || index.get(e.lba).is_some() {
            return Err(corrupt(format!(
                "checkpoint maps a slot or block twice: {e:?}"
            )));
        }
        index.insert(e.lba, e.slot, e.dirty);
        segs.on_map(e.slot, e.dirty);
    }
    Ok(State::new(index, segs))
}
