"""M-RoPE positions for a prompt of text and image spans.

Text advances all three axes together. An image of (t, h, w) merged units at
running position p gets (p + t_i, p + h_i, p + w_i), and the text after it
resumes at p + max(h, w) (images have t = 1). A video's temporal patch i
sits at p + int(i * interval) on the time axis, the interval being the
model's tokens per second times the seconds a temporal patch spans. Because images take fewer
positions than tokens, later tokens sit at `index + delta`, where `delta` is
fixed once the prompt is known; decode steps use that delta.
"""

from __future__ import annotations

import torch

from pipeline.models.mrope_decode import decode_positions, decode_step_positions
from pipeline.models.qwen2_5_vl.vision_layout import Grid

__all__ = ["decode_positions", "decode_step_positions", "prompt_positions"]


def prompt_positions(num_tokens: int, image_spans: list[tuple[int, int]], grids: list[Grid], merge: int,
                     time_intervals: list[float] | None = None) -> tuple[torch.Tensor, int]:
    """Positions [3, num_tokens] (int64) and the decode delta. `time_intervals`:
    per span, the time-axis step between temporal patches (1 for images)."""
    if len(image_spans) != len(grids):
        raise ValueError(f"{len(image_spans)} image spans but {len(grids)} image grids")
    intervals = [1.0] * len(grids) if time_intervals is None else time_intervals
    if len(intervals) != len(grids):
        raise ValueError(f"{len(intervals)} time intervals for {len(grids)} grids")
    parts: list[torch.Tensor] = []
    cursor = 0     # next token index
    position = 0   # next text position
    for (start, length), (t, h, w), interval in zip(image_spans, grids, intervals):
        gh, gw = h // merge, w // merge
        if length != t * gh * gw:
            raise ValueError(f"image span of {length} tokens does not match grid {(t, h, w)}")
        if start < cursor:
            raise ValueError("image spans overlap or are out of order")
        parts.append(_text(start - cursor, position))
        position += start - cursor
        # As the reference: the float product truncated, then the offset added.
        tt = (torch.arange(t) * interval).long().view(t, 1, 1).expand(t, gh, gw)
        hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw)
        ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw)
        parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + position)
        position += max(gh, gw)
        cursor = start + length
    if cursor > num_tokens:
        raise ValueError("image span runs past the end of the prompt")
    parts.append(_text(num_tokens - cursor, position))
    positions = torch.cat(parts, dim=1)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta


def _text(n: int, start: int) -> torch.Tensor:
    return (torch.arange(n) + start).view(1, -1).expand(3, -1)
