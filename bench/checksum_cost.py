#!/usr/bin/env python3
"""What checking every cache read against its checksum costs on the hit path.

Since format version 2 every block read from the cache device is checked against the CRC32C its
record carried (kept per slot in RAM). This measures the cost where it shows most: warm 4K random
reads, all hits, at QD32, served by

  checked    this tree's flashtier (reads checked)
  unchecked  flashtier built from --baseline-ref (default 971e05d, the last commit before reads
             were checked; format version 1), the same way

Each serves its own cache file (same size, same disk) formatted by itself for the same emulated
slow backing store (DESIGN.md §5), warmed the same way (sequential reads of the working set until
a pass promotes nothing more). Rounds are interleaved (order alternating) and medians reported,
with the servers' CPU time per I/O: the difference in CPU µs per I/O is what the check costs
(together with anything else that changed between the two commits on the read path: the
lookup also fetches the slot's CRC, the lost-blocks check is one comparison when nothing is lost).

The baseline is built once into WORKDIR/baseline-<sha>/ (a git worktree and its own target dir)
and reused by later runs; --baseline-bin PATH uses a binary built elsewhere instead.

Writes bench/results/checksum_cost.{md,json,png}.
"""

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import benchlib as bl

PEERS = ["unchecked", "checked"]


def build_baseline(ref: str, work: Path) -> Path:
    sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=bl.REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    root = work / f"baseline-{sha}"
    binary = root / "target" / "release" / "flashtier"
    if binary.exists():
        return binary
    src = root / "src"
    if not src.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(src), sha], cwd=bl.REPO, check=True)
    print(f"building the baseline flashtier at {sha} (once)", flush=True)
    subprocess.run(["cargo", "build", "--release", "--locked", "-q", "-p", "flashtier"], cwd=src, check=True,
                   env={**os.environ, "CARGO_TARGET_DIR": str(root / "target")})
    return binary


