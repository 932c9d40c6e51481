# Sourced by the GPU scripts (scripts/gpu_*.sh) first: the output folder ($OUT,
# with a copy of everything printed in $OUT/log.txt), and on the device the
# carried wheels (.whl/) installed where python3 finds them. --upgrade: a warm
# machine keeps /tmp/site from the last call, and --target would otherwise
# leave an older copy of a package in place. TINY=1: the CPU, no wheels.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
if [ "${TINY:-0}" != 1 ]; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
fi
export PYTHONUNBUFFERED=1
