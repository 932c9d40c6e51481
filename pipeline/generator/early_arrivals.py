"""Embeddings that reached a generator before the request they were sent for.

The proxy sends a request's encode jobs and the request itself at the same
time, by different paths: the jobs go to an encoder, which answers into the
generator's ring (no system call), while the request waits in a socket. So
an EmbeddingReady often arrives first. The engine keeps such an embedding
while some request needs its image; but if that request ends before the late
one arrives, the cache frees the entry, and the late request would wait for
a second delivery that never comes. Held here, by request id, the late
request claims its own embedding when it comes.
"""

from __future__ import annotations

import time

import torch


class EarlyArrivals:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s   # how long to wait for a request that may never come (aborted, failed over)
        # request id -> (when its first embedding came, [(key, embedding)]); in
        # insertion order, so oldest first: expiry stops at the first young one.
        self._held: dict[str, tuple[float, list[tuple[str, torch.Tensor]]]] = {}

    def hold(self, request_id: str, key: str, embedding: torch.Tensor) -> None:
        self._held.setdefault(request_id, (time.monotonic(), []))[1].append((key, embedding))

    def claim(self, request_id: str) -> list[tuple[str, torch.Tensor]]:
        """The embeddings that came for `request_id` (each key, its tensor),
        handed over once."""
        return self._held.pop(request_id, (0.0, []))[1]

    def expire(self, now: float) -> int:
        """Drop what waited longer than the ttl; returns how many requests' worth.
        Runs every engine loop: without anything old it looks at one entry."""
        dropped = 0
        while self._held:
            request_id, (since, _) = next(iter(self._held.items()))
            if now - since <= self.ttl_s:
                break
            del self._held[request_id]
            dropped += 1
        return dropped

    def __len__(self) -> int:
        return len(self._held)
