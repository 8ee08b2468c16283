//! Shared helpers for the engine's crash, fault and model tests.
//!
//! - [`Rng`]: a small deterministic PRNG (every test is reproducible from a printed seed).
//! - [`Rail`] / [`RailDev`]: puts several [`CrashDev`]s on one "power rail". Every request to any
//!   device on the rail runs under one lock, so a snapshot taken under that lock is the state of
//!   *all* devices at one instant: a power loss of the cache device and the backing store at the
//!   same moment, while I/O is in flight on other threads. A hook runs after each device request
//!   (still under the lock) so a test can lose power at an exact point (the Nth write, a
//!   checkpoint write, a cleaner write, ...).
//! - [`Gate`]: a device that parks one chosen request (the next write, the next write covering a
//!   given offset, or the next flush) until the test releases it, to force a particular
//!   interleaving of engine threads (deterministic race reproducers); gates stack.
//! - [`Model`]: the sequential oracle and the crash checker shared by `model.rs` and `faults.rs`
//!   (its doc comment states the exact rules).
//! - Seeds and sizes (`FLASHTIER_SEED`, `FLASHTIER_LONG`), [`format_cache`] / [`format_small`],
//!   [`open`], [`read_all`], [`with_timeout`] (a hung engine fails the test instead of hanging
//!   it).

#![allow(dead_code)]

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use flashtier_engine::{format, BackingIdentity, Cache, FormatOptions, Mode, ReclaimPolicy};
use flashtier_io::{BlockDev, DevInfo, Extent, ZeroOpts};
use flashtier_testkit::{CrashDev, CrashPolicy};

pub const BS: u64 = 4096;

pub fn ident(size: u64) -> BackingIdentity {
    BackingIdentity {
        size,
        name: "test-backing".into(),
        fingerprint: Vec::new(),
    }
}

/// Whether `FLASHTIER_LONG=1` asks for the long versions of the randomized tests.
pub fn is_long() -> bool {
    long_factor() > 1
}

/// 10 with `FLASHTIER_LONG=1`, else 1.
pub fn long_factor() -> u64 {
    match std::env::var("FLASHTIER_LONG") {
        Ok(v) if v == "1" => 10,
        _ => 1,
    }
}

/// `FLASHTIER_SEED` if set (decimal or 0x-hex), else `default`.
pub fn base_seed(default: u64) -> u64 {
    match std::env::var("FLASHTIER_SEED") {
        Ok(v) => {
            let v = v.trim();
            if let Some(h) = v.strip_prefix("0x") {
                u64::from_str_radix(h, 16).expect("FLASHTIER_SEED")
            } else {
                v.parse().expect("FLASHTIER_SEED")
            }
        }
        Err(_) => default,
    }
}

/// splitmix64.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, n)` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// Uniform in `[lo, hi]`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64) < p
    }
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }
}

pub fn mix(a: u64, b: u64) -> u64 {
    Rng(a.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ b).next_u64()
}

