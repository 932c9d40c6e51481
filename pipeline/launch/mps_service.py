"""epd-mps: the NVIDIA MPS control daemon in the foreground, as systemd's
epd-mps.service (Type=notify) runs it.

`nvidia-cuda-mps-control -f` serves without forking, as this process's
child, so systemd watches one main process that knows whether the daemon
is up: READY=1 once the child lives and listens on <pipe>/control,
WATCHDOG=1 while it lives. systemd's stop is a SIGTERM to this process
alone (KillMode=mixed); it passes `quit` on through the control program, as
the launcher does for its private daemon (mps.py), so the daemon shuts its
servers down in order, and SIGKILLs it only past --stop-timeout.

Exit status: 0 after a clean quit; 1 when the daemon would not start, died
on its own or had to be killed (Restart=on-failure starts it again); 2 for
a bad setup (a variable, folder or program missing).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pipeline.arg_parser import OneLineParser
from pipeline.launch.mps import CONTROL_SOCKET, LOG_VAR, PIPE_VAR, POLL_S, log_tail, send_quit
from pipeline.launch.sd_notify import Notifier

SYSTEMD_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")  # systemd hears from us alone


class SetupError(Exception):
    """What this machine lacks for the daemon to run at all; one line."""


@dataclass(frozen=True)
class Setup:
    program: str  # the control program's full path
    pipe: Path
    logs: Path
    start_timeout: float
    stop_timeout: float
    env: dict[str, str]  # the daemon's and the `quit`'s: ours, the folders included, less SYSTEMD_VARS


class MpsService:
    """One run of the daemon, from start to exit; `run` returns the exit status."""

    def __init__(self, setup: Setup, notifier: Notifier) -> None:
        self.setup = setup
        self.notifier = notifier
        self.signal: int | None = None  # the first SIGTERM/SIGINT: the stop has begun
        self.child: subprocess.Popen | None = None

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        control = self.setup.pipe / CONTROL_SOCKET
        stale = _socket_id(control)  # one left by a killed daemon is no sign of readiness
        self.notifier.status("starting the MPS control daemon")
        try:
            # A new session: Ctrl-C in a terminal reaches this process alone,
            # which quits the daemon in order.
            self.child = subprocess.Popen([self.setup.program, "-f"], stdin=subprocess.DEVNULL,
                                          env=self.setup.env, close_fds=True, start_new_session=True)
        except OSError as exc:
            _error(f"cannot run {self.setup.program}: {exc.strerror or exc}")
            return 1
        try:
            if not self._wait_ready(control, stale):
                return 1
            return self._serve()
        finally:
            if self.child.poll() is None:  # never left behind, whatever the way out
                self.child.kill()
            self.child.wait()

    def _on_signal(self, signum: int, _frame) -> None:
        if self.signal is None:
            self.signal = signum

    def _wait_ready(self, control: Path, stale: tuple[int, int] | None) -> bool:
        deadline = time.monotonic() + self.setup.start_timeout
        while True:
            self.notifier.tick()
            code = self.child.poll()
            if code is not None:
                _error(f"the MPS control daemon exited {_how(code)} before it was ready{log_tail(self.setup.logs)}")
                return False
            if self.signal is not None:
                _error(f"{signal.Signals(self.signal).name} before the MPS control daemon was ready; killing it")
                return False
            if _socket_id(control) not in (None, stale):
                break
            if time.monotonic() >= deadline:
                _error(f"the MPS control daemon was not ready within {self.setup.start_timeout:g} s "
                       f"(no {control} socket){log_tail(self.setup.logs)}; killing it")
                return False
            time.sleep(POLL_S)
        self.notifier.ready(f"serving MPS clients (pipe {self.setup.pipe}, daemon pid {self.child.pid})")
        _say(f"the MPS control daemon is ready (pipe {self.setup.pipe}, pid {self.child.pid})")
        return True

    def _serve(self) -> int:
        while self.signal is None:
            code = self.child.poll()
            if code is not None:
                _error(f"the MPS control daemon (pid {self.child.pid}) exited {_how(code)}"
                       f"{log_tail(self.setup.logs)}")
                return 1
            self.notifier.tick()
            time.sleep(POLL_S)
        return self._stop()

    def _stop(self) -> int:
        name = signal.Signals(self.signal).name
        self.notifier.stopping(f"{name}: quitting the MPS control daemon")
        deadline = time.monotonic() + self.setup.stop_timeout
        why = send_quit(self.setup.program, self.setup.env, deadline)
        while self.child.poll() is None and time.monotonic() < deadline:
            self.notifier.tick()
            time.sleep(POLL_S)
        code = self.child.poll()
        if code is None:
            self.child.kill()
            _error(f"the MPS control daemon (pid {self.child.pid}) did not quit within "
                   f"{self.setup.stop_timeout:g} s{why}; killed it")
            return 1
        if code != 0:
            _error(f"the MPS control daemon exited {_how(code)} on quit{log_tail(self.setup.logs)}")
            return 1
        _say(f"{name}: the MPS control daemon quit")
        return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        setup = setup_from(args, os.environ)
    except SetupError as exc:
        _error(str(exc))
        return 2
    notifier = Notifier()
    try:
        return MpsService(setup, notifier).run()
    finally:
        notifier.close()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog="epd-mps", description="Run the NVIDIA MPS control daemon in the "
                                "foreground for systemd (Type=notify): ready once it listens, `quit` on SIGTERM. "
                                f"Its folders come from {PIPE_VAR} and {LOG_VAR}.")
    p.add_argument("--control", default="nvidia-cuda-mps-control", metavar="PROGRAM",
                   help="the control program (default: nvidia-cuda-mps-control, looked up on PATH)")
    p.add_argument("--start-timeout", type=_seconds, default=10.0, metavar="S",
                   help="seconds for the daemon to listen on <pipe>/control before giving up (default 10)")
    p.add_argument("--stop-timeout", type=_seconds, default=20.0, metavar="S",
                   help="seconds between `quit` and SIGKILL (default 20)")
    return p.parse_args(argv)


def setup_from(args: argparse.Namespace, env: Mapping[str, str]) -> Setup:
    """Raises SetupError naming the first thing missing."""
    folders = []
    for name in (PIPE_VAR, LOG_VAR):
        value = env.get(name)
        if not value:
            raise SetupError(f"{name} is not set (epd-mps.service sets it)")
        if not Path(value).is_dir():
            raise SetupError(f"{name}={value} is not a folder")
        folders.append(Path(value))
    program = shutil.which(args.control)
    if program is None:
        raise SetupError(f"{args.control}: not found on PATH")
    child_env = {name: value for name, value in env.items() if name not in SYSTEMD_VARS}
    return Setup(program, folders[0], folders[1], args.start_timeout, args.stop_timeout, child_env)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):  # also false for nan
        raise argparse.ArgumentTypeError(f"expected seconds > 0 (got {text!r})")
    return value


def _socket_id(path: Path) -> tuple[int, int] | None:
    """Which file is at `path` (a daemon that binds makes a new one); None if none."""
    try:
        stat = path.lstat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def _how(code: int) -> str:
    """Popen's return code in words: a negative one is the signal that ended it."""
    if code >= 0:
        return f"with code {code}"
    try:
        return f"on {signal.Signals(-code).name}"
    except ValueError:
        return f"on signal {-code}"


def _say(line: str) -> None:
    print(f"epd-mps: {line}", flush=True)


def _error(line: str) -> None:
    print(f"epd-mps: error: {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
