"""Aggregated mode: a bound on the decoded media a generator holds.

A decoded clip is hundreds of MB of pixel values (8 s of 1280x720 video at
2 frames a second: 173 MB in float32), and the receiver's workers decode as
fast as requests come. Under overload the decoded backlog grew until the
GPU ran out of memory and the generator died with every request it held
(measured on an H200 at 1.6 video requests a second: docs/benchmarks.md).

So a worker waits, after decoding, until what the generator holds plus its
own fits the budget; requests behind it wait as their compressed bytes.
What is held is counted by the tensors' lives: each decoded tensor gives its
bytes back when it is freed (the engine drops a request's inputs when the
request ends), so no one has to remember to release anything.
"""

from __future__ import annotations

import threading
import weakref

import torch


class HeldBytes:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the media budget must be at least 1 byte, got {limit}")
        self.limit = limit
        self.held = 0
        self._changed = threading.Condition()

    def hold(self, tensors: list[torch.Tensor], stop: threading.Event | None = None) -> bool:
        """Block until `tensors` fit beside what is held (one item larger than
        the whole budget is let through alone), then count them until each is
        freed. False if `stop` was set while waiting (nothing is counted)."""
        sizes = [t.untyped_storage().nbytes() for t in tensors]
        need = sum(sizes)
        with self._changed:
            while self.held and self.held + need > self.limit:
                if stop is not None and stop.is_set():
                    return False
                self._changed.wait(timeout=0.1)
            self.held += need
        for tensor, size in zip(tensors, sizes):
            weakref.finalize(tensor, self._give_back, size)
        return True

    def _give_back(self, size: int) -> None:
        with self._changed:
            self.held -= size
            self._changed.notify_all()
