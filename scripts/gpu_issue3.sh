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
cat /proc/sys/net/unix/max_dgram_qlen; nproc; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
rc=0
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" || { echo "!! $name failed ($?)"; rc=1; }; }
B="python3 scripts/gpu_arena_bench.py --iters $ITERS"
step "arena handoff, other GPU: zmq message, Tensor.copy_" 120 $B --consumer-device 1 --copy torch --json "$OUT/cross_zmq_torch.json"
step "arena handoff, other GPU: zmq message, raw copy" 120 $B --consumer-device 1 --json "$OUT/cross_zmq_raw.json"
step "arena handoff, other GPU: lane message, raw copy" 120 $B --consumer-device 1 --lane --json "$OUT/cross_lane_raw.json"
step "arena handoff, other GPU: lane message, raw copy, busy-polling" 120 $B --consumer-device 1 --lane --spin --json "$OUT/cross_lane_raw_spin.json"
if [ "${MPS:-0}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "MPS daemon started"
  step "arena handoff, same GPU under MPS: zmq message, raw copy" 120 $B --consumer-device 0 --json "$OUT/same_mps_zmq_raw.json"
  step "arena handoff, same GPU under MPS: lane message, raw copy" 120 $B --consumer-device 0 --lane --json "$OUT/same_mps_lane_raw.json"
  echo quit | nvidia-cuda-mps-control
fi
step "encoder stage on cuda:0, consumer on cuda:1" 120 python3 scripts/gpu_encoder_smoke.py --encoder-device 0 --consumer-device 1
[ "${QUICK:-0}" = 1 ] && exit $rc
step "media backends on GPU" 120 python3 scripts/gpu_media_check.py
exit $rc
