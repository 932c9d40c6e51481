"""The command lines' argument parser: a bad flag is one line on stderr and
exit status 2, not argparse's usage block (one line reads better in a log)."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")
