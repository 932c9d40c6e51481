#!/usr/bin/env python3
"""The generator scheduler's host time per step (CPU, fake model outputs):
about 75 running requests of 2,500 prompt tokens with 4 image spans each,
decoding 150 tokens, one new request every other step. This is the work an
engine step does on the host between forwards.

    python3 scripts/bench_scheduler.py [--against OTHER_CHECKOUT]

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
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
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


def run_in(checkout: Path) -> float:
    out = subprocess.run([sys.executable, str(checkout / "scripts" / "bench_scheduler.py"), "--one"],
                         capture_output=True, text=True, check=True, cwd=checkout).stdout
    return float(out.split()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", type=Path, help="another checkout to compare with, side by side")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one or args.against is None:
        print(f"us/step {measure():.1f}")
        return 0
    ours, theirs = [], []
    for _ in range(3):
        ours.append(run_in(REPO))
        theirs.append(run_in(args.against.resolve()))
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"this checkout {a:.0f} us/step, {args.against} {b:.0f} us/step: {b / a:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
