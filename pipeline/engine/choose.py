"""After a step's forward: each row's next token and, for the rows that ask
for them, its logprobs, with one wait on the device.

The sampler (sample_on_device) and the logprobs (logprob_table) are queued
one behind the other (queue_choice), and a single queued copy brings the
tokens and the logprob table to the host, which read() waits for: before,
the tokens came back first and the logprobs' top-k ran only after, a second
wait with the device idle in between. Then,
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


@dataclass
class Drawn:
    """A step's choice queued on the device: the tokens (still there, for a
    next step to read as its inputs) and the copy of tokens and logprobs to
    the host, which read() waits for."""

    rows: list[SamplingRow]
    tokens: torch.Tensor                 # [n] token ids on the logits' device
    asking: list[int]                    # the rows that asked for logprobs
    k: int                               # the widest top-k among them
    host: torch.Tensor                   # tokens, then the logprob table; pinned on CUDA
    ready: torch.cuda.Event | None       # recorded after the copy into `host` (CUDA)


@torch.inference_mode()
def choose(logits: torch.Tensor, rows: list[SamplingRow], pool: PenaltyPool, masks: GrammarMasks | None,
           grammars: Grammars | None) -> Chosen:
    """logits [n, vocab] of the step's due rows, raw (the sampler works on a
    copy where it changes them, so the logprobs see the model's own)."""
    if not rows:
        return Chosen([])
    return read(queue_choice(logits, rows, pool, masks), grammars)


@torch.inference_mode()
def queue_choice(logits: torch.Tensor, rows: list[SamplingRow], pool: PenaltyPool,
                 masks: GrammarMasks | None) -> Drawn:
    """Everything of choose() that runs on the device, queued: nothing here waits."""
    tokens = sample_on_device(logits, rows, pool, masks)
    asking = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    k = max((rows[i].params.logprobs for i in asking), default=0)
    flat = tokens
    if asking:
        picked = tokens if len(asking) == len(rows) else tokens.index_select(
            0, steady_tensor("asking", tuple(asking), torch.long, logits.device))
        table = logprob_table(logits, asking, picked, k)
        # float64 holds every token id exactly: the tokens ride in the table's copy.
        flat = torch.cat((tokens.double(), table.flatten()))
    penalised = [i for i, row in enumerate(rows) if row.pool_row is not None]
    if penalised:   # from the tokens on the device: no copy back
        index = steady_tensor("penalised_batch", tuple(penalised), torch.long, logits.device)
        pool.record([rows[i].pool_row for i in penalised], tokens.index_select(0, index))
    if not flat.is_cuda:
        return Drawn(rows, tokens, asking, k, flat, None)
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return Drawn(rows, tokens, asking, k, host, ready)


def read(drawn: Drawn, grammars: Grammars | None) -> Chosen:
    """Wait for a queued choice (the step's one wait), then on the host: the
    tokens, the logprobs, and the grammar matchers' consume."""
    if drawn.ready is not None:
        drawn.ready.synchronize()
    rows, n = drawn.rows, len(drawn.rows)
    flat = drawn.host.tolist()
    chosen = Chosen([int(t) for t in flat[:n]])
    if drawn.asking:
        width = 1 + 2 * drawn.k
        table_rows = [flat[n + j * width:n + (j + 1) * width] for j in range(len(drawn.asking))]
        top = [rows[i].params.logprobs for i in drawn.asking]
        chosen.logprobs = dict(zip(drawn.asking, read_table(table_rows, top, drawn.k)))
    if grammars is not None:
        grammars.consume([(row.matcher, token) for row, token in zip(rows, chosen.tokens) if row.matcher is not None])
    return chosen
