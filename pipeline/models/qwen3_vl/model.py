"""Qwen3-VL: vision tower + language model + output head, as one module
whose parameter names are the checkpoint's (after the family's mapping).

The same API as Qwen25VL, plus DeepStack: `encode_images` returns per image
[tokens, (1 + L) * hidden] (main embedding, then L levels), `split_features`
takes one apart, and `forward` takes the levels as `side` [T, L, H]
aligned with the token stream, zeros where there is no image token.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.models.attention import AttentionBackend
from pipeline.models.qwen3_vl import positions as mrope
from pipeline.models.qwen3_vl.config import Qwen3VLConfig, model_spec
from pipeline.models.qwen3_vl.text import TextModel
from pipeline.models.qwen3_vl.vision import VisionTower
from pipeline.models.qwen3_vl.vision_layout import Grid
from pipeline.models.spec import ModelSpec


class Qwen3VL(nn.Module):
    def __init__(self, cfg: Qwen3VLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.spec: ModelSpec = model_spec(cfg)
        self.visual = VisionTower(cfg.vision)
        self.model = TextModel(cfg.text)
        if not cfg.text.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)

    def fuse(self) -> None:
        """Merge same-input projections of the language model (q/k/v, gate/up).
        The vision tower has no fused path yet (its LayerNorms have no
        LayerOps kernel)."""
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

    @property
    def deepstack_levels(self) -> int:
        return self.cfg.deepstack_levels

    def encode_images(self, pixel_values: torch.Tensor, grids: list[Grid]) -> list[torch.Tensor]:
        """One vision forward over a packed batch; one [tokens_i, (1 + L) * hidden] per image."""
        return self.visual(pixel_values, grids)

    def split_features(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, (1 + L) * H] image features -> (embeddings [n, H] for the
        image tokens, deepstack levels [n, L, H]); views, no copy."""
        hidden = self.cfg.text.hidden_size
        return features[:, :hidden], features[:, hidden:].unflatten(1, (self.deepstack_levels, hidden))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

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

    def decode_positions(self, first_index: int, count: int, delta: int) -> torch.Tensor:
        return mrope.decode_positions(first_index, count, delta)

    def decode_step_positions(self, indices: list[int], deltas: list[int]) -> torch.Tensor:
        """One decode token per request (a batched decode step), in one tensor."""
        return mrope.decode_step_positions(indices, deltas)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.cfg.text.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight)
