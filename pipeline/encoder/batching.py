"""Choosing the next vision forward's batch under a token budget, and the
forwards a clip too long for one takes."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def take_batch(queue: deque[T], cost: Callable[[T], int], budget: int) -> list[T]:
    """Pop items from the front while their total cost fits the budget; the
    first item is always taken (an image larger than the budget still runs,
    alone). Order is kept, so no job is starved."""
    batch: list[T] = []
    total = 0
    while queue:
        c = cost(queue[0])
        if batch and total + c > budget:
            break
        batch.append(queue.popleft())
        total += c
    return batch


def temporal_parts(grid_t: int, tokens: int, budget: int) -> list[tuple[int, int]]:
    """[start, end) temporal patches of each forward for a clip of `grid_t`
    temporal patches and `tokens` in all: as many patches a forward as fit
    `budget`, one at least. The vision towers attend within a temporal patch
    only (their attention windows and positions repeat per patch), so the
    parts' outputs, stacked, are the whole clip's."""
    per_step = tokens // grid_t
    step = max(1, budget // per_step)
    return [(start, min(start + step, grid_t)) for start in range(0, grid_t, step)]
