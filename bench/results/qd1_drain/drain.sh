#!/bin/bash
# QD1 commits (4K write + FLUSH, fio --fsync=1 over NBD) through a flashtier write-back cache with
# nothing dirty and while its cleaner writes back a backlog, against the raw file's
# write + fdatasync; then why: the same backlog under other write-back parameters, and the raw
# file's commits beside a reader doing what the cleaner does to the device.
#
#   drain.sh BIN WORKDIR [ROUNDS] [SECS]
#
# BIN: a flashtier binary. WORKDIR: on the disk under test (the cache file and the raw file,
# 2 GiB each, go there); the backing file goes to /dev/shm (1 GiB), so the cleaner never waits
# for a slow disk and what it costs is the cache device's side alone.
# Prints one line per fio job: commits/s, the write's and the FLUSH's p50/p99 (µs).
set -euo pipefail
BIN=$(realpath "$1"); W=$2; ROUNDS=${3:-3}; S=${4:-6}
mkdir -p "$W"; cd "$W"
BACKING=/dev/shm/qd1-drain-backing.img
CACHE=$W/cache.img; RAW=$W/raw.img
SOCK=$W/ft.sock; CTL=$W/ft.ctl
trap 'kill $(jobs -p) 2>/dev/null; rm -f $BACKING' EXIT

line() {
    /usr/bin/python3 -c '
import json, sys
t = sys.stdin.read(); d = json.loads(t[t.index("{"):]); j = d["jobs"][0]
w, s = j["write"], j["sync"]["lat_ns"]
p, sp = w["clat_ns"]["percentile"], s["percentile"]
print("%-44s %6.0f commits/s  write p50 %4.0f p99 %4.0f  flush p50 %4.0f p99 %4.0f" % (sys.argv[1], w["iops"],
      p["50.000000"] / 1e3, p["99.000000"] / 1e3, sp["50.000000"] / 1e3, sp["99.000000"] / 1e3))' "$1"
}
commit_nbd() { fio --name=c --rw=randwrite --bs=4k --iodepth=1 --time_based --runtime="$S" --output-format=json \
    --ioengine=nbd --uri="nbd+unix:///?socket=$SOCK" --size=1G --fsync=1; }
commit_raw() { fio --name=c --rw=randwrite --bs=4k --iodepth=1 --time_based --runtime="$S" --output-format=json \
    --ioengine=io_uring --direct=1 --filename="$RAW" --size=2G --fdatasync=1; }
cleaned() { "$BIN" stats --control "$CTL" --json | /usr/bin/python3 -c \
    'import json, sys; t = sys.stdin.read(); print(json.loads(t[t.index("{"):])["counters"]["cleaned_blocks"])'; }
serve() {
    rm -f "$SOCK" "$CTL"
    "$BIN" serve --backing "$BACKING" --cache "$CACHE" --mode writeback --listen "$SOCK" --control-socket "$CTL" \
        > serve.log 2>&1 &
    SERVER=$!
    for _ in $(seq 100); do [ -S "$SOCK" ] && [ -S "$CTL" ] && return; sleep 0.1; done
    echo "no socket" >&2; exit 1
}
stop() { kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; }
# The backlog: 4 s of 4K random writes at QD32 over the 1 GiB working set.
backlog() { fio --name=w --ioengine=nbd --uri="nbd+unix:///?socket=$SOCK" --rw=randwrite --bs=4k --iodepth=32 \
    --size=1G --time_based --runtime=4 > /dev/null; }

truncate -s 1G "$BACKING"
[ -f "$RAW" ] || fio --name=fill --ioengine=io_uring --direct=1 --filename="$RAW" --rw=write --bs=1M --size=2G > /dev/null
"$BIN" format --cache "$CACHE" --size 2G --backing "$BACKING" --force --no-probe > /dev/null 2>&1 \
    || "$BIN" format --cache "$CACHE" --backing "$BACKING" --force --no-probe > /dev/null
echo "# $("$BIN" --version), $(date -u '+%F %T') UTC, load average $(cut -d' ' -f1-3 /proc/loadavg)"

echo "## 1. nothing dirty, then during the drain of a backlog, then the raw file; $ROUNDS rounds of $S s"
for r in $(seq "$ROUNDS"); do
    serve
    "$BIN" flush --control "$CTL" > /dev/null 2>&1
    commit_nbd | line "$r flashtier, nothing dirty"
    backlog
    c0=$(cleaned); commit_nbd | line "$r flashtier, during the drain"; c1=$(cleaned)
    echo "    (the cleaner wrote back $((c1 - c0)) blocks during it)"
    "$BIN" flush --control "$CTL" > /dev/null 2>&1
    stop
    commit_raw | line "$r raw file"
done

echo "## 2. the same drain with other live write-back parameters (set after the backlog)"
for sets in "" "writeback_controller off" "writeback_rate_max_kib 4096" "writeback_rate_max_kib 16384" \
        "writeback_rate_max_kib 32768" "writeback_max_inflight 1"; do
    serve
    "$BIN" flush --control "$CTL" > /dev/null 2>&1
    backlog
    # shellcheck disable=SC2086
    [ -n "$sets" ] && "$BIN" set --control "$CTL" $sets > /dev/null
    c0=$(cleaned); commit_nbd | line "flashtier, during the drain, ${sets:-defaults}"; c1=$(cleaned)
    echo "    (the cleaner wrote back $((c1 - c0)) blocks during it)"
    "$BIN" flush --control "$CTL" > /dev/null 2>&1
    stop
done

echo "## 3. the raw file's commits beside a reader of the cache file (what a drain does to the device)"
commit_raw | line "raw file alone"
for bg in "4k --iodepth=4 --rate_iops=15000" "256k --iodepth=4 --rate=60m"; do
    # shellcheck disable=SC2086
    fio --name=bg --ioengine=io_uring --direct=1 --filename="$CACHE" --rw=randread --bs=$bg --time_based \
        --runtime=$((S + 2)) --size=2G > bg.txt &
    BG=$!; sleep 1
    commit_raw | line "raw file, reader: ${bg%% *} random reads"
    wait $BG
    grep -E "read:" bg.txt | sed 's/^ */    reader: /'
done
