"""Which encoder delivered each image key: where to ask again when the
generator's cache evicted an embedding that a request still needs. Keys no
request needs are forgotten after `memory_s`, so the map does not grow with
every image ever seen."""

from __future__ import annotations

import time
from collections.abc import Callable


class KeySources:
    def __init__(self, memory_s: float) -> None:
        self.memory_s = memory_s
        self._source: dict[str, tuple[str, float]] = {}   # key -> (encoder address, when delivered)
        self._pruned_at = time.monotonic()

    def remember(self, key: str, encoder: str) -> None:
        self._source[key] = (encoder, time.monotonic())

    def address_of(self, key: str) -> str:
        """"" when unknown (never delivered here, or forgotten)."""
        return self._source.get(key, ("",))[0]

    def prune(self, now: float, needed: Callable[[str], bool]) -> None:
        """At most every `memory_s`: drop keys that are old and not `needed`."""
        if now - self._pruned_at < self.memory_s:
            return
        self._pruned_at = now
        self._source = {k: v for k, v in self._source.items() if needed(k) or now - v[1] < self.memory_s}

    def __len__(self) -> int:
        return len(self._source)
