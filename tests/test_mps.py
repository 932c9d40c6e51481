"""The private MPS control daemon (pipeline/launch/mps.py) against a stand-in
`nvidia-cuda-mps-control` first on PATH: on its own, then run by the
supervisor around test_launch.py's stand-in stages (which dump their
environment), in a launcher process of its own."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from pipeline.launch.mps import MpsConfig, MpsDaemon, MpsError
from waiting import until
from pipeline.launch.plan import StageSpec
from pipeline.launch.supervisor import SupervisorConfig
from test_launch import Launcher, assert_all_gone

# Like the real one: `-d` forks a detached daemon that writes its pid file
# and listens on <pipe>/control, `-f` serves in the foreground; with neither
# it passes one command from stdin to that socket: `quit` ends the daemon,
# which removes its pid file, and `exit N` ends it with code N. Rules in
# control.json: fail (message; -d exits 1), never_ready (pid file, no socket),
# ignore_quit, bind_on_cue (bind once bin/bind exists). Starts, commands,
# quits and (with -f) the moment before the bind go to calls.log.
CONTROL = r'''
import json, os, socket, sys, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
rules = json.loads((HERE / "control.json").read_text())
pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
logs = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
PID = pipe / "nvidia-cuda-mps-control.pid"

def record(*words):
    with open(HERE / "calls.log", "a") as f:
        f.write(" ".join(map(str, (repr(time.time()), *words))) + "\n")

def serve(foreground):
    if not foreground:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
    record("daemon", os.getpid(), pipe, logs)
    PID.write_text(f"{os.getpid()}\n")
    while rules.get("never_ready") or (rules.get("bind_on_cue") and not (HERE / "bind").exists()):
        time.sleep(0.02)
    (pipe / "control").unlink(missing_ok=True)  # one a killed daemon left
    if foreground:
        record("binding", os.getpid())
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(pipe / "control"))
        server.listen()
        (logs / "control.log").write_text("Starting control daemon\n")
        while True:
            conn, _ = server.accept()
            with conn, conn.makefile() as lines:
                command = lines.readline().strip()
            record("command", command)
            if command.startswith("exit "):
                os._exit(int(command.split()[1]))
            if command == "quit" and not rules.get("ignore_quit"):
                PID.unlink()
                record("quit", os.getpid())
                return

if sys.argv[1:] == ["-d"]:
    if "fail" in rules:
        sys.exit(rules["fail"])
    if os.fork() == 0:
        try:
            serve(foreground=False)
        finally:
            os._exit(0)
elif sys.argv[1:] == ["-f"]:
    serve(foreground=True)
else:
    command = sys.stdin.readline().strip()
    try:
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(pipe / "control"))
            client.sendall(command.encode() + b"\n")
    except OSError as exc:
        sys.exit(f"cannot reach the daemon: {exc}")
'''

PIPE, LOG, PERCENT = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PRIORITY = "CUDA_MPS_CLIENT_PRIORITY"
CLIENTS = frozenset({"encoder-0", "generator-0"})


def gone(pid: int) -> bool:
    """Exited (a zombie too: an orphaned daemon's parent is init, which here
    may never reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


class StandIn:
    """The stand-in control program in <tmp>/bin, first on PATH."""

    def __init__(self, folder: Path) -> None:
        self.bin = folder / "bin"
        self.bin.mkdir()
        self.program = self.bin / "nvidia-cuda-mps-control"
        self.program.write_text(f"#!{sys.executable}\n{CONTROL}")
        self.program.chmod(0o755)
        self.rules({})

    def rules(self, rules: dict) -> None:
        (self.bin / "control.json").write_text(json.dumps(rules))

    def calls(self) -> list[tuple[float, list[str]]]:
        log = self.bin / "calls.log"
        lines = log.read_text().splitlines() if log.exists() else []
        return [(float(line.split()[0]), line.split()[1:]) for line in lines]

    def daemons(self) -> list[int]:
        return [int(words[1]) for _, words in self.calls() if words[0] == "daemon"]

    def quits(self) -> dict[int, float]:
        return {int(words[1]): when for when, words in self.calls() if words[0] == "quit"}


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """Fails the test if a stand-in daemon outlives it (and kills that one)."""
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(PIPE, raising=False)
    control = StandIn(tmp_path)
    yield control
    alive = [pid for pid in control.daemons() if not gone(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"stand-in daemon(s) {alive} outlived the test"


def make_daemon(root: Path, lines: list[str], **kwargs) -> MpsDaemon:
    return MpsDaemon(MpsConfig(root, CLIENTS, **kwargs), lines.append)


def test_start_points_clients_at_the_daemon_and_stop_quits_it_and_removes_its_folder(stand_in, tmp_path):
    root, lines = tmp_path / "mps", []
    daemon = make_daemon(root, lines, encoder_sm_percent=30, encoders=frozenset({"encoder-0"}))
    assert daemon.env_for("encoder-0") == {}
    env = daemon.start()
    assert env == {PIPE: str(root / "pipe"), LOG: str(root / "log")}
    for folder in (root, root / "pipe", root / "log"):
        assert folder.stat().st_mode & 0o777 == 0o700
    (pid,) = stand_in.daemons()
    assert daemon.pid == pid and not gone(pid)
    assert stand_in.calls()[0][1] == ["daemon", str(pid), str(root / "pipe"), str(root / "log")]
    assert lines == [f"epd-launch: started the MPS control daemon (pipe {root / 'pipe'}, pid {pid}) "
                     "for encoder-0, generator-0"]
    assert daemon.env_for("encoder-0") == {**env, PERCENT: "30"}
    assert daemon.env_for("generator-0") == env
    assert daemon.env_for("proxy") == {}

    daemon.stop()
    assert list(stand_in.quits()) == [pid]
    assert gone(pid)
    assert not root.exists()
    assert lines[1:] == ["epd-launch: stopped the MPS control daemon"]
    assert daemon.env_for("encoder-0") == {}
    daemon.stop()  # idempotent: no second quit, no second line
    assert len(lines) == 2 and len(stand_in.calls()) == 3


def test_a_missing_control_program_is_named_and_nothing_is_made(stand_in, tmp_path):
    daemon = make_daemon(tmp_path / "mps", [], control="no-such-mps-control")
    with pytest.raises(MpsError, match=r"^no-such-mps-control: not found on PATH$"):
        daemon.start()
    assert not (tmp_path / "mps").exists()


def test_a_control_program_that_fails_leaves_nothing(stand_in, tmp_path):
    stand_in.rules({"fail": "stand-in: no MPS here"})
    with pytest.raises(MpsError) as caught:
        make_daemon(tmp_path / "mps", []).start()
    assert str(caught.value) == f"{stand_in.program} -d exited with code 1: stand-in: no MPS here"
    assert not (tmp_path / "mps").exists()
    assert stand_in.calls() == []


def test_a_daemon_never_ready_is_killed_and_its_folder_removed(stand_in, tmp_path):
    stand_in.rules({"never_ready": True})
    started = time.monotonic()
    with pytest.raises(MpsError, match=r"^the daemon was not ready within 1 s \(no control socket"):
        make_daemon(tmp_path / "mps", [], start_timeout=1.0).start()
    assert 1.0 <= time.monotonic() - started < 5.0
    (pid,) = stand_in.daemons()
    until(lambda: gone(pid), f"the half-started daemon {pid} to die", 10.0)
    assert not (tmp_path / "mps").exists()


def test_a_daemon_that_ignores_quit_is_killed_by_its_pid(stand_in, tmp_path):
    stand_in.rules({"ignore_quit": True})
    lines = []
    daemon = make_daemon(tmp_path / "mps", lines, stop_timeout=0.5)
    daemon.start()
    (pid,) = stand_in.daemons()
    daemon.stop()
    assert lines[1:] == [f"epd-launch: the MPS control daemon (pid {pid}) did not quit within 0.5 s; killed it",
                         "epd-launch: stopped the MPS control daemon"]
    until(lambda: gone(pid), f"the daemon {pid} to die", 10.0)
    assert not (tmp_path / "mps").exists()


def test_a_daemon_left_by_a_killed_launcher_is_quit_before_a_new_start(stand_in, tmp_path):
    root, lines = tmp_path / "mps", []
    make_daemon(root, []).start()  # never stopped, as if its launcher got SIGKILL
    (old,) = stand_in.daemons()
    daemon = make_daemon(root, lines)
    daemon.start()
    assert lines[0] == f"epd-launch: stopping the MPS control daemon left by an earlier run (pid {old})"
    assert list(stand_in.quits()) == [old] and gone(old)
    (_, new) = stand_in.daemons()
    assert new != old and daemon.pid == new and not gone(new)
    daemon.stop()
    assert gone(new) and not root.exists()


def test_the_operators_daemon_is_used_and_nothing_is_started_or_stopped(stand_in, tmp_path, monkeypatch):
    monkeypatch.setenv(PIPE, "/run/epd-mps/pipe")
    lines = []
    daemon = make_daemon(tmp_path / "mps", lines, encoder_sm_percent=25, encoder_below_normal=True,
                         encoders=frozenset({"encoder-0"}))
    assert daemon.start() == {}
    assert lines == ["epd-launch: using the operator's MPS control daemon "
                     "(CUDA_MPS_PIPE_DIRECTORY=/run/epd-mps/pipe)"]
    assert daemon.env_for("encoder-0") == {PERCENT: "25", PRIORITY: "1"}  # the pipe folder is inherited
    assert daemon.env_for("generator-0") == {}
    daemon.stop()
    assert len(lines) == 1 and stand_in.calls() == [] and not (tmp_path / "mps").exists()


def test_a_pipe_folder_too_long_for_a_socket_is_refused(stand_in, tmp_path):
    root = tmp_path / ("x" * 100)
    with pytest.raises(MpsError, match=r"too long for the daemon's UNIX sockets \(\d+ > 107 bytes\)"):
        make_daemon(root, []).start()
    assert not root.exists() and stand_in.calls() == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(encoder_sm_percent=0), r"MpsConfig\.encoder_sm_percent must be an integer in 1\.\.100 \(got 0\)"),
    (dict(encoder_sm_percent=101), r"encoder_sm_percent must be an integer in 1\.\.100 \(got 101\)"),
    (dict(encoder_sm_percent=True), r"encoder_sm_percent must be an integer in 1\.\.100 \(got True\)"),
    (dict(encoders=frozenset({"encoder-1"})),
     r"MpsConfig\.encoders must be clients too \(not in clients: encoder-1\)"),
    (dict(start_timeout=0), r"MpsConfig\.start_timeout must be > 0 \(got 0\)"),
    (dict(stop_timeout=float("nan")), r"MpsConfig\.stop_timeout must be > 0 \(got nan\)"),
])
def test_bad_config_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MpsConfig(Path("/tmp/mps"), CLIENTS, **kwargs)


