"""M-RoPE positions of Qwen3-VL prompts.

For images Qwen3-VL lays positions out as Qwen2.5-VL does (text advances
all three axes; an image of gh x gw merged units at running position p gets
(p, p + row, p + col) and the text after it resumes at p + max(gh, gw)), so
this reuses that code. Only videos differ: Qwen3-VL splits a clip into one
grid of t = 1 per temporal patch, each with a placeholder run of its own
and timestamp text between them, positioned as an image each.
"""

from __future__ import annotations

import torch

from pipeline.models.qwen2_5_vl import positions as qwen2_5
from pipeline.models.qwen3_vl.vision_layout import Grid

__all__ = ["prompt_positions"]


def prompt_positions(num_tokens: int, image_spans: list[tuple[int, int]],
                     grids: list[Grid], merge: int) -> tuple[torch.Tensor, int]:
    """Positions [3, num_tokens] (int64) and the decode delta; `grids` per
    item (a video's (t, h, w) covers t runs of `image_spans`)."""
    frames = [(1, h, w) for t, h, w in grids for _ in range(t)]
    return qwen2_5.prompt_positions(num_tokens, image_spans, frames, merge)
