//! The transmission phase: requests in, replies out, many in flight.
//!
//! Each connection is served by a small pool of threads in a leader/followers pattern: a thread
//! takes the seat, reads one request (and its payload) from a shared buffered reader, passes the
//! seat on, executes the request on the device, then sends its own reply (`outbound`: a single
//! vectored write when the stream is free; when another thread is writing, a small reply is
//! queued and that thread writes it along with its own). There is no hand-off between threads
//! per request, a burst of pipelined requests costs one `recv` for many of them, replies finished
//! together cost one `writev`, and replies go out in completion order.
//!
//! The pool grows on demand: the connection's own thread serves alone until a request is read
//! while no other thread is free to read the next one; then one more is spawned (up to
//! `threads`, and only while the server-wide [`WorkerPool`](crate::limits::WorkerPool) has room).
//! When the connection has had no request for [`RETIRE_AFTER`], the extra threads exit. So an
//! idle connection costs one thread, and a busy one as many as its clients keep busy.
//!
//! Who reads next is the *seat* (`Seat`): the thread holding it is the only one to touch the
//! reader; the others wait for it on a condition variable. After reading a request, the reader
//! passes the seat on and wakes one follower. Except when the connection is *serial*: the request
//! read is the only one in flight and nothing more is buffered (a client waiting for each reply,
//! a database's commit). Then the reader keeps the seat while it executes the request and
//! answers it, and reads the next one itself: passing the seat on would wake a follower only for
//! it to wait on the socket, and the next request would wake it there and then this thread for
//! the seat, two more thread wake-ups per request than one thread serving alone (measured at QD1:
//! read hits 11.9k → 15.7k/s, 42 → 29 µs of server CPU each; bench/results/serial_nbd/). A
//! request arriving meanwhile must not wait for a slow one (a miss on a slow backing store, a
//! long flush): one follower watches, waking every [`PATIENCE`] while the connection is serial,
//! and takes the seat from a request that has run longer than that; it stops watching once no
//! request came for [`WATCH_IDLE`], and the next serial request wakes a follower to watch again.
//! And a connection that only looked serial (a request came while the serial one ran, before its
//! reply) executes no request serially for the next [`SERIAL_BACKOFF`].
//!
//! Small READs already buffered behind a READ are read with it, served by the device together and
//! answered with one write (`batch`); what the device leaves of them (cache misses) goes to the
//! connection's *pending* queue, which threads take before the seat, so a miss never waits behind
//! the batch's hits or the socket. Small WRITEs whole in the buffer behind a WRITE are taken the
//! same way, for a device that logs them together (a write-back cache), and acknowledged with one
//! write; what it leaves, this thread writes after.
//!
//! Idleness is noticed by the thread that would read the next request: with more than one thread
//! and nothing buffered, it waits for the socket to be readable with a timeout before reading;
//! when that times out it marks the connection for shrinking and hands the seat to the waiting
//! threads, which exit instead of reading (the mark is cleared by the next request read).
//! An extra thread exits only while another thread not busy with a request remains, so a
//! connection whose one request runs longer than [`RETIRE_AFTER`] still reads the next one, and
//! a thread exits only before reading anything: no request is ever left unread or unanswered by
//! retirement. Followers other than the watcher wait for the seat without a timeout: a timed
//! futex wait costs a kernel timer per wait, measured at ~15% more server CPU per 4 KiB read at
//! QD32.
//!
//! Before a request's payload is read or its reply buffer allocated, its size is taken from the
//! connection's and the server's request memory [`Budget`](crate::limits::Budget)s, and given back
//! once the reply is written. A client that does not read its replies therefore stops being read
//! from once its budget is spent, and memory stays bounded whatever clients do.
//!
//! Every request is validated here, once, before the device sees it: unknown commands and flags,
//! out-of-range offsets, oversized payloads and writes to a read-only export get the spec's errno,
//! and the stream stays in sync (a refused WRITE still has its payload consumed).

use parking_lot::{Condvar, Mutex};
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::Scope;
use std::time::{Duration, Instant};

use flashtier_io::{AlignedBuf, BlockDev, Extent, ZeroOpts};

mod batch;
use batch::Batch;

use crate::errmap::nbd_error;
use crate::export::Export;
use crate::handshake::Session;
use crate::limits::{ConnState, Limits, Pressure};
use crate::outbound::Outbound;
use crate::wire::{self, cmd, cmd_flag, errno, reply, state, RequestHeader};

/// Read buffer per connection: enough for a deep queue of small requests in one `recv`.
const INBOUND_BUFFER: usize = 256 * 1024;
/// A thread keeps a payload buffer up to this size between requests; larger ones are freed.
/// Requests up to this size use that buffer and are not counted in the request memory budgets:
/// what they hold is bounded by the threads (this, plus a batch's space (`batch::SPACE`), times
/// `max_connections + worker_pool`: 276 MiB with the defaults), and it keeps the budgets' atomics
/// off the small-request hot path.
const KEEP_BUFFER: usize = 256 * 1024;
/// Extents reported per BLOCK_STATUS reply when the client did not ask for just one.
const MAX_EXTENTS: usize = 1024;
/// An extra thread that gets no request for this long exits.
pub const RETIRE_AFTER: Duration = Duration::from_secs(5);
/// How long a request executed serially (see the module documentation) holds the seat before
/// the watching follower takes it; also how often the watcher wakes while the connection is
/// serial. Read hits and write-back writes take well under it; misses on a slow disk do not.
const PATIENCE: Duration = Duration::from_micros(500);
/// The watcher stops watching once no request was read for this long.
const WATCH_IDLE: Duration = Duration::from_millis(20);
/// After a request arrived while a serial one ran (the connection only looked serial: a
/// database's threads issue requests independently), this many requests are read before the
/// next is executed serially: each such request waits for the one running (up to [`PATIENCE`])
/// instead of running beside it, and this bounds how often that happens to one request in this
/// many. (MariaDB under sysbench showed no TPS difference with or without it, nor against the
/// build before serial connections, within its runs' noise: bench/results/serial_nbd/.)
const SERIAL_BACKOFF: u64 = 64;
/// Stack of extra threads: they run the same code as the connection's own thread, which is
/// shallow (the engine does not recurse).
const WORKER_STACK: usize = 256 * 1024;

/// Per-connection parameters of the transmission phase.
pub struct Params<'a> {
    pub export: &'a Export,
    pub session: Session,
    pub max_payload: u32,
    /// Most threads serving this connection (requests executing at once).
    pub threads: usize,
    /// Server-wide memory and thread limits.
    pub limits: &'a Limits,
    /// This connection's state: its memory budget, activity for the reclaim policy, and the
    /// flag that tells its threads to stop.
    pub conn: &'a ConnState,
    /// Waits up to the given time for the reader to have data (or an error or end of stream to
    /// report); false if the time passed first.
    pub wait_readable: &'a (dyn Fn(Duration) -> bool + Sync),
}

