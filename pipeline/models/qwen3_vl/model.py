"""Qwen3-VL: vision tower + language model + output head, as one module
whose parameter names are the checkpoint's (after the family's mapping).

The same API as Qwen25VL, plus DeepStack: `encode_images` returns per image
[tokens, (1 + L) * hidden] (main embedding, then L levels), `split_features`
takes one apart, and `forward` takes the levels as `side` [T, L, H]
aligned with the token stream, zeros where there is no image token.
"""

from __future__ import annotations

import torch

from pipeline.models.attention import AttentionBackend
from pipeline.models.qwen3_vl import positions as mrope
from pipeline.models.qwen3_vl.config import Qwen3VLConfig, model_spec
from pipeline.models.qwen3_vl.text import TextModel
from pipeline.models.qwen3_vl.vision import VisionTower
from pipeline.models.qwen3_vl.vision_layout import Grid
from pipeline.models.vl_model import VisionLanguageModel


class Qwen3VL(VisionLanguageModel):
    def __init__(self, cfg: Qwen3VLConfig) -> None:
        super().__init__(cfg, model_spec(cfg), VisionTower(cfg.vision), TextModel(cfg.text))

    @property
    def deepstack_levels(self) -> int:
        return self.cfg.deepstack_levels

    def split_features(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, (1 + L) * H] image features -> (embeddings [n, H] for the
        image tokens, deepstack levels [n, L, H]); views, no copy."""
        hidden = self.cfg.text.hidden_size
        return features[:, :hidden], features[:, hidden:].unflatten(1, (self.deepstack_levels, hidden))

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                side: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden] for a flat stream of T tokens;
        `side` holds the DeepStack levels [T, L, H] (spec.side_levels)."""
        if side is not None and side.shape != (embeds.shape[0], self.deepstack_levels, embeds.shape[1]):
            raise ValueError(f"deepstack levels of shape {tuple(side.shape)}, expected "
                             f"{(embeds.shape[0], self.deepstack_levels, embeds.shape[1])}")
        return self.model(embeds, positions, attn, side)

    def prompt_positions(self, num_tokens: int, image_spans: list[tuple[int, int]], grids: list[Grid],
                         seconds_per_grid: list[float | None] | None = None) -> tuple[torch.Tensor, int]:
        """M-RoPE positions [3, num_tokens] of a prompt and its decode delta.
        A video's time is in its timestamp text, so `seconds_per_grid` goes unused."""
        return mrope.prompt_positions(num_tokens, image_spans, grids, self.spatial_merge_size)
