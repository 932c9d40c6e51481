"""Starting a whole EPD stack (real processes) for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pipeline.arena.shm import remove_stale_segments
from pipeline.cpu_threads import threads_per_stage, usable_cpus

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """An encoder/generator/proxy set of processes on the tiny model."""

    def __init__(self, run_dir: Path, model_dir: Path, encoders: int, generators: int, aggregated: bool = False,
                 generator_args: tuple[str, ...] = (), proxy_args: tuple[str, ...] = (),
                 encoder_args: tuple[str, ...] = ()) -> None:
        self.run_dir = run_dir
        self.port = free_port()
        self.log = open(run_dir / "stack.log", "w")
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}
        # Named after the run folder too: two stacks may be up at once.
        self.encoder_instances = [f"e2e-{run_dir.name}-enc{i}-{os.getpid()}" for i in range(encoders)]
        self.generator_instances = [f"e2e-{run_dir.name}-gen{i}-{os.getpid()}" for i in range(generators)]
        enc = self.encoder_addresses = [f"ipc://{run_dir}/enc{i}.sock" for i in range(encoders)]
        gen = [f"ipc://{run_dir}/gen{i}.sock" for i in range(generators)]
        # As epd-launch does: the cores split among the model stages.
        threads = threads_per_stage(encoders + generators, usable_cpus())
        common = ["--model", str(model_dir), "--device", "cpu", "--cpu-threads", str(threads)]
        for i, address in enumerate(enc):
            self._start(f"enc{i}", ["stages.encoder", "--address", address, "--instance", self.encoder_instances[i],
                                    "--media-backend", "pillow", "--model-id", "tiny", "--arena-mib", "16", *common,
                                    *encoder_args])
        for i, address in enumerate(gen):
            mode = ["--mode", "aggregated", "--media-backend", "pillow"] if aggregated else []
            self._start(f"gen{i}", ["stages.generator", "--address", address, "--instance", self.generator_instances[i],
                                    *[a for e in enc for a in ("--encoders", e)], *mode, *common,
                                    "--kv-cache-mib", "16", *generator_args])
        self._start("proxy", ["stages.proxy", "--port", str(self.port), "--address", f"ipc://{run_dir}/proxy.sock",
                              "--model", str(model_dir), "--model-id", "tiny", "--mode",
                              "aggregated" if aggregated else "epd", "--generators", ",".join(gen),
                              *(["--encoders", ",".join(enc)] if enc else []), *proxy_args])
        self.base_url = f"http://127.0.0.1:{self.port}"

    def _start(self, name: str, argv: list[str]) -> None:
        self.argv[name] = argv
        self.procs[name] = subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, stdout=self.log,
                                            stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"stages died: {dead}\n{self.logs()}")
            time.sleep(0.3)
        raise TimeoutError(f"stack not healthy\n{self.logs()}")

    def stop_stage(self, name: str, sig: int = signal.SIGTERM) -> None:
        self.procs[name].send_signal(sig)
        self.procs[name].wait(timeout=20)

    def restart_stage(self, name: str) -> None:
        self._start(name, self.argv[name])

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by name{labels}."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def total(self, name: str, **labels) -> float:
        return sum(v for k, v in self.metrics().items()
                   if k.split("{")[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items()))

    def logs(self) -> str:
        """The log's tail, for failure messages."""
        return self.whole_log()[-6000:]

    def whole_log(self) -> str:
        self.log.flush()
        return (self.run_dir / "stack.log").read_text()

    def wait_for_log(self, text: str, deadline_s: float = 10.0) -> bool:
        """Whether `text` shows in the log within the deadline (stages log as they go)."""
        end = time.monotonic() + deadline_s
        while text not in self.whole_log():
            if time.monotonic() > end:
                return False
            time.sleep(0.1)
        return True

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for instance in self.encoder_instances + self.generator_instances:
            remove_stale_segments(instance)
        self.log.close()
