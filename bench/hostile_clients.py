#!/usr/bin/env python3
"""Hostile clients: what 256 misbehaving sockets cost `flashtier serve`, and whether a real client
still gets in.

Three attacks, each on a fresh server (defaults, unix socket, a 64 MiB sparse file), each with
CLIENTS sockets:
- never-read: handshake, then 16 READs of 32 MiB each, and never a recv of the replies;
- never-read-4k: the same with 2,048 READs of 4 KiB (replies small enough to be queued for the
  thread writing to the stuck socket: the reply queue's bound);
- dribble: a valid handshake sent one byte every 2 s (a slow-loris handshake);
- idle: handshake, then nothing.
While the attack runs (ATTACK_SECS), the server's RSS and thread count are sampled every 100 ms
(peak reported). Then a real client connects: a raw NBD client (connect, handshake, 4 KiB write
and read back: time to first I/O), `nbdinfo --size` and `qemu-io` (write, read, flush), each
timed with a 10 s limit.

Each server runs in a memory cgroup limited to RSS_CAP_MIB (page cache included) so that a
server without memory bounds is OOM-killed instead of taking the machine down; that outcome is
reported as such.

The measured binary gets its limits spelled out (the defaults: --max-connections 256,
--worker-pool 512, --threads 16, --request-memory-mib 1024, --request-memory-per-connection-mib
64) and its peak RSS is checked against the bound the code enforces (ARCHITECTURE.md): the RSS
it had before any client came, plus request memory charged to the budgets (at most
max(request memory, one 32 MiB request)), plus the 256 KiB buffer each thread keeps and uses
uncharged for requests up to 256 KiB and the 112 KiB where a thread's batch of small READs lands,
times (max connections + worker pool) threads, plus each
connection's 256 KiB read buffer and 256 KiB of queued replies. Its peak thread count is checked against max connections +
worker pool + the threads it had before any client.

    bench/hostile_clients.py [--before BIN] [--flashtier BIN] [--clients 256] [--attack-secs 6]

--before BIN measures an older binary too (e.g. one built from the commit before the bounds, with
its own defaults), in the same run. Writes bench/results/hostile_clients.{md,json,png}.
"""

import argparse
import json
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import benchlib as bl

IHAVEOPT = 0x49484156454F5054
OPT_GO = 7
REQ_MAGIC = 0x25609513
CMD_READ, CMD_WRITE = 0, 1
MIB = 1 << 20
SIZE = 64 * MIB
LIMIT_S = 10.0
KIB = 1 << 10

# The limits the measured binary runs with (its defaults, spelled out) and what the code adds to
# them: see ARCHITECTURE.md, "Memory and thread bound".
MAX_CONNECTIONS = 256
WORKER_POOL = 512
THREADS = 16
REQUEST_MEMORY_MIB = 1024
REQUEST_MEMORY_PER_CONNECTION_MIB = 64
MAX_PAYLOAD_MIB = 32
KEEP_BUFFER = 256 * KIB
# Where a thread's batch of small READs lands (crates/flashtier-nbd/src/transmission/batch.rs:
# SPACE, 7 reads of up to 16 KiB).
READ_BATCH_SPACE = 7 * 16 * KIB
INBOUND_BUFFER = 256 * KIB
# Replies queued while another thread writes, and the batch it is writing (QUEUE_MAX each:
# crates/flashtier-nbd/src/outbound.rs).
REPLY_QUEUE = 2 * 128 * KIB
LIMIT_FLAGS = ["--max-connections", str(MAX_CONNECTIONS), "--worker-pool", str(WORKER_POOL),
               "--threads", str(THREADS), "--request-memory-mib", str(REQUEST_MEMORY_MIB),
               "--request-memory-per-connection-mib", str(REQUEST_MEMORY_PER_CONNECTION_MIB)]


def memory_bound_mib():
    """Memory the server may hold for clients beyond its RSS before any client, as enforced."""
    charged = max(REQUEST_MEMORY_MIB, MAX_PAYLOAD_MIB) * MIB
    kept = (KEEP_BUFFER + READ_BATCH_SPACE) * (MAX_CONNECTIONS + WORKER_POOL)
    per_connection = (INBOUND_BUFFER + REPLY_QUEUE) * MAX_CONNECTIONS
    return (charged + kept + per_connection) / MIB


