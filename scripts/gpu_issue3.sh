#!/usr/bin/env bash
# The encoder-stage GPU acceptance run, for the device tool on nvidia-h200-x2:
#   run(command="bash scripts/gpu_issue3.sh", carry=[".whl"], kind="nvidia-h200-x2")
# Everything is logged to $OUT/log.txt (and JSON files beside it).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
ITERS=${ITERS:-1000}
nvidia-smi topo -m | head -3; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
rc=0
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" || { echo "!! $name failed ($?)"; rc=1; }; }
step "arena handoff, same GPU" 120 python3 scripts/gpu_arena_bench.py --consumer-device 0 --iters "$ITERS" --json "$OUT/arena_same.json"
step "arena handoff, other GPU (peer copy)" 120 python3 scripts/gpu_arena_bench.py --consumer-device 1 --iters "$ITERS" --json "$OUT/arena_cross.json"
step "arena handoff, other GPU, busy-polling consumer" 120 python3 scripts/gpu_arena_bench.py --consumer-device 1 --spin --iters "$ITERS" --json "$OUT/arena_cross_spin.json"
if [ "${MPS:-0}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "MPS daemon started"
  step "arena handoff, same GPU, under MPS" 120 python3 scripts/gpu_arena_bench.py --consumer-device 0 --iters "$ITERS" --json "$OUT/arena_same_mps.json"
  step "arena handoff, same GPU, under MPS, busy-polling" 120 python3 scripts/gpu_arena_bench.py --consumer-device 0 --spin --iters "$ITERS" --json "$OUT/arena_same_mps_spin.json"
  echo quit | nvidia-cuda-mps-control
fi
step "encoder stage on cuda:0, consumer on cuda:1" 120 python3 scripts/gpu_encoder_smoke.py --encoder-device 0 --consumer-device 1
step "media backends on GPU" 120 python3 scripts/gpu_media_check.py
exit $rc
