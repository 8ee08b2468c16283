"""Shared pieces of flashtier's benchmarks: servers, fio, CPU accounting, result files.

Benchmarks compare flashtier with a peer measured in the same run, on the same files, as ratios.
The machine is shared and noisy, so every comparison is interleaved (peer, flashtier, flashtier,
peer, ...) over several rounds and reported as medians, together with the server's CPU time per
I/O, which is far less sensitive to noise from other processes than IOPS.
"""

import atexit
import datetime
import fcntl
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


def ensure_matplotlib():
    """Imports matplotlib; if this interpreter lacks it, re-runs the script under Debian's
    /usr/bin/python3 when that has it (python3-matplotlib, from scripts/install-deps.sh), else in a
    private venv with matplotlib from PyPI."""
    try:
        import matplotlib  # noqa: F401

        return
    except ImportError:
        pass
    system = Path("/usr/bin/python3")
    if Path(sys.executable).resolve() != system.resolve() and system.exists() and subprocess.run(
            [str(system), "-c", "import matplotlib"], capture_output=True).returncode == 0:
        os.execv(str(system), [str(system), str(Path(sys.argv[0]).resolve())] + sys.argv[1:])
    venv = Path.home() / ".cache" / "flashtier-bench-venv"
    py = venv / "bin" / "python3"
    # The venv's python is a symlink to the base interpreter, so compare prefixes, not binaries.
    if Path(sys.prefix).resolve() == venv.resolve():
        sys.exit("matplotlib is still missing inside the benchmark venv")
    print("matplotlib is missing (scripts/install-deps.sh installs python3-matplotlib): installing it "
          f"into {venv}", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "matplotlib"], check=True)
    os.execv(str(py), [str(py), str(Path(sys.argv[0]).resolve())] + sys.argv[1:])


def cargo_target_dir() -> Path:
    """Where cargo puts its output: $CARGO_TARGET_DIR if set (cargo honours it too), else target/."""
    d = os.environ.get("CARGO_TARGET_DIR")
    return Path(d) if d else REPO / "target"


def build_flashtier():
    """Builds the release binary (into $CARGO_TARGET_DIR, default target/) and returns its path."""
    subprocess.run(
        ["cargo", "build", "--release", "--locked", "-q", "-p", "flashtier"],
        cwd=REPO,
        check=True,
    )
    return cargo_target_dir() / "release" / "flashtier"


def flashtier_binary(path=None) -> Path:
    """The flashtier binary to benchmark: `path` (--flashtier), else $FLASHTIER_BIN, else a fresh
    release build (see build_flashtier)."""
    path = path or os.environ.get("FLASHTIER_BIN")
    if path:
        p = Path(path)
        if not os.access(p, os.X_OK):
            sys.exit(f"flashtier binary {p} does not exist or is not executable")
        return p.resolve()
    return build_flashtier()


def require(*tools):
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        sys.exit(f"missing tools: {', '.join(missing)} (run scripts/install-deps.sh)")


def make_random_file(path: Path, size: int):
    """A file of random bytes (so nothing is sparse or compressible), reused across runs. It is
    written back and dropped from the page cache before returning, so no write-back of it runs
    behind the measurements and no peer finds it cached."""
    if not (path.exists() and path.stat().st_size == size):
        chunk = 16 << 20
        with open(path, "wb") as f:
            left = size
            while left:
                n = min(chunk, left)
                f.write(os.urandom(n))
                left -= n
    evict_from_page_cache(path)


def copy_file(src: Path, dst: Path):
    """Copies a file, then writes the copy back and drops it from the page cache (as make_random_file)."""
    shutil.copyfile(src, dst)
    evict_from_page_cache(dst)


def warm_page_cache(path: Path):
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass


def evict_from_page_cache(path: Path):
    """Writes back and drops one file's pages from the kernel page cache (no other file is touched)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_LIVE = []  # servers, mounts and cgroups this script started and has not stopped or removed yet


def _cleanup():
    """Stops every server still running, takes down every FUSE/loop/mount stack still up and removes
    every memory cgroup still there, newest first: runs at exit,
    including sys.exit() on an error and the SIGTERM/SIGHUP handler below."""
    for obj in reversed(list(_LIVE)):
        try:
            obj.stop() if hasattr(obj, "stop") else obj.remove()
        except Exception as e:  # noqa: BLE001 - keep cleaning up the rest
            print(f"warning: cleanup of {obj}: {e}", flush=True)


def _exit_on_signal(signum, _frame):
    raise SystemExit(128 + signum)  # unwinds try/finally blocks, then atexit runs _cleanup


atexit.register(_cleanup)
for _sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, _exit_on_signal)


class Server:
    """A server process listening on a unix socket; stopped at exit if the script does not stop it.

    Ready when `ready_line` (if given) appears on its stdout, else when the socket exists.
    `ready_ms` is the time from exec to ready (for `ready_line`, to that line: what a client could
    wait for). stdout and stderr go to `log`.

    `cgroup` (a MemCgroup) puts the process into a memory cgroup before it execs, so everything it
    allocates or faults into the page cache is charged there from the start."""

    def __init__(self, name, argv, socket: Path, uri: str, log: Path, env=None, cgroup=None, ready_line=None,
                 timeout=60):
        self.name, self.socket, self.uri, self.log_path = name, Path(socket), uri, Path(log)
        self.cgroup = cgroup
        if self.socket.exists():
            self.socket.unlink()
        self.log_path.write_text("")
        self.log = open(self.log_path, "a", buffering=1)  # O_APPEND: the server writes to it too
        if cgroup is not None:
            argv = cgroup.wrap(argv)
        self.argv = [str(a) for a in argv]
        ready = threading.Event()
        self._pump = None
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE if ready_line else self.log,
                                     stderr=self.log, env=env, text=True)
        _LIVE.append(self)
        self.ready_ms = None
        if ready_line:
            def pump():
                for line in self.proc.stdout:
                    if self.ready_ms is None and ready_line in line:
                        self.ready_ms = (time.monotonic() - t0) * 1000
                        ready.set()
                    self.log.write(line)
            self._pump = threading.Thread(target=pump, daemon=True)
            self._pump.start()
        deadline = time.monotonic() + timeout
        while not (ready.is_set() if ready_line else self.socket.exists()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with status {self.proc.returncode}" if self.proc.poll() is not None
                       else f"was not ready after {timeout} s")
                self.stop()
                sys.exit(f"{name} {why}: {' '.join(self.argv)}\n--- {self.log_path} ---\n"
                         + self.log_text()[-3000:])
            time.sleep(0.002)
        if not ready_line:
            self.ready_ms = (time.monotonic() - t0) * 1000

    def __repr__(self):
        return f"{self.name} (pid {self.proc.pid})"

    @property
    def pid(self):
        return self.proc.pid

    def cpu_seconds(self):
        """User + system CPU time of the server so far (all threads)."""
        return proc_cpu_seconds(self.proc.pid)

    def io_counters(self):
        return proc_io(self.proc.pid)

    def rss_kib(self, settle=0.0):
        """VmRSS now, or after `settle` seconds (let an idle server finish what it started)."""
        time.sleep(settle)
        return proc_status(self.proc.pid).get("VmRSS", 0)

    def wait_io_quiet(self, quiet=2.0, timeout=300.0):
        """Waits until the server has written nothing to storage for `quiet` seconds (e.g. queued
        promotions have reached the cache device). Returns the seconds waited."""
        t0 = time.time()
        last, since = self.io_counters()["write_bytes"], time.time()
        while time.time() - since < quiet:
            if time.time() - t0 > timeout:
                print(f"warning: {self.name} still writing after {timeout:.0f} s", flush=True)
                break
            time.sleep(0.25)
            now = self.io_counters()["write_bytes"]
            if now != last:
                last, since = now, time.time()
        return time.time() - t0

    def stop(self, timeout=60):
        """SIGTERM (a graceful shutdown), SIGKILL after `timeout` seconds. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"warning: {self.name} did not stop within {timeout} s of SIGTERM: killed", flush=True)
                self.proc.kill()
                self.proc.wait()
        return self._closed()

    def kill(self):
        """SIGKILL: a crash, as far as the server can tell. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        return self._closed()

    def _closed(self):
        if self in _LIVE:
            _LIVE.remove(self)
        if self._pump is not None:
            self._pump.join(5)  # it ends at EOF, once the server (and any child) has exited
        if not self.log.closed:
            self.log.close()
        if self.socket.exists():
            self.socket.unlink()
        return self.proc.returncode

    def log_text(self):
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")


def proc_cpu_seconds(pid):
    """User + system CPU time of a process so far (all threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_io(pid):
    """/proc/PID/io of a whole process: rchar, wchar, syscr, syscw, read_bytes, write_bytes (the
    last two are what reached the block layer, O_DIRECT included)."""
    out = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def proc_status(pid):
    """Numeric fields of /proc/PID/status in kB (VmRSS, VmHWM, ...)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            parts = v.split()
            if parts and parts[0].isdigit():
                out[k] = int(parts[0])
    return out


class MemCgroup:
    """A cgroup-v1 memory cgroup with a limit (page cache included), removed by remove()."""

    ROOT = Path("/sys/fs/cgroup/memory")

    def __init__(self, name: str, limit_bytes: int):
        if not (self.ROOT / "cgroup.procs").exists():
            sys.exit(f"no cgroup-v1 memory controller at {self.ROOT}; cannot limit the page cache")
        self.path = self.ROOT / f"flashtier-bench-{name}"
        self.limit = limit_bytes
        if self.path.exists():
            self.remove()
        self.path.mkdir()
        _LIVE.append(self)
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))

    def __repr__(self):
        return f"memory cgroup {self.path}"

    def wrap(self, argv):
        """argv run inside this cgroup: a shell joins it, then execs the command (same PID)."""
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh", *[str(a) for a in argv]]

    def stat(self):
        out = {}
        for line in (self.path / "memory.stat").read_text().splitlines():
            k, v = line.split()
            out[k] = int(v)
        for f in ("usage_in_bytes", "max_usage_in_bytes", "failcnt"):
            out[f] = int((self.path / f"memory.{f}").read_text())
        return out

    def remove(self):
        if self in _LIVE:
            _LIVE.remove(self)
        try:
            for pid in (self.path / "cgroup.procs").read_text().split():
                try:
                    (self.ROOT / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            self.path.rmdir()
        except OSError as e:
            print(f"warning: cannot remove {self.path}: {e}", flush=True)


def _run_quiet(argv):
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True)


def _unmount(mnt):
    """Unmounts `mnt`, lazily (detached now, gone once nothing uses it) if it is busy."""
    if _run_quiet(["umount", mnt]).returncode != 0:
        _run_quiet(["umount", "-l", mnt])


def _run_checked(argv, what=None):
    out = _run_quiet(argv)
    if out.returncode != 0:
        raise RuntimeError(f"{what or ' '.join(map(str, argv))} failed (exit {out.returncode}):\n"
                           f"{out.stdout}{out.stderr}")
    return out.stdout


class LoopMount:
    """A loop device on `file` (with `direct_io`: the loop device reads and writes the file with
    O_DIRECT, so no page cache sits between the file system on it and the file), optionally
    mounted; stop() (also at exit) unmounts, detaches it and waits until the kernel let go."""

    def __init__(self, file: Path, direct_io=False):
        argv = ["losetup", "--find", "--show", *(["--direct-io=on"] if direct_io else []), str(file)]
        self.dev = _run_checked(argv).strip()
        if not self.dev.startswith("/dev/loop"):
            raise RuntimeError(f"losetup printed {self.dev!r}")
        self.mnt = None
        _LIVE.append(self)

    def __repr__(self):
        return f"loop device {self.dev}" + (f" mounted on {self.mnt}" if self.mnt else "")

    def mount(self, mnt: Path, options=None):
        Path(mnt).mkdir(parents=True, exist_ok=True)
        _run_checked(["mount", *(["-o", options] if options else []), self.dev, mnt])
        self.mnt = Path(mnt)

    def umount(self):
        if self.mnt is not None:
            _unmount(self.mnt)
            self.mnt = None

    def stop(self):
        if self in _LIVE:
            _LIVE.remove(self)
        self.umount()
        if self.dev:
            _run_quiet(["losetup", "-d", self.dev])
            backing = Path(f"/sys/block/{Path(self.dev).name}/loop/backing_file")
            deadline = time.monotonic() + 20
            while backing.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            self.dev = None


class FuseLoop:
    """An NBD export as a block device without the nbd kernel module: nbdfuse exposes it as the
    file FUSE_DIR/nbd, and a LoopMount (O_DIRECT by default) sits on that file. stop() (also at
    exit) unmounts, detaches the loop device, then unmounts the FUSE file system and waits for
    nbdfuse; stop the NBD server only after it."""

    def __init__(self, uri: str, fuse_dir: Path, size: int, log: Path, direct_io=True, timeout=30):
        self.fuse_dir = Path(fuse_dir)
        self.fuse_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(log, "w")
        self.proc = subprocess.Popen(["nbdfuse", str(self.fuse_dir), uri], stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=self.log)
        self.loop = None
        _LIVE.append(self)
        file = self.fuse_dir / "nbd"
        deadline = time.monotonic() + timeout
        while not (file.exists() and file.stat().st_size == size):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"nbdfuse did not expose {file} ({size} bytes) for {uri}; see {log}")
            time.sleep(0.02)
        self.loop = LoopMount(file, direct_io)
        self.dev = self.loop.dev

    def __repr__(self):
        return f"nbdfuse {self.fuse_dir} (pid {self.proc.pid})"

    @property
    def pid(self):
        return self.proc.pid

    def mount(self, mnt: Path, options=None):
        self.loop.mount(mnt, options)

    def stop(self):
        if self in _LIVE:
            _LIVE.remove(self)
        if self.loop is not None:
            self.loop.stop()
            self.loop = None
        # Also when nbdfuse died: its dead mount ("Transport endpoint is not connected") stays.
        if _run_quiet(["fusermount3", "-u", self.fuse_dir]).returncode != 0 and self.proc.poll() is not None:
            _run_quiet(["fusermount3", "-uz", self.fuse_dir])
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            _run_quiet(["fusermount3", "-uz", self.fuse_dir])
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        return self.proc.returncode


def slow_backing(img: Path, socket: Path, log: Path, stats: Path, reqlog: Path, delay_ms=4, extra_filters=()):
    """DESIGN.md §5's emulated slow disk: one request at a time, `delay_ms` per read and write
    (~250 random IOPS). The stats filter writes a summary of every backing I/O to `stats` when
    nbdkit exits; the log filter records each request with a timestamp in `reqlog`, so a phase's
    backing I/O can be counted afterwards (count_backing_io)."""
    argv = ["nbdkit", "-U", str(socket), "-f", "--exit-with-parent", "--filter=noparallel", "--filter=delay",
            *extra_filters, "--filter=stats", "--filter=log", "file", str(img),
            "serialize=all-requests", f"rdelay={delay_ms}ms", f"wdelay={delay_ms}ms",
            f"statsfile={stats}", "statsappend=false", f"logfile={reqlog}"]
    return Server("backing", argv, socket, f"nbd+unix:///?socket={socket}", log)


_LOG_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) connection=\d+ "
    r"(Read|Write|Flush|Trim|Zero|Cache|Extents) id=\d+(?: offset=0x([0-9a-f]+) count=0x([0-9a-f]+))?")


def count_backing_io(reqlog: Path, windows):
    """Counts the requests nbdkit's log filter recorded in each time window.

    `windows` maps a name to (t_start, t_end) in time.time() seconds; returns name -> {op: {"ops",
    "bytes"}}. Read the log after nbdkit has exited (the filter may buffer)."""
    out = {name: {} for name in windows}
    if not Path(reqlog).exists():
        return out
    with open(reqlog, errors="replace") as f:
        for line in f:
            m = _LOG_LINE.match(line)
            if not m:
                continue
            ts = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
            for name, (a, b) in windows.items():
                if a <= ts < b:
                    d = out[name].setdefault(m.group(2).lower(), {"ops": 0, "bytes": 0})
                    d["ops"] += 1
                    if m.group(4):
                        d["bytes"] += int(m.group(4), 16)
    return out


def read_stats_file(path: Path):
    """The stats filter's summary lines (total/read/write/trim/zero/flush), without histograms."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    return [ln for ln in lines if re.match(r"^(total|read|write|trim|zero|flush|cache|extents):", ln)]


def nbdkit_file(path: Path, socket: Path, log: Path, extra=(), params=(), cgroup=None):
    argv = ["nbdkit", "-f", "--exit-with-parent", "-U", str(socket), *extra, "file", str(path), *params]
    return Server("nbdkit", argv, socket, f"nbd+unix:///?socket={socket}", log, cgroup=cgroup)


def nbdkit_cache_filter(backing_socket: Path, socket: Path, log: Path, cache_bytes: int, tmpdir: Path,
                        min_block="4K", cgroup=None):
    """`nbdkit --filter=cache` in write-back mode in front of the NBD server at `backing_socket`,
    caching reads too (cache-on-read=true: else it caches no reads at all), at most `cache_bytes`,
    in blocks of `min_block` (its default 64K would turn each 4K write to an uncached block into a
    64K read-modify-write from the backing store). Its cache is a temporary file in `tmpdir`
    (emptied first), through the page cache: limit that with `cgroup`."""
    shutil.rmtree(tmpdir, ignore_errors=True)
    Path(tmpdir).mkdir(parents=True)
    argv = ["nbdkit", "-f", "--exit-with-parent", "-U", str(socket), "--filter=cache", "nbd",
            f"socket={backing_socket}", "cache=writeback", "cache-on-read=true",
            f"cache-max-size={cache_bytes >> 20}M", f"cache-min-block-size={min_block}"]
    return Server("nbdkit", argv, socket, f"nbd+unix:///?socket={socket}", log,
                  env={**os.environ, "TMPDIR": str(tmpdir)}, cgroup=cgroup)


def flashtier_serve(binary: Path, backing: str, socket: Path, log: Path, extra=(), cgroup=None, env=None):
    """`flashtier serve`, ready (and timed, `ready_ms`) at its `listening on` line."""
    argv = [str(binary), "serve", "--backing", backing, "--listen", str(socket), *extra]
    return Server("flashtier", argv, socket, f"nbd+unix:///?socket={socket}", log, cgroup=cgroup, env=env,
                  ready_line="listening on")


def format_no_probe(binary: Path):
    """`--no-probe` for a binary whose `format` has it (builds before the probe have neither).
    The quick device probe (2 s of I/O on the cache's filesystem) would only add noise before a
    measurement; `flashtier probe` measures the device on its own."""
    out = subprocess.run([str(binary), "format", "--help"], capture_output=True, text=True).stdout
    return ["--no-probe"] if "--no-probe" in out else []


def flashtier_format(binary: Path, cache: Path, backing: str, size: int, prefill=True, segment_size=None,
                     extra=()):
    """Formats `cache` for `backing`. With `prefill` the cache file is first written in full with
    random bytes (kept between runs when its size matches), so it behaves like a device: no holes
    that read as free zeros, no allocating writes. Returns format's output."""
    cache = Path(cache)
    if prefill:
        make_random_file(cache, size)
        argv = [str(binary), "format", "--cache", str(cache), "--backing", backing, "--force"]
    else:
        if cache.exists():
            cache.unlink()
        argv = [str(binary), "format", "--cache", str(cache), "--backing", backing, "--size", str(size)]
    if segment_size:
        argv += ["--segment-size", str(segment_size)]
    argv += format_no_probe(binary)
    argv += list(extra)
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"flashtier format failed: {' '.join(argv)}\n{out.stdout}{out.stderr}")
    return out.stdout