def test_supervisor_config_refuses_clients_that_are_no_stage():
    stage = StageSpec("encoder", "encoder-0", "ipc:///tmp/e.sock", "cuda:0", ("true",), ())
    with pytest.raises(ValueError, match=r"SupervisorConfig\.mps\.clients names no stage: generator-0"):
        SupervisorConfig((stage,), "http://x/health", "http://x/v1", mps=MpsConfig(Path("/tmp/mps"), CLIENTS))


# ---- run by the supervisor, through test_launch.py's harness --------------------------------------

STARTED = (r"^epd-launch: started the MPS control daemon \(pipe (\S+), pid (\d+)\) "
           r"for encoder-0, generator-0, generator-1$")
STOPPED = "epd-launch: stopped the MPS control daemon"
MODEL_STAGES = ("encoder-0", "generator-0", "generator-1")


@pytest.fixture
def launch(tmp_path, stand_in):
    """Launchers with an MpsConfig for every model stage (torn down before
    `stand_in` checks that no daemon outlived the test)."""
    started = []

    def start(behaviour, required=False, sm_percent=None, **kwargs):
        mps = dict(required=required, sm_percent=sm_percent)
        started.append(Launcher(tmp_path, behaviour, mps=mps, **kwargs))
        return started[-1]

    yield start
    for launcher in started:
        launcher.kill()


