"""Single-flight: concurrent jobs for one content hash share one encoding.

The first job for a hash starts the work; later ones join its waiter list.
When the work ends every waiter is answered at once, success or failure.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
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

    def leave(self, gone: Callable[[W], bool]) -> list[Hashable]:
        """Drop the waiters for which `gone` is true; returns the keys left
        with none. Their work stays in flight (a later job joins it) until
        the caller ends it with `finish`."""
        emptied = []
        for key, waiters in self._waiters.items():
            if any(gone(w) for w in waiters):
                waiters[:] = [w for w in waiters if not gone(w)]
                if not waiters:
                    emptied.append(key)
        return emptied

    def __contains__(self, key: Hashable) -> bool:
        return key in self._waiters

    def __len__(self) -> int:
        return len(self._waiters)
