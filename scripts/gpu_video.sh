#!/usr/bin/env bash
# Issue 16 on one H200. DALI's wheels travel in parts (bash ../shared/tools/dali-parts.sh
# writes .dali/part-aa ... part-ae); one call per part while the machine stays warm:
#   run(command="mkdir -p /tmp/dp && cp .dali/part-aa /tmp/dp/", carry=[".dali/part-aa"])   # ... to part-ad
#   run(command="PHASE=check bash scripts/gpu_video.sh", carry=[".whl", ".dali/part-ae"])
# then, warm, each with carry=[".whl"] (DALI stays installed in /tmp/site):
#   PHASE=check: scripts/gpu_video_check.py: NVDEC against PyAV, 640x360 and 1280x720 H.264
#   PHASE=agg:   aggregated sustained goodput, 1 clip (8 s, 1280x720, 30 fps) + 100 text tokens,
#                150 output tokens, Qwen3-VL-4B shape; VIDEO_BACKEND=pyav|dali|auto for its decoder
#   PHASE=epd:   the same for EPD colocated (the encoder decodes with NVDEC)
# Brackets: B=LOW:HIGH (default 4:40), steps S (default 5); issue 14's rule (40 s steps, 10 s warm-up).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/log-$PHASE.txt") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
if [ -f .dali/part-ae ]; then
  mkdir -p /tmp/dp && cp .dali/part-ae /tmp/dp/
  (cd /tmp/dp && cat part-* | tar x && python3 -m pip install -q --no-index --no-deps --no-compile \
    --target /tmp/site nvidia_dali_cuda130-*.whl deps/*.whl) || { echo "DALI install failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -c "import nvidia.dali.experimental.dynamic" 2>/dev/null && echo "DALI importable" || echo "DALI missing"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
R=/tmp/video; mkdir -p "$R"
if [ "$PHASE" = check ]; then
  timeout 500 python3 scripts/gpu_video_check.py --json "$OUT/video-check.json"
  exit $?
fi
layout=$([ "$PHASE" = agg ] && echo aggregated || echo epd)
backend=${VIDEO_BACKEND:-auto}
extra=(--launch-arg=--stage-arg=encoder=--video-backend=$backend --launch-arg=--stage-arg=generator=--video-backend=$backend)
(while sleep 20; do tar czf "$OUT/partial.tgz" -C /tmp video 2>/dev/null; done) &
timeout 560 python3 scripts/gpu_sustained.py --layout "$layout" --out "$R/$layout-$backend" --shape qwen3-vl-4b \
  --step-s 40 --warmup-s 10 --video 720,1280,240 --workload "1:100:${S:-5}:${B:-4:40}" "${extra[@]}"
rc=$?
kill %1 2>/dev/null
grep -h "epd-bench: step" "$R/$layout-$backend"/logs/*.log
tar czf "$OUT/video-$layout-$backend.tgz" -C /tmp video && rm -f "$OUT/partial.tgz"
exit $rc
