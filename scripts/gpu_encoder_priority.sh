#!/usr/bin/env bash
# The encoders' MPS client priority (epd-launch --encoder-priority) against
# the interference line of issue 14, on one H200, in one device call:
#   run(command="bash scripts/gpu_encoder_priority.sh", carry=[".whl"])
# The half text-only load at a fixed rate (MIXED_RATE, default 21.66 req/s:
# aggregated's sustained maximum for it, session 9), 40 s of arrivals after
# 10 s of warm-up, side by side: aggregated, EPD colocated, and EPD colocated
# with the encoders at below-normal priority. Then, if SEARCH=1, a 2-step
# 4-image / 400-token search of the below-normal layout.
# TINY=1 runs the same on the CPU with the tiny model (a smoke test).
source "$(dirname "$0")/device_prelude.sh"
R=/tmp/priority; rm -rf "$R"; mkdir -p "$R"
rate=${MIXED_RATE:-21.66}
timing=(--step-s 40 --warmup-s 10); tiny=()
[ "${TINY:-0}" = 1 ] && { timing=(--step-s 8 --warmup-s 2); tiny=(--tiny --image-size 224 --output-len 16); rate=${MIXED_RATE:-2}; }
run() {   # name, layout, extra args...
  local name=$1 layout=$2; shift 2
  echo "== $name"
  timeout 200 python3 scripts/gpu_sustained.py --layout "$layout" --out "$R/$name" "${tiny[@]}" "${timing[@]}" \
    --interference-rate "$rate" "$@"
}
run aggregated aggregated
run epd epd
run epd-below-normal epd --launch-arg=--encoder-priority=below-normal
if [ "${SEARCH:-0}" = 1 ]; then
  timeout 200 python3 scripts/gpu_sustained.py --layout epd --out "$R/search-below-normal" "${tiny[@]}" \
    "${timing[@]}" --workload "4:400:2:${LOW_HIGH:-14.5:17}" --launch-arg=--encoder-priority=below-normal
fi
for d in "$R"/*; do cp "$d"/*summary.json "$OUT/$(basename "$d")-summary.json" 2>/dev/null; done
grep -h "MPS\|placement" "$R"/*/logs/*/launcher.log 2>/dev/null | sort | uniq -c | head
tar czf "$OUT/priority.tgz" -C /tmp priority
ls "$OUT"
