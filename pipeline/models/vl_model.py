"""What every vision-language model module here shares: a vision tower at
`visual`, a language model at `model` (embed_tokens, rotary, fuse), an
output head tied to the embeddings or at `lm_head`, and M-RoPE decode
positions. A family's model adds its forward and its prompt positions."""

from __future__ import annotations

import torch
from torch import nn

from pipeline.models.mrope_decode import decode_positions, decode_step_positions
from pipeline.models.spec import ModelSpec


class VisionLanguageModel(nn.Module):
    def __init__(self, cfg, spec: ModelSpec, visual: nn.Module, language: nn.Module) -> None:
        super().__init__()
        self.cfg = cfg
        self.spec = spec
        self.visual = visual
        self.model = language
        if not cfg.text.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)

    def fuse(self) -> None:
        """Merge same-input projections of the language model (its TextModel.fuse);
        the vision tower's fused path is its own (VisionTower.fuse)."""
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

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """One vision forward over a packed batch of images and videos; one
        [tokens_i, spec.embedding_width] per item."""
        return self.visual(pixel_values, grids)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def decode_positions(self, first_index: int, count: int, delta: int) -> torch.Tensor:
        return decode_positions(first_index, count, delta)

    def decode_step_positions(self, indices: list[int], deltas: list[int]) -> torch.Tensor:
        """One decode token per request (a batched decode step), in one tensor."""
        return decode_step_positions(indices, deltas)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.cfg.text.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight)
