"""Running a planned box: one OS process per stage, readiness through the
proxy's /health, restarts with backoff, and a clean stop.

Children stay in the launcher's process group (no setsid), so Ctrl-C in a
terminal and systemd's control group reach them too; the launcher still
stops them itself and reaps every one. Each child's output goes to the
launcher's stdout prefixed with its instance name, or to
`<log_dir>/<instance>.log`. With `mps` set, a private MPS control daemon
(pipeline/launch/mps.py) runs from before the first stage until after the
last has been reaped; should it (or the operator's) die, its clients are
restarted under a daemon again (mps_watch.py).
"""

from __future__ import annotations

import os
import shlex
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pipeline.arena.shm import remove_stale_segments
from pipeline.launch.mps import MpsConfig, MpsDaemon, MpsError
from pipeline.launch.mps_watch import MpsWatch
from pipeline.launch.plan import StageSpec, prefill_signal_file
from pipeline.launch.sd_notify import Notifier
from pipeline.launcher_watch import LAUNCHER_PID_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
RESTART_WINDOW_S = 60.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StageFailed(RuntimeError):
    """The box cannot be kept up; the message is one line naming the stage."""


@dataclass(frozen=True)
class SupervisorConfig:
    stages: tuple[StageSpec, ...]
    health_url: str  # polled until it answers 200
    ready_url: str  # printed as "EPD ready: <ready_url>"
    ready_timeout: float = 180.0
    stop_timeout: float = 15.0  # SIGTERM -> SIGKILL
    log_dir: Path | None = None
    # The proxy stops first and lets the requests in flight finish within
    # this (its own --drain-timeout) while the model stages still serve them.
    drain_timeout: float = 30.0
    max_restarts_per_minute: int = 5  # per stage; one more exit stops the box
    restart_backoff: float = 1.0  # first delay; doubles with each recent restart
    max_backoff: float = 30.0
    poll_interval: float = 0.2
    # Test hook: role -> program that replaces `python -m stages.<role>`; the
    # stage's planned flags follow it unchanged. Empty in production.
    commands: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    mps: MpsConfig | None = None  # None: no daemon is started and no stage is pointed at one

    def __post_init__(self) -> None:
        for name in ("ready_timeout", "stop_timeout", "restart_backoff", "max_backoff", "poll_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SupervisorConfig.{name} must be > 0 (got {getattr(self, name)})")
        if self.drain_timeout < 0:
            raise ValueError(f"SupervisorConfig.drain_timeout must be >= 0 (got {self.drain_timeout})")
        if self.max_restarts_per_minute < 0:
            raise ValueError("SupervisorConfig.max_restarts_per_minute must be >= 0")
        if len({s.instance for s in self.stages}) != len(self.stages):
            raise ValueError("SupervisorConfig.stages: instance names must be unique")
        unknown = sorted(self.mps.clients - {s.instance for s in self.stages}) if self.mps else []
        if unknown:
            raise ValueError(f"SupervisorConfig.mps.clients names no stage: {', '.join(unknown)}")


@dataclass
class _Stage:
    """Run-time state of one planned stage (mutable; owned by the loop)."""

    spec: StageSpec
    proc: subprocess.Popen | None = None
    restarts: deque[float] = field(default_factory=deque)  # monotonic times of recent restarts
    restart_at: float | None = None