def handshake_bytes():
    """What a client sends for FIXED_NEWSTYLE | NO_ZEROES and GO on the default export."""
    payload = struct.pack(">IH", 0, 0)
    return struct.pack(">I", 3) + struct.pack(">QII", IHAVEOPT, OPT_GO, len(payload)) + payload


def recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("server closed the connection")
        buf += chunk
    return buf


def go(s):
    """Handshake up to transmission (GO on the default export)."""
    recv_exact(s, 18)
    s.sendall(handshake_bytes())
    while True:
        h = recv_exact(s, 20)
        _, _, ty, length = struct.unpack(">QIII", h)
        recv_exact(s, length)
        if ty == 1:
            return
        if ty & 0x80000000:
            raise ConnectionError(f"GO refused ({ty:#x})")


def request(cmd, handle, offset, length):
    return struct.pack(">IHHQQI", REQ_MAGIC, 0, cmd, handle, offset, length)


# The READs each never-reading client sends (by its index), by attack.
NEVER_READ = {
    "never-read": lambda i: b"".join(request(CMD_READ, h, (i % 2) * 32 * MIB, 32 * MIB) for h in range(16)),
    "never-read-4k": lambda i: b"".join(request(CMD_READ, h, (h % 4096) * 4 * KIB, 4 * KIB) for h in range(2048)),
}


def connect(path, timeout=LIMIT_S):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(path))
    return s


def real_client_ms(path):
    """Connect, handshake, write 4 KiB and read it back; milliseconds, or an error string."""
    t0 = time.monotonic()
    try:
        s = connect(path)
        go(s)
        data = bytes([0x5A]) * 4096
        # The READ only after the WRITE's reply: NBD does not order requests in flight.
        s.sendall(request(CMD_WRITE, 1, 8 * MIB, 4096) + data)
        _, err, _ = struct.unpack(">IIQ", recv_exact(s, 16))
        if err:
            return f"WRITE error {err}"
        s.sendall(request(CMD_READ, 2, 8 * MIB, 4096))
        _, err, _ = struct.unpack(">IIQ", recv_exact(s, 16))
        if err:
            return f"READ error {err}"
        if recv_exact(s, 4096) != data:
            return "wrong data"
        s.close()
        return round((time.monotonic() - t0) * 1000, 1)
    except (OSError, ConnectionError) as e:
        return f"failed after {time.monotonic() - t0:.1f} s: {e}"


def tool_ms(argv):
    t0 = time.monotonic()
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        return f"timed out ({LIMIT_S:.0f} s)"
    ms = round((time.monotonic() - t0) * 1000, 1)
    text = (out.stdout + out.stderr).lower()
    if out.returncode != 0 or "fail" in text or "error" in text:
        return f"failed after {ms / 1000:.1f} s"
    return ms


class Attack:
    """CLIENTS sockets doing one kind of misbehaviour, until stop()."""

    def __init__(self, kind, path, clients):
        self.kind, self.socks, self.errors = kind, [], 0
        self.stopping = threading.Event()
        hs = handshake_bytes()
        for i in range(clients):
            try:
                s = connect(path, timeout=5)
                if kind in NEVER_READ:
                    go(s)
                    s.setblocking(False)
                    try:
                        s.send(NEVER_READ[kind](i))
                    except BlockingIOError:
                        pass
                elif kind == "idle":
                    go(s)
                elif kind == "dribble":
                    recv_exact(s, 18)
                    s.send(hs[:1])
                self.socks.append(s)
            except (OSError, ConnectionError):
                self.errors += 1
        if kind == "dribble":
            self.thread = threading.Thread(target=self._dribble, args=(hs,), daemon=True)
            self.thread.start()

    def _dribble(self, hs):
        sent = 1
        while not self.stopping.wait(2.0) and sent < len(hs):
            for s in self.socks:
                try:
                    s.send(hs[sent:sent + 1])
                except OSError:
                    pass
            sent += 1

    def stop(self):
        self.stopping.set()
        for s in self.socks:
            s.close()