struct Shared<'a, R, W> {
    params: &'a Params<'a>,
    dev: &'a dyn BlockDev,
    read_only: bool,
    /// Locked only by the thread holding the seat (uncontended).
    inbound: Mutex<BufReader<R>>,
    /// Who reads the next request.
    seat: Mutex<Seat>,
    /// Followers wait here for the seat.
    seat_free: Condvar,
    /// Set once no further request may be read; outside the seat, so that a thread closing the
    /// connection never waits for the reader.
    closed: AtomicBool,
    /// Where replies go (see `outbound`).
    outbound: Outbound<W>,
    /// Breaks the connection so threads blocked in I/O on it return (e.g. shuts the socket down).
    hangup: &'a (dyn Fn() + Sync),
    /// Threads serving this connection. Those not busy with a request (`ConnState::in_flight`)
    /// read the next one or wait to.
    live: AtomicUsize,
    /// The connection was idle for [`RETIRE_AFTER`]: extra threads exit when they would take the
    /// seat, until a request arrives.
    shrink: AtomicBool,
    /// Requests read but left for any thread to execute: a batch's reads the device did not
    /// serve together (`batch`). Taken before the seat, so they never wait for the socket.
    pending: Mutex<std::collections::VecDeque<Request>>,
    /// How many `pending` holds, checked without its lock.
    pending_len: AtomicUsize,
}

/// Who reads the next request (see the module documentation).
struct Seat {
    state: SeatState,
    /// A follower waits with a timeout, ready to take the seat from a serial request.
    watching: bool,
    /// Requests read on this connection so far: numbers serial turns, and tells the watcher
    /// whether the connection is still busy.
    read: u64,
    /// No request is executed serially before this one: a request arrived while the last
    /// serial one ran.
    serial_from: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum SeatState {
    /// Nobody reads: the next thread to come takes it.
    Free,
    /// A thread reads (or waits for the socket to be readable).
    Reading,
    /// The thread that read request `turn` executes it and will read the next one itself,
    /// unless it runs past `since` + [`PATIENCE`].
    Serial { turn: u64, since: Instant },
}

/// A request read off the wire, its payload (if any) in the thread's buffer.
#[derive(Clone, Copy)]
struct Request {
    hdr: RequestHeader,
    /// A WRITE payload larger than the maximum was read and discarded.
    payload_dropped: bool,
    /// Request memory taken from the budgets for it.
    cost: u64,
}

/// How [`Shared::take_seat`] ended.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Taken {
    /// This thread holds the seat.
    Seat,
    /// A request is pending: take it instead of waiting.
    Pending,
    /// This extra thread was counted out (the connection idle).
    Retire,
}

enum Next {
    Request(Request),
    /// The connection is closing.
    Closed,
    /// This extra thread had nothing to do for [`RETIRE_AFTER`] and was counted out of `live`.
    Retire,
}

/// A successful result, before it is put on the wire.
enum Done {
    /// No payload in the reply.
    Ack,
    /// READ: the thread's buffer holds the data.
    Data,
    /// BLOCK_STATUS: the thread's extent list holds the descriptors.
    Extents,
}

struct Failure {
    error: u32,
    message: String,
}

/// Serves requests from `reader` and answers on `writer` until the client disconnects, the stream
/// breaks, `hangup` is called from elsewhere or the connection is told to close. Returns once every
/// request read has been answered (or its reply could not be sent).
pub fn serve<R: Read + Send, W: Write + Send>(
    params: &Params<'_>,
    reader: R,
    writer: W,
    hangup: &(dyn Fn() + Sync),
) {
    let shared = Shared {
        params,
        dev: &*params.export.dev,
        read_only: params.export.read_only(),
        inbound: Mutex::new(BufReader::with_capacity(INBOUND_BUFFER, reader)),
        seat: Mutex::new(Seat {
            state: SeatState::Free,
            watching: false,
            read: 0,
            serial_from: 0,
        }),
        seat_free: Condvar::new(),
        closed: AtomicBool::new(false),
        outbound: Outbound::new(writer),
        hangup,
        live: AtomicUsize::new(1),
        shrink: AtomicBool::new(false),
        pending: Mutex::new(std::collections::VecDeque::new()),
        pending_len: AtomicUsize::new(0),
    };
    std::thread::scope(|scope| shared.worker(scope, false));
    // Left by threads that ended on a reply they could not send: nobody can be answered now.
    while let Some(req) = shared.take_pending() {
        shared.finished(&req);
    }
}

/// Gives a worker's pool slot back when its thread ends, however it ends.
struct PoolSlot<'a>(&'a Limits);

impl Drop for PoolSlot<'_> {
    fn drop(&mut self) {
        self.0.workers.give_back();
    }
}

