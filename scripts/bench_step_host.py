#!/usr/bin/env python3
"""Host work of a generator step on the CPU, in two parts:
- the scheduler (schedule + update, fake model outputs): about 75 running
  requests of 2,500 prompt tokens with 4 image spans each, decoding 150
  tokens, one new request every other step;
- a mixed step's M-RoPE positions (the runner's input building): one
  1,948-token prefill chunk beside 90 decoding requests;
- a decode step's graph inputs (DecodeGraphs._fill): 90 requests of 2,600
  tokens (163 KV blocks each), their block ids passed as the runner passes
  them.

    python3 scripts/bench_step_host.py [--against OTHER_CHECKOUT]

With --against, the same measurement runs on another checkout of the repo
(e.g. `git worktree add /tmp/base HEAD~1`), alternating subprocesses three
times, and the ratio of the medians is printed.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def measure(steps: int = 300, repeats: int = 5) -> float:
    """Microseconds per schedule + update, the best of `repeats` runs."""
    from test_scheduler import make_request, make_scheduler, step

    from pipeline.engine.request import ImageSpan

    scheduler = make_scheduler(max_num_batched_tokens=2048, max_num_seqs=128, block_size=16, num_blocks=400_000,
                               encoder_cache_tokens=1 << 20)
    count = 0

    def add() -> None:
        nonlocal count
        spans = [ImageSpan(10 + j * 600, 529, f"k{count}-{j}") for j in range(4)]
        for span in spans:   # embeddings already local, as in EPD once the encoder has answered
            scheduler.admit_embedding(span.key, span.length)
        scheduler.add_request(make_request(f"r{count}", 2500, max_tokens=150, spans=spans))
        count += 1

    for _ in range(110):
        add()
    for i in range(400):   # to a steady state
        if i % 2 == 0:
            add()
        step(scheduler)
    gc.collect()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for i in range(steps):
            if i % 2 == 0:
                add()
            step(scheduler)
        best = min(best, (time.perf_counter() - started) / steps * 1e6)
    return best


def measure_positions(repeats: int = 200) -> float:
    """Microseconds to build one mixed step's positions the runner's way."""
    import torch

    from pipeline.engine.plan import Chunk
    from pipeline.engine.runner import ModelRunner, PromptGeometry
    from pipeline.models.qwen2_5_vl import positions as mrope

    class Model:   # the runner's position hooks of the Qwen2.5-VL model, nothing else
        decode_positions = staticmethod(mrope.decode_positions)
        decode_step_positions = staticmethod(mrope.decode_step_positions)

    prompt = 2500
    geometry = PromptGeometry(torch.arange(3 * prompt).view(3, prompt), -300)
    chunks = [Chunk("p", 500, 1948)] + [Chunk(f"d{i}", 2600 + i, 1, sample=True) for i in range(90)]
    build = _positions_builder(ModelRunner, Model())
    started = time.perf_counter()
    for _ in range(repeats):
        build(geometry, chunks, prompt)
    return (time.perf_counter() - started) / repeats * 1e6


def measure_decode_inputs(repeats: int = 300) -> float:
    """Microseconds to fill one decode step's pinned graph inputs."""
    import torch

    from pipeline.engine.decode_graphs import DecodeGraphs
    from pipeline.engine.request import Request
    from pipeline.sampling_params import SamplingParams

    class Cache:
        block_size = 16

    graphs = DecodeGraphs.__new__(DecodeGraphs)   # the input tables alone: no model, no device
    graphs.cache, graphs.null_block, graphs.max_batch = Cache(), 0, 128
    graphs.header = 6 * graphs.max_batch
    graphs.staging = torch.zeros(graphs.header + graphs.max_batch * 512, dtype=torch.long)
    graphs.inputs = torch.zeros_like(graphs.staging)
    graphs._copied = None   # no copy in flight (read by checkouts since decode ahead)
    graphs.axes = 3         # M-RoPE position rows (the header above holds 3 + axes rows)
    requests = [Request(f"r{i}", [1], (), SamplingParams(150)) for i in range(90)]
    for i, request in enumerate(requests):
        request.block_ids.extend(list(range(1 + i * 200, 1 + i * 200 + 163)))
    # As the checkout's runner passes them: array views, or the lists themselves.
    tables = [getattr(r.block_ids, "view", lambda r=r: r.block_ids)() for r in requests]
    positions, context = torch.zeros(3, 90, dtype=torch.long), [2600] * 90
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeats):
            graphs._fill([1] * 90, positions, tables, context, 128, 4096)
        best = min(best, (time.perf_counter() - started) / repeats * 1e6)
    return best


def _positions_builder(runner_class, model):
    """(geometry, chunks, prompt_len) -> positions, with whichever helper the
    checkout's runner has (its per-chunk _positions before the change)."""
    import torch

    from pipeline.engine import runner

    if hasattr(runner, "_StepPositions"):
        def build(geometry, chunks, prompt_len):
            positions = runner._StepPositions(model)
            for chunk in chunks:
                positions.add(geometry, chunk, prompt_len)
            return positions.tensor()
        return build
    shell = runner_class.__new__(runner_class)
    shell.model = model
    return lambda geometry, chunks, prompt_len: torch.cat(
        [shell._positions(geometry, chunk, prompt_len) for chunk in chunks], dim=1)


def run_in(checkout: Path) -> tuple[float, float, float]:
    # This file's own measurements, run against the checkout's code.
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", "--code", str(checkout)],
                         capture_output=True, text=True, check=True, cwd=checkout).stdout
    values = out.split()
    return float(values[2]), float(values[5]), float(values[9])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", type=Path, help="another checkout to compare with, side by side")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--code", type=Path, default=REPO, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one or args.against is None:
        code = args.code.resolve()        # whose pipeline/ (and tests/ helpers) to measure
        sys.path[:0] = [str(code), str(code / "tests")]
        print(f"scheduler us/step {measure():.1f} positions us/step {measure_positions():.1f} "
              f"decode inputs us/step {measure_decode_inputs():.1f}")
        return 0
    ours, theirs = [], []
    for _ in range(3):
        ours.append(run_in(REPO))
        theirs.append(run_in(args.against.resolve()))
    for i, part in enumerate(("scheduler", "mixed-step positions", "decode-step inputs")):
        a, b = statistics.median(o[i] for o in ours), statistics.median(t[i] for t in theirs)
        print(f"{part}: this checkout {a:.0f} us/step, {args.against} {b:.0f} us/step: {b / a:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