def run_one(binary, label, kind, work, clients, attack_secs, cap_mib, limits):
    disk = work / "disk.img"
    with open(disk, "wb") as f:
        f.truncate(SIZE)
    sock = work / "ft.sock"
    cg = bl.MemCgroup(f"hostile-{label}", cap_mib * MIB)
    server = bl.flashtier_serve(binary, str(disk), sock, work / f"{label}-{kind}.log", cgroup=cg,
                                extra=["--control-socket", str(work / "c.sock"),
                                       "--stats-file", str(work / "stats"), *(LIMIT_FLAGS if limits else [])])
    row = {"binary": label, "attack": kind, "clients": clients}
    try:
        time.sleep(0.5)
        st = bl.proc_status(server.pid)
        row["idle_rss_mib"] = round(st.get("VmRSS", 0) / 1024, 1)
        row["idle_threads"] = int(st.get("Threads", 0))
        if limits:
            row["rss_bound_mib"] = round(row["idle_rss_mib"] + memory_bound_mib(), 1)
            row["threads_bound"] = row["idle_threads"] + MAX_CONNECTIONS + WORKER_POOL
        attack = Attack(kind, sock, clients)
        row["attack_connect_errors"] = attack.errors
        peak_rss, peak_threads, died = 0, 0, None
        t_end = time.monotonic() + attack_secs
        while time.monotonic() < t_end:
            if server.proc.poll() is not None:
                died = f"exited (status {server.proc.returncode}; OOM-killed at the {cap_mib} MiB cgroup limit)" \
                    if cg.stat()["failcnt"] else f"exited (status {server.proc.returncode})"
                break
            st = bl.proc_status(server.pid)
            peak_rss = max(peak_rss, st.get("VmRSS", 0))
            peak_threads = max(peak_threads, int(st.get("Threads", 0)))
            time.sleep(0.1)
        row["peak_rss_mib"] = round(peak_rss / 1024)
        row["peak_threads"] = peak_threads
        row["server"] = died or "running"
        if limits:
            row["within_bounds"] = (not died and row["peak_rss_mib"] <= row["rss_bound_mib"]
                                    and peak_threads <= row["threads_bound"])
        uri = f"nbd+unix:///?socket={sock}"
        row["first_io_ms"] = real_client_ms(sock)
        row["nbdinfo_ms"] = tool_ms(["nbdinfo", "--size", uri])
        row["qemu_io_ms"] = tool_ms(["qemu-io", "-f", "raw", uri, "-c", "write -P 0x33 1M 64k",
                                     "-c", "read -P 0x33 1M 64k", "-c", "flush"])
        attack.stop()
    finally:
        server.kill()
        cg.remove()
    print(f"{label:7} {kind:10} peak RSS {row['peak_rss_mib']:6} MiB  threads {row['peak_threads']:5}  "
          f"first I/O {row['first_io_ms']}  nbdinfo {row['nbdinfo_ms']}  qemu-io {row['qemu_io_ms']}  "
          f"server {row['server']}", flush=True)
    return row


def num(v):
    return "—" if v is None else f"{v:,}"


