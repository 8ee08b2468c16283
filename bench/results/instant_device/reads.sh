#!/bin/bash
# usage: reads.sh BIN ROUNDS: 4K random read hits, fio nbd engine, QD32, one connection, 10 s over
# 1 GiB of a fresh write-back cache warmed by reading it (1 MiB reads, promotions settled, repeated
# until a pass misses nothing, as bench/hotpath.py; nothing is dirty), alternating each round:
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
counter() { $BIN stats --control $W/c.sock --json | python3 -c "import json,sys; print(json.load(sys.stdin)['counters']['$1'])"; }
misses() { counter read_miss_blocks; }
settle() { # promotions unchanged for 1 s (bench/benchlib.py's flashtier_wait_promotions)
  local last=$(counter promoted_blocks) now i=0
  while sleep 1; do now=$(counter promoted_blocks); [ "$now" = "$last" ] && return; last=$now; i=$((i+1)); [ $i -ge 60 ] && return; done
}
iops() { python3 -c 'import json,sys; t=sys.stdin.read(); j=json.loads(t[t.index("{"):])["jobs"][0]["read"]; print(j["iops"], j["total_ios"])'; }
flashtier() { # label cache
  rm -f $backing; truncate -s 1G $backing
  [ "$2" = "$shm_cache" ] && { rm -f $shm_cache; truncate -s 2G $shm_cache; }
  rm -f $W/s.sock $W/c.sock
  $BIN format --cache $2 --backing $backing --force --no-probe >/dev/null 2>$W/format.err
  $BIN serve --backing $backing --cache $2 --mode writeback --set sequential_cutoff_read_kib=0 --listen $W/s.sock --control-socket $W/c.sock >"$W/serve.log" 2>&1 &
  local pid=$!; wait_sock $W/s.sock
  local uri="nbd+unix:///?socket=$W/s.sock"
  local p before after
  for p in 1 2 3 4; do
    before=$(misses); fio --name=warm --ioengine=nbd --uri="$uri" --rw=read --bs=1M --iodepth=4 --size=1G >/dev/null 2>&1
    settle; after=$(misses); [ "$before" = "$after" ] && break
  done
  local h0=$(counter read_hit_blocks) m0=$(misses) c0=$(cpu $pid)
  read n ios < <(fio --name=r --ioengine=nbd --uri="$uri" --rw=randread --bs=4k --iodepth=32 --size=1G --time_based --runtime=10 --output-format=json 2>/dev/null | iops)
  local c1=$(cpu $pid)
  local hm="$(( $(counter read_hit_blocks) - h0 )) $(( $(misses) - m0 ))"
  kill $pid; wait $pid 2>/dev/null || true
  python3 -c "print(f'$1: {float($n):,.0f} reads/s, server CPU {($c1-$c0)*1e4/$ios:.1f} us/read (hit, miss blocks during it: $hm; $p warm passes)')"
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
