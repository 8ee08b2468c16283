#!/bin/bash
# The miss path under batching: 4 KiB random reads at QD32 over a 2 GiB backing file in
# /dev/shm (RAM: a miss costs microseconds, so anything a miss waits for shows) through a fresh
# 512 MiB write-back cache, 8 s; most reads miss (and promote). Prints IOPS, the server's CPU µs
# per read and the p99 latency.
#
#   misses.sh BIN LABEL [DIR]
set -euo pipefail
BIN=$1
L=$2
DIR=${3:-/var/tmp/flashtier-read-batch-misses}
BACK=/dev/shm/flashtier-read-batch-misses.img
mkdir -p "$DIR"
rm -f "$DIR/cache.img" "$DIR/ft.sock"
truncate -s 2G "$BACK"
"$BIN" format --cache "$DIR/cache.img" --backing "$BACK" --size 512M --no-probe --force >/dev/null 2>&1
"$BIN" serve --backing "$BACK" --listen "$DIR/ft.sock" --cache "$DIR/cache.img" --mode write-back \
    --set sequential_cutoff_read_kib=0 >"$DIR/log-$L" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true; rm -f "$BACK"' EXIT
for _ in $(seq 50); do [ -S "$DIR/ft.sock" ] && break; sleep 0.1; done
C0=$(awk '{print $14+$15}' /proc/$PID/stat)
fio --name=r --ioengine=nbd --uri="nbd+unix:///?socket=$DIR/ft.sock" --rw=randread --bs=4k \
    --iodepth=32 --size=2G --time_based --runtime=8 --output-format=json >"$DIR/r-$L.json"
C1=$(awk '{print $14+$15}' /proc/$PID/stat)
python3 - "$DIR/r-$L.json" "$L" "$C0" "$C1" "$(getconf CLK_TCK)" <<'PY'
import json, sys
path, label, c0, c1, tick = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
text = open(path).read()
r = json.loads(text[text.index("{"):])["jobs"][0]["read"]
cpu_us = (c1 - c0) * 1e6 / tick / r["total_ios"]
print(f"{label} iops {r['iops']:.0f} cpu us/io {cpu_us:.1f} p99 {r['clat_ns']['percentile']['99.000000'] / 1000:.0f}")
PY
