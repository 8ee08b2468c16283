#!/bin/bash
# `--flashtier` for bench/eviction.py: the build in $FT_BASE, formatting with 2 MiB segments.
if [ "$1" = format ]; then exec "$FT_BASE" "$@" --segment-size 2M; fi
exec "$FT_BASE" "$@"
