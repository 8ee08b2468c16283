#!/usr/bin/env python3
"""What `reclaim_compact_pct` buys and costs: each trace replayed through a real cache
(`flashtier advise --engine`) once per threshold, at the pace it was recorded.

For every trace and threshold: the read miss ratio, the share of the cache holding live blocks at
the end, exact LRU's miss ratio at the same capacity, and the replay's own counters (blocks copied
forward by reclaim, blocks evicted, segments compacted): the copies are the price, cache device
writes beyond the clients' own.

Usage:
  bench/compaction_threshold.py --flashtier BIN --trace NAME=FILE:BYTES [--trace ...]
      [--pcts 50,70,75,90] [--speed 1] [--out bench/results/compaction_threshold]

A trace comes from `flashtier serve --trace` (bench/eviction.py leaves its MariaDB recording in
/var/tmp/flashtier-bench/eviction-oltp.ft); BYTES is the cache size to replay it into.
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import benchlib as bl

COUNTERS = ("moved_blocks", "evicted_blocks", "compacted_segments", "reclaimed_segments",
            "write_blocks", "promoted_blocks", "sealed_unused_blocks")


def replay(binary, trace, size, pct, speed, scratch):
    cmd = [str(binary), "advise", str(trace), "--sample", "1", "--sizes", str(size), "--engine",
           "--engine-accesses", "100000000", "--engine-speed", speed, "--json",
           "--scratch-dir", str(scratch), "--engine-set", f"reclaim_compact_pct={pct}",
           "--log", "flashtier=debug"]
    t0 = time.time()
    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    row = json.loads(run.stdout)["curve"][0]
    # The replay's counters, from its debug line (`replay finished stats=StatsSnapshot { .. }`).
    finished = [line for line in run.stderr.splitlines() if "replay finished" in line]
    if not finished:
        sys.exit(f"no 'replay finished' line from: {' '.join(cmd)}")
    counters = {k: int(m.group(1)) for k in COUNTERS
                for m in [re.search(rf"\b{k}: (\d+)", finished[-1])] if m}
    return {
        "pct": pct,
        "command": " ".join(cmd),
        "seconds": round(time.time() - t0, 1),
        "bytes": row["bytes"],
        "miss": row["flashtier_miss_ratio"],
        "lru_miss": row["lru_miss_ratio"],
        "live": row["flashtier_live_share"],
        "headers": row["flashtier_header_share"],
        "counters": counters,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flashtier", type=Path)
    ap.add_argument("--trace", action="append",
                    help="NAME=FILE:BYTES, a trace and the cache size to replay it into")
    ap.add_argument("--pcts", default="50,70,75,90")
    ap.add_argument("--speed", default="1", help="--engine-speed: 1 = the recorded pace")
    ap.add_argument("--scratch", type=Path, default=Path("/var/tmp/flashtier-bench/compaction"))
    ap.add_argument("--out", type=Path, default=Path("bench/results/compaction_threshold"))
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite README.md from the results.json already in --out")
    a = ap.parse_args()
    if a.report_only:
        write_report(a.out, json.loads((a.out / "results.json").read_text()))
        return
    if not a.flashtier or not a.trace:
        ap.error("--flashtier and at least one --trace are needed (or --report-only)")
    a.scratch.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    version = bl._first_line([str(a.flashtier), "--version"])
    rows, traces = [], {}
    for spec in a.trace:
        name, rest = spec.split("=", 1)
        path, size = rest.rsplit(":", 1)
        traces[name] = subprocess.run([str(a.flashtier), "trace", "show", path], capture_output=True,
                                      text=True, check=True).stdout
        for pct in [int(p) for p in a.pcts.split(",")]:
            r = replay(a.flashtier, path, int(size), pct, a.speed, a.scratch)
            r.update(trace=name, file=path)
            rows.append(r)
            print(f"{name} {pct}%: miss {r['miss']:.2%} (LRU {r['lru_miss']:.2%}), "
                  f"live {r['live']:.1%}, moved {r['counters'].get('moved_blocks')}", flush=True)
    finished = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    results = {"command": bl.command_line(),
               "flashtier": version, "speed": a.speed, "finished": finished, "traces": traces,
               "rows": rows}
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    write_report(a.out, results)
    print(a.out / "README.md")


def write_report(out, results):
    rows = results["rows"]
    lines = [
        "# `reclaim_compact_pct`: capacity against copying",
        "",
        f"Command: `{results['command']}`  ",
        f"{results['flashtier']}; finished {results['finished']}; replays at "
        f"`--engine-speed {results['speed']}`.",
        "",
        "Each trace replayed whole through a real cache (`flashtier advise --engine`, one run per "
        "row). *copied per client block*: blocks reclaim copied forward, over the blocks clients "
        "wrote plus those promoted after read misses (the cache device writes the clients cause).",
        "",
        "| trace | cache | threshold | miss | exact LRU | ÷ LRU | live | copied | copied per client block | evicted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c = r["counters"]
        client = c.get("write_blocks", 0) + c.get("promoted_blocks", 0)
        lines.append(
            f"| {r['trace']} | {r['bytes'] / 2**20:.0f} MiB | {r['pct']}% | {r['miss']:.1%} | "
            f"{r['lru_miss']:.1%} | {r['miss'] / r['lru_miss']:.2f}x | {r['live']:.1%} | "
            f"{c.get('moved_blocks', 0):,} | {c.get('moved_blocks', 0) / max(client, 1):.2f} | "
            f"{c.get('evicted_blocks', 0):,} |")
    for name, show in results.get("traces", {}).items():
        lines += ["", f"`{name}`:", "", "```", show.rstrip(), "```"]
    (out / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
