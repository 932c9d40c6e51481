"""A private MPS control daemon that dies while the launcher runs (SIGKILL,
a crash): the supervisor starts a new one and restarts its clients on it.
Found on an H100 (scripts/gpu_mps_fault.py): with the daemon gone, the
stages' replacements came up without MPS and time-sliced the GPU, and
nothing said so. Runs test_mps.py's stand-in daemon around test_launch.py's
stand-in stages."""

from __future__ import annotations

import os
import re
import signal

from test_launch import assert_all_gone
from test_mps import (LOG, PERCENT, PIPE, STARTED, STOPPED, all_up, envs, gone, launch,  # noqa: F401
                      mps_vars, stand_in)

GONE = (r"^epd-launch: the MPS control daemon \(pid {pid}\) is gone, and its clients' GPU contexts with it; "
        r"starting a new one and restarting encoder-0, generator-0, generator-1$")
MODEL_STAGES = ("encoder-0", "generator-0", "generator-1")


def started_daemon(launcher, count: int = 1) -> tuple[str, int]:
    line = launcher.wait_for(STARTED, count=count)[count - 1]
    pipe, pid = re.match(STARTED, line).groups()
    return pipe, int(pid)


def test_a_killed_daemon_is_replaced_and_its_clients_restarted_on_the_new_one(launch, stand_in, tmp_path):
    (tmp_path / "ready").touch()
    launcher = launch({}, sm_percent=30)
    launcher.wait_for("^EPD ready")
    all_up(launcher)
    pipe, old = started_daemon(launcher)
    first = {instance: launcher.pids(instance) for instance in (*MODEL_STAGES, "proxy")}

    os.kill(old, signal.SIGKILL)
    launcher.wait_for(GONE.format(pid=old))
    same_pipe, new = started_daemon(launcher, count=2)
    assert new != old and same_pipe == pipe and stand_in.daemons() == [old, new]
    mps = {PIPE: pipe, LOG: str(tmp_path / "run" / "mps" / "log")}
    for instance in MODEL_STAGES:
        restarted = envs(launcher, instance, count=2)[1]
        assert mps_vars(restarted) == {**mps, PERCENT: "30" if instance == "encoder-0" else None}
        launcher.wait_for(rf"^epd-launch: {instance} was killed by SIGKILL; restarting")
        assert_all_gone(first[instance])  # killed: its context was in the dead server
    assert launcher.pids("proxy") == first["proxy"]  # not a client: left alone
    # Every restart started after the new daemon did.
    lines = launcher.out
    new_start = next(i for i, line in enumerate(lines) if re.match(STARTED, line) and f"pid {new})" in line)
    restarts = [i for i, line in enumerate(lines)
                if re.match(r"^epd-launch: started (encoder|generator)-", line)][len(MODEL_STAGES):]
    assert len(restarts) == len(MODEL_STAGES) and min(restarts) > new_start

    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.finish() == 0, launcher.err
    assert launcher.out[-1] == STOPPED
    assert list(stand_in.quits()) == [new] and gone(new) and gone(old)
    assert not (tmp_path / "run" / "mps").exists()
    assert_all_gone(launcher.pids())


def test_a_daemon_that_cannot_be_restarted_leaves_the_stages_time_slicing_with_a_warning(
        launch, stand_in, tmp_path):
    (tmp_path / "ready").touch()
    launcher = launch({})
    launcher.wait_for("^EPD ready")
    all_up(launcher)
    _, old = started_daemon(launcher)
    stand_in.rules({"fail": "stand-in: no MPS now"})
    os.kill(old, signal.SIGKILL)
    launcher.wait_for(GONE.format(pid=old))
    launcher.wait_for(rf"^epd-launch: warning: MPS could not be restarted \({re.escape(str(stand_in.program))} "
                      r"-d exited with code 1: stand-in: no MPS now\); the stages sharing cuda:0 will time-slice it$")
    for instance in MODEL_STAGES:
        assert mps_vars(envs(launcher, instance, count=2)[1]) == {PIPE: None, LOG: None, PERCENT: None}
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.finish() == 0, launcher.err
    assert STOPPED not in launcher.out and not (tmp_path / "run" / "mps").exists()
    assert_all_gone(launcher.pids())


def test_with_mps_required_a_daemon_that_cannot_be_restarted_ends_the_launch(launch, stand_in, tmp_path):
    (tmp_path / "ready").touch()
    launcher = launch({}, required=True)
    launcher.wait_for("^EPD ready")
    all_up(launcher)
    _, old = started_daemon(launcher)
    stand_in.rules({"fail": "stand-in: no MPS now"})
    os.kill(old, signal.SIGKILL)
    assert launcher.finish() == 1
    assert launcher.err[-1] == (f"epd-launch: error: MPS is required (--mps on) but could not be restarted: "
                                f"{stand_in.program} -d exited with code 1: stand-in: no MPS now")
    assert not (tmp_path / "run" / "mps").exists()
    assert_all_gone(launcher.pids())
