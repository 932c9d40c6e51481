"""A launcher killed with SIGKILL cannot quit its private MPS daemon; the
keeper beside it (pipeline/launch/mps_keeper.py) does, once the stages the
launcher started have all exited, and removes the daemon's folder. The
stand-in control program and stages are test_mps.py's and test_launch.py's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from pipeline.launch.mps_keeper import stages_left
from pipeline.launcher_watch import LAUNCHER_PID_ENV
from test_mps import STARTED, all_up, gone, launch, stand_in  # noqa: F401 (fixtures)
from waiting import until

KEEPER_LINE = (r"^epd-launch: the launcher \(pid {launcher}\) is gone and so are its stages: the MPS control "
               r"daemon \(pid {daemon}\) is stopped \(quit it\) and {root} removed$")


def keepers(root: Path) -> list[int]:
    """Live keeper processes for the daemon folder `root`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pipeline.launch.mps_keeper" in words and str(root).encode() in words and not gone(int(entry.name)):
            found.append(int(entry.name))
    return found


def test_a_killed_launchers_daemon_is_quit_only_after_its_last_stage_and_its_folder_removed(launch, stand_in,
                                                                                             tmp_path):
    (tmp_path / "ready").touch()
    launcher = launch({"generator-1": {"drain": 1.5}})   # the last to exit, 1.5 s after its SIGTERM
    launcher.wait_for("^EPD ready")
    all_up(launcher)   # each has written its pid file
    (started,) = launcher.wait_for(STARTED)
    daemon = int(re.match(STARTED, started).group(2))
    root = tmp_path / "run" / "mps"
    (keeper,) = keepers(root)
    stages = launcher.pids()
    assert sorted(stages_left(launcher.proc.pid)) == sorted(stages)

    launcher.proc.kill()   # SIGKILL to the launcher alone: its stages and the keeper live on
    launcher.proc.wait()
    for pid in stages:     # as launcher_watch.py stops real stages once the launcher is gone
        os.kill(pid, signal.SIGTERM)
    until(lambda: gone(daemon) and not keepers(root), "the keeper to quit the daemon and exit", 20)
    assert list(stand_in.quits()) == [daemon]
    exits = [float(p.read_text()) for p in (tmp_path / "stamps").glob("*.exit")]
    assert len(exits) == len(stages) and stand_in.quits()[daemon] >= max(exits)   # its clients went first
    assert not root.exists() and (tmp_path / "run").exists()
    pattern = KEEPER_LINE.format(launcher=launcher.proc.pid, daemon=daemon, root=re.escape(str(root)))
    until(lambda: any(re.match(pattern, line) for line in launcher.err), "the keeper's line", 10)
    assert gone(keeper)


def test_a_launcher_that_stops_normally_takes_its_keeper_with_it(launch, stand_in, tmp_path):
    (tmp_path / "ready").touch()
    launcher = launch({})
    launcher.wait_for("^EPD ready")
    root = tmp_path / "run" / "mps"
    (keeper,) = keepers(root)
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.finish() == 0, launcher.err
    assert gone(keeper) and not root.exists()
    assert not [line for line in launcher.err if "the launcher (pid" in line]


def test_a_new_launch_that_clears_the_old_daemon_first_leaves_the_keeper_nothing_to_do(launch, stand_in,
                                                                                         tmp_path):
    (tmp_path / "ready").touch()
    old = launch({"generator-0": {"ignore_term": True}})   # a stage that outlives the killed launcher
    old.wait_for("^EPD ready")
    all_up(old)
    (started,) = old.wait_for(STARTED)
    old_daemon = int(re.match(STARTED, started).group(2))
    root = tmp_path / "run" / "mps"
    (old_keeper,) = keepers(root)
    old.proc.kill()
    old.proc.wait()
    for pid in old.pids():
        os.kill(pid, signal.SIGTERM)
    until(lambda: len(stages_left(old.proc.pid)) == 1, "all but the stubborn stage to exit", 10)
    # The MpsDaemon of a launcher started again now clears the old daemon
    # itself; the old keeper sees it gone and exits without touching root.
    from pipeline.launch.mps import MpsConfig, MpsDaemon
    lines: list[str] = []
    daemon = MpsDaemon(MpsConfig(root, frozenset({"encoder-0"})), lines.append)
    daemon.start()
    assert lines[0] == f"epd-launch: stopping the MPS control daemon left by an earlier run (pid {old_daemon})"
    until(lambda: gone(old_keeper), "the old keeper to exit", 10)
    assert daemon.pid is not None and not gone(daemon.pid) and (root / "pipe").is_dir()
    for pid in stages_left(old.proc.pid):
        os.kill(pid, signal.SIGKILL)
    daemon.stop()
    assert not root.exists() and not keepers(root)


def test_stages_left_finds_live_processes_by_their_launcher_pid_only():
    fake = 4_000_000 + os.getpid()   # no launcher has this pid
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                             env={**os.environ, LAUNCHER_PID_ENV: str(fake)})
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                             env={**os.environ, LAUNCHER_PID_ENV: str(fake + 1)})
    try:
        until(lambda: stages_left(fake) == [child.pid], "the child to be found", 10)
        child.stdin.close()
        until(lambda: stages_left(fake) == [], "the child to count as gone once it exits", 10)
        assert child.poll() is not None or gone(child.pid)
        assert stages_left(fake + 1) == [other.pid]
    finally:
        for proc in (child, other):
            proc.kill()
            proc.wait()
