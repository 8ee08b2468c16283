#!/bin/bash
# Runs a command (e.g. ab.sh) and, from its 4th to its 7th second, samples /proc/diskstats of
# DISK (default vda): the cache device's reads and writes a second, its average queue (weighted
# time in queue ÷ elapsed) and the average time of a read there.
#
#   DISK=vda device_queue.sh ./ab.sh BIN LABEL
set -euo pipefail
DISK=${DISK:-vda}
(
    sleep 4
    read -ra a < <(grep " $DISK " /proc/diskstats)
    sleep 3
    read -ra b < <(grep " $DISK " /proc/diskstats)
    reads=$(( (b[3] - a[3]) / 3 ))
    echo "writes $(( (b[7] - a[7]) / 3 ))/s reads ${reads}/s" \
        "avg queue $(echo "scale=1; (${b[13]} - ${a[13]}) / 3000" | bc)" \
        "avg read us $(echo "scale=0; (${b[6]} - ${a[6]}) * 1000 / (${b[3]} - ${a[3]})" | bc)"
) &
"$@"
wait
