#!/usr/bin/env bash
# The A/B of bench/results/compaction90/: the MariaDB cells whose cache is smaller than what the
# database touches (1× and 0.5× the data), with reclaim_compact_pct at its default (75, A) and at
# its maximum (90, B), alternating A B B A. Usage: driver.sh FLASHTIER_BINARY OUT_DIR
set -euo pipefail
bin=$1 out=$2
cells=ft-wb/16k/dwon/cache1x,ft-wb/16k/dwon/cache0.5x
here=$(cd "$(dirname "$0")/../../.." && pwd)
for run in A1 B1 B2 A2; do
    case $run in
        A*) set_args=() ;;
        B*) set_args=(--ft-set reclaim_compact_pct=90) ;;
    esac
    python3 "$here/bench/oltp.py" --flashtier "$bin" --cells "$cells" "${set_args[@]}" --out "$out/$run"
done
