#!/bin/bash
# One line of an A/B comparison of flashtier builds over NBD (bench/results/read_batch/ and
# bench/results/write_batch/): 4 KiB random reads that hit (the default), with MISSES=1 reads
# that mostly miss, with RW=randwrite random write-back writes.
#
#   nbd_ab.sh BIN LABEL [DIR]
#
# Formats a 512 MiB cache file in DIR (default /var/tmp/flashtier-read-batch: it must be on a
# disk, O_DIRECT) for a 256 MiB backing file in /dev/shm, serves it write-back with the read
# cutoff off, writes the 256 MiB once (every block cached), then runs 8 s of fio 4 KiB random
# reads over NBD and prints IOPS, the server's CPU µs per I/O (utime+stime of all its threads
# during the run ÷ I/Os) and the p99 latency. NJ (connections, default 1) and QD (per
# connection, default 32) shape the load; EXTRA adds serve options (e.g. EXTRA="--threads 32").
# Run two builds alternately, several rounds: the machine's noise is a few thousand IOPS.
#
# MISSES=1: the miss path instead. The backing file is 2 GiB and nothing is written first, so
# most reads miss (and promote); in RAM, a miss costs microseconds, so whatever it waits for shows.
#
# RW=randwrite: random writes instead of reads, on the fresh cache (nothing written first). At
# ~70k writes/s the 8 s write 2 GiB, four times the cache: the log wraps, and reclaim and the
# write-back cleaner run as they do under a sustained load.
set -euo pipefail
BIN=$1
L=$2
DIR=${3:-/var/tmp/flashtier-read-batch}
mkdir -p "$DIR"
BACK=/dev/shm/flashtier-read-batch-backing.img
SOCK=$DIR/ft.sock
SIZE=256M
[ "${MISSES:-0}" = 1 ] && SIZE=2G
truncate -s "$SIZE" "$BACK"
rm -f "$SOCK"
rm -f "$DIR/cache.img"
"$BIN" format --cache "$DIR/cache.img" --backing "$BACK" --size 512M --no-probe --force >/dev/null 2>&1
# shellcheck disable=SC2086
"$BIN" serve --backing "$BACK" --listen "$SOCK" --cache "$DIR/cache.img" --mode write-back \
    --set sequential_cutoff_read_kib=0 ${EXTRA:-} >"$DIR/log-$L" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true; rm -f "$BACK"' EXIT
for _ in $(seq 50); do [ -S "$SOCK" ] && break; sleep 0.1; done
URI="nbd+unix:///?socket=$SOCK"
RW=${RW:-randread}
if [ "${MISSES:-0}" != 1 ] && [ "$RW" = randread ]; then
    fio --name=fill --ioengine=nbd --uri="$URI" --rw=write --bs=1M --iodepth=8 --size="$SIZE" \
        --output-format=terse >/dev/null
fi
C0=$(awk '{print $14+$15}' /proc/$PID/stat)
fio --name=r --ioengine=nbd --uri="$URI" --rw="$RW" --bs=4k --iodepth="${QD:-32}" \
    --numjobs="${NJ:-1}" --group_reporting --size="$SIZE" --time_based --runtime=8 \
    --output-format=json >"$DIR/r-$L.json"
C1=$(awk '{print $14+$15}' /proc/$PID/stat)
TICK=$(getconf CLK_TCK)
python3 - "$DIR/r-$L.json" "$L" "$C0" "$C1" "$TICK" "$RW" <<'EOF'
import json, sys
path, label, c0, c1, tick = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
text = open(path).read()
r = json.loads(text[text.index("{"):])["jobs"][0]["write" if sys.argv[6] == "randwrite" else "read"]
cpu_us = (c1 - c0) * 1e6 / tick / r["total_ios"]
print(f"{label} iops {r['iops']:.0f} cpu us/io {cpu_us:.1f} p99 {r['clat_ns']['percentile']['99.000000'] / 1000:.0f}")
EOF
