"""Quits a launcher's private MPS control daemon when that launcher was
killed (SIGKILL, so that it could not quit it), once every stage it started
has exited: nothing is left running and nothing is left on disk.

The launcher starts one keeper beside its daemon (MpsDaemon.start), in a
session of its own, and terminates it before it quits the daemon itself on
a normal stop. A keeper whose parent is no longer the launcher knows the
launcher is gone. The stages then drain and stop on their own
(pipeline/launcher_watch.py), and the daemon must outlive them: `quit`
waits for the clients still attached. The keeper knows them by the
EPD_LAUNCHER_PID the launcher gave each of them (and they gave their own
children), read from /proc.

A launcher started again before the old stages have gone clears the old
daemon itself (MpsDaemon._clear_leftover). Both hold an flock on the run
folder while they quit a daemon and remove or make the folder, and the
keeper leaves alone a daemon that is no longer the one it was given.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from pipeline.launch.mps import (LOG_VAR, PID_FILE, PIPE_VAR, MpsError, daemon_alive, kill_pid, read_pid,
                                 run_folder_lock, send_quit, wait_exit)
from pipeline.launcher_watch import LAUNCHER_PID_ENV

CHECK_S = 0.5


def stages_left(launcher: int) -> list[int]:
    """Live processes (not this one) that carry EPD_LAUNCHER_PID=launcher.
    A zombie's environ reads empty, so a stage that exited does not count."""
    needle = f"{LAUNCHER_PID_ENV}={launcher}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or another user's
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def keep(launcher: int, root: Path, program: str, daemon: int, stop_timeout: float) -> str | None:
    """Wait for the launcher to go, then for its stages; then quit `daemon`
    and remove `root`. Returns what was done, as a line, or None when there
    was nothing to do (the daemon went some other way)."""
    while os.getppid() == launcher:
        if not daemon_alive(daemon):
            return None
        time.sleep(CHECK_S)
    while stages_left(launcher):
        if not daemon_alive(daemon):
            return None
        time.sleep(CHECK_S)
    try:
        with run_folder_lock(root):
            if read_pid(root / "pipe" / PID_FILE) != daemon or not daemon_alive(daemon):
                return None  # a new launcher cleared it first, and may have started its own
            why, killed = _stop(program, root, daemon, stop_timeout)
    except MpsError:  # the run folder itself is gone, and with it the daemon's
        return None
    done = "killed it" if killed else "quit it"
    return (f"epd-launch: the launcher (pid {launcher}) is gone and so are its stages: the MPS control "
            f"daemon (pid {daemon}) is stopped{why} ({done}) and {root} removed")


def _stop(program: str, root: Path, daemon: int, stop_timeout: float) -> tuple[str, bool]:
    deadline = time.monotonic() + stop_timeout
    why = send_quit(program, {**os.environ, PIPE_VAR: str(root / "pipe"), LOG_VAR: str(root / "log")}, deadline)
    killed = not wait_exit(daemon, deadline)
    if killed:
        kill_pid(daemon)
    shutil.rmtree(root, ignore_errors=True)
    return why, killed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.launch.mps_keeper", description=__doc__.split("\n\n")[0])
    parser.add_argument("--launcher", type=int, required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--program", required=True)
    parser.add_argument("--daemon", type=int, required=True)
    parser.add_argument("--stop-timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    # SIGTERM: the launcher is stopping normally and quits its daemon itself.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    line = keep(args.launcher, args.root, args.program, args.daemon, args.stop_timeout)
    if line is not None:
        try:  # the launcher's output, where its stages write too; maybe nobody reads it any more
            print(line, file=sys.stderr, flush=True)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
