#!/usr/bin/env python3
"""The users' topology on the CPU, with the cores split among the stages
(epd-launch's default) against torch's default of a thread per core in
every stage, side by side.

    python scripts/bench_cpu_threads.py [--out /tmp/cpu-threads] [--prompts 24] [--rounds 2]

Each round starts `bin/epd-launch --encoders 1 --generators 3 --device cpu`
on the built-in tiny model once per configuration (alternating, so the
machine's noise hits both), warms it up, and sends a burst of one-image
requests (32 text and 64 output tokens, decode-heavy: decode is where
oversubscribed OpenMP threads hurt). Prints request throughput and TPOT p50
per run, and the ratios of the medians.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.bench.launched import LaunchedStack, StackError, read_json, run_bench  # noqa: E402
from pipeline.cpu_threads import usable_cpus  # noqa: E402

TOPOLOGY = ["--encoders", "1", "--generators", "3", "--device", "cpu"]
WORKLOAD = ["--random-input-len", "32", "--random-output-len", "64", "--random-mm-base-items-per-request", "1",
            "--random-mm-bucket-config", "{(224, 224, 1): 1.0}", "--request-rate", "inf", "--no-progress"]


def configurations() -> dict[str, list[str]]:
    every_core = str(usable_cpus())
    return {"split": [],
            "thread per core": [f"--stage-arg={role}=--cpu-threads={every_core}" for role in ("encoder", "generator")]}


def run_once(name: str, launch_args: list[str], args: argparse.Namespace, round_no: int) -> dict:
    logs = args.out / "logs" / f"{name.replace(' ', '-')}-{round_no}"
    stack = LaunchedStack([*TOPOLOGY, *launch_args], logs)
    out = logs / "result.json"
    bench = ["--base-url", stack.base_url, *WORKLOAD, "--num-prompts", str(args.prompts), "--json", str(out)]
    try:
        stack.start(ready_timeout=120)
        run_bench(["--base-url", stack.base_url, *WORKLOAD, "--num-prompts", "6", "--seed", "1000"], 300,
                  logs / "bench.log")
        run_bench(bench, 600, logs / "bench.log")
    finally:
        stack.stop()
    result = read_json(out)
    if not result or result.get("failed"):
        raise StackError(f"{name}: the burst failed; see {logs}")
    result["commands"] = [shlex.join(["bin/epd-launch", *stack.argv[2:]]), shlex.join(["bin/epd-bench", *bench])]
    return result


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/cpu-threads"))
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {name: [] for name in configurations()}
    try:
        for round_no in range(args.rounds):
            for name, launch_args in configurations().items():
                r = run_once(name, launch_args, args, round_no)
                results[name].append(r)
                print(f"round {round_no} {name:>15}: {r['request_throughput']:.2f} req/s, "
                      f"TPOT p50 {r['median_tpot_ms']:.1f} ms, TTFT p50 {r['median_ttft_ms']:.0f} ms", flush=True)
                print(f"{'':>24}{r['commands'][0]}", flush=True)
    except StackError as exc:
        print(f"bench_cpu_threads: error: {exc}", file=sys.stderr)
        return 1
    median = {name: {key: statistics.median(r[key] for r in runs) for key in ("request_throughput", "median_tpot_ms")}
              for name, runs in results.items()}
    split, default = median["split"], median["thread per core"]
    print(f"usable cores {usable_cpus()}; split/thread-per-core: request throughput "
          f"{split['request_throughput'] / default['request_throughput']:.2f}x, "
          f"TPOT p50 {split['median_tpot_ms'] / default['median_tpot_ms']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
