#!/bin/bash
# The rig this folder's README names; it is bench/nbd_ab.sh now (the write batches use it too).
exec "$(dirname "$0")/../../nbd_ab.sh" "$@"
