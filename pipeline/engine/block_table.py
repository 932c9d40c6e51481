"""A request's KV block ids, kept as an int64 array.

Each step copies every running request's block ids into the graphs' pinned
input tables. From Python lists that meant converting each id to a machine
integer every step: filling a decode step's inputs for 90 requests of 2,600
tokens took 344 us on the development CPU, 88 us copying rows of arrays
(scripts/bench_step_host.py), and the mixed step's per-request tuple copies
are gone too. The scheduler appends ids as blocks are allocated and clears
them on free; everything else reads `view()`.
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    __slots__ = ("_ids", "_len")

    def __init__(self, ids: list[int] | None = None) -> None:
        self._ids = np.empty(max(16, len(ids or ())), dtype=np.int64)
        self._len = 0
        if ids:
            self.extend(ids)

    def extend(self, ids: list[int]) -> None:
        end = self._len + len(ids)
        if end > len(self._ids):
            grown = np.empty(max(end, 2 * len(self._ids)), dtype=np.int64)
            grown[:self._len] = self._ids[:self._len]
            self._ids = grown
        self._ids[self._len:end] = ids
        self._len = end

    def clear(self) -> None:
        # A new array, not a reset length: views handed out before stay what
        # they were even once the table grows again.
        self._ids = np.empty(16, dtype=np.int64)
        self._len = 0

    def view(self) -> np.ndarray:
        """The ids as they are now, for reading only (not copied: this runs
        for every request every step). Later extends append past it and
        clear() leaves it alone, so it stays what it was."""
        return self._ids[:self._len]

    def tolist(self) -> list[int]:
        return self._ids[:self._len].tolist()

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockTable):
            return self.tolist() == other.tolist()
        if isinstance(other, list):
            return self.tolist() == other
        return NotImplemented

    def __repr__(self) -> str:
        return f"BlockTable({self.tolist()})"
