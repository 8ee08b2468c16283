//! [`Acceptor`]: the accept loop both listeners share (control socket, metrics): one thread
//! accepting, one thread per connection up to a limit, and a stop that wakes a blocked
//! `accept(2)` by shutting the listening socket down (Linux returns EINVAL to it), so no
//! polling and no self-connect that a removed socket file would break.
//!
//! When every slot is taken, the listener may make room: `evict` asks one connection to go
//! (the control socket closes its longest-idle client), and the new one waits briefly for its
//! thread to end. Threads stay bounded by the limit either way.

use std::io;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// How long a new connection waits for the slot an eviction frees.
const EVICT_WAIT: Duration = Duration::from_secs(2);

/// A listening socket.
pub(crate) trait Listen: AsFd + Send + Sync + 'static {
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

/// What answers one connection, on its own thread. Dropped without running if the thread cannot
/// start.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

pub(crate) struct Acceptor {
    /// A duplicate of the listener's descriptor, to shut the listening socket down with (the
    /// listener itself belongs to the accept thread).
    fd: OwnedFd,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Acceptor {
    /// Accepts on `listener` in a thread named `name`. `serve` takes each connection on the
    /// accept thread (quickly: it may register it) and returns the work that answers it, which
    /// runs on a thread of its own. With `max` connections served, `evict` is asked to make one
    /// leave (it returns whether it did) and the new connection waits for a slot; if none
    /// frees, `refuse` gets it instead (on the accept thread: it must be quick).
    pub(crate) fn start<L: Listen>(
        listener: L,
        name: &str,
        max: usize,
        serve: impl Fn(L::Stream) -> Job + Send + 'static,
        refuse: impl Fn(L::Stream) + Send + 'static,
        evict: impl Fn() -> bool + Send + 'static,
    ) -> io::Result<Acceptor> {
        let fd = listener.as_fd().try_clone_to_owned()?;
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = stopping.clone();
        let conn_name = format!("{name}-conn");
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let slots = Arc::new(Slots::default());
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
                    if !slots.take(max, &evict) {
                        refuse(stream);
                        continue;
                    }
                    let job = serve(stream);
                    let slots2 = slots.clone();
                    let spawned =
                        std::thread::Builder::new()
                            .name(conn_name.clone())
                            .spawn(move || {
                                job();
                                slots2.give_back();
                            });
                    if let Err(e) = spawned {
                        tracing::warn!("{conn_name}: cannot start a thread: {e}");
                        slots.give_back();
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
            // Shutting the socket down (through our duplicate descriptor) wakes accept(2).
            let _ = flashtier_io::sys::shutdown(self.fd.as_fd(), Shutdown::Both);
            let _ = thread.join();
        }
    }
}

/// Connections being served.
#[derive(Default)]
struct Slots {
    busy: Mutex<usize>,
    freed: Condvar,
}

impl Slots {
    /// Takes a slot, evicting a connection to make room if all `max` are taken (or waiting for
    /// one executing a request to finish, when none can be evicted); false if none came free.
    fn take(&self, max: usize, evict: &impl Fn() -> bool) -> bool {
        let mut busy = self.busy.lock();
        if *busy >= max {
            parking_lot::MutexGuard::unlocked(&mut busy, evict);
            let deadline = Instant::now() + EVICT_WAIT;
            while *busy >= max {
                if self.freed.wait_until(&mut busy, deadline).timed_out() {
                    break;
                }
            }
            if *busy >= max {
                return false;
            }
        }
        *busy += 1;
        true
    }

    fn give_back(&self) {
        *self.busy.lock() -= 1;
        self.freed.notify_all();
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop();
    }
}