def flashtier_cache_serve(binary: Path, cache: Path, backing: str, socket: Path, log: Path, mode="writeback",
                          threads=None, cgroup=None, extra=()):
    # The benchmarks warm caches with sequential reads (as they do nbdkit's cache filter, which
    # caches everything): the read cutoff, on by default, would keep those from being cached.
    args = ["--cache", str(cache), "--mode", mode, "--set", "sequential_cutoff_read_kib=0"]
    if threads:
        args += ["--threads", str(threads)]
    return flashtier_serve(binary, str(backing), socket, log, extra=[*args, *extra], cgroup=cgroup)


_KV = re.compile(r"(\w+)=(\S+)")


def flashtier_log_event(text: str, message: str):
    """The key=value fields of the last line of a flashtier log containing `message`, or None."""
    found = None
    for line in text.splitlines():
        if message in line:
            found = {k: v.strip('"') for k, v in _KV.findall(line)}
    return found


def flashtier_open_event(text: str):
    """How a flashtier log says the cache was opened: ("clean", fields) after a clean shutdown,
    ("unclean", fields) after recovery (replayed_records, replayed_batches, time_ms, ...), or
    (None, {})."""
    for kind, message in (("clean", "cache opened after a clean shutdown"),
                          ("unclean", "cache recovered after an unclean shutdown")):
        ev = flashtier_log_event(text, message)
        if ev is not None:
            return kind, ev
    return None, {}


