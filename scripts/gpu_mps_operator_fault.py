#!/usr/bin/env python3
"""The operator's MPS daemon killed under load on a GPU box, as systemd runs
it (not CI; tests/test_mps_operator_watch.py is the CPU version):

    bin/epd-mps                      # epd-mps.service: nvidia-cuda-mps-control -f, its pipe in CUDA_MPS_PIPE_DIRECTORY
    bin/epd-launch --encoders 1 --generators 1 --device cuda   # with that variable set: uses that daemon

Two clients send chats with fresh images the whole time. The daemon (the
child of epd-mps) gets SIGKILL; epd-mps must exit 1, and is started again
5 s later, as Restart=on-failure with RestartSec=5 does. The launcher must
say the daemon is gone, kill its GPU stages, hold their restarts until the
new daemon answers, and the stack must serve again under it (an MPS server
running). Then the launcher is stopped (exit 0, the operator's daemon left
running), then epd-mps (exit 0). Every request must end. Prints one JSON
report; exit 1 if a condition failed.

    python3 scripts/gpu_mps_operator_fault.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_launcher_death import alive, mps_processes, until  # noqa: E402
from gpu_mps_fault import Load, Log, compute_apps, finish, recovered, servers, started, summarize  # noqa: E402
from pipeline.bench.launched import LaunchedStack  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PID_FILE = "nvidia-cuda-mps-control.pid"
RESTART_SEC = 5.0   # epd-mps.service's RestartSec


class EpdMps:
    """bin/epd-mps, started and restarted as systemd would."""

    def __init__(self, root: Path, out: Path) -> None:
        self.pipe, self.logs = root / "pipe", root / "log"
        self.pipe.mkdir(parents=True)
        self.logs.mkdir()
        self.env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.logs)}
        self.out = out
        self.proc: subprocess.Popen | None = None
        self.exits: list[int] = []

    def start(self) -> int:
        with open(self.out, "a") as log:
            self.proc = subprocess.Popen([sys.executable, str(REPO / "bin" / "epd-mps")], env=self.env, cwd=REPO,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        until(lambda: self.daemon() is not None and (self.pipe / "control").exists(), "epd-mps's daemon", 30)
        return self.daemon()

    def daemon(self) -> int | None:
        try:
            pid = int((self.pipe / PID_FILE).read_text())
        except (OSError, ValueError):
            return None
        return pid if alive(pid) else None

    def wait_exit(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self.exits.append(code)
        return code

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(30)


def run(out: Path, root: Path, report: dict) -> None:
    mps = EpdMps(root / "operator", out / "epd-mps.log")
    first = mps.start()
    stack = LaunchedStack(["--encoders", "1", "--generators", "1", "--device", "cuda", "--drain-timeout", "30"],
                          out / "logs", env={**mps.env, "EPD_RUN_DIR": str(root / "run")})
    report["ready_s"] = round(stack.start(ready_timeout=300), 1)
    launcher_log = out / "logs" / "launcher.log"
    log = Log(launcher_log)
    model = json.load(urllib.request.urlopen(stack.base_url + "/v1/models"))["data"][0]["id"]
    load = Load(stack.base_url, model)
    try:
        recovered(load, 0.0, 60)
        report["serving"] = {"daemon": first, "servers": servers(), "apps": compute_apps(), "log": log.new_lines()}

        before = started(launcher_log)
        at = load.now()
        os.kill(first, signal.SIGKILL)
        report["daemon_kill"] = {"at_s": round(at, 1), "epd_mps_exit": mps.wait_exit(30)}
        time.sleep(RESTART_SEC)   # systemd's RestartSec, not a wait for a condition
        second = mps.start()
        report["daemon_kill"]["recovered_after_s"] = recovered(load, at + RESTART_SEC, 180)
        report["daemon_kill"].update(
            new_daemon=second, replaced=sorted(k for k, v in started(launcher_log).items() if before.get(k) != v),
            servers=servers(), mps_processes=mps_processes(), apps=compute_apps(), log=log.new_lines())
    finally:
        load.end()
        report["requests"] = summarize(load.outcomes)
        code = stack.stop(timeout=60)
        report["stop"] = {"launcher_exit": code, "daemon_left_running": mps.daemon() is not None,
                          "log": log.new_lines()}
        report["stop"]["epd_mps_exit"] = mps.stop() if mps.proc.poll() is None else mps.proc.returncode
    report["after"] = {"mps_processes": mps_processes(), "apps": compute_apps(),
                       "shm_left": sorted(p.name for p in Path("/dev/shm").glob("epd-*"))}


def failures(report: dict) -> list[str]:
    kill, stop, after = report.get("daemon_kill", {}), report.get("stop", {}), report.get("after", {})
    lines = " ".join(kill.get("log", []))
    return [name for name, bad in [
        ("error", "error" in report),
        ("epd_mps_did_not_fail", kill.get("epd_mps_exit") != 1),
        ("no_gone_line", "operator's MPS control daemon" not in lines or "is gone" not in lines),
        ("no_back_line", "is back" not in lines),
        ("not_all_replaced", kill.get("replaced") != ["encoder-0", "generator-0"]),
        ("no_mps_after", not kill.get("servers")),
        ("hung", bool(report.get("requests", {}).get("hung"))),
        ("stop", stop.get("launcher_exit") != 0 or not stop.get("daemon_left_running")
         or stop.get("epd_mps_exit") != 0),
        ("left", bool(after.get("mps_processes")) or bool(after.get("shm_left"))),
    ] if bad]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("/tmp/mps-operator-fault"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="epd-op-") as root:
        try:
            run(args.out, Path(root), report)
        except Exception as exc:  # noqa: BLE001 - the report says what failed
            report["error"] = f"{type(exc).__name__}: {exc}"
    report["failed"] = failures(report)
    return finish(report, args.out)


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
