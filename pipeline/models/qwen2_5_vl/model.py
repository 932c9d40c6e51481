"""Qwen2.5-VL: vision tower + language model + output head, as one module
whose parameter names are the reference checkpoint's."""

from __future__ import annotations

import torch

from pipeline.models.attention import AttentionBackend
from pipeline.models.qwen2_5_vl import positions as mrope
from pipeline.models.qwen2_5_vl.config import Qwen25VLConfig, model_spec
from pipeline.models.qwen2_5_vl.text import TextModel
from pipeline.models.qwen2_5_vl.vision import VisionTower
from pipeline.models.qwen2_5_vl.vision_layout import Grid
from pipeline.models.vl_model import VisionLanguageModel


class Qwen25VL(VisionLanguageModel):
    def __init__(self, cfg: Qwen25VLConfig) -> None:
        super().__init__(cfg, model_spec(cfg), VisionTower(cfg.vision), TextModel(cfg.text))

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend, side: None = None) -> torch.Tensor:
        """Final hidden states [T, hidden] for a flat stream of T tokens
        (`side` is for families with side levels: this one has none)."""
        if side is not None:
            raise ValueError("Qwen2.5-VL takes no side features")
        return self.model(embeds, positions, attn)

    def prompt_positions(self, num_tokens: int, image_spans: list[tuple[int, int]], grids: list[Grid],
                         seconds_per_grid: list[float | None] | None = None) -> tuple[torch.Tensor, int]:
        """M-RoPE positions [3, num_tokens] of a prompt and its decode delta.
        `seconds_per_grid`: per span, the seconds one temporal patch of a
        video spans (None for an image)."""
        intervals = None if seconds_per_grid is None else [
            1.0 if s is None else self.cfg.vision.tokens_per_second * s for s in seconds_per_grid]
        return mrope.prompt_positions(num_tokens, image_spans, grids, self.spatial_merge_size, intervals)