/// `len` pseudo-random bytes derived from `seed` (distinct seeds give distinct data).
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut r = Rng::new(seed);
    while out.len() < len {
        out.extend_from_slice(&r.next_u64().to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The crash policies the tests draw from.
pub fn policy(i: u64) -> CrashPolicy {
    match i % 8 {
        0 => CrashPolicy::drop_all(),
        1 => CrashPolicy::keep_all(),
        2 => CrashPolicy::random(),
        3 => CrashPolicy::tear_all(),
        4 => CrashPolicy::random().with_sector(4096),
        5 => CrashPolicy::tear_all().with_sector(4096),
        6 => CrashPolicy::new(0.8, 0.15),
        _ => CrashPolicy::new(0.1, 0.6),
    }
}

/// Reads the whole of `dev`.
pub fn read_all(dev: &dyn BlockDev) -> io::Result<Vec<u8>> {
    let size = dev.info().size as usize;
    let mut out = vec![0u8; size];
    let chunk = 1 << 20;
    let mut at = 0;
    while at < size {
        let n = chunk.min(size - at);
        dev.read_at(&mut out[at..at + n], at as u64)?;
        at += n;
    }
    Ok(out)
}

/// Formats `dev` as a cache for a backing store of `backing` bytes.
pub fn format_cache(
    dev: &dyn BlockDev,
    backing: u64,
    segment: u32,
    mode: Mode,
    reclaim: ReclaimPolicy,
) -> Result<(), String> {
    let opts = FormatOptions {
        segment_size: segment,
        mode,
        reclaim,
        ..Default::default()
    };
    format(dev, ident(backing), opts)
        .map(drop)
        .map_err(|e| format!("format: {e}"))
}

/// [`format_cache`] with 64 KiB segments (16 blocks, so the log wraps quickly) and LRU reclaim.
pub fn format_small(dev: &dyn BlockDev, backing: u64, mode: Mode) {
    format_cache(dev, backing, 64 << 10, mode, ReclaimPolicy::Lru).unwrap()
}

pub fn open(
    cache: Arc<dyn BlockDev>,
    backing: Arc<dyn BlockDev>,
    mode: Option<Mode>,
) -> Result<Cache, flashtier_engine::EngineError> {
    let size = backing.info().size;
    Cache::open(cache, backing, &ident(size), mode)
}

// ---------------------------------------------------------------------------------------------
// The power rail
// ---------------------------------------------------------------------------------------------

/// A device request, as the rail's hook sees it (after it completed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Req {
    Write { offset: u64, len: u64, fua: bool },
    Flush,
    Trim { offset: u64, len: u64 },
    Zeroes { offset: u64, len: u64, fua: bool },
}

/// What a hook is told about a request.
#[derive(Debug, Clone, Copy)]
pub struct Event {
    /// Index of the device on the rail (registration order).
    pub dev: usize,
    pub req: Req,
    pub ok: bool,
    /// Write-like requests on this rail so far (all devices), this one included.
    pub writes: u64,
}

pub type Hook = Box<dyn FnMut(&Event, &RailCtx<'_>) + Send>;

/// Devices on one rail; see the module docs.
pub struct Rail {
    lock: Mutex<()>,
    devs: Mutex<Vec<Arc<CrashDev>>>,
    hook: Mutex<Option<Hook>>,
    writes: AtomicU64,
}

/// Given to a hook: lets it take images of every device at this instant.
pub struct RailCtx<'a> {
    rail: &'a Rail,
}

impl RailCtx<'_> {
    /// The images a power loss now would leave on every device (one seed per device).
    pub fn crash_images(&self, seed: u64, policy: CrashPolicy) -> Vec<Vec<u8>> {
        self.rail.images_locked(seed, policy)
    }
}

impl Rail {
    pub fn new() -> Arc<Rail> {
        Arc::new(Rail {
            lock: Mutex::new(()),
            devs: Mutex::new(Vec::new()),
            hook: Mutex::new(None),
            writes: AtomicU64::new(0),
        })
    }

    /// Puts `dev` on the rail; returns the device to hand to the engine.
    pub fn attach(self: &Arc<Rail>, dev: Arc<CrashDev>) -> Arc<RailDev> {
        let mut devs = self.devs.lock().unwrap();
        devs.push(dev.clone());
        Arc::new(RailDev {
            rail: self.clone(),
            inner: dev,
            index: devs.len() - 1,
        })
    }

