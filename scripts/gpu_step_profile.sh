#!/usr/bin/env bash
# Where the stages' time goes under load (issue 6), for the device tool on
# nvidia-h200-x2 (one call, ~6 minutes):
#   run(command="bash scripts/gpu_step_profile.sh", carry=[".whl"], kind="nvidia-h200-x2")
# Fixed-rate runs of the 4-image, 400-token workload (RUNS: config:rate[:eager]
# items; eager = generators with --eager-mixed). The generators and the
# encoder log a step profile every 10 s; every log and result comes back
# in one tarball ($OUT/profile.tgz) with the profile lines in $OUT/log.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
IMAGES=${IMAGES:-4} INPUT_LEN=${INPUT_LEN:-400} BUDGET_S=${BUDGET_S:-100}
RUNS=${RUNS:-"epd:3 epd:3:eager aggregated:5"}
[ "${ENGINE_CHECK:-0}" = 1 ] && timeout 150 python3 scripts/gpu_engine_check.py --modes kernels,fast_decode \
  --no-profile --json "$OUT/engine.json" | grep -E "^(kernel_equality|fused_|failed)"
rc=0
for run in $RUNS; do
  IFS=: read -r config rate eager <<< "$run"
  name="$config-$rate${eager:+-$eager}"
  args=(--stage-arg generator=--kv-cache-mib=32768 --stage-arg generator=--encoder-cache-tokens=65536
        --stage-arg generator=--max-num-seqs=128 --stage-arg encoder=--arena-mib=4096)
  [ "$eager" = eager ] && args+=(--stage-arg generator=--eager-mixed)
  echo "== $name"
  timeout -s TERM $(( BUDGET_S + 40 )) python3 scripts/gpu_goodput.py --images "$IMAGES" --input-len "$INPUT_LEN" \
    --out "/tmp/profile/$name" --budget-s "$BUDGET_S" --configs "$config" --fixed-rate "$rate" \
    --warmup-prompts 12 "${args[@]}" || rc=1
  grep -h "profile" /tmp/profile/"$name"/logs/*/*.log | sed "s/^/$name /" | tail -20
done
tar czf "$OUT/profile.tgz" -C /tmp/profile .
exit $rc