def flashtier_closed_event(text: str):
    """The fields of a flashtier log's `cache closed cleanly` line (cached_blocks, dirty_blocks), or {}."""
    return flashtier_log_event(text, "cache closed cleanly") or {}


class PerfCounter:
    """Counts tracepoints (e.g. syscalls:sys_enter_pwritev) in one process with `perf stat`,
    between start() and stop(). Optional: available() says whether perf works here."""

    def __init__(self, pid, events, outfile: Path):
        self.events, self.outfile = list(events), Path(outfile)
        argv = ["perf", "stat", "-x", ",", "-o", str(self.outfile), "-p", str(pid)]
        for e in self.events:
            argv += ["-e", e]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)  # let perf attach

    @staticmethod
    def available():
        if shutil.which("perf") is None:
            return False
        out = subprocess.run(["perf", "stat", "-x", ",", "-e", "syscalls:sys_enter_pwritev", "true"],
                             capture_output=True, text=True)
        return out.returncode == 0

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(10)
        counts = {}
        for line in self.outfile.read_text().splitlines():
            parts = line.split(",")
            if len(parts) >= 3 and parts[2] in self.events:
                counts[parts[2]] = int(parts[0]) if parts[0].isdigit() else None
        return counts


def nbd_target(uri: str):
    """fio arguments that drive an NBD server through fio's nbd engine (libnbd)."""
    return ["--ioengine=nbd", f"--uri={uri}"]