def fmt(v):
    return f"{v:,.0f} ms" if isinstance(v, (int, float)) else str(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flashtier", help="binary to measure (default: a fresh release build)")
    ap.add_argument("--before", help="an older binary to measure the same way, for comparison")
    ap.add_argument("--clients", type=int, default=256, help="hostile sockets per attack (default 256)")
    ap.add_argument("--attack-secs", type=float, default=6, help="seconds of attack before the real client")
    ap.add_argument("--rss-cap-mib", type=int, default=4096, help="memory cgroup limit per server")
    ap.add_argument("--workdir", default="/var/tmp/flashtier-bench-hostile")
    ap.add_argument("--out", default=str(bl.REPO / "bench" / "results"))
    args = ap.parse_args()
    bl.ensure_matplotlib()
    bl.require("nbdinfo", "qemu-io")
    after = bl.flashtier_binary(args.flashtier)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    binaries = ([("before", Path(args.before).resolve())] if args.before else []) + [("after", after)]
    rows = []
    for kind in ["never-read", "never-read-4k", "dribble", "idle"]:
        for label, binary in binaries:
            rows.append(run_one(binary, label, kind, work, args.clients, args.attack_secs, args.rss_cap_mib,
                                limits=label == "after"))

    machine = bl.machine_description(after, work)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"command": bl.command_line(), "machine": machine, "binaries": {k: str(v) for k, v in binaries},
           "limit_flags": LIMIT_FLAGS, "memory_bound_beyond_idle_mib": memory_bound_mib(), "rows": rows}
    (out / "hostile_clients.json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [
        "# Hostile clients: memory, threads, and a real client's way in",
        "",
        f"Command: `{doc['command']}`  ",
        bl.machine_line(machine) + "  ",
        "Binaries: " + ", ".join(f"{k} = `{v}`" for k, v in binaries),
        "",
        f"{args.clients} hostile unix-socket clients per attack against `flashtier serve` with default "
        f"settings, for {args.attack_secs:g} s (peak RSS and threads sampled every 100 ms), then a real "
        "client: time to connect, handshake and complete a 4 KiB write + read (raw client), and the "
        f"wall time of `nbdinfo --size` and of `qemu-io` (64 KiB write, read, flush), {LIMIT_S:.0f} s limit each. "
        f"Each server runs in a {args.rss_cap_mib} MiB memory cgroup. **after** runs with "
        f"`{' '.join(LIMIT_FLAGS)}` (its defaults); its bounds: RSS ≤ RSS before any client + "
        f"max({REQUEST_MEMORY_MIB}, {MAX_PAYLOAD_MIB}) MiB charged request memory + (256 KiB kept + 112 KiB for a "
        f"batch of small READs) per thread × ({MAX_CONNECTIONS} + {WORKER_POOL}) threads + (256 KiB read buffer + 256 KiB queued replies) × {MAX_CONNECTIONS} connections "
        f"= RSS before + {memory_bound_mib():,.0f} MiB; threads ≤ threads before + {MAX_CONNECTIONS} + {WORKER_POOL}.",
        "",
        "| attack | binary | RSS before MiB | peak RSS MiB | RSS bound MiB | peak threads | thread bound | "
        "within bounds | first I/O | nbdinfo | qemu-io | server |",
        "|---|---|---:|---:|---:|---:|---:|:---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = {True: "✓", False: "✗"}.get(r.get("within_bounds"), "—")
        lines.append(f"| {r['attack']} | {r['binary']} | {r['idle_rss_mib']:,} | {r['peak_rss_mib']:,} | "
                     f"{num(r.get('rss_bound_mib'))} | {r['peak_threads']:,} | {num(r.get('threads_bound'))} | "
                     f"{ok} | {fmt(r['first_io_ms'])} | {fmt(r['nbdinfo_ms'])} | {fmt(r['qemu_io_ms'])} | "
                     f"{r['server']} |")
    lines += ["", "![peak RSS and threads per attack](hostile_clients.png)"]
    (out / "hostile_clients.md").write_text("\n".join(lines) + "\n")
    plot(out / "hostile_clients.png", rows, [label for label, _ in binaries])
    print("\n".join(lines))


def plot(path, rows, labels):
    plt = bl.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    attacks = list(dict.fromkeys(r["attack"] for r in rows))
    colors = {"before": "#888888", "after": "#1f77b4"}
    width = 0.8 / len(labels)
    for ax, key, bound, title in [(axes[0], "peak_rss_mib", "rss_bound_mib", "peak RSS (MiB)"),
                                  (axes[1], "peak_threads", "threads_bound", "peak threads")]:
        for i, label in enumerate(labels):
            for j, attack in enumerate(attacks):
                r = next(r for r in rows if r["attack"] == attack and r["binary"] == label)
                x = j + (i - (len(labels) - 1) / 2) * width
                ax.bar(x, r[key], width=width * 0.95, color=colors.get(label, "#1f77b4"),
                       label=label if j == 0 else None, hatch="//" if r["server"] != "running" else None)
                if bound in r:
                    ax.hlines(r[bound], x - width / 2, x + width / 2, colors="red",
                              label="bound (after)" if j == 0 else None)
        ax.set_xticks(range(len(attacks)))
        ax.set_xticklabels([f"{a}\n({rows[0]['clients']} clients)" for a in attacks])
        ax.set_ylabel(title)
        ax.legend()
    axes[0].set_title("Server RSS under attack (hatched: server died)")
    axes[1].set_title("Server threads under attack")
    bl.save_figure(fig, path)


if __name__ == "__main__":
    main()
