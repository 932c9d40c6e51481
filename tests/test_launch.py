"""The launcher's supervisor, driving stand-in stages (a tiny script per
role; the "proxy" serves /health) in a launcher process of its own, so
signals to it never reach pytest. test_mps.py drives the same harness with
an MpsConfig."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO
from waiting import until

STAND_IN = r'''
import json, os, signal, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).parent
role, flags = sys.argv[1], sys.argv[2:]
def flag(name):
    return flags[flags.index(name) + 1] if name in flags else None
instance = flag("--instance") or role
(HERE / "pids" / f"{instance}.{os.getpid()}").write_text(json.dumps(dict(os.environ)))  # for test_mps
rules = json.loads((HERE / "behaviour.json").read_text()).get(instance, {})
print(f"stand-in {instance} up", flush=True)
if "exit" in rules:
    sys.exit(rules["exit"])
if rules.get("shm"):  # like an arena that only a clean stop removes
    Path(f"/dev/shm/epd-{instance}-{os.getpid()}-arena").write_bytes(b"x")
if flag("--prefill-signal"):  # like a generator's signal file (pipeline/prefill_signal.py)
    Path(flag("--prefill-signal")).write_bytes(b"\0")
def on_term(*_):  # stamps when SIGTERM came and when it exits; a "drain" first
    (HERE / "stamps" / f"{instance}.term").write_text(repr(time.time()))
    time.sleep(rules.get("drain", 0))
    (HERE / "stamps" / f"{instance}.exit").write_text(repr(time.time()))
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if rules.get("ignore_term") else on_term)
if role == "proxy":
    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/health" and (HERE / "ready").exists()
            with open(HERE / "health_answers", "a") as answers:  # what the launcher was told, for the tests
                answers.write(f"{200 if ok else 503}\n")
            self.send_response(200 if ok else 503)
            self.end_headers()
        def log_message(self, *args):
            pass
    ThreadingHTTPServer((flag("--host"), int(flag("--port"))), Health).serve_forever(0.05)
while True:
    if "exit_on" in rules and (HERE / rules["exit_on"]).exists():  # once: the cue file goes
        (HERE / rules["exit_on"]).unlink()
        sys.exit(3)
    if "exit_after_ready" in rules and (HERE / "ready").exists():
        time.sleep(0.3)
        sys.exit(rules["exit_after_ready"])
    time.sleep(0.05)
'''

DRIVER = r'''
import json, sys
from dataclasses import replace
from pathlib import Path
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["repo"])
from pipeline.launch.mps import MpsConfig
from pipeline.launch.plan import HostFacts, LaunchOptions, http_url, plan_stages
from pipeline.launch.supervisor import SupervisorConfig, run_supervisor

here = Path(cfg["dir"])
options = LaunchOptions(cfg["encoders"], cfg["generators"], here / "run", port=cfg["port"])
specs = plan_stages(options, HostFacts(0, here / "tiny-model"))
if cfg["prefill_signals"]:  # as prefill_yield_args gives them to generators beside an encoder
    specs = [replace(s, args=(*s.args, "--prefill-signal", str(here / "run" / f"{s.instance}.prefill")))
             if s.role == "generator" else s for s in specs]
stand_in = (sys.executable, str(here / "stand_in.py"))
mps = None
if cfg["mps"] is not None:  # every model stage is a client, as if all shared cuda:0
    mps = MpsConfig(here / "run" / "mps", frozenset(s.instance for s in specs if s.role != "proxy"),
                    required=cfg["mps"]["required"], encoder_sm_percent=cfg["mps"]["sm_percent"],
                    encoders=frozenset(s.instance for s in specs if s.role == "encoder"), shared=("cuda:0",),
                    operator_wait=cfg["mps"].get("operator_wait", 60.0))
config = SupervisorConfig(
    tuple(specs), http_url("127.0.0.1", cfg["port"], "/health"), http_url("127.0.0.1", cfg["port"], "/v1"),
    ready_timeout=cfg["ready_timeout"], stop_timeout=1.0, drain_timeout=cfg["drain_timeout"],
    restart_backoff=0.2, poll_interval=0.05,
    max_restarts_per_minute=cfg["max_restarts"], mps=mps,
    commands={role: (*stand_in, role) for role in ("encoder", "generator", "proxy")})
sys.exit(run_supervisor(config))
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Launcher:
    """A supervisor process over stand-ins, its output collected by threads."""

    def __init__(self, folder: Path, behaviour: dict, encoders=1, generators=2, ready_timeout=20.0,
                 max_restarts=5, drain_timeout=5.0, mps: dict | None = None, env: dict | None = None,
                 prefill_signals=False):
        self.folder = folder
        (folder / "pids").mkdir()
        (folder / "stamps").mkdir()
        (folder / "run").mkdir()
        (folder / "stand_in.py").write_text(STAND_IN)
        (folder / "behaviour.json").write_text(json.dumps(behaviour))
        self.port = free_port()
        cfg = dict(repo=str(REPO), dir=str(folder), encoders=encoders, generators=generators,
                   port=self.port, ready_timeout=ready_timeout, max_restarts=max_restarts,
                   drain_timeout=drain_timeout, mps=mps, prefill_signals=prefill_signals)
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(cfg)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(s, into), daemon=True)
                        for s, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, into):
        for line in stream:
            into.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 10.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [line for line in list(self.out) if re.search(pattern, line)]
            if len(hits) >= count:
                return hits
            time.sleep(0.02)
        raise AssertionError(f"no {count} line(s) matching {pattern!r} in:\n" + "\n".join(self.out + self.err))

    def pids(self, instance: str | None = None) -> list[int]:
        return [int(p.suffix[1:]) for p in (self.folder / "pids").iterdir()
                if instance is None or p.stem == instance]

    def health_answers(self) -> list[str]:
        """The stand-in proxy's answers to /health so far ("503", "200")."""
        path = self.folder / "health_answers"
        return path.read_text().split() if path.exists() else []

    def stamp(self, instance: str, event: str) -> float:
        return float((self.folder / "stamps" / f"{instance}.{event}").read_text())

    def finish(self, timeout: float = 10.0) -> int:
        code = self.proc.wait(timeout=timeout)
        for reader in self.readers:
            reader.join(timeout=2)
        return code

    def kill(self):
        if self.proc.poll() is None:  # a failed test: leave nothing behind
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def launch(tmp_path):
    started = []

    def start(behaviour, **kwargs):
        started.append(Launcher(tmp_path, behaviour, **kwargs))
        return started[-1]

    yield start
    for launcher in started:
        launcher.kill()