    pub fn set_hook(&self, hook: Option<Hook>) {
        *self.hook.lock().unwrap() = hook;
    }

    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::SeqCst)
    }

    fn images_locked(&self, seed: u64, policy: CrashPolicy) -> Vec<Vec<u8>> {
        let devs = self.devs.lock().unwrap();
        devs.iter()
            .enumerate()
            .map(|(i, d)| d.crash_image(mix(seed, i as u64), policy))
            .collect()
    }

    /// Every device's crash image at one instant (no request in progress on any of them).
    pub fn crash_images(&self, seed: u64, policy: CrashPolicy) -> Vec<Vec<u8>> {
        let _g = self.enter();
        self.images_locked(seed, policy)
    }

    /// Runs `f` with the rail held: no device request runs meanwhile.
    pub fn frozen<R>(&self, f: impl FnOnce(&RailCtx<'_>) -> R) -> R {
        let _g = self.enter();
        f(&RailCtx { rail: self })
    }

    fn enter(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn after(&self, dev: usize, req: Req, ok: bool) {
        let writes = if matches!(req, Req::Flush) {
            self.writes.load(Ordering::SeqCst)
        } else {
            self.writes.fetch_add(1, Ordering::SeqCst) + 1
        };
        let mut hook = self.hook.lock().unwrap();
        if let Some(h) = hook.as_mut() {
            h(
                &Event {
                    dev,
                    req,
                    ok,
                    writes,
                },
                &RailCtx { rail: self },
            );
        }
    }
}

/// A [`CrashDev`] on a [`Rail`].
pub struct RailDev {
    rail: Arc<Rail>,
    inner: Arc<CrashDev>,
    index: usize,
}

impl RailDev {
    pub fn inner(&self) -> &Arc<CrashDev> {
        &self.inner
    }
}

impl BlockDev for RailDev {
    fn info(&self) -> &DevInfo {
        self.inner.info()
    }
    fn describe(&self) -> String {
        format!("rail {} over {}", self.index, self.inner.describe())
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let _g = self.rail.enter();
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let _g = self.rail.enter();
        let r = self.inner.write_at(buf, offset, fua);
        let req = Req::Write {
            offset,
            len: buf.len() as u64,
            fua,
        };
        self.rail.after(self.index, req, r.is_ok());
        r
    }
    fn write_vectored_at(&self, bufs: &[&[u8]], offset: u64) -> io::Result<()> {
        let _g = self.rail.enter();
        let r = self.inner.write_vectored_at(bufs, offset);
        let len = bufs.iter().map(|b| b.len() as u64).sum();
        let req = Req::Write {
            offset,
            len,
            fua: false,
        };
        self.rail.after(self.index, req, r.is_ok());
        r
    }
    fn flush(&self) -> io::Result<()> {
        let _g = self.rail.enter();
        let r = self.inner.flush();
        self.rail.after(self.index, Req::Flush, r.is_ok());
        r
    }
    fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        let _g = self.rail.enter();
        let r = self.inner.trim(offset, len);
        self.rail
            .after(self.index, Req::Trim { offset, len }, r.is_ok());
        r
    }
    fn write_zeroes(&self, offset: u64, len: u64, opts: ZeroOpts) -> io::Result<()> {
        let _g = self.rail.enter();
        let r = self.inner.write_zeroes(offset, len, opts);
        let req = Req::Zeroes {
            offset,
            len,
            fua: opts.fua,
        };
        self.rail.after(self.index, req, r.is_ok());
        r
    }
    fn prefetch(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.prefetch(offset, len)
    }
    fn extents(&self, o: u64, l: u64, m: usize, out: &mut Vec<Extent>) -> io::Result<()> {
        self.inner.extents(o, l, m, out)
    }
}

// ---------------------------------------------------------------------------------------------
// The gate
// ---------------------------------------------------------------------------------------------

#[derive(Default)]
struct GateState {
    park_write: bool,
    /// Park only a write (or trim, write-zeroes) whose range covers this offset.
    park_write_at: Option<u64>,
    park_flush: bool,
    /// Park the next read whose range covers this offset.
    park_read_at: Option<u64>,
    parked: bool,
    released: bool,
}

/// Forwards to `inner`, except that the next write (or flush, read) after
/// [`Gate::park_next_write`] (or [`Gate::park_next_flush`], [`Gate::park_next_write_at`],
/// [`Gate::park_next_read_at`]) waits until [`Gate::release`], *before* reaching `inner`. Gates
/// stack (a gate over a gate) to park two chosen requests.
pub struct Gate {
    inner: Arc<dyn BlockDev>,
    st: Mutex<GateState>,
    cv: Condvar,
}

