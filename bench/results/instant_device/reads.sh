#!/bin/bash
# usage: reads.sh BIN ROUNDS: 4K random read hits, fio nbd engine, QD32, one connection, 10 s over
# 1 GiB written through a fresh write-back cache (1 MiB sequential writes), alternating each round:
# the cache file on the disk, the cache file in /dev/shm, and fio io_uring O_DIRECT QD32 random
# reads of the disk's 2 GiB file itself. IOPS and the server's CPU per read.
set -e
BIN=$1; ROUNDS=${2:-3}
W=/var/tmp/instant; mkdir -p $W
disk_cache=$W/cache.img; shm_cache=/dev/shm/instant-cache.img; backing=/dev/shm/instant-backing.img
[ -f $disk_cache ] || dd if=/dev/zero of=$disk_cache bs=1M count=2048 oflag=direct status=none
trap 'rm -f $shm_cache $backing' EXIT
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
wait_sock() { for i in $(seq 100); do [ -S $1 ] && return; sleep 0.1; done; echo "no socket $1" >&2; exit 1; }
iops() { python3 -c 'import json,sys; t=sys.stdin.read(); j=json.loads(t[t.index("{"):])["jobs"][0]["read"]; print(j["iops"], j["total_ios"])'; }
flashtier() { # label cache
  rm -f $backing; truncate -s 1G $backing
  [ "$2" = "$shm_cache" ] && { rm -f $shm_cache; truncate -s 2G $shm_cache; }
  rm -f $W/s.sock $W/c.sock
  $BIN format --cache $2 --backing $backing --force --no-probe >/dev/null 2>$W/format.err
  $BIN serve --backing $backing --cache $2 --mode writeback --listen $W/s.sock --control-socket $W/c.sock >"$W/serve.log" 2>&1 &
  local pid=$!; wait_sock $W/s.sock
  local uri="nbd+unix:///?socket=$W/s.sock"
  fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M --iodepth=8 --size=1G >/dev/null 2>&1
  sleep 1
  local c0=$(cpu $pid)
  read n ios < <(fio --name=r --ioengine=nbd --uri="$uri" --rw=randread --bs=4k --iodepth=32 --size=1G --time_based --runtime=10 --output-format=json 2>/dev/null | iops)
  local c1=$(cpu $pid)
  local hm=$($BIN stats --control $W/c.sock --json | python3 -c 'import json,sys; c=json.load(sys.stdin)["counters"]; print(c["read_hit_blocks"], c["read_miss_blocks"])')
  kill $pid; wait $pid 2>/dev/null || true
  python3 -c "print(f'$1: {float($n):,.0f} reads/s, server CPU {($c1-$c0)*1e4/$ios:.1f} us/read (hit, miss blocks: $hm)')"
}
raw() {
  read n ios < <(fio --name=raw --ioengine=io_uring --direct=1 --filename=$disk_cache --rw=randread --bs=4k --iodepth=32 --size=2G --time_based --runtime=10 --output-format=json 2>/dev/null | iops)
  python3 -c "print(f'raw file (io_uring O_DIRECT): {float($n):,.0f} reads/s')"
}
for r in $(seq $ROUNDS); do
  echo "round $r ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
  flashtier "flashtier read hits, cache file on the disk" $disk_cache
  flashtier "flashtier read hits, cache file in /dev/shm" $shm_cache
  raw
done
