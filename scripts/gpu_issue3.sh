#!/usr/bin/env bash
# The encoder-stage GPU acceptance run, for the device tool on nvidia-h200-x2:
#   run(command="bash scripts/gpu_issue3.sh", carry=[".whl"], kind="nvidia-h200-x2")
# Results land in $OUT (JSON) and on stdout.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nvidia-smi topo -m | head -4
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
rc=0
echo "== arena handoff, same GPU"
python3 scripts/gpu_arena_bench.py --consumer-device 0 --json "$OUT/arena_same.json" || rc=1
echo "== arena handoff, same GPU, busy-polling consumer"
python3 scripts/gpu_arena_bench.py --consumer-device 0 --spin --json "$OUT/arena_same_spin.json" || rc=1
echo "== arena handoff, other GPU (peer copy)"
timeout 300 python3 scripts/gpu_arena_bench.py --consumer-device 1 --json "$OUT/arena_cross.json" || rc=1
echo "== encoder stage on cuda:0, consumer on cuda:1"
timeout 180 python3 scripts/gpu_encoder_smoke.py --encoder-device 0 --consumer-device 1 || rc=1
echo "== media backends on GPU"
timeout 180 python3 scripts/gpu_media_check.py || rc=1
exit $rc
