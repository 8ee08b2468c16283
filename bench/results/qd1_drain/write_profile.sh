#!/bin/bash
# perf profile of flashtier serving 4K random write-back writes at QD32 (one connection), the
# backing file in /dev/shm so nothing slows the cleaner's drain.
#   B=BINARY W=WORKDIR PERF=1 write_profile.sh; then
#   perf report -i WORKDIR/perf.data --no-children --sort comm -g none
set -e
B=${B:?B=flashtier binary}
W=${W:?W=work directory}
mkdir -p "$W"
rm -f $W/ft.sock $W/ctl.sock
[ -f $W/cache.img ] || dd if=/dev/urandom of=$W/cache.img bs=1M count=2048 status=none
truncate -s 4G /dev/shm/s50-backing.img
$B format --cache $W/cache.img --backing /dev/shm/s50-backing.img --force --no-probe >/dev/null 2>&1 || $B format --cache $W/cache.img --backing /dev/shm/s50-backing.img --force > /dev/null
$B serve --backing /dev/shm/s50-backing.img --cache $W/cache.img --mode writeback --listen $W/ft.sock --control-socket $W/ctl.sock $EXTRA > $W/serve.log 2>&1 &
SP=$!
for i in $(seq 50); do [ -S $W/ft.sock ] && break; sleep 0.1; done
fio --name=w --ioengine=nbd --uri="nbd+unix:///?socket=$W/ft.sock" --rw=randwrite --bs=4k --iodepth=32 --size=1G --time_based --runtime=${SECS:-20} --output-format=json --output=$W/fio.json &
FP=$!
sleep 3
if [ -n "$PERF" ]; then perf record -g -p $SP -o $W/perf.data -- sleep 10 2>/dev/null; else sleep 10; fi
wait $FP
kill -INT $SP; wait $SP || true
python3 -c "import json;j=json.load(open('$W/fio.json'));print('write iops', round(j['jobs'][0]['write']['iops']))"
