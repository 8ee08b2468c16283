//! A read-only NBD server in one thread around one io_uring: a measurement of what a reactor per
//! connection would give flashtier's read hits on this machine (issue 11 item 5), not a product.
//!
//! `reactor_probe FILE SOCKET`: serves FILE (opened O_DIRECT) read-only over a unix socket, one
//! connection at a time. The loop keeps one RECV of the socket and every READ of the file in the
//! ring, waits in one `io_uring_enter` for whichever completes first, and sends what completed in
//! one `writev`. No thread hand-offs, no sleeps but that one wait.

use std::alloc::{alloc_zeroed, Layout};
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::{UnixListener, UnixStream};

use io_uring::{opcode, types, IoUring};

const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = 0x8000_0001;
const CMD_READ: u16 = 0;
const CMD_DISC: u16 = 2;
const FLAG_HAS_FLAGS: u16 = 1;
const FLAG_READ_ONLY: u16 = 2;
const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;

const SLOTS: usize = 128;
const MAX_READ: usize = 128 << 10;
const RECV: u64 = u64::MAX;
const INBUF: usize = 64 << 10;

fn main() -> io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        eprintln!("usage: reactor_probe FILE SOCKET");
        std::process::exit(2);
    }
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&args[1])?;
    let size = file.metadata()?.len();
    let _ = std::fs::remove_file(&args[2]);
    let listener = UnixListener::bind(&args[2])?;
    // The read buffers, allocated once and reused by every connection.
    let layout = Layout::from_size_align(MAX_READ, 4096).unwrap();
    let bufs: Vec<*mut u8> = (0..SLOTS)
        .map(|_| unsafe { alloc_zeroed(layout) })
        .collect();
    loop {
        let (mut s, _) = listener.accept()?;
        match handshake(&mut s, size) {
            Ok(true) => {
                if let Err(e) = transmission(&mut s, &file, &bufs) {
                    eprintln!("connection: {e}");
                }
            }
            Ok(false) => {}
            Err(e) => eprintln!("handshake: {e}"),
        }
    }
}

fn opt_reply(s: &mut UnixStream, opt: u32, kind: u32, data: &[u8]) -> io::Result<()> {
    let mut m = Vec::with_capacity(20 + data.len());
    m.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    m.extend_from_slice(&opt.to_be_bytes());
    m.extend_from_slice(&kind.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    s.write_all(&m)
}

/// Fixed newstyle; true when the client went to transmission.
fn handshake(s: &mut UnixStream, size: u64) -> io::Result<bool> {
    let mut hello = Vec::new();
    hello.extend_from_slice(b"NBDMAGIC");
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&3u16.to_be_bytes()); // FIXED_NEWSTYLE | NO_ZEROES
    s.write_all(&hello)?;
    let mut b4 = [0u8; 4];
    s.read_exact(&mut b4)?;
    let no_zeroes = u32::from_be_bytes(b4) & 2 != 0;
    let tflags = FLAG_HAS_FLAGS | FLAG_READ_ONLY | FLAG_CAN_MULTI_CONN;
    loop {
        let mut h = [0u8; 16];
        s.read_exact(&mut h)?;
        let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
        let len = u32::from_be_bytes(h[12..16].try_into().unwrap()) as usize;
        let mut data = vec![0u8; len];
        s.read_exact(&mut data)?;
        match opt {
            OPT_GO | OPT_INFO => {
                let mut info = Vec::new();
                info.extend_from_slice(&0u16.to_be_bytes());
                info.extend_from_slice(&size.to_be_bytes());
                info.extend_from_slice(&tflags.to_be_bytes());
                opt_reply(s, opt, REP_INFO, &info)?;
                opt_reply(s, opt, REP_ACK, &[])?;
                if opt == OPT_GO {
                    return Ok(true);
                }
            }
            OPT_EXPORT_NAME => {
                let mut m = Vec::new();
                m.extend_from_slice(&size.to_be_bytes());
                m.extend_from_slice(&tflags.to_be_bytes());
                if !no_zeroes {
                    m.extend_from_slice(&[0u8; 124]);
                }
                s.write_all(&m)?;
                return Ok(true);
            }
            OPT_ABORT => {
                opt_reply(s, opt, REP_ACK, &[])?;
                return Ok(false);
            }
            _ => opt_reply(s, opt, REP_ERR_UNSUP, &[])?,
        }
    }
}

struct Slot {
    buf: *mut u8,
    header: [u8; 16],
    len: usize,
}

fn transmission(s: &mut UnixStream, file: &File, bufs: &[*mut u8]) -> io::Result<()> {
    let mut inbuf = vec![0u8; INBUF];
    let mut ring = IoUring::new(2 * SLOTS as u32)?;
    let (mut in_flight, mut recv_armed) = (0usize, false);
    let result = serve(
        s,
        file,
        bufs,
        &mut inbuf,
        &mut ring,
        &mut in_flight,
        &mut recv_armed,
    );
    // The buffers go to the next connection and `inbuf` away: nothing of this one may still land
    // in them. Shutting the socket down ends a RECV still in the ring.
    let _ = s.shutdown(std::net::Shutdown::Both);
    while in_flight > 0 || recv_armed {
        ring.submit_and_wait(1)?;
        for cqe in ring.completion() {
            if cqe.user_data() == RECV {
                recv_armed = false;
            } else {
                in_flight -= 1;
            }
        }
    }
    result
}

