//! Writes the seed corpus, `fuzz/corpus/<target>/seed-*`, and runs every seed through its harness
//! to check it goes where it is meant to (a seed that stops early seeds nothing useful):
//!
//!     cargo run --manifest-path fuzz/Cargo.toml --example gen_seeds
//!
//! Seeds are named descriptively; the hash-named files the fuzzer adds are ignored by git.

use std::fs;
use std::path::Path;

use flashtier_fuzz::client::{client_flags, info_payload, meta_payload, option, request, write};
use flashtier_fuzz::handshake::{self, Ended};
use flashtier_fuzz::transmission::{self, MAX_PAYLOAD_SMALL};
use flashtier_fuzz::{quirky, request_header, DEV_SIZE};
use flashtier_nbd::wire::{cmd, cmd_flag, errno, handshake as hflag, info, opt, BASE_ALLOCATION};

const FIXED_NZ: u32 = hflag::C_FIXED_NEWSTYLE | hflag::C_NO_ZEROES;
const DEV: u64 = DEV_SIZE as u64;

fn cat(parts: &[Vec<u8>]) -> Vec<u8> {
    parts.concat()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn go(name: &str, items: &[u16]) -> Vec<u8> {
    option(opt::GO, &info_payload(name, items))
}

fn disc(handle: u64) -> Vec<u8> {
    request(0, cmd::DISC, handle, 0, 0)
}

/// A short request stream to follow a successful handshake.
fn after_handshake() -> Vec<u8> {
    cat(&[
        write(0, 1, 0, &pattern(512, 1)),
        request(0, cmd::READ, 2, 0, 512),
        request(0, cmd::FLUSH, 3, 0, 0),
        disc(4),
    ])
}

struct Writer {
    dir: std::path::PathBuf,
    count: usize,
}

impl Writer {
    fn new(root: &Path, target: &str) -> Writer {
        let dir = root.join(target);
        fs::create_dir_all(&dir).unwrap();
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let stale = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("seed-"));
            if stale {
                fs::remove_file(path).unwrap();
            }
        }
        Writer { dir, count: 0 }
    }

    fn seed(&mut self, name: &str, data: &[u8]) {
        fs::write(self.dir.join(format!("seed-{name}")), data).unwrap();
        self.count += 1;
    }
}

fn handshake_seeds(root: &Path) -> usize {
    let mut w = Writer::new(root, "handshake");
    let mut seed = |name: &str, data: Vec<u8>, check: &dyn Fn(Ended) -> bool| {
        let ended = handshake::run(&data);
        assert!(check(ended), "handshake seed {name} ended {ended:?}");
        w.seed(name, &data);
    };
    let transmission = |e: Ended| matches!(e, Ended::Transmission(_));
    let plain = |e: Ended| matches!(e, Ended::Transmission(s) if !s.structured_replies && s.base_allocation.is_none());
    let with_context = |e: Ended| matches!(e, Ended::Transmission(s) if s.structured_replies && s.base_allocation.is_some());
    let closed = |e: Ended| e == Ended::Closed;

    seed(
        "go-read",
        cat(&[
            client_flags(FIXED_NZ),
            go("disk", &[info::BLOCK_SIZE]),
            after_handshake(),
        ]),
        &plain,
    );
    seed(
        "go-default-name-all-info",
        cat(&[
            client_flags(FIXED_NZ),
            go("", &[info::NAME, info::DESCRIPTION, info::BLOCK_SIZE, 77]),
            after_handshake(),
        ]),
        &plain,
    );
    seed(
        "structured-meta-go",
        cat(&[
            client_flags(FIXED_NZ),
            option(opt::STRUCTURED_REPLY, &[]),
            option(
                opt::SET_META_CONTEXT,
                &meta_payload("disk", &[BASE_ALLOCATION]),
            ),
            go("disk", &[info::BLOCK_SIZE]),
            request(cmd_flag::REQ_ONE, cmd::BLOCK_STATUS, 1, 0, 65536),
            request(cmd_flag::DF, cmd::READ, 2, 4096, 4096),
            disc(3),
        ]),
        &with_context,
    );
    seed(
        "list-meta-context",
        cat(&[
            client_flags(FIXED_NZ),
            option(opt::STRUCTURED_REPLY, &[]),
            option(opt::LIST_META_CONTEXT, &meta_payload("", &[])),
            option(opt::LIST_META_CONTEXT, &meta_payload("disk", &["base:"])),
            option(
                opt::SET_META_CONTEXT,
                &meta_payload("disk", &["qemu:dirty-bitmap:x", BASE_ALLOCATION]),
            ),
            go("", &[]),
            disc(1),
        ]),
        &with_context,
    );
    seed(
        "list-info-go",
        cat(&[
            client_flags(FIXED_NZ),
            option(opt::LIST, &[]),
            option(
                opt::INFO,
                &info_payload("disk", &[info::NAME, info::BLOCK_SIZE]),
            ),
            go("disk", &[]),
            after_handshake(),
        ]),
        &plain,
    );
    seed(
        "abort",
        cat(&[
            client_flags(FIXED_NZ),
            option(opt::LIST, &[]),
            option(opt::ABORT, &[]),
        ]),
        &closed,
    );
    seed(
        "export-name-zeroes",
        cat(&[
            client_flags(hflag::C_FIXED_NEWSTYLE),
            option(opt::EXPORT_NAME, b"disk"),
            after_handshake(),
        ]),
        &plain,
    );
    seed(
        "export-name-no-zeroes",
        cat(&[
            client_flags(FIXED_NZ),
            option(opt::STRUCTURED_REPLY, &[]),
            option(opt::EXPORT_NAME, b""),
            after_handshake(),
        ]),
        &transmission,
    );
    seed(
        "export-name-unknown",
        cat(&[client_flags(FIXED_NZ), option(opt::EXPORT_NAME, b"nope")]),
        &closed,
    );
    seed(
        "refused-options-then-go",
        cat(&[
            client_flags(FIXED_NZ),
            option(opt::STARTTLS, &[]),
            option(opt::EXTENDED_HEADERS, &[]),
            option(42, b"whatever"),
            option(opt::STRUCTURED_REPLY, b"x"),
            option(opt::LIST, b"x"),
            option(opt::GO, &[0, 0, 0, 4, b'd']),
            go("other", &[]),
            option(
                opt::SET_META_CONTEXT,
                &meta_payload("disk", &[BASE_ALLOCATION]),
            ),
            option(opt::INFO, &info_payload("disk", &[info::BLOCK_SIZE])[..7]),
            go("disk", &[info::BLOCK_SIZE]),
            after_handshake(),
        ]),
        &plain,
    );
    seed(
        "too-big-then-go",
        cat(&[
            client_flags(FIXED_NZ),
            option(99, &vec![0x5a; 64 * 1024 + 1]),
            go("disk", &[info::BLOCK_SIZE]),
            disc(1),
        ]),
        &plain,
    );
    seed(
        "bad-client-flags",
        cat(&[client_flags(1 << 5), go("disk", &[])]),
        &|e| e == Ended::Error,
    );
    w.count
}

