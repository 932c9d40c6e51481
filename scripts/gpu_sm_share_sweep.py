#!/usr/bin/env python3
"""Does an MPS SM share for the vision work protect the generator's steps,
and at what cost to the vision work? (issue 14, the interference line.)
One device call, under an MPS daemon the caller started
(bash scripts/gpu_sm_share.sh starts one):

    python3 scripts/gpu_sm_share_sweep.py [--shares 100,90,80,70,60,50] [--json OUT]

This process holds the Qwen2.5-VL-3B shape (random weights) as the planner's
profile does (pipeline/planner/measure.py) and times the generator's work
alone: decode steps by batch, and a 2048-token prefill step. Then, for each
share, a load child runs vision forwards of 8 images back to back with
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE set to the share, and the same work is
timed again beside it. The child reports its forwards, so each share also
gives the vision loop's rate: alone (while this process idles) and beside
the timings. Printed per share: each timing against alone, and the vision
rate against the uncapped alone rate.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from pipeline.planner.measure import PROGRESS, Box, MeasureSettings, load_process

SM_SHARE_VAR = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


class reporting_load(load_process):
    """The planner's vision load child, at an SM share, reporting its rate."""

    def __init__(self, settings: MeasureSettings, share: int) -> None:
        super().__init__(settings, "vision", 1.0)
        self.share = share

    def argv(self) -> list[str]:
        return super().argv() + ["--report-every", "0.25"]

    def __enter__(self) -> "reporting_load":
        os.environ[SM_SHARE_VAR] = str(self.share)
        try:
            return super().__enter__()
        finally:
            del os.environ[SM_SHARE_VAR]

    def progress(self) -> tuple[int, float]:
        """(forwards done, seconds since the child's loop began), as last reported."""
        for line in reversed(self.tail):
            if line.startswith(PROGRESS):
                units, seconds = line.split()[-2:]
                return int(units), float(seconds)
        return 0, 0.0


def rate_over(load: reporting_load, work) -> float:
    """The load's forwards a second while `work` runs (reports every 0.25 s)."""
    time.sleep(0.3)
    units0, t0 = load.progress()
    work()
    time.sleep(0.3)
    units1, t1 = load.progress()
    return (units1 - units0) / max(t1 - t0, 1e-9)


def generator_timings(box: Box, batches: list[int], prefill: int, repeats: int, wall_s: float) -> dict:
    out = {f"decode{b}": box.decode_s(b, repeats, np.mean, wall_s) for b in batches}
    out[f"prefill{prefill}"] = box.prefill_s(prefill, repeats, np.mean, wall_s)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shares", default="100,90,80,70,60,50")
    ap.add_argument("--batches", default="1,32,64")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--wall-s", type=float, default=1.5, help="each beside timing samples at least this long")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--tiny", action="store_true", help="the built-in tiny model on the CPU (a smoke test)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.tiny:
        settings = MeasureSettings(None, None, "sweep", "cpu", "float32", image_sizes=((224, 224),),
                                   kv_cache_mib=64, beside=False)
    else:
        settings = MeasureSettings(None, "qwen2.5-vl-3b", "sweep", "cuda:0", "bfloat16", vision_graphs=16,
                                   max_num_seqs=128, kv_cache_mib=8192, beside=False)
    box = Box(settings, vision=False, engine=True)
    with torch.inference_mode():
        alone = generator_timings(box, batches, args.prefill, 8, 0.0)
    print("alone: " + "  ".join(f"{k} {v * 1e3:.2f} ms" for k, v in alone.items()), flush=True)
    result = {"alone_s": alone, "shares": {}}
    vision_alone_uncapped = None
    shares = [int(s) for s in args.shares.split(",")]
    if shares[0] != 100:
        ap.error("--shares must begin with 100: the vision rate's baseline")
    for share in shares:
        with reporting_load(settings, share) as load, torch.inference_mode():
            vision_alone = rate_over(load, lambda: time.sleep(2.0))
            beside: dict = {}
            vision_beside = rate_over(load, lambda: beside.update(
                generator_timings(box, batches, args.prefill, 16, args.wall_s)))
        vision_alone_uncapped = vision_alone_uncapped or vision_alone
        row = {"beside_s": beside, "x_alone": {k: beside[k] / alone[k] for k in alone},
               "vision_forwards_per_s_alone": vision_alone, "vision_forwards_per_s_beside": vision_beside,
               "vision_alone_x_uncapped": vision_alone / vision_alone_uncapped,
               "vision_beside_x_uncapped": vision_beside / vision_alone_uncapped}
        result["shares"][share] = row
        print(f"share {share:3d}%: " + "  ".join(f"{k} x{v:.2f}" for k, v in row["x_alone"].items())
              + f"  | vision {vision_alone:.1f}/s alone ({row['vision_alone_x_uncapped']:.2f}x uncapped),"
              f" {vision_beside:.1f}/s beside ({row['vision_beside_x_uncapped']:.2f}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
