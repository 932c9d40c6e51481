"""Waiting on a benchmark's worker processes without hanging on a dead one."""

from __future__ import annotations

import queue as queue_module
import time


def result_or_raise(results, procs, limit: float = 600.0):
    """The next item on `results`, or RuntimeError as soon as one of `procs`
    died without giving it (the others are killed), or TimeoutError."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queue_module.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a bench process exited with {dead[0]}") from None
    raise TimeoutError("no result from the bench processes")
