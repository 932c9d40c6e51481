"""Executes a step plan on the model: builds the flat batch (token ids,
positions, spliced image embeddings and their side levels, paged-attention
layout), runs one forward over every chunk, and returns the logits of the
rows due a sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.engine.decode_graphs import DecodeGraphs
from pipeline.engine.mixed_attention import MixedStepAttention
from pipeline.engine.mixed_graphs import MixedGraphs
from pipeline.engine.paged_attention import PagedKVCache, ReferencePagedAttention, SequenceSlice, StepLayout
from pipeline.engine.plan import Chunk, StepPlan
from pipeline.engine.prompt_logprobs import PromptLogprob, chunk_prompt_logprobs
from pipeline.engine.request import Request
from pipeline.models.spec import splice_rows


@dataclass
class PromptGeometry:
    """What the runner needs to place a request's tokens: its prompt's
    positions [position_axes, prompt_len] and the decode delta."""

    positions: torch.Tensor
    delta: int


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, device: torch.device,
                 decode: DecodeGraphs | None = None, mixed: MixedGraphs | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.decode = decode
        self.mixed = mixed
        # Aggregated mode's vision forward: (pixels, grids) -> embeddings; the
        # generator may swap in VisionGraphs over model.visual.
        self.vision = model.encode_images

    @torch.inference_mode()
    def encode_images(self, inputs: list[tuple[torch.Tensor, tuple[int, int, int]]]) -> list[torch.Tensor]:
        """Aggregated mode: one vision forward over several images' pixels."""
        pixels = torch.cat([p for p, _ in inputs]).to(self.device)
        return self.vision(pixels, [g for _, g in inputs])

    def is_fast_decode(self, plan: StepPlan, requests: dict[str, Request]) -> bool:
        """The plan runs on the decode graphs: one token past its prompt for every chunk."""
        return self.decode is not None and all(
            c.num_tokens == 1 and c.start >= requests[c.request_id].num_prompt_tokens for c in plan.chunks)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, requests: dict[str, Request], geometry: dict[str, PromptGeometry],
                embeddings, device_tokens: torch.Tensor | None = None,
                prompt_logprobs: dict[str, dict[int, PromptLogprob]] | None = None) -> tuple[list[Chunk], torch.Tensor]:
        """Run the plan's chunks; returns the chunks due a sample and their
        logits rows [n, vocab]. `embeddings(key)` gives a cached image
        embedding. `device_tokens`: a fast decode plan's input tokens, still
        on the device (see DecodeGraphs.run). `prompt_logprobs`: for the
        requests that still want their prompt's logprobs, where this step's
        prompt chunks add theirs (engine/prompt_logprobs.py)."""
        if self.is_fast_decode(plan, requests):
            return plan.chunks, self._decode(plan, requests, geometry, device_tokens)
        if device_tokens is not None:
            raise ValueError("device_tokens are for fast decode plans only")
        ids, slices, splices = [], [], []
        positions = _StepPositions(self.model)
        offset = 0
        for chunk in plan.chunks:
            request = requests[chunk.request_id]
            ids += request.token_ids_between(chunk.start, chunk.end)
            positions.add(geometry[chunk.request_id], chunk, request.num_prompt_tokens)
            slices.append(SequenceSlice(offset, chunk.num_tokens, chunk.start, request.block_ids.view()))
            for span in chunk.image_spans_in_chunk:
                lo, hi = max(chunk.start, span.start), min(chunk.end, span.end)
                splices.append((offset + lo - chunk.start, span.key, span.offset + lo - span.start, hi - lo))
            offset += chunk.num_tokens
        due = [c for c in plan.chunks if c.sample]
        rows = [s.offset + s.query_len - 1 for s, c in zip(slices, plan.chunks) if c.sample]
        # A chunk that covers part of an image takes the same rows of its
        # embedding, side levels included.
        pieces = [(at, embeddings(key)[first:first + count]) for at, key, first, count in splices]
        scored = [(c, s) for c, s in zip(plan.chunks, slices) if c.request_id in (prompt_logprobs or {})
                  and c.start < requests[c.request_id].num_prompt_tokens - 1]
        if self.mixed is not None and not scored:
            return due, self.mixed.run(ids, positions.tensor(), slices, pieces, rows)
        embeds = self.model.embed(torch.tensor(ids, device=self.device))
        side = splice_rows(self.model.spec, embeds, pieces)
        layout = StepLayout.build(slices, self.kv_cache.block_size, self.device)
        # The fast path's mixed steps batch their decode rows; the reference
        # backend is what the equality tests pin.
        backend = MixedStepAttention if self.decode is not None else ReferencePagedAttention
        hidden = self.model(embeds, positions.tensor().to(self.device), backend(self.kv_cache, layout), side)
        for chunk, piece in scored:
            request = requests[chunk.request_id]
            prompt_logprobs[chunk.request_id].update(chunk_prompt_logprobs(
                self.model, hidden, piece.offset, chunk.start, chunk.end, request.prompt_token_ids,
                request.sampling_params.prompt_logprobs))
        logits = self.model.logits(hidden[rows]) if rows else hidden.new_empty(0, 0)
        return due, logits

    def _decode(self, plan: StepPlan, requests: dict[str, Request], geometry: dict[str, PromptGeometry],
                device_tokens: torch.Tensor | None) -> torch.Tensor:
        chunks = plan.chunks
        reqs = [requests[c.request_id] for c in chunks]
        positions = self.model.decode_step_positions([c.start for c in chunks],
                                                     [geometry[c.request_id].delta for c in chunks])
        return self.decode.run([r.token_ids_between(c.start, c.end)[0] for r, c in zip(reqs, chunks)], positions,
                               [r.block_ids.view() for r in reqs], [c.start for c in chunks], device_tokens)


class _StepPositions:
    """A step's positions [position_axes, tokens], chunk after chunk: the prompt's
    own positions where a chunk is in its prompt, the model's decode
    positions after it. Decode positions of consecutive chunks are gathered
    as ints and made into one tensor: a step beside ~100 decoding requests
    would otherwise build ~100 small tensors (0.5 ms of host time here)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.parts: list[torch.Tensor] = []
        # The current run of decode tokens: their token indices and their
        # requests' decode deltas.
        self.indices: list[int] = []
        self.deltas: list[int] = []

    def add(self, geometry: PromptGeometry, chunk: Chunk, prompt_len: int) -> None:
        if chunk.start < prompt_len:
            self._flush()
            self.parts.append(geometry.positions[:, chunk.start:min(chunk.end, prompt_len)])
        first = max(chunk.start, prompt_len)
        if chunk.end > first:
            self.indices.extend(range(first, chunk.end))
            self.deltas.extend([geometry.delta] * (chunk.end - first))

    def tensor(self) -> torch.Tensor:
        self._flush()
        return torch.cat(self.parts, dim=1) if len(self.parts) > 1 else self.parts[0]

    def _flush(self) -> None:
        if self.indices:
            self.parts.append(self.model.decode_step_positions(self.indices, self.deltas))
            self.indices, self.deltas = [], []
