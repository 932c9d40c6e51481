#!/usr/bin/env bash
# The interference line of issue 14 (text-only P99 TPOT under a mixed load,
# EPD colocated against aggregated), on one H200, in one device call:
#   run(command="RUNS='epd aggregated' bash scripts/gpu_interference.sh", carry=[".whl"])
# MICRO=1 first runs scripts/gpu_mps_stream_priority.py under an MPS daemon
# this script starts and stops, then without MPS: whether a CUDA stream's
# priority reaches across MPS clients (a decode-like graph beside a matmul
# load, on a normal- and a high-priority stream).
# Then the half text-only load (4 images of 640x640 or none, 400 text tokens,
# 150 out) at a fixed rate (MIXED_RATE, default 21.66 req/s: aggregated's
# sustained maximum for it, session 9), 40 s of arrivals after 10 s of
# warm-up, one run per name in RUNS, each stack started by bin/epd-launch
# alone. A name is a layout (epd: colocated; aggregated) with optional
# suffixes: -tN runs every generator at --max-num-batched-tokens N; -reuse
# sends every image from epd-bench's pool of 4 (--image-reuse 1), so that
# after the first few no image costs any vision work: the same LM work with
# none of the vision, the floor of the text-only TPOT; -paceN runs every
# generator at --prefill-pacing-ms N (-holdM: --prefill-pacing-max-hold-ms M);
# -smN caps the encoders at N% of the SMs (--encoder-sm-percent N); -yieldN holds
# each encoder forward (one image) up to N ms while the generator beside it
# prefills (--encoder-yield-ms N); -noprefix turns prefix caching off
# (--no-enable-prefix-caching; on by default since session 31); -sharedN
# starts every prompt with the same N words (epd-bench --random-prefix-len N).
# MIXED_SEARCH=STEPS:LOW:HIGH first searches aggregated's sustained maximum for
# the mixed load (epd-bench's paced search, as the other workloads since
# session 15), runs aggregated's interference run at it, and sets the rate of
# the RUNS that follow from it.
# TINY=1 runs the serving part on the CPU with the tiny model (a smoke test).
source "$(dirname "$0")/device_prelude.sh"
R=/tmp/interference; rm -rf "$R"; mkdir -p "$R"
rate=${MIXED_RATE:-21.66} runs=${RUNS:-epd aggregated}
timing=(--step-s 40 --warmup-s 10); tiny=()
[ "${TINY:-0}" = 1 ] && { timing=(--step-s 8 --warmup-s 2); tiny=(--tiny --image-size 224 --output-len 16); rate=${MIXED_RATE:-2}; }
if [ "${MICRO:-0}" = 1 ] && [ "${TINY:-0}" != 1 ]; then
  echo "== stream priority across MPS clients (MPS daemon started here)"
  export CUDA_MPS_PIPE_DIRECTORY=$R/mps-pipe CUDA_MPS_LOG_DIRECTORY=$R/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && timeout 120 python3 scripts/gpu_mps_stream_priority.py --json "$OUT/micro.json"
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  echo "== stream priority, no MPS (time-sliced)"
  timeout 120 python3 scripts/gpu_mps_stream_priority.py --seconds 3 --json "$OUT/micro-nomps.json"
fi
# One file back per run, copied as it ends (the device tool returns few files, and
# a call cut short keeps what is in $OUT): its summary, with the interference
# figures; the per-request records and logs are in the tarball.
keep() { cp "$R/$1"/*-summary.json "$OUT/$1-summary.json" 2>/dev/null; }
if [ -n "${MIXED_SEARCH:-}" ]; then
  echo "== aggregated-search ($MIXED_SEARCH)"
  timeout 420 python3 scripts/gpu_sustained.py --layout aggregated --out "$R/aggregated-search" "${tiny[@]}" \
    "${timing[@]}" --mixed-search "$MIXED_SEARCH"
  found=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["mixed_search"]["max_request_rate"] or "")' \
    "$R/aggregated-search/aggregated-summary.json")
  keep aggregated-search
  if [ -n "$found" ]; then rate=$found; echo "mixed maximum (aggregated): $rate req/s"
  else echo "no passing step in $MIXED_SEARCH: no runs at its maximum"; runs=""; fi
fi
declare -A seen=()
for run in $runs; do
  # A name given again runs again, into a folder of its own (name.2, ...).
  seen[$run]=$(( ${seen[$run]:-0} + 1 )); name=$run
  [ "${seen[$run]}" -gt 1 ] && name=$run.${seen[$run]}
  echo "== $name"
  layout=${run%%-*}
  args=(--layout "$layout")
  [[ $run =~ -t([0-9]+) ]] && args+=("--launch-arg=--max-num-batched-tokens=${BASH_REMATCH[1]}")
  [[ $run == *-reuse* ]] && args+=("--bench-arg=--image-reuse=1")
  [[ $run =~ -pace([0-9.]+) ]] && args+=("--launch-arg=--stage-arg=generator=--prefill-pacing-ms=${BASH_REMATCH[1]}")
  [[ $run =~ -sm([0-9]+) ]] && args+=("--launch-arg=--encoder-sm-percent=${BASH_REMATCH[1]}")
  [[ $run =~ -yield([0-9.]+) ]] && args+=("--launch-arg=--encoder-yield-ms=${BASH_REMATCH[1]}")
  [[ $run == *-noprefix* ]] && args+=("--launch-arg=--no-enable-prefix-caching")
  [[ $run =~ -shared([0-9]+) ]] && args+=("--bench-arg=--random-prefix-len=${BASH_REMATCH[1]}")
  [[ $run =~ -hold([0-9.]+) ]] && args+=("--launch-arg=--stage-arg=generator=--prefill-pacing-max-hold-ms=${BASH_REMATCH[1]}")
  timeout 200 python3 scripts/gpu_sustained.py "${args[@]}" --out "$R/$name" "${tiny[@]}" "${timing[@]}" \
    --interference-rate "$rate"
  grep -h "encoder profile" "$R/$name"/logs/*/encoder-0.log 2>/dev/null | tail -2 | sed 's/^.*INFO //'
  keep "$name"
done
tar czf "$OUT/interference.tgz" -C /tmp --exclude='mps-*' interference
ls "$OUT"
