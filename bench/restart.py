#!/usr/bin/env python3
"""Restart time of a half-full write-back cache, and RAM per cached block of a full one.

Restart (DESIGN.md §3: a clean shutdown writes a final checkpoint so restart is near-instant;
after a crash, recovery loads the newest checkpoint and replays the log written since):

  1. Format a --cache-mib cache (file written in full first) for a sparse --backing-mib backing
     file on the same local disk, serve it in write-back.
  2. Fill --fill-mib (default: half the cache) with random writes of 4K..64K through NBD (fio
     randwrite, bsrange 4k-64k, QD32, every byte of the range written once), in two parts: the
     first (fill - tail) MiB, then a clean restart (so a checkpoint covers them), then the last
     --tail-mib MiB (default: a tenth of the cache, below the checkpoint trigger of an eighth), so
     a crash now leaves about tail MiB of log to replay.
  3. kill -9; restart; time it; kill -9 again ... (--rounds times). Recovery writes no checkpoint,
     so every round replays the same log tail.
  4. SIGTERM (clean shutdown, final checkpoint); restart; time it; SIGTERM ... (--rounds times).
  Each restart is timed from exec to the "listening on" line on stdout, and the server's own
  time_ms (and records replayed) is taken from its log.

RAM per cached block (DESIGN.md §3 target: <= 16 bytes per cached 4 KiB block):

  5. Write --cache-mib more with 4K random writes past the filled range, so the cache is full
     (reclaim writes the oldest dirty blocks back and keeps the rest), wait for it to settle,
     shut down cleanly (the log says how many blocks were cached), restart and measure the
     server's RSS (VmRSS) idle. RAM per block = (RSS of the full cache after restart - RSS of the
     same server started without a cache) / cached blocks; the delta to the freshly started
     empty cache and RSS / cached blocks are reported too. The
     index's own accounting (Index::memory_bytes) is not printed by `serve`; `flashtier demo`
     prints it for a demo cache of the same size, which the script runs too (--no-demo skips).

Writes bench/results/restart.{md,json,png}.
"""

import argparse
import re
import shutil
import subprocess

import benchlib as bl


def fio_fill(uri, offset, size, bs="4k-64k", rw="randwrite"):
    """Writes every byte of [offset, offset+size) once (fio's random map), with mixed request sizes."""
    return bl.run_fio(bl.nbd_target(uri), rw, bs="4k", iodepth=32, size=size, offset=offset, time_based=False,
                      extra=[f"--bsrange={bs}"] if "-" in bs else [])


