#!/usr/bin/env python3
"""An encoder SIGKILLed under load on a GPU box, with the CUDA arena (not CI):

    bin/epd-launch --encoders 2 --generators 1 --random-weights qwen2.5-vl-3b --device cuda

On one GPU the three stages share it (colocated, under the launcher's MPS
daemon unless --mps off). epd-bench sends 4-image, 400-token requests with
distinct images; a few seconds in, one encoder is SIGKILLed. What must
hold: every request completes (the dead encoder's jobs go to the other
one, the launcher restarts it), the dead process's GPU memory comes back
(nvidia-smi: its pid leaves the compute apps, and the memory that no live
process is listed as holding stays what it was before the kill: nothing
orphaned), and after the stop nothing is
left (no epd segment in /dev/shm, no GPU memory in use). Prints one JSON
report; exit 1 if anything failed.

    python3 scripts/gpu_encoder_kill.py [--prompts 160] [--rate 4] [--kill-after 10] [--mps auto|off]
    python3 scripts/gpu_encoder_kill.py --cpu --prompts 12 --rate 2 --kill-after 3   # a dry run of the script
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline.bench.launched import LaunchedStack, read_json, run_bench  # noqa: E402
from soak_stack import Stages  # noqa: E402

# The GPU memory no listed process holds (the driver's own) may move this
# much; memory orphaned by a dead encoder would be gigabytes.
UNACCOUNTED_SLACK_MIB = 128


def gpu_total_mib(cpu: bool) -> int:
    if cpu:
        return 0
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(line) for line in out.split())


def compute_apps(cpu: bool) -> dict[int, int]:
    """pid -> MiB of each process nvidia-smi lists on the GPUs."""
    if cpu:
        return {}
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    apps = {}
    for line in out.strip().splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            apps[int(pid)] = int(mib)
    return apps


def unaccounted_mib(cpu: bool) -> int:
    """The GPU's used memory that no live process is listed as holding."""
    return gpu_total_mib(cpu) - sum(compute_apps(cpu).values())


def epd_shm() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob("epd-*"))


class MemoryTimeline(threading.Thread):
    """(seconds, total MiB, compute apps) every 0.25 s until stopped."""

    def __init__(self, cpu: bool, t0: float) -> None:
        super().__init__(daemon=True)
        self.cpu, self.t0 = cpu, t0
        self.samples: list[tuple[float, int, dict[int, int]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.25):
            self.samples.append((round(time.monotonic() - self.t0, 2), gpu_total_mib(self.cpu),
                                 compute_apps(self.cpu)))


def wait_for(condition, deadline_s: float) -> bool:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def bench_argv(base_url: str, args, out: Path) -> list[str]:
    return ["--base-url", base_url, "--random-input-len", "400", "--random-output-len", "150",
            "--random-mm-base-items-per-request", "4", "--random-mm-bucket-config", "{(640, 640, 1): 1.0}",
            "--num-prompts", str(args.prompts), "--request-rate", f"{args.rate:g}", "--no-progress",
            "--json", str(out / "bench.json")]


def kill_one_encoder(stages: Stages, report: dict, t0: float) -> None:
    victim = stages.instances("encoder")[0]
    pid = stages.pid(victim)
    report["killed"] = {"instance": victim, "pid": pid, "at_s": round(time.monotonic() - t0, 2),
                        "gpu_mib_before": gpu_total_mib(report["cpu"]),
                        "its_mib_before": compute_apps(report["cpu"]).get(pid)}
    os.kill(pid, signal.SIGKILL)
    # Under MPS a client may not be listed by pid (the MPS server holds its memory): then the totals tell.
    report["killed"]["pid_listed"] = report["killed"]["its_mib_before"] is not None
    report["killed"]["pid_gone_from_gpu"] = wait_for(lambda: pid not in compute_apps(report["cpu"]), 30)
    report["killed"]["restarted"] = wait_for(lambda: stages.pid(victim) not in (None, pid), 60)
    report["killed"]["new_pid"] = stages.pid(victim)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=160)
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--kill-after", type=float, default=10.0, help="seconds into the load")
    p.add_argument("--mps", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--out", type=Path, default=Path("/tmp/encoder-kill"))
    p.add_argument("--cpu", action="store_true", help="the built-in tiny model on the CPU")
    args = p.parse_args()
    report: dict = {"cpu": args.cpu, "mps": args.mps, "shm_before": epd_shm(), "gpu_mib_idle": gpu_total_mib(args.cpu)}
    launch = ["--encoders", "2", "--generators", "1", "--mps", args.mps,
              *(["--device", "cpu"] if args.cpu else ["--random-weights", "qwen2.5-vl-3b", "--device", "cuda"])]
    logs = args.out / f"logs-{args.mps}"
    stack = LaunchedStack(launch, logs, env={"OMP_NUM_THREADS": "1"} if args.cpu else None)
    t0 = time.monotonic()
    timeline = MemoryTimeline(args.cpu, t0)
    try:
        report["ready_s"] = round(stack.start(ready_timeout=300), 1)
        stages = Stages(logs / "launcher.log", t0)
        report["gpu_mib_serving"] = gpu_total_mib(args.cpu)
        report["apps_serving"] = compute_apps(args.cpu)
        report["unaccounted_mib_serving"] = unaccounted_mib(args.cpu)
        timeline.start()
        result: dict = {}
        bench = threading.Thread(target=lambda: result.setdefault(
            "rc", run_bench(bench_argv(stack.base_url, args, args.out), 600, args.out / "bench.log")))
        bench.start()
        time.sleep(args.kill_after)   # the load's own pace: the kill lands with requests in flight
        kill_one_encoder(stages, report, t0)
        bench.join()
        report["bench_rc"] = result.get("rc")
        out = read_json(args.out / "bench.json") or {}
        report["bench"] = {k: out.get(k) for k in ("completed", "failed", "request_throughput",
                                                    "p99_ttft_ms", "p99_tpot_ms")}
        report["gpu_mib_after_load"] = gpu_total_mib(args.cpu)
        report["apps_after_load"] = compute_apps(args.cpu)
        report["unaccounted_mib_after_load"] = unaccounted_mib(args.cpu)
    finally:
        timeline.done.set()
        report["launcher_exit"] = stack.stop(timeout=60)
    wait_for(lambda: gpu_total_mib(args.cpu) < 1024, 20)
    report["gpu_mib_after_stop"] = gpu_total_mib(args.cpu)
    report["shm_after"] = epd_shm()
    killed = report.get("killed", {})
    after_kill = [total for at, total, _ in timeline.samples if at >= killed.get("at_s", 1e9)]
    report["gpu_mib_lowest_after_kill"] = min(after_kill, default=None)
    report["timeline"] = " ".join(f"{at:.0f}s:{total}" for at, total, _ in timeline.samples[::4])   # MiB, each second
    bench = report.get("bench", {})
    report["ok"] = bool(bench.get("completed") == args.prompts and not bench.get("failed")
                        and killed.get("restarted") and killed.get("pid_gone_from_gpu")
                        and report.get("unaccounted_mib_after_load", 1e9)
                        <= report["unaccounted_mib_serving"] + UNACCOUNTED_SLACK_MIB
                        and report["shm_after"] == report["shm_before"] and report["gpu_mib_after_stop"] < 1024)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
