#!/usr/bin/env python3
"""A real database on each storage configuration: MariaDB + sysbench oltp_read_write (pareto).

The stack of every run: ext4 on a loop device (O_DIRECT on its file) on nbdfuse on the
configuration's NBD export; mariadbd's data directory on that ext4, its InnoDB buffer pool about
1/20 of the data (--pool-mib). sysbench oltp_read_write with --rand-type=pareto, --report-interval=10.

Configurations (the storage under the NBD export):
  slow           DESIGN.md §5's emulated slow disk alone: `nbdkit --filter=noparallel
                 --filter=delay --filter=stats file IMG serialize=all-requests rdelay=4ms wdelay=4ms`
                 (--delay-ms; plus the log filter, to count the backing I/O of each run)
  nbdkit-cache   `nbdkit --filter=cache nbd cache=writeback cache-on-read=true
                 cache-min-block-size=4K cache-max-size=CACHE` over the slow disk, its cache a
                 temporary file on the local disk, in a memory cgroup of --mem-limit-mib
  ft-wb, ft-wt, ft-wa
                 flashtier serve --mode writeback / writethrough / writearound over the slow disk,
                 its cache a file of CACHE bytes on the local disk (O_DIRECT), in the same cgroup limit
  ft-wb+mc       ft-wb with a pool of memcached servers below its cache (`--memcached ADDR,ADDR
                 --memcached-mode inclusive`): --mc-servers fresh memcached processes on loopback,
                 together given room for --mc-factor × the data's blocks (memcached 1.6 stores a
                 4 KiB block in a 4,544-byte chunk); their CPU counts as storage CPU. Run where the
                 SSD cache holds less than the data (1× and 0.5×), the case a second-level cache is for.
                 (bench/memcached.py runs WaffleGrid's experiment: flashtier pass-through, `serve`
                 without --cache, with and without a memcached tier, through this script's one_run.)
  ssd-direct     all on the local disk ("the SSD"), no page cache: `nbdkit file IMG cache=none`
  ssd-pagecache  all on the local disk through the page cache: plain `nbdkit file IMG`

Factors: innodb_doublewrite ON/OFF, innodb_page_size 16K/4K, and for the cached configurations the
cache size as a multiple of the data (the InnoDB data directory's allocated bytes): 2× (larger than
the data), 1× and 0.5×. The full run covers every configuration and factor without the cross product:
  base (16K, doublewrite ON, cache 2×): every configuration
  doublewrite OFF: ft-wb, ssd-direct, ssd-pagecache
  4K pages (doublewrite ON and OFF): ft-wb, ssd-direct
  cache 1× and 0.5× the data: ft-wb, ft-wb+mc, nbdkit-cache
--quick runs slow, ft-wb and ssd-direct at the base factors and ft-wb+mc at 0.5× on small data and
checks the results are sane (TPS > 0, sysbench exits 0, the JSON is written, ft-wb+mc's memcached
tier stored blocks and was hit); any failure exits non-zero.

The database is prepared once per page size on a plain local image (ext4 on a loop device,
mariadb-install-db, sysbench prepare with a large buffer pool, a slow shutdown) and kept in --workdir
(keyed by page size, tables, rows and disk size), so reruns skip it; every run starts from a sparse
copy of that image as its slow disk or SSD file, so all runs see identical data. Configurations with
a cache (and ssd-pagecache's page cache) are warmed before mariadbd starts by reading every
allocated range of the image once through the export (1 MiB reads), as a cache that has been in use
would be. Each run: mariadbd starts, --warmup seconds of load (not counted), then --seconds measured.
Runs are interleaved: one round runs every cell of the matrix once; --repeat rounds alternate the
order. After the measured run mariadbd is killed (its copy is thrown away) and the stack torn down.

Reported per cell (median over rounds): TPS, p95 latency, CPU seconds per 1,000 transactions of the
storage server processes (the NBD servers under nbdfuse) and of mariadbd, the coefficient of
variation of the per-10-second TPS, the slow disk's I/O during the measured run, and flashtier's
`stats --json` counters before and after the measured run. Targets (issue 14): flashtier write-back
≥ 1.0× ssd-direct TPS; flashtier write-back with doublewrite OFF ≥ 1.15× ssd-direct with doublewrite
ON; flashtier write-back's per-10 s TPS CV ≤ ssd-direct's.

--profile runs ft-wb at the base factors once instead, and during its measured run records
`perf stat` (context switches, CPU migrations, syscalls) of flashtier, mariadbd and nbdfuse for 20 s,
`perf record -e cpu-clock -g` of flashtier for 20 s (cpu-clock: a software event, named since this
machine's VM has no hardware counters) and `strace -c -f` of flashtier for 10 s; it writes
oltp_profile_raw.{md,json}.

Writes bench/results/oltp.{md,json,png} (--quick: /tmp/flashtier-bench-quick). Needs root (loop
devices, mounts, memory cgroups), /dev/fuse, nbdkit, nbdfuse, mariadbd, sysbench, python3-libnbd,
memcached.
"""

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import benchlib as bl
from memcached_pool import BLOCK, ITEMS_PER_MIB, MEMCACHED, MemcachedPool, pool_totals

CONFIGS = {
    "slow": "slow disk alone",
    "nbdkit-cache": "nbdkit --filter=cache (writeback) over the slow disk",
    "ft-wb": "flashtier write-back over the slow disk",
    "ft-wt": "flashtier write-through over the slow disk",
    "ft-wa": "flashtier write-around over the slow disk",
    "ft-wb+mc": "flashtier write-back with a memcached pool (inclusive) below its cache, over the slow disk",
    "ssd-direct": "all on the SSD, no page cache (nbdkit file cache=none)",
    "ssd-pagecache": "all on the SSD through the page cache (nbdkit file)",
}
RUNDIR = Path("/run") / f"flashtier-oltp-{os.getpid()}"  # tmpfs: flashtier's control socket, stats file
MC = "ft-wb+mc"
CACHED = ("nbdkit-cache", "ft-wb", "ft-wt", "ft-wa", MC)
FT_MODES = {"ft-wb": "writeback", "ft-wt": "writethrough", "ft-wa": "writearound", MC: "writeback"}
WARMED = (*CACHED, "ssd-pagecache")
# flashtier pass-through (`serve` without --cache) over the slow disk, plus the serve arguments
# one_run's `serve_extra` gives (e.g. a memcached tier): every configuration named PASS or
# PASS+SUFFIX. Not in CONFIGS, so not in this script's matrix; bench/memcached.py runs them.
# (MC is a configuration of this matrix: its pool is one_run's, and comes after `serve_extra`.)
PASS = "ft-pass"

Cell = namedtuple("Cell", "config page_kib doublewrite cache_factor")


def cell_label(c):
    cache = f", cache {c.cache_factor:g}× data" if c.cache_factor else ""
    return f"{c.config} ({c.page_kib}K, dw {'ON' if c.doublewrite else 'OFF'}{cache})"


def cell_key(c):
    return f"{c.config}/{c.page_kib}k/dw{'on' if c.doublewrite else 'off'}" + (
        f"/cache{c.cache_factor:g}x" if c.cache_factor else "")


