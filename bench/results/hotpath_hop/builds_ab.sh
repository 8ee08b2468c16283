#!/bin/bash
# ab2.sh ROUNDS SECS bin...: 4K read hits at QD32 (or $QD, $NJ jobs), each binary on its own warm cache
cd /var/tmp/s49
R=$1; S=$2; shift 2
pkill -f "flashtier serve|bins/.* serve" ; sleep 1
start() { rm -f ft.sock ft.ctl; bins/$1 serve --backing /dev/shm/s49-backing-$1.img --cache cache-$1.img --mode writeback --set sequential_cutoff_read_kib=0 --listen /var/tmp/s49/ft.sock --control-socket /var/tmp/s49/ft.ctl > serve-$1.log 2>&1 & P=$!; for i in $(seq 50); do [ -S ft.sock ] && break; sleep 0.1; done; sleep 0.5; }
for b in "$@"; do
  if [ ! -f cache-$b.img ]; then
    truncate -s 1G /dev/shm/s49-backing-$b.img
    bins/$b format --cache cache-$b.img --size 2G --backing /dev/shm/s49-backing-$b.img --force --no-probe >/dev/null 2>&1 || bins/$b format --cache cache-$b.img --size 2G --backing /dev/shm/s49-backing-$b.img --force > /dev/null 2>&1
    start $b
    for i in 1 2 3; do fio --name=w --ioengine=nbd --uri=nbd+unix:///?socket=/var/tmp/s49/ft.sock --rw=read --bs=1M --iodepth=4 --size=1G >/dev/null 2>&1; sleep 2; done
    kill $P; wait $P 2>/dev/null
  fi
done
for r in $(seq $R); do
  for b in "$@"; do
    start $b
    c0=$(awk '{print $14+$15}' /proc/$P/stat)
    out=$(fio --name=r --ioengine=nbd --uri=nbd+unix:///?socket=/var/tmp/s49/ft.sock --rw=${RW:-randread} --bs=4k --iodepth=${QD:-32} --numjobs=${NJ:-1} --group_reporting --size=1G --time_based --runtime=$S --output-format=json)
    c1=$(awk '{print $14+$15}' /proc/$P/stat)
    echo "$out" | /usr/bin/python3 -c "import json,sys;t=sys.stdin.read();d=json.loads(t[t.index(chr(123)):]);j=d['jobs'][0];j=j['read'] if j['read']['total_ios'] else j['write'];n=j['total_ios'];print('$r $b iops=%.0f cpu_us=%.1f p50=%.0f'%(j['iops'],($c1-$c0)*1e4/n, j['clat_ns']['percentile']['50.000000']/1000))"
    kill $P; wait $P 2>/dev/null
  done
done
