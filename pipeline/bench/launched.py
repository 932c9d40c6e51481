"""A whole stack under bin/epd-launch and epd-bench runs against it, as
subprocesses, for the comparison scripts (scripts/gpu_goodput.py,
scripts/cpu_burst.py).

The launcher gets a session of its own, so a Ctrl-C meant for the script
does not reach the stages twice; `stop` sends it SIGINT (it stops every
stage and cleans up shared memory) and kills the group only if it hangs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
LAUNCH = REPO / "bin" / "epd-launch"
BENCH = REPO / "bin" / "epd-bench"


class StackError(RuntimeError):
    """The stack did not come up (the message names the log to read)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchedStack:
    """`bin/epd-launch *launch_args --port PORT --log-dir LOG_DIR`, ready once /health answers 200."""

    def __init__(self, launch_args: list[str], log_dir: Path, port: int | None = None,
                 env: dict[str, str] | None = None):
        self.port = port or free_port()
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.argv = [sys.executable, str(LAUNCH), *launch_args, "--port", str(self.port),
                     "--log-dir", str(self.log_dir)]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, ready_timeout: float) -> float:
        """Start and wait for /health; returns the seconds it took."""
        started = time.monotonic()
        with open(self.log_dir / "launcher.log", "w") as log:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)
        while time.monotonic() - started < ready_timeout:
            if self.proc.poll() is not None:
                raise StackError(f"epd-launch exited with code {self.proc.returncode}; "
                                 f"see {self.log_dir / 'launcher.log'}")
            if _healthy(self.base_url):
                return time.monotonic() - started
            time.sleep(0.5)
        raise StackError(f"not ready within {ready_timeout:.0f} s; see {self.log_dir}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGINT, wait, then SIGKILL the launcher's group; its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> LaunchedStack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def run_bench(bench_args: list[str], timeout_s: float, log_path: Path) -> int:
    """Run bin/epd-bench; past `timeout_s` it gets SIGTERM (a search keeps
    the steps it finished in its --json file). Returns its exit code."""
    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, str(BENCH), *bench_args], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            log.write(f"\nepd-bench ran past {timeout_s:.0f} s: stopped\n")
            return _terminate(proc)
        finally:
            if proc.poll() is None:  # interrupted while waiting
                _terminate(proc)


def _terminate(proc: subprocess.Popen) -> int:
    proc.terminate()
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def read_json(path: Path):
    """A JSON file, or None when it is missing or half-written."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def gpu_memory_used_mib(cpu: bool) -> list[int]:
    """Each GPU's memory in use, from nvidia-smi ([0] with `cpu`: a dry run on no GPU)."""
    if cpu:
        return [0]
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [int(line) for line in out.split()]
