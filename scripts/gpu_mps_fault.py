#!/usr/bin/env python3
"""The MPS daemons killed under load on a GPU box (not CI; the CPU tests use
a stand-in daemon that runs no server):

    bin/epd-launch --encoders 1 --generators 1 --device cuda   # the built-in tiny model; one GPU, MPS auto

The encoder and the generator share cuda:0 under the launcher's private
MPS control daemon. Two clients send chats with fresh images the whole
time. Then, in turn:

1. the MPS server (nvidia-cuda-mps-server, which runs every client's work)
   gets SIGKILL: its clients' contexts are gone, so the stages must be
   replaced, and the stack must serve again;
2. the control daemon gets SIGKILL, and then the generator: the launcher
   must start a new daemon, and the stages' replacements must serve under
   it (an MPS server running), not time-slice the GPU;
3. the launcher is stopped (SIGINT): it must exit 0 and leave no MPS
   process, no MPS folder and no epd segment in /dev/shm.

Every request must end (answered, or failed with an HTTP error): none
may hang past its timeout. Prints one JSON report, with each phase's
launcher log lines and nvidia-smi's compute processes; exit 1 if a
condition failed.

    python3 scripts/gpu_mps_fault.py [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_launcher_death import alive, mps_processes, until  # noqa: E402
from pipeline.bench.launched import LaunchedStack  # noqa: E402

STARTED = re.compile(r"started (\S+) \(pid (\d+)")
MPS = re.compile(r"started the MPS control daemon \(pipe (\S+), pid (\d+)\)")
REQUEST_TIMEOUT_S = 90


def png(seed: int) -> str:
    import base64

    from PIL import Image
    rng = random.Random(seed)
    image = Image.frombytes("RGB", (112, 112), bytes(rng.randrange(256) for _ in range(112 * 112 * 3)))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat(base_url: str, model: str, seed: int) -> tuple[int | str, str]:
    body = {"model": model, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png(seed)}},
                                                      {"type": "text", "text": "describe"}]}]}
    request = urllib.request.Request(base_url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return response.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()[:200].decode(errors="replace")
    except OSError as exc:   # refused while the proxy restarts, or the timeout: a hang
        return type(exc).__name__, str(exc)[:200]


class Load:
    """Clients sending chats one after another, each outcome kept with its times."""

    def __init__(self, base_url: str, model: str, clients: int = 2) -> None:
        self.base_url, self.model = base_url, model
        self.outcomes: list[dict] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.seed = 0
        self.t0 = time.monotonic()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def _client(self) -> None:
        while not self.stop.is_set():
            with self.lock:
                self.seed += 1
                seed = self.seed
            sent = time.monotonic() - self.t0
            status, error = chat(self.base_url, self.model, seed)
            with self.lock:
                self.outcomes.append({"sent_s": round(sent, 2), "took_s": round(time.monotonic() - self.t0 - sent, 2),
                                      "status": status, "error": error})
            if status != 200:
                self.stop.wait(0.2)

    def ok_since(self, t: float) -> int:
        with self.lock:
            return sum(1 for o in self.outcomes if o["status"] == 200 and o["sent_s"] >= t)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def end(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(REQUEST_TIMEOUT_S + 10)


def servers() -> list[int]:
    return [int(line.split()[0]) for line in mps_processes() if "nvidia-cuda-mps-server" in line]


def compute_apps() -> str:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return out.stdout.strip()


class Log:
    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def new_lines(self) -> list[str]:
        text = self.path.read_text(errors="replace")
        lines, self.offset = text[self.offset:].splitlines(), len(text)
        return [line[:240] for line in lines if "epd-launch" in line or "MPS" in line or "exited" in line
                or "restart" in line or "error" in line.lower()][-40:]


def started(log_path: Path) -> dict[str, int]:
    """Each stage's latest pid, from the launcher's log."""
    return {m.group(1): int(m.group(2)) for m in STARTED.finditer(log_path.read_text(errors="replace"))}


def recovered(load: Load, since: float, timeout: float) -> float:
    """Seconds until two chats sent after `since` have been answered."""
    return until(lambda: load.ok_since(since) >= 2, "two chats answered after the fault", timeout)


def run(out: Path, run_dir: Path, report: dict) -> None:
    stack = LaunchedStack(["--encoders", "1", "--generators", "1", "--device", "cuda", "--drain-timeout", "30"],
                          out / "logs", env={"EPD_RUN_DIR": str(run_dir)})
    report["ready_s"] = round(stack.start(ready_timeout=300), 1)
    launcher_log = out / "logs" / "launcher.log"
    log = Log(launcher_log)
    mps = MPS.search(launcher_log.read_text())
    if mps is None:
        raise RuntimeError("the launcher started no MPS daemon")
    daemon, pipe = int(mps.group(2)), Path(mps.group(1))
    model = json.load(urllib.request.urlopen(stack.base_url + "/v1/models"))["data"][0]["id"]
    load = Load(stack.base_url, model)
    try:
        recovered(load, 0.0, 60)
        report["serving"] = {"servers": servers(), "apps": compute_apps(), "log": log.new_lines()}

        before = started(launcher_log)
        at = load.now()
        for pid in servers():
            subprocess.run(["kill", "-9", str(pid)], check=False)
        report["server_kill"] = {"killed": servers() or "none left", "at_s": round(at, 1)}
        report["server_kill"]["recovered_after_s"] = recovered(load, at + 1.0, 180)
        report["server_kill"].update(replaced=sorted(k for k, v in started(launcher_log).items() if before.get(k) != v),
                                     servers=servers(), apps=compute_apps(), log=log.new_lines())

        at = load.now()
        subprocess.run(["kill", "-9", str(daemon)], check=False)
        until(lambda: not alive(daemon), "the control daemon to die", 10)
        time.sleep(3)   # serving on, with no control daemon
        generator = started(launcher_log)["generator-0"]
        subprocess.run(["kill", "-9", str(generator)], check=False)
        report["daemon_kill"] = {"at_s": round(at, 1), "generator_killed": generator}
        report["daemon_kill"]["recovered_after_s"] = recovered(load, load.now() + 1.0, 180)
        daemons = [int(pid) for _, pid in MPS.findall(launcher_log.read_text())]
        report["daemon_kill"].update(generator_now=started(launcher_log)["generator-0"], daemons=daemons,
                                     servers=servers(), mps_processes=mps_processes(), apps=compute_apps(),
                                     log=log.new_lines())
        daemon = daemons[-1]  # the launcher's new one, which its stop must quit
    finally:
        load.end()
        report["requests"] = summarize(load.outcomes)
        code = stack.stop(timeout=60)
        report["stop"] = {"launcher_exit": code, "log": log.new_lines()}
    report["after"] = {"mps_processes": mps_processes(), "mps_folder_left": pipe.parent.exists(),
                       "shm_left": sorted(p.name for p in Path("/dev/shm").glob("epd-*")), "apps": compute_apps()}


def summarize(outcomes: list[dict]) -> dict:
    by_status: dict[str, int] = {}
    for o in outcomes:
        by_status[str(o["status"])] = by_status.get(str(o["status"]), 0) + 1
    return {"sent": len(outcomes), "by_status": by_status,
            "hung": [o for o in outcomes if o["status"] == "TimeoutError" or o["took_s"] >= REQUEST_TIMEOUT_S],
            "failures": [o for o in outcomes if o["status"] != 200][:20]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("/tmp/mps-fault"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="epd-run-") as run_dir:
        try:
            run(args.out, Path(run_dir), report)
        except Exception as exc:  # noqa: BLE001 - the report says what failed
            report["error"] = f"{type(exc).__name__}: {exc}"
    after = report.get("after", {})
    failed = [name for name, bad in [
        ("error", "error" in report),
        # The replacements must run under a new daemon (an MPS server), not time-slice the GPU.
        ("no_mps_after", "daemon_kill" in report and not report["daemon_kill"].get("servers")),
        ("hung", bool(report.get("requests", {}).get("hung"))),
        ("stop", report.get("stop", {}).get("launcher_exit") != 0),
        ("left", bool(after.get("mps_processes")) or after.get("mps_folder_left") or bool(after.get("shm_left"))),
    ] if bad]
    report["failed"] = failed
    return finish(report, args.out)


def finish(report: dict, out: Path) -> int:
    """Print and save the report; after a failure, clear the box for the next call. The exit status."""
    if report["failed"]:
        for line in mps_processes():
            subprocess.run(["kill", "-9", line.split()[0]], check=False)
        subprocess.run(["pkill", "-9", "-f", r"stages\."], check=False)
    text = json.dumps(report, indent=1)
    print(text)
    (out / "report.json").write_text(text)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
