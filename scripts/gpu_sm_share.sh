#!/usr/bin/env bash
# The MPS SM share sweep of issue 14 (scripts/gpu_sm_share_sweep.py) under an
# MPS daemon started and stopped here, in one device call:
#   run(command="bash scripts/gpu_sm_share.sh", carry=[".whl"])
# SHARES (default 100,90,80,70,60,50) and BATCHES (1,32,64) pass through.
source "$(dirname "$0")/device_prelude.sh"
R=/tmp/sm-share; rm -rf "$R"; mkdir -p "$R/mps-pipe" "$R/mps-log"
export CUDA_MPS_PIPE_DIRECTORY=$R/mps-pipe CUDA_MPS_LOG_DIRECTORY=$R/mps-log
nvidia-cuda-mps-control -d || exit 1
timeout 480 python3 scripts/gpu_sm_share_sweep.py --shares "${SHARES:-100,90,80,70,60,50}" \
  --batches "${BATCHES:-1,32,64}" --json "$OUT/sm-share.json"
rc=$?
echo quit | nvidia-cuda-mps-control
exit $rc
