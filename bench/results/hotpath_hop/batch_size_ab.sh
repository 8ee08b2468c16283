#!/bin/bash
# usage: ab.sh ROUNDS SECS bin1 bin2 ... ; prints IOPS per bin per round, and raw
cd /var/tmp/s49
R=$1; S=$2; shift 2
pkill -f "flashtier serve" ; sleep 1
for r in $(seq $R); do
  for b in "$@"; do
    rm -f ft.sock ft.ctl
    bins/$b serve --backing /dev/shm/s49-backing.img --cache cache.img --mode writeback --set sequential_cutoff_read_kib=0 --listen /var/tmp/s49/ft.sock --control-socket /var/tmp/s49/ft.ctl > serve-$b.log 2>&1 &
    P=$!
    for i in $(seq 50); do [ -S ft.sock ] && break; sleep 0.1; done
    sleep 0.5
    c0=$(awk '{print $14+$15}' /proc/$P/stat)
    out=$(fio --name=r --ioengine=nbd --uri=nbd+unix:///?socket=/var/tmp/s49/ft.sock --rw=randread --bs=4k --iodepth=${QD:-32} --numjobs=${NJ:-1} --group_reporting --size=1G --time_based --runtime=$S --output-format=json)
    c1=$(awk '{print $14+$15}' /proc/$P/stat)
    echo "$out" | /usr/bin/python3 -c "import json,sys;t=sys.stdin.read();d=json.loads(t[t.index(chr(123)):]);j=d['jobs'][0]['read'];n=j['total_ios'];print('$r $b iops=%.0f cpu_us=%.1f p50=%.0f'%(j['iops'],($c1-$c0)*1e4/n, j['clat_ns']['percentile']['50.000000']/1000))"
    kill $P; wait $P 2>/dev/null
  done
  fio --name=raw --ioengine=io_uring --direct=1 --filename=/var/tmp/s49/raw.img --rw=randread --bs=4k --iodepth=32 --size=2G --time_based --runtime=$S --output-format=json | /usr/bin/python3 -c "import json,sys;t=sys.stdin.read();d=json.loads(t[t.index(chr(123)):]);j=d['jobs'][0]['read'];print('$r raw iops=%.0f'%j['iops'])"
done
