#!/usr/bin/env bash
# Issue 15's last acceptance line: sustained goodput of EPD (1E+1G colocated
# under MPS) against aggregated for the Qwen3-VL-4B shape (random bf16
# weights) on one H200, at 4 images / 400 tokens and 1 image / 400 tokens,
# under issue 14's rule (40 s steps, the first 10 s warm-up). One layout per
# device call of at most 10 minutes; the second call's brackets come from the
# first's maxima:
#   run(command="PHASE=agg bash scripts/gpu_qwen3_sustained.sh", carry=[".whl"])
#   run(command="PHASE=epd B4=LOW:HIGH B1=LOW:HIGH bash scripts/gpu_qwen3_sustained.sh", carry=[".whl"])
# TINY=1 runs the same on the CPU with the tiny Qwen3-VL shape.
source "$(dirname "$0")/device_prelude.sh"
if [ "${TINY:-0}" != 1 ]; then
  shape=qwen3-vl-4b; rule=(--step-s 40 --warmup-s 10); limit=560
else
  shape=qwen3-vl-tiny; rule=(--tiny --image-size 224 --output-len 16 --step-s 8 --warmup-s 2); limit=400
fi
R=/tmp/qwen3; mkdir -p "$R"
(while sleep 20; do tar czf "$OUT/partial.tgz" -C /tmp qwen3 2>/dev/null; done) &
if [ "$PHASE" = agg ]; then
  layout=aggregated; w4="4:400:${S4:-4}:${B4:-8:18}"; w1="1:400:${S1:-3}:${B1:-22:44}"
else
  layout=epd; w4="4:400:${S4:-4}:${B4:?the bracket from aggregated}"; w1="1:400:${S1:-3}:${B1:?the bracket from aggregated}"
fi
timeout "$limit" python3 scripts/gpu_sustained.py --layout "$layout" --out "$R/$layout" --shape "$shape" \
  "${rule[@]}" --workload "$w4" --workload "$w1"
rc=$?
kill %1 2>/dev/null
cp "$R/$layout/$layout-summary.json" "$OUT/" 2>/dev/null
tar czf "$OUT/qwen3-$layout.tgz" -C /tmp qwen3 && rm -f "$OUT/partial.tgz"
ls "$OUT"
exit $rc
