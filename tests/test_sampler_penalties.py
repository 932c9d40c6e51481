"""The penalties' torch path (engine/penalties.py: the CPU path and the
reference of the Triton kernel) against the gather-and-scatter code it
replaced, exactly: several rows of one batch, their pool rows out of order,
a row without penalties, logit_bias beside them; and the pool's record."""

from __future__ import annotations

import torch

from pipeline.engine.penalties import PenaltyPool, apply_bias_and_penalties
from pipeline.sampling_params import SamplingParams

VOCAB = 300


def previous(logits, params, pool_rows, pool) -> None:
    """The code before the kernel, verbatim in its maths."""
    for i, p in enumerate(params):
        for token, bias in p.logit_bias:
            logits[i, token] += bias
    penalised = [i for i, row in enumerate(pool_rows) if row is not None]
    batch = torch.tensor(penalised)
    slots = torch.tensor([pool_rows[i] for i in penalised])
    counts, seen = pool.counts[slots], pool.seen[slots]
    column = lambda values: torch.tensor(values, dtype=logits.dtype).unsqueeze(1)  # noqa: E731
    repetition = column([params[i].repetition_penalty for i in penalised])
    frequency = column([params[i].frequency_penalty for i in penalised])
    presence = column([params[i].presence_penalty for i in penalised])
    scores = logits[batch]
    repeated = torch.where(scores > 0, scores / repetition, scores * repetition)
    scores = torch.where(seen, repeated, scores)
    scores = scores - frequency * counts - presence * (counts > 0).to(scores.dtype)
    logits[batch] = scores


def penalised_batch():
    gen = torch.Generator().manual_seed(0)
    pool = PenaltyPool(VOCAB, 2, torch.device("cpu"))   # grows to 4 on the third take
    settings = [SamplingParams(max_tokens=4, repetition_penalty=1.3, logit_bias=((3, 2.5),)),
                SamplingParams(max_tokens=4, logit_bias=((7, -1.0), (8, 4.0))),
                SamplingParams(max_tokens=4, frequency_penalty=0.7, presence_penalty=-0.3),
                SamplingParams(max_tokens=4, repetition_penalty=0.8, frequency_penalty=-1.2, presence_penalty=1.1)]
    taken = [pool.take(torch.randint(0, VOCAB, (20,), generator=gen).tolist()) for _ in range(3)]
    pool.give_back(taken[0])
    rows = [taken[2], None, pool.take([1, 2, 3]), taken[1]]
    for _ in range(30):
        live = [r for r in rows if r is not None]
        pool.record(live, torch.randint(0, VOCAB, (len(live),), generator=gen).tolist())
    return torch.randn(4, VOCAB, generator=gen) * 3, settings, rows, pool


def test_the_torch_path_equals_the_code_it_replaced():
    logits, settings, rows, pool = penalised_batch()
    ours, theirs = logits.clone(), logits.clone()
    apply_bias_and_penalties(ours, settings, rows, pool)
    previous(theirs, settings, rows, pool)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, logits)
    assert torch.equal(ours[1, :7], logits[1, :7])   # the unpenalised row only got its bias


def test_record_counts_every_token():
    pool = PenaltyPool(VOCAB, 2, torch.device("cpu"))
    a, b = pool.take([5]), pool.take([])
    pool.record([a, b, a], [9, 9, 9])   # one row twice in one call: both count
    pool.record([b], [11])
    assert pool.counts[a, 9] == 2 and pool.counts[b, 9] == 1 and pool.counts[b, 11] == 1
    assert pool.seen[a].nonzero().flatten().tolist() == [5, 9]
    assert pool.seen[b].nonzero().flatten().tolist() == [9, 11]
    pool.record([b], torch.tensor([11]))   # tokens still on the device: the same counting
    assert pool.counts[b, 11] == 2


def test_steady_tensors_are_copied_once_while_their_values_repeat():
    from pipeline.engine.small_copies import steady_tensor

    first = steady_tensor("test-rows", (1, 2, 3), torch.long, torch.device("cpu"))
    assert steady_tensor("test-rows", (1, 2, 3), torch.long, torch.device("cpu")) is first
    other = steady_tensor("test-rows", (1, 2, 4), torch.long, torch.device("cpu"))
    assert other is not first and other.tolist() == [1, 2, 4]
    assert steady_tensor("test-rows", (1, 2, 4), torch.float32, torch.device("cpu")).dtype == torch.float32