def warm(server, ws):
    passes = []
    for p in range(4):
        w0 = server.io_counters()["write_bytes"]
        bl.run_fio(bl.nbd_target(server.uri), "read", bs="1M", iodepth=4, size=ws, time_based=False)
        server.wait_io_quiet()
        wrote = server.io_counters()["write_bytes"] - w0
        passes.append(wrote)
        if p > 0 and wrote < (1 << 20):
            return passes
    print(f"warning: {server} was still promoting after 4 passes", flush=True)
    return passes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_fio_args(ap, rounds=6, runtime=10, ramp=2)
    ap.add_argument("--cache-mib", type=int, default=1024, help="cache file size (default 1024)")
    ap.add_argument("--working-set-mib", type=int, default=512, help="working set read at random (default 512)")
    ap.add_argument("--backing-mib", type=int, default=1024, help="backing store size (default 1024)")
    ap.add_argument("--baseline-ref", default="971e05d", help="git ref of the unchecked flashtier (default 971e05d)")
    ap.add_argument("--baseline-bin", metavar="PATH", help="use this unchecked flashtier binary instead of building")
    bl.add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.runtime, args.ramp = 2, 3, 1
        args.cache_mib, args.working_set_mib, args.backing_mib = 256, 128, 256

    binary, work, machine = bl.setup(args, "fio", "nbdkit")
    baseline = Path(args.baseline_bin).resolve() if args.baseline_bin else build_baseline(args.baseline_ref, work)
    bins = {"checked": binary, "unchecked": baseline}
    ws = args.working_set_mib << 20

    backing_img = work / "crc-backing.img"
    bl.make_random_file(backing_img, args.backing_mib << 20)
    reqlog = work / "crc-backing.requests.log"
    backing = bl.slow_backing(backing_img, work / "crc-backing.sock", work / "crc-backing.log",
                              work / "crc-backing.stats.txt", reqlog)
    servers = {}
    warm_passes = {}
    windows = {}
    try:
        t0 = time.time()
        for peer in PEERS:
            cache_img = work / f"crc-cache-{peer}.img"
            bl.flashtier_format(bins[peer], cache_img, backing.uri, args.cache_mib << 20)
            s = bl.flashtier_cache_serve(bins[peer], cache_img, backing.uri, work / f"crc-{peer}.sock",
                                         work / f"crc-{peer}.log", threads=args.threads)
            servers[peer] = s
            warm_passes[peer] = warm(s, ws)
            print(f"{peer}: warmed in {len(warm_passes[peer])} passes", flush=True)
        windows["warm-up"] = (t0, time.time())

        samples = {p: [] for p in PEERS}
        fio_args = dict(rw="randread", bs="4k", iodepth=args.iodepth, size=ws, runtime=args.runtime, ramp=args.ramp)
        meas = time.time()
        for r in range(args.rounds):
            for peer in (PEERS if r % 2 == 0 else PEERS[::-1]):
                m = bl.measure(servers[peer], **fio_args)
                samples[peer].append(m)
                print(f"round {r + 1}/{args.rounds} {peer:9} {m['iops']:9.0f} IOPS  p99 {m['lat_p99_us']:7.0f} us  "
                      f"server CPU {m['cpu_us_per_io']:5.2f} us/IO", flush=True)
        windows["measurement"] = (meas, time.time())
    finally:
        for s in servers.values():
            s.stop()
        backing.stop()

    io = bl.count_backing_io(reqlog, windows)
    meas_reads = io["measurement"].get("read", {"ops": 0, "bytes": 0})
    rows = [{"peer": peer, **bl.medians(samples[peer], ["iops", "lat_p99_us", "lat_mean_us", "cpu_us_per_io",
                                                         "fio_cpu_pct"]),
             "iops_all": [x["iops"] for x in samples[peer]]} for peer in PEERS]
    by = {r["peer"]: r for r in rows}
    ratio = by["checked"]["iops"] / by["unchecked"]["iops"]
    cpu_delta = by["checked"]["cpu_us_per_io"] - by["unchecked"]["cpu_us_per_io"]
    doc = {"machine": machine, "args": vars(args), "rows": rows, "iops_ratio": ratio,
           "cpu_us_per_io_delta": cpu_delta, "baseline": str(baseline), "warm_passes": warm_passes,
           "backing_io": io, "samples": samples}
    out = bl.results_dir(args)
    lines = bl.results_header("The cost of checking every cache read (warm 4K random reads)", machine, args.quick)
    lines += [
        f"4K random reads at QD{args.iodepth} over a {args.working_set_mib} MiB working set fully cached in a "
        f"{args.cache_mib} MiB write-back cache (backing: {args.backing_mib} MiB behind the emulated slow disk). "
        f"**checked** = this tree (every block read from the cache device checked against its CRC32C); "
        f"**unchecked** = flashtier at `{args.baseline_ref}` (no check). Median of {args.rounds} interleaved rounds "
        f"of {args.runtime} s (+{args.ramp} s ramp). " + bl.CLIENT_CPU_NOTE,
        "",
        *bl.peer_table(rows, "unchecked"),
        "",
        f"Checked vs unchecked: **{ratio:.3f}× the IOPS**, **{cpu_delta:+.2f} µs of server CPU per 4K read** "
        f"({cpu_delta / by['unchecked']['cpu_us_per_io'] * 100:+.1f} %).",
        "",
        f"Backing I/O during the measurement: {meas_reads['ops']} reads — "
        f"{'every read was a cache hit' if meas_reads['ops'] == 0 else 'NOT all hits'}.",
        "",
        "![IOPS per round](checksum_cost.png)",
    ]
    bl.write_results(out, "checksum_cost", doc, lines)
    bl.bar_plot(out / "checksum_cost.png", f"Warm 4K random reads, QD{args.iodepth} (bars: median; dots: rounds)",
                "IOPS", ["4K randread (all hits)"],
                [(p, c, [[x["iops"] for x in samples[p]]]) for p, c in [("unchecked", "#aaaaaa"),
                                                                        ("checked", "#1f77b4")]],
                quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
