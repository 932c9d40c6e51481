"""M-RoPE positions of Qwen3-VL prompts.

For images Qwen3-VL lays positions out as Qwen2.5-VL does (text advances
all three axes; an image of gh x gw merged units at running position p gets
(p, p + row, p + col) and the text after it resumes at p + max(gh, gw)), so
this reuses that code. Only videos differ: Qwen3-VL splits a clip into one
grid of t = 1 per frame, with timestamp text between them, so every grid
here must have t = 1.
"""

from __future__ import annotations

import torch

from pipeline.models.qwen2_5_vl import positions as qwen2_5
from pipeline.models.qwen3_vl.vision_layout import Grid

decode_positions = qwen2_5.decode_positions
decode_step_positions = qwen2_5.decode_step_positions


def prompt_positions(num_tokens: int, image_spans: list[tuple[int, int]],
                     grids: list[Grid], merge: int) -> tuple[torch.Tensor, int]:
    """Positions [3, num_tokens] (int64) and the decode delta."""
    frames = [g for g in grids if g[0] != 1]
    if frames:
        raise ValueError(f"grid {tuple(frames[0])} has t != 1: Qwen3-VL positions one frame per grid")
    return qwen2_5.prompt_positions(num_tokens, image_spans, grids, merge)
