#!/usr/bin/env bash
# The generator's stream priority (stages.generator --stream-priority high)
# against the interference line of issue 14, on one H200, in one device call:
#   run(command="bash scripts/gpu_stream_priority.sh", carry=[".whl"])
# First the mechanism alone: scripts/gpu_mps_stream_priority.py under an MPS
# daemon this script starts and stops (a decode-like graph beside a matmul
# load, on a normal- and a high-priority stream). Then the half text-only
# load at a fixed rate (MIXED_RATE, default 21.66 req/s: aggregated's
# sustained maximum for it, session 9), 40 s of arrivals after 10 s of
# warm-up, one layout after another, each started by bin/epd-launch alone:
# RUNS (default "aggregated epd epd-high"; epd-high is EPD colocated with
# --stage-arg generator=--stream-priority=high; a name ending in -tN runs
# its layout at --max-num-batched-tokens N). SEARCH=LOW:HIGH adds a
# 2-step 4-image / 400-token search of epd-high. MICRO=0 skips the first part.
# TINY=1 runs the serving part on the CPU with the tiny model (a smoke test).
source "$(dirname "$0")/device_prelude.sh"
R=/tmp/stream-priority; rm -rf "$R"; mkdir -p "$R"
rate=${MIXED_RATE:-21.66}
timing=(--step-s 40 --warmup-s 10); tiny=()
[ "${TINY:-0}" = 1 ] && { timing=(--step-s 8 --warmup-s 2); tiny=(--tiny --image-size 224 --output-len 16); rate=${MIXED_RATE:-2}; }
high=--launch-arg=--stage-arg=generator=--stream-priority=high
if [ "${MICRO:-1}" = 1 ] && [ "${TINY:-0}" != 1 ]; then
  echo "== mechanism (MPS daemon started here)"
  export CUDA_MPS_PIPE_DIRECTORY=$R/mps-pipe CUDA_MPS_LOG_DIRECTORY=$R/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && timeout 120 python3 scripts/gpu_mps_stream_priority.py --json "$OUT/micro.json"
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  echo "== mechanism, no MPS (time-sliced)"
  timeout 120 python3 scripts/gpu_mps_stream_priority.py --seconds 3 --json "$OUT/micro-nomps.json"
fi
for name in ${RUNS:-aggregated epd epd-high}; do
  echo "== $name"
  case $name in
    aggregated*) args=(--layout aggregated) ;;
    epd-high*) args=(--layout epd "$high") ;;
    *) args=(--layout epd) ;;
  esac
  # A name ending in -tN: every generator at --max-num-batched-tokens N.
  [[ $name =~ -t([0-9]+)$ ]] && args+=("--launch-arg=--max-num-batched-tokens=${BASH_REMATCH[1]}")
  timeout 200 python3 scripts/gpu_sustained.py "${args[@]}" --out "$R/$name" "${tiny[@]}" "${timing[@]}" \
    --interference-rate "$rate"
  # Kept as each run ends: a call cut short by its time limit keeps the runs it finished.
  for f in "$R/$name"/*-summary.json "$R/$name"/*-mixed.json; do cp "$f" "$OUT/$name-$(basename "$f")"; done
done
if [ -n "${SEARCH:-}" ]; then
  timeout 200 python3 scripts/gpu_sustained.py --layout epd "$high" --out "$R/search-high" "${tiny[@]}" \
    "${timing[@]}" --workload "4:400:2:$SEARCH"
fi
[ -d "$R/search-high" ] && cp "$R"/search-high/*.json "$OUT/"
grep -h "stream priority\|MPS\|placement" "$R"/*/logs/*/*.log 2>/dev/null | sed 's/^.*\] //' | sort | uniq -c | head
tar czf "$OUT/stream-priority.tgz" -C /tmp --exclude='mps-*' stream-priority
ls "$OUT"