impl Gate {
    pub fn new(inner: Arc<dyn BlockDev>) -> Arc<Gate> {
        Arc::new(Gate {
            inner,
            st: Mutex::default(),
            cv: Condvar::new(),
        })
    }
    pub fn park_next_write(&self) {
        let mut s = self.st.lock().unwrap();
        s.park_write = true;
        s.park_write_at = None;
        s.released = false;
        s.parked = false;
    }
    /// Parks the next write, trim or write-zeroes whose range covers byte `offset`.
    pub fn park_next_write_at(&self, offset: u64) {
        let mut s = self.st.lock().unwrap();
        s.park_write = true;
        s.park_write_at = Some(offset);
        s.released = false;
        s.parked = false;
    }
    pub fn park_next_flush(&self) {
        let mut s = self.st.lock().unwrap();
        s.park_flush = true;
        s.released = false;
        s.parked = false;
    }
    /// Parks the next read whose range covers byte `offset`.
    pub fn park_next_read_at(&self, offset: u64) {
        let mut s = self.st.lock().unwrap();
        s.park_read_at = Some(offset);
        s.released = false;
        s.parked = false;
    }
    /// Waits until a request is parked.
    pub fn wait_parked(&self) {
        let mut s = self.st.lock().unwrap();
        while !s.parked {
            s = self.cv.wait(s).unwrap();
        }
    }
    /// Whether a request is parked now.
    pub fn is_parked(&self) -> bool {
        let s = self.st.lock().unwrap();
        s.parked && !s.released
    }
    pub fn release(&self) {
        let mut s = self.st.lock().unwrap();
        s.released = true;
        self.cv.notify_all();
    }
    fn gate_read(&self, offset: u64, len: u64) {
        let mut s = self.st.lock().unwrap();
        if !s
            .park_read_at
            .is_some_and(|at| offset <= at && at < offset + len)
        {
            return;
        }
        s.park_read_at = None;
        s.parked = true;
        self.cv.notify_all();
        while !s.released {
            s = self.cv.wait(s).unwrap();
        }
    }
    /// `range`: the `(offset, len)` of a write-like request, `None` for a flush.
    fn gate(&self, range: Option<(u64, u64)>) {
        let flush = range.is_none();
        let mut s = self.st.lock().unwrap();
        let armed = match range {
            None => s.park_flush,
            Some((o, l)) => s.park_write && s.park_write_at.is_none_or(|at| o <= at && at < o + l),
        };
        if !armed {
            return;
        }
        if flush {
            s.park_flush = false;
        } else {
            s.park_write = false;
        }
        s.parked = true;
        self.cv.notify_all();
        while !s.released {
            s = self.cv.wait(s).unwrap();
        }
    }
}

impl BlockDev for Gate {
    fn info(&self) -> &DevInfo {
        self.inner.info()
    }
    fn describe(&self) -> String {
        format!("gate over {}", self.inner.describe())
    }
    fn read_at(&self, b: &mut [u8], o: u64) -> io::Result<()> {
        self.gate_read(o, b.len() as u64);
        self.inner.read_at(b, o)
    }
    fn write_at(&self, b: &[u8], o: u64, f: bool) -> io::Result<()> {
        self.gate(Some((o, b.len() as u64)));
        self.inner.write_at(b, o, f)
    }
    fn write_vectored_at(&self, b: &[&[u8]], o: u64) -> io::Result<()> {
        self.gate(Some((o, b.iter().map(|x| x.len() as u64).sum())));
        self.inner.write_vectored_at(b, o)
    }
    fn flush(&self) -> io::Result<()> {
        self.gate(None);
        self.inner.flush()
    }
    fn trim(&self, o: u64, l: u64) -> io::Result<()> {
        self.gate(Some((o, l)));
        self.inner.trim(o, l)
    }
    fn write_zeroes(&self, o: u64, l: u64, z: ZeroOpts) -> io::Result<()> {
        self.gate(Some((o, l)));
        self.inner.write_zeroes(o, l, z)
    }
}

// ---------------------------------------------------------------------------------------------
// The sequential model and the crash checker
// ---------------------------------------------------------------------------------------------

/// A byte of the model whose content is unspecified (trimmed and not rewritten since).
pub const ANY: u16 = 0x100;

/// What a sub-operation writes.
#[derive(Clone)]
pub enum Val {
    /// `data[at..at + len]`.
    Data {
        data: Arc<Vec<u8>>,
        at: usize,
    },
    Zero,
    /// Trim: anything.
    Any,
}

/// One all-or-nothing (if `logged`) piece of a client operation, as the engine executes it.
#[derive(Clone)]
pub struct Sub {
    pub off: u64,
    pub len: u64,
    pub val: Val,
    /// Went through the cache's log (write-back / write-through writes): atomic and ordered.
    /// Otherwise it went around the cache to the backing store (write-around / pass-through
    /// writes, trim, the whole-block part of write-zeroes): per sector, unordered.
    pub logged: bool,
    /// Durable once acknowledged (FUA).
    pub fua: bool,
    /// The client operation returned an error: it may or may not have happened.
    pub failed: bool,
    /// Index of the client operation (for messages).
    pub op: usize,
    pub what: String,
}

