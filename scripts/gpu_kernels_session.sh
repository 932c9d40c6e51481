#!/usr/bin/env bash
# The kernel-level GPU checks in one device call (nvidia-h200, ~7 minutes):
#   run(command="bash scripts/gpu_kernels_session.sh", carry=[".whl"], kind="nvidia-h200")
# 1. the engine check: correctness, kernels, reference, fast decode with
#    cuBLAS and with gemv projections, side by side;
# 2. vision tower: ours against transformers, eager against CUDA graphs;
# 3. small-M Triton matmul (gemv) against cuBLAS at the 3B decode shapes;
# 4. unified mixed-step attention against flash SDPA on prefill shapes;
# 5. a profile of one eager vision forward (kernels by GPU time).
# Each writes its JSON into $OUT; SKIP="vision gemv ..." leaves parts out,
# ENGINE_MODES picks the engine check's modes, VISION_BATCHES the vision
# check's batch sizes.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
rc=0
part() {   # part NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  case " ${SKIP:-} " in *" $name "*) echo "== $name skipped"; return;; esac
  echo "== $name"
  timeout -s TERM "$limit" "$@" || { echo "== $name exit $?"; rc=1; }
}
# The engine check first: it is issue 4's acceptance run (reference, cuBLAS
# and gemv decode side by side). Limits sum to under the 600 s of one call.
part engine 220 python3 scripts/gpu_engine_check.py \
  --modes "${ENGINE_MODES:-correctness,kernels,reference,fast_decode,fast_decode_gemv}" \
  --no-profile --json "$OUT/engine.json"
part vision 150 python3 scripts/gpu_vision_check.py --batches "${VISION_BATCHES:-1,4,8,16}" --json "$OUT/vision.json"
part gemv 140 python3 scripts/gpu_gemv_bench.py --budget-s 110 --json "$OUT/gemv.json"
part unified 90 python3 scripts/gpu_unified_bench.py --sweep-budget-s 30 --json "$OUT/unified.json"
part vprofile 90 python3 scripts/gpu_vision_profile.py --json "$OUT/vision_profile.json"
exit $rc