fn serve(
    s: &mut UnixStream,
    file: &File,
    bufs: &[*mut u8],
    inbuf: &mut [u8],
    ring: &mut IoUring,
    in_flight: &mut usize,
    recv_armed: &mut bool,
) -> io::Result<()> {
    let mut slots: Vec<Slot> = bufs
        .iter()
        .map(|&buf| Slot {
            buf,
            header: [0; 16],
            len: 0,
        })
        .collect();
    let mut free: Vec<usize> = (0..SLOTS).rev().collect();
    let (mut start, mut end) = (0usize, 0usize);
    let mut disconnecting = false;
    let mut done: Vec<usize> = Vec::with_capacity(SLOTS);
    let mut errors: Vec<[u8; 16]> = Vec::new();
    let sock = s.as_raw_fd();
    let fd = file.as_raw_fd();
    loop {
        // Parse every whole request in the buffer; each READ goes to the ring.
        while end - start >= 28 && !free.is_empty() {
            let r = &inbuf[start..start + 28];
            if u32::from_be_bytes(r[0..4].try_into().unwrap()) != REQUEST_MAGIC {
                return Err(io::Error::other("bad request magic"));
            }
            let kind = u16::from_be_bytes(r[6..8].try_into().unwrap());
            let handle: [u8; 8] = r[8..16].try_into().unwrap();
            let offset = u64::from_be_bytes(r[16..24].try_into().unwrap());
            let len = u32::from_be_bytes(r[24..28].try_into().unwrap()) as usize;
            start += 28;
            let mut header = [0u8; 16];
            header[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
            header[8..16].copy_from_slice(&handle);
            match kind {
                CMD_READ if len <= MAX_READ => {
                    let i = free.pop().unwrap();
                    slots[i].header = header;
                    slots[i].len = len;
                    let sqe = opcode::Read::new(types::Fd(fd), slots[i].buf, len as u32)
                        .offset(offset)
                        .build()
                        .user_data(i as u64);
                    unsafe { ring.submission().push(&sqe).map_err(io::Error::other)? };
                    *in_flight += 1;
                }
                CMD_DISC => disconnecting = true,
                _ => {
                    header[4..8].copy_from_slice(&(libc::EINVAL as u32).to_be_bytes());
                    errors.push(header);
                }
            }
        }
        if disconnecting && *in_flight == 0 {
            return Ok(());
        }
        if !*recv_armed && !disconnecting {
            if start > 0 {
                inbuf.copy_within(start..end, 0);
                end -= start;
                start = 0;
            }
            let sqe = opcode::Recv::new(
                types::Fd(sock),
                inbuf[end..].as_mut_ptr(),
                (INBUF - end) as u32,
            )
            .build()
            .user_data(RECV);
            unsafe { ring.submission().push(&sqe).map_err(io::Error::other)? };
            *recv_armed = true;
        }
        ring.submit_and_wait(1)?;
        for cqe in ring.completion() {
            if cqe.user_data() == RECV {
                *recv_armed = false;
                match cqe.result() {
                    0 => disconnecting = true,
                    n if n < 0 => return Err(io::Error::from_raw_os_error(-n)),
                    n => end += n as usize,
                }
            } else {
                let i = cqe.user_data() as usize;
                *in_flight -= 1;
                if cqe.result() != slots[i].len as i32 {
                    let err = if cqe.result() < 0 {
                        -cqe.result()
                    } else {
                        libc::EIO
                    };
                    slots[i].header[4..8].copy_from_slice(&(err as u32).to_be_bytes());
                    slots[i].len = 0;
                }
                done.push(i);
            }
        }
        // Every reply finished in this turn, in one writev.
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(2 * done.len() + errors.len());
        for e in &errors {
            iov.push(libc::iovec {
                iov_base: e.as_ptr() as *mut _,
                iov_len: 16,
            });
        }
        for &i in &done {
            iov.push(libc::iovec {
                iov_base: slots[i].header.as_ptr() as *mut _,
                iov_len: 16,
            });
            if slots[i].len > 0 {
                iov.push(libc::iovec {
                    iov_base: slots[i].buf as *mut _,
                    iov_len: slots[i].len,
                });
            }
        }
        write_all_iov(sock, &mut iov)?;
        errors.clear();
        free.append(&mut done);
    }
}

fn write_all_iov(sock: i32, iov: &mut [libc::iovec]) -> io::Result<()> {
    let mut first = 0;
    while first < iov.len() {
        let n = unsafe {
            libc::writev(
                sock,
                iov[first..].as_ptr(),
                (iov.len() - first).min(1024) as i32,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        let mut n = n as usize;
        while first < iov.len() && n >= iov[first].iov_len {
            n -= iov[first].iov_len;
            first += 1;
        }
        if n > 0 {
            iov[first].iov_base = unsafe { (iov[first].iov_base as *mut u8).add(n) } as *mut _;
            iov[first].iov_len -= n;
        }
    }
    Ok(())
}
