"""Shared pieces of flashtier's benchmarks: servers, fio, CPU accounting, result files.

Benchmarks compare flashtier with a peer measured in the same run, on the same files, as ratios.
The machine is shared and noisy, so every comparison is interleaved (peer, flashtier, flashtier,
peer, ...) over several rounds and reported as medians, together with the server's CPU time per
I/O, which is far less sensitive to noise from other processes than IOPS.
"""

import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


def ensure_matplotlib():
    """Imports matplotlib, installing it into a private venv (and re-running there) if needed."""
    try:
        import matplotlib  # noqa: F401

        return
    except ImportError:
        pass
    venv = Path.home() / ".cache" / "flashtier-bench-venv"
    py = venv / "bin" / "python3"
    # The venv's python is a symlink to the base interpreter, so compare prefixes, not binaries.
    if Path(sys.prefix).resolve() == venv.resolve():
        sys.exit("matplotlib is still missing inside the benchmark venv")
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "matplotlib"], check=True)
    os.execv(str(py), [str(py)] + sys.argv)


def build_flashtier():
    subprocess.run(
        ["cargo", "build", "--release", "--locked", "-q", "-p", "flashtier"],
        cwd=REPO,
        check=True,
    )
    return REPO / "target" / "release" / "flashtier"


def require(*tools):
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        sys.exit(f"missing tools: {', '.join(missing)} (run scripts/install-deps.sh)")


def make_random_file(path: Path, size: int):
    """A file of random bytes (so nothing is sparse or compressible), reused across runs."""
    if path.exists() and path.stat().st_size == size:
        return
    chunk = 16 << 20
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(chunk, left)
            f.write(os.urandom(n))
            left -= n


def warm_page_cache(path: Path):
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass


def wait_for_socket(path: Path, proc, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists():
            return
        if proc.poll() is not None:
            sys.exit(f"server exited early with status {proc.returncode}")
        time.sleep(0.05)
    sys.exit(f"server did not create {path}")


class Server:
    """A server process listening on a unix socket, stopped on exit."""

    def __init__(self, name, argv, socket: Path, uri: str, log: Path):
        self.name, self.socket, self.uri = name, socket, uri
        if socket.exists():
            socket.unlink()
        self.log = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        wait_for_socket(socket, self.proc)

    def cpu_seconds(self):
        """User + system CPU time of the server so far (all threads)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def nbdkit_file(path: Path, socket: Path, log: Path, extra=()):
    argv = ["nbdkit", "-f", "-U", str(socket), *extra, "file", str(path)]
    return Server("nbdkit", argv, socket, f"nbd+unix:///?socket={socket}", log)


def flashtier_serve(binary: Path, backing: str, socket: Path, log: Path, extra=()):
    argv = [str(binary), "serve", "--backing", backing, "--listen", str(socket), *extra]
    return Server("flashtier", argv, socket, f"nbd+unix:///?socket={socket}", log)


def fio(uri: str, rw: str, bs="4k", iodepth=32, jobs=1, size="1G", runtime=10, ramp=2, extra=()):
    """Runs fio's nbd engine and returns (iops, mean latency us, p99 latency us)."""
    argv = [
        "fio", "--name=bench", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}",
        f"--iodepth={iodepth}", f"--numjobs={jobs}", f"--size={size}", "--time_based",
        f"--runtime={runtime}", f"--ramp_time={ramp}", "--group_reporting",
        "--output-format=json", *extra,
    ]
    out = subprocess.run(argv, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"fio failed: {' '.join(argv)}\n{out.stderr}")
    # fio may print warnings before the JSON document.
    doc = json.loads(out.stdout[out.stdout.index("{"):])
    job = doc["jobs"][0]
    iops = job["read"]["iops"] + job["write"]["iops"]
    side = job["read"] if job["read"]["iops"] >= job["write"]["iops"] else job["write"]
    clat = side["clat_ns"]
    p99 = clat.get("percentile", {}).get("99.000000", 0) / 1000
    return iops, clat["mean"] / 1000, p99


def measure(server: Server, **fio_args):
    """One fio run against `server`: IOPS, latency, and server CPU microseconds per I/O."""
    runtime = fio_args.get("runtime", 10)
    ramp = fio_args.get("ramp", 2)
    cpu0 = server.cpu_seconds()
    iops, mean_us, p99_us = fio(server.uri, **fio_args)
    cpu = server.cpu_seconds() - cpu0
    # The CPU window includes fio's ramp, so count the I/Os of the ramp too.
    ios = iops * (runtime + ramp)
    cpu_us_per_io = cpu * 1e6 / ios if ios else float("nan")
    return {"iops": iops, "lat_mean_us": mean_us, "lat_p99_us": p99_us, "cpu_us_per_io": cpu_us_per_io}


def median(values):
    return statistics.median(values) if values else float("nan")


def machine_description():
    def version(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[0]
        except (OSError, IndexError):
            return "?"

    return {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "fio": version(["fio", "--version"]),
        "nbdkit": version(["nbdkit", "--version"]),
        "flashtier_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
