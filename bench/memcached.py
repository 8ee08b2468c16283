#!/usr/bin/env python3
"""WaffleGrid's experiment on flashtier's memcached tier: MariaDB + sysbench over a slow disk, with
a pool of memcached servers holding clean 4 KiB blocks between the database and the disk.

WaffleGrid put memcached behind InnoDB's buffer pool of a disk-bound database and found (as the
issue quotes it) 3.3× in its "non-LRU" mode, which stores pages as they come from disk, and 1.9× in
its "LRU" mode, which stores only pages the buffer pool evicts. flashtier's tier has both modes:
`inclusive` stores every block read from or written to the backing store, `victim` only blocks a
faster tier evicts. The faster tier that hands evictions down is flashtier's RAM tier standing
directly on the memcached tier (`--ram-cache`, no SSD tier): without it victim stores nothing (the
report shows it), with it the RAM tier plays the part InnoDB's buffer pool played for WaffleGrid.

The database, workload and run are bench/oltp.py's (imported, not copied): ext4 on a loop device on
nbdfuse on the NBD export, mariadbd with a buffer pool ~1/20 of the data, sysbench oltp_read_write
--rand-type=pareto, --warmup seconds not counted, then --seconds measured; the slow disk is
oltp.py's `slow` stack (nbdkit noparallel + 4 ms delay + stats + log filters). No SSD tier: every
flashtier cell is `flashtier serve --backing nbd+unix://<slow disk>` (pass-through, no --cache).

Cells:
  slow                          the slow disk alone (reference)
  ft-pass                       flashtier pass-through, no memcached (the base of every ratio)
  ft-pass+mc-all-inclusive      + memcached, --memcached-mode inclusive, memory --all-factor × the
                                data's allocated bytes (default 1.5×: holds all of it)
  ft-pass+mc-quarter-inclusive  + memcached, inclusive, memory for --fraction (default 1/4) of the
                                data's blocks
  ft-pass+mc-quarter-victim     the same memory, --memcached-mode victim
  ft-pass+ram                   flashtier pass-through with a RAM tier (--ram-cache: --ram-fraction,
                                default 1/8, of the data's bytes), no memcached
  ft-pass+ram+mc-quarter-inclusive  the RAM tier on memcached for a quarter, inclusive
  ft-pass+ram+mc-quarter-victim     the RAM tier on memcached for a quarter, victim: the RAM tier's
                                evictions are what memcached stores (WaffleGrid's LRU mode)
The memcached servers (--servers of them, default 2, on loopback ports; `-m` each so their total is
the cell's memory) are started fresh for each cell and stopped after it. A 4 KiB block is stored as
a ~4.1 KiB value plus a ~45-byte key, which lands in memcached 1.6's 4,544-byte slab class (230 per
1 MiB slab page): the quarter cells get ceil(fraction × blocks ÷ servers ÷ 230) MiB per server. The
report gives the memory given and what memcached says it held (`stats`, `stats slabs`).

Every cell (the slow disk too, so the page cache under the slow disk is in the same state in all
of them) is warmed before mariadbd starts as oltp.py warms its caches: every allocated range of the
image is read through the export (1 MiB reads), which fills an inclusive tier; the pass is repeated
while it missed blocks the pool failed to store (memcached requests that timed out, servers skipped
after a timeout) and memcached has evicted nothing yet, at most --warm-passes (default 4) times. Cells are
interleaved over --repeat rounds (default 1), the order reversed every other round.

Reported per cell (median over rounds): TPS, the ratio over ft-pass, p95 latency, the memcached
hit % over the measured run (flashtier's `stats --json`: hit blocks ÷ looked-up blocks, after minus
before), the blocks the tier stored while warming, the slow disk's reads and writes during the
measured run (its log filter), memcached's items and evictions at the end of the cell.
Targets (the issue): memcached holding all the data ≥ 3× the TPS of no memcached; with a quarter,
the modes ranked as WaffleGrid found (inclusive 3.3× above victim's 1.9×), or the measured reason.

--quick runs every cell once on oltp.py's --quick data (small, short runs) and checks the results
are sane: sysbench ran, the JSON is written, flashtier reports the memcached counters, the
inclusive tier stored blocks while warming and was hit; any failure exits non-zero.

Writes bench/results/memcached/memcached.{md,json,png} (--quick: /tmp/flashtier-bench-quick/memcached).
Needs root and what oltp.py needs, plus memcached (1.6; scripts/install-deps.sh).
"""

