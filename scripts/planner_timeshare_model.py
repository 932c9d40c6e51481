#!/usr/bin/env python3
"""A candidate generator model for the capacity planner, beside the one it
uses (pipeline/planner/capacity.py), against measured sustained maxima.
Analysis only: `bin/epd-plan` does not use it (docs/benchmarks.md, session
15, says why: it fixes the colocated figures at 4 images and 400 tokens but
not the choice, and worsens the aggregated 1-image ones).

What it changes, per generator at r requests/s of P prompt tokens and O
output tokens (costs read at the encoders' busy share, as capacity.py does):
- A mixed step carries the B decoding sequences through its prefill's
  matmuls, so no decode step is charged on top of it: mixed steps take
  r*P*t_p + m*B*t_p seconds a second (m = r*P / (budget - B) of them, full
  chunks), plus, aggregated, the vision forwards of the images in the
  chunks, run as power-of-two graph pieces (models/vision_graphs.py).
- Decode-only steps of d(B) fill the time left; every step advances every
  sequence, so TPOT = 1 / (m + decode-only steps a second), B = r*O*TPOT.
- TTFT = the P99 wait of an M/M/1 queue at the mixed steps' busy share W,
  whose service is a request's prefill (+ vision), plus the prefill's steps.

    python3 scripts/planner_timeshare_model.py docs/results/h200-sustained-paced-2026-12-03.json \
        docs/profiles/h200-qwen2.5-vl-3b-2026-12-03-session15.json
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline.planner import capacity  # noqa: E402
from pipeline.planner.profile import Profile, decode_step_s, prefill_s_per_token, vision_batch_s  # noqa: E402
from pipeline.bench.search import sustained_rate  # noqa: E402
from pipeline.models.vision_graphs import plan_pieces  # noqa: E402
from planner_vs_steps import read_runs  # noqa: E402

GRAPH_PIECE_MAX = 16   # the stages' --vision-graphs in these runs


def pieces_s(profile: Profile, tokens: int, images: float) -> float:
    """Vision seconds for `images` images of one size, cut into pieces as
    the stages cut them (vision_graphs.plan_pieces); a fractional count
    blends the two whole counts around it."""
    def whole(count: int) -> float:
        pieces = plan_pieces([(1, 1, 1)] * count, GRAPH_PIECE_MAX)   # one grid: only the sizes matter
        return sum(vision_batch_s(profile, tokens, len(indices)) for _, indices in pieces)
    low = math.floor(images)
    return (1 - (images - low)) * whole(low) + (images - low) * whole(low + 1)


def generator(profile: Profile, work: capacity.Workload, inline_vision: bool, r: float, share: float) -> dict:
    """The generator's figures at r requests/s; `failed` names what breaks."""
    t_p = prefill_s_per_token(profile, share)
    budget, P, O = profile.limits.max_num_batched_tokens, work.prompt_tokens, work.output_len
    tpot, mixed_share, vision_s = decode_step_s(profile, 1, share), 0.0, 0.0
    for _ in range(200):
        batch = r * O * tpot
        chunk = budget - batch
        if chunk <= 1:
            return {"failed": "generator"}
        mixed = r * P / chunk
        vision_s = 0.0
        if inline_vision and work.images:
            per_step = max(1.0, min(profile.limits.local_encode_tokens // work.image_tokens, work.images * chunk / P))
            vision_s = work.images * pieces_s(profile, work.image_tokens, per_step) / per_step
        mixed_share = r * P * t_p + mixed * batch * t_p + r * vision_s
        if mixed_share >= 1:
            return {"failed": "generator", "busy": mixed_share}
        new = 1 / (mixed + (1 - mixed_share) / decode_step_s(profile, batch, share))
        converged = abs(new - tpot) < 1e-9
        tpot = new
        if converged:
            break
    batch = r * O * tpot
    out = {"tpot_s": tpot, "batch": batch, "busy": mixed_share}
    if batch > profile.limits.max_num_seqs:
        return {**out, "failed": "max_num_seqs"}
    if tpot > work.slo_tpot_s:
        return {**out, "failed": "tpot"}
    service = P * t_p + vision_s
    wait = service / (1 - mixed_share) * math.log(max(1.0, 100 * mixed_share))
    return {**out, "ttft_s": wait + math.ceil(P / (budget - batch)) * tpot}


def verdict(profile: Profile, work: capacity.Workload, layout: capacity.Layout, rate: float) -> str | None:
    """None when `layout` sustains `rate`, else the bound; the encoders as capacity.py models them."""
    encoder_gpus, generator_gpus = layout.stage_gpus()
    busy, encoders, found = 1.0, [], {}
    for _ in range(3):   # the two sides' busy shares depend on each other
        encoders = [capacity._encoder(profile, work, layout, gpu, encoder_gpus, generator_gpus, rate, busy)
                    for gpu in encoder_gpus]
        share = min(1.0, sum(e["busy"] for e in encoders)) if layout.placement == "colocated" else 0.0
        found = generator(profile, work, layout.placement == "aggregated", rate, share)
        busy = found.get("busy", 1.0)
    if not all(e["stable"] for e in encoders):
        return "encoder"
    if found.get("failed"):
        return found["failed"]
    encode_s = max((e["latency_s"] for e in encoders), default=0.0)
    return "ttft" if found["ttft_s"] + encode_s > work.slo_ttft_s else None


def max_rate(profile: Profile, work: capacity.Workload, layout: capacity.Layout) -> tuple[float, str]:
    low, high = 0.0, 1.0
    while verdict(profile, work, layout, high) is None:
        low, high = high, high * 2
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        low, high = (middle, high) if verdict(profile, work, layout, middle) is None else (low, middle)
    return low, verdict(profile, work, layout, high) or "none"


def sustained(steps: list[dict]) -> float | None:
    """The measured figure: the sustained rate of the highest passing step."""
    passing = [s for s in steps if s["passed"]]
    return sustained_rate(max(passing, key=lambda s: s["request_rate"])) if passing else None


def main(argv: list[str]) -> int:
    runs = read_runs(argv, __doc__.splitlines()[0])
    print("layout      workload     measured | this model        | capacity.py")
    for name, workloads in runs.steps.items():
        for key, steps in workloads.items():
            work, layout, measured = runs.workload(key), runs.layouts[name], sustained(steps)
            rate, bound = max_rate(runs.profile, work, layout)
            main_model = capacity.predict(runs.profile, work, layout)
            error = lambda x: f"{100 * (x / measured - 1):+4.0f}%" if measured else "  n/a"  # noqa: E731
            print(f"{name:<11} {key:<12} {measured or 0:7.2f} | {rate:6.2f} {error(rate)} {bound:<12} | "
                  f"{main_model.max_rate:6.2f} {error(main_model.max_rate)} {main_model.bound}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