fn transmission_seeds(root: &Path) -> usize {
    let mut w = Writer::new(root, "transmission");
    type Want = Vec<(u16, Result<(), u32>)>;
    let mut seed = |name: &str, config: u8, stream: Vec<u8>, want: Want| {
        let mut data = vec![config];
        data.extend_from_slice(&stream);
        let answers = transmission::run(&data);
        assert_eq!(answers, want, "transmission seed {name}");
        w.seed(name, &data);
    };
    const STRUCTURED: u8 = 1;
    const CONTEXT: u8 = 2;
    const FORCE_RO: u8 = 4;
    const DEV_RO: u8 = 8;
    const SMALL_PAYLOAD: u8 = 16;
    const SHORT_WRITES: u8 = 32;
    const BROKEN_WRITER: u8 = 64;
    const QUIRKY: u8 = 128;
    use cmd::*;
    let ok = Ok(());

    seed(
        "simple-all-commands",
        0,
        cat(&[
            write(0, 1, 0, &pattern(4096, 7)),
            request(0, READ, 2, 0, 4096),
            write(cmd_flag::FUA, 3, 8192, &pattern(100, 9)),
            request(0, FLUSH, 4, 0, 0),
            request(0, TRIM, 5, 0, 1024),
            request(cmd_flag::NO_HOLE, WRITE_ZEROES, 6, 2048, 1024),
            request(cmd_flag::FUA, CACHE, 7, 0, 1 << 20),
            request(0, READ, 8, 0, 8192 + 100),
            request(cmd_flag::FUA, TRIM, 9, DEV - 512, 512),
            disc(10),
        ]),
        vec![
            (WRITE, ok),
            (READ, ok),
            (WRITE, ok),
            (FLUSH, ok),
            (TRIM, ok),
            (WRITE_ZEROES, ok),
            (CACHE, ok),
            (READ, ok),
            (TRIM, ok),
        ],
    );
    seed(
        "structured-block-status",
        STRUCTURED | CONTEXT,
        cat(&[
            write(cmd_flag::FUA, 1, 4096, &pattern(4096, 3)),
            request(cmd_flag::DF, READ, 2, 4096, 4096),
            request(0, READ, 3, 0, 0),
            request(cmd_flag::REQ_ONE, BLOCK_STATUS, 4, 0, 65536),
            request(0, BLOCK_STATUS, 5, 4096, 1 << 19),
            request(
                cmd_flag::FAST_ZERO | cmd_flag::FUA,
                WRITE_ZEROES,
                6,
                4096,
                2048,
            ),
            request(0, READ, 7, 4000, 8192),
            disc(8),
        ]),
        vec![
            (WRITE, ok),
            (READ, ok),
            (READ, ok),
            (BLOCK_STATUS, ok),
            (BLOCK_STATUS, ok),
            (WRITE_ZEROES, ok),
            (READ, ok),
        ],
    );
    seed(
        "structured-errors",
        STRUCTURED,
        cat(&[
            request(0, BLOCK_STATUS, 1, 0, 4096),
            request(0, READ, 2, DEV, 1),
            write(0, 3, DEV - 10, &pattern(20, 1)),
            request(cmd_flag::REQ_ONE, READ, 4, 0, 512),
            request(0, 12, 5, 0, 0),
            request(0, READ, 6, 0, 65537),
            disc(7),
        ]),
        vec![
            (BLOCK_STATUS, Err(errno::EINVAL)),
            (READ, Err(errno::EINVAL)),
            (WRITE, Err(errno::ENOSPC)),
            (READ, Err(errno::EINVAL)),
            (12, Err(errno::EINVAL)),
            (READ, Err(errno::EOVERFLOW)),
        ],
    );
    seed(
        "simple-errors",
        0,
        cat(&[
            request(0, READ, 1, DEV - 1, 2),
            request(0, READ, 2, u64::MAX, 1),
            request(0, WRITE_ZEROES, 3, DEV, 1),
            request(0, FLUSH, 4, 1, 0),
            request(cmd_flag::DF, READ, 5, 0, 512),
            request(cmd_flag::NO_HOLE, TRIM, 6, 0, 512),
            request(0, BLOCK_STATUS, 7, 0, 512),
            request(0, 0xffff, 8, 0, 0),
            disc(9),
        ]),
        vec![
            (READ, Err(errno::EINVAL)),
            (READ, Err(errno::EINVAL)),
            (WRITE_ZEROES, Err(errno::ENOSPC)),
            (FLUSH, Err(errno::EINVAL)),
            (READ, Err(errno::EINVAL)),
            (TRIM, Err(errno::EINVAL)),
            (BLOCK_STATUS, Err(errno::EINVAL)),
            (0xffff, Err(errno::EINVAL)),
        ],
    );
    seed(
        "read-only-export",
        FORCE_RO | STRUCTURED,
        cat(&[
            write(0, 1, 0, &pattern(512, 1)),
            request(0, TRIM, 2, 0, 512),
            request(0, WRITE_ZEROES, 3, 0, 512),
            request(0, READ, 4, 0, 512),
            request(0, FLUSH, 5, 0, 0),
            disc(6),
        ]),
        vec![
            (WRITE, Err(errno::EPERM)),
            (TRIM, Err(errno::EPERM)),
            (WRITE_ZEROES, Err(errno::EPERM)),
            (READ, ok),
            (FLUSH, ok),
        ],
    );
    seed(
        "read-only-device",
        DEV_RO,
        cat(&[
            write(cmd_flag::FUA, 1, 512, &pattern(512, 2)),
            request(0, READ, 2, 512, 512),
            disc(3),
        ]),
        vec![(WRITE, Err(errno::EPERM)), (READ, ok)],
    );
    let big = MAX_PAYLOAD_SMALL as usize + 1000;
    seed(
        "oversized-payloads",
        SMALL_PAYLOAD,
        cat(&[
            write(0, 1, 0, &pattern(big, 4)),
            request(0, READ, 2, 0, big as u32),
            write(0, 3, 0, &pattern(MAX_PAYLOAD_SMALL as usize, 5)),
            request(0, READ, 4, 0, MAX_PAYLOAD_SMALL),
            disc(5),
        ]),
        vec![
            (WRITE, Err(errno::EOVERFLOW)),
            (READ, Err(errno::EOVERFLOW)),
            (WRITE, ok),
            (READ, ok),
        ],
    );
    seed(
        "short-writes",
        SHORT_WRITES | STRUCTURED | CONTEXT,
        cat(&[
            write(0, 1, 100, &pattern(300, 6)),
            request(0, READ, 2, 0, 1000),
            request(0, BLOCK_STATUS, 3, 0, 1000),
            request(0, READ, 4, DEV, 1),
            disc(5),
        ]),
        vec![
            (WRITE, ok),
            (READ, ok),
            (BLOCK_STATUS, ok),
            (READ, Err(errno::EINVAL)),
        ],
    );
    // The reply writer fails after 256 bytes: in the middle of the READ's reply here...
    seed(
        "broken-connection-mid-reply",
        STRUCTURED | BROKEN_WRITER,
        cat(&[
            write(0, 1, 0, &pattern(100, 1)),
            request(0, READ, 2, 0, 512),
            write(0, 3, 4096, &pattern(64, 2)),
            disc(4),
        ]),
        vec![(WRITE, ok)],
    );
    // ... and here between replies: 16 acks fill it, the WRITE_ZEROES is executed but its reply
    // fails, and the last WRITE is never read.
    let mut stream: Vec<Vec<u8>> = (0..16).map(|i| write(0, i, i, &[0xaa])).collect();
    stream.push(request(0, WRITE_ZEROES, 16, 0, 8));
    stream.push(write(0, 17, 100, &[0xbb]));
    seed(
        "broken-connection-between-replies",
        BROKEN_WRITER,
        cat(&stream),
        vec![(WRITE, ok); 16],
    );
    let bad = quirky::BAD.start;
    seed(
        "quirky-device",
        STRUCTURED | CONTEXT | QUIRKY,
        cat(&[
            request(0, BLOCK_STATUS, 1, 0, 65536),
            request(cmd_flag::REQ_ONE, BLOCK_STATUS, 2, 1000, 5000),
            request(0, BLOCK_STATUS, 3, 0, DEV as u32),
            request(0, READ, 4, bad - 100, 200),
            write(0, 5, bad + 4000, &pattern(200, 3)),
            request(cmd_flag::FAST_ZERO, WRITE_ZEROES, 6, 4096, 1000),
            request(cmd_flag::FAST_ZERO, WRITE_ZEROES, 7, 8192, 8192),
            request(0, CACHE, 8, 0, DEV as u32),
            request(0, TRIM, 9, bad, 1),
            write(0, 10, bad - 512, &pattern(512, 4)),
            request(0, READ, 11, bad - 512, 512),
            request(0, FLUSH, 12, 0, 0),
            disc(13),
        ]),
        vec![
            (BLOCK_STATUS, ok),
            (BLOCK_STATUS, ok),
            (BLOCK_STATUS, ok),
            (READ, Err(errno::EIO)),
            (WRITE, Err(errno::EIO)),
            (WRITE_ZEROES, Err(errno::ENOTSUP)),
            (WRITE_ZEROES, ok),
            (CACHE, Err(errno::EIO)),
            (TRIM, Err(errno::EIO)),
            (WRITE, ok),
            (READ, ok),
            (FLUSH, ok),
        ],
    );
    seed(
        "quirky-device-simple",
        QUIRKY,
        cat(&[
            request(0, READ, 1, bad, 512),
            write(cmd_flag::FUA, 2, 0, &pattern(512, 5)),
            request(0, READ, 3, 0, 512),
            disc(4),
        ]),
        vec![(READ, Err(errno::EIO)), (WRITE, ok), (READ, ok)],
    );
    seed(
        "bad-magic",
        0,
        cat(&[
            request(0, READ, 1, 0, 512),
            vec![0xde; 28],
            request(0, READ, 2, 0, 512),
        ]),
        vec![(READ, ok)],
    );
    seed(
        "eof-inside-write",
        STRUCTURED,
        cat(&[
            request(0, FLUSH, 1, 0, 0),
            request(0, WRITE, 2, 0, 4096),
            pattern(100, 0),
        ]),
        vec![(FLUSH, ok)],
    );
    w.count
}

