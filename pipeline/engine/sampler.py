"""Next-token choice for a batch of rows: greedy, temperature, top-k, top-p,
min-p, per-request seeds, allowed_token_ids (every other token cut), bans
(min_tokens' end tokens until enough output, bad_words' next tokens), the
logits processors of engine/penalties.py and the grammar masks of
engine/grammar.py.

Nothing loops over the batch on the device: greedy rows take one batched
argmax; bans, bias, penalties and masks apply to the whole batch at once;
the sampled rows go through engine/draw.py together, each with one uniform
number (a seeded request's from its own generator, so it gives the same
tokens whatever else is in the batch). Nothing here waits on the device:
the tokens stay there (sample_on_device) until engine/choose.py brings
them to the host with the logprobs, in the step's one copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipeline.engine.draw import draw
from pipeline.engine.grammar import GrammarMasks
from pipeline.engine.penalties import PenaltyPool, apply_bias_and_penalties
from pipeline.sampling_params import SamplingParams
from pipeline.engine.small_copies import device_tensor, steady_tensor


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    banned: tuple[int, ...] = ()  # token ids masked this step (min_tokens not reached, bad_words)
    pool_row: int | None = None   # the request's row in the PenaltyPool, if penalised
    matcher: Any = None           # the request's grammar matcher (engine/grammar.py), if any


def _plain(row: SamplingRow) -> bool:
    return (row.params.temperature == 0 and not row.banned and not row.params.logit_bias and row.pool_row is None
            and row.matcher is None and not row.params.allowed_token_ids)


def sample(logits: torch.Tensor, rows: list[SamplingRow], pool: PenaltyPool | None = None,
           masks: GrammarMasks | None = None) -> list[int]:
    """logits [n, vocab] (any float dtype, left as they are) -> one token id
    per row. `masks`: the step's grammar masks (Grammars.fill), needed
    wherever a row has a matcher."""
    return sample_on_device(logits, rows, pool, masks).tolist() if rows else []


@torch.inference_mode()
def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow], pool: PenaltyPool | None = None,
                     masks: GrammarMasks | None = None) -> torch.Tensor:
    """As sample(), but the token ids [n] stay on the logits' device: nothing
    here waits for the device, so the step can queue more work behind it."""
    if all(_plain(row) for row in rows):
        # All greedy (the common serving case): the argmax of the logits as
        # they are, no float copy; converting to float never changes the order.
        return logits.argmax(-1)
    # A copy even when already float32: the caller reads the raw logits after (logprobs).
    logits = logits.to(torch.float32, copy=True)
    _allow_only(logits, rows)
    _ban(logits, rows)
    apply_bias_and_penalties(logits, [row.params for row in rows], [row.pool_row for row in rows], pool)
    if any(row.matcher is not None for row in rows):
        if masks is None:
            raise ValueError("rows with a grammar matcher need the step's masks (Grammars.fill)")
        masks.apply(logits)
    drawn = [i for i, row in enumerate(rows) if row.params.temperature > 0]
    if len(drawn) == len(rows):
        return draw(logits, [row.params for row in rows], [row.generator for row in rows])
    tokens = logits.argmax(-1)
    if drawn:
        index = device_tensor(drawn, torch.long, logits.device)
        chosen = draw(logits.index_select(0, index), [rows[i].params for i in drawn],
                      [rows[i].generator for i in drawn])
        tokens.index_copy_(0, index, chosen)
    return tokens


def _allow_only(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """allowed_token_ids: a restricted row keeps those tokens' logits and
    loses every other (three batched kernels: gather, fill, scatter back)."""
    restricted = tuple(i for i, row in enumerate(rows) if row.params.allowed_token_ids)
    if not restricted:
        return
    vocab = logits.shape[1]
    # Ids past the logits' width (a tokenizer larger than the model) are never allowed.
    at = tuple(i * vocab + t for i in restricted for t in rows[i].params.allowed_token_ids if t < vocab)
    flat = steady_tensor("allowed_at", at, torch.long, logits.device)
    kept = logits.view(-1).index_select(0, flat)
    logits.index_fill_(0, steady_tensor("allowed_rows", restricted, torch.long, logits.device), float("-inf"))
    logits.view(-1).index_copy_(0, flat, kept)


def _ban(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    pairs = [(i, token) for i, row in enumerate(rows) for token in row.banned]
    if pairs:
        index = tuple(device_tensor(list(zip(*pairs)), torch.long, logits.device))
        logits.index_put_(index, logits.new_full((len(pairs),), float("-inf")))


def bad_word_bans(words: tuple[tuple[int, ...], ...], output: list[int]) -> set[int]:
    """vLLM's bad_words: for each word's tokens, the last is banned where the
    output ends with the ones before it (a one-token word's, always)."""
    def ends_with_start(word: tuple[int, ...]) -> bool:
        start = list(word[:-1])
        return len(output) >= len(start) and output[len(output) - len(start):] == start
    return {word[-1] for word in words if ends_with_start(word)}


def make_generator(params: SamplingParams, drawn: int = 0) -> torch.Generator | None:
    """A private CPU generator for seeded sampling, else None (global RNG).
    `drawn`: the tokens the request already sampled (it moved here after
    them): each took one number (draw.uniforms), so the generator skips as
    many and the next token is the one the lost generator would have drawn."""
    if params.temperature == 0 or params.seed is None:
        return None
    generator = torch.Generator().manual_seed(params.seed)
    if drawn:
        torch.rand(drawn, generator=generator)   # the same numbers as `drawn` draws of one (tested)
    return generator
