//! Safe wrappers for the few system calls the engine and the control plane make beyond `std`.
//!
//! Those two crates `forbid(unsafe_code)`: whatever they need from libc that the standard library
//! does not offer goes through a function here, which takes only safe arguments (slices, borrowed
//! file descriptors) and says next to its `unsafe` block why that block is sound. Keeping them in
//! one place also means one implementation per call, shared by every crate that makes it.

use std::io;
use std::net::Shutdown;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Fills `buf` from the kernel's random source (`getrandom(2)`, the urandom pool), for identifiers
/// (a cache's UUID) and unpredictable names (temporary files). Waits only if the pool is not
/// initialised yet, early in boot.
pub fn fill_random(buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is a valid, writable buffer of `rest.len()` bytes, borrowed mutably for
        // the duration of the call; getrandom writes at most that many bytes into it.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += n as usize;
    }
    Ok(())
}

/// The process's effective user id (`geteuid(2)`): 0 means root, which decides default paths and
/// which ownership checks apply.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid takes no arguments, touches no memory of ours and cannot fail.
    unsafe { libc::geteuid() }
}

/// Shuts a socket down (`shutdown(2)`) in the direction `how`. On a listening socket this wakes a
/// thread blocked in `accept(2)` on it, which then fails; that is how a listener on another
/// thread is stopped. The socket may be reached through any descriptor of it (a duplicate will
/// do: shutdown acts on the socket, not on the descriptor).
pub fn shutdown(fd: BorrowedFd<'_>, how: Shutdown) -> io::Result<()> {
    let how = match how {
        Shutdown::Read => libc::SHUT_RD,
        Shutdown::Write => libc::SHUT_WR,
        Shutdown::Both => libc::SHUT_RDWR,
    };
    // SAFETY: `fd` is borrowed, so it is open for the duration of the call; shutdown touches no
    // memory of ours and only changes the socket's state.
    if unsafe { libc::shutdown(fd.as_raw_fd(), how) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sends `buf` on a connected socket without ever blocking (`MSG_DONTWAIT`) and without raising
/// SIGPIPE if the peer is gone (`MSG_NOSIGNAL`): for a last word to a client that may not be
/// reading. Returns how many bytes the socket took (maybe fewer than `buf.len()`), or the error
/// (`WouldBlock` when it had no room at all).
pub fn send_nonblocking(fd: BorrowedFd<'_>, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for reads of `buf.len()` bytes for the duration of the call, and
    // `fd` is borrowed, so it is open; send only reads from the buffer.
    let n = unsafe {
        libc::send(
            fd.as_raw_fd(),
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Lowers the calling thread's CPU priority to at least nice value `nice` (`setpriority(2)` on
/// the thread's id: on Linux the nice value is per thread); a thread already nicer is left as it
/// is, so this never raises a priority. For background work that must not take a CPU from client
/// I/O on a small machine but must still progress when the CPUs are busy, which a nice value
/// (unlike `SCHED_IDLE`) guarantees. Returns the nice value the thread runs at.
pub fn lower_thread_priority(nice: i32) -> io::Result<i32> {
    // SAFETY: gettid takes no arguments and cannot fail.
    let tid = unsafe { libc::gettid() } as libc::id_t;
    let now = thread_nice(tid)?;
    if now >= nice {
        return Ok(now);
    }
    // SAFETY: setpriority takes plain integers and touches no memory of ours.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(nice)
}

/// The nice value of thread `tid`. getpriority may return -1 as a value, so errors are told apart
/// by errno, cleared before the call.
fn thread_nice(tid: libc::id_t) -> io::Result<i32> {
    // SAFETY: errno is thread-local; the pointer is valid for this thread's whole life.
    unsafe { *libc::__errno_location() = 0 };
    // SAFETY: getpriority takes plain integers and touches no memory of ours.
    let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid) };
    if nice == -1 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(0) {
            return Err(e);
        }
    }
    Ok(nice)
}

/// The calling thread's nice value.
pub fn current_thread_nice() -> io::Result<i32> {
    // SAFETY: gettid takes no arguments and cannot fail.
    thread_nice(unsafe { libc::gettid() } as libc::id_t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn random_bytes_fill_the_whole_buffer() {
        // 4 KiB of zeroes from a random source would be a broken source (or a broken wrapper).
        let mut buf = vec![0u8; 4096];
        fill_random(&mut buf).unwrap();
        assert!(buf.iter().filter(|&&b| b != 0).count() > 3000);
        fill_random(&mut []).unwrap();
    }

    #[test]
    fn the_effective_uid_is_the_one_the_files_we_create_get() {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir();
        let f = tempfile::NamedTempFile::new_in(dir).unwrap();
        assert_eq!(f.as_file().metadata().unwrap().uid(), effective_uid());
    }

    #[test]
    fn a_send_that_cannot_wait_and_a_shutdown() {
        let (a, mut b) = UnixStream::pair().unwrap();
        assert_eq!(send_nonblocking(a.as_fd(), b"bye\n").unwrap(), 4);
        shutdown(a.as_fd(), Shutdown::Both).unwrap();
        let mut got = Vec::new();
        b.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"bye\n");
        let e = send_nonblocking(a.as_fd(), b"more").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPIPE));
    }

    #[test]
    fn a_lowered_priority_is_this_threads_alone_and_never_raised() {
        let ours = current_thread_nice().unwrap();
        let wanted = (ours + 3).min(19);
        let (set, theirs, again) = std::thread::spawn(move || {
            let set = lower_thread_priority(wanted).unwrap();
            // Asking for a higher priority than the thread has leaves it where it is.
            let again = lower_thread_priority(wanted - 2).unwrap();
            (set, current_thread_nice().unwrap(), again)
        })
        .join()
        .unwrap();
        assert_eq!((set, theirs, again), (wanted, wanted, wanted));
        assert_eq!(
            current_thread_nice().unwrap(),
            ours,
            "the caller's priority changed too"
        );
    }
}
