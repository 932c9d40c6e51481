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
from pipeline.models.spec import ModelSpec, splice_rows
from pipeline.processing.processor import MultimodalPrompt


@dataclass(frozen=True)
class GenerationLimits:
    max_tokens: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool = False


def splice_images(spec: ModelSpec, embeds: torch.Tensor, spans: list[tuple[int, int]],
                  images: list[torch.Tensor]) -> torch.Tensor | None:
    """Write each image's embeddings over its placeholder run, in place, and
    return the prompt's side levels (None for a family without them). A
    count that disagrees with the span is an error, never a silent fill."""
    for (_, length), image in zip(spans, images, strict=True):
        if image.shape[0] != length:
            raise ValueError(f"image embedding has {image.shape[0]} tokens, its placeholder span {length}")
    return splice_rows(spec, embeds, [(start, image) for (start, _), image in zip(spans, images)])


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
        side = splice_images(model.spec, embeds, prompt.image_spans, images)
    positions, delta = model.prompt_positions(len(prompt.token_ids), prompt.image_spans, prompt.grids)
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
