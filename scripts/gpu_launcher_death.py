#!/usr/bin/env python3
"""A launcher SIGKILLed mid-stream on a GPU box, under the real MPS control
daemon it started (not CI; tests/test_launcher_death.py and
tests/test_mps_keeper.py are the CPU versions, with a stand-in daemon):

    bin/epd-launch --encoders 1 --generators 1 --device cuda   # the built-in tiny model; one GPU, MPS auto

The encoder and the generator share cuda:0, so the launcher starts a private
MPS daemon and its keeper (pipeline/launch/mps_keeper.py). One chat stream
with an image and ignore_eos runs; after its first chunk the launcher gets
SIGKILL. Expected: the stream still ends with all its tokens, every stage
exits on its own, then the keeper quits the daemon and removes its folder;
no nvidia-cuda-mps-control/server process, no epd segment in /dev/shm and
no GPU memory is left. Prints one JSON report; exit 1 if anything failed.

    python3 scripts/gpu_launcher_death.py [--tokens 3000] [--out DIR]
    python3 scripts/gpu_launcher_death.py --cpu --tokens 300   # a dry run of the script: no MPS there
"""

from __future__ import annotations

import argparse
import base64
import http.client
import io
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.bench.launched import LaunchedStack, gpu_memory_used_mib  # noqa: E402

STARTED = re.compile(r"started (\S+) \(pid (\d+)")
MPS = re.compile(r"started the MPS control daemon \(pipe (\S+), pid (\d+)\)")


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def until(check, what: str, timeout: float) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)
    return round(time.monotonic() - started, 2)


def mps_processes() -> list[str]:
    """Live nvidia-cuda-mps-control / -server processes and keepers, as 'pid command'."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        ours = "nvidia-cuda-mps" in command or "mps_keeper" in command
        if entry.name.isdigit() and ours and alive(int(entry.name)):
            found.append(f"{entry.name} {command}")
    return found


def image_url() -> str:
    from PIL import Image
    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), (120, 30, 200)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def open_stream(port: int, tokens: int) -> http.client.HTTPResponse:
    body = {"model": "epd", "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url()}},
                                                      {"type": "text", "text": "go on"}]}]}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("GET", "/v1/models")
    body["model"] = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    return response


def events(response: http.client.HTTPResponse):
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def refused(port: int) -> bool:
    try:
        http.client.HTTPConnection("127.0.0.1", port, timeout=1).connect()
        return False
    except OSError:
        return True


def run(args: argparse.Namespace, run_dir: Path, report: dict) -> None:
    device = "cpu" if args.cpu else "cuda"
    stack = LaunchedStack(["--encoders", "1", "--generators", "1", "--device", device, "--drain-timeout", "300"],
                          args.out / "logs", env={"EPD_RUN_DIR": str(run_dir)})
    report["ready_s"] = round(stack.start(ready_timeout=300), 1)
    log = (args.out / "logs" / "launcher.log").read_text()
    pids = {m.group(1): int(m.group(2)) for m in STARTED.finditer(log)}
    report["stages"] = sorted(pids)
    mps = MPS.search(log)
    report["mps_line"] = mps.group(0) if mps else None
    daemon, pipe = (int(mps.group(2)), Path(mps.group(1))) if mps else (None, None)
    report["mps_processes_serving"] = mps_processes()
    report["gpu_mib_serving"] = gpu_memory_used_mib(args.cpu)
    stream = events(open_stream(stack.port, args.tokens))
    first = next(stream)
    assert first["choices"], first
    stack.proc.send_signal(signal.SIGKILL)
    stack.proc.wait(timeout=10)
    report["port_closed_after_s"] = until(lambda: refused(stack.port), "the proxy to stop listening", 30)
    rest = list(stream)
    finish = [c["choices"][0]["finish_reason"] for c in rest if c.get("choices") and c["choices"][0]["finish_reason"]]
    report["finish"] = finish
    report["completion_tokens"] = rest[-1]["usage"]["completion_tokens"] if rest and rest[-1].get("usage") else None
    report["stages_gone_after_s"] = until(lambda: not any(alive(p) for p in pids.values()),
                                          "every stage to stop on its own", 120)
    if daemon is not None:
        report["daemon_gone_after_s"] = until(lambda: not alive(daemon), "the keeper to quit the daemon", 60)
        # The keeper removes the folder after the daemon has exited, then says so and exits itself.
        report["keeper_gone_after_s"] = until(lambda: not mps_processes(), "the keeper to exit", 30)
        report["mps_folder_left"] = pipe.parent.exists()
    report["mps_processes_after"] = mps_processes()
    report["keeper_line"] = [line for line in (args.out / "logs" / "launcher.log").read_text().splitlines()
                             if "is gone and so are its stages" in line]
    report["shm_left"] = sorted(p.name for p in Path("/dev/shm").glob("epd-*"))
    until(lambda: gpu_memory_used_mib(args.cpu)[0] < 1024, "the GPU's memory to be given back", 30)
    report["gpu_mib_after"] = gpu_memory_used_mib(args.cpu)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=3000)
    p.add_argument("--out", type=Path, default=Path("/tmp/launcher-death"))
    p.add_argument("--cpu", action="store_true", help="the tiny model on the CPU, without MPS")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="epd-run-") as run_dir:
        try:
            run(args, Path(run_dir), report)
        except Exception as exc:  # noqa: BLE001 - the report says what failed
            report["error"] = f"{type(exc).__name__}: {exc}"
    failed = [name for name, bad in [
        ("error", "error" in report),
        ("mps", not args.cpu and not report.get("mps_line")),
        ("stream", report.get("finish") != ["length"] or report.get("completion_tokens") != args.tokens),
        ("mps_left", bool(report.get("mps_processes_after")) or report.get("mps_folder_left")),
        ("keeper_line", len(report.get("keeper_line", [])) != (0 if args.cpu else 1)),
        ("shm_left", bool(report.get("shm_left"))),
    ] if bad]
    report["failed"] = failed
    if failed:  # leave the box clean for the next call
        for line in mps_processes():
            subprocess.run(["kill", "-9", line.split()[0]], check=False)
        subprocess.run(["pkill", "-9", "-f", r"stages\."], check=False)
    print(json.dumps(report, indent=1))
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
