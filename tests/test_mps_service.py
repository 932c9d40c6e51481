"""bin/epd-mps (pipeline/launch/mps_service.py) under a fake systemd: a bound
NOTIFY_SOCKET here, WATCHDOG_USEC set, and test_mps.py's stand-in
`nvidia-cuda-mps-control` first on PATH, whose `-f` serves in the
foreground as the wrapper's child."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
import test_mps
from test_mps import LOG, PIPE, StandIn, gone
from waiting import until

stand_in = test_mps.stand_in  # the fixture: the stand-in first on PATH, and no daemon outlives a test

WATCHDOG_USEC = 400_000  # a ping every 0.2 s


class Service:
    """One bin/epd-mps process, its folders and what systemd hears from it."""

    def __init__(self, folder: Path, flags: tuple[str, ...], env: dict[str, str | None]) -> None:
        self.pipe, self.logs = folder / "pipe", folder / "log"
        self.pipe.mkdir(exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.listener.bind(str(folder / "notify.sock"))
        self.listener.settimeout(0.05)
        self.heard: list[tuple[float, str]] = []  # (time.time() on arrival, datagram)
        environ = {**os.environ, PIPE: str(self.pipe), LOG: str(self.logs), "WATCHDOG_USEC": str(WATCHDOG_USEC),
                   "NOTIFY_SOCKET": str(folder / "notify.sock")}
        environ.pop("WATCHDOG_PID", None)
        for name, value in env.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value
        self.proc = subprocess.Popen([sys.executable, str(REPO / "bin" / "epd-mps"), *flags], env=environ,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []

    def messages(self) -> list[str]:
        return [message for _, message in self.heard]

    def hear(self, stop, what: str, timeout: float = 10.0) -> None:
        """Collect datagrams until stop(messages) holds."""
        deadline = time.monotonic() + timeout
        while not stop(self.messages()):
            assert time.monotonic() < deadline, f"not heard in time: {what} (heard {self.messages()})"
            try:
                message = self.listener.recv(4096).decode()
            except TimeoutError:
                continue
            self.heard.append((time.time(), message))

    def when(self, prefix: str) -> float:
        return next(at for at, message in self.heard if message.startswith(prefix))

    def finish(self, timeout: float = 30.0) -> int:
        out, err = self.proc.communicate(timeout=timeout)
        self.out, self.err = out.splitlines(), err.splitlines()
        self.listener.close()
        return self.proc.returncode


@pytest.fixture
def service(tmp_path, stand_in):
    """Starts epd-mps (torn down before `stand_in` checks that no daemon outlived the test)."""
    started: list[Service] = []

    def start(*flags: str, env: dict[str, str | None] | None = None) -> Service:
        started.append(Service(tmp_path, flags, env or {}))
        return started[-1]

    yield start
    for each in started:  # alive only after a failed test; its daemon is `stand_in`'s to report
        if each.proc.poll() is None:
            each.proc.kill()
        each.proc.wait()
        each.proc.stdout.close()
        each.proc.stderr.close()
        each.listener.close()


def pings_since(messages: list[str], start: int) -> int:
    return sum(m == "WATCHDOG=1" for m in messages[start:])


def ready(svc: Service, stand_in: StandIn) -> int:
    """Waits for READY=1; the daemon's pid."""
    svc.hear(lambda h: any(m.startswith("READY=1") for m in h), "READY=1")
    (pid,) = stand_in.daemons()
    return pid


