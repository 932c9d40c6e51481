#!/usr/bin/env python3
"""Does a CUDA stream's priority reach across MPS clients? (issue 14, the
interference line.) One device call, with an MPS daemon already started
(MICRO=1 bash scripts/gpu_interference.sh starts one):

    python3 scripts/gpu_mps_stream_priority.py [--seconds 6] [--json OUT]

Two processes on GPU 0. The probe replays a decode-like CUDA graph (batch-16
matmuls reading about 6 GiB of weights, so memory-bound like a decode step)
and times each replay with events; the load (an encoder stand-in) loops
compute-bound 8192^3 bf16 matmuls on the default stream. The probe is timed
alone, then beside the load on a normal-priority stream and on a
high-priority one, in alternating rounds so that drift hits both. Printed:
the probe's p50 / p99 per phase, its slowdown beside the load against alone,
and the load's matmul rate in each phase (what the priority costs the
encoder). The same graph runs in every phase; only the launch stream differs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

PHASES = ("alone", "beside-normal", "beside-high")


def load_loop(phase, stop, counts, seconds_in) -> None:
    """The encoder stand-in: matmuls back to back; per phase, how many and for how long."""
    torch.cuda.set_device(0)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    while not stop.is_set():
        p = phase.value
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        torch.cuda.synchronize()
        if p == phase.value and p >= 0:
            counts[p] += 4
            seconds_in[p] += time.perf_counter() - start


def make_probe() -> torch.cuda.CUDAGraph:
    layers = [(torch.randn(2048, 11008, device="cuda", dtype=torch.bfloat16) * 0.01,
               torch.randn(11008, 2048, device="cuda", dtype=torch.bfloat16) * 0.01) for _ in range(72)]
    x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)

    def forward():
        h = x
        for up, down in layers:
            h = (h @ up).relu_() @ down
        return h

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    graph.keep = layers  # the weights live as long as the graph
    return graph


def time_replays(graph, stream, n: int) -> list[float]:
    out = []
    with torch.cuda.stream(stream):
        for _ in range(n):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            out.append(start.elapsed_time(end))
    return out


def summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"n": len(ordered), "p50_ms": statistics.median(ordered),
            "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], "mean_ms": statistics.fmean(ordered)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="per beside phase, in rounds")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    torch.cuda.set_device(0)
    normal, high = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-(1 << 10))
    graph = make_probe()
    time_replays(graph, normal, 20)
    samples = {name: [] for name in PHASES}
    samples["alone"] = time_replays(graph, normal, 300)
    ctx = mp.get_context("spawn")
    phase, stop = ctx.Value("i", -1), ctx.Event()
    counts, seconds_in = ctx.Array("d", len(PHASES)), ctx.Array("d", len(PHASES))
    load = ctx.Process(target=load_loop, args=(phase, stop, counts, seconds_in), daemon=True)
    load.start()
    time.sleep(3.0)   # the load's CUDA start-up and first matmuls (a benchmark, not a test)
    deadline = time.perf_counter() + 2 * args.seconds
    while time.perf_counter() < deadline:
        for index, (name, stream) in ((1, ("beside-normal", normal)), (2, ("beside-high", high))):
            phase.value = index
            samples[name] += time_replays(graph, stream, 50)
    phase.value = -1
    stop.set()
    load.join(timeout=30)
    result = {"stream_priorities": [normal.priority, high.priority]}
    alone = summary(samples["alone"])
    for index, name in enumerate(PHASES):
        row = summary(samples[name])
        row["x_alone_p50"] = row["p50_ms"] / alone["p50_ms"]
        if index:
            row["load_matmuls_per_s"] = counts[index] / max(seconds_in[index], 1e-9)
        result[name] = row
        print(f"{name:14s} p50 {row['p50_ms']:.3f} ms  p99 {row['p99_ms']:.3f} ms  x alone {row['x_alone_p50']:.2f}"
              + (f"  load {row['load_matmuls_per_s']:.0f} matmuls/s" if index else ""))
    print(f"high/normal beside, p50: {result['beside-high']['p50_ms'] / result['beside-normal']['p50_ms']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
