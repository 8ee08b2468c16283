#!/bin/bash
# nice_trial.sh BIN ROUNDS SECS (as run: `nice_trial.sh base 2 6`, BIN under /var/tmp/s49/bins): QD1 commits during a write-back backlog, the writeback thread as is / niced 19 / ionice idle / both; the raw file after each round
cd /var/tmp/s49
B=$1; R=$2; S=$3
J() { /usr/bin/python3 -c "import json,sys;t=sys.stdin.read();d=json.loads(t[t.index(chr(123)):]);j=d['jobs'][0]['write'];s=d['jobs'][0]['sync']['lat_ns'];p=j['clat_ns']['percentile'];sp=s['percentile'];print('$1 iops=%.0f w50=%.0f w99=%.0f f50=%.0f f99=%.0f'%(j['iops'],p['50.000000']/1e3,p['99.000000']/1e3,sp['50.000000']/1e3,sp['99.000000']/1e3))"; }
FIO="fio --name=c --rw=randwrite --bs=4k --iodepth=1 --time_based --runtime=$S --output-format=json"
for r in $(seq $R); do
 for v in plain nice ionice both; do
  rm -f ft.sock ft.ctl
  bins/$B serve --backing /dev/shm/s49-backing.img --cache cache.img --mode writeback --listen /var/tmp/s49/ft.sock --control-socket /var/tmp/s49/ft.ctl > serve-qd1.log 2>&1 &
  P=$!; for i in $(seq 50); do [ -S ft.sock ] && break; sleep 0.1; done; sleep 1
  W=$(grep -l writeback /proc/$P/task/*/comm | head -1 | xargs dirname | xargs basename)
  case $v in nice) renice -n 19 -p $W >/dev/null;; ionice) ionice -c 3 -p $W;; both) renice -n 19 -p $W >/dev/null; ionice -c 3 -p $W;; esac
  fio --name=w --ioengine=nbd --uri=nbd+unix:///?socket=/var/tmp/s49/ft.sock --rw=randwrite --bs=4k --iodepth=32 --size=1G --time_based --runtime=4 >/dev/null 2>&1
  c0=$(awk '{print $14+$15}' /proc/$P/task/$W/stat)
  $FIO --ioengine=nbd --uri=nbd+unix:///?socket=/var/tmp/s49/ft.sock --size=1G --fsync=1 | J "$r $v"
  c1=$(awk '{print $14+$15}' /proc/$P/task/$W/stat)
  echo "   writeback thread cpu ticks during: $((c1-c0))"
  kill $P; wait $P 2>/dev/null
 done
 $FIO --ioengine=io_uring --direct=1 --filename=/var/tmp/s49/raw.img --size=2G --fdatasync=1 | J "$r raw"
done