import argparse
import atexit
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import benchlib as bl
import oltp
from memcached_pool import BLOCK, ITEMS_PER_MIB, MEMCACHED, MemcachedPool, pool_totals

# config -> (description, memory: None | "all" | "quarter", --memcached-mode, with a RAM tier)
CELLS = {
    "slow": ("the slow disk alone", None, None, False),
    oltp.PASS: ("flashtier pass-through, no memcached", None, None, False),
    f"{oltp.PASS}+mc-all-inclusive": ("pass-through + memcached holding all the data, inclusive", "all", "inclusive",
                                      False),
    f"{oltp.PASS}+mc-quarter-inclusive": ("pass-through + memcached for a quarter of the data, inclusive",
                                          "quarter", "inclusive", False),
    f"{oltp.PASS}+mc-quarter-victim": ("pass-through + memcached for a quarter of the data, victim",
                                       "quarter", "victim", False),
    f"{oltp.PASS}+ram": ("pass-through + a RAM tier, no memcached", None, None, True),
    f"{oltp.PASS}+ram+mc-quarter-inclusive": ("pass-through + a RAM tier on memcached for a quarter, inclusive",
                                              "quarter", "inclusive", True),
    f"{oltp.PASS}+ram+mc-quarter-victim": ("pass-through + a RAM tier on memcached for a quarter, victim (the RAM "
                                           "tier's evictions stored)", "quarter", "victim", True),
}
BASE = oltp.PASS
ALL_INC, Q_INC, Q_VIC = (f"{oltp.PASS}+mc-{x}" for x in ("all-inclusive", "quarter-inclusive", "quarter-victim"))
RAM, RQ_INC, RQ_VIC = (f"{oltp.PASS}+ram{x}" for x in ("", "+mc-quarter-inclusive", "+mc-quarter-victim"))


def ram_mib(data_bytes, args):
    """The RAM tier's size for the data."""
    return math.ceil(args.ram_fraction * data_bytes / (1 << 20))


# --- flashtier's memcached counters -------------------------------------------------------------

MC_FIELDS = ("lookup_blocks", "hit_blocks", "miss_blocks", "stored_blocks", "store_failures", "stale_values",
             "corrupt_values", "removed_blocks", "bypassed_requests", "pool_errors", "pool_timeouts", "pool_skipped")


def mc_key(flat, field):
    """The key of flashtier's flattened `stats --json` report holding the memcached tier's `field`
    since the server started: `counters.memcached_<field>` (also in `memcached.tier` / `.pool`), or None."""
    for k in (f"counters.memcached_{field}", f"memcached.tier.{field}",
              f"memcached.pool.{field.removeprefix('pool_')}" if field.startswith("pool_") else None):
        if k in flat:
            return k
    return None


def mc_counters(report):
    """{field: value} of the memcached tier's counters in a `stats --json` report (missing: absent)."""
    flat = oltp.flatten(report)
    return {f: flat[k] for f in MC_FIELDS if (k := mc_key(flat, f)) is not None}


def mc_delta(before, after):
    a, b = mc_counters(before), mc_counters(after)
    return {f: b[f] - a.get(f, 0) for f in b}


def hit_pct(d):
    if d and d.get("lookup_blocks"):
        return 100 * d.get("hit_blocks", 0) / d["lookup_blocks"]
    return float("nan")


# --- runs ---------------------------------------------------------------------------------------