impl Sub {
    pub fn end(&self) -> u64 {
        self.off + self.len
    }
    #[inline]
    pub fn byte(&self, x: u64) -> u16 {
        match &self.val {
            Val::Data { data, at } => data[at + (x - self.off) as usize] as u16,
            Val::Zero => 0,
            Val::Any => ANY,
        }
    }
    /// If it is applied, nothing older shows through it.
    fn definite(&self) -> bool {
        !self.failed && (self.logged || self.fua)
    }
    /// Present after a crash whatever the prefix (an acknowledged FUA write).
    fn durable_alone(&self) -> bool {
        !self.failed && self.fua
    }
}

/// The oracle: what the exported device must contain, and which states a crash may leave.
///
/// `base` is the content at the last durability point (an acknowledged FLUSH, or the state found
/// by the last recovery); `pending` lists, in order, the pieces ("subs") of every client
/// operation since; `current` is `base` with all of them applied (what reads must return).
///
/// **The crash rule.** Number the pending subs `0..n`. For a *log cut* `k` in `0..=n`, the subs
/// in effect are `S_k` = those numbered `< k`, plus every acknowledged FUA sub (durable whatever
/// else is lost). For a byte `x`, walk the subs of `S_k` that touch `x` from the newest back:
/// each one's value is acceptable, and the walk stops after the first *definite* sub (a
/// successful logged write, or any acknowledged FUA write): a logged write maps the block in the
/// cache, so nothing older can show through it, while a non-FUA write that went around the cache
/// (write-around, pass-through, trim, write-zeroes) may have been lost or torn by the backing
/// store's volatile cache, so what it overwrote may show instead. If the walk runs out, `base[x]`
/// is acceptable. A failed operation's subs are acceptable but never definite. A recovered image
/// is correct iff **one** `k` makes every byte acceptable.
///
/// What this checks, line by line of the contract:
/// - durability: subs before the last acknowledged FLUSH are in `base`; an acknowledged FUA sub is
///   in every `S_k` and definite, so its bytes must hold it (or a later write in effect);
/// - atomicity: a logged sub (each at most the atomic size; larger writes are split exactly as the
///   engine splits them) is in `S_k` for all of its bytes or for none;
/// - prefix consistency: one `k` for the whole device: if any logged sub is present, every sub
///   before it is in effect (and an older value showing through a newer logged write fails);
/// - no stale data / no phantom: only values written at or after a byte's last durable point are
///   acceptable; write-zeroes reads as zero. A byte trimmed since the last durable point accepts
///   anything at any cut (its content is unspecified; the engine sends a trim that covers no
///   whole block to the backing store without syncing the log, so the trim may survive a crash
///   that loses earlier unsynced writes, and trimmed bytes cannot serve as evidence of a cut).
///
/// Writes that bypass the cache are not atomic or ordered after a crash: the backing store's
/// own volatile cache may drop or tear them (see `writes_around_the_cache_are_not_atomic` in
/// model.rs for why the contract cannot promise more there).
pub struct Model {
    pub size: u64,
    pub base: Vec<u16>,
    pub current: Vec<u16>,
    pub pending: Vec<Sub>,
    pub ops: usize,
    /// Recent operations, for failure messages.
    pub history: Vec<String>,
}

fn mask_words(n: usize) -> usize {
    (n + 1).div_ceil(64)
}

fn set_bits(mask: &mut [u64], lo: usize, hi: usize) {
    for k in lo..=hi {
        mask[k / 64] |= 1 << (k % 64);
    }
}

fn describe_set(mask: &[u64], n: usize) -> String {
    let mut out = Vec::new();
    let mut k = 0;
    while k <= n {
        if mask[k / 64] >> (k % 64) & 1 == 1 {
            let start = k;
            while k < n && mask[(k + 1) / 64] >> ((k + 1) % 64) & 1 == 1 {
                k += 1;
            }
            out.push(if start == k {
                format!("{k}")
            } else {
                format!("{start}..={k}")
            });
        }
        k += 1;
    }
    if out.is_empty() {
        "{}".into()
    } else {
        format!("{{{}}}", out.join(", "))
    }
}

fn show(v: u16) -> String {
    if v == ANY {
        "ANY".into()
    } else {
        format!("{v:#04x}")
    }
}