def local_target(path, engine="io_uring"):
    """fio arguments for a local file read and written with O_DIRECT: the device's own speed."""
    return [f"--ioengine={engine}", "--direct=1", f"--filename={path}"]


def _side(doc_side):
    clat = doc_side["clat_ns"]
    pct = clat.get("percentile", {})
    return {
        "iops": doc_side["iops"],
        "ios": doc_side["total_ios"],
        "bytes": doc_side["io_bytes"],
        "lat_mean_us": clat["mean"] / 1000,
        "lat_p50_us": pct.get("50.000000", 0) / 1000,
        "lat_p99_us": pct.get("99.000000", 0) / 1000,
        "lat_p999_us": pct.get("99.900000", 0) / 1000,
    }


def run_fio(target, rw: str, bs="4k", iodepth=32, jobs=1, size=None, offset=None, runtime=10, ramp=2,
            time_based=True, io_size=None, iops_log=None, extra=()):
    """Runs one fio job and returns a dict: combined `iops`, the dominant side's latency
    (`lat_mean_us`, `lat_p99_us`, as `fio()` always did), and `read`/`write` sub-dicts.

    `target` is nbd_target(uri) or local_target(path). Without `time_based`, the job ends after
    `io_size` (or `size`) bytes. `iops_log` is a path prefix for fio's per-second IOPS log: the
    result's `timeline` is then [(second, IOPS)] of the measured part (see read_iops_log)."""
    argv = ["fio", "--name=bench", *target, f"--rw={rw}", f"--bs={bs}", f"--iodepth={iodepth}",
            f"--numjobs={jobs}", "--group_reporting", "--output-format=json"]
    if size is not None:
        argv.append(f"--size={size}")
    if offset is not None:
        argv.append(f"--offset={offset}")
    if io_size is not None:
        argv.append(f"--io_size={io_size}")
    if time_based:
        argv += ["--time_based", f"--runtime={runtime}", f"--ramp_time={ramp}"]
    if iops_log:
        argv += [f"--write_iops_log={iops_log}", "--log_avg_msec=1000"]
    argv += list(extra)
    t0 = time.time()
    out = subprocess.run(argv, capture_output=True, text=True)
    elapsed = time.time() - t0
    if out.returncode != 0:
        sys.exit(f"fio failed: {' '.join(argv)}\n{out.stderr}")
    # fio may print warnings before the JSON document.
    doc = json.loads(out.stdout[out.stdout.index("{"):])
    job = doc["jobs"][0]
    r, w = _side(job["read"]), _side(job["write"])
    main = r if r["iops"] >= w["iops"] else w
    return {
        "iops": r["iops"] + w["iops"],
        "lat_mean_us": main["lat_mean_us"],
        "lat_p99_us": main["lat_p99_us"],
        "read": r,
        "write": w,
        "elapsed_s": elapsed,
        "fio_cpu_pct": job.get("usr_cpu", 0) + job.get("sys_cpu", 0),
        "argv": argv,
        "timeline": read_iops_log(iops_log, runtime if time_based else 0) if iops_log else None,
    }


def read_iops_log(prefix, duration=0):
    """Per-second IOPS from fio's --write_iops_log files (--log_avg_msec=1000): [(second, iops)],
    both directions and all jobs summed. fio starts the log after the ramp, stamps each 1 s average
    at the end of its window (999, 1999, 3000, ... ms: the stamps jitter around the second, so they
    are rounded, not truncated) and writes no entry for a window in which nothing completed; those
    seconds are filled in as 0, so stalls show. Seconds missing at the end are filled in up to
    `duration` (the runtime without the ramp) less one: fio often leaves out the last window."""
    per_sec = {}
    for path in sorted(Path(prefix).parent.glob(Path(prefix).name + "_iops.*.log")):
        for line in path.read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) >= 2:
                sec = max(0, round(int(parts[0]) / 1000) - 1)
                per_sec[sec] = per_sec.get(sec, 0) + int(parts[1])
        path.unlink()
    if per_sec or duration:
        for sec in range(0, max(list(per_sec) + [duration - 2]) + 1):
            per_sec.setdefault(sec, 0)
    return sorted(per_sec.items())


def _summary(m, cpu_us_per_io):
    return {"iops": m["iops"], "lat_mean_us": m["lat_mean_us"], "lat_p99_us": m["lat_p99_us"],
            "cpu_us_per_io": cpu_us_per_io, "read": m["read"], "write": m["write"],
            "fio_cpu_pct": m["fio_cpu_pct"], "timeline": m["timeline"]}


def measure(server, target=None, **fio_args):
    """One fio run (run_fio's arguments) against `server`, through NBD unless `target` says
    otherwise: IOPS, latency, `read`/`write` sides, `timeline` (with `iops_log`) and the server's
    CPU microseconds per I/O (`cpu_us_per_io`)."""
    runtime = fio_args.get("runtime", 10)
    ramp = fio_args.get("ramp", 2)
    fio_args.setdefault("size", "1G")
    cpu0 = server.cpu_seconds()
    m = run_fio(target or nbd_target(server.uri), **fio_args)
    cpu = server.cpu_seconds() - cpu0
    # The CPU window includes fio's ramp, so count the I/Os of the ramp too.
    ios = m["iops"] * (runtime + ramp) if fio_args.get("time_based", True) else (
        m["read"]["ios"] + m["write"]["ios"])
    return _summary(m, cpu * 1e6 / ios if ios else float("nan"))