def all_up(launcher: Launcher, stages: int = 4) -> None:
    """Every stage has started once (its pid file and environment written).
    "EPD ready" waits on the proxy alone: a test that kills the daemon
    before a stage's first start would find one start of it, not two."""
    launcher.wait_for(r"\| stand-in \S+ up$", count=stages)


def envs(launcher: Launcher, instance: str, count: int = 1) -> list[dict[str, str]]:
    """The environment of each start of `instance`, oldest first."""
    launcher.wait_for(rf"^{instance} +\| stand-in {instance} up$", count=count)
    dumps = sorted((launcher.folder / "pids").glob(f"{instance}.*"), key=lambda p: p.stat().st_mtime_ns)
    return [json.loads(p.read_text()) for p in dumps]


def mps_vars(env: dict[str, str]) -> dict[str, str | None]:
    return {name: env.get(name) for name in (PIPE, LOG, PERCENT)}


def assert_stopped_after_every_stage(launcher: Launcher, stand_in: StandIn, pid: int) -> None:
    root = launcher.folder / "run" / "mps"
    assert list(stand_in.quits()) == [pid]
    exits = [float(p.read_text()) for p in (launcher.folder / "stamps").glob("*.exit")]
    assert exits and all(stand_in.quits()[pid] >= when for when in exits)  # its clients went first
    assert gone(pid) and not root.exists()
    assert_all_gone(launcher.pids())


