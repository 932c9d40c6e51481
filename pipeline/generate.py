"""Offline greedy generation: a plain loop over one request, no engine.

Used by `bin/epd-generate` and as the reference the serving engine is tested
against. The model runs prefill over the whole prompt (image embeddings
spliced in at their placeholder spans, with their side levels), then one
token per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.models.attention import ContiguousKVCache
from pipeline.models.spec import ModelSpec, span_rows, splice_rows
from pipeline.processing.processor import MultimodalPrompt


@dataclass(frozen=True)
class GenerationLimits:
    max_tokens: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool = False


def splice_images(spec: ModelSpec, embeds: torch.Tensor, spans: list[tuple[int, int]],
                  grids: list[tuple[int, int, int]], items: list[torch.Tensor]) -> torch.Tensor | None:
    """Write each item's embedding rows over its placeholder runs (one run,
    or one per temporal patch of a video where the family splits them), in
    place, and return the prompt's side levels (None for a family without
    them). Rows that disagree with the runs are an error, never a silent fill."""
    pieces = []
    for (start, length), rows in zip(spans, span_rows(spec, grids, spans), strict=True):
        embedding = items[rows.item]
        if embedding.shape[0] != rows.item_tokens:
            raise ValueError(f"an embedding of {embedding.shape[0]} tokens for an item of {rows.item_tokens}")
        pieces.append((start, embedding[rows.offset:rows.offset + length]))
    return splice_rows(spec, embeds, pieces)


@torch.inference_mode()
def greedy_generate(model: torch.nn.Module, prompt: MultimodalPrompt,
                    pixel_values: torch.Tensor | None, limits: GenerationLimits) -> list[int]:
    """Token ids generated after the prompt (a stop token, when hit, is the
    last one)."""
    device = next(model.parameters()).device
    lang = model.spec.language
    ids = torch.tensor(prompt.token_ids, device=device)
    embeds = model.embed(ids)
    side = None
    if prompt.grids:
        images = model.encode_images(pixel_values.to(device), prompt.grids)
        side = splice_images(model.spec, embeds, prompt.image_spans, prompt.grids, images)
    positions, delta = model.prompt_positions(len(prompt.token_ids), prompt.image_spans, prompt.grids,
                                              list(prompt.seconds_per_grid) or None)
    cache = ContiguousKVCache(lang.num_layers, len(prompt.token_ids) + limits.max_tokens,
                              lang.kv_heads, lang.head_dim, embeds.dtype, device)
    out: list[int] = []
    hidden = model(embeds, positions.to(device), cache, side)
    cache.commit(embeds.shape[0])
    while len(out) < limits.max_tokens:
        token = int(model.logits(hidden[-1:]).argmax(-1))
        out.append(token)
        finished = token in limits.stop_token_ids and not limits.ignore_eos
        if finished or len(out) == limits.max_tokens:
            break
        step_positions = model.decode_positions(cache.length, 1, delta).to(device)
        hidden = model(model.embed(torch.tensor([token], device=device)), step_positions, cache)
        cache.commit(1)
    return out
