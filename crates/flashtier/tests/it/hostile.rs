//! Hostile clients: 256 sockets of each kind that tried to exhaust the server — dribbling the
//! handshake, sitting idle after it, or sending large READs and never reading the replies — while
//! a real client connects and does I/O within a second, the server's memory stays under a stated
//! bound and its threads stay few.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use flashtier_nbd::wire::{self, cmd, handshake, opt, rep, RequestHeader};

use crate::harness::{self, Server};

const ATTACKERS: usize = 256;
const SIZE: u64 = 64 << 20;
const MIB: u64 = 1 << 20;

fn serve(dir: &Path, args: &[&str]) -> Server {
    let disk = dir.join("disk.img");
    harness::sparse_file(&disk, SIZE);
    // Not the default control socket and stats file, which other tests' servers may hold.
    let control = dir.join("control.sock");
    let stats = dir.join("stats");
    let mut all = vec![
        "--control-socket",
        harness::path_str(&control),
        "--stats-file",
        harness::path_str(&stats),
    ];
    all.extend_from_slice(args);
    Server::on_socket(dir, harness::path_str(&disk), &all)
}

/// `(VmRSS bytes, threads)` of a process.
fn rss_and_threads(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
    };
    (field("VmRSS:") * 1024, field("Threads:"))
}

fn connect(socket: &Path) -> UnixStream {
    let s = UnixStream::connect(socket).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

/// Greeting, client flags, GO on the default export; leaves the socket in transmission.
fn go(s: &mut UnixStream) {
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("greeting");
    assert_eq!(&greeting[..8], b"NBDMAGIC");
    let flags = handshake::C_FIXED_NEWSTYLE | handshake::C_NO_ZEROES;
    s.write_all(&flags.to_be_bytes()).unwrap();
    let mut payload = 0u32.to_be_bytes().to_vec();
    payload.extend_from_slice(&0u16.to_be_bytes());
    let mut msg = wire::IHAVEOPT.to_be_bytes().to_vec();
    msg.extend_from_slice(&opt::GO.to_be_bytes());
    msg.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    msg.extend_from_slice(&payload);
    s.write_all(&msg).unwrap();
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).expect("GO reply");
        let ty = wire::be32(&h[12..16]);
        let mut data = vec![0u8; wire::be32(&h[16..20]) as usize];
        s.read_exact(&mut data).unwrap();
        if ty == rep::ACK {
            return;
        }
        assert!(!rep::is_error(ty), "GO refused: {ty:#x}");
    }
}

fn request(command: u16, handle: u64, offset: u64, length: u32) -> [u8; 28] {
    RequestHeader {
        flags: 0,
        cmd: command,
        handle,
        offset,
        length,
    }
    .encode()
}

/// A real client's first I/O: connect, handshake, write 4 KiB, read it back. Returns how long
/// it took.
fn real_client_io(socket: &Path) -> Duration {
    let started = Instant::now();
    let mut s = connect(socket);
    go(&mut s);
    let data = vec![0x5a; 4096];
    // The READ only after the WRITE's reply: NBD does not order requests in flight.
    let mut msg = request(cmd::WRITE, 1, 8 * MIB, 4096).to_vec();
    msg.extend_from_slice(&data);
    s.write_all(&msg).unwrap();
    let mut r = [0u8; 16];
    s.read_exact(&mut r).expect("WRITE reply");
    assert_eq!(
        (wire::be32(&r[4..8]), wire::be64(&r[8..16])),
        (0, 1),
        "WRITE failed"
    );
    s.write_all(&request(cmd::READ, 2, 8 * MIB, 4096)).unwrap();
    s.read_exact(&mut r).expect("READ reply");
    assert_eq!(
        (wire::be32(&r[4..8]), wire::be64(&r[8..16])),
        (0, 2),
        "READ failed"
    );
    let mut got = vec![0u8; 4096];
    s.read_exact(&mut got).unwrap();
    assert!(got == data, "READ returned other data than written");
    started.elapsed()
}

