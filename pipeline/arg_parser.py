"""The command lines' argument parser: a bad flag is one line on stderr and
exit status 2, not argparse's usage block (one line reads better in a log)."""

from __future__ import annotations

import argparse
import json
import re

_SIZE = re.compile(r"^(\d+)x(\d+)$")


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def json_object(text: str, example: str) -> dict:
    """An argparse `type` body: `text` as a JSON object, or an
    ArgumentTypeError showing `example`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, e.g. '{example}', got {text!r}")
    return value


def at_least_one(text: str, unit: str, alternative: str = "") -> int:
    """An argparse `type` body: `text` as a whole number >= 1 of `unit`,
    or an ArgumentTypeError naming what was wanted."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want a whole number of {unit} >= 1{alternative}")
    return value


def image_sizes(text: str) -> list[tuple[int, int]]:
    """An argparse `type`: "640x480,1280x720" -> [(640, 480), (1280, 720)] as (width, height)."""
    sizes = []
    for item in text.split(","):
        match = _SIZE.match(item.strip())
        if not match or not all(int(v) > 0 for v in match.groups()):
            raise argparse.ArgumentTypeError(f"image size {item!r}: want WIDTHxHEIGHT, e.g. 640x480")
        sizes.append((int(match[1]), int(match[2])))
    return sizes


def image_size(text: str) -> tuple[int, int]:
    """An argparse `type`: one WIDTHxHEIGHT."""
    sizes = image_sizes(text)
    if len(sizes) != 1:
        raise argparse.ArgumentTypeError(f"image size {text!r}: want one WIDTHxHEIGHT, e.g. 640x480")
    return sizes[0]
