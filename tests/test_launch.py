"""The launcher: placement plans (pure), and the supervisor driving stand-in
stages (a tiny script per role; the "proxy" serves /health) in a launcher
process of its own, so signals to it never reach pytest."""

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
from pipeline.launch.plan import (
    HostFacts, LaunchError, LaunchOptions, http_url, plan_stages, shared_gpus)

RUN = Path("/tmp/epd-test-run")  # only names addresses in plan tests; nothing is bound
MODEL = Path("/models/qwen2.5-vl-3b")


def options(**overrides) -> LaunchOptions:
    base = dict(encoders=1, generators=3, run_dir=RUN, model=MODEL, python="python")
    return LaunchOptions(**{**base, **overrides})


def flag_values(args, flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def by_role(specs):
    return {role: [s for s in specs if s.role == role] for role in ("encoder", "generator", "proxy")}


# ---- plans ------------------------------------------------------------------

def test_one_encoder_three_generators_on_four_gpus():
    specs = plan_stages(options(), HostFacts(gpu_count=4))
    assert [(s.instance, s.device) for s in specs] == [
        ("encoder-0", "cuda:0"), ("generator-0", "cuda:1"), ("generator-1", "cuda:2"),
        ("generator-2", "cuda:3"), ("proxy", "cpu")]
    assert shared_gpus(specs) == {}
    roles = by_role(specs)
    encoder, proxy = roles["encoder"][0], roles["proxy"][0]
    assert encoder.argv[:3] == ["python", "-m", "stages.encoder"]
    assert proxy.argv[:3] == ["python", "-m", "stages.proxy"]
    assert flag_values(encoder.args, "--device") == ["cuda:0"]
    assert flag_values(encoder.args, "--instance") == ["encoder-0"]
    # Every stage that hashes content uses one model id.
    assert flag_values(encoder.args, "--model-id") == flag_values(proxy.args, "--model-id") == [MODEL.name]
    for gen in roles["generator"]:
        assert gen.argv[:3] == ["python", "-m", "stages.generator"]
        assert flag_values(gen.args, "--encoders") == [encoder.address]
        assert flag_values(gen.args, "--mode") == ["epd"]
        assert flag_values(gen.args, "--model") == [str(MODEL)]
    assert flag_values(proxy.args, "--encoders") == [encoder.address]
    assert flag_values(proxy.args, "--generators") == [g.address for g in roles["generator"]]
    assert flag_values(proxy.args, "--port") == ["8000"]
    assert flag_values(proxy.args, "--address") == [proxy.address]
    addresses = [s.address for s in specs]
    assert len(set(addresses)) == len(addresses) and all(a.startswith(f"ipc://{RUN}/") for a in addresses)
    for spec in specs:  # GPUs are named, never hidden
        assert "CUDA_VISIBLE_DEVICES" not in spec.env


def test_fewer_gpus_than_stages_share_round_robin():
    specs = plan_stages(options(), HostFacts(gpu_count=2))
    assert [s.device for s in specs] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cpu"]
    assert shared_gpus(specs) == {"cuda:0": ["encoder-0", "generator-1"],
                                  "cuda:1": ["generator-0", "generator-2"]}
    assert all(s.env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" for s in specs if s.role != "proxy")


def memory_share(spec) -> list[str]:
    return [a.split("=", 1)[1] for a in spec.args if a.startswith("--gpu-memory-utilization=")]


def test_generators_sharing_a_gpu_split_its_memory():
    """1 encoder + 3 generators on 2 GPUs: cuda:0 holds the encoder and
    generator-1 (0.9 - 0.1), cuda:1 two generators (0.45 each); alone on a
    GPU a generator keeps its own default; the operator's flag wins."""
    specs = plan_stages(options(), HostFacts(gpu_count=2))
    gens = by_role(specs)["generator"]
    assert [(g.device, memory_share(g)) for g in gens] == [
        ("cuda:1", ["0.450"]), ("cuda:0", ["0.800"]), ("cuda:1", ["0.450"])]
    assert all(memory_share(g) == [] for g in by_role(plan_stages(options(), HostFacts(gpu_count=4)))["generator"])
    own = plan_stages(options(stage_args=(("generator", "--gpu-memory-utilization=0.3"),)), HostFacts(gpu_count=2))
    assert all(memory_share(g) == ["0.3"] for g in by_role(own)["generator"])
    cpu = plan_stages(options(device="cpu"), HostFacts(gpu_count=0))
    assert all(memory_share(g) == [] for g in by_role(cpu)["generator"])
    with pytest.raises(LaunchError, match="no memory left"):
        plan_stages(options(encoders=9, generators=1), HostFacts(gpu_count=1))


def test_gpu_subset():
    specs = plan_stages(options(encoders=1, generators=2, gpus=(1, 3)), HostFacts(gpu_count=4))
    assert [s.device for s in specs] == ["cuda:1", "cuda:3", "cuda:1", "cpu"]
    with pytest.raises(LaunchError, match=r"--gpus 5: only 4 GPU\(s\)"):
        plan_stages(options(gpus=(0, 5)), HostFacts(gpu_count=4))


def test_aggregated_mode_starts_no_encoders():
    specs = plan_stages(options(encoders=0, generators=2, mode="aggregated"), HostFacts(gpu_count=2))
    roles = by_role(specs)
    assert roles["encoder"] == [] and len(roles["generator"]) == 2
    for spec in roles["generator"] + roles["proxy"]:
        assert flag_values(spec.args, "--mode") == ["aggregated"]
        assert flag_values(spec.args, "--encoders") == []
    assert [s.device for s in roles["generator"]] == ["cuda:0", "cuda:1"]


def test_builtin_tiny_model_serves_on_cpu_by_default():
    tiny = Path("/cache/epd/tiny-qwen2.5-vl-v1")
    specs = plan_stages(options(model=None), HostFacts(gpu_count=8, builtin_model=tiny))
    assert {s.device for s in specs} == {"cpu"}
    assert all(s.env == {} for s in specs)
    for spec in specs:
        assert flag_values(spec.args, "--model") == [str(tiny)]
    assert flag_values(specs[0].args, "--model-id") == ["tiny-qwen2.5-vl-v1"]
    # An explicit model id wins everywhere; cpu never touches GPUs.
    specs = plan_stages(options(model_id="qwen", device="cpu"), HostFacts(gpu_count=4))
    assert {s.device for s in specs} == {"cpu"}
    assert flag_values(specs[0].args, "--model-id") == flag_values(specs[-1].args, "--model-id") == ["qwen"]


def test_stages_on_the_cpu_split_its_cores_and_the_operator_wins():
    """torch's default (a thread per core in every process) oversubscribes a
    host the stages share; GPU stages keep it, and --stage-arg overrides."""
    cpu = plan_stages(options(device="cpu"), HostFacts(gpu_count=0, cpus=16))
    assert [flag_values(s.args, "--cpu-threads") for s in cpu] == [["4"]] * 4 + [[]]
    small = plan_stages(options(device="cpu"), HostFacts(gpu_count=0, cpus=2))
    assert {flag_values(s.args, "--cpu-threads")[0] for s in small if s.role != "proxy"} == {"1"}
    gpus = plan_stages(options(), HostFacts(gpu_count=4, cpus=16))
    assert all("--cpu-threads" not in s.args for s in gpus)
    own = plan_stages(options(device="cpu", stage_args=(("generator", "--cpu-threads=8"),)),
                      HostFacts(gpu_count=0, cpus=16))
    assert all(g.args[-2:] == ("4", "--cpu-threads=8") for g in by_role(own)["generator"])  # argparse: last wins


def test_dtype_and_stage_args_pass_through_in_order():
    opts = options(dtype="bfloat16", stage_args=(("generator", "--max-num-seqs=32"),
                                                 ("encoder", "--arena-mib"), ("encoder", "512")))
    roles = by_role(plan_stages(opts, HostFacts(gpu_count=4)))
    assert roles["encoder"][0].args[-2:] == ("--arena-mib", "512")
    assert all(g.args[-1] == "--max-num-seqs=32" for g in roles["generator"])
    assert all(flag_values(s.args, "--dtype") == ["bfloat16"] for s in roles["encoder"] + roles["generator"])
    assert "--dtype" not in roles["proxy"][0].args


def test_random_weights_reach_the_model_stages_and_the_folder_every_stage():
    folder = Path("/cache/epd/qwen2.5-vl-3b-v1")
    opts = options(model=None, random_weights="qwen2.5-vl-3b", encoders=1, generators=1)
    specs = plan_stages(opts, HostFacts(gpu_count=2, builtin_model=folder))
    assert [s.device for s in specs] == ["cuda:0", "cuda:1", "cpu"]  # auto: a real-size shape uses GPUs
    roles = by_role(specs)
    for spec in roles["encoder"] + roles["generator"]:
        assert flag_values(spec.args, "--random-weights") == ["qwen2.5-vl-3b"]
    assert "--random-weights" not in roles["proxy"][0].args
    assert all(flag_values(s.args, "--model") == [str(folder)] for s in specs)
    assert flag_values(roles["proxy"][0].args, "--model-id") == ["qwen2.5-vl-3b-v1"]


@pytest.mark.parametrize("overrides, message", [
    (dict(random_weights="qwen-99b"), "--random-weights must be one of"),
    (dict(random_weights="qwen2.5-vl-3b"), "--model cannot be combined with --random-weights"),
    (dict(stage_args=(("encoder", "--random-weights=qwen2.5-vl-3b"),)), "--random-weights is set by the launcher"),
    (dict(encoders=0), "--encoders must be at least 1 in epd mode"),
    (dict(encoders=1, mode="aggregated"), "--encoders must be 0 with --mode aggregated"),
    (dict(generators=0), "--generators must be at least 1"),
    (dict(port=70000), r"--port must be in 1\.\.65535"),
    (dict(device="cpu", gpus=(0,)), "--gpus cannot be combined with --device cpu"),
    (dict(gpus=(0, 0)), "--gpus must be distinct"),
    (dict(device="tpu"), "--device must be one of auto, cpu, cuda"),
    (dict(stage_args=(("generator", "--device=cuda:3"),)), "--device is set by the launcher"),
    (dict(stage_args=(("proxy", "--generators"),)), "--generators is set by the launcher"),
    (dict(stage_args=(("decoder", "--x"),)), "role must be one of encoder, generator, proxy"),
])
def test_bad_options_are_one_line_errors(overrides, message):
    with pytest.raises(LaunchError, match=message) as info:
        options(**overrides)
    assert "\n" not in str(info.value)


def test_cuda_without_gpus_is_an_error():
    with pytest.raises(LaunchError, match="no CUDA GPU is visible"):
        plan_stages(options(device="cuda"), HostFacts(gpu_count=0))
    # auto with a real model and no GPU: the CPU.
    assert {s.device for s in plan_stages(options(), HostFacts(gpu_count=0))} == {"cpu"}


def test_urls():
    assert http_url("127.0.0.1", 8000, "/v1") == "http://127.0.0.1:8000/v1"
    assert http_url("0.0.0.0", 80, "/health", for_client=True) == "http://127.0.0.1:80/health"
    assert http_url("::", 80, "/health", for_client=True) == "http://[::1]:80/health"


@pytest.mark.parametrize("argv, message", [
    (["--generators", "0"], "--generators must be at least 1"),
    (["--mode", "aggregated", "--encoders", "2"], "--encoders must be 0 with --mode aggregated"),
    (["--port", "99999"], "--port must be in 1..65535"),
    (["--stage-arg", "generator"], "expected ROLE=ARG"),
])
def test_cli_rejects_bad_options_with_exit_2(argv, message):
    result = subprocess.run([sys.executable, str(REPO / "bin" / "epd-launch"), *argv],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert result.stderr.startswith("epd-launch: error: ")


def test_cli_refuses_a_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run([sys.executable, str(REPO / "bin" / "epd-launch"), "--port", str(port)],
                                capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.startswith(f"epd-launch: error: --port {port}: cannot listen on 127.0.0.1")


# ---- the supervisor with stand-in stages -------------------------------------

STAND_IN = r'''
import json, os, signal, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HERE = Path(__file__).parent
role, flags = sys.argv[1], sys.argv[2:]
def flag(name):
    return flags[flags.index(name) + 1] if name in flags else None
instance = flag("--instance") or role
(HERE / "pids" / f"{instance}.{os.getpid()}").touch()
rules = json.loads((HERE / "behaviour.json").read_text()).get(instance, {})
print(f"stand-in {instance} up", flush=True)
if "exit" in rules:
    sys.exit(rules["exit"])
if rules.get("shm"):  # like an arena that only a clean stop removes
    Path(f"/dev/shm/epd-{instance}-{os.getpid()}-arena").write_bytes(b"x")
signal.signal(signal.SIGTERM, signal.SIG_IGN if rules.get("ignore_term") else lambda *_: sys.exit(0))
if role == "proxy":
    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/health" and (HERE / "ready").exists()
            self.send_response(200 if ok else 503)
            self.end_headers()
        def log_message(self, *args):
            pass
    ThreadingHTTPServer((flag("--host"), int(flag("--port"))), Health).serve_forever(0.05)
while True:
    if "exit_after_ready" in rules and (HERE / "ready").exists():
        time.sleep(0.3)
        sys.exit(rules["exit_after_ready"])
    time.sleep(0.05)
'''

DRIVER = r'''
import json, sys
from pathlib import Path
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["repo"])
from pipeline.launch.plan import HostFacts, LaunchOptions, http_url, plan_stages
from pipeline.launch.supervisor import SupervisorConfig, run_supervisor

here = Path(cfg["dir"])
options = LaunchOptions(cfg["encoders"], cfg["generators"], here / "run", port=cfg["port"])
specs = plan_stages(options, HostFacts(0, here / "tiny-model"))
stand_in = (sys.executable, str(here / "stand_in.py"))
config = SupervisorConfig(
    tuple(specs), http_url("127.0.0.1", cfg["port"], "/health"), http_url("127.0.0.1", cfg["port"], "/v1"),
    ready_timeout=cfg["ready_timeout"], stop_timeout=1.0, restart_backoff=0.2, poll_interval=0.05,
    max_restarts_per_minute=cfg["max_restarts"],
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
                 max_restarts=5):
        self.folder = folder
        (folder / "pids").mkdir()
        (folder / "run").mkdir()
        (folder / "stand_in.py").write_text(STAND_IN)
        (folder / "behaviour.json").write_text(json.dumps(behaviour))
        self.port = free_port()
        cfg = dict(repo=str(REPO), dir=str(folder), encoders=encoders, generators=generators,
                   port=self.port, ready_timeout=ready_timeout, max_restarts=max_restarts)
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(cfg)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
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
    time.sleep(0.5)  # the proxy answers 503 so far
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