def memory_mib(kind, data_bytes, args):
    """MiB per server for a cell's memory kind ("all" or "quarter")."""
    if kind == "all":
        return math.ceil(args.all_factor * data_bytes / (1 << 20) / args.servers)
    return math.ceil(args.fraction * (data_bytes // BLOCK) / args.servers / ITEMS_PER_MIB)


def warmer(binary, pool, max_passes):
    """oltp.one_run's warm function: reads every allocated range through the export, as oltp.py warms,
    again while a pass missed blocks that the pool failed to store (a timeout, a server skipped) and
    memcached has evicted nothing yet (room left), at most `max_passes` times; records the memcached
    tier's counters per pass and memcached's after the warm."""
    def warm(stack, ranges):
        t0, passes, report = time.time(), [], None
        for _ in range(max_passes):
            before = mc_counters(report)
            secs, nbytes = oltp.warm_through(stack.uri, ranges)
            report = bl.flashtier_report(binary, stack.control) if stack.control else None
            d = {f: v - before.get(f, 0) for f, v in mc_counters(report).items()}
            full = pool is not None and pool_totals(pool.stats())["evictions"] > 0
            passes.append({"read_seconds": round(secs, 1), "bytes": nbytes, **d, "memcached_full": full})
            # Another pass only helps if blocks were not stored and memcached has room for them.
            if not (d.get("miss_blocks") and d.get("store_failures")) or full:
                break
        return {"seconds": round(time.time() - t0, 1), "read_seconds": sum(p["read_seconds"] for p in passes),
                "bytes": sum(p["bytes"] for p in passes), "flashtier": report, "passes": passes,
                "memcached_servers": pool.stats() if pool else None}
    return warm


def warmed_bytes(img: Path, work: Path):
    """The allocated bytes of a run's copy of the image (one_run copies it with cp --sparse=always, which
    leaves out blocks of zeros): what every warm-up reads, the data the memcached tier may hold."""
    probe = work / "sparse-probe.img"
    subprocess.run(["cp", "--sparse=always", str(img), str(probe)], check=True)
    try:
        return sum(n for _, n in oltp.data_ranges(probe))
    finally:
        probe.unlink()


def run_cell(cell, rnd, args, binary, work, images, logs_root, data_bytes):
    _, kind, mode, ram = CELLS[cell.config]
    pool, extra = None, []
    logs = logs_root / f"r{rnd}-{oltp.cell_key(cell).replace('/', '-')}"
    if kind:
        pool = MemcachedPool(args.servers, memory_mib(kind, data_bytes, args), logs)
        extra = ["--memcached", pool.arg, "--memcached-mode", mode,
                 *(["--memcached-timeout-ms", str(args.memcached_timeout_ms)] if args.memcached_timeout_ms else [])]
    if ram:
        extra += ["--ram-cache", f"{ram_mib(data_bytes, args)}M"]
    try:
        rec = oltp.one_run(cell, rnd, args, binary, work, images, {}, logs_root, serve_extra=extra,
                           warm=warmer(binary, pool, args.warm_passes))
        rec["serve_extra"] = extra
        if pool is not None:
            rec["memcached_servers"] = pool.stats()
    finally:
        if pool is not None:
            pool.stop()
    if rec.get("flashtier_after"):
        rec["flashtier_counters"] = oltp.flashtier_delta(rec)
        rec["memcached_keys"] = {f: mc_key(oltp.flatten(rec["flashtier_after"]), f) for f in MC_FIELDS}
        rec["memcached_measured"] = mc_delta(rec["flashtier_before"], rec["flashtier_after"])
        rec["memcached_after_warm"] = mc_counters((rec.get("warm") or {}).get("flashtier"))
    return rec


def summarize(cells, runs, data_bytes, args):
    rows = oltp.summarize(cells, runs)
    base = next((r for r in rows if r["cell"]["config"] == BASE), None)
    for row in rows:
        rs = [r for r in runs if r["key"] == row["key"]]
        cfg = row["cell"]["config"]
        _, kind, mode, _ = CELLS[cfg]
        row["config"], row["mode"] = cfg, mode
        row["tps_ratio"] = row["tps"] / base["tps"] if base and base["tps"] else float("nan")
        row["memcached_mib_each"] = memory_mib(kind, data_bytes, args) if kind else None
        row["memcached_mib_total"] = row["memcached_mib_each"] * args.servers if kind else None
        mc = [r["memcached_measured"] for r in rs if r.get("memcached_measured")]
        row["memcached_hit_pct"] = oltp.median([hit_pct(d) for d in mc]) if mc else None
        row["memcached_measured"] = {f: oltp.median([d.get(f, float("nan")) for d in mc]) for f in MC_FIELDS} \
            if mc else None
        warm = [r["memcached_after_warm"] for r in rs if r.get("memcached_after_warm")]
        row["warm_passes"] = oltp.median([len(r["warm"]["passes"]) for r in rs if (r.get("warm") or {}).get("passes")])
        wt = [pool_totals(r["warm"]["memcached_servers"]) for r in rs if (r.get("warm") or {}).get("memcached_servers")]
        row["items_after_warm"] = oltp.median([t["curr_items"] for t in wt]) if wt else None
        row["stored_after_warm"] = oltp.median([w.get("stored_blocks", float("nan")) for w in warm]) if warm else None
        row["store_failures_warm"] = oltp.median([w.get("store_failures", float("nan")) for w in warm]) \
            if warm else None
        tot = [pool_totals(r.get("memcached_servers")) for r in rs if r.get("memcached_servers")]
        row["memcached_end"] = {k: oltp.median([t[k] for t in tot]) for k in tot[0]} if tot else None
        row["backing_reads_per_txn"] = oltp.median(
            [r["backing_io"]["read"]["ops"] / r["sysbench"]["transactions"] for r in rs if r.get("backing_io")])
        row["backing_writes_per_txn"] = oltp.median(
            [r["backing_io"]["write"]["ops"] / r["sysbench"]["transactions"] for r in rs if r.get("backing_io")])
        # The slow disk serves one request at a time, each taking at least --delay-ms (reads and writes; its
        # flushes are not delayed): a lower bound of its busy share of the measured run.
        row["slow_busy_pct_min"] = oltp.median(
            [100 * (r["backing_io"]["read"]["ops"] + r["backing_io"]["write"]["ops"]) * args.delay_ms / 1000
             / r["sysbench"]["seconds"] for r in rs if r.get("backing_io")])
    return rows


def targets(rows):
    by = {r["config"]: r for r in rows}
    out = []

    def ratio(a, b):
        return by[a]["tps"] / by[b]["tps"] if a in by and b in by and by[b]["tps"] else None
    if ALL_INC in by and BASE in by:
        out.append(("memcached holding all the data (inclusive): TPS ≥ 3× no memcached",
                    bl.check_target(ratio(ALL_INC, BASE), 3.0)))
    if Q_INC in by and Q_VIC in by:
        mark, gap = bl.check_target(ratio(Q_INC, Q_VIC), 1.0)
        out.append(("a quarter of the data: inclusive ranked above victim, as WaffleGrid found "
                    "(inclusive TPS ÷ victim TPS ≥ 1.0×)", (mark, gap)))
    if Q_INC in by and BASE in by:
        out.append(("a quarter, inclusive, vs no memcached: WaffleGrid's non-LRU 3.3×",
                    bl.check_target(ratio(Q_INC, BASE), 3.3)))
    if Q_VIC in by and BASE in by:
        out.append(("a quarter, victim, vs no memcached: WaffleGrid's LRU 1.9×",
                    bl.check_target(ratio(Q_VIC, BASE), 1.9)))
    if RQ_INC in by and RQ_VIC in by:
        out.append(("with the RAM tier feeding victim, a quarter: inclusive ranked above victim, as WaffleGrid found "
                    "(inclusive TPS ÷ victim TPS ≥ 1.0×)", bl.check_target(ratio(RQ_INC, RQ_VIC), 1.0)))
    if RQ_VIC in by and RAM in by:
        out.append(("with the RAM tier, a quarter, victim vs the RAM tier alone: WaffleGrid's LRU 1.9×",
                    bl.check_target(ratio(RQ_VIC, RAM), 1.9)))
    return out


def fmt(x, spec=",.0f", none="—"):
    return none if x is None or x != x else format(x, spec)


def report(args, machine, cells, runs, images, data_bytes, wall, out):
    rows = summarize(cells, runs, data_bytes, args)
    tgts = targets(rows)
    meta = images[16][1]
    blocks = data_bytes // BLOCK
    doc = {"machine": machine, "args": vars(args), "image": meta, "data_allocated_bytes": data_bytes,
           "data_blocks": blocks, "items_per_mib_assumed": ITEMS_PER_MIB, "wall_seconds": round(wall, 1),
           "rows": rows, "targets": tgts, "runs": runs}
    lines = bl.results_header("The memcached tier under MariaDB + sysbench (WaffleGrid's experiment)", machine,
                              args.quick)
    lines += [
        f"Whole run: **{wall / 60:.1f} min** wall time ({len(runs)} runs; {args.repeat} round(s), interleaved). "
        "The machine has 2 CPUs and is shared with other test runs; load average at the start is in the line above.",
        "",
        "Stack (bench/oltp.py's): mariadbd → ext4 → loop device (O_DIRECT) → nbdfuse → the cell's NBD export. "
        f"sysbench oltp_read_write, {args.tables} tables × {args.table_size:,} rows, --rand-type=pareto, "
        f"{args.sysbench_threads} threads; InnoDB 16K pages, doublewrite ON, buffer pool {args.pool_mib} MiB; "
        f"data directory {meta['data_bytes'] / 2**20:.0f} MiB; the data every warm-up reads (the allocated bytes of "
        f"the run's sparse copy of the image) {data_bytes / 2**20:.0f} MiB ({blocks:,} blocks of 4 KiB; "
        f"≈{data_bytes / (args.pool_mib << 20):.0f}× the pool). Slow disk: one request "
        f"at a time, {args.delay_ms} ms per read and write. No SSD tier: the flashtier cells are `flashtier serve "
        "--backing <slow disk>` without --cache. memcached: "
        f"{args.servers} servers on loopback ({machine.get('memcached', '?')}), started empty for each cell; "
        f"'all' = {args.all_factor:g}× the allocated bytes, 'quarter' = room for {args.fraction:g} of the blocks at "
        f"{ITEMS_PER_MIB} items per MiB. The +ram cells: `--ram-cache {ram_mib(data_bytes, args)}M` "
        f"({args.ram_fraction:g} of the allocated bytes; lru), directly on the memcached tier. Every cell is warmed by reading the image's allocated ranges through "
        f"the export, again while a pass missed blocks the pool failed to store and memcached still had room (at "
        f"most {args.warm_passes} passes); then {args.warmup} s of load (not counted) and {args.seconds} s measured. "
        "Figures are medians "
        "over rounds. Hit %: flashtier's memcached hit blocks ÷ looked-up blocks over the measured run. Slow-disk "
        "I/O: requests the slow disk served during the measured run; busy ≥: (reads + writes) × the delay ÷ the "
        "measured "
        "time, a lower bound of the share of time the slow disk was serving (it serves one request at a time).",
        "",
        "| cell | memcached memory | TPS | vs no memcached | p95 ms | memcached hit % "
        "| warm-up: stored / failed (passes), "
        "items after "
        "| slow-disk reads / writes | per txn | slow disk busy ≥ | memcached items / evictions at end |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mem = (f"{r['memcached_mib_total']:,} MiB ({args.servers} × {r['memcached_mib_each']}; room for "
               f"~{min(100, 100 * r['memcached_mib_total'] * ITEMS_PER_MIB / blocks):.0f}% of the blocks)"
               if r["memcached_mib_total"] else "—")
        end = r["memcached_end"]
        lines.append(
            f"| {r['config']} | {mem} | {r['tps']:,.1f} | {r['tps_ratio']:.2f}× | {r['p95_ms']:,.0f} | "
            f"{fmt(r['memcached_hit_pct'], '.1f')} | "
            + (f"{fmt(r['stored_after_warm'])} / {fmt(r['store_failures_warm'])} ({fmt(r['warm_passes'])}), "
               f"{fmt(r['items_after_warm'])} | " if r["mode"] else "— | ")
            + f"{fmt(r['backing_reads'])} / {fmt(r['backing_writes'])} | "
            f"{fmt(r['backing_reads_per_txn'], '.1f')} / {fmt(r['backing_writes_per_txn'], '.1f')} | "
            f"{fmt(r['slow_busy_pct_min'], '.0f')}% | "
            + (f"{end['curr_items']:,.0f} / {end['evictions']:,.0f}" if end else "—") + " |")
    lines += ["", "Cells: " + "; ".join(f"**{k}**: {v[0]}" for k, v in CELLS.items()), ""]
    if tgts:
        lines += ["Targets, measured in this run:", "", *bl.targets_table(tgts), ""]
    lines += explain(rows, args)
    mc_runs = [r for r in runs if r.get("memcached_measured")]
    if mc_runs:
        lines += ["flashtier's memcached counters over each measured run (after minus before; keys "
                  + ", ".join(f"`{k}`" for k in dict.fromkeys(v for r in mc_runs for v in r["memcached_keys"].values()
                                                                  if v)) + "):", "",
                  "| run | " + " | ".join(MC_FIELDS) + " |", "|---|" + "---:|" * len(MC_FIELDS)]
        for r in mc_runs:
            d = r["memcached_measured"]
            lines.append(f"| {r['cell']['config']} r{r['round'] + 1} | "
                         + " | ".join(fmt(d.get(f)) for f in MC_FIELDS) + " |")
        lines.append("")
    srv = [r for r in runs if r.get("memcached_servers")]
    if srv:
        lines += ["memcached at the end of each cell (sum over its servers; the slab classes in use, server by "
                  "server: chunk bytes (chunks used)):", "",
                  "| run | limit MiB | bytes MiB | items | evictions | get hits | get misses | sets | CPU s "
                  "| slab chunk "
                  "bytes (chunks) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in srv:
            t = pool_totals(r["memcached_servers"])
            slabs = "; ".join(f"{v['chunk_size']} ({v['used_chunks']:,})" for s in r["memcached_servers"]
                              for v in s["slabs"].values())
            lines.append(f"| {r['cell']['config']} r{r['round'] + 1} | {t['limit_maxbytes'] / 2**20:,.0f} | "
                         f"{t['bytes'] / 2**20:,.0f} | {t['curr_items']:,} | {t['evictions']:,} | "
                         f"{t['get_hits']:,} | {t['get_misses']:,} | {t['cmd_set']:,} | {t['cpu_seconds']:.1f} | "
                         f"{slabs or '—'} |")
        lines.append("")
    lines += ["Per run (seconds, warm-up pass included): " + "; ".join(
        f"{r['cell']['config']} r{r['round'] + 1}: {r['run_seconds']:.0f} s (warm {r['warm']['seconds']:.0f} s)"
        for r in runs), "",
        "bench/tier_latency.py compares the tiers' read latency (RAM, memcached, SSD, slow disk).", "",
        "![TPS, memcached hit % and per-10-second TPS of each cell](memcached.png)"]
    bl.write_results(out, "memcached", doc, lines)
    plot(out / "memcached.png", cells, runs, rows, args)
    return rows, tgts


def explain(rows, args):
    """What the counters say about the result, from measured figures only."""
    by = {r["config"]: r for r in rows}
    out = []
    for cfg in (RQ_VIC, RQ_INC):
        if cfg in by:
            v = by[cfg]
            out.append(f"- {cfg}: memcached hit {fmt(v['memcached_hit_pct'], '.1f')}% of looked-up blocks during the "
                       f"measured run, {v['tps_ratio']:.2f}× the TPS of no memcached"
                       + (f", {v['tps'] / by[RAM]['tps']:.2f}× the RAM tier alone" if RAM in by and by[RAM]['tps']
                          else "") + ".")
    if RQ_INC in by and RQ_VIC in by:
        i, v = by[RQ_INC], by[RQ_VIC]
        mi, mv = i.get("memcached_measured") or {}, v.get("memcached_measured") or {}
        out.append(f"- with the RAM tier, victim {'above' if v['tps'] > i['tps'] else 'below'} inclusive: victim's pool "
                   "holds what the RAM tier does not (the two are exclusive), inclusive's duplicates the RAM tier's "
                   "hottest blocks and takes every block read or written below it: it stored "
                   f"{fmt(mi.get('stored_blocks'))} blocks during the measured run against victim's "
                   f"{fmt(mv.get('stored_blocks'))}, for a memcached hit % of {fmt(i['memcached_hit_pct'], '.1f')} "
                   f"against {fmt(v['memcached_hit_pct'], '.1f')}.")
    if Q_VIC in by:
        v = by[Q_VIC]
        out.append(f"- victim stored {fmt(v['stored_after_warm'])} blocks while warming and hit "
                   f"{fmt(v['memcached_hit_pct'], '.1f')}% during the measured run: it stores only blocks a faster "
                   "tier "
                   "evicts, and without a RAM tier there is no faster tier in this cell (WaffleGrid's LRU mode got its "
                   "victims from InnoDB's buffer pool, which flashtier cannot see; the +ram cells give victim one). "
                   "So victim runs as no memcached does, and that, not the mode's merit, ranks it below "
                   "inclusive.")
    for cfg in (ALL_INC, Q_INC):
        if cfg in by and BASE in by and by[cfg]["backing_reads_per_txn"] == by[cfg]["backing_reads_per_txn"]:
            r, b = by[cfg], by[BASE]
            out.append(f"- {cfg}: {r['tps_ratio']:.2f}× the TPS; {fmt(r['memcached_hit_pct'], '.1f')}% of looked-up "
                       f"blocks hit; the slow disk served {r['backing_reads_per_txn']:.1f} reads and "
                       f"{r['backing_writes_per_txn']:.1f} writes per transaction (no memcached: "
                       f"{b['backing_reads_per_txn']:.1f} and {b['backing_writes_per_txn']:.1f}), busy at least "
                       f"{r['slow_busy_pct_min']:.0f}% of the time. memcached holds clean blocks only: every write "
                       "still waits for the slow disk, so the writes alone allow at most "
                       f"1000 ÷ ({r['backing_writes_per_txn']:.1f} × {args.delay_ms} ms) = "
                       f"{1000 / (r['backing_writes_per_txn'] * args.delay_ms):.1f} TPS at this many writes per "
                       f"transaction ({1000 / (r['backing_writes_per_txn'] * args.delay_ms) / b['tps']:.2f}× no "
                       "memcached).")
    for cfg in (ALL_INC, Q_INC):
        d = by.get(cfg, {}).get("memcached_measured") or {}
        if d.get("pool_timeouts") or d.get("pool_skipped"):
            out.append(f"- {cfg}: memcached requests timed out {fmt(d.get('pool_timeouts'))} times during the measured "
                       "run (flashtier's --memcached-timeout-ms, default 5 ms, on this shared 2-CPU machine); a server "
                       f"that times out is skipped for a backoff, and {fmt(d.get('pool_skipped'))} requests were "
                       "skipped "
                       "so (their blocks read from the slow disk).")
    if out:
        out = ["What the counters say:", "", *out, ""]
    return out


def plot(path, cells, runs, rows, args):
    plt = bl.pyplot()
    by = {r["key"]: r for r in rows}
    cells = [c for c in cells if oltp.cell_key(c) in by]
    names = [c.config.replace(oltp.PASS + "+", "+").replace("mc-", "") for c in cells]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(3, 1, figsize=(max(8, 1.8 * len(cells) + 2), 12))
    ax = axes[0]
    for i, c in enumerate(cells):
        vals = [r["sysbench"]["tps"] for r in runs if r["key"] == oltp.cell_key(c)]
        ax.bar(i, by[oltp.cell_key(c)]["tps"], color=colors[i % len(colors)])
        ax.scatter([i] * len(vals), vals, s=9, color="black", zorder=3)
        ax.annotate(f"{by[oltp.cell_key(c)]['tps_ratio']:.2f}×", (i, max([by[oltp.cell_key(c)]["tps"], *vals])),
                    xytext=(0, 4), textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylabel("TPS (median; dots: rounds)")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.08)
    ax.set_title("sysbench oltp_read_write TPS; label: ratio over flashtier pass-through without memcached")
    ax = axes[1]
    hits = [by[oltp.cell_key(c)]["memcached_hit_pct"] for c in cells]
    reads = [by[oltp.cell_key(c)]["backing_reads_per_txn"] for c in cells]
    writes = [by[oltp.cell_key(c)]["backing_writes_per_txn"] for c in cells]
    x = range(len(cells))
    ax.bar([i - 0.2 for i in x], [h if h is not None and h == h else 0 for h in hits], width=0.4,
           color="tab:green", label="memcached hit % (left)")
    ax.set_ylabel("memcached hit %")
    ax.set_ylim(0, 100)
    ax2 = ax.twinx()
    ax2.bar([i + 0.2 for i in x], reads, width=0.4, color="tab:gray", label="slow-disk reads per txn (right)")
    ax2.bar([i + 0.2 for i in x], writes, width=0.4, bottom=reads, color="tab:red",
            label="slow-disk writes per txn (right)")
    ax2.set_ylabel("slow-disk I/O per transaction")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, fontsize=8)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    ax.set_title("Measured run: memcached hit % and the slow disk's I/O per transaction")
    ax = axes[2]
    for i, c in enumerate(cells):
        for r in [r for r in runs if r["key"] == oltp.cell_key(c)][:1]:
            iv = r["sysbench"]["intervals"]
            ax.plot([p["t"] for p in iv], [p["tps"] for p in iv], marker="o", ms=3, color=colors[i % len(colors)],
                    label=names[i])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds of the measured run")
    ax.set_ylabel("TPS per 10 s")
    ax.set_title("Per-10-second TPS, first round")
    ax.legend(fontsize=8, ncol=3)
    bl.save_figure(fig, path, args.quick)


def sanity(runs):
    """--quick's checks beyond oltp's (sysbench ran, TPS > 0): the counters exist and the tier works."""
    bad = []
    for r in runs:
        cfg = r["cell"]["config"]
        if not CELLS[cfg][1]:
            continue
        if not r.get("memcached_measured") or "hit_blocks" not in r["memcached_measured"] or \
                "lookup_blocks" not in r["memcached_measured"]:
            bad.append(f"{cfg}: flashtier's stats --json has no memcached lookup/hit counters")
            continue
        if CELLS[cfg][2] == "inclusive":
            if not (r.get("memcached_after_warm") or {}).get("stored_blocks"):
                bad.append(f"{cfg}: the inclusive tier stored nothing while warming")
            if not r["memcached_measured"].get("hit_blocks"):
                bad.append(f"{cfg}: no memcached hit during the measured run")
        if not (pool_totals(r.get("memcached_servers")) or {}).get("cmd_set") and CELLS[cfg][2] == "inclusive":
            bad.append(f"{cfg}: memcached itself saw no set")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_common_args(ap, workdir="/var/tmp/flashtier-memcached")
    oltp.add_database_args(ap)
    ap.add_argument("--servers", type=int, default=2, help="memcached servers per cell (default 2)")
    ap.add_argument("--all-factor", type=float, default=1.5,
                    help="memcached memory of the 'all' cell, × the data's allocated bytes (default 1.5)")
    ap.add_argument("--fraction", type=float, default=0.25,
                    help="share of the data's blocks the 'quarter' cells' memcached has room for (default 0.25)")
    ap.add_argument("--memcached-timeout-ms", type=int,
                    help="flashtier serve --memcached-timeout-ms (default: the server's default)")
    ap.add_argument("--warm-passes", type=int, default=4,
                    help="at most this many warm-up read passes: another while the last missed blocks the pool "
                         "failed to store and memcached has evicted nothing (default 4)")
    ap.add_argument("--ram-fraction", type=float, default=0.125,
                    help="the +ram cells' --ram-cache, × the data's allocated bytes (default 0.125)")
    ap.add_argument("--only", metavar="CELL,...", help=f"run only these cells ({', '.join(CELLS)})")
    args = ap.parse_args()
    if args.quick:
        oltp.quick_sizes(args)
    if os.geteuid() != 0:
        ap.error("needs root (loop devices, mounts)")
    configs = list(CELLS)
    if args.only:
        configs = args.only.split(",")
        unknown = set(configs) - set(CELLS)
        if unknown:
            ap.error(f"--only: unknown cells {', '.join(sorted(unknown))}")
    t_all = time.time()
    binary, work, machine = oltp.setup_run(args, MEMCACHED)
    machine["memcached"] = bl._first_line([MEMCACHED, "--version"])
    cells = [oltp.Cell(c, 16, True, None) for c in configs]
    images = {16: oltp.prepared_image(args, work, 16)}
    data_bytes = warmed_bytes(images[16][0], work)
    for kind in ("all", "quarter"):
        mib = memory_mib(kind, data_bytes, args)
        print(f"memcached '{kind}': {args.servers} × {mib} MiB (data: {data_bytes / 2**20:.0f} MiB allocated, "
              f"{data_bytes // BLOCK:,} blocks)", flush=True)
    oltp.RUNDIR.mkdir(mode=0o755, exist_ok=True)
    atexit.register(shutil.rmtree, oltp.RUNDIR, ignore_errors=True)
    logs_root = work / "logs"
    shutil.rmtree(logs_root, ignore_errors=True)
    runs = []
    for rnd in range(args.repeat):
        for c in (cells if rnd % 2 == 0 else cells[::-1]):
            print(f"round {rnd + 1}/{args.repeat}: {c.config} ...", flush=True)
            rec = run_cell(c, rnd, args, binary, work, images, logs_root, data_bytes)
            runs.append(rec)
            mc = rec.get("memcached_measured")
            print(f"  {rec['sysbench']['tps']:.1f} TPS, p95 {rec['sysbench']['p95_ms']:.0f} ms"
                  + (f", memcached hit {hit_pct(mc):.1f}%, stored while warming "
                     f"{(rec.get('memcached_after_warm') or {}).get('stored_blocks')}" if mc else "")
                  + (f", slow-disk reads {rec['backing_io']['read']['ops']:,}" if rec.get("backing_io") else "")
                  + f"; run {rec['run_seconds']:.0f} s", flush=True)
    out = Path(args.out) if args.out else bl.results_dir(args) / "memcached"
    report(args, machine, cells, runs, images, data_bytes, time.time() - t_all, out)
    if not (out / "memcached.json").exists():
        sys.exit("memcached.json was not written")
    bad = [f"{r['key']}: no transactions" for r in runs if not r["sysbench"]["tps"] > 0]
    if args.quick:
        bad += sanity(runs)
    if bad:
        sys.exit("sanity checks failed:\n  " + "\n  ".join(bad))
    print(f"whole run: {(time.time() - t_all) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
