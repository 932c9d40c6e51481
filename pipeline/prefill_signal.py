"""A generator's prefill steps, told to the encoders beside it on its GPU.

Colocated under MPS, an encoder's vision forwards and a generator's steps
share the SMs. Vision work and prefill are both compute-bound, and each
slows the other; decode steps are memory-bound and leave compute spare. With
this signal a generator sets one byte while a step with prefill tokens runs,
and an encoder holds its next forward (one image at a time) while the byte is
set, up to a bound, so that its work lands beside decode steps instead.

The byte is a one-byte file both processes map (the launcher puts it in its
private run folder). Each generator writes only its own file, and readers
only read, so there is no lock. Either side may create the file: the
launcher starts the stages in no fixed order.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

POLL_S = 0.0003   # well under a decode step (2-5 ms beside vision), so a held forward starts soon after


class PrefillSignal:
    """One generator's byte: 1 while one of its steps with prefill tokens runs.

    `writer` is the generator's side: it clears the byte on opening, since a
    generator restarted after dying mid-prefill is not prefilling. The file
    stays in place across restarts (an encoder beside it keeps its mapping);
    the launcher removes it when the stack stops."""

    def __init__(self, path: str | Path, writer: bool = False) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 1:
                os.ftruncate(fd, 1)   # zero-filled; never shrinks a byte the other side set
            self._map = mmap.mmap(fd, 1)
        finally:
            os.close(fd)   # the mapping keeps the file open
        if writer:
            self.set(False)

    def set(self, prefilling: bool) -> None:
        self._map[0] = 1 if prefilling else 0

    def is_set(self) -> bool:
        return self._map[0] != 0

    def close(self) -> None:
        self._map.close()


@contextlib.contextmanager
def signalling(signal: Callable[[bool], None] | None) -> Iterator[None]:
    """signal(True) on entry and signal(False) on exit, however the block
    ends; nothing where signal is None."""
    if signal is None:
        yield
        return
    signal(True)
    try:
        yield
    finally:
        signal(False)


class PrefillHold:
    """The encoder's side: before each forward, wait while any generator on
    its GPU is in a prefill step, for at most `max_s` (a forward is never
    starved: a generator that prefills back to back still lets one through
    every `max_s`)."""

    def __init__(self, signals: Sequence[PrefillSignal], max_s: float,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not max_s > 0:
            raise ValueError(f"the prefill hold's bound must be > 0 seconds (got {max_s})")
        self.signals = tuple(signals)
        self.max_s = max_s
        self._clock = clock
        self._sleep = sleep

    def wait(self) -> float:
        """Seconds held (0.0 where no generator was in a prefill step)."""
        if not self._any_set():
            return 0.0
        started = self._clock()
        deadline = started + self.max_s
        while self._any_set() and self._clock() < deadline:
            self._sleep(POLL_S)
        return self._clock() - started

    def _any_set(self) -> bool:
        return any(signal.is_set() for signal in self.signals)

    def close(self) -> None:
        for signal in self.signals:
            signal.close()
