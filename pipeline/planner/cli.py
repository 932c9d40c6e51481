"""bin/epd-plan: measure a box, or plan a layout from what was measured.

    bin/epd-plan --profile-out FILE [--random-weights SHAPE | --model DIR] [--gpus LIST] [...]
    bin/epd-plan --profile FILE --gpus N --images I --image-size WxH --input-len T --output-len O
                 [--slo-ttft-ms MS] [--slo-tpot-ms MS] [--json]

The first times the stages' work on the first GPU of LIST (capacity.py says
what is used how) and writes the profile as JSON (profile.py is the format),
also into the cache where `bin/epd-launch --placement auto` finds it for
that model on that kind of GPU. The second prints, for each candidate
layout of N GPUs, the predicted highest sustainable request rate and what
bounds it, then the chosen layout; --json prints
{"layouts": [...], "chosen": {...}}. Bad arguments exit 2, a profile that
cannot be read or measured exits 1, each with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.arg_parser import OneLineParser, image_size, image_sizes
from pipeline.planner.cache import cached_profile_path
from pipeline.planner.capacity import Workload, candidate_layouts, plan
from pipeline.planner.profile import ProfileError, image_tokens, load_profile, save_profile
from pipeline.models.hub_cache import model_dir_arg


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog="epd-plan", description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--profile-out", type=Path, metavar="FILE", help="measure this box into FILE")
    mode.add_argument("--profile", type=Path, metavar="FILE", help="plan from this profile")
    p.add_argument("--gpus", help="--profile-out: GPU numbers (the first is measured); --profile: GPU count")
    measuring = p.add_argument_group("measuring (--profile-out)")
    measuring.add_argument("--model", type=model_dir_arg, metavar="DIR|ID",
                           help="checkpoint folder, or a Hugging Face repo id in the local cache "
                           "(default: the tiny model)")
    measuring.add_argument("--random-weights", metavar="SHAPE", help="random weights of a named shape instead")
    measuring.add_argument("--model-id", help="the name the stages salt hashes with (default: the folder name)")
    measuring.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    measuring.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    measuring.add_argument("--image-sizes", type=image_sizes, default=[(640, 640)], metavar="WxH[,WxH...]")
    measuring.add_argument("--vision-batches", default="1,4,16", metavar="LIST")
    measuring.add_argument("--decode-batches", default="1,8,32,64", metavar="LIST")
    measuring.add_argument("--prefill-tokens", default="512,2048", metavar="LIST")
    measuring.add_argument("--vision-graphs", type=int, default=0, metavar="N",
                           help="time vision forwards as the stages run them with this --vision-graphs")
    measuring.add_argument("--max-num-seqs", type=int, default=64, help="the generators' --max-num-seqs")
    measuring.add_argument("--repeats", type=int, default=8)
    measuring.add_argument("--no-beside", action="store_true", help="skip the timings beside a load process")
    measuring.add_argument("--no-half-duty", action="store_true",
                           help="time beside a load working back to back only, not also beside one busy half the time")
    measuring.add_argument("--beside-wall-s", type=float, default=2.0, metavar="S",
                           help="sample each beside figure for at least S seconds (across the load's cycles)")
    measuring.add_argument("--mps", choices=("auto", "on", "off"), default="auto",
                           help="run the beside timings under a private MPS daemon (auto: on CUDA)")
    planning = p.add_argument_group("planning (--profile)")
    planning.add_argument("--images", type=int, default=1, help="images per request")
    planning.add_argument("--image-size", type=image_size, default=(640, 640), metavar="WxH")
    planning.add_argument("--input-len", type=int, default=400, help="text tokens per request")
    planning.add_argument("--output-len", type=int, default=150)
    planning.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    planning.add_argument("--slo-tpot-ms", type=float, default=50.0)
    planning.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    try:
        for name in ("vision_batches", "decode_batches", "prefill_tokens"):
            setattr(args, name, parse_counts(getattr(args, name), f"--{name.replace('_', '-')}"))
        if args.profile is not None:
            args.gpu_count = parse_counts(args.gpus or "1", "--gpus")[0]
        else:
            args.gpu_list = parse_counts(args.gpus, "--gpus", zero=True) if args.gpus else None
        if not args.beside_wall_s >= 0:
            raise ValueError("--beside-wall-s must be >= 0")
        if args.model is not None and args.random_weights is not None:
            raise ValueError("--model cannot be combined with --random-weights")
    except ValueError as exc:
        p.error(str(exc))
    return args


def parse_counts(text: str, flag: str, zero: bool = False) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < (0 if zero else 1) for v in values):
        raise ValueError(f"{flag} {text!r}: want whole numbers >= {0 if zero else 1}, comma-separated")
    return values


def planned_workload(profile, images: int, image_size: tuple[int, int], input_len: int, output_len: int,
                     slo_ttft_ms: float, slo_tpot_ms: float) -> Workload:
    """The planner's Workload from the flags' terms (epd-plan's and epd-launch's)."""
    return Workload(images, image_tokens(profile, *image_size), input_len, output_len, slo_ttft_ms / 1000,
                    slo_tpot_ms / 1000)


def plan_main(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    load = planned_workload(profile, args.images, args.image_size, args.input_len, args.output_len,
                            args.slo_ttft_ms, args.slo_tpot_ms)
    predictions, chosen = plan(profile, load, candidate_layouts(args.gpu_count))
    if args.json:
        print(json.dumps({"workload": {**vars(load), "prompt_tokens": load.prompt_tokens},
                          "profile": {"model_id": profile.model_id, "device_name": profile.device_name},
                          "layouts": [p.as_json() for p in predictions], "chosen": chosen.as_json()}, indent=2))
        return 0
    print(f"{profile.model_id} on {args.gpu_count} x {profile.device_name}: {load.images} image(s) of "
          f"{load.image_tokens} tokens, {load.input_len} text tokens ({load.prompt_tokens} prompt tokens), "
          f"{load.output_len} out; SLOs TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms")
    print(f"{'layout':<36} {'max req/s':>10}  bound")
    for prediction in predictions:
        print(f"{prediction.layout.name:<36} {prediction.max_rate:>10.2f}  {prediction.bound}")
    print(f"chosen: {chosen.layout.name} ({chosen.max_rate:.2f} req/s, bound: {chosen.bound})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.profile is not None:
            return plan_main(args)
        from pipeline.planner.profile_run import profile_main   # torch: only to measure
        return profile_main(args, argv)
    except (ProfileError, ValueError, RuntimeError, OSError) as exc:
        print(f"epd-plan: error: {exc}", file=sys.stderr)
        return 1


def write_profile(profile, path: Path) -> list[Path]:
    """Into `path` and the launcher's cache; the paths written."""
    cached = cached_profile_path(profile.model_id, profile.device_name)
    save_profile(profile, path)
    if cached.resolve() != Path(path).resolve():
        save_profile(profile, cached)
    return [Path(path), cached]

