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
SMOKE=${SMOKE:-1}
nvidia-smi topo -m | head -3; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
rc=0
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" || { echo "!! $name failed ($?)"; rc=1; }; }
B="python3 scripts/gpu_arena_bench.py --iters $ITERS"
step "handoff, other GPU, ring, spinning consumer" 150 $B --consumer-device 1 --spin --json "$OUT/cross_ring_spin.json"
step "handoff, other GPU, ring, blocking consumer" 150 $B --consumer-device 1 --json "$OUT/cross_ring_block.json"
step "handoff, other GPU, zmq only, spinning consumer" 150 $B --consumer-device 1 --spin --lane zmq --json "$OUT/cross_zmq_spin.json"
step "copy variants, other GPU" 150 python3 scripts/gpu_handoff_micro.py --consumer-device 1 --iters 300 --json "$OUT/micro_cross.json"
if [ "${MPS:-1}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
  # Two processes on one GPU time-slice it without MPS (docs/benchmarks.md).
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "MPS daemon started"
  step "handoff, same GPU (MPS), ring, spinning consumer" 150 $B --consumer-device 0 --spin --json "$OUT/same_ring_spin.json"
  step "handoff, same GPU (MPS), ring, blocking consumer" 150 $B --consumer-device 0 --json "$OUT/same_ring_block.json"
  step "copy variants, same GPU (MPS)" 150 python3 scripts/gpu_handoff_micro.py --consumer-device 0 --iters 300 --json "$OUT/micro_same.json"
  echo quit | nvidia-cuda-mps-control
fi
if [ "$SMOKE" = 1 ]; then
  step "encoder stage on cuda:0, consumer on cuda:1" 120 python3 scripts/gpu_encoder_smoke.py --encoder-device 0 --consumer-device 1
  step "media backends on GPU" 120 python3 scripts/gpu_media_check.py
fi
exit $rc
