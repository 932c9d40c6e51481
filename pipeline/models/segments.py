"""Bidirectional attention inside the segments of a packed sequence (the
vision tower's windows and frames), planned once per forward.

Segments of equal length are stacked and run as one batched SDPA call, so a
batch of images (whose windows mostly share one size) costs a few kernel
launches instead of one per window, with no padding. The plan (which rows
each length group gathers) depends only on the segment lengths, so it is
built once per forward on the host and sent to the device in one copy, not
rebuilt by every block: a host-to-device copy from pageable memory waits
for the GPU, and one per block and length group kept the host from running
ahead of the vision forward at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SegmentGroup:
    length: int
    count: int
    index: torch.Tensor | None   # [count * length] rows in segment order; None: all rows, in order


@dataclass(frozen=True)
class SegmentPlan:
    tokens: int
    groups: tuple[SegmentGroup, ...]


def plan_segments(seqlens: list[int], device: torch.device) -> SegmentPlan:
    """Group the segments (laid end to end with these lengths; zeros are
    skipped) by length; one host-to-device copy for every group's rows."""
    starts, total = [], 0
    for n in seqlens:
        starts.append(total)
        total += n
    by_length: dict[int, list[int]] = {}
    for start, n in zip(starts, seqlens):
        if n:
            by_length.setdefault(n, []).append(start)
    if len(by_length) == 1:
        (n, seg_starts), = by_length.items()
        if len(seg_starts) * n == total:   # one length tiling every row in order: views, no gather
            return SegmentPlan(total, (SegmentGroup(n, len(seg_starts), None),))
    rows = [(torch.tensor(s)[:, None] + torch.arange(n)[None, :]).reshape(-1) for n, s in by_length.items()]
    indices = torch.cat(rows).to(device).split([r.numel() for r in rows]) if rows else ()
    groups = tuple(SegmentGroup(n, len(s), index) for (n, s), index in zip(by_length.items(), indices))
    return SegmentPlan(total, groups)


def segment_attention(qkv: torch.Tensor, plan: SegmentPlan, scale: float) -> torch.Tensor:
    """qkv: [tokens, 3, heads, dim] (q, k, v of each token side by side);
    returns [tokens, heads, dim], each token attending to its own segment."""
    tokens, _, heads, dim = qkv.shape
    if tokens != plan.tokens:
        raise ValueError(f"segment plan for {plan.tokens} tokens, got {tokens}")
    out = qkv.new_empty(tokens, heads, dim)
    for group in plan.groups:
        rows = qkv if group.index is None else qkv.index_select(0, group.index)
        # [count, length, 3, heads, dim] -> three [count, heads, length, dim] views.
        q, k, v = rows.view(group.count, group.length, 3, heads, dim).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2).reshape(-1, heads, dim)
        if group.index is None:
            return o   # the only group, rows already in order
        out.index_copy_(0, group.index, o)
    return out
