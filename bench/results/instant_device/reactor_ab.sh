#!/bin/bash
# usage: reactor_ab.sh BIN PROBE ROUNDS: 4K random reads QD32 one connection, alternating: fio
# io_uring on the raw file (8 s), reactor_probe serving that file (8 s), flashtier read hits
# (reads.sh's disk line: a fresh cache warmed by reading, 10 s)
BIN=$1; PROBE=$2; ROUNDS=$3
. "$(dirname "$0")/lib.sh"
S=$W/probe.sock
trap 'rm -f $backing' EXIT
for r in $(seq $ROUNDS); do
  echo "round $r ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
  read n ios < <(fio --name=raw --ioengine=io_uring --direct=1 --filename=$disk_cache --rw=randread --bs=4k --iodepth=32 --size=2G --time_based --runtime=8 --output-format=json 2>/dev/null | fio_iops read)
  python3 -c "print(f'raw file (io_uring O_DIRECT): {float($n):,.0f} reads/s')"
  rm -f $S; $PROBE $disk_cache $S 2>/dev/null & ppid=$!; wait_sock $S
  c0=$(cpu $ppid); read n ios < <(fio --name=r --ioengine=nbd --uri="nbd+unix:///?socket=$S" --rw=randread --bs=4k --iodepth=32 --size=2G --time_based --runtime=8 --output-format=json 2>/dev/null | fio_iops read); c1=$(cpu $ppid)
  kill $ppid; wait $ppid 2>/dev/null; rm -f $S
  python3 -c "print(f'reactor_probe on the raw file: {float($n):,.0f} reads/s, server CPU {($c1-$c0)*1e4/$ios:.1f} us/read')"
  flashtier_read_hits "flashtier read hits, cache file on the disk" $disk_cache
done
