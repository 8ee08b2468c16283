//! One deadline for a whole handshake, not one timeout per read.
//!
//! A per-read timeout lets a client that sends one byte every few seconds hold a connection
//! forever. [`DeadlineStream`] sets the socket's timeouts to what is left of the deadline before
//! every read and write, so the handshake as a whole ends when the deadline passes.

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use crate::net::Stream;

/// A stream whose reads and writes fail with `TimedOut` once `deadline` has passed.
pub struct DeadlineStream<'a> {
    stream: &'a Stream,
    deadline: Instant,
}

impl<'a> DeadlineStream<'a> {
    pub fn new(stream: &'a Stream, deadline: Instant) -> DeadlineStream<'a> {
        DeadlineStream { stream, deadline }
    }

    pub fn stream(&self) -> &'a Stream {
        self.stream
    }

    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// What is left of the deadline, or `TimedOut` if nothing is.
    pub fn remaining(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        // A zero socket timeout means "wait forever": never ask for less than a millisecond.
        Ok(left.max(Duration::from_millis(1)))
    }

    /// Clears the timeouts: the handshake is over.
    pub fn finish(self) -> io::Result<()> {
        self.stream.set_read_timeout(None)?;
        self.stream.set_write_timeout(None)
    }
}

fn timed_out() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "the client did not finish the handshake in time",
    )
}

/// Socket timeouts surface as `WouldBlock` (EAGAIN); report them as the deadline passing.
fn deadline_error(e: io::Error) -> io::Error {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => timed_out(),
        _ => e,
    }
}

impl Read for DeadlineStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.remaining()?))?;
        let mut s = self.stream;
        s.read(buf).map_err(deadline_error)
    }
}

impl Write for DeadlineStream<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.remaining()?))?;
        let mut s = self.stream;
        s.write(buf).map_err(deadline_error)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_dribbling_peer_cannot_outlast_the_deadline() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let server = Stream::Unix(a);
        let writer = std::thread::spawn(move || {
            // One byte every 100 ms, forever (until the server hangs up).
            while b.write_all(&[1]).is_ok() {
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let started = Instant::now();
        let mut d = DeadlineStream::new(&server, started + Duration::from_millis(500));
        let mut buf = [0u8; 1000];
        let err = d.read_exact(&mut buf).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(500) && took < Duration::from_secs(2),
            "{took:?}"
        );
        server.shutdown(std::net::Shutdown::Both).unwrap();
        writer.join().unwrap();
    }
}
