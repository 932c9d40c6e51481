"""What a Qwen3-VL vision forward needs from the image grids alone.

Patches arrive in merge order: the merge x merge patches of one merged
unit are contiguous, units row-major over the image. For every patch this
gives its (row, col) for the 2-D rotary, and the four rows of the learned
square position table and their weights that resample it bilinearly to the
image's grid (align_corners: the grid's corners land on the table's). Both
depend only on the grid, so they are computed on the CPU once per distinct
grid and cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

Grid = tuple[int, int, int]  # (t, h, w) in patches


@dataclass(frozen=True)
class GridLayout:
    positions: torch.Tensor      # [patches, 2] (row, col) per patch, merge order
    table_rows: torch.Tensor     # [patches, 4] rows of the position table, int64
    table_weights: torch.Tensor  # [patches, 4] their bilinear weights, float32
    frame_seqlens: list[int]     # patches per frame: attention stays inside a frame


@lru_cache(maxsize=1024)
def grid_layout(grid: Grid, merge: int, side: int) -> GridLayout:
    t, h, w = grid
    if h % merge or w % merge:
        raise ValueError(f"grid {grid} is not divisible by the spatial merge size {merge}")
    rows, cols = merge_order(h, w, merge)
    row_taps, row_weights = _axis_taps(rows, h, side)
    col_taps, col_weights = _axis_taps(cols, w, side)
    # Outer product of the two axes: (top, left), (top, right), (bottom, left), (bottom, right).
    table_rows = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    table_weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return GridLayout(
        positions=torch.stack([rows, cols], dim=-1).repeat(t, 1),
        table_rows=table_rows.repeat(t, 1),
        table_weights=table_weights.repeat(t, 1),
        frame_seqlens=[h * w] * t,
    )


def merge_order(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch of one frame, in merge order."""
    rows = torch.arange(h).view(h, 1).expand(h, w)
    cols = torch.arange(w).view(1, w).expand(h, w)
    block = (h // merge, merge, w // merge, merge)
    return (rows.reshape(block).transpose(1, 2).reshape(-1),
            cols.reshape(block).transpose(1, 2).reshape(-1))


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For patch coordinates `index` on an axis of `size` patches: the two
    table coordinates that bracket each one and their linear weights.
    Written as the reference computes it (source coordinate, floor, hat
    weights, clamped taps), so the float32 weights match it exactly."""
    source = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(source)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - ((source - floor)[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


@dataclass(frozen=True)
class BatchLayout:
    positions: torch.Tensor
    table_rows: torch.Tensor
    table_weights: torch.Tensor
    frame_seqlens: list[int]
    units_per_image: list[int]


def batch_layout(grids: list[Grid], merge: int, side: int, device: torch.device) -> BatchLayout:
    """The layouts of a packed batch of images, end to end, on `device`."""
    layouts = [grid_layout(tuple(int(x) for x in grid), merge, side) for grid in grids]
    return BatchLayout(
        positions=torch.cat([l.positions for l in layouts]).to(device),
        table_rows=torch.cat([l.table_rows for l in layouts]).to(device),
        table_weights=torch.cat([l.table_weights for l in layouts]).to(device),
        frame_seqlens=[n for l in layouts for n in l.frame_seqlens],
        units_per_image=[l.positions.shape[0] // merge ** 2 for l in layouts],
    )
