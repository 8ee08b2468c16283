//! The reply side of a connection: threads that finish requests at the same time send their
//! replies with one write.
//!
//! Every thread serving a connection writes its own reply to the one stream, under one lock.
//! At a queue depth of 32 those threads finish together, and the lock was measured as the
//! connection's busiest: 4 KiB read hits at QD32, a tenth of the server's CPU went to threads
//! spinning (with `sched_yield`) or sleeping on it, each then making its own `writev` and waking
//! the client once more.
//!
//! So a thread that finds the stream taken does not wait for it: it copies a small reply (at most
//! [`COMBINE_MAX`]) into a queue and goes back to work, and the thread holding the stream writes
//! what was queued, in one write, before it lets go. A reply too large to copy, or one that would
//! take the queue past [`QUEUE_MAX`], waits for the stream as before, which bounds the memory a
//! client that stops reading can make the server hold (the queue and the batch being written,
//! plus one reply per thread).
//!
//! No reply is left behind: whoever releases the stream looks at the queue afterwards and, if it
//! is not empty, takes the stream again unless another thread already has it (which then does the
//! same). A thread that queued a reply tries the stream itself after queueing it, so a reply
//! queued just as the holder let go is written by the thread that queued it. Replies in one
//! connection may go out in any order (the protocol matches them by handle); a reply is written
//! whole, never interleaved with another. Lock order: the stream, then the queue (a thread
//! queueing holds only the queue).
//!
//! Errors: a failed write is returned to the thread that made it, which closes the connection.
//! Replies other threads had queued in that write are lost with the connection, as they would be
//! unsent had each thread waited.

use std::io::{self, IoSlice, Write};

use parking_lot::{Mutex, MutexGuard};

use crate::net::write_all_vectored;

/// Largest reply (header and payload) a thread copies into the queue rather than wait for the
/// stream. A 4 KiB read's reply copies in well under a microsecond; much larger ones would cost
/// more to copy than to wait.
pub const COMBINE_MAX: usize = 64 << 10;
/// Most bytes of replies queued at once: room for the 31 other replies of 4 KiB reads finished
/// at QD32 while one is written, or 7 of 16 KiB ones (a database page). The queue and the batch
/// its holder is writing never hold more than this each, capacity included, so a connection holds
/// at most twice this for replies (ARCHITECTURE.md's memory bound counts 256 KiB).
pub const QUEUE_MAX: usize = 128 << 10;

/// The stream and the replies queued for it.
pub struct Outbound<W> {
    stream: Mutex<Stream<W>>,
    queued: Mutex<Vec<u8>>,
}

struct Stream<W> {
    writer: W,
    /// What the holder writes the queue from: swapped with the queue, written, emptied, so
    /// neither buffer is allocated again once both have grown.
    batch: Vec<u8>,
}

impl<W: Write> Outbound<W> {
    pub fn new(writer: W) -> Outbound<W> {
        Outbound {
            stream: Mutex::new(Stream {
                writer,
                batch: Vec::new(),
            }),
            queued: Mutex::new(Vec::new()),
        }
    }