def test_every_client_start_gets_the_private_daemon_which_stops_after_the_stages(launch, stand_in, tmp_path):
    (tmp_path / "ready").touch()
    launcher = launch({"generator-1": {"exit_on": "cue"}}, sm_percent=30)
    launcher.wait_for("^EPD ready")
    (started,) = launcher.wait_for(STARTED)
    pipe, pid = re.match(STARTED, started).groups()
    root = tmp_path / "run" / "mps"
    assert pipe == str(root / "pipe") and stand_in.daemons() == [int(pid)]
    first_stage = next(i for i, line in enumerate(launcher.out) if line.startswith("epd-launch: started encoder"))
    assert launcher.out.index(started) < first_stage
    mps = {PIPE: pipe, LOG: str(root / "log")}
    assert [mps_vars(env) for env in envs(launcher, "encoder-0")] == [{**mps, PERCENT: "30"}]
    for generator in ("generator-0", "generator-1"):
        assert [mps_vars(env) for env in envs(launcher, generator)] == [{**mps, PERCENT: None}]
    assert [mps_vars(env) for env in envs(launcher, "proxy")] == [{PIPE: None, LOG: None, PERCENT: None}]

    (tmp_path / "cue").touch()
    launcher.wait_for(r"generator-1 exited with code 3; restarting in 0\.2 s")
    restarted = envs(launcher, "generator-1", count=2)[1]
    assert mps_vars(restarted) == {**mps, PERCENT: None}
    assert stand_in.daemons() == [int(pid)]  # one daemon per run, restarts included

    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.finish() == 0, launcher.err
    assert launcher.out[-1] == STOPPED
    assert_stopped_after_every_stage(launcher, stand_in, int(pid))


@pytest.mark.parametrize("behaviour, error", [
    ({"generator-0": {"exit": 4}}, "generator-0 exited with code 4 before the server was ready"),
    ({"generator-0": {"exit_after_ready": 3}},
     "generator-0 exited with code 3 after 1 restart(s) in the last 60 s; giving up"),
], ids=["fails-before-ready", "keeps-dying"])
def test_a_box_that_fails_stops_the_daemon_too(launch, stand_in, tmp_path, behaviour, error):
    if "exit_after_ready" in behaviour["generator-0"]:  # else never: the proxy must not beat the failure
        (tmp_path / "ready").touch()
    launcher = launch(behaviour, max_restarts=1)
    assert launcher.finish() == 1
    assert launcher.err[-1] == f"epd-launch: error: {error}"
    assert launcher.out[-1] == STOPPED
    (pid,) = stand_in.daemons()
    assert_stopped_after_every_stage(launcher, stand_in, pid)


def test_a_required_daemon_that_cannot_start_stops_the_launch_before_any_stage(launch, stand_in, tmp_path):
    stand_in.rules({"fail": "stand-in: no MPS here"})
    launcher = launch({}, required=True)
    assert launcher.finish() == 1
    assert launcher.err == [f"epd-launch: error: MPS is required (--mps on) but could not start: "
                            f"{stand_in.program} -d exited with code 1: stand-in: no MPS here"]
    assert launcher.pids() == []
    assert not any(line.startswith("epd-launch: started") for line in launcher.out)
    assert not (tmp_path / "run" / "mps").exists()


def test_an_auto_daemon_that_cannot_start_warns_and_the_stages_run_without_it(launch, stand_in, tmp_path):
    stand_in.rules({"fail": "stand-in: no MPS here"})
    (tmp_path / "ready").touch()
    launcher = launch({}, sm_percent=30)
    launcher.wait_for("^EPD ready")
    assert (f"epd-launch: warning: MPS could not start ({stand_in.program} -d exited with code 1: stand-in: "
            "no MPS here); the stages sharing cuda:0 will time-slice it") in launcher.out
    for instance in (*MODEL_STAGES, "proxy"):
        assert [mps_vars(env) for env in envs(launcher, instance)] == [{PIPE: None, LOG: None, PERCENT: None}]
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.finish() == 0, launcher.err
    assert STOPPED not in launcher.out and not (tmp_path / "run" / "mps").exists()
    assert_all_gone(launcher.pids())


def test_the_operators_daemon_is_inherited_and_left_alone(launch, stand_in, tmp_path):
    (tmp_path / "ready").touch()
    operator = str(tmp_path / "operator-pipe")
    launcher = launch({}, sm_percent=30, env={PIPE: operator})
    launcher.wait_for("^EPD ready")
    assert (f"epd-launch: using the operator's MPS control daemon (CUDA_MPS_PIPE_DIRECTORY={operator})"
            in launcher.out)
    for instance in MODEL_STAGES:
        (env,) = envs(launcher, instance)
        assert env[PIPE] == operator and env.get(PERCENT) == ("30" if instance == "encoder-0" else None)
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.finish() == 0, launcher.err
    assert stand_in.calls() == [] and STOPPED not in launcher.out and not (tmp_path / "run" / "mps").exists()
    assert_all_gone(launcher.pids())
