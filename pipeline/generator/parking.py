"""EPD mode: embeddings left in their encoder's arena until the generator has
room for them.

A generator copies an announced embedding onto its own device at once, and
what its encoder cache cannot take yet waits there as pending. Unbounded,
that waiting grew under overload (an 8 s clip's embedding is 138 MB with a
wide model's side rows) until the device ran out of memory and the
generator died with every request it held (measured on an H200).

So an announcement past the budget is parked instead: its lease is kept, the
bytes stay in the arena (whose own bound then slows the encoder down), and it
is read when the cache and the pending embeddings leave room. The budget is
the encoder cache's own capacity, which the KV cache's sizing already keeps
free: what the cache holds plus what is pending never exceeds it, except for
one embedding when nothing is pending (so a large one is never stuck).
"""

from __future__ import annotations

from collections import deque

from pipeline import protocol
from pipeline.engine.engine import Engine


class ParkedEmbeddings:
    def __init__(self) -> None:
        self.parked: deque[protocol.EmbeddingReady] = deque()
        self.keys: set[str] = set()

    def __len__(self) -> int:
        return len(self.parked)

    def has_room(self, engine: Engine, ready: protocol.EmbeddingReady) -> bool:
        return engine.has_room_for(ready.handle.shape[0])

    def park(self, ready: protocol.EmbeddingReady) -> None:
        self.parked.append(ready)
        self.keys.add(ready.content_hash)

    def drop_gone(self, gone) -> list[protocol.EmbeddingReady]:
        """Take out (to be given back unread) those whose request is gone."""
        dropped = [ready for ready in self.parked if gone(ready)]
        for ready in dropped:
            self._remove(ready)
        return dropped

    def next_fitting(self, engine: Engine) -> protocol.EmbeddingReady | None:
        """The oldest parked announcement if it fits now (arrival order: the
        later ones wait behind it, so a large one is never starved)."""
        if not self.parked or not self.has_room(engine, self.parked[0]):
            return None
        ready = self.parked[0]
        self._remove(ready)
        return ready

    def _remove(self, ready: protocol.EmbeddingReady) -> None:
        self.parked.remove(ready)
        if not any(p.content_hash == ready.content_hash for p in self.parked):
            self.keys.discard(ready.content_hash)