def base_cell(config, page_kib=16, doublewrite=True, cache_factor=2.0):
    return Cell(config, page_kib, doublewrite, cache_factor if config in CACHED else None)


def home_cell(config):
    """A configuration's cell at the base factors, but ft-wb+mc's at 0.5×: with a cache larger than
    the data its memcached tier would see no reads."""
    return base_cell(config, cache_factor=0.5) if config == MC else base_cell(config)


def cell_of_key(key):
    """The cell a key names when it is a cached configuration's cell at any cache factor
    (e.g. ft-wb/16k/dwon/cache10x), else None."""
    m = re.fullmatch(r"([a-z+-]+)/(4|16)k/dw(on|off)/cache([0-9]+(?:\.[0-9]+)?)x", key)
    if not m or m[1] not in CACHED or float(m[4]) <= 0:
        return None
    return Cell(m[1], int(m[2]), m[3] == "on", float(m[4]))


def full_matrix():
    cells = [base_cell(c) for c in CONFIGS if c != MC]
    cells += [base_cell(c, doublewrite=False) for c in ("ft-wb", "ssd-direct", "ssd-pagecache")]
    cells += [base_cell(c, page_kib=4, doublewrite=dw) for dw in (True, False) for c in ("ft-wb", "ssd-direct")]
    cells += [base_cell(c, cache_factor=f) for f in (1.0, 0.5) for c in ("ft-wb", MC, "nbdkit-cache")]
    return cells


def quick_matrix():
    return [home_cell(c) for c in ("slow", "ft-wb", "ssd-direct", MC)]


# --- MariaDB and sysbench -----------------------------------------------------------------------

class MariaDB:
    """mariadbd on `datadir` with its socket, pid file and error log in `rundir`, as root, no
    networking, nothing shared with the system's MariaDB."""

    def __init__(self, rundir: Path, datadir: Path, page_kib, pool_mib, doublewrite, durable=True):
        self.rundir, self.datadir = Path(rundir), Path(datadir)
        self.rundir.mkdir(parents=True, exist_ok=True)
        self.sock = self.rundir / "mariadbd.sock"
        self.cnf = self.rundir / "my.cnf"
        self.errlog = self.rundir / "mariadbd.err"
        self.cnf.write_text("\n".join([
            "[mysqld]", "user=root", f"datadir={self.datadir}", f"socket={self.sock}",
            f"pid-file={self.rundir}/mariadbd.pid", f"log-error={self.errlog}", "skip-networking",
            "skip-name-resolve", f"innodb_page_size={page_kib}k", f"innodb_buffer_pool_size={pool_mib}M",
            f"innodb_doublewrite={'ON' if doublewrite else 'OFF'}",
            f"innodb_flush_log_at_trx_commit={1 if durable else 0}",
            "innodb_buffer_pool_dump_at_shutdown=OFF", "innodb_buffer_pool_load_at_startup=OFF",
            "max_connections=100", ""]))
        self.server = None

    def install(self):
        install = "mariadb-install-db" if shutil.which("mariadb-install-db") else "mysql_install_db"
        out = subprocess.run([install, f"--defaults-file={self.cnf}", "--user=root", "--skip-test-db",
                              f"--datadir={self.datadir}"], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{install} failed:\n{out.stdout}{out.stderr}")

    def start(self, timeout=300):
        binary = "mariadbd" if shutil.which("mariadbd") else "mysqld"
        self.server = bl.Server("mariadbd", [binary, f"--defaults-file={self.cnf}"], self.sock, "",
                                self.rundir / "mariadbd.out", timeout=timeout)
        deadline = time.monotonic() + timeout
        while subprocess.run(self.client("mariadb-admin", "ping"), capture_output=True).returncode != 0:
            if self.server.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"mariadbd did not answer:\n{self.errlog.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)

    @property
    def pid(self):
        return self.server.pid

    def client(self, tool, *args):
        return [tool, "--no-defaults", f"--socket={self.sock}", "--user=root", *args]

    def sql(self, query):
        out = subprocess.run(self.client("mariadb", "-N", "-B", "-e", query), capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"mariadb -e {query!r} failed:\n{out.stderr}")
        return out.stdout

    def stop(self, timeout=600):
        """A clean shutdown (SIGTERM)."""
        status = self.server.stop(timeout)
        if status != 0:
            sys.exit(f"mariadbd exited with {status}:\n{self.errlog.read_text(errors='replace')[-3000:]}")

    def kill(self):
        """SIGKILL: for a copy that is thrown away anyway (no shutdown flush through a slow disk)."""
        if self.server is not None:
            self.server.kill()


def sysbench_argv(db, args, command, seconds=None, threads=None):
    argv = ["sysbench", "oltp_read_write", "--db-driver=mysql", "--mysql-user=root", "--mysql-db=sbtest",
            f"--mysql-socket={db.sock}", f"--tables={args.tables}", f"--table-size={args.table_size}",
            f"--threads={threads or args.sysbench_threads}"]
    if command == "run":
        argv += ["--rand-type=pareto", f"--time={seconds}", "--report-interval=10", "--percentile=95"]
    return argv + [command]


_INTERVAL = re.compile(r"^\[ *(\d+)s \] thds: \d+ tps: ([\d.]+) qps: ([\d.]+) .*lat \(ms,95%\): ([\d.]+) "
                       r"err/s: ([\d.]+)")


def parse_sysbench(text):
    def num(pattern, default=float("nan")):
        m = re.search(pattern, text)
        return float(m.group(1)) if m else default
    intervals = [{"t": int(m.group(1)), "tps": float(m.group(2)), "qps": float(m.group(3)),
                  "p95_ms": float(m.group(4)), "err_per_s": float(m.group(5))}
                 for m in (_INTERVAL.match(line) for line in text.splitlines()) if m]
    tps = [i["tps"] for i in intervals]
    mean = statistics.mean(tps) if tps else float("nan")
    return {
        "transactions": num(r"transactions:\s+(\d+)"),
        "tps": num(r"transactions:\s+\d+\s+\(([\d.]+) per sec"),
        "qps": num(r"queries:\s+\d+\s+\(([\d.]+) per sec"),
        "ignored_errors": num(r"ignored errors:\s+(\d+)", 0),
        "reconnects": num(r"reconnects:\s+(\d+)", 0),
        "p95_ms": num(r"95th percentile:\s+([\d.]+)"),
        "avg_ms": num(r"avg:\s+([\d.]+)"),
        "seconds": num(r"total time:\s+([\d.]+)s"),
        "intervals": intervals,
        "cv": statistics.pstdev(tps) / mean if len(tps) > 1 and mean else float("nan"),
    }


def run_sysbench(db, args, seconds, log: Path, during=None):
    """sysbench oltp_read_write run for `seconds`; `during(t0)` (optional) runs meanwhile. Exits the
    script if sysbench fails or reports no transaction."""
    argv = sysbench_argv(db, args, "run", seconds)
    with open(log, "w") as f:
        t0 = time.time()
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, text=True)
        extra = during(t0) if during else None
        try:
            proc.wait(seconds + 300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace")
    if proc.returncode != 0 or "FATAL" in text:
        sys.exit(f"sysbench failed (exit {proc.returncode}): {' '.join(argv)}\n{text[-3000:]}")
    res = parse_sysbench(text)
    if not res["tps"] > 0:
        sys.exit(f"sysbench reported no transactions: {' '.join(argv)}\n{text[-3000:]}")
    res["start"], res["end"] = t0, time.time()
    return res, extra


# --- The prepared database image ----------------------------------------------------------------

def allocated_bytes(path: Path):
    return sum(p.lstat().st_blocks * 512 for p in Path(path).rglob("*") if p.is_file())


def prepared_image(args, work: Path, page_kib):
    """The image with the sysbench tables for `page_kib`, prepared once and kept: (path, meta)."""
    name = f"prepared-{page_kib}k-{args.tables}x{args.table_size}-{args.disk_mib}M"
    img, meta_path = work / f"{name}.img", work / f"{name}.json"
    if img.exists() and meta_path.exists():
        return img, json.loads(meta_path.read_text())
    print(f"preparing {name} (once; kept in {work})", flush=True)
    t0 = time.time()
    tmp = work / f"{name}.tmp.img"
    tmp.unlink(missing_ok=True)
    with open(tmp, "wb") as f:
        f.truncate(args.disk_mib << 20)
    out = subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0",
                          str(tmp)], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"mkfs.ext4 failed:\n{out.stderr}")
    prep = work / "prepare"
    loop = bl.LoopMount(tmp)
    db = None
    try:
        loop.mount(prep / "mnt")
        db = MariaDB(prep / "db", prep / "mnt" / "data", page_kib, args.prepare_pool_mib, doublewrite=False,
                     durable=False)
        db.install()
        db.start()
        db.sql("CREATE DATABASE sbtest")
        sb = subprocess.run(sysbench_argv(db, args, "prepare", threads=min(args.tables, 4)),
                            capture_output=True, text=True)
        if sb.returncode != 0:
            sys.exit(f"sysbench prepare failed:\n{sb.stdout[-2000:]}{sb.stderr[-2000:]}")
        db.sql("SET GLOBAL innodb_fast_shutdown=0")  # purge and merge now, not during the runs
        db.stop()
        data = allocated_bytes(prep / "mnt" / "data")
        tables = sum(p.stat().st_blocks * 512 for p in (prep / "mnt" / "data" / "sbtest").glob("*.ibd"))
        st = os.statvfs(prep / "mnt")
        fs_used = (st.f_blocks - st.f_bfree) * st.f_frsize
    finally:
        if db is not None and db.server is not None and db.server.proc.poll() is None:
            db.kill()
        loop.stop()
    os.replace(tmp, img)
    meta = {"page_kib": page_kib, "tables": args.tables, "table_size": args.table_size, "disk_mib": args.disk_mib,
            "data_bytes": data, "table_bytes": tables, "fs_used_bytes": fs_used,
            "prepare_seconds": round(time.time() - t0, 1), "mariadbd": bl._first_line(["mariadbd", "--version"])}
    meta_path.write_text(json.dumps(meta, indent=2))
    print(f"prepared {name} in {meta['prepare_seconds']} s: data directory {data / 2**20:.0f} MiB "
          f"(tables {tables / 2**20:.0f} MiB), file system {fs_used / 2**20:.0f} MiB used", flush=True)
    return img, meta


