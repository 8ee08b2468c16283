//! Small READs already buffered behind the one just read are read with it and served together
//! (`BlockDev::read_batch`): for a cache, its hits with one submission to the cache device and
//! one sleep, and their replies with one write. At QD32 one `recv` brings ten to fifteen
//! requests; before this each took a thread wake-up for the seat, a blocking `pread` (a sleep and
//! a wake-up) and a `writev` of its own.
//!
//! Only while the device says it serves batches (`read_batch_max` above 1) and only reads that
//! are whole in the buffer, so reading them costs no system call and never waits. What the device
//! leaves (a cache miss, bound for the backing store) must not wait behind the batch's other
//! reads, nor they for it: the device names them as soon as it knows (a cache: before it reads
//! its hits) and they go at once to the connection's pending queue, for the threads waiting for
//! the seat (or spawned for them). Handed over after the batch instead, misses on a backing
//! store in RAM waited for the hits' device reads (0.7–0.8× the unbatched server's reads/s).
//!
//! Small WRITEs whole in the buffer behind a WRITE are taken the same way (`BlockDev::write_batch`:
//! for a cache, write-back writes logged in one group, the thread waiting once for all of them),
//! when the first one could be batched too: no FUA, at most [`MAX_BATCHED`] bytes, aligned to the
//! device's block. Their payloads are copied out of the buffer into the batch's space. A write
//! the device leaves (rare: a cache takes every such write in write-back mode, unless a
//! read-modify-write holds its block or the mode changed meanwhile) is written by this thread
//! after the batch's replies are sent: its payload is here, and it is not one that waits for a
//! slow store.
//!
//! The batch's data lives in one buffer per thread, [`SPACE`] bytes, each request in a 4 KiB-aligned
//! part of it (O_DIRECT reads land straight in it), so what a thread keeps between requests grows
//! by that much and no more.

use std::io::{BufRead, IoSlice, Read, Write};
use std::thread::Scope;

use flashtier_io::{AlignedBuf, BatchRead, BatchWrite};
use smallvec::SmallVec;

use crate::wire::{self, cmd, RequestHeader};

use super::{data_reply_header, device_failure, Done, Failure, Request, Shared};

/// Most requests in a batch (the first one included). Small batches keep several in flight on a
/// connection's threads, so the cache device's queue refills as each batch's replies go out;
/// one connection at QD32 served 4 KiB read hits at 0.84–0.89× the unbatched server's rate in
/// batches of up to 32 (the client and the server fell into lockstep, a few big batches at a
/// time) and 0.94–1.04× in batches of up to 8 (bench/results/read_batch/).
const MAX_BATCH: usize = 8;
/// Largest request taken into a batch after the first, and largest first WRITE of a batch
/// (InnoDB's 16 KiB pages, 4 KiB blocks).
const MAX_BATCHED: usize = 16 << 10;
/// Where a batch's data after the first request's lands: room for all of it at its largest.
pub(super) const SPACE: usize = (MAX_BATCH - 1) * MAX_BATCHED;
/// Each read's part of [`SPACE`] starts on this boundary, as O_DIRECT needs.
const ALIGN: usize = 4096;

/// The requests taken with a connection's first READ or WRITE, and where their data goes.
pub(super) struct Batch {
    /// WRITEs (else READs).
    writes: bool,
    /// The requests after the first, in the order read.
    reqs: Vec<Request>,
    /// Where each of `reqs` starts in `space`.
    at: Vec<usize>,
    /// Allocated on the first batch, kept after.
    space: AlignedBuf,
}

impl Batch {
    pub(super) fn new() -> Batch {
        Batch {
            writes: false,
            reqs: Vec::new(),
            at: Vec::new(),
            space: AlignedBuf::new(),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.reqs.len()
    }

    pub(super) fn is_writes(&self) -> bool {
        self.writes
    }

    pub(super) fn clear(&mut self) {
        self.writes = false;
        self.reqs.clear();
        self.at.clear();
    }

    /// Allocates the space on the first batch; kept after.
    fn make_space(&mut self) {
        if self.space.len() < SPACE {
            self.space = AlignedBuf::zeroed(SPACE);
        }
    }

    /// Room in `space` after what the batch holds.
    fn used(&self) -> usize {
        match (self.at.last(), self.reqs.last()) {
            (Some(&at), Some(last)) => at + (last.hdr.length as usize).next_multiple_of(ALIGN),
            _ => 0,
        }
    }
}

/// What became of one request of a batch.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// Answered by the batch (its data, a refusal or the device's error), or its reply could not
    /// be sent.
    Answered,
    /// Not served (yet).
    Left,
    /// Left by the device and handed to the pending queue, for whichever thread comes first.
    Pending,
}

