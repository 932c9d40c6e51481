#!/usr/bin/env bash
# One workload of the issue-6 goodput comparison, for the device tool on
# nvidia-h200-x2 (one device call of at most 10 minutes):
#   run(command="IMAGES=4 INPUT_LEN=400 bash scripts/gpu_issue6.sh", carry=[".whl"], kind="nvidia-h200-x2")
# Settings (environment): IMAGES, INPUT_LEN, BUDGET_S (per configuration),
# STEPS, LOW, HIGH, EAGER_MIXED=1 (generators run mixed steps eagerly, not
# through the fused kernels and graphs), FIXED_RATE and TEXT_ONLY (the mixed-load TPOT
# check), ENGINE_CHECK=1 (the engine check's speed modes first),
# TEXT_CHECK=F (after the search: EPD alone at the aggregated maximum rate
# with a fraction F of text-only requests, TEXT_BUDGET_S seconds),
# VISION_GRAPHS=N (vision forwards replayed as CUDA graphs, N shapes kept;
# VISION_WARMUP sizes captured at start-up, default 640x640),
# MAX_STEP_PROMPTS (requests per search step at most; default 240), GEMV=0
# (decode projections on cuBLAS only, not the small-batch Triton matmul that
# is the default on CUDA), MAX_BATCHED
# (the generators' token budget per step: shorter mixed steps, lower TPOT),
# KV_MIB (the generators' KV cache, default 32768; auto sizes it from the GPU),
# GPUS, EPD_GENERATORS, AGG_GENERATORS (the layouts: default 0,1, 1 and 2;
# issue 7 on nvidia-h200-x4: GPUS=0,1,2,3 EPD_GENERATORS=3 AGG_GENERATORS=4).
# The summary, the plot and a tarball of every result and log land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
if [ "${TINY:-0}" != 1 ]; then   # TINY=1: a CPU smoke run of this script on the built-in tiny model
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi

IMAGES=${IMAGES:-4} INPUT_LEN=${INPUT_LEN:-400} BUDGET_S=${BUDGET_S:-240}
STEPS=${STEPS:-5} LOW=${LOW:-0.5} HIGH=${HIGH:-16}
stage_args=(--stage-arg "generator=--kv-cache-mib=${KV_MIB:-32768}" --stage-arg generator=--encoder-cache-tokens=65536
            --stage-arg generator=--max-num-seqs=128 --stage-arg encoder=--arena-mib=4096)
[ "${EAGER_MIXED:-0}" = 1 ] && stage_args+=(--stage-arg generator=--eager-mixed)
[ "${GEMV:-1}" = 0 ] && stage_args+=(--stage-arg generator=--decode-matmul=cublas)
[ -n "${MAX_BATCHED:-}" ] && stage_args+=(--stage-arg "generator=--max-num-batched-tokens=$MAX_BATCHED")
# Both layouts replay vision forwards as graphs (the encoder in EPD, each
# generator's local vision forward in aggregated mode), those of the
# workload's image size captured at start-up: a fair baseline.
if [ -n "${VISION_GRAPHS:-}" ]; then
  for role in encoder generator; do
    stage_args+=(--stage-arg "$role=--vision-graphs=$VISION_GRAPHS" --stage-arg "$role=--vision-warmup=${VISION_WARMUP:-640x640}")
  done
fi
extra=()
[ -n "${FIXED_RATE:-}" ] && extra+=(--fixed-rate "$FIXED_RATE")
[ -n "${TEXT_ONLY:-}" ] && extra+=(--text-only-fraction "$TEXT_ONLY")
[ "${TINY:-0}" = 1 ] && extra+=(--tiny --image-size 64 --output-len 8)
extra+=(--gpus "${GPUS:-0,1}" --epd-generators "${EPD_GENERATORS:-1}" --aggregated-generators "${AGG_GENERATORS:-2}")

if [ "${ENGINE_CHECK:-0}" = 1 ]; then
  echo "== engine check (speed)"
  timeout 120 python3 scripts/gpu_engine_check.py --modes fast_decode --no-profile --json "$OUT/engine.json"
fi

name="${IMAGES}img-${INPUT_LEN}tok"
[ "${EPD_GENERATORS:-1}/${AGG_GENERATORS:-2}" != 1/2 ] && name="$name-1e${EPD_GENERATORS:-1}g-vs-${AGG_GENERATORS:-2}g"
echo "== goodput $name"
timeout -s TERM $(( 2 * BUDGET_S + 60 )) python3 scripts/gpu_goodput.py --images "$IMAGES" --input-len "$INPUT_LEN" \
  --out "/tmp/goodput/$name" --budget-s "$BUDGET_S" --steps "$STEPS" --low "$LOW" --high "$HIGH" \
  --warmup-prompts 24 --max-step-prompts "${MAX_STEP_PROMPTS:-240}" "${stage_args[@]}" "${extra[@]}"
rc=$?
if [ -n "${TEXT_CHECK:-}" ]; then
  rate=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['configs']['aggregated']['max_request_rate'] or '')" \
         "/tmp/goodput/$name/summary.json" 2>/dev/null)
  if [ -n "$rate" ]; then
    echo "== EPD at the aggregated maximum, $rate req/s, text-only fraction $TEXT_CHECK"
    timeout -s TERM $(( ${TEXT_BUDGET_S:-90} + 30 )) python3 scripts/gpu_goodput.py --images "$IMAGES" \
      --input-len "$INPUT_LEN" --out "/tmp/goodput/$name/textonly" --budget-s "${TEXT_BUDGET_S:-90}" \
      --configs epd --fixed-rate "$rate" --text-only-fraction "$TEXT_CHECK" --warmup-prompts 8 \
      "${stage_args[@]}" "${extra[@]}" || rc=1
  else
    echo "== no aggregated maximum: text-only check skipped"; rc=1
  fi
fi
# The device tool brings back few, shallow files: the summary, the plot and
# one tarball of every result and log.
cp "/tmp/goodput/$name/summary.json" "$OUT/${name}-summary.json" 2>/dev/null
cp "/tmp/goodput/$name/goodput.png" "$OUT/${name}-goodput.png" 2>/dev/null
tar czf "$OUT/${name}.tgz" -C /tmp/goodput "$name"
exit $rc
