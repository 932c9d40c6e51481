"""Choosing the next vision forward's batch under a token budget."""

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