def assert_all_gone(pids):
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_ready_after_health_then_sigterm_stops_everything(launch):
    launcher = launch({"encoder-0": {"shm": True, "ignore_term": True}})
    launcher.wait_for(r"^proxy +\| stand-in proxy up$")
    launcher.wait_for(r"^encoder-0 +\| stand-in encoder-0 up$")
    # The proxy answers 503 so far: the launcher has been told so three times, and is not ready.
    until(lambda: launcher.health_answers().count("503") >= 3, "the launcher to ask /health three times", 10)
    assert not any(line.startswith("EPD ready") for line in launcher.out)
    (launcher.folder / "ready").touch()
    launcher.wait_for(rf"^EPD ready: http://127\.0\.0\.1:{launcher.port}/v1$")
    pids = launcher.pids()
    assert len(pids) == 4
    for pid in pids:  # children stay in the launcher's process group
        assert os.getpgid(pid) == os.getpgid(launcher.proc.pid) == launcher.proc.pid
    (encoder_pid,) = launcher.pids("encoder-0")
    assert Path(f"/dev/shm/epd-encoder-0-{encoder_pid}-arena").exists()

    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.finish() == 0, launcher.err
    assert_all_gone(pids)
    assert not list(Path("/dev/shm").glob(f"epd-encoder-0-{encoder_pid}-*"))
    launcher.wait_for(r"encoder-0 did not stop within 1 s; killing it")
    launcher.wait_for(rf"removed shared memory left by encoder-0: epd-encoder-0-{encoder_pid}-arena")


def test_the_generators_prefill_signal_files_are_removed_when_the_stack_stops(launch, tmp_path):
    (tmp_path / "ready").touch()
    launcher = launch({}, prefill_signals=True)
    launcher.wait_for("EPD ready")
    files = [tmp_path / "run" / f"generator-{i}.prefill" for i in range(2)]
    until(lambda: all(f.exists() for f in files), "the generators to make their signal files", 10)
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.finish() == 0, launcher.err
    assert not [f for f in files if f.exists()]
    assert_all_gone(launcher.pids())


def test_the_proxy_stops_first_and_its_drain_still_has_the_model_stages(launch, tmp_path):
    """On stop the proxy lets the requests in flight finish; the encoders and
    generators serving them get SIGTERM only once it has exited."""
    (tmp_path / "ready").touch()
    launcher = launch({"proxy": {"drain": 1.0}})
    launcher.wait_for("EPD ready")
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.finish() == 0, launcher.err
    proxy_exit = launcher.stamp("proxy", "exit")
    assert proxy_exit - launcher.stamp("proxy", "term") >= 1.0
    for instance in ("encoder-0", "generator-0", "generator-1"):
        assert launcher.stamp(instance, "term") >= proxy_exit
    assert_all_gone(launcher.pids())


