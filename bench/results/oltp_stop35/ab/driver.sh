#!/bin/bash
set -u
cd /work/main
CELLS=ft-wb/16k/dwon/cache2x,ssd-direct/16k/dwon,ft-wb/16k/dwoff/cache2x,ft-wb/16k/dwon/cache1x
for step in r1-A:/tmp/ab/flashtier-998 r1-B:/tmp/ab/flashtier-0de r2-B:/tmp/ab/flashtier-0de r2-A:/tmp/ab/flashtier-998; do
  tag=${step%%:*}; bin=${step#*:}
  echo "== $tag $bin $(date +%T)"
  python3 bench/oltp.py --flashtier $bin --cells $CELLS --out /tmp/oltp-ab/$tag > /tmp/oltp-ab/$tag.log 2>&1
  echo "rc $? $(date +%T)"
done
