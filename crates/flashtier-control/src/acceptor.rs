//! [`Acceptor`]: the accept loop both listeners share (control socket, metrics): one thread
//! accepting, one thread per connection up to a limit, and a stop that wakes a blocked
//! `accept(2)` by shutting the listening socket down (Linux returns EINVAL to it), so no
//! polling and no self-connect that a removed socket file would break.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// A listening socket.
pub(crate) trait Listen: AsRawFd + Send + Sync + 'static {
    type Stream: Send + 'static;
    fn accept_one(&self) -> io::Result<Self::Stream>;
}

impl Listen for UnixListener {
    type Stream = UnixStream;
    fn accept_one(&self) -> io::Result<UnixStream> {
        self.accept().map(|(s, _)| s)
    }
}

impl Listen for TcpListener {
    type Stream = TcpStream;
    fn accept_one(&self) -> io::Result<TcpStream> {
        self.accept().map(|(s, _)| s)
    }
}

pub(crate) struct Acceptor {
    fd: i32,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Acceptor {
    /// Accepts on `listener` in a thread named `name`; each connection runs `serve` on a thread
    /// of its own. Beyond `max` at once, `refuse` gets the connection instead (on the accept
    /// thread: it must be quick).
    pub(crate) fn start<L: Listen>(
        listener: L,
        name: &str,
        max: usize,
        serve: impl Fn(L::Stream) + Send + Sync + 'static,
        refuse: impl Fn(L::Stream) + Send + 'static,
    ) -> io::Result<Acceptor> {
        let fd = listener.as_raw_fd();
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = stopping.clone();
        let serve = Arc::new(serve);
        let conn_name = format!("{name}-conn");
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let busy = Arc::new(AtomicUsize::new(0));
                loop {
                    let accepted = listener.accept_one();
                    if stop.load(Ordering::SeqCst) {
                        return; // drops (closes) the listener
                    }
                    let stream = match accepted {
                        Ok(s) => s,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            tracing::warn!("{conn_name}: accept failed: {e}");
                            // EMFILE and friends: back off instead of spinning.
                            std::thread::sleep(Duration::from_millis(100));
                            continue;
                        }
                    };
                    if busy.fetch_add(1, Ordering::SeqCst) >= max {
                        busy.fetch_sub(1, Ordering::SeqCst);
                        refuse(stream);
                        continue;
                    }
                    let (busy2, serve) = (busy.clone(), serve.clone());
                    let spawned =
                        std::thread::Builder::new()
                            .name(conn_name.clone())
                            .spawn(move || {
                                serve(stream);
                                busy2.fetch_sub(1, Ordering::SeqCst);
                            });
                    if let Err(e) = spawned {
                        tracing::warn!("{conn_name}: cannot start a thread: {e}");
                        busy.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            })?;
        Ok(Acceptor {
            fd,
            stopping,
            thread: Some(thread),
        })
    }

    /// Stops accepting and closes the listener; connections being served run on.
    pub(crate) fn stop(&mut self) {
        if let Some(thread) = self.thread.take() {
            self.stopping.store(true, Ordering::SeqCst);
            // SAFETY: the accept thread owns the listener and is still running (not joined), so
            // the fd is open; shutdown only changes the socket's state and wakes accept(2).
            unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
            let _ = thread.join();
        }
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop();
    }
}