impl<'env, R: Read + Send, W: Write + Send> Shared<'env, R, W> {
    /// After a READ was read: takes the small READs whole in the buffer behind it, up to what
    /// the device serves together. Called with the inbound lock held, by the seat's holder.
    pub(super) fn read_more(&self, inbound: &mut std::io::BufReader<R>, batch: &mut Batch) {
        if inbound.buffer().len() < RequestHeader::LEN {
            return;
        }
        let max = self.dev.read_batch_max().min(MAX_BATCH);
        let small_read = |h: &RequestHeader| h.cmd == cmd::READ && h.length as usize <= MAX_BATCHED;
        while batch.len() + 1 < max {
            let Some((hdr, at)) = next_buffered(inbound, batch, small_read) else {
                break;
            };
            inbound.consume(RequestHeader::LEN);
            self.take_into(batch, hdr, at);
        }
    }

    /// Adds `hdr`, consumed from the buffer, to the batch, its data at `at` of the space.
    fn take_into(&self, batch: &mut Batch, hdr: RequestHeader, at: usize) {
        self.params.conn.request_read();
        batch.at.push(at);
        // Within the buffer each thread keeps: not charged to the budgets (`request_cost`).
        batch.reqs.push(Request {
            hdr,
            payload_dropped: false,
            cost: 0,
        });
    }

    /// After a WRITE (`first`) was read, its payload in the thread's buffer: if the device
    /// batches writes and `first` could be batched, takes the small WRITEs whole in the buffer
    /// behind it, up to what the device takes together, copying their payloads into the batch's
    /// space. Called with the inbound lock held, by the seat's holder.
    pub(super) fn write_more(
        &self,
        first: &RequestHeader,
        inbound: &mut std::io::BufReader<R>,
        batch: &mut Batch,
    ) {
        if inbound.buffer().len() < RequestHeader::LEN || !self.batchable_write(first) {
            return;
        }
        let max = self.dev.write_batch_max().min(MAX_BATCH);
        if max < 2 {
            return;
        }
        batch.make_space();
        batch.writes = true;
        while batch.len() + 1 < max {
            let buffered = inbound.buffer().len();
            let whole_write = |h: &RequestHeader| {
                self.batchable_write(h) && buffered >= RequestHeader::LEN + h.length as usize
            };
            let Some((hdr, at)) = next_buffered(inbound, batch, whole_write) else {
                break;
            };
            let len = hdr.length as usize;
            let payload = &inbound.buffer()[RequestHeader::LEN..RequestHeader::LEN + len];
            batch.space[at..at + len].copy_from_slice(payload);
            inbound.consume(RequestHeader::LEN + len);
            self.take_into(batch, hdr, at);
        }
    }

    /// A WRITE the device may take into a batch: small, aligned to its block, without FUA or
    /// any other flag, and with a payload that was kept (not too large).
    fn batchable_write(&self, h: &RequestHeader) -> bool {
        let block = u64::from(self.dev.info().min_block.max(1));
        h.cmd == cmd::WRITE
            && h.flags == 0
            && h.length > 0
            && h.length as usize <= MAX_BATCHED
            && h.length <= self.params.max_payload
            && h.offset.is_multiple_of(block)
            && u64::from(h.length).is_multiple_of(block)
    }

