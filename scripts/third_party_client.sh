#!/usr/bin/env bash
# An unmodified third-party benchmark client (NVIDIA AIPerf, from PyPI) against
# EPD on the built-in tiny model: random multimodal load (2 base64 JPEGs per
# request), streaming, ignore_eos. Run from the repo root on a machine with
# PyPI access; everything it installs goes to a throwaway venv.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${AIPERF_VENV:-/tmp/aiperf-venv}
[ -x "$venv/bin/aiperf" ] || { python3 -m venv "$venv" && "$venv/bin/pip" install -q aiperf; }
model_dir=$(python3 -c 'from pipeline.models.tiny import default_model_dir; print(default_model_dir())')
# AIPerf reads its tokenizer from the Hugging Face cache when offline; lay the
# tiny model's tokenizer out as a cached repo "epd/tiny".
cache=$(mktemp -d); rev=0123456789abcdef0123456789abcdef01234567
snap=$cache/models--epd--tiny/snapshots/$rev
mkdir -p "$snap" "$cache/models--epd--tiny/refs"
printf %s $rev > "$cache/models--epd--tiny/refs/main"
cp "$model_dir"/{tokenizer.json,tokenizer_config.json,config.json,chat_template.jinja} "$snap"/
port=${PORT:-8123}; log=$(mktemp)
bin/epd-launch --encoders 1 --generators 3 --port "$port" >"$log" 2>&1 &
launcher=$!
trap 'kill -TERM $launcher; wait $launcher; rm -rf "$cache" "$log"' EXIT
until grep -q "EPD ready" "$log"; do kill -0 $launcher; sleep 0.5; done
out=${OUT_DIR:-/tmp/aiperf-out}
HF_HUB_CACHE=$cache HF_HUB_OFFLINE=1 "$venv/bin/aiperf" profile --model "$(basename "$model_dir")" \
  --url "http://127.0.0.1:$port" --endpoint-type chat --streaming --tokenizer epd/tiny \
  --request-count 40 --concurrency 8 --prompt-input-tokens-mean 64 --prompt-input-tokens-stddev 0 \
  --output-tokens-mean 16 --output-tokens-stddev 0 --image-width-mean 320 --image-height-mean 240 \
  --image-batch-size 2 --image-format jpeg --extra-inputs ignore_eos:true --ui-type none --artifact-dir "$out"
python3 - "$out/profile_export_aiperf.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("completed:", d["request_count"]["avg"], "errors:", len(d["error_summary"]),
      "completion tokens per request:", d["usage_completion_tokens"]["avg"], "images per request:", d["num_images"]["avg"])
sys.exit(0 if not d["error_summary"] and d["request_count"]["avg"] == 40 else 1)
PY