impl<'env, R: Read + Send, W: Write + Send> Shared<'env, R, W> {
    /// Serves requests until the connection closes; `extra` threads (not the connection's own)
    /// also stop after [`RETIRE_AFTER`] without work.
    fn worker<'scope>(&'scope self, scope: &'scope Scope<'scope, '_>, extra: bool) {
        let mut buf = AlignedBuf::new();
        let mut extents = Vec::new();
        let mut batch = Batch::new();
        // The serial turn this thread holds the seat for, if any (see `next_request`).
        let mut serial = None;
        loop {
            let req = match self.next_request(&mut serial, &mut buf, &mut batch, extra) {
                Next::Request(req) => req,
                // `next_request` counted this thread out already.
                Next::Retire => return,
                Next::Closed => break,
            };
            self.grow(scope);
            let answered = if batch.is_empty() {
                self.answer(&req, &mut buf, &mut extents, serial)
            } else if batch.is_writes() {
                self.serve_write_batch(req, &mut buf, &mut batch)
            } else {
                self.serve_batch(req, &mut buf, &mut batch, &mut extents, scope)
            };
            if !answered {
                break;
            }
        }
        if let Some(turn) = serial {
            if self.back_in_seat(turn) {
                self.leave_seat();
            }
        }
        self.live.fetch_sub(1, Ordering::AcqRel);
    }

    /// Executes `req` and sends its reply; false if the reply could not be sent (the connection
    /// is closed then). `serial`: the turn this thread kept the seat for, if it did.
    fn answer(
        &self,
        req: &Request,
        buf: &mut AlignedBuf,
        extents: &mut Vec<(u32, u32)>,
        serial: Option<u64>,
    ) -> bool {
        let result = self.execute(req, buf, extents);
        if let Some(turn) = serial {
            self.note_arrivals(turn);
        }
        let sent = self.send_reply(&req.hdr, &result, buf, extents);
        buf.shrink_to(KEEP_BUFFER);
        self.finished(req);
        if let Err(e) = sent {
            tracing::debug!(error = %e, "cannot send reply; closing connection");
            self.close();
            return false;
        }
        true
    }

    /// Spawns one more thread if none is left to read the next request.
    fn grow<'scope>(&'scope self, scope: &'scope Scope<'scope, '_>) {
        let live = self.live.load(Ordering::Acquire);
        if live >= self.params.threads || live as u64 > self.params.conn.in_flight() {
            return;
        }
        if self.closed.load(Ordering::Acquire) {
            return;
        }
        let limits = self.params.limits;
        if !limits.workers.try_take() {
            limits.pressure(Pressure::Threads);
            return;
        }
        let slot = PoolSlot(limits);
        self.live.fetch_add(1, Ordering::AcqRel);
        let spawned = std::thread::Builder::new()
            .name("nbd-worker".into())
            .stack_size(WORKER_STACK)
            .spawn_scoped(scope, move || {
                let _slot = slot;
                self.worker(scope, true)
            });
        if let Err(e) = spawned {
            // The slot was moved into the closure and dropped with it.
            self.live.fetch_sub(1, Ordering::AcqRel);
            tracing::debug!(error = %e, "cannot spawn NBD worker thread; serving with fewer");
        }
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.params.conn.close();
        (self.hangup)();
    }

    /// Takes `cost` bytes from the connection's budget, then the server's; false if the
    /// connection closed meanwhile.
    fn admit(&self, cost: u64) -> bool {
        let (conn, limits) = (self.params.conn, self.params.limits);
        let abort = || conn.is_closing();
        if !conn.memory.acquire(cost, 0, &abort, &|| {}) {
            return false;
        }
        // The connection asking for least in all goes first (see `Budget`).
        let priority = conn.memory.used();
        if !limits.memory.acquire(cost, priority, &abort, &|| {
            limits.pressure(Pressure::Memory)
        }) {
            conn.memory.release(cost);
            return false;
        }
        true
    }

    /// A request was answered (or could not be): its memory goes back to the budgets.
    fn finished(&self, req: &Request) {
        self.params.conn.memory.release(req.cost);
        self.params.limits.memory.release(req.cost);
        self.params.conn.request_done();
    }

    /// Counts this extra thread out if another thread not busy with a request would remain to
    /// read the next one (a thread busy with a long request must not leave its connection with
    /// no reader). Called with the seat's lock held, so two threads cannot both see the other as
    /// the one remaining; a request read meanwhile makes its reader spawn a thread if it was the
    /// last one free (`grow`).
    fn retire(&self, _seat: &Seat) -> bool {
        let live = self.live.load(Ordering::Acquire) as u64;
        if live > self.params.conn.in_flight() + 1 {
            self.live.fetch_sub(1, Ordering::AcqRel);
            true
        } else {
            false
        }
    }

    /// Takes the seat: at once if it is free, or held by a serial request that has run past
    /// [`PATIENCE`]; else waits (as the watcher, with a timeout, if it is serial and nobody
    /// watches yet). Gives up waiting when a request is pending (`Taken::Pending`), or when this
    /// extra thread was counted out instead (the connection idle: `Taken::Retire`).
    fn take_seat(&self, extra: bool) -> Taken {
        let mut seat = self.seat.lock();
        let mut watcher = false;
        let (mut seen, mut quiet_since) = (seat.read, Instant::now());
        let taken = loop {
            if extra && self.shrink.load(Ordering::Acquire) && self.retire(&seat) {
                break Taken::Retire;
            }
            // Checked under the seat's lock, which `push_pending` takes before it notifies: a
            // request pushed after this check wakes this thread from the wait below.
            if self.pending_len.load(Ordering::Acquire) > 0 {
                break Taken::Pending;
            }
            match seat.state {
                SeatState::Free => break Taken::Seat,
                SeatState::Serial { since, .. } if since.elapsed() >= PATIENCE => {
                    #[cfg(test)]
                    self.params.conn.serial_seat_taken();
                    break Taken::Seat;
                }
                SeatState::Serial { since, .. } if watcher || !seat.watching => {
                    watcher = true;
                    seat.watching = true;
                    self.seat_free.wait_until(&mut seat, since + PATIENCE);
                }
                SeatState::Reading if watcher => {
                    if seat.read != seen {
                        (seen, quiet_since) = (seat.read, Instant::now());
                    } else if quiet_since.elapsed() >= WATCH_IDLE {
                        watcher = false;
                        seat.watching = false;
                        continue;
                    }
                    self.seat_free.wait_for(&mut seat, PATIENCE);
                }
                _ => self.seat_free.wait(&mut seat),
            }
        };
        if watcher {
            seat.watching = false;
        }
        if taken == Taken::Seat {
            seat.state = SeatState::Reading;
        }
        taken
    }

    /// Takes the seat, or else a pending request (`Err(Next::Request)`), or retires this extra
    /// thread (`Err(Next::Retire)`).
    fn seat_or_pending(&self, extra: bool) -> Result<(), Next> {
        loop {
            if let Some(req) = self.take_pending() {
                return Err(Next::Request(req));
            }
            match self.take_seat(extra) {
                Taken::Seat => return Ok(()),
                Taken::Retire => return Err(Next::Retire),
                Taken::Pending => {}
            }
        }
    }

    /// The oldest pending request, if any.
    fn take_pending(&self) -> Option<Request> {
        if self.pending_len.load(Ordering::Acquire) == 0 {
            return None;
        }
        let req = self.pending.lock().pop_front();
        if req.is_some() {
            self.pending_len.fetch_sub(1, Ordering::AcqRel);
        }
        req
    }

    /// Leaves `reqs` to whichever threads come first, and wakes those waiting for the seat.
    fn push_pending(&self, reqs: impl Iterator<Item = Request>) {
        {
            let mut pending = self.pending.lock();
            let before = pending.len();
            pending.extend(reqs);
            self.pending_len
                .fetch_add(pending.len() - before, Ordering::AcqRel);
        }
        drop(self.seat.lock());
        self.seat_free.notify_all();
    }

    /// Whether the thread that executed serial `turn` still holds the seat (nobody took it
    /// meanwhile); it reads on if so.
    fn back_in_seat(&self, turn: u64) -> bool {
        let mut seat = self.seat.lock();
        if matches!(seat.state, SeatState::Serial { turn: t, .. } if t == turn) {
            seat.state = SeatState::Reading;
            true
        } else {
            false
        }
    }

    /// After serial `turn` ran, before its reply: if a request came meanwhile, the client was
    /// not waiting for the reply (the connection only looked serial), and that request waited
    /// for this one: no request is executed serially for the next [`SERIAL_BACKOFF`]. Under the
    /// seat's lock and only while this thread holds the seat, so nobody reads meanwhile.
    fn note_arrivals(&self, turn: u64) {
        let mut seat = self.seat.lock();
        let held = matches!(seat.state, SeatState::Serial { turn: t, .. } if t == turn);
        if held && (self.params.wait_readable)(Duration::ZERO) {
            seat.serial_from = seat.read + SERIAL_BACKOFF;
        }
    }

    /// Gives up the seat and wakes every follower (the connection closing or shrinking: each
    /// must look).
    fn leave_seat(&self) {
        self.seat.lock().state = SeatState::Free;
        self.seat_free.notify_all();
    }

    /// After reading `requests` (a request, or a batch of reads): passes the seat on, or keeps it
    /// for a serial request (`turn`, returned), waking a follower to watch if none does.
    fn after_read(&self, serial: bool, requests: u64) -> Option<u64> {
        let mut seat = self.seat.lock();
        seat.read += requests;
        let turn = seat.read;
        if serial && turn >= seat.serial_from {
            seat.state = SeatState::Serial {
                turn,
                since: Instant::now(),
            };
            let wake = !seat.watching;
            drop(seat);
            if wake {
                self.seat_free.notify_one();
            }
            self.params.conn.executed_serially();
            Some(turn)
        } else {
            seat.state = SeatState::Free;
            drop(seat);
            self.seat_free.notify_one();
            None
        }
    }

    /// Reads the next request; `Closed` once the connection is closing, `Retire` (this extra
    /// thread counted out) once it has been idle for [`RETIRE_AFTER`]. `serial`: the turn this
    /// thread kept the seat for, if it did (taken by this call, set again if it keeps it).
    fn next_request(
        &self,
        serial: &mut Option<u64>,
        buf: &mut AlignedBuf,
        batch: &mut Batch,
        extra: bool,
    ) -> Next {
        batch.clear();
        let seated = serial.take().is_some_and(|turn| self.back_in_seat(turn));
        if !seated {
            if let Err(next) = self.seat_or_pending(extra) {
                return next;
            }
        }
        let mut inbound = self.inbound.lock();
        loop {
            if self.closed.load(Ordering::Acquire) {
                drop(inbound);
                self.leave_seat();
                return Next::Closed;
            }
            if !inbound.buffer().is_empty() || self.live.load(Ordering::Acquire) == 1 {
                break;
            }
            if extra && self.shrink.load(Ordering::Acquire) && self.retire(&self.seat.lock()) {
                drop(inbound);
                // Straight to the next thread waiting, which may be leaving too.
                self.leave_seat();
                return Next::Retire;
            }
            if (self.params.wait_readable)(RETIRE_AFTER) {
                break;
            }
            self.shrink.store(true, Ordering::Release);
            drop(inbound);
            if extra && self.retire(&self.seat.lock()) {
                self.leave_seat();
                return Next::Retire;
            }
            // Let the extra threads waiting for the seat see the flag and exit.
            self.leave_seat();
            if let Err(next) = self.seat_or_pending(extra) {
                return next;
            }
            inbound = self.inbound.lock();
        }
        let max_payload = self.params.max_payload;
        let result = read_header(&mut *inbound).and_then(|hdr| {
            let Some(hdr) = hdr else { return Ok(None) };
            let cost = request_cost(&hdr, max_payload);
            if !self.admit(cost) {
                return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "closing"));
            }
            match read_payload(&mut *inbound, &hdr, buf, max_payload) {
                Ok(payload_dropped) => Ok(Some(Request {
                    hdr,
                    payload_dropped,
                    cost,
                })),
                Err(e) => {
                    self.params.conn.memory.release(cost);
                    self.params.limits.memory.release(cost);
                    Err(e)
                }
            }
        });
        match result {
            Ok(Some(req)) => {
                // A request came: the connection is not idle (any more).
                if self.shrink.load(Ordering::Relaxed) {
                    self.shrink.store(false, Ordering::Release);
                }
                self.params.conn.request_read();
                match req.hdr.cmd {
                    cmd::READ => self.read_more(&mut inbound, batch),
                    cmd::WRITE => self.write_more(&req.hdr, &mut inbound, batch),
                    _ => {}
                }
                let alone = inbound.buffer().is_empty() && self.params.conn.in_flight() == 1;
                drop(inbound);
                *serial = self.after_read(alone, 1 + batch.len() as u64);
                Next::Request(req)
            }
            Ok(None) => {
                tracing::debug!("client disconnected (NBD_CMD_DISC)");
                self.closed.store(true, Ordering::Release);
                drop(inbound);
                self.leave_seat();
                Next::Closed
            }
            Err(e) => {
                self.closed.store(true, Ordering::Release);
                drop(inbound);
                self.leave_seat();
                match e.kind() {
                    io::ErrorKind::UnexpectedEof => tracing::debug!("client closed the connection"),
                    io::ErrorKind::ConnectionAborted => {}
                    _ => {
                        tracing::info!(error = %e, "dropping connection");
                        (self.hangup)();
                    }
                }
                Next::Closed
            }
        }
    }

    fn execute(
        &self,
        req: &Request,
        buf: &mut AlignedBuf,
        extents: &mut Vec<(u32, u32)>,
    ) -> Result<Done, Failure> {
        let h = &req.hdr;
        self.validate(req).map_err(|(error, why)| Failure {
            error,
            message: format!("{} refused: {why}", cmd::name(h.cmd)),
        })?;
        let fua = h.flags & cmd_flag::FUA != 0;
        let (offset, len) = (h.offset, h.length as u64);
        let dev = self.dev;
        let result = match h.cmd {
            cmd::READ => {
                buf.resize(h.length as usize);
                dev.read_at(buf, offset).map(|()| Done::Data)
            }
            cmd::WRITE => dev.write_at(buf, offset, fua).map(|()| Done::Ack),
            cmd::FLUSH => dev.flush().map(|()| Done::Ack),
            cmd::TRIM => dev
                .trim(offset, len)
                .and_then(|()| if fua { dev.flush() } else { Ok(()) })
                .map(|()| Done::Ack),
            cmd::WRITE_ZEROES => {
                let opts = ZeroOpts {
                    may_trim: h.flags & cmd_flag::NO_HOLE == 0,
                    fast_only: h.flags & cmd_flag::FAST_ZERO != 0,
                    fua,
                };
                dev.write_zeroes(offset, len, opts).map(|()| Done::Ack)
            }
            cmd::CACHE => dev.prefetch(offset, len).map(|()| Done::Ack),
            cmd::BLOCK_STATUS => {
                let max = if h.flags & cmd_flag::REQ_ONE != 0 {
                    1
                } else {
                    MAX_EXTENTS
                };
                let mut raw = Vec::new();
                dev.extents(offset, len, max, &mut raw)
                    .map(|()| encode_extents(&raw, h.length, max, extents))
                    .map(|()| Done::Extents)
            }
            _ => unreachable!("validate() admits only known commands"),
        };
        result.map_err(|e| device_failure(h, &e))
    }

    /// The spec's checks, in the order that gives the most useful error.
    fn validate(&self, req: &Request) -> Result<(), (u32, &'static str)> {
        let h = &req.hdr;
        let session = &self.params.session;
        let allowed_flags = match h.cmd {
            cmd::READ if session.structured_replies => cmd_flag::FUA | cmd_flag::DF,
            cmd::READ | cmd::WRITE | cmd::FLUSH | cmd::TRIM | cmd::CACHE => cmd_flag::FUA,
            cmd::WRITE_ZEROES => cmd_flag::FUA | cmd_flag::NO_HOLE | cmd_flag::FAST_ZERO,
            cmd::BLOCK_STATUS => cmd_flag::FUA | cmd_flag::REQ_ONE,
            _ => return Err((errno::EINVAL, "unknown command")),
        };
        if h.flags & !allowed_flags != 0 {
            return Err((errno::EINVAL, "flag not valid for this command"));
        }
        let writes = matches!(h.cmd, cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES);
        if writes && self.read_only {
            return Err((errno::EPERM, "export is read-only"));
        }
        if req.payload_dropped || (h.cmd == cmd::READ && h.length > self.params.max_payload) {
            return Err((errno::EOVERFLOW, "length exceeds the maximum payload"));
        }
        if h.cmd == cmd::FLUSH {
            return if h.offset == 0 && h.length == 0 {
                Ok(())
            } else {
                Err((errno::EINVAL, "offset and length must be zero"))
            };
        }
        if h.cmd == cmd::BLOCK_STATUS {
            if session.base_allocation.is_none() {
                return Err((errno::EINVAL, "no metadata context was negotiated"));
            }
            if h.length == 0 {
                return Err((errno::EINVAL, "zero length"));
            }
        }
        let in_range = h
            .offset
            .checked_add(h.length as u64)
            .is_some_and(|end| end <= session.size);
        if !in_range {
            return Err(if writes {
                (errno::ENOSPC, "range extends beyond the end of the export")
            } else {
                (errno::EINVAL, "range extends beyond the end of the export")
            });
        }
        Ok(())
    }

    fn send_reply(
        &self,
        h: &RequestHeader,
        result: &Result<Done, Failure>,
        buf: &[u8],
        extents: &[(u32, u32)],
    ) -> io::Result<()> {
        let structured = self.params.session.structured_replies;
        let mut header = [0u8; wire::STRUCTURED_HEADER_LEN + 8];
        let mut tail = Vec::new();
        let (head_len, body): (usize, &[u8]) = match (result, structured) {
            (Ok(Done::Data), _) => (
                data_reply_header(structured, h, buf.len(), &mut header),
                buf,
            ),
            (Ok(Done::Extents), _) => {
                let id = self.params.session.base_allocation.unwrap_or(0);
                tail.reserve(4 + extents.len() * 8);
                tail.extend_from_slice(&id.to_be_bytes());
                for (len, flags) in extents {
                    tail.extend_from_slice(&len.to_be_bytes());
                    tail.extend_from_slice(&flags.to_be_bytes());
                }
                header[..20].copy_from_slice(&wire::structured_header(
                    reply::FLAG_DONE,
                    reply::TYPE_BLOCK_STATUS,
                    h.handle,
                    tail.len() as u32,
                ));
                (20, &tail)
            }
            (Ok(Done::Ack), _) => {
                header[..16].copy_from_slice(&wire::simple_reply(0, h.handle));
                (16, &[])
            }
            (Err(f), false) => {
                tracing::debug!(handle = h.handle, error = f.error, message = %f.message, "request failed");
                header[..16].copy_from_slice(&wire::simple_reply(f.error, h.handle));
                (16, &[])
            }
            (Err(f), true) => {
                tracing::debug!(handle = h.handle, error = f.error, message = %f.message, "request failed");
                let msg = &f.message.as_bytes()[..f.message.len().min(wire::MAX_STRING)];
                tail.extend_from_slice(&f.error.to_be_bytes());
                tail.extend_from_slice(&(msg.len() as u16).to_be_bytes());
                tail.extend_from_slice(msg);
                header[..20].copy_from_slice(&wire::structured_header(
                    reply::FLAG_DONE,
                    reply::TYPE_ERROR,
                    h.handle,
                    tail.len() as u32,
                ));
                (20, &tail)
            }
        };
        self.outbound.send(
            &mut [IoSlice::new(&header[..head_len]), IoSlice::new(body)],
            &|yes| self.params.conn.writing(yes),
        )
    }
}