def measure_local(path, **fio_args):
    """One fio run with io_uring and O_DIRECT on a local file (no server): the physical limit.
    Same result as measure(), with no server CPU (NaN)."""
    return _summary(run_fio(local_target(path), **fio_args), float("nan"))


def median(values):
    return statistics.median(values) if values else float("nan")


def _first_line(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        return "?"


def disk_description(path) -> str:
    """The filesystem and block device under `path`, and whether the kernel thinks it rotates."""
    try:
        src = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True,
                             text=True).stdout.splitlines()[1].split()
        dev = Path(src[0]).name
        base = re.sub(r"p?\d+$", "", dev) if not Path(f"/sys/block/{dev}").exists() else dev
        rot = Path(f"/sys/block/{base}/queue/rotational").read_text().strip()
        model = Path(f"/sys/block/{base}/device/model")
        model = model.read_text().strip() if model.exists() else "virtual disk"
        return f"{src[0]} ({src[1]}, {model}, rotational={rot})"
    except (OSError, IndexError):
        return "?"


def machine_description(binary=None, workdir=None):
    mem = proc_meminfo_total_gib()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    return {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "memory_gib": mem,
        "disk": disk_description(workdir) if workdir else "?",
        "fio": _first_line(["fio", "--version"]),
        "nbdkit": _first_line(["nbdkit", "--version"]),
        "flashtier": _first_line([str(binary), "--version"]) if binary else "?",
        "flashtier_commit": commit + ("+dirty" if dirty else ""),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }


def proc_meminfo_total_gib():
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / (1 << 20), 1)
    return None