def restart_record(ft, kind_expected):
    kind, ev = bl.flashtier_open_event(ft.log_text())
    rec = {"kind": kind, "exec_to_listening_ms": ft.ready_ms, "logged_time_ms": int(ev.get("time_ms", -1)),
           "replayed_records": int(ev.get("replayed_records", 0)), "replayed_batches": int(ev.get("replayed_batches", 0)),
           "cached_blocks": int(ev.get("cached_blocks", 0)), "dirty_blocks": int(ev.get("dirty_blocks", 0))}
    if kind != kind_expected:
        print(f"warning: expected a {kind_expected} open, the log says {kind}", flush=True)
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-mib", type=int, default=4096, help="cache file size (default 4096)")
    ap.add_argument("--fill-mib", type=int, help="dirty data written before the restarts (default: half the cache)")
    ap.add_argument("--tail-mib", type=int, help="part of the fill written after the last checkpoint "
                                                  "(default: a tenth of the cache)")
    ap.add_argument("--backing-mib", type=int, help="backing file size (sparse; default fill + cache + 1 GiB)")
    ap.add_argument("--rounds", type=int, default=5, help="restarts of each kind (default 5)")
    ap.add_argument("--no-full", action="store_true", help="skip filling the cache for the RAM-per-block figure")
    ap.add_argument("--no-demo", action="store_true", help="skip `flashtier demo` for the index's own memory figure")
    bl.add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.cache_mib, args.rounds = 512, 2
    args.fill_mib = args.fill_mib or args.cache_mib // 2
    args.tail_mib = args.tail_mib if args.tail_mib is not None else args.cache_mib // 10
    args.backing_mib = args.backing_mib or args.fill_mib + args.cache_mib + 1024
    if not 0 <= args.tail_mib < args.fill_mib:
        ap.error("--tail-mib must be smaller than --fill-mib")

    binary, work, machine = bl.setup(args, "fio")
    cache = work / "restart-cache.img"
    backing = work / "restart-backing.img"
    sock = work / "restart-ft.sock"
    if backing.exists():
        backing.unlink()
    with open(backing, "wb") as f:
        f.truncate(args.backing_mib << 20)
    fmt = bl.flashtier_format(binary, cache, str(backing), args.cache_mib << 20)
    bl.evict_from_page_cache(cache)
    logn = iter(range(1000))

    def serve(with_cache=True):
        log = work / f"restart-ft-{next(logn)}.log"
        if with_cache:
            return bl.flashtier_cache_serve(binary, cache, backing, sock, log, threads=args.threads)
        return bl.flashtier_serve(binary, str(backing), sock, log,
                                  extra=["--threads", str(args.threads)] if args.threads else [])

    def sigterm(ft):
        """Clean shutdown (final checkpoint); returns the blocks the log says were cached."""
        ft.stop(timeout=300)
        return bl.flashtier_closed_event(ft.log_text())

    mib = 1 << 20
    res = {"unclean": [], "clean": []}
    mem = {}
    fills = []

    # Baseline: the same server without a cache (pass-through) holds no index at all.
    ft = serve(with_cache=False)
    mem["passthrough_rss_kib"] = ft.rss_kib(settle=1)
    sigterm(ft)
    ft = serve()
    mem["empty_rss_kib"] = ft.rss_kib(settle=1)
    mem["empty_start_ms"] = ft.ready_ms
    head = args.fill_mib - args.tail_mib
    m = fio_fill(ft.uri, 0, head * mib)
    fills.append({"what": "fill (head)", "mib": head, "seconds": m["elapsed_s"]})
    print(f"filled {head} MiB in {m['elapsed_s']:.1f} s", flush=True)
    sigterm(ft)
    ft = serve()
    if args.tail_mib:
        m = fio_fill(ft.uri, head * mib, args.tail_mib * mib)
        fills.append({"what": "fill (tail, after the last checkpoint)", "mib": args.tail_mib, "seconds": m["elapsed_s"]})
        print(f"filled the last {args.tail_mib} MiB in {m['elapsed_s']:.1f} s", flush=True)
        if m["elapsed_s"] > 25:
            print("warning: the tail took over 25 s; a periodic checkpoint (every 30 s) may have shortened "
                  "the log to replay", flush=True)
    mem["after_fill_live_rss_kib"] = ft.rss_kib()

    # Crash, restart, crash again: every round replays the same log.
    ft.kill()
    for r in range(args.rounds):
        ft = serve()
        rec = restart_record(ft, "unclean")
        res["unclean"].append(rec)
        print(f"kill -9 restart {r + 1}/{args.rounds}: {rec['exec_to_listening_ms']:.0f} ms to listening, "
              f"logged {rec['logged_time_ms']} ms, replayed {rec['replayed_records']} records "
              f"in {rec['replayed_batches']} batches", flush=True)
        if r + 1 < args.rounds:
            ft.kill()
    closed_half = sigterm(ft)
    for r in range(args.rounds):
        ft = serve()
        rec = restart_record(ft, "clean")
        if r == 0:
            mem["half_full_idle_rss_kib"] = ft.rss_kib(settle=1)
        res["clean"].append(rec)
        print(f"clean restart {r + 1}/{args.rounds}: {rec['exec_to_listening_ms']:.0f} ms to listening, "
              f"logged {rec['logged_time_ms']} ms, {rec['cached_blocks']} blocks cached "
              f"({rec['dirty_blocks']} dirty)", flush=True)
        closed_half = sigterm(ft)

    full = None
    if not args.no_full:
        ft = serve()
        rss0 = ft.rss_kib()
        # 4K random writes: large writes make large log batches, and a batch that does not fit the
        # rest of a segment leaves that rest unused, so they cannot fill the cache.
        m = bl.run_fio(bl.nbd_target(ft.uri), "randwrite", bs="4k", iodepth=32, size=args.cache_mib * mib,
                       offset=args.fill_mib * mib, time_based=False)
        fills.append({"what": "fill to full (4K random)", "mib": args.cache_mib, "seconds": m["elapsed_s"]})
        print(f"wrote {args.cache_mib} MiB more in {m['elapsed_s']:.1f} s; waiting for reclaim to settle", flush=True)
        waited = ft.wait_io_quiet(quiet=3.0, timeout=600)
        live_full = bl.proc_status(ft.pid)
        closed = sigterm(ft)
        ft = serve()
        rec = restart_record(ft, "clean")
        idle_full = ft.rss_kib(settle=1)
        sigterm(ft)
        blocks = int(closed.get("cached_blocks", 0)) or rec["cached_blocks"]
        full = {"cached_blocks": blocks, "dirty_blocks": int(closed.get("dirty_blocks", 0)),
                "capacity_blocks_hint": (args.cache_mib * mib) // 4096, "settle_s": waited,
                "live_rss_before_fill_kib": rss0, "live_rss_full_kib": live_full.get("VmRSS", 0),
                "live_hwm_kib": live_full.get("VmHWM", 0), "idle_rss_full_kib": idle_full, "restart": rec,
                "bytes_per_block_idle_delta": (idle_full - mem["empty_rss_kib"]) * 1024 / blocks if blocks else None,
                "bytes_per_block_vs_passthrough": (idle_full - mem["passthrough_rss_kib"]) * 1024 / blocks
                if blocks else None,
                "bytes_per_block_idle_total": idle_full * 1024 / blocks if blocks else None,
                "bytes_per_block_live_delta": (live_full.get("VmRSS", 0) - rss0) * 1024 / blocks if blocks else None}
        print(f"full cache: {blocks} blocks; idle RSS {idle_full} KiB vs {mem['empty_rss_kib']} KiB empty, "
              f"{mem['passthrough_rss_kib']} KiB without a cache → {full['bytes_per_block_vs_passthrough']:.1f} "
              "bytes/block", flush=True)

    backing.unlink()  # made anew by every run

    demo = None
    if not args.no_demo:
        demo = run_demo(binary, work, args.cache_mib)

    report(args, machine, res, mem, fills, full, demo, closed_half, fmt)


