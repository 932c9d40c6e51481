"""Bidirectional attention inside the segments of a packed sequence (the
vision tower's windows and frames), planned once per forward.

Segments of equal length are stacked and run as one batched SDPA call, so a
batch of images (whose windows mostly share one size) costs a few kernel
launches instead of one per window, with no padding. Where a length group's
rows lie side by side it is a slice; otherwise its rows are gathered, and
its outputs scattered back (the Qwen2.5-VL tower orders its windows by
length so that its 28 window blocks need neither; qwen2_5_vl/vision_layout.py).
The plan (which rows each length group reads) depends only on the segment
lengths and the row order, so it is built once per forward on the host and
sent to the device in one copy, not rebuilt by every block: a host-to-device
copy from pageable memory waits for the GPU, and one per block and length
group kept the host from running ahead of the vision forward at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SegmentGroup:
    length: int
    count: int
    index: torch.Tensor | None   # [count * length] rows in segment order; None: the rows from `start`, in order
    start: int = 0


@dataclass(frozen=True)
class SegmentPlan:
    tokens: int
    groups: tuple[SegmentGroup, ...]


def plan_segments(seqlens: list[int], device: torch.device, rows: torch.Tensor | None = None) -> SegmentPlan:
    """Group the segments (laid end to end with these lengths; zeros are
    skipped) by length; one host-to-device copy for every group's rows.
    `rows` (on the CPU): the sequence's i-th token is row rows[i] of the
    tensor attended over (default: row i). A group whose rows are
    consecutive is a slice of it, and costs no gather."""
    starts, total = [], 0
    for n in seqlens:
        starts.append(total)
        total += n
    by_length: dict[int, list[int]] = {}
    for start, n in zip(starts, seqlens):
        if n:
            by_length.setdefault(n, []).append(start)
    groups, gathered = [], []
    for n, seg_starts in by_length.items():
        logical = (torch.tensor(seg_starts)[:, None] + torch.arange(n)[None, :]).reshape(-1)
        physical = logical if rows is None else rows[logical]
        first = int(physical[0])
        if torch.equal(physical, torch.arange(first, first + physical.numel())):
            groups.append(SegmentGroup(n, len(seg_starts), None, first))
        else:
            groups.append(None)
            gathered.append(physical)
    indices = iter(torch.cat(gathered).to(device).split([g.numel() for g in gathered]) if gathered else ())
    groups = [g if g is not None else SegmentGroup(n, len(s), next(indices))
              for g, (n, s) in zip(groups, by_length.items())]
    return SegmentPlan(total, tuple(groups))


def segment_attention(qkv: torch.Tensor, plan: SegmentPlan, scale: float) -> torch.Tensor:
    """qkv: [tokens, 3, heads, dim] (q, k, v of each token side by side);
    returns [tokens, heads, dim], each token attending to its own segment."""
    tokens, _, heads, dim = qkv.shape
    if tokens != plan.tokens:
        raise ValueError(f"segment plan for {plan.tokens} tokens, got {tokens}")
    if not plan.groups:
        return qkv.new_empty(tokens, heads, dim)
    out = None if all(g.index is None for g in plan.groups) else qkv.new_empty(tokens, heads, dim)
    slices = []
    for group in plan.groups:
        size = group.count * group.length
        rows = qkv[group.start:group.start + size] if group.index is None else qkv.index_select(0, group.index)
        # [count, length, 3, heads, dim] -> three [count, heads, length, dim] views.
        q, k, v = rows.view(group.count, group.length, 3, heads, dim).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2).reshape(-1, heads, dim)
        if group.index is not None:
            out.index_copy_(0, group.index, o)
        elif out is not None:
            out[group.start:group.start + size] = o
        else:
            slices.append((group.start, o))
    if out is not None:
        return out
    # Every group a slice: between them they tile the rows, so their outputs
    # in row order are the whole (one copy, or none for a single group).
    slices.sort(key=lambda item: item[0])
    return slices[0][1] if len(slices) == 1 else torch.cat([o for _, o in slices])
