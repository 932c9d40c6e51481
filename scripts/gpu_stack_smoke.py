#!/usr/bin/env python3
"""The whole stack on a GPU (run on the GPU box, not in CI):

    python scripts/gpu_stack_smoke.py [--generators 1]

Starts `bin/epd-launch --device cuda --dtype float32` on the tiny model,
sends chat requests with 0, 1 and 2 images, and compares each answer with
`bin/epd-generate` run on the CPU for the same prompt (float32 both sides;
TF32 is off). Then stops the stack and checks for leftovers.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def image(seed: int, h: int, w: int) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((w, h)).save(buf, "PNG")
    return buf.getvalue()


def chat(port: int, images: list[bytes], text: str) -> str:
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b).decode()}}
             for b in images] + [{"type": "text", "text": text}]
    body = json.dumps({"model": "tiny-qwen2.5-vl-v1", "messages": [{"role": "user", "content": parts}],
                       "max_tokens": 16, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["message"]["content"]


def offline(images: list[bytes], text: str, tmp: Path) -> str:
    args = []
    for i, b in enumerate(images):
        (tmp / f"{i}.png").write_bytes(b)
        args += ["--image", str(tmp / f"{i}.png")]
    out = subprocess.run([sys.executable, str(REPO / "bin" / "epd-generate"), "--prompt", text, *args,
                          "--max-tokens", "16", "--json", "--device", "cpu"], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.splitlines()[-1])["text"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--generators", type=int, default=1)
    p.add_argument("--port", type=int, default=8300)
    args = p.parse_args()
    tmp = Path("/tmp/epd-stack-smoke")
    tmp.mkdir(exist_ok=True)
    log = open(tmp / "launch.log", "w")
    launcher = subprocess.Popen([str(REPO / "bin" / "epd-launch"), "--encoders", "1", "--generators",
                                 str(args.generators), "--device", "cuda", "--dtype", "float32",
                                 "--port", str(args.port)], stdout=log, stderr=subprocess.STDOUT)
    failures = 0
    try:
        deadline = time.monotonic() + 240
        while "EPD ready" not in (tmp / "launch.log").read_text():
            if launcher.poll() is not None or time.monotonic() > deadline:
                print((tmp / "launch.log").read_text()[-3000:])
                return 1
            time.sleep(0.5)
        cases = {0: [], 1: [image(1, 224, 336)], 2: [image(2, 120, 90), image(3, 300, 200)]}
        for n, images in cases.items():
            text = f"Describe these {n} pictures."
            t = time.perf_counter()
            got = chat(args.port, images, text)
            ms = (time.perf_counter() - t) * 1000
            expected = offline(images, text, tmp)
            same = got == expected
            failures += not same
            print(f"{n} images: {'equal' if same else 'DIFFERENT'} ({ms:.0f} ms) {got!r} vs {expected!r}")
    finally:
        launcher.terminate()
        print("launcher exit code", launcher.wait(timeout=60))
        log.close()
        left = sorted(p.name for p in Path("/dev/shm").glob("epd-*"))
        print("shm leftovers:", left)
        print((tmp / "launch.log").read_text()[-1500:])
        failures += bool(left)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
