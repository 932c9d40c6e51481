#!/usr/bin/env bash
# Prefix caching on one GPU, in one device call:
#   run(command="bash scripts/gpu_prefix_cache.sh", carry=[".whl"])
# First scripts/gpu_prefix_cache_check.py (the tiny model's tokens with the
# cache on and off; the 3B shape's first token cold and from the cache; its
# output in $OUT/check/), then scripts/gpu_interference.sh's mixed load with
# the cache on and off (RUNS, default "epd epd-noprefix epd-reuse
# epd-reuse-noprefix": unique images, then every image from epd-bench's pool
# of 4, so that prompts repeat their starts).
here=$(dirname "$0")
OUT=${OUT:-/tmp/out}/check bash -c "source '$here/device_prelude.sh' && \
  timeout 300 python3 '$here/gpu_prefix_cache_check.py' --json \"\$OUT/prefix-check.json\""
MIXED_RATE=${MIXED_RATE:-22.562} RUNS=${RUNS:-epd epd-noprefix epd-reuse epd-reuse-noprefix} \
  bash "$here/gpu_interference.sh"