fn request_header_seeds(root: &Path) -> usize {
    let mut w = Writer::new(root, "request_header");
    let mut seed = |name: &str, data: Vec<u8>| {
        request_header::run(&data);
        w.seed(name, &data);
    };
    seed("read", request(0, cmd::READ, 1, 4096, 4096));
    seed(
        "write-fua",
        request(cmd_flag::FUA, cmd::WRITE, u64::MAX, 1 << 40, 65536),
    );
    seed(
        "block-status",
        request(cmd_flag::REQ_ONE, cmd::BLOCK_STATUS, 7, 0, 1 << 20),
    );
    seed("bad-magic", vec![0xde; 28]);
    seed(
        "info-payload",
        info_payload("disk", &[info::NAME, info::BLOCK_SIZE]),
    );
    seed("info-payload-empty-name", info_payload("", &[]));
    seed(
        "meta-payload",
        meta_payload("disk", &[BASE_ALLOCATION, "qemu:dirty-bitmap:x"]),
    );
    seed("meta-payload-no-queries", meta_payload("", &[]));
    w.count
}

fn main() {
    let root = std::env::args_os()
        .nth(1)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus"));
    let n = handshake_seeds(&root) + transmission_seeds(&root) + request_header_seeds(&root);
    println!("wrote {n} seeds under {}", root.display());
}
