#!/usr/bin/env python3
"""What recording a trace (`serve --trace`) costs the clients, where it shows most.

Two pass-through servers of the same binary, each exporting its own file in /dev/shm (the fastest
path flashtier has: no cache device, no disk), one with `--trace` (into a file in WORKDIR, on
the disk) and one without:

  off     flashtier serve --backing /dev/shm/...
  traced  flashtier serve --backing /dev/shm/... --trace WORKDIR/...trace

4K random reads and 4K random writes at QD32, rounds interleaved (order alternating), medians
reported with the servers' CPU time per I/O: the difference in CPU µs per I/O is what recording
costs (a relaxed atomic load per request when off; a short lock and a 24-byte record when on,
and the trace thread's writes, which are counted in the server's CPU too). The traced server's
trace is checked at the end: every request fio made is in it, none dropped.

Writes bench/results/trace_cost.{md,json,png}.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

import benchlib as bl

PEERS = ["off", "traced"]
LOADS = [("randread", "4K random reads"), ("randwrite", "4K random writes")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_fio_args(ap, rounds=6, runtime=10, ramp=2)
    ap.add_argument("--size-mib", type=int, default=1024, help="each export's size in /dev/shm (default 1024)")
    bl.add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.runtime, args.ramp, args.size_mib = 2, 3, 1, 256

    binary, work, machine = bl.setup(args, "fio")
    shm = Path("/dev/shm/flashtier-trace-cost")
    shm.mkdir(parents=True, exist_ok=True)
    size = args.size_mib << 20
    trace = work / "trace-cost.trace"
    trace.unlink(missing_ok=True)
    servers = {}
    try:
        for peer in PEERS:
            img = shm / f"{peer}.img"
            bl.make_random_file(img, size)
            extra = ["--control-socket", str(work / f"trace-cost-{peer}.ctl"),
                     "--stats-file", str(work / f"trace-cost-{peer}.stats")]
            if args.threads:
                extra += ["--threads", str(args.threads)]
            if peer == "traced":
                extra += ["--trace", str(trace)]
            servers[peer] = bl.flashtier_serve(binary, str(img), work / f"trace-cost-{peer}.sock",
                                               work / f"trace-cost-{peer}.log", extra=extra)
        samples = {(peer, rw): [] for peer in PEERS for rw, _ in LOADS}
        t0 = time.time()
        for r in range(args.rounds):
            for rw, _ in LOADS:
                for peer in (PEERS if r % 2 == 0 else PEERS[::-1]):
                    m = bl.measure(servers[peer], rw=rw, bs="4k", iodepth=args.iodepth, size=size,
                                   runtime=args.runtime, ramp=args.ramp)
                    samples[(peer, rw)].append(m)
                    print(f"round {r + 1}/{args.rounds} {rw:9} {peer:6} {m['iops']:9.0f} IOPS  "
                          f"server CPU {m['cpu_us_per_io']:5.2f} us/IO", flush=True)
        elapsed = time.time() - t0
        _, status = bl.flashtier_ctl(binary, work / "trace-cost-traced.ctl", "trace", "stop")
    finally:
        for s in servers.values():
            s.stop()
    show = subprocess.run([str(binary), "trace", "show", str(trace)], capture_output=True, text=True,
                          check=True).stdout

    rows = []
    for rw, label in LOADS:
        for peer in PEERS:
            rows.append({"load": rw, "peer": peer,
                         **bl.medians(samples[(peer, rw)], ["iops", "lat_p99_us", "cpu_us_per_io"])})
    by = {(r["load"], r["peer"]): r for r in rows}
    lines = bl.results_header("The cost of recording a trace (pass-through export from /dev/shm)", machine,
                              args.quick)
    lines += [
        f"Two pass-through servers of one binary over {args.size_mib} MiB files in /dev/shm, one recording "
        f"`--trace` into {work}. fio nbd engine, QD{args.iodepth}, one connection; median of {args.rounds} "
        f"interleaved rounds of {args.runtime} s (+{args.ramp} s ramp). Total {elapsed / 60:.1f} min.",
        "",
        "| load | off IOPS | traced IOPS | ratio | off CPU µs/IO | traced CPU µs/IO | Δ CPU µs/IO |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    doc_ratios = {}
    for rw, label in LOADS:
        off, on = by[(rw, "off")], by[(rw, "traced")]
        ratio = on["iops"] / off["iops"]
        doc_ratios[rw] = ratio
        lines.append(f"| {label} | {off['iops']:,.0f} | {on['iops']:,.0f} | {ratio:.3f}× | "
                     f"{off['cpu_us_per_io']:.2f} | {on['cpu_us_per_io']:.2f} | "
                     f"{on['cpu_us_per_io'] - off['cpu_us_per_io']:+.2f} |")
    lines += ["", "`flashtier trace stop`: " + status.strip(), "", "```", show.strip(), "```", "",
              "![IOPS per round](trace_cost.png)"]
    doc = {"machine": machine, "args": vars(args), "rows": rows, "iops_ratio": doc_ratios,
           "trace_stop": status, "trace_show": show,
           "samples": {f"{p}/{rw}": v for (p, rw), v in samples.items()}}
    out = bl.results_dir(args)
    bl.write_results(out, "trace_cost", doc, lines)
    bl.bar_plot(out / "trace_cost.png", f"Pass-through from /dev/shm, QD{args.iodepth} (bars: median; dots: rounds)",
                "IOPS", [label for _, label in LOADS],
                [(p, c, [[x["iops"] for x in samples[(p, rw)]] for rw, _ in LOADS])
                 for p, c in [("off", "#aaaaaa"), ("traced", "#1f77b4")]], quick=args.quick)
    trace.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