/// Writes the header of a successful READ's reply with `len` bytes of data into `header`;
/// returns its length (the data follows it, none for an empty structured reply).
fn data_reply_header(
    structured: bool,
    h: &RequestHeader,
    len: usize,
    header: &mut [u8; wire::STRUCTURED_HEADER_LEN + 8],
) -> usize {
    if !structured {
        header[..16].copy_from_slice(&wire::simple_reply(0, h.handle));
        return 16;
    }
    if len == 0 {
        header[..20].copy_from_slice(&wire::structured_header(
            reply::FLAG_DONE,
            reply::TYPE_NONE,
            h.handle,
            0,
        ));
        return 20;
    }
    header[..20].copy_from_slice(&wire::structured_header(
        reply::FLAG_DONE,
        reply::TYPE_OFFSET_DATA,
        h.handle,
        8 + len as u32,
    ));
    header[20..28].copy_from_slice(&h.offset.to_be_bytes());
    28
}

/// The reply to a request the device failed.
fn device_failure(h: &RequestHeader, e: &io::Error) -> Failure {
    let (offset, len) = (h.offset, h.length);
    let error = nbd_error(e);
    if error == errno::EIO {
        tracing::warn!(cmd = cmd::name(h.cmd), offset, len, error = %e, "device error");
    }
    Failure {
        error,
        message: format!(
            "{} of {len} bytes at offset {offset}: {e}",
            cmd::name(h.cmd)
        ),
    }
}