    /// Writes `first` (its payload in `buf`) and the batch read with it: what the device takes
    /// together is answered with one write, then this thread writes what it left, one by one.
    /// False if a reply could not be sent (the connection is closed then).
    pub(super) fn serve_write_batch(
        &self,
        first: Request,
        buf: &mut AlignedBuf,
        batch: &mut Batch,
    ) -> bool {
        let mut broken: Option<std::io::Error> = None;
        {
            let reqs: SmallVec<[&Request; MAX_BATCH]> =
                std::iter::once(&first).chain(&batch.reqs).collect();
            let mut writes: SmallVec<[BatchWrite<'_>; MAX_BATCH]> = SmallVec::new();
            // Which request each write is.
            let mut of: SmallVec<[usize; MAX_BATCH]> = SmallVec::new();
            for (i, req) in reqs.iter().enumerate() {
                if let Err((error, why)) = self.validate(req) {
                    let refused = Err(Failure {
                        error,
                        message: format!("{} refused: {why}", cmd::name(req.hdr.cmd)),
                    });
                    self.send_or_break(&req.hdr, &refused, &mut broken);
                    continue;
                }
                let data: &[u8] = if i == 0 {
                    buf
                } else {
                    let at = batch.at[i - 1];
                    &batch.space[at..at + req.hdr.length as usize]
                };
                of.push(i);
                writes.push(BatchWrite::new(data, req.hdr.offset));
            }
            self.dev.write_batch(&mut writes);
            let mut acks: SmallVec<[[u8; 16]; MAX_BATCH]> = SmallVec::new();
            for (w, &i) in writes.iter().zip(&of) {
                let h = &reqs[i].hdr;
                match &w.result {
                    Some(Ok(())) => acks.push(wire::simple_reply(0, h.handle)),
                    Some(Err(e)) => self.send_or_break(h, &Err(device_failure(h, e)), &mut broken),
                    None => {}
                }
            }
            if !acks.is_empty() && broken.is_none() {
                let mut parts: SmallVec<[IoSlice<'_>; MAX_BATCH]> =
                    acks.iter().map(|a| IoSlice::new(a)).collect();
                if let Err(e) = self
                    .outbound
                    .send(&mut parts, &|yes| self.params.conn.writing(yes))
                {
                    broken = Some(e);
                }
            }
            // What the device left: written here, one by one.
            for (w, &i) in writes.iter().zip(&of) {
                if w.result.is_some() || broken.is_some() {
                    continue;
                }
                let h = &reqs[i].hdr;
                let result = self
                    .dev
                    .write_at(w.buf, w.offset, false)
                    .map(|()| Done::Ack)
                    .map_err(|e| device_failure(h, &e));
                self.send_or_break(h, &result, &mut broken);
            }
        }
        for req in std::iter::once(&first).chain(&batch.reqs) {
            self.finished(req);
        }
        batch.clear();
        if let Some(e) = broken {
            tracing::debug!(error = %e, "cannot send reply; closing connection");
            self.close();
            return false;
        }
        true
    }

    /// Serves `first` (its data into `buf`) and the batch read with it: the device serves what
    /// it can together and those are answered at once; the rest go to other threads (any the
    /// device left without naming them: all but one, this thread executing the last). False if a
    /// reply could not be sent (the connection is closed then).
    pub(super) fn serve_batch<'scope>(
        &'scope self,
        first: Request,
        buf: &mut AlignedBuf,
        batch: &mut Batch,
        extents: &mut Vec<(u32, u32)>,
        scope: &'scope Scope<'scope, '_>,
    ) -> bool {
        batch.make_space();
        let n = 1 + batch.reqs.len();
        let hdr = |i: usize| {
            if i == 0 {
                &first.hdr
            } else {
                &batch.reqs[i - 1].hdr
            }
        };
        let mut outcomes: SmallVec<[Outcome; MAX_BATCH]> = SmallVec::new();
        // The first error sending a reply: nothing more is sent after it.
        let mut broken: Option<std::io::Error> = None;
        {
            let mut reads: SmallVec<[BatchRead<'_>; MAX_BATCH]> = SmallVec::new();
            // Which request each read is.
            let mut of: SmallVec<[usize; MAX_BATCH]> = SmallVec::new();
            let mut rest = &mut batch.space[..];
            let mut taken = 0;
            // The first read's data goes to the thread's own buffer, sized once it is valid.
            if self.validate(&first).is_ok() {
                buf.resize(first.hdr.length as usize);
            }
            let mut first_data = Some(&mut buf[..]);
            for i in 0..n {
                let req = if i == 0 { &first } else { &batch.reqs[i - 1] };
                if let Err((error, why)) = self.validate(req) {
                    let refused = Err(Failure {
                        error,
                        message: format!("{} refused: {why}", cmd::name(req.hdr.cmd)),
                    });
                    self.send_or_break(&req.hdr, &refused, &mut broken);
                    outcomes.push(Outcome::Answered);
                    continue;
                }
                let data = if i == 0 {
                    first_data.take().expect("the first request comes once")
                } else {
                    let (at, len) = (batch.at[i - 1], req.hdr.length as usize);
                    let (_, from) = std::mem::take(&mut rest).split_at_mut(at - taken);
                    let (data, after) = from.split_at_mut(len.next_multiple_of(ALIGN));
                    (rest, taken) = (after, at + len.next_multiple_of(ALIGN));
                    &mut data[..len]
                };
                outcomes.push(Outcome::Left);
                of.push(i);
                reads.push(BatchRead::new(data, req.hdr.offset));
            }
            // What the device leaves goes to other threads as soon as it says so (a cache: before
            // it reads its hits), so a miss on a fast backing store does not wait for them. The
            // replies go out once the device is done with the whole batch, when it holds nothing
            // any more (a cache pins the segments it reads): a client that does not read its
            // replies may block this thread in the write, and must block nothing else.
            self.dev.read_batch(&mut reads, &mut |left| {
                let reqs = left.iter().map(|&k| {
                    outcomes[of[k]] = Outcome::Pending;
                    if of[k] == 0 {
                        first
                    } else {
                        batch.reqs[of[k] - 1]
                    }
                });
                self.push_pending(reqs);
                self.grow(scope);
            });
            let served = reads.iter().zip(&of).map(|(read, &i)| (i, read));
            self.answer_reads(&hdr, served, &mut outcomes, &mut broken);
        }
        let mut left: SmallVec<[Request; MAX_BATCH]> = SmallVec::new();
        let reqs = std::iter::once(first).chain(batch.reqs.drain(..));
        for (req, outcome) in reqs.zip(&outcomes) {
            match outcome {
                Outcome::Answered => self.finished(&req),
                Outcome::Left => left.push(req),
                // Another thread's now.
                Outcome::Pending => {}
            }
        }
        batch.clear();
        if let Some(e) = broken {
            tracing::debug!(error = %e, "cannot send reply; closing connection");
            for req in &left {
                self.finished(req);
            }
            self.close();
            return false;
        }
        let Some(mine) = left.pop() else {
            return true;
        };
        if !left.is_empty() {
            self.push_pending(left.into_iter());
            self.grow(scope);
        }
        self.answer(&mine, buf, extents, None)
    }

    /// Sends `reply` to request `h` unless a reply already failed, recording a failure.
    fn send_or_break(
        &self,
        h: &RequestHeader,
        reply: &Result<Done, Failure>,
        broken: &mut Option<std::io::Error>,
    ) {
        if broken.is_none() {
            if let Err(e) = self.send_reply(h, reply, &[], &[]) {
                *broken = Some(e);
            }
        }
    }

    /// Answers the reads the device served (request `i` of the batch, its read; a read left has
    /// no result, and its outcome is not touched), the data replies with one write; failed ones
    /// each on their own (rare).
    fn answer_reads<'h, 'r, 'b: 'r>(
        &self,
        hdr: &impl Fn(usize) -> &'h RequestHeader,
        finished: impl Iterator<Item = (usize, &'r BatchRead<'b>)>,
        outcomes: &mut [Outcome],
        broken: &mut Option<std::io::Error>,
    ) {
        let structured = self.params.session.structured_replies;
        // Each data reply's header and its length.
        let mut heads: SmallVec<[([u8; wire::STRUCTURED_HEADER_LEN + 8], usize); MAX_BATCH]> =
            SmallVec::new();
        let mut bodies: SmallVec<[&[u8]; MAX_BATCH]> = SmallVec::new();
        for (i, read) in finished {
            let h = hdr(i);
            if read.result.is_some() {
                outcomes[i] = Outcome::Answered;
            }
            match &read.result {
                Some(Ok(())) => {
                    let data: &[u8] = read.buf;
                    let mut head = [0u8; wire::STRUCTURED_HEADER_LEN + 8];
                    let head_len = data_reply_header(structured, h, data.len(), &mut head);
                    heads.push((head, head_len));
                    bodies.push(data);
                }
                Some(Err(e)) => self.send_or_break(h, &Err(device_failure(h, e)), broken),
                // Left, and already pending or still to be executed.
                None => {}
            }
        }
        if heads.is_empty() || broken.is_some() {
            return;
        }
        let mut parts: SmallVec<[IoSlice<'_>; 2 * MAX_BATCH]> = SmallVec::new();
        for ((head, len), body) in heads.iter().zip(&bodies) {
            parts.push(IoSlice::new(&head[..*len]));
            if !body.is_empty() {
                parts.push(IoSlice::new(body));
            }
        }
        if let Err(e) = self
            .outbound
            .send(&mut parts, &|yes| self.params.conn.writing(yes))
        {
            *broken = Some(e);
        }
    }
}

/// The request whose header is whole at the front of the buffer, if `fits` takes it and its data
/// fits in the batch's space after what the batch holds; and where that data goes.
fn next_buffered<R: Read>(
    inbound: &std::io::BufReader<R>,
    batch: &Batch,
    fits: impl Fn(&RequestHeader) -> bool,
) -> Option<(RequestHeader, usize)> {
    let raw = inbound.buffer().get(..RequestHeader::LEN)?;
    // Out of sync (`None`): the next `read_header` reports it.
    let hdr = RequestHeader::decode(raw.try_into().expect("sliced to LEN"))?;
    let at = batch.used();
    let room = at + (hdr.length as usize).next_multiple_of(ALIGN) <= SPACE;
    (fits(&hdr) && room).then_some((hdr, at))
}