@pytest.mark.parametrize("drain_timeout, signals, line", [
    (0.5, [signal.SIGTERM], r"proxy did not stop within 1\.5 s; killing it"),
    # Ctrl-C, then Ctrl-C again: the operator does not want to wait.
    (20.0, [signal.SIGINT, signal.SIGINT], "asked to stop again: not waiting for the requests in flight"),
])
def test_a_proxy_whose_drain_runs_on_is_killed_in_time_or_when_asked_again(launch, tmp_path, drain_timeout,
                                                                           signals, line):
    (tmp_path / "ready").touch()
    launcher = launch({"proxy": {"drain": 30.0}}, drain_timeout=drain_timeout)
    launcher.wait_for("EPD ready")
    started = time.monotonic()
    launcher.proc.send_signal(signals[0])
    # The launcher acted on it (the proxy got SIGTERM: its drain began); only then is a second one "again".
    until(lambda: (launcher.folder / "stamps" / "proxy.term").exists(), "the proxy to be told to stop", 10)
    for sig in signals[1:]:
        launcher.proc.send_signal(sig)
    assert launcher.finish() == 0, launcher.err
    assert time.monotonic() - started < 10
    launcher.wait_for(line)
    assert_all_gone(launcher.pids())


def test_a_stage_that_dies_is_restarted(launch, tmp_path):
    (tmp_path / "ready").touch()
    launcher = launch({"generator-1": {"exit_after_ready": 3}})
    launcher.wait_for("EPD ready")
    launcher.wait_for(r"generator-1 exited with code 3; restarting in 0\.2 s \(restart 1 ")
    launcher.wait_for(r"started generator-1 \(pid \d+, cpu\)", count=2)
    launcher.wait_for(r"^generator-1 \| stand-in generator-1 up$", count=2)
    assert len(launcher.pids("generator-1")) >= 2
    launcher.proc.send_signal(signal.SIGINT)
    assert launcher.finish() == 0
    assert_all_gone(launcher.pids())


def test_a_stage_that_keeps_dying_stops_the_box(launch, tmp_path):
    (tmp_path / "ready").touch()
    launcher = launch({"generator-0": {"exit_after_ready": 3}}, max_restarts=1)
    assert launcher.finish(timeout=15) == 1
    assert launcher.err[-1] == ("epd-launch: error: generator-0 exited with code 3 after 1 restart(s) "
                                "in the last 60 s; giving up")
    assert_all_gone(launcher.pids())


def test_a_stage_dying_before_ready_is_named(launch):
    launcher = launch({"generator-1": {"exit": 4}})
    assert launcher.finish() == 1
    assert launcher.err == ["epd-launch: error: generator-1 exited with code 4 before the server was ready"]
    assert_all_gone(launcher.pids())


def test_health_timeout_is_named(launch):
    launcher = launch({}, encoders=1, generators=1, ready_timeout=1.0)
    assert launcher.finish() == 1
    (line,) = launcher.err
    assert re.fullmatch(rf"epd-launch: error: timed out: the proxy's http://127\.0\.0\.1:{launcher.port}/health "
                        r"did not answer 200 within 1 s \(last: (HTTP 503|no answer)\)", line)
    assert_all_gone(launcher.pids())


def test_systemd_hears_ready_only_once_health_answers_and_watchdog_pings_until_stopping(launch, tmp_path):
    """The launcher under a fake systemd (NOTIFY_SOCKET, WATCHDOG_USEC): STATUS
    while loading, watchdog pings from the start, READY=1 only once /health
    answers 200, STOPPING=1 on SIGTERM; the stages never see the socket."""
    import urllib.request

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify.sock"))
    listener.settimeout(0.05)
    heard: list[str] = []

    def hear(stop, timeout: float = 10.0) -> None:
        """Collect datagrams until stop(heard) holds."""
        deadline = time.monotonic() + timeout
        while not stop(heard):
            assert time.monotonic() < deadline, f"not heard in time: {heard}"
            try:
                heard.append(listener.recv(4096).decode())
            except TimeoutError:
                pass

    def pings_since(start: int) -> int:
        return sum(m == "WATCHDOG=1" for m in heard[start:])

    launcher = launch({}, env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "400000"})
    try:
        hear(lambda h: any("STATUS=loading" in m for m in h))
        loading = len(heard)
        hear(lambda h: pings_since(loading) >= 3)          # every 0.2 s while loading
        assert not any("READY=1" in m for m in heard)     # the proxy answers 503 so far
        (launcher.folder / "ready").touch()
        hear(lambda h: any("READY=1" in m for m in h))
        with urllib.request.urlopen(f"http://127.0.0.1:{launcher.port}/health", timeout=5) as reply:
            assert reply.status == 200
        ready = len(heard)
        hear(lambda h: pings_since(ready) >= 2)            # and on while serving
        launcher.proc.send_signal(signal.SIGTERM)
        hear(lambda h: any("STOPPING=1" in m for m in h))
        assert launcher.finish() == 0, launcher.err
    finally:
        listener.close()
    for dump in (launcher.folder / "pids").iterdir():
        assert "NOTIFY_SOCKET" not in json.loads(dump.read_text())
