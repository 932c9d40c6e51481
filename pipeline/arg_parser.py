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


_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kmgtKMGT]?)$")
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def human_readable_int(text: str) -> int:
    """An argparse `type`: a whole number as vLLM's flags take one, plain or
    with a multiplier: k, m, g, t decimal (25.6k = 25600), K, M, G, T binary
    (1K = 1024)."""
    match = _HUMAN_INT.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r}: want a whole number, e.g. 4096, 32k or 1G")
    number, unit = match.groups()
    scale = _DECIMAL[unit] if unit.islower() or not unit else 1 << (10 * " KMGT".index(unit))
    value = float(number) * scale
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


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
