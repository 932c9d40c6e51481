#!/usr/bin/env bash
# First offline generation with bin/epd-generate on the built-in tiny model and
# a sample image; then the same request through EPD (1 encoder + 3 generators
# + the proxy) and the OpenAI API; then stop. Both answers are the same text.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== bin/epd-generate (offline, no server)"
bin/epd-generate --image examples/sample.jpg --prompt "Describe this image." --max-tokens 24 --json | tail -1
echo "== the same request through bin/epd-launch --encoders 1 --generators 3"
port=${PORT:-8000}
log=$(mktemp)
bin/epd-launch --encoders 1 --generators 3 --port "$port" >"$log" 2>&1 &
launcher=$!
trap 'kill -TERM $launcher 2>/dev/null; wait $launcher 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 600); do
  grep -q "EPD ready" "$log" && break
  kill -0 $launcher 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.2
done
grep "EPD ready" "$log"
image=$(base64 -w0 examples/sample.jpg)
curl -sS "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' -d @- <<JSON
{"model": "tiny-qwen2.5-vl-v1", "max_tokens": 24, "temperature": 0,
 "messages": [{"role": "user", "content": [
   {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,$image"}},
   {"type": "text", "text": "Describe this image."}]}]}
JSON
echo