def run_supervisor(config: SupervisorConfig, out: IO[str] | None = None, notify: Notifier | None = None) -> int:
    """Run until SIGINT/SIGTERM/SIGHUP: 0 after a clean stop, 1 (with one
    line on stderr) when a stage fails to start or keeps dying."""
    stop, hurry = threading.Event(), threading.Event()

    def on_signal(*_) -> None:
        # The first asks for a stop with a drain; a second (Ctrl-C again) cuts the drain short.
        (hurry if stop.is_set() else stop).set()

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        Supervisor(config, out or sys.stdout, hurry, notify).run(stop)
    except StageFailed as exc:
        print(f"epd-launch: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


class Supervisor:
    def __init__(self, config: SupervisorConfig, out: IO[str], hurry: threading.Event | None = None,
                 notify: Notifier | None = None) -> None:
        self.config = config
        self.notify = notify or Notifier()   # systemd (sd_notify.py); does nothing outside it
        self.out = out
        self.hurry = hurry or threading.Event()  # set: stop without waiting for the drain
        self.lock = threading.Lock()  # one writer at a time on `out`
        self.stages = [_Stage(spec) for spec in config.stages]
        self.pumps: list[threading.Thread] = []
        self.width = max((len(s.instance) for s in config.stages), default=0)
        self.mps = MpsDaemon(config.mps, self._write) if config.mps else None
        self.mps_watch = MpsWatch(self.mps, self._write, _time_slicing(config.mps.shared)) if config.mps else None

    def run(self, stop: threading.Event) -> None:
        """Start, wait until ready, keep up until `stop`; always stops and
        reaps every child on the way out, then the MPS daemon."""
        try:
            self._start_mps()
            for stage in self.stages:
                self._start(stage)
            self.notify.status(f"loading: {len(self.stages)} stages started, waiting for {self.config.health_url}")
            if self._wait_ready(stop):
                self._write(f"EPD ready: {self.config.ready_url}")
                self.notify.ready(f"serving on {self.config.ready_url}")
                self._watch(stop)
        finally:
            try:
                self.notify.stopping("stopping: the proxy drains the requests in flight, then every stage stops")
                self._stop_all()
            finally:
                if self.mps is not None:
                    self.mps.stop()  # only now: `quit` waits for the clients still attached

    def _start_mps(self) -> None:
        if self.mps is None:
            return
        try:
            self.mps.start()
        except MpsError as exc:
            if self.mps.config.required:
                raise StageFailed(f"MPS is required (--mps on) but could not start: {exc}") from None
            self._write(f"epd-launch: warning: MPS could not start ({exc}); "
                        f"{_time_slicing(self.mps.config.shared)}")

    def _wait_ready(self, stop: threading.Event) -> bool:
        """True once /health answers 200; False when asked to stop first."""
        deadline = time.monotonic() + self.config.ready_timeout
        last = "no answer"
        while not stop.is_set():
            self.notify.tick()
            for stage in self.stages:
                code = stage.proc.poll()
                if code is not None and not stop.is_set():
                    raise StageFailed(f"{stage.spec.instance} {_exit_text(code)} before the server was "
                                      f"ready{self._log_hint(stage.spec)}")
            status = _health_status(self.config.health_url)
            if status == 200:
                return True
            last = "no answer" if status is None else f"HTTP {status}"
            if time.monotonic() >= deadline:
                raise StageFailed(f"timed out: the proxy's {self.config.health_url} did not answer 200 within "
                                  f"{self.config.ready_timeout:g} s (last: {last})")
            stop.wait(self.config.poll_interval)
        return False

    def _watch(self, stop: threading.Event) -> None:
        while not stop.wait(self.config.poll_interval):
            self.notify.tick()   # from this loop only: if it hangs, the pings stop and systemd acts
            now = time.monotonic()
            if self.mps_watch is not None:
                try:
                    self.mps_watch.tick(now, self._kill_mps_clients)
                except MpsError as exc:  # required, and no daemon to be had
                    raise StageFailed(str(exc)) from None
            for stage in self.stages:
                if stage.proc is not None and (code := stage.proc.poll()) is not None:
                    if stop.is_set():  # it saw the same Ctrl-C we did
                        return
                    self._schedule_restart(stage, code, now)
                elif stage.restart_at is not None and now >= stage.restart_at and not self._held(stage):
                    self._start(stage)
                    self.notify.status(f"serving on {self.config.ready_url}; {stage.spec.instance} restarted")

    def _kill_mps_clients(self) -> list[str]:
        """Kill the MPS clients still up (their CUDA contexts died with the
        daemon's server); the watch loop restarts them. Their names."""
        clients = [s for s in self.stages if s.spec.instance in self.mps.config.clients
                   and s.proc is not None and s.proc.poll() is None]
        for stage in clients:
            stage.proc.kill()
        return [s.spec.instance for s in clients]

    def _schedule_restart(self, stage: _Stage, code: int, now: float) -> None:
        stage.proc = None
        while stage.restarts and now - stage.restarts[0] > RESTART_WINDOW_S:
            stage.restarts.popleft()
        name = stage.spec.instance
        if len(stage.restarts) >= self.config.max_restarts_per_minute:
            raise StageFailed(f"{name} {_exit_text(code)} after {len(stage.restarts)} restart(s) in the "
                              f"last {RESTART_WINDOW_S:g} s; giving up{self._log_hint(stage.spec)}")
        delay = min(self.config.max_backoff, self.config.restart_backoff * 2 ** len(stage.restarts))
        stage.restarts.append(now)
        stage.restart_at = now + delay
        line = (f"{name} {_exit_text(code)}; restarting in {delay:g} s "
                f"(restart {len(stage.restarts)} in the last {RESTART_WINDOW_S:g} s)")
        self._write(f"epd-launch: {line}")
        self.notify.status(f"serving, degraded: {line}")

    def _start(self, stage: _Stage) -> None:
        spec = stage.spec
        argv = [*self.config.commands.get(spec.role, spec.program), *spec.args]
        log = self._open_log(spec, argv)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                    stdout=log if log else subprocess.PIPE, stderr=subprocess.STDOUT,
                                    env=_child_env({**spec.env, **self._mps_env(spec)}), close_fds=True)
        except OSError as exc:
            raise StageFailed(f"cannot start {spec.instance} ({argv[0]}): {exc.strerror or exc}") from None
        finally:
            if log:
                log.close()  # the child holds its own descriptor
        stage.proc, stage.restart_at = proc, None
        self._write(f"epd-launch: started {spec.instance} (pid {proc.pid}, {spec.device}): {shlex.join(argv)}")
        if proc.stdout is not None:
            pump = threading.Thread(target=self._pump, args=(proc.stdout, spec.instance),
                                    name=f"output-{spec.instance}", daemon=True)
            pump.start()
            self.pumps = [p for p in self.pumps if p.is_alive()] + [pump]

    def _held(self, stage: _Stage) -> bool:
        """An MPS client whose restart waits for the operator's daemon to be back."""
        return (self.mps_watch is not None and self.mps_watch.holding()
                and stage.spec.instance in self.mps.config.clients)

    def _mps_env(self, spec: StageSpec) -> dict[str, str]:
        return self.mps.env_for(spec.instance) if self.mps is not None else {}

    def _open_log(self, spec: StageSpec, argv: list[str]) -> IO[bytes] | None:
        if self.config.log_dir is None:
            return None
        log = open(self.config.log_dir / f"{spec.instance}.log", "ab")
        log.write(f"--- epd-launch {time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(argv)}\n".encode())
        log.flush()
        return log

    def _pump(self, stream: IO[bytes], instance: str) -> None:
        prefix = instance.ljust(self.width)
        with stream:
            for raw in iter(stream.readline, b""):
                self._write(f"{prefix} | {raw.decode('utf-8', 'replace').rstrip()}")

    def _write(self, line: str) -> None:
        with self.lock:
            self.out.write(line + "\n")
            self.out.flush()

    def _stop_all(self) -> None:
        """Stop the proxy, then the model stages (SIGTERM, SIGKILL whoever
        outlives its time), reap all, then remove what the dead left behind
        (shm segments, socket files, prefill signal files). The proxy goes first so that the
        requests it drains still have their encoders and generators."""
        front = [s for s in self.stages if s.spec.role == "proxy"]
        self._terminate(front, self.config.drain_timeout + self.config.stop_timeout, draining=True)
        self._terminate([s for s in self.stages if s.spec.role != "proxy"], self.config.stop_timeout)
        for stage in self.stages:
            # A SIGKILLed encoder cannot unlink its arena; the instance name finds it.
            removed = remove_stale_segments(stage.spec.instance)
            if removed:
                self._write(f"epd-launch: removed shared memory left by {stage.spec.instance}: "
                            f"{', '.join(removed)}")
            if stage.spec.address.startswith("ipc://"):
                Path(stage.spec.address[len("ipc://"):]).unlink(missing_ok=True)
            signal_file = prefill_signal_file(stage.spec)
            if signal_file is not None:
                signal_file.unlink(missing_ok=True)
        for pump in self.pumps:
            pump.join(timeout=2.0)  # a grandchild may still hold the pipe; never hang on it

    def _terminate(self, stages: list[_Stage], timeout: float, draining: bool = False) -> None:
        """SIGTERM, then SIGKILL whoever outlives `timeout`, or (`draining`)
        is still up once a second stop signal has set `hurry`."""
        running = [s for s in stages if s.proc is not None and s.proc.poll() is None]
        for stage in running:
            stage.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        cut_short = False
        while any(s.proc.poll() is None for s in running) and time.monotonic() < deadline:
            if draining and self.hurry.is_set():
                cut_short = True
                self._write("epd-launch: asked to stop again: not waiting for the requests in flight")
                break
            time.sleep(min(self.config.poll_interval, max(0.0, deadline - time.monotonic())))
        for stage in running:
            if stage.proc.poll() is None:
                if not cut_short:
                    self._write(f"epd-launch: {stage.spec.instance} did not stop within {timeout:g} s; killing it")
                stage.proc.kill()
            stage.proc.wait()

    def _log_hint(self, spec: StageSpec) -> str:
        if self.config.log_dir is None:
            return ""
        return f" (log: {self.config.log_dir / (spec.instance + '.log')})"


def _child_env(overrides: Mapping[str, str]) -> dict[str, str]:
    env = {**os.environ, **overrides}
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(name, None)   # systemd hears from the launcher alone
    # Lines reach the prefixing pump as they are printed, not at exit.
    env["PYTHONUNBUFFERED"] = "1"
    # A stage that outlives this launcher (killed) drains and stops (pipeline/launcher_watch.py).
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    # `python -m stages.<role>` must resolve from any working directory.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def _time_slicing(shared: tuple[str, ...]) -> str:
    if not shared:
        return "the stages sharing a GPU will time-slice it"
    return f"the stages sharing {', '.join(shared)} will time-slice {'it' if len(shared) == 1 else 'them'}"


def _health_status(url: str) -> int | None:
    """The HTTP status of a GET, or None when nothing answers."""
    # An empty ProxyHandler: an http_proxy in the environment must not carry
    # a loopback health check elsewhere.
    # Over HTTPS the certificate goes unchecked: this is our own proxy on
    # loopback, whose certificate names the host clients use.
    unchecked = ssl.create_default_context()
    unchecked.check_hostname, unchecked.verify_mode = False, ssl.CERT_NONE
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=unchecked))
    try:
        with opener.open(url, timeout=2.0) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