def run_demo(binary, work, cache_mib):
    d = work / "restart-demo"
    shutil.rmtree(d, ignore_errors=True)
    out = subprocess.run([str(binary), "demo", "--dir", str(d), "--cache-size", f"{cache_mib}M",
                          # The index is sized by the cache's capacity alone; a small backing store
                          # keeps the demo's workload (and its slow-disk reads) short.
                          "--size", "16M"],
                         capture_output=True, text=True)
    shutil.rmtree(d, ignore_errors=True)
    m = re.search(r"cache: (\d+) blocks cached in ([\d.]+ \w+) of index RAM \(([\d.]+) bytes per cache block\)",
                  out.stdout)
    if not m:
        print(f"warning: could not read the demo's index figure:\n{out.stdout[-2000:]}{out.stderr[-2000:]}", flush=True)
        return None
    return {"blocks_cached": int(m.group(1)), "index_ram": m.group(2), "bytes_per_cache_block": float(m.group(3))}


def report(args, machine, res, mem, fills, full, demo, closed_half, fmt):
    out = bl.results_dir(args)
    med = lambda recs, k: bl.median([x[k] for x in recs])  # noqa: E731
    summary = {kind: {k: med(recs, k) for k in ("exec_to_listening_ms", "logged_time_ms", "replayed_records",
                                                 "replayed_batches", "cached_blocks", "dirty_blocks")}
               for kind, recs in res.items() if recs}
    doc = {"machine": machine, "args": vars(args), "restarts": res, "summary": summary, "memory": mem,
           "fills": fills, "full_cache": full, "demo_index": demo, "closed_half_full": closed_half,
           "format_output": fmt}
    lines = bl.results_header("Restart time of a half-full write-back cache; RAM per cached block", machine, args.quick)
    lines += [
        f"Cache: {args.cache_mib} MiB file (written in full, then formatted) on the local disk; backing: a sparse "
        f"{args.backing_mib} MiB file on the same disk. Filled through NBD in write-back with {args.fill_mib} MiB of "
        f"random 4K–64K writes (every byte once); the last {args.tail_mib} MiB were written after a clean restart, "
        "so a crash leaves them in the log past the last checkpoint. Each kind of restart was repeated "
        f"{args.rounds} times (medians; all values in the JSON). *exec → listening* is measured by the script "
        "from exec to the `listening on` line; *logged* is the server's own `time_ms` for opening the cache.",
        "",
        "Fill: " + "; ".join(f"{f['what']}: {f['mib']} MiB in {f['seconds']:.1f} s "
                             f"({f['mib'] / f['seconds']:.0f} MiB/s)" for f in fills),
        "",
        "| restart after | exec → listening ms | logged time_ms | records replayed | batches replayed | blocks cached | dirty |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, label in (("clean", "clean shutdown (SIGTERM)"), ("unclean", "kill -9")):
        if kind in summary:
            s = summary[kind]
            lines.append(f"| {label} | {s['exec_to_listening_ms']:,.0f} | {s['logged_time_ms']:,.0f} | "
                         f"{s['replayed_records']:,.0f} | {s['replayed_batches']:,.0f} | {s['cached_blocks']:,.0f} | "
                         f"{s['dirty_blocks']:,.0f} |")
    if "empty_start_ms" in mem:
        lines.append(f"| (first start of the freshly formatted, empty cache) | {mem['empty_start_ms']:,.0f} | | | | 0 | 0 |")
    lines += ["", "No numeric restart target is set (DESIGN.md §3: near-instant after a clean shutdown; after a "
                  "crash, bounded by the log written since the last checkpoint, at most an eighth of the cache).", ""]
    lines += ["## RAM per cached block", ""]
    if full:
        t = bl.check_target(full["bytes_per_block_vs_passthrough"], 16.0, higher_is_better=False, unit="B/block")
        lines += [
            f"After writing {args.cache_mib} MiB more, the cache held **{full['cached_blocks']:,} blocks** "
            f"({full['dirty_blocks']:,} dirty; capacity about {full['capacity_blocks_hint']:,}) when shut down. "
            f"Server RSS (VmRSS), idle: {mem['passthrough_rss_kib']:,} KiB serving the same backing file without a "
            f"cache, {mem['empty_rss_kib']:,} KiB freshly started on the empty cache, "
            f"{mem.get('half_full_idle_rss_kib', 0):,} KiB after a clean restart half full, "
            f"{full['idle_rss_full_kib']:,} KiB after a clean restart full.",
            "",
            "| figure | bytes per cached 4 KiB block |",
            "|---|---:|",
            f"| (idle RSS full − idle RSS without a cache) ÷ cached blocks: all the cache costs | "
            f"**{full['bytes_per_block_vs_passthrough']:.1f}** |",
            f"| (idle RSS full − idle RSS empty cache) ÷ cached blocks (misses what is allocated and touched at "
            f"open) | {full['bytes_per_block_idle_delta']:.1f} |",
            f"| idle RSS full ÷ cached blocks (upper bound: binary, stacks, allocator included) | "
            f"{full['bytes_per_block_idle_total']:.1f} |",
            f"| (live RSS after filling − live RSS before) ÷ cached blocks (includes request buffers) | "
            f"{full['bytes_per_block_live_delta']:.1f} |",
        ]
        if demo:
            lines.append(f"| index's own `memory_bytes` ÷ capacity blocks (`flashtier demo --cache-size "
                         f"{args.cache_mib}M`) | {demo['bytes_per_cache_block']:.1f} |")
        lines += ["", *bl.targets_table([("≤ 16 bytes of RAM per cached 4 KiB block (idle RSS full − idle RSS "
                                          "without a cache, ÷ cached blocks)", t)])]
    else:
        lines.append("Not measured (--no-full).")
    lines += ["", "![restart times](restart.png)"]
    bl.write_results(out, "restart", doc, lines)
    plot(out / "restart.png", res, args.quick)


def plot(path, res, quick):
    kinds = [("clean", "after SIGTERM"), ("unclean", "after kill -9")]
    bl.bar_plot(path, "Restart of a half-full write-back cache (bars median, dots rounds)", "milliseconds",
                [label for _, label in kinds],
                [(name, color, [[x[key] for x in res.get(kind, [])] for kind, _ in kinds])
                 for key, name, color in (("exec_to_listening_ms", "exec → listening", "#1f77b4"),
                                          ("logged_time_ms", "logged time_ms", "#ff7f0e"))],
                quick=quick)


if __name__ == "__main__":
    main()
