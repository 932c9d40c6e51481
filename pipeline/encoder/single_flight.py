"""Single-flight: concurrent jobs for one content hash share one encoding.

The first job for a hash starts the work; later ones join its waiter list.
When the work ends every waiter is answered at once, success or failure.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

W = TypeVar("W")


class SingleFlight(Generic[W]):
    def __init__(self) -> None:
        self._waiters: dict[Hashable, list[W]] = {}

    def join(self, key: Hashable, waiter: W) -> bool:
        """Add a waiter; True if it is the first (the caller must start the work)."""
        waiters = self._waiters.get(key)
        if waiters is None:
            self._waiters[key] = [waiter]
            return True
        waiters.append(waiter)
        return False

    def finish(self, key: Hashable) -> list[W]:
        """Every waiter of the work, which is over."""
        return self._waiters.pop(key, [])

    def __contains__(self, key: Hashable) -> bool:
        return key in self._waiters

    def __len__(self) -> int:
        return len(self._waiters)