impl Model {
    pub fn new(initial: &[u8]) -> Model {
        let base: Vec<u16> = initial.iter().map(|&b| b as u16).collect();
        Model {
            size: initial.len() as u64,
            current: base.clone(),
            base,
            pending: Vec::new(),
            ops: 0,
            history: Vec::new(),
        }
    }

    pub fn note(&mut self, what: String) {
        self.history.push(what);
        if self.history.len() > 400 {
            self.history.drain(..100);
        }
    }

    /// Subs for a write of `len` bytes at `off` in `mode`, split like the engine splits it.
    #[allow(clippy::too_many_arguments)]
    pub fn write_subs(
        &self,
        off: u64,
        len: u64,
        val: Val,
        fua: bool,
        mode: Mode,
        atomic_bytes: u64,
        what: &str,
    ) -> Vec<Sub> {
        let logged = matches!(mode, Mode::WriteBack | Mode::WriteThrough);
        let end = off + len;
        let mk = |from: u64, to: u64| {
            let val = match &val {
                Val::Data { data, at } => Val::Data {
                    data: data.clone(),
                    at: at + (from - off) as usize,
                },
                v => v.clone(),
            };
            Sub {
                off: from,
                len: to - from,
                val,
                logged,
                fua,
                failed: false,
                op: self.ops,
                what: format!("{what} [{mode}{}]", if fua { " fua" } else { "" }),
            }
        };
        if len == 0 {
            return Vec::new();
        }
        if !logged {
            return vec![mk(off, end)];
        }
        // The engine extends the write to whole blocks and logs records of at most
        // `atomic_bytes / BS` blocks, starting at the first block.
        let max = (atomic_bytes / BS).max(1);
        let first = off / BS;
        let last = end.div_ceil(BS);
        let mut out = Vec::new();
        let mut b = first;
        while b < last {
            let e = (b + max).min(last);
            let from = (b * BS).max(off);
            let to = (e * BS).min(end);
            out.push(mk(from, to));
            b = e;
        }
        out
    }

    /// Subs of a write-zeroes, in the order the engine performs them: the partial block at each
    /// edge through the write path, then the whole blocks around the cache.
    pub fn zeroes_subs(
        &self,
        off: u64,
        len: u64,
        fua: bool,
        mode: Mode,
        atomic_bytes: u64,
    ) -> Vec<Sub> {
        let end = off + len;
        let first = off.div_ceil(BS);
        let last = (end / BS).max(first);
        let head_end = (first * BS).min(end);
        let tail_start = (last * BS).max(head_end);
        let mut out = Vec::new();
        if head_end > off {
            out.extend(self.write_subs(
                off,
                head_end - off,
                Val::Zero,
                fua,
                mode,
                atomic_bytes,
                "zeroes head",
            ));
        }
        if end > tail_start {
            out.extend(self.write_subs(
                tail_start,
                end - tail_start,
                Val::Zero,
                fua,
                mode,
                atomic_bytes,
                "zeroes tail",
            ));
        }
        if last > first {
            out.push(Sub {
                off: first * BS,
                len: (last - first) * BS,
                val: Val::Zero,
                logged: false,
                fua,
                failed: false,
                op: self.ops,
                what: format!("zeroes body [{mode}{}]", if fua { " fua" } else { "" }),
            });
        }
        out
    }

    pub fn trim_subs(&self, off: u64, len: u64) -> Vec<Sub> {
        if len == 0 {
            return Vec::new();
        }
        vec![Sub {
            off,
            len,
            val: Val::Any,
            logged: false,
            fua: false,
            failed: false,
            op: self.ops,
            what: "trim".into(),
        }]
    }

    /// Records a client operation made of `subs`, which succeeded (`ok`) or failed.
    pub fn apply(&mut self, mut subs: Vec<Sub>, ok: bool) {
        for s in &mut subs {
            s.failed = !ok;
            if ok {
                for x in s.off..s.end() {
                    self.current[x as usize] = s.byte(x);
                }
            }
        }
        self.pending.extend(subs);
        self.ops += 1;
    }

    pub fn has_failed(&self) -> bool {
        self.pending.iter().any(|s| s.failed)
    }