def data_ranges(path: Path):
    """The allocated (offset, length) ranges of a sparse file (SEEK_DATA/SEEK_HOLE)."""
    out = []
    fd = os.open(path, os.O_RDONLY)
    try:
        size, off = os.fstat(fd).st_size, 0
        while off < size:
            try:
                start = os.lseek(fd, off, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, end - start))
            off = end
    finally:
        os.close(fd)
    return out


def warm_through(uri, ranges, chunk=1 << 20):
    """Reads every range once through the NBD export at `uri`: (seconds, bytes)."""
    import nbd

    h = nbd.NBD()
    h.connect_uri(uri)
    t0, total = time.time(), 0
    try:
        for off, length in ranges:
            end = off + length
            while off < end:
                n = min(chunk, end - off)
                h.pread(n, off)
                off += n
                total += n
    finally:
        h.shutdown()
    return time.time() - t0, total


# --- One run ------------------------------------------------------------------------------------

class Stack:
    """The storage of one cell: its servers (started in order), the NBD URI mariadbd's stack uses,
    flashtier's control socket, and what it wrote before the measured run. `helpers`: processes the
    storage uses beside its NBD servers (ft-wb+mc's memcached servers), counted in its CPU; their
    owner starts and stops them."""

    def __init__(self, cell, disk: Path, rd: Path, args, binary, cache_bytes, work: Path, serve_extra=(),
                 helpers=()):
        self.servers, self.cgroups, self.control, self.reqlog, self.statsf = [], [], None, None, None
        self.helpers = list(helpers)
        # --ft-set (bench/memcached.py's arguments have none)
        ft_set = [x for kv in getattr(args, "ft_set", None) or [] for x in ("--set", kv)]
        self.format_output = None
        c = cell.config
        if c in ("ssd-direct", "ssd-pagecache"):
            s = bl.nbdkit_file(disk, rd / "ssd.sock", rd / "ssd.log",
                               params=["cache=none"] if c == "ssd-direct" else [])
            self.servers.append(s)
            self.uri = s.uri
            return
        self.reqlog, self.statsf = rd / "slow.requests.log", rd / "slow.stats.txt"
        slow = bl.slow_backing(disk, rd / "slow.sock", rd / "slow.log", self.statsf, self.reqlog,
                               delay_ms=args.delay_ms)
        self.servers.append(slow)
        self.uri = slow.uri
        if c == "slow":
            return
        if c == PASS or c.startswith(PASS + "+"):
            self.control = RUNDIR / "control.sock"
            s = bl.flashtier_serve(binary, slow.uri, rd / "ft.sock", rd / "ft.log",
                                   extra=[*(["--threads", str(args.threads)] if args.threads else []),
                                          "--control-socket", str(self.control),
                                          "--stats-file", str(RUNDIR / "ft.stats"), *ft_set, *serve_extra])
            self.servers.append(s)
            self.uri = s.uri
            return
        cg = bl.MemCgroup(f"oltp-{c}", args.mem_limit_mib << 20)
        self.cgroups.append(cg)
        if c == "nbdkit-cache":
            s = bl.nbdkit_cache_filter(slow.socket, rd / "cache.sock", rd / "cache.log", cache_bytes,
                                       rd / "nbdkit-tmp", cgroup=cg)
        else:
            cache = work / f"ft-cache-{cache_bytes >> 20}M.img"  # prefilled once, formatted every run
            self.format_output = bl.flashtier_format(binary, cache, slow.uri, cache_bytes)
            bl.evict_from_page_cache(cache)
            # Control socket and stats file on tmpfs: wait_io_quiet() watches what the server writes
            # to disk, and the stats file is rewritten every second.
            self.control = RUNDIR / "control.sock"
            s = bl.flashtier_cache_serve(binary, cache, slow.uri, rd / "ft.sock", rd / "ft.log",
                                         mode=FT_MODES[c], threads=args.threads, cgroup=cg,
                                         extra=["--control-socket", str(self.control),
                                                "--stats-file", str(RUNDIR / "ft.stats"), *ft_set, *serve_extra])
        self.servers.append(s)
        self.uri = s.uri

    def cpu(self):
        return sum(s.cpu_seconds() for s in [*self.servers, *self.helpers])

    def flashtier(self):
        return self.servers[-1] if self.control else None

    def stop(self):
        for s in reversed(self.servers):
            s.stop(timeout=120)
        for cg in self.cgroups:
            cg.remove()


