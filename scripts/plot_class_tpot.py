#!/usr/bin/env python3
"""The distribution of one request class's TPOT in a mixed load, one line per
epd-bench result file (run with --save-detailed), over the measurement window:

    python3 scripts/plot_class_tpot.py --warmup-s 10 --series EPD=epd-mixed.json \
        --series aggregated=aggregated-mixed.json [--images] --out tpot.png

Text-only requests by default, those with images with --images. Each line is
the empirical CDF of the requests sent after the warm-up; the legend gives
their median and P99 (epd-bench's percentiles).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.bench.metrics import records_from_detailed  # noqa: E402
from pipeline.bench.window import WindowSpec, in_window  # noqa: E402


def class_tpots_ms(path: Path, warmup_s: float, images: bool) -> np.ndarray:
    result = json.loads(path.read_text())
    if "requests" not in result:
        raise SystemExit(f"{path}: no per-request records (run epd-bench with --save-detailed)")
    records = in_window(records_from_detailed(result["requests"]), WindowSpec(warmup_s=warmup_s))
    chosen = [r.tpot for r in records if r.success and r.tpot is not None and (r.num_images > 0) == images]
    return np.sort(np.asarray(chosen) * 1000.0)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--series", action="append", required=True, metavar="NAME=FILE")
    ap.add_argument("--warmup-s", type=float, default=0.0, help="the run's --warmup-s (left out)")
    ap.add_argument("--images", action="store_true", help="the requests with images, not the text-only ones")
    ap.add_argument("--title", default="")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for item in args.series:
        name, _, file = item.partition("=")
        tpots = class_tpots_ms(Path(file), args.warmup_s, args.images)
        if not len(tpots):
            raise SystemExit(f"{file}: no completed requests of that class in the window")
        label = f"{name}: median {np.percentile(tpots, 50):.1f}, P99 {np.percentile(tpots, 99):.1f} ms"
        ax.step(tpots, np.arange(1, len(tpots) + 1) / len(tpots), where="post", label=label)
    ax.set_xlabel(f"TPOT of {'requests with images' if args.images else 'text-only requests'} (ms)")
    ax.set_ylabel("share of requests")
    ax.set_title(args.title or f"TPOT, requests sent after the {args.warmup_s:g} s warm-up")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
