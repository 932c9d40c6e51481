#!/usr/bin/env python3
"""One workload of the EPD-vs-aggregated goodput comparison (issue 6), both
configurations, in one run that fits one 10-minute device call:

    python scripts/gpu_goodput.py --images 4 --input-len 400 --out results/4img-400

- epd:        bin/epd-launch --encoders 1 --generators 1 --gpus 0,1
- aggregated: bin/epd-launch --mode aggregated --generators 2 --gpus 0,1
both with --random-weights qwen2.5-vl-3b --dtype bfloat16 --device cuda.
--epd-generators, --aggregated-generators and --gpus change the layouts
(issue 7: 3, 4 and 0,1,2,3 for 1E+3G against 4 aggregated generators).

Per configuration: launch, wait for /health, a warm-up burst (first-use
decode-graph captures and allocations), then epd-bench's goodput search
(geometric bisection of the request rate; a step passes when no request
failed and P99 TTFT <= 2000 ms and P99 TPOT <= 50 ms), then a clean stop.
--budget-s bounds each configuration, launch and stop included, by
sizing the search's steps. Writes under --out: <config>.json (every step,
rewritten after each one), <config>.png, logs/, summary.json (after each
configuration, and on SIGTERM/SIGINT with what exists), goodput.png, and
prints `goodput EPD/aggregated (N images, M tokens): R.RRx` (ratio of the
highest passing request rates).

--tiny runs the same on the CPU with the built-in tiny model (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.bench.launched import LaunchedStack, StackError, read_json, run_bench  # noqa: E402

CONFIGS = ("epd", "aggregated")
# The generator's default KV cache (256 MiB) holds ~7k tokens of the 3B
# model: two or three 4-image requests. The arena default holds ~120
# embeddings of a 640x640 image.
GPU_STAGE_ARGS = ("generator=--kv-cache-mib=32768", "encoder=--arena-mib=4096")
STOP_RESERVE_S = 20.0  # stopping the stack, writing results
WARMUP_TIMEOUT_S = 60.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for results")
    p.add_argument("--configs", default="epd,aggregated", help="comma list of epd, aggregated")
    p.add_argument("--images", type=int, default=4, help="images per request")
    p.add_argument("--image-size", type=int, default=640, help="square images of this many pixels")
    p.add_argument("--input-len", type=int, default=400, help="text tokens per request")
    p.add_argument("--output-len", type=int, default=150)
    p.add_argument("--budget-s", type=float, default=270.0, help="per configuration, launch and stop included")
    p.add_argument("--low", type=float, default=0.5, help="lowest request rate searched (req/s)")
    p.add_argument("--high", type=float, default=64.0, help="highest request rate searched (req/s)")
    p.add_argument("--steps", type=int, default=6, help="search steps at most")
    p.add_argument("--max-step-prompts", type=int, default=240,
                   help="requests per search step at most (the client makes their noise JPEGs first, ~10 ms each)")
    p.add_argument("--warmup-prompts", type=int, default=16)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--shape", default="qwen2.5-vl-3b", help="--random-weights shape")
    p.add_argument("--gpus", default="0,1")
    p.add_argument("--epd-generators", type=int, default=1, help="generators beside the one encoder")
    p.add_argument("--aggregated-generators", type=int, default=2)
    p.add_argument("--stage-arg", action="append", default=None, metavar="ROLE=ARG",
                   help=f"epd-launch --stage-arg; replaces the defaults {' '.join(GPU_STAGE_ARGS)}")
    p.add_argument("--text-only-fraction", type=float, default=0.0,
                   help="share of requests without images (results split by class)")
    p.add_argument("--fixed-rate", type=float, metavar="R",
                   help="one run at R requests/s (e.g. aggregated's maximum) instead of the search")
    p.add_argument("--tiny", action="store_true", help="the built-in tiny model on the CPU (smoke test)")
    args = p.parse_args(argv)
    args.configs = args.configs.split(",")
    if not args.configs or any(c not in CONFIGS for c in args.configs):
        p.error(f"--configs must list {' and/or '.join(CONFIGS)}")
    if args.epd_generators < 1 or args.aggregated_generators < 1:
        p.error("--epd-generators and --aggregated-generators must be at least 1")
    if args.budget_s <= STOP_RESERVE_S + 10:
        p.error(f"--budget-s must exceed {STOP_RESERVE_S + 10:.0f} s")
    return args


def label(config: str, args: argparse.Namespace) -> str:
    if config == "epd":
        n = args.epd_generators
        return f"EPD (1 encoder + {n} generator{'s' if n != 1 else ''})"
    return f"aggregated ({args.aggregated_generators} generators)"


def launch_args(config: str, args: argparse.Namespace) -> list[str]:
    layout = ["--encoders", "1", "--generators", str(args.epd_generators)] if config == "epd" else [
        "--mode", "aggregated", "--generators", str(args.aggregated_generators)]
    if args.tiny:
        return [*layout, "--device", "cpu"]
    stage_args = GPU_STAGE_ARGS if args.stage_arg is None else args.stage_arg
    return [*layout, "--gpus", args.gpus, "--random-weights", args.shape, "--dtype", "bfloat16",
            "--device", "cuda", *[f"--stage-arg={a}" for a in stage_args]]


def workload_args(args: argparse.Namespace) -> list[str]:
    size = args.image_size
    return ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
            "--random-mm-base-items-per-request", str(args.images),
            "--random-mm-bucket-config", f"{{({size}, {size}, 1): 1.0}}", "--no-progress",
            "--text-only-fraction", f"{args.text_only_fraction:g}"]


def search_args(config: str, args: argparse.Namespace, base_url: str, search_s: float) -> list[str]:
    # Half of each step's share of the time for arrivals, half for draining
    # the queue an overloaded rate builds up.
    step_s = min(30.0, max(3.0, search_s / args.steps / 2))
    slos = ["--goodput", f"ttft:{args.slo_ttft_ms:g}", f"tpot:{args.slo_tpot_ms:g}"]
    if args.fixed_rate:
        # Half the time for arrivals, half for the queue to drain.
        prompts = max(10, min(args.max_step_prompts, int(args.fixed_rate * search_s / 2)))
        return ["--base-url", base_url, *workload_args(args), "--request-rate", f"{args.fixed_rate:g}",
                "--num-prompts", str(prompts), *slos, "--json", str(args.out / f"{config}.json")]
    return ["--base-url", base_url, *workload_args(args), "--request-rate", f"search:{args.low:g}:{args.high:g}",
            "--search-criterion", "p99", "--search-steps", str(args.steps), "--search-step-s", f"{step_s:.1f}",
            "--warmup-s", f"{min(4.0, step_s / 4):.1f}",
            "--search-budget-s", f"{search_s:.0f}", "--num-prompts", str(args.max_step_prompts), *slos,
            "--json", str(args.out / f"{config}.json"), "--plot", str(args.out / f"{config}.png"),
            "--plot-label", label(config, args)]


def run_configuration(config: str, args: argparse.Namespace, record: dict) -> None:
    """Fills `record` as it goes, so an interruption leaves what was done."""
    started = time.monotonic()
    # On the CPU, torch's default threads per stage oversubscribe the cores
    # (then a busy aggregated generator misses the proxy's liveness window).
    env = {"OMP_NUM_THREADS": "1"} if args.tiny else None
    stack = LaunchedStack(launch_args(config, args), args.out / "logs" / config, env=env)
    log = args.out / "logs" / f"{config}-bench.log"
    record["launch"] = shlex.join(["bin/epd-launch", *stack.argv[2:]])
    try:
        record["ready_s"] = round(stack.start(ready_timeout=max(30.0, args.budget_s * 0.6)), 1)
        warmup = ["--base-url", stack.base_url, *workload_args(args), "--num-prompts", str(args.warmup_prompts),
                  "--seed", "1000", "--json", str(args.out / f"{config}-warmup.json")]
        run_bench(warmup, WARMUP_TIMEOUT_S, log)
        search_s = args.budget_s - (time.monotonic() - started) - STOP_RESERVE_S
        bench = search_args(config, args, stack.base_url, search_s)
        record["bench"] = shlex.join(["bin/epd-bench", *bench])
        record["bench_exit"] = run_bench(bench, search_s, log)
    except StackError as exc:
        record["error"] = str(exc)
    finally:
        record["stop_exit"] = stack.stop()
        record["seconds"] = round(time.monotonic() - started, 1)


def search_outcome(path: Path) -> dict:
    """The highest passing rate in a (possibly partial) search file; for a
    --fixed-rate run, its result as it is."""
    found = read_json(path) or {}
    if "steps" not in found and "completed" in found:
        keys = ("request_rate", "completed", "failed", "request_goodput", "p99_ttft_ms", "p99_tpot_ms", "by_class")
        return {"fixed_rate": {k: found.get(k) for k in keys}}
    steps = found.get("steps") or []
    passing = [s for s in steps if s.get("passed")]
    best = max(passing, key=lambda s: s["request_rate"]) if passing else None
    return {"steps": len(steps), "partial": bool(found.get("partial")) or not found,
            "max_request_rate": best["request_rate"] if best else None,
            "max_request_goodput": best["request_goodput"] if best else None,
            "p99_ttft_ms_at_max": best["p99_ttft_ms"] if best else None,
            "p99_tpot_ms_at_max": best["p99_tpot_ms"] if best else None,
            "at_bound": found.get("at_bound")}


def write_summary(args: argparse.Namespace, records: dict[str, dict], interrupted: bool) -> dict:
    for config, record in records.items():
        record.update(search_outcome(args.out / f"{config}.json"))
    summary = {"workload": {"images": args.images, "image_size": args.image_size, "input_len": args.input_len,
                            "output_len": args.output_len, "slo_ttft_ms": args.slo_ttft_ms,
                            "slo_tpot_ms": args.slo_tpot_ms, "tiny": args.tiny,
                            "layouts": {c: label(c, args) for c in CONFIGS}},
               "configs": records, "interrupted": interrupted}
    epd, agg = (records.get(c, {}).get("max_request_rate") for c in CONFIGS)
    if epd is not None and agg:
        images = f"{args.images} image{'s' if args.images != 1 else ''}"
        layouts = ("" if (args.epd_generators, args.aggregated_generators) == (1, 2) else
                   f" 1E+{args.epd_generators}G vs {args.aggregated_generators}G")
        summary["ratio"] = epd / agg
        summary["line"] = f"goodput EPD/aggregated{layouts} ({images}, {args.input_len} tokens): {epd / agg:.2f}x"
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def plot_both(args: argparse.Namespace, records: dict[str, dict]) -> None:
    try:
        from pipeline.bench.plot import plot_series

        series = {label(c, args): (read_json(args.out / f"{c}.json") or {}).get("steps") or [] for c in records}
        plot_series(series, args.out / "goodput.png", {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms},
                    f"{args.images} x {args.image_size}px images, {args.input_len} text tokens")
    except (ImportError, ValueError) as exc:
        print(f"gpu_goodput: no combined plot: {exc}", file=sys.stderr)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    records: dict[str, dict] = {}
    interrupted = False
    try:
        for config in args.configs:
            records[config] = {}
            run_configuration(config, args, records[config])
            write_summary(args, records, interrupted=False)
    except KeyboardInterrupt:
        interrupted = True
    summary = write_summary(args, records, interrupted)
    if not args.fixed_rate:
        plot_both(args, records)
    for config, record in records.items():
        error = f"; {record['error']}" if "error" in record else ""
        fixed = record.get("fixed_rate")
        if fixed:
            classes = fixed.get("by_class") or {}
            parts = [f"{name} P99 TPOT {c.get('p99_tpot_ms')} ms, P99 TTFT {c.get('p99_ttft_ms')} ms"
                     for name, c in classes.items()]
            print(f"{config}: {fixed['completed']} done, {fixed['failed']} failed at {fixed['request_rate']} req/s; "
                  f"P99 TPOT {fixed['p99_tpot_ms']} ms{'; ' if parts else ''}{'; '.join(parts)}{error}")
            continue
        print(f"{config}: max rate {record.get('max_request_rate')} req/s over {record.get('steps')} steps "
              f"({record.get('seconds')} s){error}")
    if not args.fixed_rate:
        print(summary.get("line", "goodput EPD/aggregated: not measured (a configuration found no passing rate)"))
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