def running(program: Path) -> list[int]:
    """Live processes (zombies excluded) running `program`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if str(program).encode() in (entry / "cmdline").read_bytes() and not gone(int(entry.name)):
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.parametrize("leftover", [False, True], ids=["fresh-pipe", "stale-control-socket"])
def test_ready_only_once_the_daemon_listens_and_watchdog_pings_while_it_lives(service, stand_in, tmp_path,
                                                                               leftover):
    stand_in.rules({"bind_on_cue": True})
    if leftover:  # a killed daemon's socket file, there before this daemon binds its own
        (tmp_path / "pipe").mkdir()
        with socket.socket(socket.AF_UNIX) as old:
            old.bind(str(tmp_path / "pipe" / "control"))
    svc = service()
    (pid,) = until(stand_in.daemons, "the daemon to start", 10.0)
    svc.hear(lambda h: "STATUS=starting the MPS control daemon" in h, "the starting STATUS")
    started = len(svc.heard)
    svc.hear(lambda h: pings_since(h, started) >= 3, "pings while starting")   # 0.6 s, not listening
    assert not any(m.startswith("READY=1") for m in svc.messages())
    assert [words[0] for _, words in stand_in.calls()] == ["daemon"]          # not bound yet

    (stand_in.bin / "bind").touch()
    assert ready(svc, stand_in) == pid
    (binding,) = [when for when, words in stand_in.calls() if words == ["binding", str(pid)]]  # the -f daemon's
    assert binding <= svc.when("READY=1")
    assert f"READY=1\nSTATUS=serving MPS clients (pipe {svc.pipe}, daemon pid {pid})" in svc.messages()
    after = len(svc.heard)
    svc.hear(lambda h: pings_since(h, after) >= 2, "pings while serving")
    svc.proc.send_signal(signal.SIGTERM)
    assert svc.finish() == 0, svc.err
    assert svc.out[0] == f"epd-mps: the MPS control daemon is ready (pipe {svc.pipe}, pid {pid})"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_quits_the_daemon_through_the_control_program_and_exits_0(service, stand_in, signum):
    svc = service()
    pid = ready(svc, stand_in)
    svc.proc.send_signal(signum)
    svc.hear(lambda h: any(m.startswith("STOPPING=1") for m in h), "STOPPING=1")
    assert svc.finish() == 0, svc.err
    assert f"STOPPING=1\nSTATUS={signum.name}: quitting the MPS control daemon" in svc.messages()
    assert [words for _, words in stand_in.calls()][-2:] == [["command", "quit"], ["quit", str(pid)]]
    assert svc.when("STOPPING=1") <= stand_in.quits()[pid]
    assert svc.out[-1] == f"epd-mps: {signum.name}: the MPS control daemon quit" and svc.err == []
    assert gone(pid) and running(stand_in.program) == []


def test_a_daemon_that_ignores_quit_is_killed_after_the_stop_timeout(service, stand_in):
    stand_in.rules({"ignore_quit": True})
    svc = service("--stop-timeout", "0.5")
    pid = ready(svc, stand_in)
    svc.proc.send_signal(signal.SIGTERM)
    assert svc.finish() == 1
    assert svc.err == [f"epd-mps: error: the MPS control daemon (pid {pid}) did not quit within 0.5 s; killed it"]
    assert ["command", "quit"] in [words for _, words in stand_in.calls()]
    assert gone(pid) and running(stand_in.program) == []


def test_a_daemon_that_dies_on_its_own_is_named_with_its_code_and_exit_1(service, stand_in):
    svc = service()
    pid = ready(svc, stand_in)
    with socket.socket(socket.AF_UNIX) as client:   # the stand-in's own way to die
        client.connect(str(svc.pipe / "control"))
        client.sendall(b"exit 3\n")
    assert svc.finish() == 1
    assert svc.err == [f"epd-mps: error: the MPS control daemon (pid {pid}) exited with code 3 "
                       "(control.log: Starting control daemon)"]
    assert not any(m.startswith("STOPPING=1") for m in svc.messages())
    assert gone(pid)


def test_a_daemon_never_ready_is_killed_after_the_start_timeout(service, stand_in):
    stand_in.rules({"never_ready": True})
    began = time.monotonic()
    svc = service("--start-timeout", "1")
    assert svc.finish() == 1
    assert 1.0 <= time.monotonic() - began < 8.0
    assert svc.err == [f"epd-mps: error: the MPS control daemon was not ready within 1 s "
                       f"(no {svc.pipe / 'control'} socket); killing it"]
    (pid,) = stand_in.daemons()
    assert gone(pid) and running(stand_in.program) == []
    assert not any(m.startswith("READY=1") for m in svc.messages())


def test_a_stop_before_the_daemon_is_ready_kills_it(service, stand_in):
    stand_in.rules({"bind_on_cue": True})
    svc = service()
    (pid,) = until(stand_in.daemons, "the daemon to start", 10.0)
    svc.proc.send_signal(signal.SIGTERM)
    assert svc.finish() == 1
    assert svc.err == ["epd-mps: error: SIGTERM before the MPS control daemon was ready; killing it"]
    assert gone(pid)


@pytest.mark.parametrize("flags, env, line", [
    ((), {PIPE: None}, f"{PIPE} is not set (epd-mps.service sets it)"),
    ((), {LOG: "/no/such/folder"}, f"{LOG}=/no/such/folder is not a folder"),
    (("--control", "no-such-mps-control"), {}, "no-such-mps-control: not found on PATH"),
], ids=["no-pipe-variable", "no-log-folder", "no-control-program"])
def test_a_bad_setup_is_one_line_and_exit_2(service, stand_in, flags, env, line):
    svc = service(*flags, env=env)
    assert svc.finish() == 2
    assert svc.err == [f"epd-mps: error: {line}"] and svc.out == []
    assert stand_in.calls() == []
