#!/usr/bin/env python3
"""The capacity planner's model at each measured search step: what it
predicts (TTFT, step time, verdict) beside what the step measured. CPU
only; reads a sustained-goodput results file (docs/results/, with "steps")
and the profile it was measured with.

    python3 scripts/planner_vs_steps.py docs/results/h200-sustained-paced-2026-12-03.json \
        docs/profiles/h200-qwen2.5-vl-3b-2026-12-03-session15.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.planner.capacity import Layout, Workload, candidate_layouts, evaluate  # noqa: E402
from pipeline.planner.profile import Profile, image_tokens, load_profile  # noqa: E402

PLACEMENT = {"aggregated": "aggregated", "epd": "colocated"}  # the results' layout names -> the planner's


@dataclass(frozen=True)
class MeasuredRuns:
    """A results file's search steps, with what it takes to model them."""
    profile: Profile
    layouts: dict[str, Layout]   # by the results' layout name
    steps: dict[str, dict[str, list[dict]]]   # layout -> "4img-400tok" -> steps
    image_tokens: int
    output_len: int

    def workload(self, key: str) -> Workload:
        images, text = (int(v) for v in re.fullmatch(r"(\d+)img-(\d+)tok", key).groups())
        return Workload(images, self.image_tokens, text, self.output_len)


def read_runs(argv: list[str], description: str) -> MeasuredRuns:
    """The command line both planner scripts take: a results file and its profile."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("results", type=Path)
    p.add_argument("profile", type=Path)
    p.add_argument("--image-size", default="640x640")
    p.add_argument("--output-len", type=int, default=150)
    args = p.parse_args(argv)
    profile = load_profile(args.profile)
    width, height = (int(v) for v in args.image_size.split("x"))
    placements = {layout.placement: layout for layout in candidate_layouts(1) if layout.encoders <= 1}
    return MeasuredRuns(profile, {name: placements[kind] for name, kind in PLACEMENT.items()},
                        json.loads(args.results.read_text())["steps"], image_tokens(profile, width, height),
                        args.output_len)


def main(argv: list[str]) -> int:
    runs = read_runs(argv, __doc__.splitlines()[0])
    profile = runs.profile
    print("layout      workload    rate  | measured P99 TTFT  TPOT  | model TTFT   step  batch  verdict")
    for name, workloads in runs.steps.items():
        for key, measured in workloads.items():
            workload = runs.workload(key)
            for step in sorted(measured, key=lambda s: s["request_rate"]):
                verdict = evaluate(profile, workload, runs.layouts[name], step["request_rate"])
                generator = verdict.detail["generators"][0]
                print(f"{name:<11} {key:<11} {step['request_rate']:5.2f} | "
                      f"{step['window_p99_ttft_ms']:13.0f} ms {step['window_p99_tpot_ms']:5.1f} "
                      f"{'pass' if step['passed'] else 'miss'} | "
                      f"{generator.get('ttft_s', 0) * 1000:6.0f} ms {generator.get('step_s', 0) * 1000:6.1f} "
                      f"{generator.get('decode_batch', 0):6.0f}  {verdict.failed or 'passes'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