    /// Sends one reply made of `parts` (see the module's documentation: it may be written by
    /// another thread after this returns). `writing` is told when this thread starts and stops
    /// writing to the stream (a client that stops reading leaves a writer stuck there).
    pub fn send(&self, parts: &mut [IoSlice<'_>], writing: &dyn Fn(bool)) -> io::Result<()> {
        if let Some(mut stream) = self.stream.try_lock() {
            write_reply(&mut stream.writer, parts, writing)?;
            return self.release(stream, writing);
        }
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len <= COMBINE_MAX && self.queue(parts, len) {
            return match self.stream.try_lock() {
                Some(stream) => self.release(stream, writing),
                None => Ok(()),
            };
        }
        let mut stream = self.stream.lock();
        write_reply(&mut stream.writer, parts, writing)?;
        self.release(stream, writing)
    }

    /// Copies a reply into the queue, unless that would take it past [`QUEUE_MAX`].
    fn queue(&self, parts: &[IoSlice<'_>], len: usize) -> bool {
        let mut queued = self.queued.lock();
        if queued.len() + len > QUEUE_MAX {
            return false;
        }
        if queued.capacity() < queued.len() + len {
            // Straight to the bound, not doubling past it.
            let room = QUEUE_MAX - queued.len();
            queued.reserve_exact(room);
        }
        for part in parts {
            queued.extend_from_slice(part);
        }
        true
    }

    /// Writes what was queued and lets the stream go; takes it again while more was queued
    /// meanwhile and nobody else has taken it.
    fn release<'a>(
        &'a self,
        mut stream: MutexGuard<'a, Stream<W>>,
        writing: &dyn Fn(bool),
    ) -> io::Result<()> {
        loop {
            let s = &mut *stream;
            std::mem::swap(&mut *self.queued.lock(), &mut s.batch);
            if !s.batch.is_empty() {
                let written = write_reply(&mut s.writer, &mut [IoSlice::new(&s.batch)], writing);
                s.batch.clear();
                written?;
            }
            drop(stream);
            if self.queued.lock().is_empty() {
                return Ok(());
            }
            match self.stream.try_lock() {
                Some(again) => stream = again,
                None => return Ok(()),
            }
        }
    }
}

/// Writes `bufs` whole (and flushes: a TLS stream holds back what it has not flushed).
fn write_reply<W: Write + ?Sized>(
    w: &mut W,
    bufs: &mut [IoSlice<'_>],
    writing: &dyn Fn(bool),
) -> io::Result<()> {
    writing(true);
    let written = write_all_vectored(w, bufs);
    writing(false);
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Condvar};
    use std::time::Duration;

    type Shared<T> = Arc<std::sync::Mutex<T>>;
    /// How many of the stream's stops the test has let writes pass.
    type Gate = Arc<(std::sync::Mutex<usize>, Condvar)>;

    /// A stream whose writes number `stops[k]` (counting from 0) wait until the test has opened
    /// the gate `k + 1` times; counts its writes.
    struct Gated {
        out: Shared<Vec<u8>>,
        gate: Gate,
        stops: Vec<usize>,
        writes: Arc<AtomicUsize>,
        /// Each write takes this long (widening the windows between threads).
        pause: Duration,
    }

    impl Write for Gated {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            let n = self.writes.fetch_add(1, Ordering::SeqCst);
            if let Some(k) = self.stops.iter().position(|&stop| stop == n) {
                let (opened, cv) = &*self.gate;
                let mut opened = opened.lock().unwrap();
                while *opened <= k {
                    opened = cv.wait(opened).unwrap();
                }
            }
            std::thread::sleep(self.pause);
            self.out.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn open_once(gate: &(std::sync::Mutex<usize>, Condvar)) {
        *gate.0.lock().unwrap() += 1;
        gate.1.notify_all();
    }

    /// Reply `i`: 8 bytes of header naming it, then `len - 8` bytes of it.
    fn reply(i: u8, len: usize) -> Vec<u8> {
        let mut r = vec![i; len];
        r[..8].copy_from_slice(&[0xAA, i, 0, 0, 0, 0, 0, 0xAA]);
        r
    }

    /// Splits the stream back into replies of `len` bytes each, and checks each is whole.
    fn replies_in(out: &[u8], len: usize) -> Vec<u8> {
        assert_eq!(out.len() % len, 0, "a reply is cut or interleaved");
        out.chunks(len)
            .map(|r| {
                assert!(r == reply(r[1], len), "reply {} is not whole", r[1]);
                r[1]
            })
            .collect()
    }

    /// A stream that stops at the writes numbered in `stops`, and the handles to watch it.
    fn gated(stops: &[usize]) -> (Outbound<Gated>, Shared<Vec<u8>>, Gate, Arc<AtomicUsize>) {
        let out = Arc::new(std::sync::Mutex::new(Vec::new()));
        let gate = Arc::new((std::sync::Mutex::new(0), Condvar::new()));
        let writes = Arc::new(AtomicUsize::new(0));
        let stream = Gated {
            out: out.clone(),
            gate: gate.clone(),
            stops: stops.to_vec(),
            writes: writes.clone(),
            pause: Duration::ZERO,
        };
        (Outbound::new(stream), out, gate, writes)
    }

    /// Opens every stop when dropped: also when an assertion fails, so that the threads stuck
    /// behind one end and the test fails instead of hanging.
    struct OpenOnDrop<'a>(&'a (std::sync::Mutex<usize>, Condvar));

    impl Drop for OpenOnDrop<'_> {
        fn drop(&mut self) {
            *self.0 .0.lock().unwrap() = usize::MAX;
            self.0 .1.notify_all();
        }
    }

