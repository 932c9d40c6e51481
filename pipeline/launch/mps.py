"""A private NVIDIA MPS control daemon for the stages that share a GPU.

Without MPS, CUDA processes on one GPU time-slice it; under one control
daemon their kernels overlap. The supervisor starts the daemon before the
first stage, points every CUDA stage at it (CUDA_MPS_PIPE_DIRECTORY) and
quits it after the last stage has exited.

What this relies on, from NVIDIA's MPS documentation (and what daemons in
the field leave in their pipe folder):
- `nvidia-cuda-mps-control -d` forks the daemon and returns; the daemon and
  its clients meet in CUDA_MPS_PIPE_DIRECTORY, and it writes control.log
  and server.log to CUDA_MPS_LOG_DIRECTORY. `-f` runs the same daemon in
  the foreground instead (systemd's epd-mps unit: mps_service.py).
- The daemon writes its pid to `<pipe>/nvidia-cuda-mps-control.pid` and
  listens on the UNIX socket `<pipe>/control` (beside it: control_lock,
  control_privileged, log). It is ready once both are there and the pid is
  alive.
- `echo quit | nvidia-cuda-mps-control`, with the same pipe folder, tells
  it to shut down its servers and exit; it waits for the clients still
  attached, which is why the stages must be gone first.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pipeline.arena.shm import pid_alive
from pipeline.launcher_watch import LAUNCHER_PID_ENV

PIPE_VAR = "CUDA_MPS_PIPE_DIRECTORY"
LOG_VAR = "CUDA_MPS_LOG_DIRECTORY"
SM_PERCENT_VAR = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PRIORITY_VAR = "CUDA_MPS_CLIENT_PRIORITY"   # 0 normal, 1 below normal
PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_SOCKET = "control"
LONGEST_SOCKET = "control_privileged"  # the longest name the daemon binds in the pipe folder
SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes, the NUL included
POLL_S = 0.05


class MpsError(RuntimeError):
    """The private daemon could not start (or an earlier one is in the way);
    the message is one line."""


@dataclass(frozen=True)
class MpsConfig:
    root: Path  # the private daemon's folder; pipe/ and log/ inside, all 0700, removed on stop
    clients: frozenset[str]  # instances pointed at the daemon: every CUDA stage
    required: bool = False  # True: no daemon, no launch; False: a warning, and on without MPS
    encoder_sm_percent: int | None = None  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for `encoders`
    encoder_below_normal: bool = False  # CUDA_MPS_CLIENT_PRIORITY=1 for `encoders`
    encoders: frozenset[str] = frozenset()
    control: str = "nvidia-cuda-mps-control"  # looked up on PATH
    start_timeout: float = 10.0  # `-d` until ready
    shared: tuple[str, ...] = ()  # the GPUs stages share, for the warning only
    stop_timeout: float = 10.0  # `quit` until the daemon has exited; then SIGKILL
    operator_wait: float = 60.0  # the operator's daemon gone: how long its clients' restarts wait for it (mps_watch.py)

    def __post_init__(self) -> None:
        percent = self.encoder_sm_percent
        if percent is not None and (isinstance(percent, bool) or not isinstance(percent, int)
                                    or not 1 <= percent <= 100):
            raise ValueError(f"MpsConfig.encoder_sm_percent must be an integer in 1..100 (got {percent!r})")
        for name in ("start_timeout", "stop_timeout", "operator_wait"):
            if not getattr(self, name) > 0:  # also false for nan
                raise ValueError(f"MpsConfig.{name} must be > 0 (got {getattr(self, name)})")
        if not self.control:
            raise ValueError("MpsConfig.control must name a program")
        stray = sorted(self.encoders - self.clients)
        if stray:
            raise ValueError(f"MpsConfig.encoders must be clients too (not in clients: {', '.join(stray)})")


class MpsDaemon:
    """One private control daemon: `start` before the first client, `stop`
    after the last has exited. When the launcher's environment already names
    a daemon (CUDA_MPS_PIPE_DIRECTORY, e.g. systemd's epd-mps unit), that one
    is used: nothing is started or stopped, and the children inherit the
    variable. `write` takes the one-line log messages."""

    def __init__(self, config: MpsConfig, write: Callable[[str], None]) -> None:
        self.config = config
        self.write = write
        self.pipe = config.root / "pipe"
        self.logs = config.root / "log"
        self.pid: int | None = None  # the daemon's (ours, or the operator's when its pid file names a live one)
        self.operator: Path | None = None  # the operator's pipe folder, when that daemon is used
        self.client_env: dict[str, str] | None = None  # None: the stages run without MPS
        self._program: str | None = None  # set while we own a running daemon
        self._keeper: subprocess.Popen | None = None  # quits it should this launcher be killed

    def start(self) -> dict[str, str]:
        """The variables a client needs (empty for the operator's daemon,
        which the children inherit). Raises MpsError, having removed what it made."""
        if self.client_env is not None:
            raise RuntimeError("MpsDaemon.start called twice")
        operator = os.environ.get(PIPE_VAR)
        if operator is not None:
            self.operator = Path(operator)
            self.pid = self.operator_back()  # None: no readable pid file, nothing to watch
            self.write(f"epd-launch: using the operator's MPS control daemon ({PIPE_VAR}={operator})")
            self.client_env = {}
            return {}
        program = shutil.which(self.config.control)
        if program is None:
            raise MpsError(f"{self.config.control}: not found on PATH")
        self._check_socket_path()
        return self._launch(program)

    def lost(self) -> bool:
        """True once the daemon we started has died (killed, crashed). Its
        server goes with it, and with that every client's CUDA context: on an
        H100, SIGKILL of the control daemon ended both stages' next GPU call
        (docs/reliability.md). The operator's is watched through its pid file."""
        watched = self._program is not None or self.operator is not None
        return watched and self.pid is not None and not daemon_alive(self.pid)

    def operator_back(self) -> int | None:
        """The pid of a daemon that answers in the operator's pipe folder (a
        live pid in its pid file, and its control socket), else None."""
        if self.operator is None:
            return None
        pid = read_pid(self.operator / PID_FILE)
        if pid is None or not daemon_alive(pid) or not (self.operator / CONTROL_SOCKET).exists():
            return None
        self.pid = pid
        return pid

    def forget(self) -> None:
        """The operator's daemon is gone: watched again once `operator_back` finds one."""
        self.pid = None

    def restart(self) -> dict[str, str]:
        """After `lost`: a new daemon in the same folders (the dead one's pid
        file and sockets are cleared first), with a new keeper. Raises
        MpsError as `start` does; the stages then run without MPS."""
        program = self._program
        if program is None or not self.lost():
            raise RuntimeError("MpsDaemon.restart is for a daemon of ours that is gone")
        self._stop_keeper()  # it watched the dead pid, and has likely ended already
        self._program, self.pid, self.client_env = None, None, None
        return self._launch(program)

    def _launch(self, program: str) -> dict[str, str]:
        deadline = time.monotonic() + self.config.start_timeout
        with run_folder_lock(self.config.root):  # against a keeper of a killed launcher (mps_keeper.py)
            self._clear_leftover(program, deadline)
            self._make_folders()
            try:
                self._run_daemon_mode(program, deadline)
                self._wait_ready(deadline)
            except BaseException:
                self._abandon()
                raise
        self._program = program
        self._start_keeper(program)
        self.client_env = {PIPE_VAR: str(self.pipe), LOG_VAR: str(self.logs)}
        self.write(f"epd-launch: started the MPS control daemon (pipe {self.pipe}, pid {self.pid}) "
                   f"for {', '.join(sorted(self.config.clients))}")
        return dict(self.client_env)

    def env_for(self, instance: str) -> dict[str, str]:
        """What to add to one stage's environment on each (re)start."""
        if self.client_env is None or instance not in self.config.clients:
            return {}
        env = dict(self.client_env)
        if instance in self.config.encoders and self.config.encoder_sm_percent is not None:
            env[SM_PERCENT_VAR] = str(self.config.encoder_sm_percent)
        if instance in self.config.encoders and self.config.encoder_below_normal:
            env[PRIORITY_VAR] = "1"
        return env

    def stop(self) -> None:
        """Quit our daemon, kill it if it does not exit in time, remove the
        folder. Idempotent; does nothing for the operator's daemon."""
        self.client_env = None
        program, self._program = self._program, None
        if program is None:
            return
        self._stop_keeper()
        deadline = time.monotonic() + self.config.stop_timeout
        why = send_quit(program, self._env(), deadline)
        if self.pid is not None and not wait_exit(self.pid, deadline):
            kill_pid(self.pid)
            self.write(f"epd-launch: the MPS control daemon (pid {self.pid}) did not quit within "
                       f"{self.config.stop_timeout:g} s{why}; killed it")
        self.pid = None
        self._remove_root()
        self.write("epd-launch: stopped the MPS control daemon")

    def _start_keeper(self, program: str) -> None:
        # A session of its own, as the daemon's: a Ctrl-C or a kill of the
        # launcher's process group must not take it too.
        package_root = str(Path(__file__).resolve().parents[2])
        env = {k: v for k, v in os.environ.items() if k != LAUNCHER_PID_ENV}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        try:
            self._keeper = subprocess.Popen(
                [sys.executable, "-m", "pipeline.launch.mps_keeper", "--launcher", str(os.getpid()),
                 "--root", str(self.config.root), "--program", program, "--daemon", str(self.pid),
                 "--stop-timeout", str(self.config.stop_timeout)],
                stdin=subprocess.DEVNULL, env=env, close_fds=True, start_new_session=True)
        except OSError as exc:
            self.write(f"epd-launch: warning: cannot start the MPS keeper ({exc.strerror or exc}); "
                       "should this launcher be killed, its daemon stays up until the next launch")

    def _stop_keeper(self) -> None:
        keeper, self._keeper = self._keeper, None
        if keeper is None:
            return
        keeper.terminate()
        try:
            keeper.wait(timeout=self.config.stop_timeout)
        except subprocess.TimeoutExpired:
            keeper.kill()
            keeper.wait()

    def _check_socket_path(self) -> None:
        length = len(os.fsencode(self.pipe / LONGEST_SOCKET))
        if length > SUN_PATH_MAX:
            raise MpsError(f"the pipe folder {self.pipe} is too long for the daemon's UNIX sockets "
                           f"({length} > {SUN_PATH_MAX} bytes); choose a shorter run folder (EPD_RUN_DIR)")

    def _clear_leftover(self, program: str, deadline: float) -> None:
        """A launcher that was SIGKILLed leaves its folder, maybe with its
        daemon still up; quit that one (same pipe folder) and start afresh."""
        if not self.config.root.exists():
            return
        pid = read_pid(self.pipe / PID_FILE)
        if pid is not None and daemon_alive(pid):
            self.write(f"epd-launch: stopping the MPS control daemon left by an earlier run (pid {pid})")
            why = send_quit(program, self._env(), deadline)
            # Not killed by pid: the file may be stale and the number reused.
            if not wait_exit(pid, deadline):
                raise MpsError(f"the MPS control daemon left by an earlier run (pid {pid}, pipe {self.pipe}) "
                               f"did not quit{why}; stop it and remove {self.config.root}")
        self._remove_root()

    def _make_folders(self) -> None:
        try:
            for folder in (self.config.root, self.pipe, self.logs):
                folder.mkdir(mode=0o700)
                folder.chmod(0o700)  # whatever the umask
        except OSError as exc:
            self._remove_root()
            raise MpsError(f"cannot make {exc.filename}: {exc.strerror or exc}") from None

    def _run_daemon_mode(self, program: str, deadline: float) -> None:
        # A new session: Ctrl-C in the terminal reaches the stages but not
        # the daemon, which must outlive them and be quit by us.
        with tempfile.TemporaryFile() as output:  # not a pipe: the forked daemon may keep it open
            try:
                proc = subprocess.Popen([program, "-d"], stdin=subprocess.DEVNULL, stdout=output,
                                        stderr=subprocess.STDOUT, env=self._env(), close_fds=True,
                                        start_new_session=True)
            except OSError as exc:
                raise MpsError(f"cannot run {program}: {exc.strerror or exc}") from None
            try:
                code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise MpsError(f"{program} -d did not return within {self.config.start_timeout:g} s") from None
            if code != 0:
                raise MpsError(f"{program} -d exited with code {code}{_last_line(output)}")

    def _wait_ready(self, deadline: float) -> None:
        while True:
            pid = read_pid(self.pipe / PID_FILE)
            if pid is not None:
                self.pid = pid  # known from here on, so that a failed start can kill it
                if not daemon_alive(pid):
                    raise MpsError(f"the daemon (pid {pid}) exited right after starting{log_tail(self.logs)}")
                if (self.pipe / CONTROL_SOCKET).exists():
                    return
            if time.monotonic() >= deadline:
                raise MpsError(f"the daemon was not ready within {self.config.start_timeout:g} s (no "
                               f"{CONTROL_SOCKET} socket and live pid in {self.pipe / PID_FILE})"
                               f"{log_tail(self.logs)}")
            time.sleep(POLL_S)

    def _abandon(self) -> None:
        """Undo a failed start: no client uses the half-started daemon yet."""
        if self.pid is not None and daemon_alive(self.pid):
            kill_pid(self.pid)
        self.pid = None
        self._remove_root()

    def _env(self) -> dict[str, str]:
        return {**os.environ, PIPE_VAR: str(self.pipe), LOG_VAR: str(self.logs)}

    def _remove_root(self) -> None:
        try:
            shutil.rmtree(self.config.root)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.write(f"epd-launch: warning: cannot remove {self.config.root}: {exc.strerror or exc}")


@contextmanager
def run_folder_lock(root: Path) -> Iterator[None]:
    """An flock on the daemon folder's parent (the launcher's run folder),
    held by a launcher and by a killed launcher's keeper while they quit,
    remove, make or start a daemon in `root`. No lock file is left."""
    try:
        fd = os.open(root.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise MpsError(f"cannot open {root.parent}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def send_quit(program: str, env: dict[str, str], deadline: float) -> str:
    """Pass `quit` to the daemon whose pipe folder `env` names: '' once the
    control program has taken it; else why not, as a clause for a log line."""
    try:
        done = subprocess.run([program], input=b"quit\n", stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=env, start_new_session=True,
                              timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return f" ({program} did not take the quit in time)"
    except OSError as exc:
        return f" (cannot run {program}: {exc.strerror or exc})"
    if done.returncode != 0:
        lines = done.stdout.decode("utf-8", "replace").strip().splitlines()
        return f" ({program} exited with code {done.returncode}{': ' + lines[-1] if lines else ''})"
    return ""


def log_tail(logs: Path) -> str:
    """The last line of the daemon's control.log in `logs`, as a clause."""
    try:
        lines = (logs / "control.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return f" (control.log: {lines[-1]})" if lines else ""


def read_pid(path: Path) -> int | None:
    """None while the file is missing or half written."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def daemon_alive(pid: int) -> bool:
    """A zombie counts as gone: the daemon is reparented to init, which in
    a container may never reap it."""
    if not pid_alive(pid):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_exit(pid: int, deadline: float) -> bool:
    while daemon_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _last_line(output: IO[bytes]) -> str:
    output.seek(0)
    lines = output.read().decode("utf-8", "replace").strip().splitlines()
    return f": {lines[-1]}" if lines else ""
