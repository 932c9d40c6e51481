"""The operator's MPS control daemon (CUDA_MPS_PIPE_DIRECTORY, as systemd's
epd-mps unit provides it) dying while the launcher runs: the clients are
killed, and their restarts wait for a daemon to answer there again, or
for `operator_wait`, so that they do not come up without MPS unannounced
(pipeline/launch/mps_watch.py). test_mps.py's stand-in daemon, run in the
foreground as the operator's, around test_launch.py's stand-in stages."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from test_launch import Launcher, assert_all_gone
from test_mps import LOG, PIPE, all_up, envs, gone, stand_in  # noqa: F401 (the fixture)
from waiting import until

MODEL_STAGES = ("encoder-0", "generator-0", "generator-1")
CLIENTS = "encoder-0, generator-0, generator-1"


class Operator:
    """Daemons in one pipe folder, each `-f` as systemd runs it; quit at the end."""

    def __init__(self, program: Path, folder: Path) -> None:
        self.program = program
        self.pipe, self.logs = folder / "pipe", folder / "log"
        self.pipe.mkdir(parents=True)
        self.logs.mkdir()
        self.env = {**os.environ, PIPE: str(self.pipe), LOG: str(self.logs)}
        self.daemons: list[subprocess.Popen] = []

    def start(self) -> int:
        (self.pipe / "nvidia-cuda-mps-control.pid").unlink(missing_ok=True)
        self.daemons.append(subprocess.Popen([str(self.program), "-f"], env=self.env, stdin=subprocess.DEVNULL))
        pid = self.daemons[-1].pid
        until(lambda: (self.pipe / "control").exists() and _pid_file(self.pipe) == pid,
              "the operator's daemon to listen", 10)
        return pid

    def kill(self) -> int:
        daemon = self.daemons[-1]
        daemon.kill()
        daemon.wait()
        return daemon.pid

    def close(self) -> None:
        for daemon in self.daemons:
            if daemon.poll() is None:
                subprocess.run([str(self.program)], input=b"quit\n", env=self.env, timeout=10)
                daemon.wait(timeout=10)


def _pid_file(pipe: Path) -> int | None:
    try:
        return int((pipe / "nvidia-cuda-mps-control.pid").read_text())
    except (OSError, ValueError):
        return None


@pytest.fixture
def operator(stand_in, tmp_path):
    daemons = Operator(stand_in.program, tmp_path / "operator")
    yield daemons
    daemons.close()


@pytest.fixture
def launch(tmp_path, operator):
    started = []

    def start(required=False, operator_wait=60.0):
        mps = dict(required=required, sm_percent=None, operator_wait=operator_wait)
        started.append(Launcher(tmp_path, {}, mps=mps, env={PIPE: str(operator.pipe)}))
        return started[-1]

    yield start
    for launcher in started:
        launcher.kill()


def gone_line(pid: int, wait: float) -> str:
    return (rf"^epd-launch: the operator's MPS control daemon \(pid {pid}\) is gone, and its clients' GPU contexts "
            rf"with it; waiting up to {wait:g} s for it to be back and restarting {CLIENTS}$")


def client_restarts(launcher: Launcher) -> list[int]:
    """Where in the output each model stage's second start is."""
    starts = [i for i, line in enumerate(list(launcher.out))
              if re.match(r"^epd-launch: started (encoder|generator)-", line)]
    return starts[len(MODEL_STAGES):]


def test_clients_of_a_dead_operator_daemon_restart_once_it_is_back(launch, operator, tmp_path):
    first = operator.start()
    (tmp_path / "ready").touch()
    launcher = launch()
    launcher.wait_for("^EPD ready")
    all_up(launcher)
    before = {instance: launcher.pids(instance) for instance in MODEL_STAGES}

    operator.kill()
    launcher.wait_for(gone_line(first, 60))
    for instance in MODEL_STAGES:
        launcher.wait_for(rf"^epd-launch: {instance} was killed by SIGKILL; restarting")
        assert_all_gone(before[instance])
    second = operator.start()   # systemd's Restart=on-failure
    (back,) = launcher.wait_for(rf"^epd-launch: the operator's MPS control daemon is back \(pid {second}\); "
                                "restarting its clients$")
    for instance in MODEL_STAGES:
        assert envs(launcher, instance, count=2)[1][PIPE] == str(operator.pipe)
    assert min(client_restarts(launcher)) > launcher.out.index(back)

    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.finish() == 0, launcher.err
    assert operator.daemons[-1].poll() is None   # the operator's: left running
    assert not any("stopped the MPS control daemon" in line for line in launcher.out)
    assert_all_gone(launcher.pids())


def test_clients_restart_after_operator_wait_with_a_warning_when_it_stays_away(launch, operator, tmp_path):
    first = operator.start()
    (tmp_path / "ready").touch()
    launcher = launch(operator_wait=1.5)
    launcher.wait_for("^EPD ready")
    all_up(launcher)
    operator.kill()
    launcher.wait_for(gone_line(first, 1.5))
    (warning,) = launcher.wait_for(r"^epd-launch: warning: the operator's MPS control daemon was not back within "
                                   r"1\.5 s; the stages sharing cuda:0 will time-slice it$")
    for instance in MODEL_STAGES:
        envs(launcher, instance, count=2)
    # Held until then, though their backoff (0.2 s) had long passed.
    assert len(client_restarts(launcher)) == 3 and min(client_restarts(launcher)) > launcher.out.index(warning)
    assert gone(first)
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.finish() == 0, launcher.err
    assert_all_gone(launcher.pids())


def test_with_mps_required_an_operator_daemon_that_stays_away_ends_the_launch(launch, operator, tmp_path):
    first = operator.start()
    (tmp_path / "ready").touch()
    launcher = launch(required=True, operator_wait=1.0)
    launcher.wait_for("^EPD ready")
    all_up(launcher)
    operator.kill()
    assert launcher.finish() == 1
    assert launcher.err[-1] == ("epd-launch: error: MPS is required (--mps on) but the operator's daemon was not "
                                "back within 1 s")
    assert any(re.match(gone_line(first, 1), line) for line in launcher.out)
    assert_all_gone(launcher.pids())
