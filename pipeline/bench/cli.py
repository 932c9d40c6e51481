"""bin/epd-bench: open-loop load generator for an OpenAI-compatible chat endpoint.

Flags follow vLLM's `vllm bench serve` where the meaning is the same. Prints
one JSON result per request rate on stdout; --json also writes them to a file
(an object for one rate, a list for a sweep like --request-rate 2,4,8, and
for a goodput search, --request-rate search:LOW:HIGH, an object with every
step and the maximum found, rewritten after each step so an interrupted
search keeps what it measured). Every result also has the measurement
window's offered and achieved rates (window.py); a search step must sustain
its rate as well as meet the SLOs (search.py). --plot draws P99 TTFT and
TPOT against rate. Bad arguments exit 2 and an unreachable server exits 1,
each with one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

from pipeline.arg_parser import OneLineParser
from pipeline.bench.client import ArrivalSpan, BenchError, bench_runner, run_sweep
from pipeline.bench.dataset import RandomMMConfig, parse_bucket_config
from pipeline.bench.metrics import parse_goodput
from pipeline.bench.search import (CRITERIA, DEFAULT_STEP_S, DEFAULT_TARGET, DEFAULT_WARMUP_S, SearchSettings,
                                   describe_step, parse_search, search_max_goodput)
from pipeline.bench.stop import DEFAULT_DRAIN_TIMEOUT_S
from pipeline.bench.window import DEFAULT_SUSTAINED_FRACTION, WindowSpec

# A search step sends at least this many requests, so attainment is a fraction of something.
MIN_STEP_PROMPTS = 10
# Requests per fixed-rate run when --num-prompts is not given (a search step
# has no default cap: it sends rate * --search-step-s).
DEFAULT_NUM_PROMPTS = 100


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--request-rate {text!r} must be a number, inf, a comma list like 2,4,8, "
                         "or search:LOW:HIGH") from None
    if not all(rate > 0 for rate in rates):
        raise ValueError(f"--request-rate {text!r}: every rate must be > 0")
    return rates


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="epd-bench", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name (default: first id from GET /v1/models)")
    p.add_argument("--dataset-name", choices=("random-mm",), default="random-mm")
    p.add_argument("--num-prompts", type=int,
                   help=f"requests per rate (default {DEFAULT_NUM_PROMPTS}); in a search, a cap on a step's "
                   "rate*--search-step-s requests, none unless given (a cap that ends a step's arrivals early "
                   "shortens its measurement window)")
    p.add_argument("--request-rate", default="inf",
                   help="requests/s, inf, a sweep like 2,4,8, or search:LOW:HIGH for the maximum goodput")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    p.add_argument("--random-input-len", type=int, default=1024, help="text length in words (~tokens)")
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="words every prompt starts with, the same for all, before its random ones (~tokens)")
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-mm-base-items-per-request", type=int, default=1)
    p.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0)
    p.add_argument("--random-mm-bucket-config", default="{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}",
                   help="Python dict {(H, W, 1): probability}")
    p.add_argument("--image-reuse", type=float, default=0.0,
                   help="fraction of images taken from a small shared pool (exercises dedup)")
    p.add_argument("--text-only-fraction", type=float, default=0.0,
                   help="fraction of requests sent without images; results then split by class")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--search-criterion", choices=CRITERIA, default="attainment",
                   help="search: besides --sustained-fraction, a step passes on SLO attainment >= "
                   "--goodput-target, or (p99) when no request failed and every SLO holds for its metric's "
                   "P99; both over the requests sent after the warm-up")
    p.add_argument("--goodput-target", type=float, default=DEFAULT_TARGET, metavar="FRACTION",
                   help="search, attainment criterion: the fraction of requests that must meet every SLO "
                   "(default 0.9, DistServe's SLO attainment)")
    p.add_argument("--search-steps", type=int, default=6, help="search: most steps")
    p.add_argument("--search-step-s", type=float, default=DEFAULT_STEP_S, metavar="S",
                   help=f"search: seconds of arrivals per step: a step sends rate*S requests spread over S "
                   f"(the warm-up its share; at least {MIN_STEP_PROMPTS}, at most --num-prompts if given; "
                   f"default {DEFAULT_STEP_S:g})")
    p.add_argument("--search-budget-s", type=float, metavar="S",
                   help="search: start no step that would likely end after S seconds")
    p.add_argument("--search-resolution", type=float, default=0.05, help="search: stop at HIGH/LOW <= 1+this")
    p.add_argument("--warmup-s", type=float, metavar="S",
                   help=f"arrivals in the first S seconds are warm-up, outside the measurement window "
                   f"(default {DEFAULT_WARMUP_S:g} in a search, 0 for a fixed rate)")
    p.add_argument("--sustained-fraction", type=float, default=DEFAULT_SUSTAINED_FRACTION, metavar="FRACTION",
                   help="a search step passes only if its achieved rate is at least this fraction of its "
                   f"offered rate (default {DEFAULT_SUSTAINED_FRACTION:g}; 0 turns the check off); every run "
                   "reports whether it was sustained")
    p.add_argument("--drain-timeout-s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="S",
                   help="search: cancel what a step still runs S seconds after its last arrival plus its "
                   f"typical latency (default {DEFAULT_DRAIN_TIMEOUT_S:g}); a step that fell behind is "
                   "cancelled sooner. Fixed-rate runs wait for every request")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--save-detailed", action="store_true",
                   help="add each request's lengths, times and errors to every run in --json (`requests`)")
    p.add_argument("--plot", type=Path, metavar="PNG", help="draw P99 TTFT and TPOT against request rate")
    p.add_argument("--plot-label", help="legend label of this run (default: the model id)")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


def build_dataset(args: argparse.Namespace) -> RandomMMConfig:
    # A search sizes each step itself; the dataset's count is then only its cap.
    num_prompts = DEFAULT_NUM_PROMPTS if args.num_prompts is None else args.num_prompts
    return RandomMMConfig(
        num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
        args.random_mm_base_items_per_request, args.random_mm_num_mm_items_range_ratio,
        parse_bucket_config(args.random_mm_bucket_config), args.image_reuse, args.text_only_fraction,
        args.random_prefix_len)


def build_search(args: argparse.Namespace, slos: dict[str, float]) -> SearchSettings | None:
    bounds = parse_search(args.request_rate)
    if bounds is None:
        return None
    warmup_s = DEFAULT_WARMUP_S if args.warmup_s is None else args.warmup_s
    return SearchSettings(*bounds, slos, args.search_criterion, args.goodput_target, args.search_steps,
                          args.search_resolution, args.search_budget_s, args.sustained_fraction, warmup_s,
                          args.search_step_s, args.drain_timeout_s)


def fixed_rate_window(args: argparse.Namespace) -> WindowSpec:
    return WindowSpec(0.0 if args.warmup_s is None else args.warmup_s, args.sustained_fraction)


def search_outcome(found: dict) -> str:
    if found["max_request_rate"] is None:
        return (f"epd-bench: no step passed (the maximum lies below {found['search']['low']:g} req/s, "
                "or the SLOs cannot be met)")
    rate, goodput, offered, achieved, sustained = (
        "n/a" if found[key] is None else f"{found[key]:.3g}"
        for key in ("max_request_rate", "max_request_goodput", "max_offered_rate", "max_achieved_rate",
                    "max_sustained_rate"))
    return (f"epd-bench: maximum rate meeting the SLOs: {rate} req/s (goodput {goodput}; its window offered "
            f"{offered} and achieved {achieved} req/s: sustained {sustained} req/s)")


def write_json(path: Path | None, value) -> None:
    if path is None:
        return
    try:
        path.write_text(json.dumps(value, indent=2) + "\n")
    except OSError as exc:
        raise BenchError(f"cannot write {path}: {exc.strerror or exc}") from None


async def run_search(args: argparse.Namespace, dataset: RandomMMConfig, slos: dict[str, float],
                     settings: SearchSettings) -> dict:
    steps: list[dict] = []

    def on_step(result: dict) -> None:
        steps.append(result)
        print(json.dumps(result), flush=True)
        print(describe_step(len(steps), result, settings), file=sys.stderr, flush=True)
        write_json(args.json, {"partial": True, "search": asdict(settings), "steps": steps})

    async with bench_runner(args.base_url, args.model, dataset, args.burstiness, args.max_concurrency,
                            args.seed, slos, not args.no_progress, window=settings.window(),
                            stop=settings.stop(), save_detailed=args.save_detailed) as runner:
        async def measure(rate: float, index: int) -> dict:
            span = ArrivalSpan(settings.step_s, MIN_STEP_PROMPTS, args.num_prompts, settings.warmup_s)
            return await runner.measure(rate, index, span)

        return await search_max_goodput(measure, settings, on_step)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        slos = parse_goodput(args.goodput)
        search = build_search(args, slos)
        rates = None if search else parse_rates(args.request_rate)
        window = None if search else fixed_rate_window(args)
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if not args.burstiness > 0:
            raise ValueError("--burstiness must be > 0")
        dataset = build_dataset(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        if search:
            found = asyncio.run(run_search(args, dataset, slos, search))
            results, saved = found["steps"], found
            print(search_outcome(found), file=sys.stderr)
        else:
            results = asyncio.run(run_sweep(args.base_url, args.model, dataset, rates, args.burstiness,
                                            args.max_concurrency, args.seed, slos, not args.no_progress,
                                            window=window, save_detailed=args.save_detailed))
            saved = results[0] if len(results) == 1 else results
            for result in results:
                print(json.dumps(result))
        write_json(args.json, saved)
        if args.plot:
            plot_run(args, results, slos)
    except (BenchError, ValueError, ImportError) as exc:
        print(f"epd-bench: error: {exc}", file=sys.stderr)
        return 1
    return 0


def plot_run(args: argparse.Namespace, results: list[dict], slos: dict[str, float]) -> None:
    from pipeline.bench.plot import plot_series

    label = args.plot_label or (results[0].get("model_id") if results else None) or "epd-bench"
    try:
        plot_series({label: results}, args.plot, slos)
    except OSError as exc:
        raise BenchError(f"cannot write {args.plot}: {exc.strerror or exc}") from None
