#!/usr/bin/env python3
"""Burst absorption: a burst of 4K random writes over a slow disk, absorbed by flashtier's
write-back cache and drained afterwards as sorted, coalesced writes.

The backing store is DESIGN.md §5's emulated slow disk (`nbdkit --filter=noparallel
--filter=delay --filter=stats --filter=log file IMG serialize=all-requests rdelay=4ms wdelay=4ms`:
one request at a time, --delay-ms each, ~250 random IOPS); its log filter timestamps every
request, so the backing writes of each phase are counted exactly. The image is --region-mib
(default 1 GiB) of random bytes and the burst covers all of it.

Peers, each given the same burst (fio nbd engine, 4K randwrite, QD --iodepth, --runtime seconds,
no ramp, fio's random map: every block once before any twice), one after another on the same
image, each with a fresh slow-disk server:

  slow disk   fio straight at the slow disk (the disk's own 4K random-write IOPS)
  nbdkit      `nbdkit --filter=cache nbd ... cache=writeback cache-min-block-size=4K
              cache-max-size=--cache-mib` in front of the slow disk (its tmp file in --workdir);
              after the burst a client flush (nbdsh `h.flush()`) drains it; the drain is watched
              for at most --nbdkit-drain-secs and, if unfinished, its time is extrapolated from the
              backing writes per second so far and the dirty 4K blocks (fio wrote
              min(client writes, region blocks) distinct blocks)
  flashtier   write-back cache of --cache-mib (file written in full before `flashtier format`),
              then `flashtier flush` (blocking) drains it; two configurations:
                absorb:   `--set writeback_controller=off` (age and idle write-back off by
                          default): nothing is written back during the burst unless reclaim must,
                          so the burst is absorbed whole and drained by the flush
                defaults: the engine's default cleaning parameters (PI controller steering the
                          dirty level to writeback_dirty_target_pct, 10% of the cache by default),
                          so the cleaner writes back during the burst as it would in production

Each cache server runs in a cgroup-v1 memory cgroup limited to --mem-limit-mib (page cache
included), so nbdkit's page-cache-backed cache file cannot become a RAM cache.

Reported: client IOPS (and the ratio to the slow disk and to nbdkit); backing write ops during the
burst and during the drain, divided by client writes (target <= 1/8); drain time vs the time the
slow disk needs to take the same data as 4K random writes: the dirty blocks at the start of the
flush ÷ the slow disk's measured 4K random-write IOPS (and the client's whole write stream ÷ the
same IOPS, which is what the client would have waited for without a cache).

Writes bench/results/burst_absorption.{md,json,png}. Needs root (cgroups).
"""

import argparse
import os
import shutil
import subprocess
import time

import benchlib as bl

