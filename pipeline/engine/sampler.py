"""Next-token choice for a batch of rows: greedy, temperature, top-k, top-p,
per-request seeds, and min_tokens (end tokens masked until enough output).

Greedy rows take one batched argmax; only sampled rows do per-row work, since
each may carry its own generator (a seeded request must give the same tokens
whatever else is in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.engine.request import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    banned: tuple[int, ...] = ()  # token ids masked this step (min_tokens not reached)


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """logits [n, vocab] (any float dtype) -> one token id per row."""
    if not rows:
        return []
    if all(row.params.temperature == 0 and not row.banned for row in rows):
        # All greedy (the common serving case): the argmax of the logits as
        # they are, no float copy; converting to float never changes the order.
        return logits.argmax(-1).tolist()
    logits = logits.float()
    for i, row in enumerate(rows):
        if row.banned:
            logits[i, list(row.banned)] = float("-inf")
    tokens = logits.argmax(-1).tolist()
    for i, row in enumerate(rows):
        if row.params.temperature > 0:
            tokens[i] = _sample_row(logits[i], row)
    return tokens


def _sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
    p = row.params
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (always the first token).
        drop = probs.cumsum(-1) - probs >= p.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=row.generator))


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A private CPU generator for seeded sampling, else None (global RNG)."""
    if params.temperature == 0 or params.seed is None:
        return None
    return torch.Generator().manual_seed(params.seed)