/// nbdinfo and qemu-io, real clients, connect and work; each within `limit`.
fn real_tools_work(uri: &str, limit: Duration) {
    harness::require("nbdinfo");
    let started = Instant::now();
    let out = harness::run_stdout(Command::new("nbdinfo").arg("--size").arg(uri));
    let took = started.elapsed();
    assert_eq!(out.trim(), SIZE.to_string());
    assert!(took < limit, "nbdinfo took {took:?}");
    let started = Instant::now();
    harness::qemu_io(
        uri,
        &["write -P 0x33 1M 64k", "read -P 0x33 1M 64k", "flush"],
    );
    let took = started.elapsed();
    assert!(took < limit, "qemu-io took {took:?}");
}

/// The real client gets in and does I/O within a second, with every slot taken by attackers.
fn assert_real_clients_get_in(fx: &Server, socket: &Path) {
    let path = socket.to_path_buf();
    let client = std::thread::spawn(move || real_client_io(&path));
    let started = Instant::now();
    while !client.is_finished() && started.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    if !client.is_finished() {
        let stacks = harness::thread_stacks(fx.pid());
        let file = socket.with_file_name("stuck-stacks.txt");
        std::fs::write(&file, &stacks).unwrap();
        panic!(
            "a real client got no answer within 5 s; server threads in {file:?}:\n{}",
            fx.log()
        );
    }
    let took = client.join().expect("real client");
    assert!(
        took < Duration::from_secs(1),
        "a real client needed {took:?} to connect and do its first I/O:\n{}",
        fx.log()
    );
    real_tools_work(&fx.uri, Duration::from_secs(3));
}

#[test]
fn handshake_dribblers_do_not_lock_real_clients_out() {
    let dir = harness::Scratch::new();
    let mut fx = serve(dir.path(), &["--handshake-timeout", "4"]);
    let socket = fx.socket().expect("unix socket");
    let started = Instant::now();
    let mut dribblers: Vec<UnixStream> = (0..ATTACKERS)
        .map(|_| {
            let mut s = connect(&socket);
            let mut greeting = [0u8; 18];
            s.read_exact(&mut greeting).unwrap();
            // The first byte of the client flags; the rest never comes in time.
            s.write_all(&[0]).unwrap();
            s
        })
        .collect();
    // Let them age past the handshake's reclaim threshold (1 s), dribbling as they go.
    std::thread::sleep(Duration::from_millis(1500));
    for s in &mut dribblers {
        let _ = s.write_all(&[0]);
    }
    assert_real_clients_get_in(&fx, &socket);

    // One deadline for the whole handshake: the dribblers still there are cut off at 4 s,
    // however often they send a byte.
    let mut cut = 0;
    for s in &mut dribblers {
        let _ = s.write_all(&[0]);
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 1];
        // EOF or a reset: either way the server closed it.
        if !matches!(s.read(&mut b), Ok(n) if n > 0) {
            cut += 1;
        }
    }
    let took = started.elapsed();
    assert_eq!(cut, ATTACKERS, "every dribbler must be cut off");
    assert!(
        took < Duration::from_secs(10),
        "dribblers were cut off only after {took:?} (deadline 4 s)"
    );
    assert!(fx.is_running());
    fx.stop();
}

