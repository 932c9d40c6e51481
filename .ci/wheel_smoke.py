"""Run by .ci/wheel-smoke with the fresh venv's python: epd-launch (the
console script) serves the built-in tiny model, one chat request gets an
answer, and SIGTERM stops everything with exit 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(bin_dir: Path) -> int:
    import pipeline
    assert "site-packages" in pipeline.__file__, f"pipeline imported from {pipeline.__file__}, not the wheel"
    port = free_port()
    launcher = subprocess.Popen([str(bin_dir / "epd-launch"), "--port", str(port)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    for line in launcher.stdout:
        print(line, end="")
        if line.startswith("EPD ready:"):
            break
        if time.monotonic() > deadline:
            raise SystemExit("epd-launch was not ready in time")
    else:
        raise SystemExit(f"epd-launch exited with {launcher.wait()} before it was ready")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as reply:
        model = json.loads(reply.read())["data"][0]["id"]
    body = json.dumps({"model": model, "max_tokens": 8,
                       "messages": [{"role": "user", "content": "Say something."}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        answer = json.loads(reply.read())
    assert answer["choices"][0]["message"]["content"], answer
    assert answer["usage"]["completion_tokens"] >= 1, answer
    print("answer:", json.dumps(answer["choices"][0]["message"]))
    launcher.send_signal(signal.SIGTERM)
    rest, _ = launcher.communicate(timeout=60)
    print(rest, end="")
    assert launcher.returncode == 0, f"epd-launch exited with {launcher.returncode} on SIGTERM"
    print("wheel smoke: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