/// Reads one request header; `Ok(None)` is NBD_CMD_DISC.
fn read_header<R: Read>(reader: &mut R) -> io::Result<Option<RequestHeader>> {
    let mut raw = [0u8; RequestHeader::LEN];
    reader.read_exact(&mut raw)?;
    let hdr = RequestHeader::decode(&raw)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad request magic"))?;
    Ok((hdr.cmd != cmd::DISC).then_some(hdr))
}

/// The request memory a request is charged: its READ reply buffer or its WRITE payload, when
/// larger than the buffer each thread keeps anyway. Oversized requests are refused without one.
fn request_cost(hdr: &RequestHeader, max_payload: u32) -> u64 {
    match hdr.cmd {
        cmd::READ | cmd::WRITE
            if hdr.length <= max_payload && hdr.length as usize > KEEP_BUFFER =>
        {
            hdr.length as u64
        }
        _ => 0,
    }
}

/// Reads a WRITE's payload into `buf`; returns true if it was too large and was discarded.
fn read_payload<R: Read>(
    reader: &mut R,
    hdr: &RequestHeader,
    buf: &mut AlignedBuf,
    max_payload: u32,
) -> io::Result<bool> {
    if hdr.cmd != cmd::WRITE {
        return Ok(false);
    }
    if hdr.length > max_payload {
        let len = hdr.length as u64;
        if io::copy(&mut reader.take(len), &mut io::sink())? < len {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        return Ok(true);
    }
    buf.resize(hdr.length as usize);
    reader.read_exact(buf)?;
    Ok(false)
}

/// Turns a device's allocation map into NBD descriptors: merged, non-empty, within `request_len`,
/// at most `max` of them, and never none.
fn encode_extents(raw: &[Extent], request_len: u32, max: usize, out: &mut Vec<(u32, u32)>) {
    out.clear();
    let mut remaining = request_len as u64;
    for e in raw {
        if remaining == 0 {
            break;
        }
        let len = e.len.min(remaining);
        if len == 0 {
            continue;
        }
        remaining -= len;
        let flags = if e.hole { state::HOLE } else { 0 } | if e.zero { state::ZERO } else { 0 };
        let full = out.len() == max;
        match out.last_mut() {
            Some((last_len, last_flags)) if *last_flags == flags => *last_len += len as u32,
            _ if full => break,
            _ => out.push((len as u32, flags)),
        }
    }
    if out.is_empty() {
        out.push((request_len, 0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_are_merged_clipped_and_limited() {
        let raw = [
            Extent::data(4096),
            Extent::data(4096),
            Extent {
                len: 8192,
                hole: true,
                zero: true,
            },
            Extent::data(1 << 20),
        ];
        let mut out = Vec::new();
        encode_extents(&raw, 20_000, 16, &mut out);
        assert_eq!(
            out,
            vec![(8192, 0), (8192, state::HOLE | state::ZERO), (3616, 0)]
        );
        encode_extents(&raw, 20_000, 1, &mut out);
        assert_eq!(out, vec![(8192, 0)]);
        encode_extents(&[], 512, 16, &mut out);
        assert_eq!(out, vec![(512, 0)]);
        encode_extents(&[Extent::data(0), Extent::data(100)], 512, 16, &mut out);
        assert_eq!(out, vec![(100, 0)]);
    }

    /// A device whose FLUSH waits until the test opens the gate.
    struct GatedFlush {
        inner: flashtier_testkit::MemDev,
        open: parking_lot::Mutex<bool>,
        opened: parking_lot::Condvar,
    }

    impl BlockDev for GatedFlush {
        fn info(&self) -> &flashtier_io::DevInfo {
            self.inner.info()
        }
        fn describe(&self) -> String {
            "gated".into()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.inner.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
            self.inner.write_at(buf, offset, fua)
        }
        fn flush(&self) -> io::Result<()> {
            let mut open = self.open.lock();
            while !*open {
                self.opened.wait(&mut open);
            }
            Ok(())
        }
        fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
            self.inner.trim(offset, len)
        }
        fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
            self.inner.write_zeroes(offset, len, opts)
        }
    }

    /// Serves a connection on a device whose FLUSH waits until it is let through: sends a FLUSH
    /// (handle 1), then after `wait` a READ (handle 2), expects the READ answered within
    /// `answer_within` while the FLUSH still waits, then lets the FLUSH through and expects it
    /// answered.
    fn a_read_is_answered_behind_a_flush_that_waits(wait: Duration, answer_within: Duration) {
        let dev = std::sync::Arc::new(GatedFlush {
            inner: flashtier_testkit::MemDev::new(TEST_SIZE as usize),
            open: parking_lot::Mutex::new(false),
            opened: parking_lot::Condvar::new(),
        });
        let request = |cmd, handle, length| {
            RequestHeader {
                flags: 0,
                cmd,
                handle,
                offset: 0,
                length,
            }
            .encode()
        };
        with_connection(dev.clone(), |client| {
            client.set_read_timeout(Some(answer_within)).unwrap();
            client.write_all(&request(cmd::FLUSH, 1, 0)).unwrap();
            std::thread::sleep(wait);
            // The FLUSH still runs; a READ sent now is answered anyway.
            client.write_all(&request(cmd::READ, 2, 4096)).unwrap();
            let mut reply = [0u8; 16 + 4096];
            let answered = client.read_exact(&mut reply);
            *dev.open.lock() = true;
            dev.opened.notify_all();
            answered.unwrap_or_else(|e| {
                panic!("no reply to a READ within {answer_within:?} while a FLUSH ran: {e}")
            });
            assert_eq!(reply[..16], wire::simple_reply(0, 2));
            client
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            let mut flushed = [0u8; 16];
            client.read_exact(&mut flushed).unwrap();
            assert_eq!(flushed, wire::simple_reply(0, 1));
        });
    }

    /// A device that serves the batch reads and writes of even blocks and leaves those of odd
    /// blocks; a `read_at` of block `gated` waits until the test opens the gate.
    struct HalfBatching {
        inner: flashtier_testkit::MemDev,
        gated: u64,
        open: parking_lot::Mutex<bool>,
        opened: parking_lot::Condvar,
        batches: AtomicUsize,
        served: AtomicUsize,
        write_batches: AtomicUsize,
        written: AtomicUsize,
    }

    impl HalfBatching {
        fn new(gated: u64) -> HalfBatching {
            HalfBatching {
                inner: flashtier_testkit::MemDev::new(TEST_SIZE as usize),
                gated,
                open: parking_lot::Mutex::new(gated == u64::MAX),
                opened: parking_lot::Condvar::new(),
                batches: AtomicUsize::new(0),
                served: AtomicUsize::new(0),
                write_batches: AtomicUsize::new(0),
                written: AtomicUsize::new(0),
            }
        }
    }

    impl BlockDev for HalfBatching {
        fn info(&self) -> &flashtier_io::DevInfo {
            self.inner.info()
        }
        fn describe(&self) -> String {
            "half batching".into()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            if offset / 4096 == self.gated {
                let mut open = self.open.lock();
                while !*open {
                    self.opened.wait(&mut open);
                }
            }
            self.inner.read_at(buf, offset)
        }
        fn read_batch_max(&self) -> usize {
            32
        }
        /// Names the odd blocks' reads to `leave` first, as a cache names its misses.
        fn read_batch(
            &self,
            reads: &mut [flashtier_io::BatchRead<'_>],
            leave: &mut dyn FnMut(&[usize]),
        ) {
            self.batches.fetch_add(1, Ordering::Relaxed);
            let even = |r: &flashtier_io::BatchRead<'_>| (r.offset / 4096).is_multiple_of(2);
            for (i, r) in reads.iter().enumerate() {
                if !even(r) {
                    leave(&[i]);
                }
            }
            for r in reads.iter_mut().filter(|r| even(r)) {
                self.served.fetch_add(1, Ordering::Relaxed);
                r.result = Some(self.inner.read_at(r.buf, r.offset));
            }
        }
        fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
            self.inner.write_at(buf, offset, fua)
        }
        fn write_batch_max(&self) -> usize {
            32
        }
        fn write_batch(&self, writes: &mut [flashtier_io::BatchWrite<'_>]) {
            self.write_batches.fetch_add(1, Ordering::Relaxed);
            for w in writes.iter_mut() {
                if (w.offset / 4096).is_multiple_of(2) {
                    self.written.fetch_add(1, Ordering::Relaxed);
                    w.result = Some(self.inner.write_at(w.buf, w.offset, false));
                }
            }
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
        fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
            self.inner.trim(offset, len)
        }
        fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
            self.inner.write_zeroes(offset, len, opts)
        }
    }

    /// Pipelined READs are served in batches: the device's served reads and the ones it left
    /// all get their data, a refused one its errno, and a left read that waits (block 1, a miss
    /// on a slow disk) holds up neither the batch's other replies nor the other left reads.
    #[test]
    fn pipelined_reads_are_batched_and_a_left_read_holds_up_no_other() {
        const READS: u64 = 32;
        let dev = std::sync::Arc::new(HalfBatching::new(1));
        let block = |b: u64| vec![(b % 251) as u8 + 1; 4096];
        for b in 0..READS {
            dev.write_at(&block(b), b * 4096, false).unwrap();
        }
        let read = |handle: u64, offset: u64| {
            RequestHeader {
                flags: 0,
                cmd: cmd::READ,
                handle,
                offset,
                length: 4096,
            }
            .encode()
        };
        with_connection(dev.clone(), |client| {
            let mut all: Vec<u8> = (0..READS).flat_map(|h| read(h, h * 4096)).collect();
            // Out of range: refused with EINVAL, inside the batch.
            all.extend(read(READS, TEST_SIZE));
            client.write_all(&all).unwrap();
            let mut answered = std::collections::BTreeSet::new();
            let mut reply = |client: &mut std::os::unix::net::UnixStream| {
                let mut head = [0u8; 16];
                client.read_exact(&mut head).unwrap();
                let error = u32::from_be_bytes(head[4..8].try_into().unwrap());
                let handle = u64::from_be_bytes(head[8..16].try_into().unwrap());
                if handle == READS {
                    assert_eq!(error, errno::EINVAL);
                } else {
                    assert_eq!(error, 0, "READ {handle} failed");
                    let mut data = vec![0u8; 4096];
                    client.read_exact(&mut data).unwrap();
                    assert!(data == block(handle), "data of READ {handle}");
                }
                assert!(answered.insert(handle), "READ {handle} answered twice");
                handle
            };
            // Everything but the gated read, while it waits.
            for _ in 0..READS {
                assert_ne!(
                    reply(client),
                    dev.gated,
                    "the gated read answered while shut"
                );
            }
            *dev.open.lock() = true;
            dev.opened.notify_all();
            assert_eq!(reply(client), dev.gated);
            assert_eq!(answered.len() as u64, READS + 1);
        });
        let (batches, served) = (
            dev.batches.load(Ordering::Relaxed),
            dev.served.load(Ordering::Relaxed),
        );
        assert!(batches >= 1, "no batch");
        // Without batching every read would be a `read_at`: READS / 2 even blocks served.
        assert!(
            served > 1 && batches < served,
            "{served} reads served in {batches} batches"
        );
    }

    /// Pipelined WRITEs are taken in batches: those the device wrote and those it left (written
    /// by the batch's thread) are all acknowledged once and land; one out of range gets
    /// `ENOSPC`; a FUA, an unaligned and a large one end a batch and are written one by one.
    #[test]
    fn pipelined_writes_are_batched_and_each_lands_once() {
        const WRITES: u64 = 48;
        let dev = std::sync::Arc::new(HalfBatching::new(u64::MAX));
        let block = |b: u64| vec![(b % 251) as u8 + 1; 4096];
        // (handle, offset, data, flags)
        let mut sent: Vec<(u64, u64, Vec<u8>, u16)> =
            (0..WRITES).map(|h| (h, h * 4096, block(h), 0)).collect();
        sent.push((WRITES, TEST_SIZE, block(0), 0));
        sent.insert(10, (WRITES + 1, 100 * 4096, block(100), cmd_flag::FUA));
        sent.insert(20, (WRITES + 2, 101 * 4096 + 512, vec![7u8; 1024], 0));
        sent.insert(30, (WRITES + 3, 110 * 4096, vec![9u8; 64 << 10], 0));
        let stream: Vec<u8> = sent
            .iter()
            .flat_map(|(handle, offset, data, flags)| {
                let mut req = RequestHeader {
                    flags: *flags,
                    cmd: cmd::WRITE,
                    handle: *handle,
                    offset: *offset,
                    length: data.len() as u32,
                }
                .encode()
                .to_vec();
                req.extend_from_slice(data);
                req
            })
            .collect();
        with_connection(dev.clone(), |client| {
            client.write_all(&stream).unwrap();
            let mut answered = std::collections::BTreeSet::new();
            for _ in 0..sent.len() {
                let mut head = [0u8; 16];
                client.read_exact(&mut head).unwrap();
                let error = u32::from_be_bytes(head[4..8].try_into().unwrap());
                let handle = u64::from_be_bytes(head[8..16].try_into().unwrap());
                let want = if handle == WRITES { errno::ENOSPC } else { 0 };
                assert_eq!(error, want, "WRITE {handle}");
                assert!(answered.insert(handle), "WRITE {handle} answered twice");
            }
        });
        for (handle, offset, data, _) in &sent {
            if *handle == WRITES {
                continue;
            }
            let mut got = vec![0u8; data.len()];
            dev.inner.read_at(&mut got, *offset).unwrap();
            assert!(got == *data, "WRITE {handle} at {offset} did not land");
        }
        let (batches, written) = (
            dev.write_batches.load(Ordering::Relaxed),
            dev.written.load(Ordering::Relaxed),
        );
        assert!(
            written > 1 && batches < written,
            "{written} writes done in {batches} batches"
        );
    }

    proptest::proptest! {
        // Few shrinking steps: a failing case may wait out the client's 5 s read timeout.
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 48,
            max_shrink_iters: 16,
            ..Default::default()
        })]

        /// Any stream of READs and WRITEs (aligned or not, small or past the batch limit, in
        /// range or not, with a FLUSH or an unknown command here and there to end batches),
        /// served by a device that batches half its reads and writes and leaves the rest: every
        /// request gets exactly one reply, a READ in range its data, one out of range `EINVAL`,
        /// a WRITE in range success, one out of range `ENOSPC`, an unknown command `EINVAL`.
        #[test]
        fn every_pipelined_request_gets_its_one_right_reply(
            reqs in proptest::collection::vec(
                (0u8..20, 0u64..(TEST_SIZE + 8192), 1u32..20_000),
                1..80,
            ),
            structured in proptest::bool::ANY,
        ) {
            let dev = std::sync::Arc::new(HalfBatching::new(u64::MAX));
            let content: Vec<u8> = (0..TEST_SIZE).map(|i| (i / 512 % 251) as u8).collect();
            dev.write_at(&content, 0, false).unwrap();
            // (handle, command, offset, length) as sent.
            let sent: Vec<(u64, u16, u64, u32)> = reqs
                .iter()
                .enumerate()
                .map(|(h, &(kind, offset, length))| {
                    let cmd = match kind {
                        0 => cmd::FLUSH,
                        1 => 0x7f, // unknown
                        2..=7 => cmd::WRITE,
                        _ => cmd::READ,
                    };
                    let (offset, length) = match cmd {
                        cmd::READ | cmd::WRITE if kind % 3 == 0 => (offset, length), // unaligned
                        cmd::READ | cmd::WRITE => {
                            (offset / 512 * 512, length.div_ceil(512) * 512)
                        }
                        _ => (0, 0),
                    };
                    (h as u64, cmd, offset, length)
                })
                .collect();
            // A WRITE writes what is there already, so every READ's data is known whatever order
            // the requests run in; out of range, zeroes.
            let stream: Vec<u8> = sent
                .iter()
                .flat_map(|&(handle, cmd, offset, length)| {
                    let mut req = RequestHeader { flags: 0, cmd, handle, offset, length }
                        .encode()
                        .to_vec();
                    if cmd == cmd::WRITE {
                        let (from, to) = (offset as usize, offset as usize + length as usize);
                        match content.get(from..to) {
                            Some(data) => req.extend_from_slice(data),
                            None => req.resize(req.len() + length as usize, 0),
                        }
                    }
                    req
                })
                .collect();
            with_session(dev.clone(), structured, |client| {
                client.write_all(&stream).unwrap();
                let mut answered = vec![false; sent.len()];
                for _ in 0..sent.len() {
                    let (handle, error, data, at) = read_reply(client, structured, |h| {
                        let (_, cmd, offset, length) = sent[h as usize];
                        let in_range = offset + length as u64 <= TEST_SIZE;
                        if cmd == cmd::READ && in_range { length as usize } else { 0 }
                    });
                    let handle = handle as usize;
                    assert!(!answered[handle], "request {handle} answered twice");
                    answered[handle] = true;
                    let (_, cmd, offset, length) = sent[handle];
                    let in_range = offset + length as u64 <= TEST_SIZE;
                    match cmd {
                        cmd::READ if in_range => {
                            assert_eq!(error, 0, "READ {handle} at {offset}+{length}");
                            if structured {
                                assert_eq!(at, Some(offset), "READ {handle}'s chunk offset");
                            }
                            let want = &content[offset as usize..offset as usize + length as usize];
                            assert!(data == want, "data of READ {handle} at {offset}+{length}");
                        }
                        cmd::READ | 0x7f => assert_eq!(error, errno::EINVAL, "request {handle}"),
                        cmd::WRITE if in_range => assert_eq!(error, 0, "WRITE {handle}"),
                        cmd::WRITE => assert_eq!(error, errno::ENOSPC, "WRITE {handle}"),
                        _ => assert_eq!(error, 0, "FLUSH {handle}"),
                    }
                }
            });
        }
    }

    /// Reads one reply: its handle, its errno, a READ's data (`data_len` of the handle: how much
    /// a simple reply's data is, if it succeeds) and, structured, the offset its data chunk
    /// names. Structured: one chunk, with `DONE`.
    fn read_reply(
        client: &mut std::os::unix::net::UnixStream,
        structured: bool,
        data_len: impl Fn(u64) -> usize,
    ) -> (u64, u32, Vec<u8>, Option<u64>) {
        let be32 = |b: &[u8]| u32::from_be_bytes(b.try_into().unwrap());
        let be64 = |b: &[u8]| u64::from_be_bytes(b.try_into().unwrap());
        let mut head = [0u8; wire::STRUCTURED_HEADER_LEN];
        client.read_exact(&mut head[..16]).unwrap();
        // A command without data may be answered with a simple reply either way.
        if be32(&head[..4]) == wire::SIMPLE_REPLY_MAGIC {
            let (error, handle) = (be32(&head[4..8]), be64(&head[8..16]));
            let len = if error == 0 { data_len(handle) } else { 0 };
            assert!(!structured || len == 0, "READ {handle}: a simple reply");
            let mut data = vec![0u8; len];
            client.read_exact(&mut data).unwrap();
            return (handle, error, data, None);
        }
        assert!(structured, "a structured reply not negotiated");
        assert_eq!(be32(&head[..4]), wire::STRUCTURED_REPLY_MAGIC);
        client.read_exact(&mut head[16..]).unwrap();
        let flags = u16::from_be_bytes([head[4], head[5]]);
        let kind = u16::from_be_bytes([head[6], head[7]]);
        let (handle, len) = (be64(&head[8..16]), be32(&head[16..20]) as usize);
        assert_eq!(
            flags & reply::FLAG_DONE,
            reply::FLAG_DONE,
            "one chunk a reply"
        );
        let mut payload = vec![0u8; len];
        client.read_exact(&mut payload).unwrap();
        match kind {
            reply::TYPE_NONE => (handle, 0, Vec::new(), None),
            reply::TYPE_OFFSET_DATA => {
                (handle, 0, payload[8..].to_vec(), Some(be64(&payload[..8])))
            }
            reply::TYPE_ERROR => (handle, be32(&payload[..4]), Vec::new(), None),
            other => panic!("reply type {other:#x} to request {handle}"),
        }
    }

    /// The size of the test connections' devices.
    const TEST_SIZE: u64 = 1 << 20;

    /// Serves a connection on `dev` (4 threads, unlimited budgets) over a socket pair, runs
    /// `client` on the other end, closes it and waits for the server; returns the connection's
    /// state.
    fn with_connection(
        dev: std::sync::Arc<dyn BlockDev>,
        client: impl FnOnce(&mut std::os::unix::net::UnixStream),
    ) -> ConnState {
        with_session(dev, false, client)
    }

    /// [`with_connection`], with structured replies negotiated or not.
    fn with_session(
        dev: std::sync::Arc<dyn BlockDev>,
        structured: bool,
        client: impl FnOnce(&mut std::os::unix::net::UnixStream),
    ) -> ConnState {
        use std::os::fd::AsRawFd;

        let export = Export::new("", dev);
        let limits = Limits::unlimited();
        let conn = ConnState::new(u64::MAX);
        let (server, mut stream) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = server.as_raw_fd();
        let readable = move |t: Duration| crate::net::poll_readable(fd, t);
        let params = Params {
            export: &export,
            session: Session {
                structured_replies: structured,
                base_allocation: None,
                flags: 0,
                size: TEST_SIZE,
            },
            max_payload: 1 << 20,
            threads: 4,
            limits: &limits,
            conn: &conn,
            wait_readable: &readable,
        };
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let hangup = || {
            let _ = server.shutdown(std::net::Shutdown::Both);
        };
        std::thread::scope(|s| {
            let served = s.spawn(|| serve(&params, &server, &server, &hangup));
            client(&mut stream);
            drop(stream);
            served.join().unwrap();
        });
        conn
    }

    /// How many requests were executed serially while `client` ran against a memory device,
    /// and how many of them had their seat taken (they ran past [`PATIENCE`]).
    fn serial_requests_of(client: impl FnOnce(&mut std::os::unix::net::UnixStream)) -> (u64, u64) {
        let dev = flashtier_testkit::MemDev::new(TEST_SIZE as usize);
        let conn = with_connection(std::sync::Arc::new(dev), client);
        (conn.serial_requests(), conn.serial_seats_taken())
    }

    fn read_request(handle: u64) -> [u8; RequestHeader::LEN] {
        RequestHeader {
            flags: 0,
            cmd: cmd::READ,
            handle,
            offset: handle * 4096 % TEST_SIZE,
            length: 4096,
        }
        .encode()
    }

    /// A client that waits for each reply before sending the next request has every request
    /// executed serially; one that sends many at once has none but perhaps the last (the others
    /// find more buffered behind them).
    #[test]
    fn only_a_client_waiting_for_each_reply_is_served_serially() {
        // A memory read runs well under PATIENCE unless the machine starves the thread (CI
        // once counted 38 of 40 with a power-loss campaign beside it): then the watcher takes
        // the seat, and the next request may find the last one still finishing. Such a run
        // shows nothing and is run again.
        let mut runs = 0;
        let waiting = loop {
            let (serial, taken) = serial_requests_of(|stream| {
                for handle in 0..40 {
                    stream.write_all(&read_request(handle)).unwrap();
                    let mut reply = [0u8; 16 + 4096];
                    stream.read_exact(&mut reply).unwrap();
                    assert_eq!(reply[..16], wire::simple_reply(0, handle));
                }
            });
            runs += 1;
            if taken == 0 {
                break serial;
            }
            assert!(
                runs < 10,
                "in each of {runs} runs a read ran past PATIENCE: the machine is starved"
            );
        };
        assert_eq!(waiting, 40);
        let (pipelined, _) = serial_requests_of(|stream| {
            let all: Vec<u8> = (0..40).flat_map(read_request).collect();
            stream.write_all(&all).unwrap();
            let mut reply = [0u8; 16 + 4096];
            for _ in 0..40 {
                stream.read_exact(&mut reply).unwrap();
            }
        });
        assert!(
            pipelined <= 1,
            "{pipelined} of 40 pipelined requests executed serially"
        );
    }

    /// One request running longer than the idle time must not leave its connection without a
    /// thread to read the next: the extra thread that reads instead stays.
    #[test]
    fn a_request_longer_than_the_idle_time_does_not_stop_reading() {
        a_read_is_answered_behind_a_flush_that_waits(
            RETIRE_AFTER + Duration::from_millis(1500),
            Duration::from_secs(2),
        );
    }

    /// The FLUSH, alone in flight, is executed serially: the thread that read it keeps the seat.
    /// The watching follower must take it once the FLUSH has run for `PATIENCE`, so that a READ
    /// arriving meanwhile is read and answered at once, not after the FLUSH (which here never
    /// ends until the READ is answered).
    #[test]
    fn a_request_behind_a_serial_one_that_runs_long_is_answered_first() {
        for wait in [
            Duration::ZERO,
            Duration::from_millis(2),
            Duration::from_millis(100),
        ] {
            a_read_is_answered_behind_a_flush_that_waits(wait, Duration::from_secs(1));
        }
    }
}
