"""memcached servers for the database benchmarks (bench/oltp.py's ft-wb+mc configuration and
bench/memcached.py): a pool of memcached processes on loopback ports, started fresh for a cell and
stopped after it (or at exit, by benchlib's cleanup), and what memcached says of them."""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import benchlib as bl

MEMCACHED = "memcached"
BLOCK = 4096
ITEMS_PER_MIB = 230  # memcached 1.6, growth factor 1.25: a ~4.2 KiB item takes a 4,544-byte chunk


def free_ports(n):
    """n TCP ports on loopback nobody listens on now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def mc_command(addr, command, timeout=10):
    """Sends one text-protocol command (`stats`, `stats slabs`) and returns its STAT lines as a dict."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(command.encode() + b"\r\n")
        buf = b""
        while not buf.endswith(b"END\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    out = {}
    for line in buf.decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "STAT":
            try:
                out[parts[1]] = int(parts[2])
            except ValueError:
                try:
                    out[parts[1]] = float(parts[2])
                except ValueError:
                    out[parts[1]] = parts[2]
    return out


class MemcachedServer:
    """One memcached on 127.0.0.1:`port` with `mem_mib` MiB of item memory (-m), no UDP; ready when
    it accepts a connection; stopped at exit if the script does not stop it."""

    def __init__(self, port, mem_mib, log: Path, timeout=20):
        self.port, self.mem_mib, self.addr = port, mem_mib, f"127.0.0.1:{port}"
        self.argv = [shutil.which(MEMCACHED) or MEMCACHED, "-l", "127.0.0.1", "-p", str(port), "-U", "0",
                     "-m", str(mem_mib), "-c", "4096", *(["-u", "root"] if os.geteuid() == 0 else [])]
        self.log_path = Path(log)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        bl._LIVE.append(self)  # benchlib's exit cleanup stops it (on errors and signals too)
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    sys.exit(f"memcached did not start: {' '.join(self.argv)}\n"
                             + self.log_path.read_text(errors="replace")[-2000:])
                time.sleep(0.05)

    def __repr__(self):
        return f"memcached {self.addr} (pid {self.proc.pid})"

    def stats(self):
        return mc_command(self.addr, "stats")

    def slabs(self):
        """The slab classes holding chunks: {class: {chunk_size, used_chunks, total_pages}}."""
        raw = mc_command(self.addr, "stats slabs")
        out = {}
        for k, v in raw.items():
            cls, _, field = k.partition(":")
            if field in ("chunk_size", "used_chunks", "total_pages", "total_chunks"):
                out.setdefault(cls, {})[field] = v
        return {c: f for c, f in out.items() if f.get("used_chunks")}

    def cpu_seconds(self):
        return bl.proc_cpu_seconds(self.proc.pid)

    def stop(self):
        if self in bl._LIVE:
            bl._LIVE.remove(self)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
        return self.proc.returncode


class MemcachedPool:
    """`n` memcached servers of `mib_each` MiB each; `arg` is flashtier's --memcached value."""

    def __init__(self, n, mib_each, logdir: Path):
        Path(logdir).mkdir(parents=True, exist_ok=True)
        self.servers = [MemcachedServer(p, mib_each, Path(logdir) / f"memcached-{i}.log")
                        for i, p in enumerate(free_ports(n))]
        self.arg = ",".join(s.addr for s in self.servers)

    def stats(self):
        """Per server: memcached's `stats` (a few fields), its used slab classes and CPU seconds."""
        keep = ("limit_maxbytes", "bytes", "curr_items", "total_items", "evictions", "get_hits", "get_misses",
                "cmd_get", "cmd_set", "curr_connections", "rusage_user", "rusage_system")
        out = []
        for s in self.servers:
            st = s.stats()
            out.append({"addr": s.addr, "argv": s.argv, **{k: st.get(k) for k in keep}, "slabs": s.slabs(),
                        "cpu_seconds": s.cpu_seconds()})
        return out

    def stop(self):
        for s in self.servers:
            s.stop()


def pool_totals(stats):
    """Sums of the servers' counters (None when not recorded)."""
    if not stats:
        return None
    keys = ("limit_maxbytes", "bytes", "curr_items", "total_items", "evictions", "get_hits", "get_misses",
            "cmd_set", "cpu_seconds")
    return {k: sum(s.get(k) or 0 for s in stats) for k in keys}