def cpu_snapshot(stack, db, fuse):
    return {"storage": stack.cpu(), "mariadbd": db.server.cpu_seconds(),
            "nbdfuse": bl.proc_cpu_seconds(fuse.pid),
            "per_server": {**{f"{s.name}#{i}": s.cpu_seconds() for i, s in enumerate(stack.servers)},
                           **{f"memcached#{i}": h.cpu_seconds() for i, h in enumerate(stack.helpers)}}}


def one_run(cell, rnd, args, binary, work, images, cache_sizes, logs_root, profile=False, serve_extra=(),
            warm=None):
    """One run of `cell`. `serve_extra`: more `flashtier serve` arguments for a PASS stack; `warm`:
    whether to warm the stack before mariadbd starts (default: the configuration is in WARMED), or a
    function warm(stack, ranges) that does and returns the run's "warm" record."""
    img, meta = images[cell.page_kib]
    rd = work / "run"
    if os.path.ismount(rd / "mnt"):
        sys.exit(f"{rd / 'mnt'} is still mounted (left over from an interrupted run?): unmount it first")
    shutil.rmtree(rd, ignore_errors=True)
    rd.mkdir(parents=True)
    logs = logs_root / f"r{rnd}-{cell_key(cell).replace('/', '-')}"
    logs.mkdir(parents=True, exist_ok=True)
    disk = rd / "disk.img"
    t_start = time.time()
    subprocess.run(["cp", "--sparse=always", str(img), str(disk)], check=True)
    bl.evict_from_page_cache(disk)
    cache_bytes = cache_sizes[(cell.page_kib, cell.cache_factor)] if cell.cache_factor else None
    rec = {"cell": cell._asdict(), "key": cell_key(cell), "round": rnd, "cache_bytes": cache_bytes}
    stack = fuse = db = pool = None
    try:
        if cell.config == MC:
            pool = MemcachedPool(args.mc_servers, mc_mib_each(args, img), logs)
            serve_extra = [*serve_extra, "--memcached", pool.arg, "--memcached-mode", "inclusive"]
            rec["serve_extra"] = serve_extra
        stack = Stack(cell, disk, rd, args, binary, cache_bytes, work, serve_extra,
                      helpers=pool.servers if pool else ())
        rec["format_output"] = stack.format_output
        if callable(warm):
            rec["warm"] = warm(stack, data_ranges(disk))
        elif (cell.config in WARMED) if warm is None else warm:
            secs, nbytes = warm_through(stack.uri, data_ranges(disk))
            settle = bl.flashtier_wait_promotions(binary, stack.control) if stack.flashtier() else 0
            rec["warm"] = {"seconds": round(secs + settle, 1), "read_seconds": round(secs, 1), "bytes": nbytes,
                           "flashtier": bl.flashtier_report(binary, stack.control) if stack.flashtier() else None}
        fuse = bl.FuseLoop(stack.uri, rd / "fuse", args.disk_mib << 20, rd / "nbdfuse.log")
        fuse.mount(rd / "mnt")
        db = MariaDB(rd / "db", rd / "mnt" / "data", cell.page_kib, args.pool_mib, cell.doublewrite)
        db.start()
        if args.warmup:
            warm, _ = run_sysbench(db, args, args.warmup, rd / "sysbench-warmup.txt")
            rec["warmup"] = {"tps": warm["tps"], "intervals": warm["intervals"]}
        ft = stack.flashtier()
        rec["flashtier_before"] = bl.flashtier_report(binary, stack.control) if ft else None
        cpu0 = cpu_snapshot(stack, db, fuse)
        during = (lambda t0: profile_windows(t0, args, ft, db, fuse, rd)) if profile else None
        res, prof = run_sysbench(db, args, args.seconds, rd / "sysbench.txt", during)
        cpu1 = cpu_snapshot(stack, db, fuse)
        rec["flashtier_after"] = bl.flashtier_report(binary, stack.control) if ft else None
        if pool is not None:
            rec["memcached_servers"] = pool.stats()
        rec["sysbench"] = res
        rec["cpu_seconds"] = {k: cpu1[k] - cpu0[k] for k in ("storage", "mariadbd", "nbdfuse")}
        rec["cpu_seconds"]["per_server"] = {k: cpu1["per_server"][k] - cpu0["per_server"][k] for k in cpu0["per_server"]}
        kt = res["transactions"] / 1000
        rec["cpu_s_per_1000_txn"] = {k: rec["cpu_seconds"][k] / kt for k in ("storage", "mariadbd", "nbdfuse")}
        rec["profile"] = prof
    finally:
        if db is not None:
            db.kill()
        if fuse is not None:
            fuse.stop()
        if stack is not None:
            stack.stop()
        if pool is not None:
            pool.stop()
        for f in [*rd.glob("*.log"), *rd.glob("*.txt"), *(rd / "db").glob("*.err"), *(rd / "db").glob("*.out"),
                  rd / "db" / "my.cnf"]:
            try:
                shutil.copy2(f, logs / f.name)
            except OSError:
                pass
    if stack.reqlog is not None:
        io = bl.count_backing_io(stack.reqlog, {"measured": (res["start"], res["end"])})["measured"]
        rec["backing_io"] = {op: io.get(op, {"ops": 0, "bytes": 0}) for op in ("read", "write", "flush")}
        rec["backing_stats"] = bl.read_stats_file(stack.statsf)
    shutil.rmtree(rd, ignore_errors=True)  # the copy and the requests log: large, and per run
    (logs / "slow.requests.log").unlink(missing_ok=True)
    rec["run_seconds"] = round(time.time() - t_start, 1)
    return rec


