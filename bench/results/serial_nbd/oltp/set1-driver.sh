#!/bin/bash
set -u
cd /work/main
CELLS=ft-wb/16k/dwon/cache2x,ssd-direct/16k/dwon,ft-wb/16k/dwoff/cache2x,ft-wb/16k/dwon/cache0.5x
for step in r1-A:/tmp/ft-main r1-B:/tmp/ft-new r2-B:/tmp/ft-new r2-A:/tmp/ft-main; do
  tag=${step%%:*}; bin=${step#*:}
  echo "== $tag $bin $(date +%T)"
  python3 bench/oltp.py --flashtier $bin --cells $CELLS --out /tmp/oltp-ab36/$tag > /tmp/oltp-ab36/$tag.log 2>&1
  echo "rc $? $(date +%T)"
done
echo finished
