#!/bin/bash
# MariaDB A/B for the few-threads trial: the build before it (base) and with it (pool), alternating,
# two cells each round. BINS: a directory holding the two builds as `base` and `pool`.
BINS=${BINS:-/var/tmp/s51/bins}; OUT=${OUT:-/var/tmp/s51/oltp}
cd "$(dirname "$0")/../../../.."
for round in ${ROUNDS:-1 2}; do
  for b in base pool; do
    python3 bench/oltp.py --flashtier "$BINS/$b" --cells ft-wb/16k/dwon/cache2x,ft-wb/16k/dwon/cache0.5x \
      --out "$OUT/$b-r$round" > "$OUT/$b-r$round.log" 2>&1
  done
done
