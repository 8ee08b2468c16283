#!/bin/bash
# usage: qd1_switches.sh BIN: QD1 write+flush for 8 s against flashtier (fresh write-back cache) and nbdkit memory; context switches and CPU per commit
BIN=$1
. "$(dirname "$0")/lib.sh"
W=$W/qd1; mkdir -p $W
cache=$W/cache.img; backing=/dev/shm/qd1cs-backing.img
[ -f $cache ] || dd if=/dev/zero of=$cache bs=1M count=1024 oflag=direct status=none
one() { # label pid sock
  local c0=$(cpu $2)
  perf stat -e context-switches -p $2 -o $W/cs.txt -- sleep 7 >/dev/null 2>&1 &
  local ps=$!
  fio --name=c --ioengine=nbd --uri="nbd+unix:///?socket=$3" --rw=randwrite --bs=4k --iodepth=1 --fsync=1 --size=512M --time_based --runtime=8 --output-format=json 2>/dev/null > $W/fio.json
  wait $ps
  local c1=$(cpu $2)
  python3 - "$1" $c0 $c1 $W <<'PY'
import json,sys
l,c0,c1,W=sys.argv[1],int(sys.argv[2]),int(sys.argv[3]),sys.argv[4]
t=open(W+'/fio.json').read(); j=json.loads(t[t.index('{'):])['jobs'][0]['write']; n=j['total_ios']
cs=int([x for x in open(W+'/cs.txt') if 'context-switches' in x][0].split()[0].replace(',',''))
print(f"{l}: {j['iops']:,.0f} commits/s, server CPU {(c1-c0)*1e4/n:.0f} us/commit, {cs/(n*7/8):.1f} context switches/commit")
PY
}
rm -f $backing; truncate -s 1G $backing; rm -f $W/s.sock
$BIN format --cache $cache --backing $backing --force --no-probe >/dev/null 2>&1
$BIN serve --backing $backing --cache $cache --mode writeback --listen $W/s.sock >$W/serve.log 2>&1 & pid=$!
wait_sock $W/s.sock
one flashtier $pid $W/s.sock; kill $pid; wait $pid 2>/dev/null
rm -f $W/n.sock; nbdkit -f -U $W/n.sock memory 1G & pid=$!
wait_sock $W/n.sock
one "nbdkit memory" $pid $W/n.sock; kill $pid; wait $pid 2>/dev/null
rm -f $backing
