#!/usr/bin/env bash
# Issue 14 on one H200, in device calls of at most 10 minutes each:
#   run(command="PHASE=1 bash scripts/gpu_issue14.sh", carry=[".whl"])          # profile + aggregated 4x400, mixed, 1x400
#   run(command="PHASE=2 bash scripts/gpu_issue14.sh", carry=[".whl", "results"]) # EPD colocated: same, + 4x2000
#   run(command="PHASE=3 bash scripts/gpu_issue14.sh", carry=[".whl", "results"]) # profile again, aggregated rest
#   run(command="PHASE=4 bash scripts/gpu_issue14.sh", carry=[".whl", "results"]) # EPD rest
# Session 9 (40 s steps, the first 10 s warm-up; per-request records saved):
#   run(command="PHASE=5 bash scripts/gpu_issue14.sh", carry=[".whl"])  # profile; aggregated 4x400, mixed search + interference
#   run(command="MIXED_RATE=R PHASE=6 bash scripts/gpu_issue14.sh", carry=[".whl"])  # EPD 4x400 + interference; SM share 50
#   run(command="MIXED_RATE=R PHASE=7 bash scripts/gpu_issue14.sh", carry=[".whl"])  # interference, SM share 50; 1x400; no MPS
# Session 14 (decode ahead on by default), the same rule:
#   run(command="PHASE=8 bash scripts/gpu_issue14.sh", carry=[".whl"])  # aggregated: 4x400, 4x2000, 1x2000, interference
#   run(command="PHASE=9 bash scripts/gpu_issue14.sh", carry=[".whl"])  # EPD colocated: the same
# Session 15 (search steps offer their nominal rates: arrivals_within paces them):
#   run(command="PHASE=10 bash scripts/gpu_issue14.sh", carry=[".whl"])  # aggregated: 4x400, 4x2000, 1x2000
#   run(command="PHASE=11 bash scripts/gpu_issue14.sh", carry=[".whl"])  # EPD colocated: the same
#   run(command="PHASE=12 bash scripts/gpu_issue14.sh", carry=[".whl"])  # the profile and the planner's predictions
#   run(command="PHASE=13 bash scripts/gpu_issue14.sh", carry=[".whl"])  # aggregated above PHASE 10's brackets, then PHASE 12
#   run(command="PHASE=14 bash scripts/gpu_issue14.sh", carry=[".whl"])  # 1 image, 400 tokens: both layouts
#   run(command="PHASE=16 bash scripts/gpu_issue14.sh", carry=[".whl"])  # aggregated at --max-num-seqs 256: 1x400, 1x2000, 4x400
#   run(command="PHASE=17 bash scripts/gpu_issue14.sh", carry=[".whl"])  # EPD colocated at --max-num-seqs 256: the same
#   run(command="PHASE=18 bash scripts/gpu_issue14.sh", carry=[".whl"])  # at 256: EPD 1x400, 1x2000; aggregated 1x400 lower
#   run(command="PHASE=19 bash scripts/gpu_issue14.sh", carry=[".whl"])  # 1x2000 both layouts, one bracket, 3 steps
#   run(command="PHASE=20 bash scripts/gpu_issue14.sh", carry=[".whl"])  # profile, plans, aggregated 4x400 (2 steps)
#   run(command="PHASE=21 bash scripts/gpu_issue14.sh", carry=[".whl"])  # EPD colocated 4x400 (2 steps)
# Any card (session 27: the H100 is lent, and the maxima above are the H200's):
#   run(command="PHASE=22 bash scripts/gpu_issue14.sh", carry=[".whl"])  # profile and plans
#   run(command="PHASE=23 bash scripts/gpu_issue14.sh", carry=[".whl"])  # 4x400, both layouts, around the plans
# Every stack is started by bin/epd-launch alone (the EPD layout's MPS daemon
# is the launcher's own). PHASE 2 and 3 read the profile and aggregated
# results of PHASE 1 from results/ (copy the files PHASE 1 brought back
# there). TINY=1 runs the same on the CPU with the tiny model.
source "$(dirname "$0")/device_prelude.sh"
R=/tmp/issue14; mkdir -p "$R"; cp results/* "$R/" 2>/dev/null
tiny=(); [ "${TINY:-0}" = 1 ] && { tiny=(--tiny --image-size 224 --output-len 16 --step-s "${STEP_S:-8}"); SIZE=224 OLEN=16; }
# A call cut off at its limit loses what only the end would copy: a tarball
# of everything so far lands in $OUT every 20 s.
(while sleep 20; do tar czf "$OUT/partial.tgz" -C /tmp issue14 2>/dev/null; done) &
profile=(--profile "$R/profile.json")
long="--step-s 40 --warmup-s 10"
[ "${TINY:-0}" = 1 ] && long="--step-s 10 --warmup-s 3"

profile_box() {
  echo "== epd-plan --profile-out"
  if [ "${TINY:-0}" = 1 ]; then
    timeout 300 python3 bin/epd-plan --profile-out "$R/profile.json" --repeats 2 --vision-batches 1,4 \
      --decode-batches 1,8 --prefill-tokens 256,2048 --image-sizes 224x224
  else
    timeout 200 python3 bin/epd-plan --profile-out "$R/profile.json" --random-weights qwen2.5-vl-3b --gpus 0 \
      --vision-graphs 16 --max-num-seqs 128 --vision-batches 1,4,16 --decode-batches 1,16,64,128 \
      --prefill-tokens 512,2048 --repeats "${REPEATS:-5}"
  fi
  for w in 4:400 1:400 4:2000 1:2000; do
    python3 bin/epd-plan --profile "$R/profile.json" --gpus 1 --images "${w%%:*}" --input-len "${w##*:}" \
      --image-size "${SIZE:-640}x${SIZE:-640}" --output-len "${OLEN:-150}" --json > "$R/plan-${w/:/x}.json" \
      && python3 bin/epd-plan --profile "$R/profile.json" --gpus 1 --images "${w%%:*}" --input-len "${w##*:}" \
      --image-size "${SIZE:-640}x${SIZE:-640}" --output-len "${OLEN:-150}"
  done
}

# Session 8 ran PHASE 1 and 2 (whose profile failed: fixed since), then 3
# and 4: the profile again, the 2000-token workloads, and the searches whose
# maximum lay above their bracket, from the brackets below.
if [ "$PHASE" = 1 ]; then
  profile_box
  timeout 390 python3 scripts/gpu_sustained.py --layout aggregated --out "$R" "${profile[@]}" "${tiny[@]}" \
    --workload 4:400 --workload 1:400
elif [ "$PHASE" = 2 ]; then
  timeout 570 python3 scripts/gpu_sustained.py --layout epd --out "$R" "${profile[@]}" "${tiny[@]}" \
    --interference-from "$R/aggregated-4img-400tok.json" --workload 4:400 --workload 1:400 --workload 4:2000:2
elif [ "$PHASE" = 3 ]; then
  profile_box
  timeout 340 python3 scripts/gpu_sustained.py --layout aggregated --out "$R/p3" "${profile[@]}" "${tiny[@]}" \
    --workload "1:400:2:${AGG_1X400:-34:48}" --workload 4:2000:2 --workload 1:2000:2
elif [ "$PHASE" = 4 ]; then
  timeout 400 python3 scripts/gpu_sustained.py --layout epd --out "$R/p4" "${profile[@]}" "${tiny[@]}" \
    --workload 1:2000:2 --workload "4:400:2:${EPD_4X400:-15.3:21}" --workload "1:400:2:${EPD_1X400:-40.9:56}"
elif [ "$PHASE" = 5 ]; then
  REPEATS=3 profile_box
  timeout 420 python3 scripts/gpu_sustained.py --layout aggregated --out "$R/p5" "${tiny[@]}" $long \
    --workload 4:400:3:10.5:15 --mixed-search 3:15:27
elif [ "$PHASE" = 6 ]; then
  timeout 300 python3 scripts/gpu_sustained.py --layout epd --out "$R/p6" "${tiny[@]}" $long \
    --workload 4:400:3:13.5:19 --interference-rate "${MIXED_RATE:?the aggregated mixed maximum}"
  timeout 200 python3 scripts/gpu_sustained.py --layout epd --out "$R/p6-sm50" "${tiny[@]}" $long \
    --workload 4:400:2:14.5:18.5 --launch-arg=--encoder-sm-percent=50
elif [ "$PHASE" = 7 ]; then
  timeout 120 python3 scripts/gpu_sustained.py --layout epd --out "$R/p7-sm50" "${tiny[@]}" $long \
    --launch-arg=--encoder-sm-percent=50 --interference-rate "${MIXED_RATE:?the aggregated mixed maximum}"
  timeout 150 python3 scripts/gpu_sustained.py --layout epd --out "$R/p7-epd" "${tiny[@]}" $long \
    --workload 1:400:2:38:46
  timeout 150 python3 scripts/gpu_sustained.py --layout aggregated --out "$R/p7-agg" "${tiny[@]}" $long \
    --workload 1:400:2:33:40
  timeout 150 python3 scripts/gpu_sustained.py --layout epd --out "$R/p7-nomps" "${tiny[@]}" $long \
    --workload 4:400:2:13:17 --launch-arg=--mps=off
elif [ "$PHASE" = 8 ] || [ "$PHASE" = 9 ]; then
  layout=aggregated; b4=12:17; b42=7.5:11; b12=16:23
  [ "$PHASE" = 9 ] && { layout=epd; b4=13.5:19; b42=8.5:13; b12=18:27; }
  timeout 560 python3 scripts/gpu_sustained.py --layout $layout --out "$R/p$PHASE" "${tiny[@]}" $long \
    --workload "4:400:3:$b4" --workload "4:2000:2:$b42" --workload "1:2000:2:$b12" \
    --interference-rate "${MIXED_RATE:-21.66}"
elif [ "$PHASE" = 10 ] || [ "$PHASE" = 11 ]; then
  layout=aggregated; b4=12:17; b42=7.5:11; b12=19:24
  [ "$PHASE" = 11 ] && { layout=epd; b4=13.5:19; b42=8.5:13; b12=20:26; }
  b4=${B4:-$b4}; b42=${B42:-$b42}; b12=${B12:-$b12}
  timeout 560 python3 scripts/gpu_sustained.py --layout $layout --out "$R/p$PHASE" "${tiny[@]}" $long \
    --workload "4:400:3:$b4" --workload "1:2000:2:$b12" --workload "4:2000:2:$b42"
elif [ "$PHASE" = 12 ]; then
  REPEATS=3 profile_box
elif [ "$PHASE" = 13 ]; then  # aggregated above PHASE 10's brackets where it passed at their top, then PHASE 12
  timeout 300 python3 scripts/gpu_sustained.py --layout aggregated --out "$R/p13" "${tiny[@]}" $long \
    --workload "1:2000:2:22.6:27" --workload "4:2000:2:10:13"
  REPEATS=3 profile_box
elif [ "$PHASE" = 14 ]; then  # 1 image, 400 tokens, both layouts
  timeout 270 python3 scripts/gpu_sustained.py --layout aggregated --out "$R/p14a" "${tiny[@]}" $long \
    --workload "1:400:2:${B1A:-34:44}"
  timeout 270 python3 scripts/gpu_sustained.py --layout epd --out "$R/p14e" "${tiny[@]}" $long \
    --workload "1:400:2:${B1E:-36:48}"
elif [ "$PHASE" = 16 ] || [ "$PHASE" = 17 ]; then  # --max-num-seqs ${SEQS:-256} (128 capped EPD at 1 image; session 16: not aggregated)
  seqs=(--launch-arg=--stage-arg=generator=--max-num-seqs=${SEQS:-256})
  if [ "$PHASE" = 16 ]; then
    timeout 540 python3 scripts/gpu_sustained.py --layout aggregated --out "$R/p16" "${tiny[@]}" $long "${seqs[@]}" \
      --workload "1:400:2:${B1A:-40:56}" --workload "1:2000:2:${B12A:-22:30}" --workload "4:400:2:${B4A:-13.5:16}"
  else
    timeout 540 python3 scripts/gpu_sustained.py --layout epd --out "$R/p17" "${tiny[@]}" $long "${seqs[@]}" \
      --workload "1:400:2:${B1E:-40:60}" --workload "1:2000:2:${B12E:-22:30}" --workload "4:400:2:${B4E:-15:19}"
  fi
elif [ "$PHASE" = 18 ]; then  # PHASE 16 passed no step at 1 image: EPD at 256 near session 15's maxima, then aggregated below
  seqs=(--launch-arg=--stage-arg=generator=--max-num-seqs=256)
  timeout 330 python3 scripts/gpu_sustained.py --layout epd --out "$R/p18e" "${tiny[@]}" $long "${seqs[@]}" \
    --workload "1:400:3:${B1E:-42:52}" --workload "1:2000:2:${B12E:-22:26}"
  timeout 200 python3 scripts/gpu_sustained.py --layout aggregated --out "$R/p18a" "${tiny[@]}" $long "${seqs[@]}" \
    --workload "1:400:2:${B1A:-39:43.5}"
elif [ "$PHASE" = 19 ]; then  # 1 image, 2000 tokens at session 15's settings: one bracket, both layouts, 3 steps each
  for layout in epd aggregated; do
    timeout 250 python3 scripts/gpu_sustained.py --layout $layout --out "$R/p19-$layout" "${tiny[@]}" $long \
      --workload "1:2000:3:${B12:-21.8:23.4}"
  done
elif [ "$PHASE" = 20 ]; then  # the planner's model of session 25: a profile, its plans, then aggregated at 4x400
  REPEATS=3 profile_box
  python3 scripts/planner_vs_maxima.py "$R/profile.json" docs/results/h200-sustained-paced-2026-12-03.json \
    docs/results/h200-sustained-1img-2026-12-03-s16.json docs/results/h200-sustained-4x400-2026-12-04-s23.json
  timeout 330 python3 scripts/gpu_sustained.py --layout aggregated --out "$R/p20" "${tiny[@]}" $long \
    --workload "4:400:2:${B4A:-13.6:15.0}"
elif [ "$PHASE" = 21 ]; then  # EPD colocated at 4x400, the other half of PHASE 20's comparison
  timeout 330 python3 scripts/gpu_sustained.py --layout epd --out "$R/p21" "${tiny[@]}" $long \
    --workload "4:400:2:${B4E:-15.4:16.8}"
elif [ "$PHASE" = 22 ]; then  # a profile of this card and its plans: the brackets of PHASE 23
  REPEATS=3 profile_box
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && python3 scripts/planner_vs_maxima.py \
    "$R/profile.json" docs/results/h200-sustained-paced-2026-12-03.json \
    docs/results/h200-sustained-1img-2026-12-03-s16.json docs/results/h200-sustained-4x400-2026-12-04-s23.json
  true
elif [ "$PHASE" = 23 ]; then  # W (4:400) in both layouts in one call, 3 steps each, 0.85-1.15x the plans of PHASE 22
  w=${W:-4:400}
  for layout in aggregated epd; do
    timeout 285 python3 scripts/gpu_sustained.py --layout $layout --out "$R/p23-${w/:/x}-$layout" "${tiny[@]}" $long \
      --profile "${PROFILE:-$R/profile.json}" --around "${AROUND:-0.85:1.15}" --workload "$w:${STEPS:-3}"
  done
fi
rc=$?
# Few, shallow files come back: the profile, the summaries and a tarball of everything.
kill %1 2>/dev/null
cp "$R"/profile.json "$R"/*summary.json "$R"/p[34]/*summary.json "$OUT/" 2>/dev/null
for d in "$R"/p[5-9]* "$R"/p1[0-9]* "$R"/p2[0-9]*; do [ -d "$d" ] && cp "$d/$(ls "$d" | grep summary.json | head -1)" "$OUT/$(basename "$d")-summary.json"; done 2>/dev/null
tar czf "$OUT/issue14-phase$PHASE.tgz" -C /tmp issue14 && rm -f "$OUT/partial.tgz"
ls "$OUT"
exit $rc