    /// Checks what a read returned against the live state.
    pub fn check_live(&self, off: u64, got: &[u8]) -> Result<(), String> {
        let end = off + got.len() as u64;
        let failed: Vec<&Sub> = self
            .pending
            .iter()
            .filter(|s| s.off < end && s.end() > off)
            .collect();
        let any_failed = failed.iter().any(|s| s.failed);
        for (i, &g) in got.iter().enumerate() {
            let x = off + i as u64;
            let ok = if !any_failed {
                let e = self.current[x as usize];
                e == ANY || e == g as u16
            } else {
                // A failed operation may or may not have happened.
                let mut ok = None;
                for s in failed.iter().rev().filter(|s| s.off <= x && x < s.end()) {
                    let v = s.byte(x);
                    if v == ANY || v == g as u16 {
                        ok = Some(true);
                        break;
                    }
                    if !s.failed {
                        ok = Some(false);
                        break;
                    }
                }
                ok.unwrap_or_else(|| {
                    let b = self.base[x as usize];
                    b == ANY || b == g as u16
                })
            };
            if !ok {
                return Err(format!(
                    "read at {off}+{}: byte {x} (block {}, +{}) is {:#04x}, expected {}{}\n{}",
                    got.len(),
                    x / BS,
                    x % BS,
                    g,
                    show(self.current[x as usize]),
                    if any_failed {
                        " (or the value before a failed operation)"
                    } else {
                        ""
                    },
                    self.explain_byte(x, None)
                ));
            }
        }
        Ok(())
    }

    /// A FLUSH was acknowledged: everything so far is durable. `read` reads the exported device
    /// (to settle what failed operations left behind).
    pub fn flushed(
        &mut self,
        read: &mut dyn FnMut(u64, &mut [u8]) -> io::Result<()>,
    ) -> Result<(), String> {
        if self.has_failed() {
            let ranges: Vec<(u64, u64)> = self
                .pending
                .iter()
                .filter(|s| s.failed)
                .map(|s| (s.off, s.end()))
                .collect();
            for (a, b) in ranges {
                let mut buf = vec![0u8; (b - a) as usize];
                read(a, &mut buf).map_err(|e| format!("read after flush failed: {e}"))?;
                self.check_live(a, &buf)?;
                for (i, &v) in buf.iter().enumerate() {
                    let x = a as usize + i;
                    if self.current[x] != ANY {
                        self.current[x] = v as u16;
                    }
                }
            }
        }
        self.base.clone_from(&self.current);
        self.pending.clear();
        Ok(())
    }

    /// The recovered image `r` is taken as the new durable state (see [`Model::check_crash`]).
    pub fn reconcile(&mut self, r: &[u8]) {
        let mut any = vec![false; self.size as usize];
        for s in &self.pending {
            if matches!(s.val, Val::Any) {
                any[s.off as usize..s.end() as usize].fill(true);
            }
        }
        for (x, &v) in r.iter().enumerate() {
            self.base[x] = if self.base[x] == ANY || self.current[x] == ANY || any[x] {
                ANY
            } else {
                v as u16
            };
        }
        self.current.clone_from(&self.base);
        self.pending.clear();
    }

    fn explain_byte(&self, x: u64, r: Option<u8>) -> String {
        let mut s = format!(
            "  byte {x}: recovered {}, base {}, current {}; pending subs touching it (newest last):",
            r.map_or("-".into(), |v| format!("{v:#04x}")),
            show(self.base[x as usize]),
            show(self.current[x as usize])
        );
        for (i, sub) in self.pending.iter().enumerate() {
            if sub.off <= x && x < sub.end() {
                s += &format!(
                    "\n    #{i} op {} {} at {}+{}: value {}{}{}{}",
                    sub.op,
                    sub.what,
                    sub.off,
                    sub.len,
                    show(sub.byte(x)),
                    if sub.logged { " logged" } else { " bypass" },
                    if sub.fua { " FUA" } else { "" },
                    if sub.failed { " FAILED" } else { "" },
                );
            }
        }
        s
    }

