"""Contiguous runs of fixed-size blocks in one buffer.

An embedding occupies one contiguous run, so a consumer copies it with a
single memcpy. Runs are allocated first-fit from a sorted free list and
coalesced on free; fragmentation is handled by the index evicting unused
entries until a run fits.
"""

from __future__ import annotations

import bisect


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"an arena needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        # Free runs as parallel sorted lists of starts and lengths.
        self._starts: list[int] = [0]
        self._lengths: list[int] = [num_blocks]
        self.used = 0

    def allocate(self, count: int) -> int | None:
        """First block of a free run of `count` blocks, or None if no run fits."""
        if count < 1:
            raise ValueError(f"cannot allocate {count} blocks")
        for i, length in enumerate(self._lengths):
            if length >= count:
                start = self._starts[i]
                if length == count:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += count
                    self._lengths[i] -= count
                self.used += count
                return start
        return None

    def free(self, start: int, count: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        prev_end = self._starts[i - 1] + self._lengths[i - 1] if i else 0
        if (i and prev_end > start) or (i < len(self._starts) and self._starts[i] < start + count):
            raise ValueError(f"blocks [{start}, {start + count}) are not allocated")
        self.used -= count
        if i and prev_end == start:  # merge with the run before
            i -= 1
            self._lengths[i] += count
        else:
            self._starts.insert(i, start)
            self._lengths.insert(i, count)
        nxt = i + 1
        if nxt < len(self._starts) and self._starts[i] + self._lengths[i] == self._starts[nxt]:
            self._lengths[i] += self._lengths[nxt]
            del self._starts[nxt], self._lengths[nxt]

    def largest_free_run(self) -> int:
        return max(self._lengths, default=0)

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self.used
