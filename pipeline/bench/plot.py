"""P99 TTFT and P99 TPOT against request rate, one curve per configuration.

`python -m pipeline.bench.plot --series EPD=epd.json --series aggregated=agg.json
--out chart.png` draws epd-bench result files (one result, a sweep's list, or
a goodput search's object) on one chart; `bin/epd-bench --plot` draws its own
run. Runs at rate "inf" have no place on a rate axis and are left out.
Needs matplotlib (the `bench` extra); it draws off-screen (Agg).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

PANELS = (("p99_ttft_ms", "ttft", "P99 TTFT (ms)"), ("p99_tpot_ms", "tpot", "P99 TPOT (ms)"))


def results_of(data) -> list[dict]:
    """The per-rate results in an epd-bench JSON value."""
    if isinstance(data, dict) and isinstance(data.get("steps"), list):
        return data["steps"]
    if isinstance(data, dict):
        return [data]
    if isinstance(data, list) and all(isinstance(item, dict) for item in data):
        return data
    raise ValueError("not an epd-bench result (an object, a list of objects, or a search with steps)")


def load_results(path: Path) -> list[dict]:
    try:
        return results_of(json.loads(Path(path).read_text()))
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _points(results: list[dict], key: str) -> tuple[list[float], list[float]]:
    rows = sorted((float(r["request_rate"]), r.get(key)) for r in results
                  if r.get("request_rate") not in (None, "inf") and math.isfinite(float(r["request_rate"])))
    rows = [(rate, value) for rate, value in rows if value is not None]
    return [rate for rate, _ in rows], [value for _, value in rows]


def plot_series(series: dict[str, list[dict]], out: Path, slos: dict[str, float] | None = None,
                title: str | None = None) -> Path:
    """Write the chart as a PNG; ValueError when no series has a finite rate."""
    if not any(_points(results, "request_rate")[0] for results in series.values()):
        raise ValueError("nothing to plot: no result has a finite request rate")
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(1, len(PANELS), figsize=(11, 4.2))
    try:
        for axis, (key, slo_name, label) in zip(axes, PANELS):
            for name, results in series.items():
                rates, values = _points(results, key)
                axis.plot(rates, values, marker="o", label=name)
            if slos and slo_name in slos:
                axis.axhline(slos[slo_name], color="grey", linestyle="--", label=f"SLO {slos[slo_name]:g} ms")
            axis.set_xlabel("request rate (req/s)")
            axis.set_ylabel(label)
            axis.grid(True, alpha=0.3)
            axis.legend()
        if title:
            figure.suptitle(title)
        figure.tight_layout()
        figure.savefig(out, format="png", dpi=110)
    finally:
        pyplot.close(figure)
    return Path(out)


def _series_arg(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=FILE like EPD=epd.json (got {text!r})")
    return label, Path(path)


def main(argv: list[str] | None = None, prog: str = "epd-bench-plot") -> int:
    from pipeline.arg_parser import OneLineParser
    from pipeline.bench.metrics import parse_goodput

    parser = OneLineParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--series", action="append", type=_series_arg, required=True, metavar="LABEL=FILE",
                        help="an epd-bench JSON file and its legend label; repeatable")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLO lines to draw")
    parser.add_argument("--title")
    args = parser.parse_args(argv)
    try:
        series = {label: load_results(path) for label, path in args.series}
        plot_series(series, args.out, parse_goodput(args.goodput), args.title)
    except (ValueError, ImportError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{prog}: error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m pipeline.bench.plot"))
