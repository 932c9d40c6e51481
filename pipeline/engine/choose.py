"""After a step's forward: each row's next token and, for the rows that ask
for them, its logprobs, with one wait on the device.

The sampler (sample_on_device) and the logprobs (logprob_table) are queued
one behind the other, and a single copy brings the tokens and the logprob
table to the host: before, the tokens came back first and the logprobs'
top-k ran only after, a second wait with the device idle in between. Then,
on the host, the grammar matchers consume their tokens in one parallel call
and the penalties' counts take the new tokens (queued on the device, from
the tokens still there). At batch 32 the step waits on the host, not the
device, so every host microsecond here is a microsecond of the step: the
small index and settings tensors that repeat step after step are copied
once (small_copies.steady_tensor).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.engine.grammar import GrammarMasks, Grammars
from pipeline.engine.logprobs import TokenLogprobs, logprob_table, read_table
from pipeline.engine.penalties import PenaltyPool
from pipeline.engine.sampler import SamplingRow, sample_on_device
from pipeline.engine.small_copies import steady_tensor


@dataclass
class Chosen:
    tokens: list[int]
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)   # by row index, for the rows that asked


@torch.inference_mode()
def choose(logits: torch.Tensor, rows: list[SamplingRow], pool: PenaltyPool, masks: GrammarMasks | None,
           grammars: Grammars | None) -> Chosen:
    """logits [n, vocab] of the step's due rows, raw (the sampler works on a
    copy where it changes them, so the logprobs see the model's own)."""
    if not rows:
        return Chosen([])
    tokens = sample_on_device(logits, rows, pool, masks)
    asking = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if asking:
        top = [rows[i].params.logprobs for i in asking]
        k = max(top)
        picked = tokens if len(asking) == len(rows) else tokens.index_select(
            0, steady_tensor("asking", tuple(asking), torch.long, logits.device))
        table = logprob_table(logits, asking, picked, k)
        # float64 holds every token id exactly: the tokens ride in the table's copy.
        flat = torch.cat((tokens.double(), table.flatten())).tolist()   # the step's one wait
        width = 1 + 2 * k
        chosen = Chosen([int(t) for t in flat[:len(rows)]])
        start = len(rows)
        table_rows = [flat[start + j * width:start + (j + 1) * width] for j in range(len(asking))]
        chosen.logprobs = dict(zip(asking, read_table(table_rows, top, k)))
    else:
        chosen = Chosen(tokens.tolist())
    if grammars is not None:
        grammars.consume([(row.matcher, token) for row, token in zip(rows, chosen.tokens) if row.matcher is not None])
    penalised = [i for i, row in enumerate(rows) if row.pool_row is not None]
    if penalised:   # from the tokens still on the device: no copy back
        index = steady_tensor("penalised_batch", tuple(penalised), torch.long, logits.device)
        pool.record([rows[i].pool_row for i in penalised], tokens.index_select(0, index))
    return chosen
