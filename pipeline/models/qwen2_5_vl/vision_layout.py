"""Token layout of the Qwen2.5-VL vision tower, from image grids alone.

The tower reorders each image's patches so that the patches of one attention
window are contiguous (window attention then becomes plain varlen attention),
and undoes the order after the patch merger. Across a batch, the windows are
then ordered by size (largest first, stable): a 640x640 image has windows of
64, 48 and 36 patches, and with each size's windows side by side the window
blocks attend over slices of the rows rather than gathering them (segments.py).
The four full-attention blocks instead read each frame's rows through
`frame_rows`, in the frame's own window order: attention inside a segment
does not depend on the order of its rows, so the outputs are the same.
Everything here depends only on the grid sizes: each grid's layout is
computed on the CPU once and cached, and a batch's is assembled from them
(about 1.4 ms for sixteen 640x640 images; a captured forward reuses the
plan it was captured with).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

Grid = tuple[int, int, int]  # (t, h, w) in patches


@dataclass(frozen=True)
class GridLayout:
    """Layout of one image (or video clip), in merged units of merge**2 patches."""

    window_index: torch.Tensor   # [units] unit order for window attention
    window_seqlens: list[int]    # patch tokens per window (some may be 0)
    frame_seqlens: list[int]     # patch tokens per frame, for full attention
    positions: torch.Tensor      # [patches, 2] (row, col) per patch, natural order


@lru_cache(maxsize=1024)
def grid_layout(grid: Grid, merge: int, window_units: int) -> GridLayout:
    t, h, w = grid
    if h % merge or w % merge:
        raise ValueError(f"grid {grid} is not divisible by the spatial merge size {merge}")
    gh, gw = h // merge, w // merge
    index = torch.arange(t * gh * gw).reshape(t, gh, gw)
    pad_h = window_units - gh % window_units
    pad_w = window_units - gw % window_units
    nwh, nww = (gh + pad_h) // window_units, (gw + pad_w) // window_units
    padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -1)
    padded = padded.reshape(t, nwh, window_units, nww, window_units).permute(0, 1, 3, 2, 4)
    padded = padded.reshape(t, nwh * nww, window_units * window_units)
    valid = padded >= 0
    window_seqlens = (valid.sum(-1).reshape(-1) * merge * merge).tolist()
    window_index = padded[valid]

    rows = torch.arange(h).view(h, 1).expand(h, w)
    cols = torch.arange(w).view(1, w).expand(h, w)
    block = (gh, merge, gw, merge)
    rows = rows.reshape(block).transpose(1, 2).reshape(-1)
    cols = cols.reshape(block).transpose(1, 2).reshape(-1)
    positions = torch.stack([rows, cols], dim=-1).repeat(t, 1)
    return GridLayout(window_index, window_seqlens, [h * w] * t, positions)


@dataclass(frozen=True)
class BatchLayout:
    """The layout of a packed batch of images, ready for one tower forward."""

    window_index: torch.Tensor   # [units] global unit order: windows by size
    reverse_index: torch.Tensor  # [units] undoes window_index
    window_seqlens: list[int]    # in that order
    frame_seqlens: list[int]
    frame_rows: torch.Tensor     # [patches] (CPU) the rows of the frames' patches, frame by frame
    positions: torch.Tensor      # [patches, 2]
    units_per_image: list[int]


def batch_layout(grids: list[Grid], merge: int, window_units: int,
                 device: torch.device) -> BatchLayout:
    indices, sizes, positions, frame_seqlens, units = [], [], [], [], []
    offset = 0
    for grid in grids:
        layout = grid_layout(tuple(int(x) for x in grid), merge, window_units)
        n = layout.window_index.numel()
        indices.append(layout.window_index + offset)
        sizes.append(torch.tensor(layout.window_seqlens) // (merge * merge))
        positions.append(layout.positions)
        frame_seqlens += layout.frame_seqlens
        units.append(n)
        offset += n
    images_order = torch.cat(indices)          # each image's windows in turn: frames contiguous
    size = torch.cat(sizes)                    # units per window (empty ones included)
    window_of_unit = torch.repeat_interleave(torch.arange(size.numel()), size)
    # Stable: inside one size, windows (and their units) keep the images' order.
    by_size = torch.argsort(-size[window_of_unit], stable=True)
    unit_rows = torch.empty_like(by_size)      # where each unit of images_order now sits
    unit_rows[by_size] = torch.arange(by_size.numel())
    kept = size[torch.argsort(-size, stable=True)]
    window_index = images_order[by_size].to(device)
    return BatchLayout(
        window_index=window_index,
        reverse_index=torch.argsort(window_index),
        window_seqlens=(kept[kept > 0] * merge * merge).tolist(),
        frame_seqlens=frame_seqlens,
        frame_rows=(unit_rows[:, None] * (merge * merge) + torch.arange(merge * merge)).reshape(-1),
        positions=torch.cat(positions).to(device),
        units_per_image=units,
    )