def command_line():
    """How this script was invoked, as a shell command relative to the repository."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(REPO)
    except ValueError:
        pass
    return " ".join(shlex.quote(a) for a in [str(script), *sys.argv[1:]])


def machine_line(m):
    return (f"Machine: {m['cpus']} CPUs, {m.get('memory_gib', '?')} GiB RAM, Linux {m['kernel']}, "
            f"disk {m.get('disk', '?')}; {m['fio']}, {m['nbdkit']}, {m.get('flashtier', 'flashtier')} "
            f"(commit {m['flashtier_commit']}); {m['date']}; load average at start "
            f"{' '.join(m.get('loadavg', []))}")


def check_target(value, target, higher_is_better=True, unit="×"):
    """(mark, gap text) for a target: ✓ when met; the gap says by how much it is met or missed."""
    if value is None or value != value:  # None or NaN
        return "?", "not measured"
    ok = value >= target if higher_is_better else value <= target
    mark = "✓" if ok else "✗"
    if unit == "×":
        gap = (value / target - 1) * 100 if target else float("nan")
        return mark, f"{value:.2f}× vs ≥ {target:.2f}× ({gap:+.0f}%)" if higher_is_better else \
            f"{value:.2f}× vs ≤ {target:.2f}× ({gap:+.0f}%)"
    sign = "≥" if higher_is_better else "≤"
    return mark, f"{value:,.2f} {unit} vs {sign} {target:,.2f} {unit} ({value - target:+,.2f} {unit})"


def results_header(title, machine, noisy=False):
    lines = [f"# {title}", "", f"Command: `{command_line()}`  ", machine_line(machine), ""]
    if noisy:
        lines += ["> **Quick validation run** (`--quick`): short runs and small sizes on a busy machine; "
                  "the figures are noise and say nothing about the targets.", ""]
    return lines


def write_results(out: Path, name: str, doc: dict, md_lines):
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2, default=str))
    (out / f"{name}.md").write_text("\n".join(md_lines) + "\n")
    print((out / f"{name}.md").read_text())


def pyplot():
    """matplotlib.pyplot, drawing to files (call ensure_matplotlib() at the start of the script)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, quick=False):
    """Writes a figure to `path`; a --quick run's figure says so in red at the top."""
    if quick:
        fig.suptitle("--quick validation run: short and noisy, not a result", color="red", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def draw_bars(ax, groups, series, ylabel, title, log_y=False):
    """Grouped bars of medians with each round as a black dot. `series`: [(name, color, [[values
    per round] for each group])]; a series with no values for a group gets no bar there."""
    n = len(series)
    width = 0.8 / n
    for i, (name, color, per_group) in enumerate(series):
        labelled = False
        for j, vals in enumerate(per_group):
            if not vals:
                continue
            x = j + (i - (n - 1) / 2) * width
            ax.bar(x, median(vals), width=width * 0.95, color=color, label=None if labelled else name)
            labelled = True
            ax.scatter([x] * len(vals), vals, s=9, color="black", zorder=3)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    if log_y:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()


def draw_timelines(ax, timelines, colors, ylabel, title, log_y=False):
    """Per-second IOPS of each peer's runs drawn back to back. `timelines`: {peer: [[(second,
    IOPS)] per run]}. On a log scale, seconds with no completion (stalls) are drawn at 1."""
    for peer, runs in timelines.items():
        t0, labelled = 0, False
        for tl in runs:
            if not tl:
                continue
            xs = [t0 + sec for sec, _ in tl]
            ys = [max(v, 1) if log_y else v for _, v in tl]
            ax.plot(xs, ys, color=colors[peer], lw=1, label=None if labelled else peer)
            labelled = True
            t0 = xs[-1] + 1
    ax.set_xlabel("seconds of measurement (each peer's runs back to back, in round order)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.legend()


def bar_plot(path: Path, title, ylabel, groups, series, log_y=False, quick=False):
    """A figure with one draw_bars() chart."""
    fig, ax = pyplot().subplots(figsize=(max(6, 1.9 * len(groups) + 2), 4.5))
    draw_bars(ax, groups, series, ylabel, title, log_y)
    save_figure(fig, path, quick)


def peer_table(rows, base, extra=()):
    """Markdown lines of a table with a row per peer (`rows`: dicts with "peer" and the medians
    iops, lat_p99_us, lat_mean_us, cpu_us_per_io, fio_cpu_pct): IOPS, the ratio to the `base`
    peer, latency, the server's CPU per I/O ("—" for a peer without a server), fio's CPU, then
    `extra` columns: [(header, function of the row returning the cell's text)]."""
    by = {r["peer"]: r for r in rows}
    lines = ["| peer | IOPS | vs " + base + " | p99 µs | mean µs | server CPU µs/IO | client (fio) CPU % |"
             + "".join(f" {h} |" for h, _ in extra),
             "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(extra)]
    for r in rows:
        cpu = "—" if r["cpu_us_per_io"] != r["cpu_us_per_io"] else f"{r['cpu_us_per_io']:.1f}"
        lines.append(f"| {r['peer']} | {r['iops']:,.0f} | {r['iops'] / by[base]['iops']:.2f}× | "
                     f"{r['lat_p99_us']:,.0f} | {r['lat_mean_us']:,.0f} | {cpu} | {r['fio_cpu_pct']:.0f} |"
                     + "".join(f" {f(r)} |" for _, f in extra))
    return lines


CLIENT_CPU_NOTE = ("Server CPU µs/IO is the server's user+system CPU time per I/O; client CPU % is fio's "
                   "user+system CPU (100% = one core): the NBD client and the server share the machine's CPUs.")


def setup(args, *tools):
    """The start of every benchmark: matplotlib (may re-run the script), the tools it needs, the
    flashtier binary, the work directory and the machine's description. Returns (binary, workdir,
    machine)."""
    ensure_matplotlib()
    require(*tools)
    binary = flashtier_binary(args.flashtier)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    claim_workdir(work)
    return binary, work, machine_description(binary, work)


_WORKDIR_LOCK = []  # the open lock file: the claim lasts as long as this process


def claim_workdir(work: Path):
    """Makes this process the only benchmark using `work`, then takes down what a run that died
    there left behind. A run killed hard (SIGKILL, a machine restart) never gets to its cleanup:
    its ext4 mount, loop devices and dead FUSE mount stay, and the next run, which starts by
    removing its run directory, would fail on them. The lock file tells a dead run's leftovers
    from a live run's: whoever holds it is alive, so anything mounted under `work` while nobody
    holds it is a leftover."""
    lock = open(work / ".lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        sys.exit(f"another benchmark is running in {work} (pid {lock.read().strip() or '?'}); "
                 f"wait for it or pass another --workdir")
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    _WORKDIR_LOCK.append(lock)
    release_leftovers(work)


def _mounts_under(root: Path):
    """(mount point, file system type, source) of every mount strictly below `root`, deepest first."""
    found = []
    root = os.path.realpath(root)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mnt = fields[4].replace("\\040", " ")
            rest = fields[fields.index("-") + 1:]
            if mnt.startswith(root + "/"):
                found.append((mnt, rest[0], rest[1] if len(rest) > 1 else ""))
    return sorted(found, key=lambda m: -len(m[0]))


def _loops_under(root: Path):
    """Loop devices whose backing file is below `root`."""
    root = os.path.realpath(root)
    loops = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            file = backing.read_text().strip()
        except OSError:
            continue
        if file.startswith(root + "/"):
            loops.append(f"/dev/{backing.parent.parent.name}")
    return loops


def release_leftovers(work: Path):
    """Takes down what a dead run left under `work`: the file systems mounted from loop devices on
    its files, those loop devices, then its nbdfuse mounts, in that order (each holds the next).
    Nothing else is touched, so a --workdir that holds other mounts keeps them."""
    def leftovers():
        loops = _loops_under(work)
        mounts = _mounts_under(work)
        return ([m for m in mounts if m[2] in loops], loops,
                [m for m in mounts if m[1] == "fuse" and m[2] in ("/dev/fuse", "nbdfuse")])
    on_loops, loops, fuses = leftovers()
    for mnt, fstype, dev in on_loops:
        print(f"note: unmounting {mnt} ({fstype} on {dev}), left by an interrupted run", flush=True)
        _unmount(mnt)
    for dev in loops:
        print(f"note: detaching {dev}, left by an interrupted run", flush=True)
        _run_quiet(["losetup", "-d", dev])
    for mnt, _, _ in fuses:
        print(f"note: unmounting {mnt} (FUSE), left by an interrupted run", flush=True)
        if _run_quiet(["fusermount3", "-u", mnt]).returncode != 0:
            _run_quiet(["fusermount3", "-uz", mnt])
    deadline = time.monotonic() + 20
    while any(leftovers()) and time.monotonic() < deadline:
        time.sleep(0.05)


def targets_table(targets):
    """Markdown lines of the targets table. `targets`: [(what, check_target(...))]."""
    return ["| target | result | measured |", "|---|:---:|---|",
            *[f"| {what} | {mark} | {gap} |" for what, (mark, gap) in targets]]


def medians(samples, keys):
    """{key: median over `samples` (dicts)} for each key; a key may be "side.key" (e.g. "read.iops")."""
    def get(x, key):
        for part in key.split("."):
            x = x[part]
        return x
    return {key: median([get(x, key) for x in samples]) for key in keys}


def add_common_args(ap, workdir="/var/tmp/flashtier-bench"):
    ap.add_argument("--flashtier", metavar="PATH",
                    help="flashtier binary to benchmark (default: $FLASHTIER_BIN, else `cargo build "
                         "--release` into $CARGO_TARGET_DIR, default target/)")
    ap.add_argument("--threads", type=int, help="flashtier serve --threads (default: the server's default)")
    ap.add_argument("--workdir", default=workdir,
                    help=f"directory on the disk under test for data and cache files (default {workdir}); "
                         "its image files are kept for the next run")
    ap.add_argument("--out", help="results directory (default bench/results; with --quick "
                                  "/tmp/flashtier-bench-quick, so noise never lands in bench/results)")
    ap.add_argument("--quick", action="store_true",
                    help="short validation run: small sizes, short runs, few rounds (figures are noise)")


def add_fio_args(ap, rounds, ramp, runtime=None):
    """--rounds, --ramp, --iodepth and (unless runtime is None) --runtime."""
    ap.add_argument("--rounds", type=int, default=rounds, help=f"interleaved rounds (default {rounds})")
    if runtime is not None:
        ap.add_argument("--runtime", type=int, default=runtime, help=f"seconds per fio run (default {runtime})")
    ap.add_argument("--ramp", type=int, default=ramp, help=f"fio ramp seconds before measuring (default {ramp})")
    ap.add_argument("--iodepth", type=int, default=32, help="fio queue depth (default 32)")


def results_dir(args) -> Path:
    if args.out:
        return Path(args.out)
    return Path("/tmp/flashtier-bench-quick") if args.quick else REPO / "bench" / "results"


# --- Write-back (cleaner) benchmarks: live parameters, the dirty level over time, per-I/O logs ---

def flashtier_known_params(binary: Path):
    """Names of the live parameters this flashtier binary knows (from `flashtier set --help`), so
    a benchmark can tell a binary without a parameter from a typo."""
    out = subprocess.run([str(binary), "set", "--help"], capture_output=True, text=True).stdout
    return set(re.findall(r"^  ([a-z][a-z0-9_]+)$", out, re.M))


def flashtier_ctl(binary: Path, control: Path, *args, check=True):
    """Runs `flashtier ARGS --control CONTROL`; returns (seconds taken, stdout + stderr)."""
    argv = [str(binary), *[str(a) for a in args], "--control", str(control)]
    t0 = time.time()
    out = subprocess.run(argv, capture_output=True, text=True)
    took = time.time() - t0
    if check and out.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{out.stdout}{out.stderr}")
    return took, out.stdout + out.stderr


def flashtier_report(binary: Path, control: Path):
    """The running server's report (`flashtier stats --json`) as a dict."""
    _, text = flashtier_ctl(binary, control, "stats", "--json")
    return json.loads(text[text.index("{"):])


def flashtier_wait_promotions(binary: Path, control: Path, quiet=1.0, timeout=60.0):
    """Waits until the running server's read promotions have settled (promoted_blocks and
    promotions_dropped unchanged for `quiet` seconds), e.g. after a warm-up pass that queued them.
    Returns the seconds waited. Unlike Server.wait_io_quiet it ignores background writes
    (checkpoints, reclaim) that need not stop."""
    t0 = time.time()

    def settled():
        c = flashtier_report(binary, control)["counters"]
        return c.get("promoted_blocks"), c.get("promotions_dropped")
    last, since = settled(), time.time()
    while time.time() - since < quiet and time.time() - t0 < timeout:
        time.sleep(0.2)
        now = settled()
        if now != last:
            last, since = now, time.time()
    return time.time() - t0


def report_cache_status(report):
    """The cache part of a report's status: `status.cache_status` where the server nests it,
    else `status` itself (older reports put dirty_blocks etc. there)."""
    st = report.get("status", {})
    return st.get("cache_status") or st


class ReportPoller:
    """Records `flashtier stats --json --watch` (one report per second) with the wall-clock time
    each arrived: samples() -> [(time.time(), report)]."""

    def __init__(self, binary: Path, control: Path):
        self._samples = []
        self.proc = subprocess.Popen([str(binary), "stats", "--json", "--watch", "--control", str(control)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

        def pump():
            for line in self.proc.stdout:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        self._samples.append((time.time(), json.loads(line)))
                    except ValueError:
                        pass
        self._thread = threading.Thread(target=pump, daemon=True)
        self._thread.start()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(10)
        self._thread.join(5)
        return list(self._samples)

    def samples(self):
        return list(self._samples)


def read_lat_log(prefix, t0):
    """fio's per-I/O latency log (--write_lat_log=PREFIX --log_unix_epoch=1, no --log_avg_msec):
    [(seconds since `t0` (time.time()) at completion, total latency in µs, "read"|"write")], all
    jobs, sorted by time. The log files are removed."""
    out = []
    for path in sorted(Path(prefix).parent.glob(Path(prefix).name + "_lat.*.log")):
        for line in path.read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) >= 3:
                out.append((int(parts[0]) / 1000 - t0, int(parts[1]) / 1000, "read" if parts[2] == "0" else "write"))
    for kind in ("lat", "clat", "slat"):
        for path in Path(prefix).parent.glob(Path(prefix).name + f"_{kind}.*.log"):
            path.unlink()
    out.sort()
    return out


def percentile(values, pct):
    """The pct-th percentile (nearest rank) of `values`, NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(pct / 100 * len(s)) - 1))
    return s[k]


def per_second(ios, seconds):
    """Per-second IOPS and p99 latency (µs) from read_lat_log's [(t, lat_us, dir)] over whole
    seconds 0..seconds-1: [(second, iops, p99_us)] (a second with no completion has 0 IOPS, NaN p99)."""
    bins = [[] for _ in range(seconds)]
    for t, lat, _ in ios:
        s = int(t)
        if 0 <= s < seconds:
            bins[s].append(lat)
    return [(s, len(b), percentile(b, 99)) for s, b in enumerate(bins)]