def mc_mib_each(args, img: Path):
    """Memory (-m, MiB) of each of ft-wb+mc's memcached servers: room for --mc-factor × the blocks
    of the image's data, spread over --mc-servers."""
    blocks = img.stat().st_blocks * 512 // BLOCK
    return -(-int(args.mc_factor * blocks) // (args.mc_servers * ITEMS_PER_MIB))


def profile_windows(t0, args, ft, db, fuse, rd):
    """During the measured run of --profile: perf stat of flashtier, mariadbd and nbdfuse, then perf
    record of flashtier, then strace -c of flashtier. Returns the windows and what each recorded."""
    out = {"windows": {}}
    events = ["context-switches", "cpu-migrations", "raw_syscalls:sys_enter"]
    ws = args.profile_window

    def wait_until(t):
        time.sleep(max(0, t0 + t - time.time()))
    counters = {n: bl.PerfCounter(pid, events, rd / f"perfstat-{n}.txt")
                for n, pid in (("flashtier", ft.pid), ("mariadbd", db.pid), ("nbdfuse", fuse.pid))}
    cpu0 = {"flashtier": ft.cpu_seconds(), "mariadbd": db.server.cpu_seconds(), "nbdfuse": bl.proc_cpu_seconds(fuse.pid)}
    wait_until(ws)
    out["perf_stat"] = {n: c.stop() for n, c in counters.items()}
    out["perf_stat_cpu_seconds"] = {"flashtier": ft.cpu_seconds() - cpu0["flashtier"],
                                    "mariadbd": db.server.cpu_seconds() - cpu0["mariadbd"],
                                    "nbdfuse": bl.proc_cpu_seconds(fuse.pid) - cpu0["nbdfuse"]}
    out["windows"]["perf_stat"] = (0, ws)
    perf_data = rd.parent / "oltp-profile-perf.data"
    rec = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "1000", "-g", "-o", str(perf_data),
                            "-p", str(ft.pid)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(2 * ws)
    rec.send_signal(signal.SIGINT)
    rec.wait(30)
    out["windows"]["perf_record"] = (ws, 2 * ws)
    strace_out = rd / "strace-c.txt"
    st = subprocess.Popen(["strace", "-c", "-f", "-o", str(strace_out), "-p", str(ft.pid)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(2 * ws + ws // 2)
    st.send_signal(signal.SIGINT)
    st.wait(30)
    out["windows"]["strace"] = (2 * ws, 2 * ws + ws // 2)
    out["strace_c"] = strace_out.read_text(errors="replace") if strace_out.exists() else ""
    rep = subprocess.run(["perf", "report", "-i", str(perf_data), "--no-children", "--percent-limit", "2",
                          "--stdio"], capture_output=True, text=True)
    out["perf_report"] = rep.stdout
    rep_flat = subprocess.run(["perf", "report", "-i", str(perf_data), "--no-children", "--percent-limit", "1",
                               "--stdio", "-g", "none", "--sort", "dso,sym"], capture_output=True, text=True)
    out["perf_report_flat"] = rep_flat.stdout
    return out


# --- Report -------------------------------------------------------------------------------------

def median(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def summarize(cells, runs):
    rows = []
    for c in cells:
        rs = [r for r in runs if r["key"] == cell_key(c)]
        if not rs:
            continue
        bk = [r.get("backing_io") for r in rs if r.get("backing_io")]
        rows.append({
            "key": cell_key(c), "label": cell_label(c), "cell": c._asdict(), "runs": len(rs),
            "tps": median([r["sysbench"]["tps"] for r in rs]),
            "tps_all": [r["sysbench"]["tps"] for r in rs],
            "p95_ms": median([r["sysbench"]["p95_ms"] for r in rs]),
            "cv": median([r["sysbench"]["cv"] for r in rs]),
            "storage_cpu_s_per_1000": median([r["cpu_s_per_1000_txn"]["storage"] for r in rs]),
            "mariadbd_cpu_s_per_1000": median([r["cpu_s_per_1000_txn"]["mariadbd"] for r in rs]),
            "nbdfuse_cpu_s_per_1000": median([r["cpu_s_per_1000_txn"]["nbdfuse"] for r in rs]),
            "ignored_errors": sum(r["sysbench"]["ignored_errors"] for r in rs),
            "backing_reads": median([b["read"]["ops"] for b in bk]) if bk else None,
            "backing_writes": median([b["write"]["ops"] for b in bk]) if bk else None,
        })
    return rows


def targets(rows):
    by = {r["key"]: r for r in rows}

    def ratio(a, b, field="tps"):
        if a in by and b in by and by[b][field]:
            return by[a][field] / by[b][field]
        return None
    wb, ssd = cell_key(base_cell("ft-wb")), cell_key(base_cell("ssd-direct"))
    wb_off = cell_key(base_cell("ft-wb", doublewrite=False))
    out = []
    if wb in by and ssd in by:
        out.append(("flashtier write-back TPS ≥ 1.0× all-on-SSD without page cache (16K, doublewrite ON)",
                    bl.check_target(ratio(wb, ssd), 1.0)))
    if wb_off in by and ssd in by:
        out.append(("flashtier write-back, doublewrite OFF, TPS ≥ 1.15× all-on-SSD without page cache, "
                    "doublewrite ON", bl.check_target(ratio(wb_off, ssd), 1.15)))
    if wb in by and ssd in by:
        out.append(("flashtier write-back per-10 s TPS CV ≤ all-on-SSD's (ratio ≤ 1.0×)",
                    bl.check_target(ratio(wb, ssd, "cv"), 1.0, higher_is_better=False)))
    info = {}
    pc = cell_key(base_cell("ssd-pagecache"))
    if wb in by and pc in by:
        info["ft-wb ÷ ssd-pagecache (16K, dw ON)"] = ratio(wb, pc)
    wb4_off, ssd4 = cell_key(base_cell("ft-wb", 4, False)), cell_key(base_cell("ssd-direct", 4, True))
    if wb4_off in by and ssd4 in by:
        info["ft-wb dw OFF ÷ ssd-direct dw ON (4K pages)"] = ratio(wb4_off, ssd4)
    for f in (1.0, 0.5):
        mc, alone = cell_key(base_cell(MC, cache_factor=f)), cell_key(base_cell("ft-wb", cache_factor=f))
        if mc in by and alone in by:
            info[f"ft-wb+mc ÷ ft-wb (cache {f:g}× data)"] = ratio(mc, alone)
    return [(what, ("✓ MET" if m == "✓" else "✗ NOT MET" if m == "✗" else m, gap)) for what, (m, gap) in out], info


FT_COUNTERS = ("reads", "writes", "flushes", "read_hits", "read_misses", "hit_ratio", "dirty_blocks",
               "cached_blocks")


def flatten(d, prefix=""):
    out = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = v
    return out


def flashtier_delta(rec):
    """Numeric counters of flashtier's report after the measured run, and their change during it."""
    a, b = flatten(rec.get("flashtier_before")), flatten(rec.get("flashtier_after"))
    return {k: {"after": v, "delta": v - a[k] if k in a else None} for k, v in b.items()}


def report(args, machine, cells, runs, images, cache_sizes, wall, out):
    rows = summarize(cells, runs)
    tgts, info = targets(rows)
    for r in runs:
        if r.get("flashtier_after"):
            r["flashtier_counters"] = flashtier_delta(r)
    doc = {"machine": machine, "args": vars(args), "images": {str(k): v[1] for k, v in images.items()},
           "cache_bytes": {f"{k[0]}k/{k[1]:g}x": v for k, v in cache_sizes.items()},
           "wall_seconds": round(wall, 1), "rows": rows, "targets": tgts, "info_ratios": info, "runs": runs}
    m16 = images.get(16, images.get(4))[1]
    lines = bl.results_header("MariaDB + sysbench oltp_read_write on each storage configuration", machine, args.quick)
    lines += [
        f"Whole run: **{wall / 60:.1f} min** wall time ({len(runs)} runs; {args.repeat} round(s), interleaved).",
        "",
        "Stack: mariadbd → ext4 → loop device (O_DIRECT on its file) → nbdfuse → the configuration's NBD export. "
        f"sysbench oltp_read_write, {args.tables} tables × {args.table_size:,} rows, --rand-type=pareto, "
        f"{args.sysbench_threads} threads; InnoDB buffer pool {args.pool_mib} MiB, data directory "
        + ", ".join(f"{m['data_bytes'] / 2**20:.0f} MiB at {p}K pages (tables {m['table_bytes'] / 2**20:.0f} MiB)"
                    for p, (_, m) in sorted(images.items()))
        + f" (≈{m16['data_bytes'] / (args.pool_mib << 20):.0f}× the pool), innodb_flush_log_at_trx_commit=1, "
        f"innodb_flush_method default (O_DIRECT). Slow disk: one request at a time, {args.delay_ms} ms per read and "
        f"write. Caches live on the local disk ({machine.get('disk', '?')}); the cache servers run in memory cgroups "
        f"of {args.mem_limit_mib} MiB (page cache included); cache size = factor × data directory. Cached "
        "configurations and ssd-pagecache are warmed by reading the image's allocated ranges once through the "
        f"export. Each run: {args.warmup} s warm-up (not counted), {args.seconds} s measured. Figures are medians "
        "over rounds. CPU: user+system seconds of the storage server processes (all NBD servers under nbdfuse) "
        "and of mariadbd per 1,000 transactions (nbdfuse's in the JSON). CV: standard deviation ÷ mean of the "
        "per-10 s TPS of the measured run. Backing I/O: requests the slow disk served during the measured run.",
        "",
        "| configuration | page | doublewrite | cache | TPS | p95 ms | storage CPU s/1000 txn | mariadbd CPU s/1000 txn "
        "| per-10 s TPS CV | slow-disk reads / writes | ignored errors |",
        "|---|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c = r["cell"]
        cache = f"{c['cache_factor']:g}× ({cache_sizes[(c['page_kib'], c['cache_factor'])] >> 20} MiB)" \
            if c["cache_factor"] else "—"
        bk = f"{r['backing_reads']:,.0f} / {r['backing_writes']:,.0f}" if r["backing_reads"] is not None else "—"
        lines.append(f"| {c['config']} | {c['page_kib']}K | {'ON' if c['doublewrite'] else 'OFF'} | {cache} | "
                     f"{r['tps']:,.1f} | {r['p95_ms']:,.1f} | {r['storage_cpu_s_per_1000']:.2f} | "
                     f"{r['mariadbd_cpu_s_per_1000']:.2f} | {r['cv']:.3f} | {bk} | {r['ignored_errors']:.0f} |")
    lines += ["", "Configurations: " + "; ".join(f"**{k}**: {v}" for k, v in CONFIGS.items())
              + ". (flashtier pass-through with memcached, WaffleGrid's experiment: bench/memcached.py.)", ""]
    if tgts:
        lines += ["Targets (issue 14), measured in this run:", "", *bl.targets_table(tgts), ""]
    if info:
        lines += ["Peers for reference: " + "; ".join(f"{k}: {v:.2f}×" for k, v in info.items()), ""]
    ft_runs = [r for r in runs if r.get("flashtier_counters")]
    if ft_runs:
        lines += ["flashtier's counters over each measured run (`flashtier stats --json` after minus before; "
                  "all counters in oltp.json). Device ÷ client writes: the bytes flashtier wrote to the cache "
                  "device (log, blocks moved by reclaim, checkpoints) per byte the clients wrote, what the SSD's "
                  "endurance pays:", "",
                  "| run | " + " | ".join(h for h, _ in FT_SHOW) + " | read hit % | device ÷ client writes |",
                  "|---|" + "---:|" * (len(FT_SHOW) + 2)]
        for r in ft_runs:
            fc = r["flashtier_counters"]
            cells_txt = []
            for _, k in FT_SHOW:
                v = fc.get(k, {})
                x = v.get("after") if k.startswith("status.") else v.get("delta")
                cells_txt.append("?" if x is None else f"{x:,.0f}")
            hit, miss = (fc.get(f"counters.read_{k}_blocks", {}).get("delta") for k in ("hit", "miss"))
            cells_txt.append(f"{100 * hit / (hit + miss):.1f}" if hit is not None and miss is not None and hit + miss
                             else "?")
            dev, cli = (fc.get(f"counters.{k}_write_bytes", {}).get("delta") for k in ("cache", "client"))
            cells_txt.append(f"{dev / cli:.1f}×" if dev is not None and cli else "?")
            lines.append(f"| {cell_label(Cell(**r['cell']))} round {r['round'] + 1} | " + " | ".join(cells_txt) + " |")
        lines.append("")
    lines += memcached_table(runs)
    lines += ["Per run (seconds): " + "; ".join(
        f"{r['key']} r{r['round'] + 1}: {r['run_seconds']:.0f} s" + (f" (warm {r['warm']['seconds']:.0f} s)" if r.get('warm') else "")
        for r in runs), "",
        "Preparation (once per page size, kept in --workdir): " + "; ".join(
            f"{p}K: {m['prepare_seconds']:.0f} s" for p, (_, m) in sorted(images.items())), "",
        "![per-10-second TPS of each configuration](oltp.png)"]
    bl.write_results(out, "oltp", doc, lines)
    plot(out / "oltp.png", cells, runs, rows, args)
    return rows


def mc_figures(rec):
    """What a ft-wb+mc run's memcached tier did: flashtier's counters (blocks looked up, hit and stored
    during the measured run, stored while warming) and memcached's own at the end of the run."""
    fc = rec.get("flashtier_counters") or flashtier_delta(rec)
    warm = flatten((rec.get("warm") or {}).get("flashtier"))
    out = {f: (fc.get(f"counters.memcached_{f}_blocks") or {}).get("delta") for f in ("lookup", "hit", "stored")}
    out["stored_while_warming"] = warm.get("counters.memcached_stored_blocks")
    out["hits_since_start"] = (fc.get("counters.memcached_hit_blocks") or {}).get("after")
    out["memcached"] = pool_totals(rec.get("memcached_servers"))
    return out


def memcached_table(runs):
    mc_runs = [r for r in runs if r["cell"]["config"] == MC]
    if not mc_runs:
        return []
    lines = ["ft-wb+mc's memcached tier over each measured run (flashtier's `memcached_*_blocks` counters; "
             "memcached's `stats` at the end of the run, all servers):", "",
             "| run | blocks looked up | hits | hit % | stored | stored while warming | memcached items | "
             "memcached evictions | memcached CPU s, whole run |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def n(x):
        return "?" if x is None else f"{x:,.0f}"
    for r in mc_runs:
        m = mc_figures(r)
        pool = m["memcached"] or {}
        hit_pct = f"{100 * m['hit'] / m['lookup']:.1f}" if m["lookup"] and m["hit"] is not None else "?"
        cpu = pool.get("cpu_seconds")
        lines.append(f"| {cell_label(Cell(**r['cell']))} round {r['round'] + 1} | {n(m['lookup'])} | {n(m['hit'])} | "
                     f"{hit_pct} | {n(m['stored'])} | {n(m['stored_while_warming'])} | {n(pool.get('curr_items'))} | "
                     f"{n(pool.get('evictions'))} | {'?' if cpu is None else f'{cpu:.1f}'} |")
    return lines + [""]


def plot(path, cells, runs, rows, args):
    plt = bl.pyplot()
    by = {r["key"]: r for r in rows}
    cells = [c for c in cells if cell_key(c) in by]
    n = len(cells)
    cols = 3 if n > 4 else n
    nrows = -(-n // cols) + 1
    fig = plt.figure(figsize=(5 * cols, 2.6 * nrows + 1))
    gs = fig.add_gridspec(nrows, cols)
    ax0 = fig.add_subplot(gs[0, :])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    base = [c for c in cells if c.page_kib == 16 and c.doublewrite and c.cache_factor in (None, 2.0)]
    for i, c in enumerate(base):
        for r in [r for r in runs if r["key"] == cell_key(c)][:1]:
            iv = r["sysbench"]["intervals"]
            ax0.plot([x["t"] for x in iv], [max(x["tps"], 0.1) for x in iv], marker="o", ms=3,
                     color=colors[i % len(colors)], label=c.config)
    ax0.set_yscale("log")
    ax0.set_xlabel("seconds of the measured run")
    ax0.set_ylabel("TPS per 10 s (log)")
    ax0.set_title("Base factors (16K pages, doublewrite ON, cache 2× data): per-10-second TPS, first round")
    if base:
        ax0.legend(fontsize=8, ncol=4)
    for k, c in enumerate(cells):
        ax = fig.add_subplot(gs[1 + k // cols, k % cols])
        for j, r in enumerate(r for r in runs if r["key"] == cell_key(c)):
            iv = r["sysbench"]["intervals"]
            ax.plot([x["t"] for x in iv], [x["tps"] for x in iv], marker="o", ms=3, color=colors[j % len(colors)],
                    label=f"round {r['round'] + 1}")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{cell_label(c)}\nmedian {by[cell_key(c)]['tps']:.1f} TPS, CV {by[cell_key(c)]['cv']:.2f}",
                     fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("s", fontsize=7)
    bl.save_figure(fig, path, args.quick)


# flashtier counters shown in the table: (column, key of the flattened `stats --json` report);
# counters show their change over the measured run, levels (status.*) their value after it.
FT_SHOW = [("client reads", "counters.client_reads"), ("read hit blocks", "counters.read_hit_blocks"),
           ("read miss blocks", "counters.read_miss_blocks"), ("client writes", "counters.client_writes"),
           ("client flushes", "counters.client_flushes"), ("cache syncs", "counters.cache_syncs"),
           ("backing reads", "counters.backing_reads"), ("backing writes", "counters.backing_writes"),
           ("promoted blocks", "counters.promoted_blocks"), ("evicted blocks", "counters.evicted_blocks"),
           ("moved blocks", "counters.moved_blocks"),
           ("cached blocks after", "status.cached_blocks"), ("dirty blocks after", "status.dirty_blocks")]


def profile_report(args, machine, rec, out):
    prof = rec["profile"]
    iv = {x["t"]: x["tps"] for x in rec["sysbench"]["intervals"]}

    def txns(window):
        a, b = window
        return sum(iv.get(t, 0) * 10 for t in range(a + 10, b + 1, 10))
    lines = bl.results_header("Profile: flashtier write-back under MariaDB + sysbench (raw)", machine, args.quick)
    lines += [f"Cell: {cell_label(Cell(**rec['cell']))}; measured run {args.seconds} s at "
              f"{rec['sysbench']['tps']:.1f} TPS (p95 {rec['sysbench']['p95_ms']:.1f} ms). Windows (seconds of the "
              f"measured run): perf stat {prof['windows']['perf_stat']}, perf record -e cpu-clock -g of flashtier "
              f"{prof['windows']['perf_record']}, strace -c -f of flashtier {prof['windows']['strace']} (strace slows "
              "the server; its counts are per window, not per transaction).", "",
              "Per transaction during the perf stat window (transactions from sysbench's 10 s reports):", "",
              "| process | CPU ms/txn | context switches/txn | CPU migrations/txn | syscalls/txn |", "|---|---:|---:|---:|---:|"]
    t = txns(prof["windows"]["perf_stat"]) or float("nan")
    per = {}
    for name, counts in prof["perf_stat"].items():
        cs, mig, sc = (counts.get(e) for e in ("context-switches", "cpu-migrations", "raw_syscalls:sys_enter"))
        cpu = prof["perf_stat_cpu_seconds"][name]
        per[name] = {"cpu_ms": cpu * 1000 / t, "cs": (cs or 0) / t, "mig": (mig or 0) / t, "syscalls": (sc or 0) / t}
        lines.append(f"| {name} | {per[name]['cpu_ms']:.2f} | {per[name]['cs']:.1f} | {per[name]['mig']:.1f} | "
                     f"{per[name]['syscalls']:.1f} |")
    lines += ["", f"Transactions in the window: {t:,.0f}.", "",
              "flashtier's latency figures after the run (`stats --json`, every numeric field with 'lat' or 'us' in its name):", "",
              "```"]
    fa = flatten(rec.get("flashtier_after"))
    lines += [f"{k} = {v}" for k, v in fa.items() if "lat" in k or k.endswith("_us")][:80]
    lines += ["```", "", "`perf report --no-children --percent-limit 1 --stdio -g none --sort dso,sym` (flashtier):", "",
              "```", *prof["perf_report_flat"].splitlines()[:80], "```", "",
              "`strace -c -f` (flashtier):", "", "```", *prof["strace_c"].splitlines()[:40], "```", "",
              "`perf report --no-children --percent-limit 2 --stdio` (call graphs): in oltp_profile_raw.json."]
    doc = {"machine": machine, "args": vars(args), "run": rec, "per_txn": per, "txns_in_perf_stat_window": t}
    bl.write_results(out, "oltp_profile_raw", doc, lines)


# --- main ---------------------------------------------------------------------------------------

def add_database_args(ap):
    """The run, database and slow-disk arguments (also bench/memcached.py's)."""
    ap.add_argument("--seconds", type=int, default=60,
                    help="measured seconds per run (default 60; --quick 20: two 10 s reports)")
    ap.add_argument("--warmup", type=int, default=20,
                    help="seconds of load after mariadbd starts, not counted (default 20; --quick 5)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds: each runs every cell of the matrix once, interleaved (default 1)")
    ap.add_argument("--sysbench-threads", type=int, default=8, help="sysbench --threads (default 8)")
    ap.add_argument("--tables", type=int, default=8, help="sysbench tables (default 8; --quick 4)")
    ap.add_argument("--table-size", type=int, default=265_000,
                    help="rows per table (default 265000: ~640 MB of tables, 20× the pool; --quick 100000)")
    ap.add_argument("--pool-mib", type=int, default=32, help="InnoDB buffer pool MiB (default 32; --quick 8)")
    ap.add_argument("--prepare-pool-mib", type=int, default=512,
                    help="InnoDB buffer pool MiB while preparing the data (default 512)")
    ap.add_argument("--disk-mib", type=int, default=2048, help="size of the database's disk (default 2048; --quick 512)")
    ap.add_argument("--delay-ms", type=int, default=4, help="slow disk delay per read and write (default 4)")


def quick_sizes(args):
    """--quick's sizes and durations."""
    args.seconds, args.warmup, args.tables, args.table_size = 20, 5, 4, 100_000
    args.pool_mib, args.disk_mib = 8, 512


def setup_run(args, *tools):
    """bl.setup for database runs: the tools they need (and `tools`), mariadbd, the flashtier binary,
    the work directory and the machine's description with mariadbd's and sysbench's versions."""
    binary, work, machine = bl.setup(args, "nbdkit", "nbdfuse", "fusermount3", "losetup", "mkfs.ext4", "mount",
                                     "sysbench", "mariadb", "mariadb-admin", *tools)
    if not (shutil.which("mariadbd") or shutil.which("mysqld")):
        sys.exit("mariadbd is not installed (scripts/install-deps.sh installs mariadb-server)")
    machine["mariadbd"] = bl._first_line(["mariadbd", "--version"])
    machine["sysbench"] = bl._first_line(["sysbench", "--version"])
    return binary, work, machine


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_common_args(ap, workdir="/var/tmp/flashtier-oltp")
    add_database_args(ap)
    ap.add_argument("--mem-limit-mib", type=int, default=512,
                    help="memory cgroup limit of each cache server, page cache included (default 512)")
    ap.add_argument("--only", metavar="CONFIG,...",
                    help=f"run only these configurations' cells of the matrix ({', '.join(CONFIGS)}); with "
                         "--quick, the base cell of each")
    ap.add_argument("--cells", metavar="KEY,...",
                    help="run only these cells of the full matrix, by key as the report names them "
                         "(e.g. ft-wb/16k/dwon/cache2x,ssd-direct/16k/dwon); combines with --only. A "
                         "cached configuration's cell may name any cache factor (e.g. "
                         "ft-wb/16k/dwon/cache10x: a cache that reclaim never has to empty in a run)")
    ap.add_argument("--ft-set", action="append", metavar="NAME=VALUE",
                    help="a live parameter for every `flashtier serve` of the run (its --set), e.g. "
                         "reclaim_compact_pct=90; repeatable. Recorded in the JSON's args.")
    ap.add_argument("--mc-servers", type=int, default=2,
                    help="memcached servers of ft-wb+mc's pool, on loopback ports (default 2)")
    ap.add_argument("--mc-factor", type=float, default=1.25,
                    help="room in ft-wb+mc's memcached pool, as a multiple of the data's 4 KiB blocks "
                         "(default 1.25: all of it, and the blocks written meanwhile)")
    ap.add_argument("--profile", action="store_true",
                    help="profile one ft-wb run (base factors) instead of the matrix: perf stat, perf record, "
                         "strace -c; writes oltp_profile_raw.{md,json}")
    ap.add_argument("--profile-window", type=int, default=20,
                    help="seconds of each --profile window (default 20; --seconds must be ≥ 2.5× it)")
    args = ap.parse_args()
    if args.quick:
        quick_sizes(args)
    if os.geteuid() != 0:
        ap.error("needs root (loop devices, mounts, memory cgroups)")
    if args.profile and args.seconds < 2.5 * args.profile_window + 5:
        ap.error("--profile needs --seconds ≥ 2.5 × --profile-window + 5")
    t_all = time.time()
    cells = [base_cell("ft-wb")] if args.profile else quick_matrix() if args.quick else full_matrix()
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - set(CONFIGS)
        if unknown:
            ap.error(f"--only: unknown configurations {', '.join(sorted(unknown))}")
        # --quick --only: the base cell of each named configuration (a quick check of any of them).
        cells = [home_cell(c) for c in CONFIGS if c in wanted] if args.quick else \
            [c for c in cells if c.config in wanted]
    if args.cells:
        keys = args.cells.split(",")
        matrix = {cell_key(c) for c in full_matrix()}
        outside = {k: cell_of_key(k) for k in keys if k not in matrix}
        unknown = [k for k, c in outside.items() if c is None]
        if unknown:
            ap.error(f"--cells: not in the matrix: {', '.join(sorted(unknown))} "
                     f"(cells: {', '.join(cell_key(c) for c in full_matrix())}, or a cached "
                     "configuration's cell at another cache factor)")
        extra = [c for c in outside.values() if not args.only or c.config in args.only.split(",")]
        cells = [c for c in cells + extra if cell_key(c) in keys]
        if not cells:
            ap.error("--cells: none of these cells is in the selected matrix")
    with_mc = any(c.config == MC for c in cells)
    binary, work, machine = setup_run(args, *(["perf", "strace"] if args.profile else []),
                                      *([MEMCACHED] if with_mc else []))
    if with_mc:
        machine["memcached"] = bl._first_line([MEMCACHED, "--version"])
    images = {p: prepared_image(args, work, p) for p in sorted({c.page_kib for c in cells}, reverse=True)}
    cache_sizes = {}
    for c in cells:
        if c.cache_factor:
            data = images[c.page_kib][1]["data_bytes"]
            cache_sizes[(c.page_kib, c.cache_factor)] = -(-int(data * c.cache_factor) // (4 << 20)) * (4 << 20)
    RUNDIR.mkdir(mode=0o755, exist_ok=True)
    atexit.register(shutil.rmtree, RUNDIR, ignore_errors=True)
    logs_root = work / "logs"
    shutil.rmtree(logs_root, ignore_errors=True)
    runs = []
    for rnd in range(args.repeat):
        order = cells if rnd % 2 == 0 else cells[::-1]
        for c in order:
            print(f"round {rnd + 1}/{args.repeat}: {cell_label(c)} ...", flush=True)
            rec = one_run(c, rnd, args, binary, work, images, cache_sizes, logs_root, profile=args.profile)
            runs.append(rec)
            sb = rec["sysbench"]
            print(f"  {sb['tps']:.1f} TPS, p95 {sb['p95_ms']:.1f} ms, CV {sb['cv']:.3f}, storage CPU "
                  f"{rec['cpu_s_per_1000_txn']['storage']:.2f} s/1000 txn, mariadbd "
                  f"{rec['cpu_s_per_1000_txn']['mariadbd']:.2f}; run {rec['run_seconds']:.0f} s", flush=True)
    out = bl.results_dir(args)
    if args.profile:
        profile_report(args, machine, runs[0], out)
        return
    report(args, machine, cells, runs, images, cache_sizes, time.time() - t_all, out)
    if not (out / "oltp.json").exists():
        sys.exit("oltp.json was not written")
    bad = [r["key"] for r in runs if not r["sysbench"]["tps"] > 0]
    if bad:
        sys.exit(f"no transactions in: {', '.join(bad)}")
    for r in runs:
        if r["cell"]["config"] == MC:
            m = mc_figures(r)
            if not (m["stored_while_warming"] and m["hits_since_start"]):
                sys.exit(f"{r['key']}: the memcached tier stored {m['stored_while_warming']} blocks while warming "
                         f"and was hit {m['hits_since_start']} times: is it wired to flashtier?")
    print(f"whole run: {(time.time() - t_all) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
