#!/usr/bin/env python3
"""The capacity planner's predicted maximum beside every sustained maximum
measured on one GPU, and the layout it would choose beside the one that
measured better. CPU only; reads the sustained-goodput results files
(docs/results/) and the profile they were measured with.

    python3 scripts/planner_vs_maxima.py docs/profiles/h200-qwen2.5-vl-3b-2026-12-03-session15.json \
        docs/results/h200-sustained-paced-2026-12-03.json docs/results/h200-sustained-1img-2026-12-03-s16.json \
        docs/results/h200-sustained-4x400-2026-12-04-s23.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.bench.search import sustained_rate  # noqa: E402
from pipeline.planner.capacity import Layout, Workload, predict  # noqa: E402
from pipeline.planner.profile import Profile, image_tokens, load_profile  # noqa: E402

LAYOUTS = {"aggregated": Layout(0, 1, "aggregated", 1), "epd": Layout(1, 1, "colocated", 1)}
DEFAULT_MAX_NUM_SEQS = 128   # the bench harness's (scripts/gpu_sustained.py) unless a run says otherwise


@dataclass(frozen=True)
class Measured:
    source: str   # file name
    max_num_seqs: int
    layout: str   # aggregated or epd
    workload: str   # "4img-400tok"
    rate: float   # the sustained rate of the highest passing step


def sustained_maximum(steps: list[dict]) -> float | None:
    passing = [s for s in steps if s["passed"]]
    return sustained_rate(max(passing, key=lambda s: s["request_rate"])) if passing else None


def read_maxima(path: Path) -> list[Measured]:
    """A results file's maxima, whichever of the three layouts it was saved in."""
    data = json.loads(path.read_text())
    runs = {DEFAULT_MAX_NUM_SEQS: data["steps"]} if "steps" in data else {
        int(name.rsplit("_", 1)[1]): run for name, run in data["runs"].items()}
    found = []
    for seqs, run in runs.items():
        for layout in LAYOUTS:
            works = run.get(layout, {})
            if isinstance(works, list):   # one workload a file: named in its shape line
                images, text = re.search(r"(\d+) images, (\d+) text tokens", data["shape"]).groups()
                works = {f"{images}img-{text}tok": works}
            for key, steps in works.items():
                rate = sustained_maximum(steps)
                if rate is not None:
                    found.append(Measured(path.name, seqs, layout, key, rate))
    return found


def workload(profile: Profile, key: str, output_len: int, width: int, height: int) -> Workload:
    images, text = (int(v) for v in re.fullmatch(r"(\d+)img-(\d+)tok", key).groups())
    return Workload(images, image_tokens(profile, width, height), text, output_len)


def with_max_num_seqs(profile: Profile, seqs: int) -> Profile:
    return msgspec.structs.replace(profile, limits=msgspec.structs.replace(profile.limits, max_num_seqs=seqs))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile", type=Path)
    p.add_argument("results", type=Path, nargs="+")
    p.add_argument("--image-size", default="640x640")
    p.add_argument("--output-len", type=int, default=150)
    args = p.parse_args(argv)
    profile = load_profile(args.profile)
    width, height = (int(v) for v in args.image_size.split("x"))
    print("source                                   seqs layout      workload     measured  predicted  error  bound")
    predicted: dict[tuple, float] = {}
    errors = []
    for m in [m for path in args.results for m in read_maxima(path)]:
        at = with_max_num_seqs(profile, m.max_num_seqs)
        prediction = predict(at, workload(at, m.workload, args.output_len, width, height), LAYOUTS[m.layout])
        error = prediction.max_rate / m.rate - 1
        errors.append(abs(error))
        predicted[(m.source, m.max_num_seqs, m.workload, m.layout)] = (m.rate, prediction.max_rate)
        print(f"{m.source:<40} {m.max_num_seqs:4d} {m.layout:<11} {m.workload:<12} {m.rate:8.2f}  "
              f"{prediction.max_rate:9.2f}  {100 * error:+4.0f}%  {prediction.bound}")
    print(f"mean absolute error {100 * sum(errors) / len(errors):.1f}% over {len(errors)} maxima")
    print("where both layouts were measured: EPD/aggregated measured, predicted")
    for (source, seqs, key, layout), (rate, model) in predicted.items():
        other = predicted.get((source, seqs, key, "aggregated"))
        if layout == "epd" and other:
            print(f"{source:<40} {seqs:4d} {key:<12} {rate / other[0]:5.2f}x  {model / other[1]:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
