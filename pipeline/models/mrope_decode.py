"""M-RoPE positions after a prompt: a generated token advances all three
axes together, at its index plus the prompt's decode delta (the images of
a prompt take fewer positions than tokens, so the delta is fixed once the
prompt is known)."""

from __future__ import annotations

import torch


def decode_positions(first_index: int, count: int, delta: int) -> torch.Tensor:
    """Positions [3, count] for tokens at indices first_index... after a prompt."""
    return (torch.arange(first_index, first_index + count) + delta).view(1, -1).expand(3, -1)


def decode_step_positions(indices: list[int], deltas: list[int]) -> torch.Tensor:
    """Positions [3, n] of one decode token for each of n requests: token
    indices[i] of request i, whose prompt has decode delta deltas[i]."""
    return torch.tensor([i + d for i, d in zip(indices, deltas)]).view(1, -1).expand(3, -1)
