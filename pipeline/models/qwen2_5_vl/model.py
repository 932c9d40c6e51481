"""Qwen2.5-VL: vision tower + language model + output head, as one module
whose parameter names are the reference checkpoint's."""

from __future__ import annotations

import torch
from torch import nn

from pipeline.models.attention import AttentionBackend
from pipeline.models.qwen2_5_vl import positions as mrope
from pipeline.models.qwen2_5_vl.config import Qwen25VLConfig, model_spec
from pipeline.models.qwen2_5_vl.text import TextModel
from pipeline.models.qwen2_5_vl.vision import VisionTower
from pipeline.models.qwen2_5_vl.vision_layout import Grid
from pipeline.models.spec import ModelSpec


class Qwen25VL(nn.Module):
    def __init__(self, cfg: Qwen25VLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.spec: ModelSpec = model_spec(cfg)
        self.visual = VisionTower(cfg.vision)
        self.model = TextModel(cfg.text)
        if not cfg.text.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)

    def fuse(self) -> None:
        """Merge same-input projections of the language model (see TextModel.fuse)."""
        self.model.fuse()

    def reset_buffers(self) -> None:
        self.visual.reset_buffers()
        self.model.rotary.reset_buffers()

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    @property
    def spatial_merge_size(self) -> int:
        return self.cfg.vision.spatial_merge_size

    def encode_images(self, pixel_values: torch.Tensor, grids: list[Grid]) -> list[torch.Tensor]:
        """One vision forward over a packed batch; one [tokens_i, width] per image."""
        return self.visual(pixel_values, grids)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

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

    def decode_positions(self, first_index: int, count: int, delta: int) -> torch.Tensor:
        return mrope.decode_positions(first_index, count, delta)

    def decode_step_positions(self, indices: list[int], deltas: list[int]) -> torch.Tensor:
        """One decode token per request (a batched decode step), in one tensor."""
        return mrope.decode_step_positions(indices, deltas)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.cfg.text.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight)