    /// Waits until the stream has started `n` writes.
    fn started(writes: &AtomicUsize, n: usize) {
        let deadline = std::time::Instant::now() + WAIT;
        while writes.load(Ordering::SeqCst) < n {
            assert!(
                std::time::Instant::now() < deadline,
                "write {n} never started"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Sends `r` (as a 16-byte header and the rest) from a new thread of `s`; the receiver gets
    /// whether it was sent, once `send` returns.
    fn send_from<'s>(
        s: &'s std::thread::Scope<'s, '_>,
        ob: &'s Outbound<Gated>,
        r: Vec<u8>,
    ) -> std::sync::mpsc::Receiver<bool> {
        let (tx, rx) = std::sync::mpsc::channel();
        s.spawn(move || {
            let noop = |_: bool| {};
            let sent = ob.send(&mut [IoSlice::new(&r[..16]), IoSlice::new(&r[16..])], &noop);
            let _ = tx.send(sent.is_ok());
        });
        rx
    }

    const WAIT: Duration = Duration::from_secs(5);

    /// While one reply's write is stuck, small replies from other threads are queued (their
    /// threads return at once), and go out whole, all of them, in one more write.
    #[test]
    fn replies_sent_while_the_stream_is_busy_are_queued_and_written_together() {
        let (ob, out, gate, writes) = gated(&[0]);
        std::thread::scope(|s| {
            let open = OpenOnDrop(&gate);
            let first = send_from(s, &ob, reply(0, 4104));
            started(&writes, 1);
            // The stream is stuck in the first write: these return without waiting for it.
            for i in 1..=20u8 {
                let sent = send_from(s, &ob, reply(i, 4104));
                assert_eq!(
                    sent.recv_timeout(WAIT),
                    Ok(true),
                    "reply {i} waited for the busy stream"
                );
            }
            drop(open);
            assert_eq!(first.recv_timeout(WAIT), Ok(true));
        });
        let mut got = replies_in(&out.lock().unwrap(), 4104);
        got.sort_unstable();
        assert_eq!(got, (0..=20).collect::<Vec<u8>>());
        // The first reply's own write (a vectored write of its two parts may take two calls of
        // this stream's plain `write`), then the queue in one.
        assert!(
            writes.load(Ordering::SeqCst) <= 3,
            "{} writes",
            writes.load(Ordering::SeqCst)
        );
    }

    /// The queue is bounded: once it holds [`QUEUE_MAX`], a further reply waits for the stream
    /// instead of growing it, and a reply larger than [`COMBINE_MAX`] always waits.
    #[test]
    fn the_queue_is_bounded_and_large_replies_wait() {
        let (ob, out, gate, writes) = gated(&[0]);
        let len = COMBINE_MAX;
        let fits = QUEUE_MAX / len;
        std::thread::scope(|s| {
            let open = OpenOnDrop(&gate);
            let first = send_from(s, &ob, reply(0, 64));
            started(&writes, 1);
            for i in 1..=fits as u8 {
                let sent = send_from(s, &ob, reply(i, len));
                assert_eq!(
                    sent.recv_timeout(WAIT),
                    Ok(true),
                    "reply {i} was not queued"
                );
            }
            let over_the_bound = send_from(s, &ob, reply(100, len));
            let too_large = send_from(s, &ob, reply(101, COMBINE_MAX + 1));
            std::thread::sleep(Duration::from_millis(100));
            assert!(
                over_the_bound.try_recv().is_err(),
                "the queue grew past its bound"
            );
            assert!(
                too_large.try_recv().is_err(),
                "a large reply was copied into the queue"
            );
            assert_eq!(ob.queued.lock().len(), fits * len);
            drop(open);
            assert_eq!(first.recv_timeout(WAIT), Ok(true));
            assert_eq!(over_the_bound.recv_timeout(WAIT), Ok(true));
            assert_eq!(too_large.recv_timeout(WAIT), Ok(true));
        });
        let out = out.lock().unwrap();
        assert_eq!(out.len(), 64 + (fits + 1) * len + COMBINE_MAX + 1);
        assert!(ob.queued.lock().is_empty());
    }

    /// The bound holds for the memory, not only the bytes: filled with 4 KiB replies (whose
    /// doubling capacity would pass it), neither the queue nor the batch written from it holds
    /// more than [`QUEUE_MAX`].
    #[test]
    fn the_queue_and_its_batch_stay_within_the_bound_capacity_included() {
        let (ob, out, gate, writes) = gated(&[0]);
        let n = (QUEUE_MAX / 4104) as u8;
        std::thread::scope(|s| {
            let open = OpenOnDrop(&gate);
            let first = send_from(s, &ob, reply(0, 4104));
            started(&writes, 1);
            for i in 1..=n {
                assert_eq!(
                    send_from(s, &ob, reply(i, 4104)).recv_timeout(WAIT),
                    Ok(true)
                );
            }
            assert_eq!(ob.queued.lock().len(), n as usize * 4104);
            assert!(
                ob.queued.lock().capacity() <= QUEUE_MAX,
                "the queue grew past its bound"
            );
            drop(open);
            assert_eq!(first.recv_timeout(WAIT), Ok(true));
        });
        assert!(ob.stream.lock().batch.capacity() <= QUEUE_MAX);
        assert_eq!(replies_in(&out.lock().unwrap(), 4104).len(), n as usize + 1);
    }

    /// A reply queued while the holder writes the queue (after it took what was queued) is
    /// written before the holder's `send` returns: the holder looks at the queue again after
    /// letting the stream go. Left there, it would wait for the connection's next reply, and a
    /// client waiting for it with nothing else in flight would wait forever.
    #[test]
    fn a_reply_queued_while_the_queue_is_written_is_not_left_behind() {
        // Stops: the first reply's header (write 0), then the queue's write (write 2, after the
        // first reply's payload).
        let (ob, out, gate, writes) = gated(&[0, 2]);
        std::thread::scope(|s| {
            let _open = OpenOnDrop(&gate);
            let first = send_from(s, &ob, reply(0, 4104));
            started(&writes, 1);
            assert_eq!(
                send_from(s, &ob, reply(1, 4104)).recv_timeout(WAIT),
                Ok(true)
            );
            open_once(&gate);
            // The holder now writes the queue (reply 1) and stops there; reply 2 is queued
            // behind that write.
            started(&writes, 3);
            assert_eq!(
                send_from(s, &ob, reply(2, 4104)).recv_timeout(WAIT),
                Ok(true)
            );
            open_once(&gate);
            assert_eq!(first.recv_timeout(WAIT), Ok(true));
            let mut got = replies_in(&out.lock().unwrap(), 4104);
            got.sort_unstable();
            assert_eq!(got, vec![0, 1, 2], "a queued reply was left behind");
        });
    }

    /// Many threads sending at once, over a stream slow enough that replies are often queued
    /// while the holder writes: every reply arrives exactly once and whole, and none is left in
    /// the queue when the senders stop (in each of 30 rounds: a reply queued just as the holder
    /// lets go must be written by someone).
    #[test]
    fn concurrent_replies_all_arrive_whole_and_none_is_left_queued() {
        for round in 0..30 {
            let out = Arc::new(std::sync::Mutex::new(Vec::new()));
            let ob = Outbound::new(Gated {
                out: out.clone(),
                gate: Arc::new((std::sync::Mutex::new(0), Condvar::new())),
                stops: Vec::new(),
                writes: Arc::new(AtomicUsize::new(0)),
                pause: Duration::from_micros(50),
            });
            let noop = |_: bool| {};
            std::thread::scope(|s| {
                for t in 0..8u8 {
                    let ob = &ob;
                    s.spawn(move || {
                        for k in 0..25u8 {
                            let r = reply(t * 25 + k, 4104);
                            ob.send(&mut [IoSlice::new(&r[..16]), IoSlice::new(&r[16..])], &noop)
                                .unwrap();
                        }
                    });
                }
            });
            let mut got = replies_in(&out.lock().unwrap(), 4104);
            got.sort_unstable();
            assert_eq!(got, (0..200).collect::<Vec<u8>>(), "round {round}");
        }
    }
}
