#!/bin/bash
# A/B: flashtier serve --threads 16 vs 4 under MariaDB (ft-wb base cell), alternating.
cd /work/main
for round in 1 2; do
  for t in 16 4; do
    python3 bench/oltp.py --flashtier /var/tmp/s50/bin/head --threads $t --cells ft-wb/16k/dwon/cache2x \
      --out /var/tmp/s50/oltp-t$t-r$round > /var/tmp/s50/oltp-t$t-r$round.log 2>&1
  done
done
echo done > /var/tmp/s50/oltp_threads.done
