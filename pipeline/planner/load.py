"""The load child of `bin/epd-plan --profile-out`: keeps a device busy with one
kind of work until it is stopped, so the parent can time the other kind
beside it.

    python -m pipeline.planner.load --role generator|vision --device cuda:0 [...]

generator: a loaded generator's steps: 32 sequences decoding while a new
1500-token prompt is prefilled in every step (mixed steps, as under load:
it fits the default 2048-token budget beside the decodes).
vision: vision forwards of LOAD_VISION_BATCH (8) images of --width x --height.
--duty F: busy F of the time (after each unit of work it idles
(1/F - 1) times as long); 1 runs back to back. Prints READY once the loop
runs; SIGTERM stops it. --report-every S: a PROGRESS line every S seconds
(units of work done, seconds since READY), for a caller that wants the
load's own rate (scripts/gpu_sm_share_sweep.py).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import torch

from pipeline.planner.measure import PROGRESS, READY, Box, MeasureSettings
from pipeline.planner.profile import LOAD_VISION_BATCH

DECODING = 32
PREFILL = 1500
DECODE_TOKENS = 1024


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pipeline.planner.load", description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("generator", "vision"), required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--model", type=Path)
    p.add_argument("--random-weights")
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--height", type=int, default=640)
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--vision-graphs", type=int, default=0)
    p.add_argument("--duty", type=float, default=1.0, help="share of the time spent working, in (0, 1]")
    p.add_argument("--report-every", type=float, default=0.0, metavar="S", help="a progress line every S seconds")
    args = p.parse_args(argv)
    if not 0 < args.duty <= 1:
        p.error("--duty must be in (0, 1]")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    settings = MeasureSettings(args.model, args.random_weights, "load", args.device, args.dtype,
                               image_sizes=((args.width, args.height),), context_len=args.context_len,
                               vision_graphs=args.vision_graphs, beside=False)
    box = Box(settings, vision=args.role == "vision", engine=args.role == "generator")
    if args.role == "vision":
        pixels, grids = box.vision_input(args.width, args.height, LOAD_VISION_BATCH)
        work = lambda: box.vision(pixels, grids)  # noqa: E731
    else:
        decoding: set[str] = set()

        def work():
            # Keep DECODING sequences going (each gets a bounded length: the
            # KV cache must admit it) and one new prompt per step.
            while len(decoding) < DECODING:
                decoding.add(box.add(args.context_len, DECODE_TOKENS))
            box.add(PREFILL, 1)
            for out in box.engine.step():
                if out.finished:
                    decoding.discard(out.request_id)
    idle_per_busy = 1.0 / args.duty - 1.0
    with torch.inference_mode():
        work()
        box.sync()
        print(READY, flush=True)
        units, since = 0, time.perf_counter()
        reported = since
        while not stopping:
            started = time.perf_counter()
            work()
            box.sync()
            units += 1
            if args.report_every and started - reported >= args.report_every:
                reported = started
                print(f"{PROGRESS} {units} {time.perf_counter() - since:.4f}", flush=True)
            if idle_per_busy:
                time.sleep((time.perf_counter() - started) * idle_per_busy)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
