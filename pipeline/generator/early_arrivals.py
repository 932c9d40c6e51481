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
        self._held: dict[str, list[tuple[str, torch.Tensor]]] = {}
        self._since: dict[str, float] = {}

    def hold(self, request_id: str, key: str, embedding: torch.Tensor) -> None:
        self._held.setdefault(request_id, []).append((key, embedding))
        self._since.setdefault(request_id, time.monotonic())

    def claim(self, request_id: str) -> list[tuple[str, torch.Tensor]]:
        """The embeddings that came for `request_id` (each key, its tensor),
        handed over once."""
        self._since.pop(request_id, None)
        return self._held.pop(request_id, [])

    def expire(self, now: float) -> int:
        """Drop what waited longer than the ttl; returns how many requests' worth."""
        old = [rid for rid, since in self._since.items() if now - since > self.ttl_s]
        for rid in old:
            self.claim(rid)
        return len(old)

    def __len__(self) -> int:
        return len(self._held)
