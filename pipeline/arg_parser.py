"""The command lines' argument parser: a bad flag is one line on stderr and
exit status 2, not argparse's usage block (one line reads better in a log)."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


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
