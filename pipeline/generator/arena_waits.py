"""EmbeddingReady messages whose arena this generator cannot read yet.

A handle can arrive before its encoder's announcement (a ring is faster than
the socket the announcement takes, and a restarted encoder has a new arena).
It waits here, its lease held, while the generator asks the encoder to
announce itself. It must not wait forever: the lease pins the embedding in
the encoder's arena, and an arena that never opens here (a failed mapping)
would fill the encoder up with entries nobody reads. So a handle is given up
(lease released, its requests failed) once its encoder's announcement fails
to open, or after `wait_s`.
"""

from __future__ import annotations

import time

from pipeline import protocol


class ArenaWaits:
    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._parked: list[tuple[protocol.EmbeddingReady, float]] = []

    def park(self, ready: protocol.EmbeddingReady, since: float | None = None) -> bool:
        """Keep `ready` until its arena opens. True if it is the first one
        waiting for that arena (ask for the announcement then, not per handle)."""
        first = all(r.handle.arena_id != ready.handle.arena_id for r, _ in self._parked)
        self._parked.append((ready, time.monotonic() if since is None else since))
        return first

    def take_all(self) -> list[tuple[protocol.EmbeddingReady, float]]:
        """Every parked handle with the time it first parked, to try again
        after an announcement (those still unreadable park again, keeping it)."""
        parked, self._parked = self._parked, []
        return parked

    def take_from(self, encoder_id: str) -> list[protocol.EmbeddingReady]:
        """The handles from one encoder (its announcement did not open)."""
        mine = [r for r, _ in self._parked if r.encoder_id == encoder_id]
        self._parked = [(r, t) for r, t in self._parked if r.encoder_id != encoder_id]
        return mine

    def take_overdue(self, now: float) -> list[protocol.EmbeddingReady]:
        if not self._parked:
            return []
        overdue = [r for r, t in self._parked if now - t > self.wait_s]
        self._parked = [(r, t) for r, t in self._parked if now - t <= self.wait_s]
        return overdue

    def __len__(self) -> int:
        return len(self._parked)
