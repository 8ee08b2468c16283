#!/bin/bash
# usage: split.sh BIN TAG CACHEFILE [serve args]: 4K random writes QD32 for 10 s through a fresh write-back cache
# whose cache file is CACHEFILE (2 GiB; on the disk, or in /dev/shm); the server's CPU per write
# over seconds 2-9 split by thread (log writer, cleaner, reclaim; the rest is the NBD threads), and
# its context switches per write (perf stat).
BIN=$1; TAG=$2; cache=$3; shift 3
. "$(dirname "$0")/lib.sh"
d=/var/tmp/wbs-$TAG; rm -rf $d; mkdir -p $d
backing=/dev/shm/wb-backing.img
[ -f $cache ] || dd if=/dev/zero of=$cache bs=1M count=2048 oflag=direct status=none
rm -f $backing; truncate -s 1G $backing
$BIN format --cache $cache --backing $backing --force --no-probe >/dev/null 2>$d/format.err
$BIN serve --backing $backing --cache $cache --mode writeback --listen $d/s.sock --control-socket $d/c.sock "$@" >$d/serve.log 2>&1 &
pid=$!
wait_sock $d/s.sock
fio --name=w --ioengine=nbd --uri="nbd+unix:///?socket=$d/s.sock" --rw=randwrite --bs=4k --iodepth=32 --size=1G --time_based --runtime=10 --output-format=json > $d/fio.json 2>/dev/null &
fpid=$!
sleep 2
snap() { for t in /proc/$pid/task/*; do x=$( (cat $t/comm; awk '{print $14+$15}' $t/stat; grep -E '^(voluntary|nonvoluntary)_ctxt' $t/status | awk '{s+=$2} END{print s}') 2>/dev/null | tr '\n' ' '); [ $(echo $x | wc -w) -ge 3 ] && echo "$x"; done; echo "TOTAL $(cpu $pid) 0"; }
wr() { $BIN stats --control $d/c.sock --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["counters"]["writes"])'; }
snap > $d/t0; s0=$(date +%s.%N); w0=$(wr)
perf stat -e context-switches -p $pid -o $d/cs.txt -- sleep 7 >/dev/null 2>&1
snap > $d/t1; s1=$(date +%s.%N); w1=$(wr)
wait $fpid
kill $pid; wait $pid 2>/dev/null
rm -f $backing
python3 - $d $TAG $s0 $s1 $w0 $w1 <<'PY'
import sys,collections
d,tag,s0,s1,w0,w1=sys.argv[1],sys.argv[2],float(sys.argv[3]),float(sys.argv[4]),int(sys.argv[5]),int(sys.argv[6])
# threads come and go (the NBD pool): aggregate by name; TOTAL is the process's own count
def agg(f):
  c=collections.defaultdict(lambda:[0,0])
  for l in open(f):
    p=l.rsplit(None,2); c[p[0]][0]+=int(p[1]); c[p[0]][1]+=int(p[2])
  return c
a,b=agg(d+'/t0'),agg(d+'/t1')
n=w1-w0; el=s1-s0
print(f"{tag}: {n/el:,.0f} writes/s over {el:.1f}s")
tot=0;ts=0
for k in sorted(b, key=lambda k: -(b[k][0]-a.get(k,[0,0])[0])):
  cpu=(b[k][0]-a.get(k,[0,0])[0])*10000/n; cs=(b[k][1]-a.get(k,[0,0])[1])/n; tot+=cpu; ts+=cs
  if cpu>0.05 or cs>0.01: print(f"  {k:20s} {cpu:6.2f} us/write  {cs:5.2f} switches/write")
cs=[l for l in open(d+'/cs.txt') if 'context-switches' in l][0].split()[0].replace(',','')
T=(b['TOTAL'][0]-a['TOTAL'][0])*10000/n
named=sum((b[k][0]-a.get(k,[0,0])[0])*10000/n for k in b if k in ('log-writer','writeback','reclaim'))
print(f"  process {T:.2f} us/write: log-writer+writeback+reclaim {named:.2f}, the rest (NBD threads, io_uring workers) {T-named:.2f}; context switches {int(cs)/n:.2f}/write")
PY
