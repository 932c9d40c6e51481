#!/usr/bin/env bash
# DALI's image backend on CUDA (nvJPEG decode, GPU resize) against the Pillow reference, and its speed beside
# torchvision's nvJPEG and Pillow: scripts/gpu_media_check.py with DALI installed, for docs/media.md's
# "dali, CUDA mode" line. DALI's wheels travel in parts (bash ../shared/tools/dali-parts.sh writes
# .dali/part-aa ... part-ae), one call per part while the machine stays warm (within 30 s of the last):
#   run(command="mkdir -p /tmp/dp && cp .dali/part-aa /tmp/dp/", carry=[".dali/part-aa"])   # ... to part-ad
#   run(command="python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl",
#       carry=[".whl"])   # PyAV and the rest (the media registry imports PyAV)
#   run(command="bash scripts/gpu_dali_media.sh", carry=[".dali/part-ae"])
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
if [ -f .dali/part-ae ]; then
  mkdir -p /tmp/dp && cp .dali/part-ae /tmp/dp/
  (cd /tmp/dp && cat part-* | tar x && python3 -m pip install -q --no-index --no-deps --no-compile \
    --target /tmp/site nvidia_dali_cuda130-*.whl deps/*.whl) || { echo "DALI install failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -c "import nvidia.dali, av; print('DALI', nvidia.dali.__version__, 'PyAV', av.__version__)" || exit 1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
timeout 450 python3 scripts/gpu_media_check.py --seconds 3
