"""Next-token choice for a batch of rows: greedy, temperature, top-k, top-p,
min-p, per-request seeds, min_tokens (end tokens masked until enough
output), and the logits processors of engine/penalties.py.

Greedy rows take one batched argmax; bias and penalties are applied to the
whole batch at once; only sampled rows do per-row work, since each may
carry its own generator (a seeded request must give the same tokens
whatever else is in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeline.engine.grammar import Grammars
from pipeline.engine.penalties import PenaltyPool, apply_bias_and_penalties, apply_min_p
from pipeline.engine.request import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    banned: tuple[int, ...] = ()  # token ids masked this step (min_tokens not reached)
    pool_row: int | None = None   # the request's row in the PenaltyPool, if penalised
    matcher: Any = None           # the request's grammar matcher (engine/grammar.py), if any


def _plain(row: SamplingRow) -> bool:
    return (row.params.temperature == 0 and not row.banned and not row.params.logit_bias and row.pool_row is None
            and row.matcher is None)


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: list[SamplingRow], pool: PenaltyPool | None = None,
           grammars: Grammars | None = None) -> list[int]:
    """logits [n, vocab] (any float dtype) -> one token id per row."""
    if not rows:
        return []
    if all(_plain(row) for row in rows):
        # All greedy (the common serving case): the argmax of the logits as
        # they are, no float copy; converting to float never changes the order.
        return logits.argmax(-1).tolist()
    logits = logits.float()
    for i, row in enumerate(rows):
        if row.banned:
            logits[i, list(row.banned)] = float("-inf")
    apply_bias_and_penalties(logits, [row.params for row in rows], [row.pool_row for row in rows], pool)
    constrained = [i for i, row in enumerate(rows) if row.matcher is not None]
    if constrained:
        grammars.apply(logits, constrained, [rows[i].matcher for i in constrained])
    tokens = logits.argmax(-1).tolist()
    for i, row in enumerate(rows):
        if row.params.temperature > 0:
            tokens[i] = _sample_row(logits[i], row)
    return tokens


def _sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
    p = row.params
    logits = logits / p.temperature
    if p.min_p > 0:
        logits = apply_min_p(logits.unsqueeze(0), torch.tensor([p.min_p], device=logits.device))[0]
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
