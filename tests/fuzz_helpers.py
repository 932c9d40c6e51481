"""Shared parts of the property-based (fuzz) tests: byte mutations of valid
inputs, a per-example time bound, and the settings every fuzz test runs under.

Example counts are bounded so the whole fuzz set runs in seconds on a 2-core
CI machine. No example database is kept, so each run explores new inputs; a
failure found once is kept as an explicit case beside its property.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

T = TypeVar("T")

# deadline=None: a decoder's first call (a plugin import, a codec's set-up)
# is slow enough to trip Hypothesis's per-example deadline on a loaded runner;
# hangs are caught by `bounded` instead.
_BASE = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
EXPLORE = 1   # raise locally to fuzz longer; CI runs the counts as written


def fuzz(max_examples: int) -> settings:
    """The fuzz tests' settings, with `max_examples` examples."""
    return settings(_BASE, max_examples=max_examples * EXPLORE)


# Integers a corrupt header field is most often set to: zero, one, the
# largest values of each width and their halves (sign bits).
_EDGE_INTS = (0, 1, 0x7F, 0xFF, 0x7FFF, 0x8000, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF)


@st.composite
def mutated(draw, data: bytes, max_ops: int = 4, header: int = 64) -> bytes:
    """`data` after 1..max_ops random edits: a bit flipped, a byte set,
    bytes inserted or deleted, the tail cut off, or a 1/2/4-byte integer
    overwritten with an edge value (biased to the first `header` bytes,
    where the sizes and counts are)."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(("flip", "set", "insert", "delete", "truncate", "int")))
        in_header = kind == "int" and draw(st.booleans())
        at = draw(st.integers(0, max((min(header, len(buf)) if in_header else len(buf)) - 1, 0)))
        if kind == "flip" and buf:
            buf[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and buf:
            buf[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            buf[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del buf[at:at + draw(st.integers(1, 16))]
        elif kind == "truncate":
            del buf[at:]
        elif kind == "int" and buf:
            width = draw(st.sampled_from((1, 2, 4)))
            value = draw(st.sampled_from(_EDGE_INTS) | st.integers(0, 2**32 - 1)) % (1 << (8 * width))
            buf[at:at + width] = value.to_bytes(width, draw(st.sampled_from(("big", "little"))))
    return bytes(buf)


def bounded(fn: Callable[[], T], seconds: float) -> T:
    """fn() on a worker thread; AssertionError if it runs past `seconds` (a
    hang: a C decoder loop cannot be interrupted, so the thread is left
    behind, as a daemon). Its exception, if any, is re-raised here."""
    outcome: dict[str, object] = {}

    def work() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the caller, who judges it
            outcome["error"] = exc

    worker = threading.Thread(target=work, name="fuzz-bounded", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise AssertionError(f"still running after {seconds} s: a hang")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