#[test]
fn idle_connections_after_the_handshake_do_not_lock_real_clients_out() {
    let dir = harness::Scratch::new();
    let fx = serve(dir.path(), &[]);
    let socket = fx.socket().expect("unix socket");
    let idle: Vec<UnixStream> = (0..ATTACKERS)
        .map(|_| {
            let mut s = connect(&socket);
            go(&mut s);
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    let (rss, threads) = rss_and_threads(fx.pid());
    // One thread per connection, plus the server's own few.
    assert!(
        threads <= ATTACKERS as u64 + 32,
        "{threads} threads for {ATTACKERS} idle connections"
    );
    eprintln!(
        "{ATTACKERS} idle connections: {threads} threads, RSS {} MiB",
        rss >> 20
    );
    assert_real_clients_get_in(&fx, &socket);
    drop(idle);
    fx.stop();
}

#[test]
fn clients_that_never_read_replies_cannot_exhaust_memory() {
    // The bound the server enforces with its defaults (ARCHITECTURE.md, "Memory and thread
    // bound"): 1 GiB of request memory charged server-wide, 256 KiB kept per thread for small
    // requests and 112 KiB for a batch of small READs × (256 connections + 512 pooled threads),
    // a 256 KiB read buffer per connection; beyond what it held before any client. Threads: one
    // per connection + the pool + its own.
    const BEYOND_IDLE: u64 = (1 << 30) + 768 * ((256 << 10) + (112 << 10)) + 256 * (256 << 10);
    let dir = harness::Scratch::new();
    let fx = serve(dir.path(), &[]);
    let socket = fx.socket().expect("unix socket");
    std::thread::sleep(Duration::from_millis(300));
    let (idle_rss, idle_threads) = rss_and_threads(fx.pid());
    let bound = idle_rss + BEYOND_IDLE;
    let hostile: Vec<UnixStream> = (0..ATTACKERS)
        .map(|i| {
            let mut s = connect(&socket);
            go(&mut s);
            // 16 READs of 32 MiB, never read: 512 MiB of replies per connection if the server
            // took them all.
            let burst: Vec<u8> = (0..16u64)
                .flat_map(|h| request(cmd::READ, h, (i as u64 % 2) * 32 * MIB, 32 << 20))
                .collect();
            s.write_all(&burst).unwrap();
            s
        })
        .collect();
    // Watch memory while the server reads what it is willing to.
    let mut peak = (0, 0);
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        let (rss, threads) = rss_and_threads(fx.pid());
        peak = (peak.0.max(rss), peak.1.max(threads));
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "{ATTACKERS} clients not reading 32 MiB replies: peak RSS {} MiB, peak {} threads",
        peak.0 >> 20,
        peak.1
    );
    assert!(
        peak.0 <= bound,
        "server RSS reached {} MiB (bound {} MiB)",
        peak.0 >> 20,
        bound >> 20
    );
    // Each connection's own thread, the shared worker pool (512) and the server's own; +4: the
    // real clients take reclaimed connections' slots, whose threads may still be finishing.
    let threads_bound = idle_threads + ATTACKERS as u64 + 4 + 512;
    assert!(peak.1 <= threads_bound, "{} threads", peak.1);
    assert_real_clients_get_in(&fx, &socket);
    let (rss, threads) = rss_and_threads(fx.pid());
    assert!(rss <= bound, "RSS {} MiB after the real clients", rss >> 20);
    assert!(
        threads <= threads_bound,
        "{threads} threads after the real clients"
    );
    drop(hostile);
}

/// Threads come with load and go with it: a burst of pipelined requests on one connection grows
/// its threads, and once it has been idle for 5 s they exit, down to the connection's own.
#[test]
fn extra_threads_retire_when_a_connection_goes_idle() {
    let dir = harness::Scratch::new();
    let fx = serve(dir.path(), &[]);
    let socket = fx.socket().expect("unix socket");
    let mut s = connect(&socket);
    go(&mut s);
    std::thread::sleep(Duration::from_millis(300));
    let (_, idle_threads) = rss_and_threads(fx.pid());
    // 64 pipelined 1 MiB READs, answered while we read them: threads grow to serve them.
    let burst: Vec<u8> = (0..64u64)
        .flat_map(|h| request(cmd::READ, h, (h % 32) * MIB, MIB as u32))
        .collect();
    let mut peak = idle_threads;
    let reader = {
        let mut s = s.try_clone().unwrap();
        std::thread::spawn(move || {
            for _ in 0..64 {
                let mut r = [0u8; 16];
                s.read_exact(&mut r).expect("reply");
                assert_eq!(wire::be32(&r[4..8]), 0);
                let mut data = vec![0u8; MIB as usize];
                s.read_exact(&mut data).unwrap();
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    s.write_all(&burst).unwrap();
    while !reader.is_finished() {
        peak = peak.max(rss_and_threads(fx.pid()).1);
        std::thread::sleep(Duration::from_millis(5));
    }
    reader.join().unwrap();
    assert!(
        peak >= idle_threads + 4,
        "threads did not grow under load: {idle_threads} idle, {peak} at peak"
    );
    let mut now = peak;
    harness::wait_until(Duration::from_secs(20), "extra threads to retire", || {
        now = rss_and_threads(fx.pid()).1;
        now <= idle_threads
    });
    eprintln!("threads: {idle_threads} idle, {peak} under load, {now} after 5 s idle");
    // The connection still works on its own thread.
    assert!(real_client_io(&socket) < Duration::from_secs(1));
    drop(s);
}