    /// Checks a recovered image against the crash rule (see the type's docs); returns the
    /// largest log cut `k` that explains it.
    pub fn check_crash(&self, r: &[u8]) -> Result<usize, String> {
        assert_eq!(r.len() as u64, self.size);
        let n = self.pending.len();
        let words = mask_words(n);
        let mut alive = vec![0u64; words];
        set_bits(&mut alive, 0, n);
        let mut bounds = vec![0, self.size];
        for s in &self.pending {
            bounds.push(s.off);
            bounds.push(s.end());
        }
        bounds.sort_unstable();
        bounds.dedup();
        let mut sig: Vec<bool> = Vec::new();
        let mut last_sig: Vec<bool> = Vec::new();
        let mut mask = vec![0u64; words];
        for w in bounds.windows(2) {
            let (a, b) = (w[0], w[1]);
            let touching: Vec<usize> = (0..n)
                .filter(|&i| self.pending[i].off <= a && a < self.pending[i].end())
                .collect();
            if touching.is_empty() {
                for x in a..b {
                    let e = self.base[x as usize];
                    if e != ANY && e != r[x as usize] as u16 {
                        return Err(format!(
                            "byte {x} (block {}, +{}) changed although nothing wrote it since the \
                             last durable point: recovered {:#04x}, expected {}",
                            x / BS,
                            x % BS,
                            r[x as usize],
                            show(e)
                        ));
                    }
                }
                continue;
            }
            let m = touching.len();
            last_sig.clear();
            for x in a..b {
                let rv = r[x as usize] as u16;
                sig.clear();
                for j in 0..=m {
                    sig.push(self.acceptable(x, rv, &touching, j));
                }
                if sig == last_sig {
                    continue;
                }
                mask.fill(0);
                for (j, &ok) in sig.iter().enumerate() {
                    if ok {
                        let lo = if j == 0 { 0 } else { touching[j - 1] + 1 };
                        let hi = if j == m { n } else { touching[j] };
                        set_bits(&mut mask, lo, hi);
                    }
                }
                let before = alive.clone();
                for (a, m) in alive.iter_mut().zip(&mask) {
                    *a &= m;
                }
                if alive.iter().all(|&w| w == 0) {
                    return Err(format!(
                        "no prefix of the {n} operations since the last durable point explains the \
                         recovered image: cuts still possible before byte {x} (block {}, +{}): {}, \
                         cuts this byte allows: {}\n{}",
                        x / BS,
                        x % BS,
                        describe_set(&before, n),
                        describe_set(&mask, n),
                        self.explain_byte(x, Some(r[x as usize]))
                    ));
                }
                std::mem::swap(&mut sig, &mut last_sig);
            }
        }
        Ok((0..=n)
            .rev()
            .find(|&k| alive[k / 64] >> (k % 64) & 1 == 1)
            .unwrap())
    }

    /// Whether `rv` is an acceptable value of byte `x` for cuts in region `j` (the first `j` of
    /// the subs `touching` it are in the prefix).
    fn acceptable(&self, x: u64, rv: u16, touching: &[usize], j: usize) -> bool {
        let subs = &self.pending;
        // Trimmed bytes are unspecified whatever the cut: a trim that does not cover a whole
        // block reaches the backing store without syncing the log first, so it may survive
        // while an earlier, unsynced write does not; no other byte may prove it happened.
        if touching.iter().any(|&i| matches!(subs[i].val, Val::Any)) {
            return true;
        }
        // An acknowledged FUA write after the cut is in effect anyway, and nothing after the cut
        // is, so the newest such write decides.
        for &i in touching[j..].iter().rev() {
            if subs[i].durable_alone() {
                let v = subs[i].byte(x);
                return v == ANY || v == rv;
            }
        }
        for &i in touching[..j].iter().rev() {
            let v = subs[i].byte(x);
            if v == ANY || v == rv {
                return true;
            }
            if subs[i].definite() {
                return false;
            }
        }
        let v = self.base[x as usize];
        v == ANY || v == rv
    }

    /// A short description of the pending operations (for failure messages).
    pub fn pending_summary(&self) -> String {
        let mut s = String::new();
        for (i, sub) in self.pending.iter().enumerate() {
            s += &format!(
                "  #{i} op {} {} at {}+{}{}{}{}\n",
                sub.op,
                sub.what,
                sub.off,
                sub.len,
                if sub.logged { " logged" } else { " bypass" },
                if sub.fua { " FUA" } else { "" },
                if sub.failed { " FAILED" } else { "" }
            );
        }
        s
    }
}

/// A CRC32C (for forging on-device structures in refusal tests).
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// Runs `f` on a thread and waits up to `secs` for it; `None` if it did not finish (the thread
/// is left behind: the engine hung).
pub fn with_timeout<T: Send + 'static>(
    secs: u64,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs)).ok()
}
