#!/usr/bin/env python3
"""What prefill pacing trades, one point per interference run: the text-only
requests' P99 TTFT against their P99 TPOT over the measurement window, one
line per layout, each point labelled with its --prefill-pacing-ms (or "off"):

    python3 scripts/plot_pacing_tradeoff.py docs/results/h200-interference-2026-12-04-s21.json \
        --slo-ttft-ms 2000 --out tradeoff.png

The input is a results file whose "calls" each hold "runs": {name: summary}
(summaries of scripts/gpu_sustained.py --interference-rate, as
scripts/gpu_interference.sh names them: layout[-paceN]); a name run in several
calls gives a point per call.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def points(results: dict) -> dict[str, list[tuple[float, float, str]]]:
    """layout -> [(text P99 TTFT ms, text P99 TPOT ms, label)], by pace target, unpaced first."""
    by_layout: dict[str, list[tuple[float, float, float, str]]] = {}
    for call in results["calls"]:
        for name, summary in call["runs"].items():
            text = summary["interference"]["window_by_class"]["text_only"]
            pace = re.search(r"-pace([0-9.]+)", name)
            target = float(pace.group(1)) if pace else float("inf")
            label = f"{pace.group(1)} ms" if pace else "off"
            by_layout.setdefault(name.split("-")[0], []).append(
                (target, text["p99_ttft_ms"], text["p99_tpot_ms"], label))
    return {layout: [(ttft, tpot, label) for _, ttft, tpot, label in sorted(rows, key=lambda r: -r[0])]
            for layout, rows in by_layout.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for layout, rows in sorted(points(json.loads(args.results.read_text())).items()):
        ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label=layout)
        for ttft, tpot, label in rows:
            ax.annotate(label, (ttft, tpot), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axvline(args.slo_ttft_ms, color="grey", linestyle="--", linewidth=1, label="TTFT SLO")
    ax.set_xlabel("text-only P99 TTFT (ms)")
    ax.set_ylabel("text-only P99 TPOT (ms)")
    ax.set_title("prefill pacing: first-token wait against decode steadiness")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
