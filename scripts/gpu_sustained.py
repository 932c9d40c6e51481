#!/usr/bin/env python3
"""Sustained goodput of one layout over several workloads, one launch
(issue 14; one device call each):

    python scripts/gpu_sustained.py --layout epd --out OUT --workload 4:400 --workload 1:400:2 \
        [--profile PROFILE.json] [--mixed-search 3:14:24] [--interference-rate R | --interference-from F.json]

--layout epd: bin/epd-launch --encoders 1 --generators 1 --placement colocated
(so the launcher starts its own MPS daemon on the shared GPU); aggregated:
--mode aggregated --generators 1. Both with --random-weights SHAPE (--shape,
default qwen2.5-vl-3b) --dtype bfloat16 --device cuda --gpus 0 and the same stage flags. Per
workload I:T[:STEPS[:LOW:HIGH]] (I images of 640x640, or clips with --video; T text tokens, 150 output
tokens): a warm-up burst, then epd-bench's sustained goodput search
(--step-s of arrivals per step, the first --warmup-s of them warm-up; a step
passes with no failure, P99 TTFT <= 2 s, P99 TPOT <= 50 ms and achieved >=
0.95x offered), its bracket centred on epd-plan's prediction for this layout
when --profile is given. --mixed-search STEPS:LOW:HIGH searches the mixed
load too: 4 images, 400 tokens, half of the requests text-only. Then one
fixed-rate run of that mixed load (the interference run) at
--interference-rate, or at the maximum read from a result file
(--interference-from), or at this run's own mixed maximum. Every run saves
its per-request records (epd-bench --save-detailed). --tiny runs all of it
on the CPU with the tiny model (or --shape's random weights, for a tiny
shape). Writes OUT/<layout>-<I>img-<T>tok.json per
search, OUT/<layout>-mixed-search.json, OUT/<layout>-mixed.json,
OUT/<layout>-summary.json and logs/.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.bench.launched import LaunchedStack, StackError, read_json, run_bench  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STAGE_ARGS = ("generator=--max-num-seqs=128", "generator=--encoder-cache-tokens=65536",
              "encoder=--vision-graphs=16", "encoder=--vision-warmup=640x640",
              "generator=--vision-graphs=16", "generator=--vision-warmup=640x640")
SLOS = ("ttft:2000", "tpot:50")
FALLBACK_RATE = {"epd": 12.0, "aggregated": 10.0}  # req/s at 4 images, 400 tokens, scaled by prompt size


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", choices=("epd", "aggregated"), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--workload", action="append", default=[], metavar="I:T[:STEPS[:LOW:HIGH]]",
                   help="images, text tokens, search steps, and the bracket (default: around the prediction)")
    p.add_argument("--profile", type=Path, help="epd-plan profile: brackets centred on its predictions")
    p.add_argument("--around", default="0.7:1.4", metavar="LOW:HIGH",
                   help="a bracket not given is LOW to HIGH times the prediction")
    p.add_argument("--interference-rate", type=float)
    p.add_argument("--interference-from", type=Path, help="a search result file whose maximum sets the rate")
    p.add_argument("--mixed-search", metavar="STEPS:LOW:HIGH", help="search the half text-only load too")
    p.add_argument("--step-s", type=float, default=30.0, help="seconds of arrivals per search step")
    p.add_argument("--warmup-s", type=float, default=4.0, help="warm-up seconds at the start of every run")
    p.add_argument("--output-len", type=int, default=150)
    p.add_argument("--image-size", type=int, default=640)
    p.add_argument("--video", metavar="H,W,T", help="send clips of T frames at HxW (epd-bench's video "
                   "bucket) instead of images: a workload's I counts clips")
    p.add_argument("--launch-arg", action="append", default=[], help="extra bin/epd-launch flag")
    p.add_argument("--bench-arg", action="append", default=[], help="extra bin/epd-bench flag, every run")
    p.add_argument("--shape", default="qwen2.5-vl-3b", help="the --random-weights shape served")
    p.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (a smoke test)")
    return p.parse_args(argv)


def launch_args(args: argparse.Namespace) -> list[str]:
    layout = (["--encoders", "1", "--generators", "1", "--placement", "colocated"] if args.layout == "epd" else
              ["--mode", "aggregated", "--generators", "1"])
    if args.tiny:
        shape = ["--random-weights", args.shape] if args.shape.endswith("-tiny") else []
        return [*layout, "--device", "cpu", *shape, *args.launch_arg]
    return [*layout, "--gpus", "0", "--random-weights", args.shape, "--dtype", "bfloat16", "--device", "cuda",
            *[f"--stage-arg={a}" for a in STAGE_ARGS], *args.launch_arg]


def media_bucket(args: argparse.Namespace) -> str:
    if args.video:
        height, width, frames = (int(v) for v in args.video.split(","))
        return f"{{({height}, {width}, {frames}): 1.0}}"
    return f"{{({args.image_size}, {args.image_size}, 1): 1.0}}"


def workload_flags(args: argparse.Namespace, images: int, text: int, text_only: float = 0.0) -> list[str]:
    return ["--random-input-len", str(text), "--random-output-len", str(args.output_len),
            "--random-mm-base-items-per-request", str(images), "--text-only-fraction", f"{text_only:g}",
            "--random-mm-bucket-config", media_bucket(args), "--no-progress",
            "--warmup-s", f"{args.warmup_s:g}", "--save-detailed", *args.bench_arg]


def predicted_rate(args: argparse.Namespace, images: int, text: int) -> float:
    """epd-plan's prediction for this layout on one GPU, else a guess scaled from earlier runs."""
    if args.profile and args.profile.is_file():
        cmd = [sys.executable, str(REPO / "bin" / "epd-plan"), "--profile", str(args.profile), "--gpus", "1",
               "--images", str(images), "--image-size", f"{args.image_size}x{args.image_size}",
               "--input-len", str(text), "--output-len", str(args.output_len), "--json"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode == 0:
            layouts = json.loads(done.stdout)["layouts"]
            kind = "colocated" if args.layout == "epd" else "aggregated"
            rate = next(l["max_rate"] for l in layouts if l["placement"] == kind and l["encoders"] <= 1)
            if 0 < rate < float("inf"):
                return rate
        print(f"gpu_sustained: no prediction ({done.stderr.strip()[-200:]}); using a guess", flush=True)
    scale = (400 + 4 * 531) / (text + images * 531 + 20)
    return FALLBACK_RATE[args.layout] * scale * (8 if args.tiny else 1)


def search(args: argparse.Namespace, stack: LaunchedStack, images: int, text: int, steps: int,
           bracket: tuple[float, float] | None = None, text_only: float = 0.0) -> dict:
    item = "vid" if args.video else "img"
    name = f"{args.layout}-mixed-search" if text_only else f"{args.layout}-{images}{item}-{text}tok"
    rate = predicted_rate(args, images, text) if bracket is None else sum(bracket) / 2
    around = [float(v) for v in args.around.split(":")]
    low, high = bracket or (around[0] * rate, around[1] * rate)
    log = args.out / "logs" / f"{name}.log"
    warmup = ["--base-url", stack.base_url, *workload_flags(args, images, text, text_only), "--num-prompts", "16",
              "--request-rate", "inf", "--seed", "999"]
    run_bench(warmup, 90, log)
    bench = ["--base-url", stack.base_url, *workload_flags(args, images, text, text_only),
             "--request-rate", f"search:{low:.3f}:{high:.3f}", "--search-criterion", "p99",
             "--search-steps", str(steps), "--search-step-s", f"{args.step_s:g}", "--goodput", *SLOS,
             "--json", str(args.out / f"{name}.json"), "--plot", str(args.out / f"{name}.png")]
    started = time.monotonic()
    code = run_bench(bench, steps * (args.step_s + 90) + 30, log)
    found = read_json(args.out / f"{name}.json") or {}
    return {"workload": name, "predicted": rate, "bracket": [low, high], "bench": shlex.join(["bin/epd-bench", *bench]),
            "exit": code, "seconds": round(time.monotonic() - started, 1),
            **{k: found.get(k) for k in ("max_request_rate", "max_offered_rate", "max_achieved_rate",
                                                "max_sustained_rate", "at_bound")}}


def interference(args: argparse.Namespace, stack: LaunchedStack, rate: float) -> dict:
    name = f"{args.layout}-mixed"
    bench = ["--base-url", stack.base_url, *workload_flags(args, 4, 400, 0.5),
             "--request-rate", f"{rate:g}", "--num-prompts", str(max(20, round(rate * args.step_s))),
             "--goodput", *SLOS, "--json", str(args.out / f"{name}.json")]
    code = run_bench(bench, args.step_s + 120, args.out / "logs" / f"{name}.log")
    found = read_json(args.out / f"{name}.json") or {}
    return {"rate": rate, "exit": code, "bench": shlex.join(["bin/epd-bench", *bench]),
            "by_class": found.get("by_class"), "window_by_class": found.get("window_by_class"),
            "p99_tpot_ms": found.get("p99_tpot_ms"),
            "offered_rate": found.get("offered_rate"),
            "achieved_rate": found.get("achieved_rate"), "failed": found.get("failed")}


def interference_rate(args: argparse.Namespace) -> float | None:
    if args.interference_rate:
        return args.interference_rate
    if args.interference_from:
        found = read_json(args.interference_from) or {}
        return found.get("max_request_rate")
    return None


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"layout": args.layout, "searches": [], "started": time.strftime("%H:%M:%S")}
    stack = LaunchedStack(launch_args(args), args.out / "logs" / args.layout)
    summary["launch"] = shlex.join(["bin/epd-launch", *stack.argv[2:]])
    path = args.out / f"{args.layout}-summary.json"
    try:
        summary["ready_s"] = round(stack.start(ready_timeout=240), 1)
        for item in args.workload:
            images, text, *rest = (float(v) for v in item.split(":"))
            images, text = int(images), int(text)
            bracket = (rest[1], rest[2]) if len(rest) == 3 else None
            summary["searches"].append(search(args, stack, images, text, int(rest[0]) if rest else 3, bracket))
            path.write_text(json.dumps(summary, indent=2) + "\n")
            print(json.dumps(summary["searches"][-1]), flush=True)
        mixed_max = None
        if args.mixed_search:
            steps, low, high = (float(v) for v in args.mixed_search.split(":"))
            summary["mixed_search"] = search(args, stack, 4, 400, int(steps), (low, high), text_only=0.5)
            mixed_max = summary["mixed_search"]["max_request_rate"]
            print(json.dumps(summary["mixed_search"]), flush=True)
        if rate := interference_rate(args) or mixed_max:
            summary["interference"] = interference(args, stack, rate)
            print(json.dumps(summary["interference"]), flush=True)
    except StackError as exc:
        summary["error"] = str(exc)
    finally:
        summary["stop_exit"] = stack.stop()
        path.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if "error" not in summary else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