CONFIGS = {
    "absorb": ["writeback_controller=off"],
    "defaults": [],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtime", type=int, default=60, help="seconds of burst (default 60)")
    ap.add_argument("--iodepth", type=int, default=32, help="fio queue depth (default 32)")
    ap.add_argument("--region-mib", type=int, default=1024, help="region written at random = backing size (default 1024)")
    ap.add_argument("--cache-mib", type=int, default=4096, help="size of each cache (default 4096)")
    ap.add_argument("--delay-ms", type=int, default=4, help="slow disk delay per read/write (default 4)")
    ap.add_argument("--mem-limit-mib", type=int, default=256,
                    help="memory cgroup limit of each cache server, page cache included (default 256)")
    ap.add_argument("--nbdkit-drain-secs", type=int, default=30,
                    help="longest wait for nbdkit's flush before extrapolating (default 30)")
    ap.add_argument("--configs", default="absorb,defaults",
                    help="flashtier configurations to run, comma-separated: absorb, defaults (default both)")
    ap.add_argument("--allow-missing-params", action="store_true",
                    help="run even if the binary lacks the write-back parameters (the absorb "
                         "configuration then runs with the binary's behaviour); implied by --quick")
    bl.add_common_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.runtime, args.region_mib, args.cache_mib, args.mem_limit_mib = 10, 128, 512, 64
        args.nbdkit_drain_secs = 5
        args.allow_missing_params = True
    if os.geteuid() != 0:
        ap.error("needs root for memory cgroups")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown configuration {c!r} (absorb, defaults)")

    binary, work, machine = bl.setup(args, "fio", "nbdkit", "nbdsh")
    known = bl.flashtier_known_params(binary)
    params_ok = "writeback_controller" in known
    if not params_ok:
        if not args.allow_missing_params:
            raise SystemExit(f"{binary} has no writeback_controller parameter (a build without the background "
                             "cleaner): pass --allow-missing-params to run anyway")
        print("warning: this flashtier has no write-back parameters: running its behaviour as is", flush=True)
        configs = configs[:1]

    region = args.region_mib << 20
    img = work / "burst-backing.img"
    bl.make_random_file(img, region)
    results = {}
    timelines = {}
    t_all = time.time()

    def backing(tag):
        reqlog = work / f"burst-{tag}-backing.requests.log"
        statsf = work / f"burst-{tag}-backing.stats.txt"
        reqlog.unlink(missing_ok=True)
        srv = bl.slow_backing(img, work / f"burst-{tag}-backing.sock", work / f"burst-{tag}-backing.log", statsf,
                              reqlog, delay_ms=args.delay_ms)
        return srv, reqlog, statsf

    fio_args = dict(rw="randwrite", bs="4k", iodepth=args.iodepth, size=region, runtime=args.runtime, ramp=0)

    # --- the slow disk alone ---
    srv, reqlog, statsf = backing("slow")
    try:
        t0 = time.time()
        m = bl.run_fio(bl.nbd_target(srv.uri), iops_log=str(work / "burst-slow"), **fio_args)
        t1 = time.time()
    finally:
        srv.stop()
    io = bl.count_backing_io(reqlog, {"burst": (t0, t1)})["burst"]
    results["slow disk"] = summarize(m, io, {}, None, bl.read_stats_file(statsf))
    timelines["slow disk"] = [m["timeline"]]
    print(f"slow disk: {m['iops']:,.0f} IOPS, {m['write']['ios']:,} client writes, "
          f"{io.get('write', {}).get('ops', 0):,} backing writes", flush=True)

    # --- nbdkit's cache filter ---
    srv, reqlog, statsf = backing("nbdkit")
    cg = bl.MemCgroup("burst-nbdkit", args.mem_limit_mib << 20)
    tmp = work / "burst-nbdkit-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    nk = None
    try:
        sock = work / "burst-nbdkit.sock"
        nk = bl.Server("nbdkit-cache",
                       ["nbdkit", "-f", "--exit-with-parent", "-U", str(sock), "--filter=cache", "nbd",
                        f"socket={srv.socket}", "cache=writeback", "cache-min-block-size=4K",
                        f"cache-max-size={args.cache_mib}M"],
                       sock, f"nbd+unix:///?socket={sock}", work / "burst-nbdkit.log",
                       env={**os.environ, "TMPDIR": str(tmp)}, cgroup=cg)
        t0 = time.time()
        m = bl.measure(nk, iops_log=str(work / "burst-nbdkit"), **fio_args)
        t1 = time.time()
        # nbdsh runs `python3 -m nbd`: Debian's python3 has the nbd module, a python3 earlier in
        # PATH (pyenv, a venv) may not.
        flush = subprocess.Popen(["nbdsh", "-u", nk.uri, "-c", "h.flush()"], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, "PATH": "/usr/bin:" + os.environ.get("PATH", "")})
        try:
            flush.wait(args.nbdkit_drain_secs)
            drained = flush.returncode == 0
            if not drained:
                raise SystemExit(f"nbdsh flush failed: {flush.stderr.read()}")
        except subprocess.TimeoutExpired:
            flush.kill()
            flush.wait()
            drained = False
        t2 = time.time()
        nk.kill()  # an unfinished flush would hold a graceful stop for many minutes
    finally:
        if nk:
            nk.kill()
        srv.stop()
        cg.remove()
        shutil.rmtree(tmp, ignore_errors=True)
    io = bl.count_backing_io(reqlog, {"burst": (t0, t1), "drain": (t1, t2)})
    dirty_blocks = min(m["write"]["ios"], region // 4096)
    drain_writes = io["drain"].get("write", {}).get("ops", 0)
    if drained:
        drain = {"seconds": t2 - t1, "extrapolated": False, "dirty_blocks": dirty_blocks}
    else:
        rate = drain_writes / (t2 - t1) if drain_writes else float("nan")
        drain = {"seconds": dirty_blocks / rate if rate == rate else float("nan"), "extrapolated": True,
                 "watched_seconds": t2 - t1, "written_while_watched": drain_writes, "dirty_blocks": dirty_blocks}
    # An unfinished drain is extrapolated to one backing write per dirty 4K block (what it did
    # while watched: cache-min-block-size=4K, one block per write).
    drain_total_writes = drain_writes if drained else dirty_blocks
    results["nbdkit"] = summarize(m, io["burst"], io["drain"], drain, bl.read_stats_file(statsf),
                                  drain_total_writes=drain_total_writes)
    timelines["nbdkit"] = [m["timeline"]]
    print(f"nbdkit cache: {m['iops']:,.0f} IOPS, {m['write']['ios']:,} client writes; drain "
          f"{'done' if drained else 'unfinished'} after {t2 - t1:.1f} s with {drain_writes:,} backing writes "
          f"(drain time {'measured' if drained else 'extrapolated'}: {drain['seconds']:,.1f} s)", flush=True)

    # --- flashtier ---
    cache_img = work / "burst-cache.img"
    fmt = None
    for cfg in configs:
        tag = f"flashtier-{cfg}"
        srv, reqlog, statsf = backing(tag)
        cg = bl.MemCgroup(f"burst-{cfg}", args.mem_limit_mib << 20)
        ft = poller = None
        ctl = work / f"burst-{tag}.ctl"
        try:
            fmt = bl.flashtier_format(binary, cache_img, srv.uri, args.cache_mib << 20)
            extra = ["--control-socket", str(ctl), "--stats-file", str(work / f"burst-{tag}.stats")]
            if params_ok:
                for kv in CONFIGS[cfg]:
                    extra += ["--set", kv]
            ft = bl.flashtier_cache_serve(binary, cache_img, srv.uri, work / f"burst-{tag}.sock",
                                          work / f"burst-{tag}.log", threads=args.threads, cgroup=cg, extra=extra)
            poller = bl.ReportPoller(binary, ctl)
            t0 = time.time()
            m = bl.measure(ft, iops_log=str(work / f"burst-{tag}"), **fio_args)
            t1 = time.time()
            before = bl.flashtier_report(binary, ctl)
            took, flush_out = bl.flashtier_ctl(binary, ctl, "flush")
            t2 = time.time()
            after = bl.flashtier_report(binary, ctl)
            samples = poller.stop()
            poller = None
        finally:
            if poller:
                poller.stop()
            if ft:
                ft.stop(timeout=120)
            srv.stop()
            cg.remove()
        io = bl.count_backing_io(reqlog, {"burst": (t0, t1), "drain": (t1, t2)})
        dirty = bl.report_cache_status(before).get("dirty_blocks")
        drain = {"seconds": t2 - t1, "flush_command_seconds": took, "extrapolated": False, "dirty_blocks": dirty,
                 "dirty_left": bl.report_cache_status(after).get("dirty_blocks"),
                 "output_tail": flush_out.strip().splitlines()[-2:]}
        r = summarize(m, io["burst"], io["drain"], drain, bl.read_stats_file(statsf))
        r["counters_before_flush"] = before.get("counters", {})
        r["counters_after_flush"] = after.get("counters", {})
        r["capacity_blocks"] = bl.report_cache_status(before).get("capacity_blocks")
        r["settings"] = CONFIGS[cfg] if params_ok else []
        # The flush marks blocks clean when its pass ends, so the level drops in one step; the report
        # taken right after the flush is the last point (the poller may not have caught it).
        r["dirty_timeline"] = [(t - t0, bl.report_cache_status(rep).get("dirty_blocks")) for t, rep in samples] + [
            (t2 - t0, bl.report_cache_status(after).get("dirty_blocks"))]
        r["closed"] = bl.flashtier_closed_event(ft.log_text())
        name = f"flashtier ({cfg})" if params_ok else "flashtier"
        results[name] = r
        timelines[name] = [m["timeline"]]
        print(f"{name}: {m['iops']:,.0f} IOPS, {m['write']['ios']:,} client writes, backing writes "
              f"{r['backing_writes_burst']:,} in the burst + {r['backing_writes_drain']:,} in the drain "
              f"({r['backing_writes_per_client_write']:.4f} per client write); {dirty} dirty blocks drained in "
              f"{t2 - t1:.1f} s", flush=True)

    report(args, machine, results, timelines, fmt, params_ok, time.time() - t_all)


def summarize(m, burst_io, drain_io, drain, stats_lines, drain_total_writes=None):
    """One peer's figures: fio's result, backing requests per phase, the drain."""
    bw = burst_io.get("write", {"ops": 0, "bytes": 0})
    dw = drain_io.get("write", {"ops": 0, "bytes": 0})
    dtot = dw["ops"] if drain_total_writes is None else drain_total_writes
    writes = m["write"]["ios"]
    return {
        "iops": m["iops"], "lat_p99_us": m["write"]["lat_p99_us"], "lat_mean_us": m["write"]["lat_mean_us"],
        "client_writes": writes, "client_write_bytes": m["write"]["bytes"],
        "backing_writes_burst": bw["ops"], "backing_write_bytes_burst": bw["bytes"],
        "backing_writes_drain": dw["ops"], "backing_write_bytes_drain": dw["bytes"],
        "backing_flushes": burst_io.get("flush", {}).get("ops", 0) + drain_io.get("flush", {}).get("ops", 0),
        "backing_reads": burst_io.get("read", {}).get("ops", 0) + drain_io.get("read", {}).get("ops", 0),
        "backing_writes_per_client_write": (bw["ops"] + dtot) / writes if writes else float("nan"),
        "drain": drain, "backing_stats": stats_lines, "fio_argv": m.get("argv"),
    }


def report(args, machine, results, timelines, fmt, params_ok, elapsed):
    out = bl.results_dir(args)
    slow = results["slow disk"]
    slow_iops = slow["iops"]
    for name, r in results.items():
        d = r.get("drain")
        if d and d.get("dirty_blocks"):
            # What the slow disk needs for the same data as 4K random writes, at its measured IOPS.
            d["straight_dirty_seconds"] = d["dirty_blocks"] / slow_iops
            d["straight_client_seconds"] = r["client_writes"] / slow_iops
            d["speedup_vs_straight"] = d["straight_dirty_seconds"] / d["seconds"] if d["seconds"] else float("nan")
    fts = [n for n in results if n.startswith("flashtier")]
    targets = []
    for n in fts:
        v = results[n]["backing_writes_per_client_write"]
        targets.append((f"{n}: backing write ops per client write ≤ 1/8 (burst + drain)",
                        ("✓" if v <= 1 / 8 else "✗",
                         f"{v:.4f} (1/{1 / v:,.0f}) vs ≤ 0.125 (1/8)" if v else f"{v} vs ≤ 0.125 (1/8)")))
    doc = {"machine": machine, "args": vars(args), "results": results, "timelines": timelines,
           "format_output": fmt, "write_back_parameters_available": params_ok, "elapsed_s": elapsed}

    lines = bl.results_header("Burst absorption: 4K random writes over a slow disk, absorbed and drained",
                              machine, args.quick)
    lines += [
        f"Burst: fio nbd engine, 4K randwrite, QD{args.iodepth}, {args.runtime} s, no ramp, over a "
        f"{args.region_mib} MiB region of random data = the whole backing image, behind the emulated slow disk "
        f"(one request at a time, {args.delay_ms} ms per request; nbdkit's log filter counts its requests). "
        f"Each peer gets the same burst on the same image, one after another. Caches: {args.cache_mib} MiB each; "
        f"each cache server in a memory cgroup limited to {args.mem_limit_mib} MiB (page cache included). "
        "**nbdkit** = `nbdkit --filter=cache nbd cache=writeback cache-min-block-size=4K "
        f"cache-max-size={args.cache_mib}M`, drained by a client flush (`nbdsh -c 'h.flush()'`). "
        "**flashtier** drained by `flashtier flush` (blocking). "
        + ("flashtier (absorb) = `--set writeback_controller=off` (no background write-back; age and idle "
           "write-back are off by default): the burst is absorbed whole and drained by the flush. flashtier "
           "(defaults) = the default cleaning parameters (PI controller, dirty target 10% of the cache), so its "
           "cleaner writes back during the burst."
           if params_ok else "**This flashtier binary has no write-back parameters** (no background cleaner): "
                             "it ran as is."),
        "",
        "| peer | client IOPS | vs slow disk | vs nbdkit | write p99 µs | client writes | backing writes: burst | "
        "backing writes: drain | backing writes per client write | drain time | dirty data drained | "
        "same data straight to the slow disk (4K random) | drain speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    nk_iops = results.get("nbdkit", {}).get("iops")
    for name, r in results.items():
        d = r.get("drain")
        if d:
            dt = f"{d['seconds']:,.1f} s" + (" (extrapolated)" if d.get("extrapolated") else "")
            dd = f"{d['dirty_blocks'] * 4096 / 2**20:,.0f} MiB" if d.get("dirty_blocks") else "—"
            st = (f"{d['straight_dirty_seconds']:,.0f} s" if "straight_dirty_seconds" in d else "—")
            sp = (f"**{d['speedup_vs_straight']:,.0f}×**" if "speedup_vs_straight" in d else "—")
            dw = f"{r['backing_writes_drain']:,}" + (
                f" in {d['watched_seconds']:.0f} s watched (≈ {d['dirty_blocks']:,} in all)" if d.get("extrapolated") else "")
        else:
            dt = dd = st = sp = dw = "—"
        vs_nk = f"{r['iops'] / nk_iops:.2f}×" if nk_iops else "—"
        lines.append(
            f"| {name} | {r['iops']:,.0f} | {r['iops'] / slow_iops:,.1f}× | {vs_nk} | {r['lat_p99_us']:,.0f} | "
            f"{r['client_writes']:,} | {r['backing_writes_burst']:,} | {dw} | "
            f"{r['backing_writes_per_client_write']:.4f} | {dt} | {dd} | {st} | {sp} |")
    lines += [
        "",
        "*Backing writes per client write* = (backing write requests during the burst + during the drain) ÷ "
        "the client's 4K writes (for the slow disk alone, every client write is a backing write). *Same data "
        "straight* = the dirty blocks the drain wrote ÷ the slow disk's measured 4K random-write IOPS "
        f"({slow_iops:,.0f}): the time the slow disk needs to take that data as 4K random writes; the client's "
        "whole write stream straight to the slow disk would take "
        + ", ".join(f"{n}: {r['client_writes'] / slow_iops:,.0f} s" for n, r in results.items() if n != "slow disk")
        + ". *Drain speed-up* = that time ÷ the drain time.",
        "",
    ]
    for n in fts:
        r = results[n]
        bb = r["backing_write_bytes_drain"]
        if r["backing_writes_drain"]:
            lines.append(f"- {n}: drain wrote {bb / 2**20:,.0f} MiB in {r['backing_writes_drain']:,} backing writes "
                         f"(mean {bb / r['backing_writes_drain'] / 1024:,.0f} KiB each); burst wrote "
                         f"{r['backing_write_bytes_burst'] / 2**20:,.0f} MiB in {r['backing_writes_burst']:,}; "
                         f"{r['backing_flushes']:,} backing flushes, {r['backing_reads']:,} backing reads; "
                         f"cleaner_writes counter after the flush "
                         f"{r['counters_after_flush'].get('cleaner_writes', '?')}.")
    lines += ["", *bl.targets_table(targets), "",
              f"Whole run: {elapsed / 60:.1f} min.", "",
              "![client IOPS, backing writes per client write, drain time](burst_absorption.png)"]
    bl.write_results(out, "burst_absorption", doc, lines)
    plot(out / "burst_absorption.png", results, timelines, args)


def plot(path, results, timelines, args):
    plt = bl.pyplot()
    names = list(results)
    palette = ["#555555", "#999999", "#1f77b4", "#2ca02c", "#9467bd"]
    colors = {n: palette[i % len(palette)] for i, n in enumerate(names)}
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    a1, a2, a3 = axes[0]
    xs = range(len(names))
    a1.bar(xs, [results[n]["iops"] for n in names], color=[colors[n] for n in names])
    a1.set_yscale("log")
    a1.set_title(f"Client IOPS, 4K randwrite QD{args.iodepth}, {args.runtime} s")
    a2.bar(xs, [results[n]["backing_writes_per_client_write"] for n in names], color=[colors[n] for n in names])
    a2.axhline(1 / 8, color="red", ls="--", lw=1, label="target ≤ 1/8")
    a2.set_yscale("log")
    a2.set_title("Backing write ops per client write (burst + drain)")
    a2.legend()
    drained = [n for n in names if results[n].get("drain") and "straight_dirty_seconds" in results[n]["drain"]]
    if drained:
        w = 0.38
        a3.bar([i - w / 2 for i in range(len(drained))], [results[n]["drain"]["seconds"] for n in drained], w,
               color="#1f77b4", label="drain (nbdkit: extrapolated if unfinished)")
        a3.bar([i + w / 2 for i in range(len(drained))], [results[n]["drain"]["straight_dirty_seconds"] for n in drained],
               w, color="#555555", label="same dirty data as 4K random writes to the slow disk")
        a3.set_xticks(range(len(drained)))
        a3.set_xticklabels(drained, fontsize=8)
        a3.set_yscale("log")
        top = max(max(results[n]["drain"]["seconds"], results[n]["drain"]["straight_dirty_seconds"]) for n in drained)
        a3.set_ylim(top=top * 30)  # room for the legend above the bars
        a3.set_ylabel("seconds (log)")
        a3.legend(fontsize=8, loc="upper right")
    a3.set_title("Time to drain vs writing it straight")
    for a in (a1, a2):
        a.set_xticks(list(xs))
        a.set_xticklabels(names, fontsize=8)
    gs = axes[1, 0].get_gridspec()
    for a in axes[1]:
        a.remove()
    b1 = fig.add_subplot(gs[1, :2])
    bl.draw_timelines(b1, {n: timelines[n] for n in names}, colors, "IOPS, 1 s averages (log; stalls at 1)",
                      "Client IOPS per second during the burst", log_y=True)
    b1.set_xlabel("seconds")
    b2 = fig.add_subplot(gs[1, 2])
    for n in names:
        tl = results[n].get("dirty_timeline")
        if tl:
            b2.plot([t for t, _ in tl], [(v or 0) * 4096 / 2**20 for _, v in tl], color=colors[n], label=n)
    b2.axvline(args.runtime, color="gray", ls=":", lw=1)
    b2.set_xlabel("seconds since the burst started (dotted: burst ends, flush starts)")
    b2.set_ylabel("dirty MiB")
    b2.set_title("flashtier dirty data: burst, then drain")
    b2.legend(fontsize=8)
    bl.save_figure(fig, path, args.quick)


if __name__ == "__main__":
    main()
