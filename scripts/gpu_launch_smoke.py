#!/usr/bin/env python3
"""The users' command with its defaults, on a GPU box (not CI):

    bin/epd-launch --encoders 1 --generators 3 --random-weights qwen2.5-vl-3b --device cuda

On fewer GPUs than stages the stages share GPUs (on 2 GPUs: the encoder and
a generator on one, two generators on the other), so the launcher splits
their memory and each generator sizes its KV cache from its share. A burst
of 4-image, 400-token requests goes through epd-bench; then the stack is
stopped with SIGINT and nothing may be left: no epd segment in /dev/shm, no
GPU memory in use. Prints one JSON report; exit 1 if anything failed.

    python3 scripts/gpu_launch_smoke.py [--prompts 48] [--rate 8] [--out DIR]
    python3 scripts/gpu_launch_smoke.py --cpu --prompts 6 --rate 2   # a dry run of the script
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.bench.launched import LaunchedStack, gpu_memory_used_mib, read_json, run_bench  # noqa: E402

KV_LINE = re.compile(r"KV cache: .*")


def epd_shm() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob("epd-*"))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--out", type=Path, default=Path("/tmp/launch-smoke"))
    p.add_argument("--cpu", action="store_true", help="the built-in tiny model on the CPU")
    args = p.parse_args()
    shm_before = epd_shm()
    report: dict = {"shm_before": shm_before}
    launch = ["--encoders", "1", "--generators", "3", "--device", "cpu"] if args.cpu else [
        "--encoders", "1", "--generators", "3", "--random-weights", "qwen2.5-vl-3b", "--device", "cuda"]
    stack = LaunchedStack(launch, args.out / "logs", env={"OMP_NUM_THREADS": "1"} if args.cpu else None)
    try:
        report["ready_s"] = round(stack.start(ready_timeout=300), 1)
        report["gpu_mib_serving"] = gpu_memory_used_mib(args.cpu)
        bench = ["--base-url", stack.base_url, "--random-input-len", "400", "--random-output-len", "150",
                 "--random-mm-base-items-per-request", "4", "--random-mm-bucket-config", "{(640, 640, 1): 1.0}",
                 "--num-prompts", str(args.prompts), "--request-rate", f"{args.rate:g}", "--no-progress",
                 "--json", str(args.out / "bench.json")]
        report["bench_rc"] = run_bench(bench, 180, args.out / "bench.log")
        result = read_json(args.out / "bench.json") or {}
        report["bench"] = {k: result.get(k) for k in ("completed", "failed", "request_throughput",
                                                       "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                                       "p99_tpot_ms")}
    finally:
        report["launcher_exit"] = stack.stop(timeout=60)
    time.sleep(2)
    report["gpu_mib_after"] = gpu_memory_used_mib(args.cpu)
    report["shm_after"] = epd_shm()
    report["kv_cache"] = [m.group(0) for log in sorted((args.out / "logs").glob("generator-*.log"))
                          for m in KV_LINE.finditer(log.read_text())]
    report["placement"] = [line for line in (args.out / "logs" / "launcher.log").read_text().splitlines()
                           if line.startswith("epd-launch: placement ") or "MPS control daemon" in line]
    bench = report.get("bench", {})
    report["ok"] = (bench.get("completed") == args.prompts and not bench.get("failed")
                    and len(report["kv_cache"]) == 3 and report["shm_after"] == shm_before
                    and max(report["gpu_mib_after"]) < 1024)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
