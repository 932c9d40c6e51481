"""What the serving code may know about a model, whatever its family.

Every family answers with one ModelSpec built from its own config, and the
code outside pipeline/models/ reads this and nothing else: KV geometry, the
sizes that budgets count, how many position axes a token has, which tokens
mark images and videos, how an item's placeholder runs lie (span_rows), and
the layout of an encoder's output rows.

An encoder's output row for one image token is `embedding_width` wide:
the input embedding (`hidden_size`), then `side_levels` more slices of
`hidden_size` each. Side level i is added to the hidden states at that
token after language-model layer i (Qwen3-VL's DeepStack); a family
without them has `side_levels` 0 and rows `hidden_size` wide.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LanguageSpec:
    num_layers: int
    num_attention_heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_context: int


@dataclass(frozen=True)
class VisionSpec:
    hidden_size: int
    intermediate_size: int
    # Patches merged into one output token: a vision forward over N output
    # tokens runs its blocks over N * patches_per_token rows.
    patches_per_token: int


@dataclass(frozen=True)
class ModelSpec:
    family: str
    language: LanguageSpec
    vision: VisionSpec
    position_axes: int  # rows of a token's position (3 for M-RoPE)
    image_token_id: int
    eos_token_ids: tuple[int, ...]
    side_levels: int = 0
    # A video's temporal patches each take a placeholder run of their own
    # (with text, e.g. a timestamp, between them) instead of one run.
    frame_spans: bool = False
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None

    @property
    def embedding_width(self) -> int:
        return self.language.hidden_size * (1 + self.side_levels)

    def split_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encoder output rows [n, embedding_width] -> (input embeddings
        [n, hidden], side levels [n, side_levels, hidden] or None); views."""
        hidden = self.language.hidden_size
        if rows.shape[-1] != self.embedding_width:
            raise ValueError(f"image embedding rows are {rows.shape[-1]} wide; this model takes "
                             f"{self.embedding_width} ({1 + self.side_levels} x {hidden})")
        if not self.side_levels:
            return rows, None
        return rows[:, :hidden], rows[:, hidden:].unflatten(1, (self.side_levels, hidden))


@dataclass(frozen=True)
class SpanRows:
    """Which item a placeholder run belongs to, and which rows of that
    item's embedding fill it."""
    item: int
    offset: int
    item_tokens: int


def span_rows(spec: ModelSpec, grids: list[tuple[int, int, int]],
              spans: list[tuple[int, int]]) -> list[SpanRows]:
    """Per placeholder run, in order: its item (grids[i], an image or a
    video) and the rows it takes. ValueError if the runs do not fit the grids."""
    out: list[SpanRows] = []
    lengths: list[int] = []
    for item, (t, h, w) in enumerate(grids):
        tokens = t * h * w // spec.vision.patches_per_token
        runs = t if spec.frame_spans else 1
        out += [SpanRows(item, run * (tokens // runs), tokens) for run in range(runs)]
        lengths += [tokens // runs] * runs
    if [length for _, length in spans] != lengths:
        raise ValueError(f"placeholder runs of {[length for _, length in spans]} tokens where the items' grids "
                         f"give {lengths}")
    return out


def splice_rows(spec: ModelSpec, embeds: torch.Tensor,
                pieces: list[tuple[int, torch.Tensor]]) -> torch.Tensor | None:
    """Write each piece (token offset, encoder rows) into `embeds` [T, hidden]
    and return the step's side input [T, side_levels, hidden], zeros where
    no image token is (adding zeros leaves a hidden state exactly as it
    was), or None for a family without side levels."""
    side = (embeds.new_zeros(embeds.shape[0], spec.side_levels, embeds.shape[1])
            if spec.side_levels else None)
    for at, rows in pieces:
        main, levels = spec.split_rows(rows)
        embeds[at:at + rows.shape[0]] = main.to(embeds.dtype)
        if side is not None:
            side[at:at + rows.shape[0]] = levels.to(side.dtype)
    return side


def spec_from_config(family: str, cfg, side_levels: int = 0, frame_spans: bool = False) -> ModelSpec:
    """The spec of a config with `text` and `vision` parts in the hub's
    field names (num_hidden_layers, num_key_value_heads, ...), M-RoPE
    positions, and `image_token_id` / `video_token_id` / `vision_start_token_id` /
    `vision_end_token_id` / `eos_token_ids` / `max_context`."""
    text, vision = cfg.text, cfg.vision
    language = LanguageSpec(text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads,
                            text.head_dim, text.hidden_size, text.intermediate_size, text.vocab_size,
                            cfg.max_context)
    return ModelSpec(family, language,
                     VisionSpec(vision.hidden_size, vision.intermediate_size, vision.spatial_merge_size ** 2),
                     position_axes=3, image_token_id=cfg.image_token_id,
                     eos_token_ids=tuple(cfg.eos_token_ids), side_levels=side_levels, frame_spans=frame_spans,
                     video_token_id=cfg.video_token_id, vision_start_token_id=cfg.vision_start_token_id,
                     vision_end_token_id=cfg.vision_end_token_id)
