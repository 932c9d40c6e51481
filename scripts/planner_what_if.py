#!/usr/bin/env python3
"""What the capacity planner says a change of one cost would do to the
EPD/aggregated ratio on one GPU: the profile's vision or prefill times
scaled, or the interference between co-running stages (the gap between
each "beside" figure and its "alone" one) cut. CPU only; analysis for
docs/benchmarks.md (session 25), not used by any stage.

    python3 scripts/planner_what_if.py docs/profiles/h200-qwen2.5-vl-3b-2026-12-03-session15.json \
        --images 4 --input-len 400
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.planner.capacity import Layout, Workload, predict  # noqa: E402
from pipeline.planner.profile import Profile, image_tokens, load_profile  # noqa: E402

AGGREGATED, COLOCATED = Layout(0, 1, "aggregated", 1), Layout(1, 1, "colocated", 1)


def scaled(points: list, factor: float) -> list:
    """Every time of the points (alone and beside) times `factor`."""
    def times(p):
        return {name: None if getattr(p, name) is None else getattr(p, name) * factor
                for name in ("alone_s", "beside_s", "beside_half_s")}
    return [msgspec.structs.replace(p, **times(p)) for p in points]


def less_interference(points: list, kept: float) -> list:
    """Each beside figure moved to alone + kept * (beside - alone)."""
    def toward(p, name):
        beside = getattr(p, name)
        return None if beside is None else p.alone_s + kept * (beside - p.alone_s)
    return [msgspec.structs.replace(p, beside_s=toward(p, "beside_s"), beside_half_s=toward(p, "beside_half_s"))
            for p in points]


def variants(profile: Profile) -> list[tuple[str, Profile]]:
    replace = msgspec.structs.replace
    found = [("the profile as measured", profile)]
    found += [(f"vision at {f:.0%} of its times", replace(profile, vision=scaled(profile.vision, f)))
              for f in (0.8, 0.6)]
    found += [(f"prefill at {f:.0%} of its times", replace(profile, prefill=scaled(profile.prefill, f)))
              for f in (0.8, 0.6)]
    found += [(f"interference at {kept:.0%} of measured",
               replace(profile, vision=less_interference(profile.vision, kept),
                       decode=less_interference(profile.decode, kept),
                       prefill=less_interference(profile.prefill, kept)))
              for kept in (0.75, 0.5, 0.0)]
    return found


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile", type=Path)
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--input-len", type=int, default=400)
    p.add_argument("--output-len", type=int, default=150)
    p.add_argument("--image-size", default="640x640")
    args = p.parse_args(argv)
    profile = load_profile(args.profile)
    width, height = (int(v) for v in args.image_size.split("x"))
    load = Workload(args.images, image_tokens(profile, width, height), args.input_len, args.output_len)
    print(f"{'change':<40} aggregated  colocated  EPD/aggregated")
    for name, changed in variants(profile):
        aggregated, colocated = (predict(changed, load, layout).max_rate for layout in (AGGREGATED, COLOCATED))
        print(f"{name:<40} {aggregated:10.2f} {colocated:10.2f}  {colocated / aggregated:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
