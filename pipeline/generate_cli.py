"""Offline greedy generation with a checkpoint of a supported family (no serving engine).

The user message is the given images in order, then the videos, then the text, rendered with
the checkpoint's chat template and the generation prompt. Without --model the
built-in tiny checkpoint is used. Errors exit 1 with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.arg_parser import OneLineParser
from pipeline.offline import GenerateRequest, InputError, OfflineModel
from pipeline.models.hub_cache import model_dir_arg


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="epd-generate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=model_dir_arg, help="checkpoint folder (default: the built-in tiny model)")
    parser.add_argument("--prompt", required=True, help="the user's text")
    parser.add_argument("--image", action="append", type=Path, default=[], help="an image file; repeatable")
    parser.add_argument("--video", action="append", type=Path, default=[],
                        help="a video file (mp4, mkv, webm, avi, ts), after the images; repeatable")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    parser.add_argument("--json", action="store_true", help="last line: prompt ids, token ids and text as JSON")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        model = OfflineModel.load(args.model, dtype=args.dtype, device=args.device)
        images = [read_media_file(path, "image") for path in args.image]
        videos = [read_media_file(path, "video") for path in args.video]
        result = model.generate(GenerateRequest(args.prompt, images, args.max_tokens, args.ignore_eos, videos))
    except InputError as exc:
        print(f"epd-generate: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"prompt_token_ids": result.prompt_token_ids,
                          "token_ids": result.token_ids, "text": result.text}, ensure_ascii=False))
    else:
        print(result.text)
    return 0


def read_media_file(path: Path, kind: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read {kind} {path}: {exc.strerror or exc}") from exc


if __name__ == "__main__":
    sys.exit(main())
