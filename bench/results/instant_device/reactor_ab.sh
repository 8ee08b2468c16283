#!/bin/bash
# usage: reactor_ab.sh BIN PROBE ROUNDS: 4K random reads QD32 one connection, 8 s each, alternating:
# fio io_uring on the raw file, reactor_probe serving that file, flashtier read hits (reads.sh's way)
BIN=$1; PROBE=$2; ROUNDS=$3
F=/var/tmp/instant/cache.img; S=/var/tmp/instant/probe.sock
cpu() { awk '{print $14+$15}' /proc/$1/stat; }
j() { python3 -c 'import json,sys; t=sys.stdin.read(); j=json.loads(t[t.index("{"):])["jobs"][0]["read"]; print(j["iops"], j["total_ios"])'; }
for r in $(seq $ROUNDS); do
  echo "round $r ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
  read n ios < <(fio --name=raw --ioengine=io_uring --direct=1 --filename=$F --rw=randread --bs=4k --iodepth=32 --size=2G --time_based --runtime=8 --output-format=json 2>/dev/null | j)
  python3 -c "print(f'raw file (io_uring O_DIRECT): {float($n):,.0f} reads/s')"
  $PROBE $F $S 2>/dev/null & pid=$!; for i in $(seq 50); do [ -S $S ] && break; sleep 0.1; done
  c0=$(cpu $pid); read n ios < <(fio --name=r --ioengine=nbd --uri="nbd+unix:///?socket=$S" --rw=randread --bs=4k --iodepth=32 --size=2G --time_based --runtime=8 --output-format=json 2>/dev/null | j); c1=$(cpu $pid)
  kill $pid; wait $pid 2>/dev/null; rm -f $S
  python3 -c "print(f'reactor_probe on the raw file: {float($n):,.0f} reads/s, server CPU {($c1-$c0)*1e4/$ios:.1f} us/read')"
  ( source <(sed '/^for r in/,$d' $(dirname $0)/reads.sh); flashtier "flashtier read hits, cache file on the disk" $disk_cache )
done
