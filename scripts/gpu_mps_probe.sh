#!/usr/bin/env bash
# What the real `nvidia-cuda-mps-control -f` (systemd's epd-mps unit) leaves
# in its pipe folder, and whether a bare connect to its control socket (a
# liveness check) disturbs it. Not CI: run on a GPU box.
#   bash scripts/gpu_mps_probe.sh
set -u
root=$(mktemp -d); mkdir "$root/pipe" "$root/log"
export CUDA_MPS_PIPE_DIRECTORY=$root/pipe CUDA_MPS_LOG_DIRECTORY=$root/log
nvidia-cuda-mps-control -f & daemon=$!
for _ in $(seq 50); do [ -S "$root/pipe/control" ] && break; sleep 0.1; done
echo "foreground daemon pid $daemon; pipe folder:"; ls -la "$root/pipe"
echo "pid file: $(cat "$root/pipe/nvidia-cuda-mps-control.pid" 2>&1)"
python3 - <<'PY'
import os, socket
for _ in range(3):
    s = socket.socket(socket.AF_UNIX); s.connect(os.environ["CUDA_MPS_PIPE_DIRECTORY"] + "/control"); s.close()
print("three bare connects made")
PY
sleep 1
echo "control.log:"; cat "$root/log/control.log"
echo get_server_list | nvidia-cuda-mps-control; echo "get_server_list exit $?"
echo quit | nvidia-cuda-mps-control; wait $daemon; echo "daemon exit $?"
echo "left in the pipe folder:"; ls -la "$root/pipe"
rm -rf "$root"
