"""batch_logprobs (engine/logprobs.py: a topk of the raw logits and one
logsumexp a row) against log_softmax of a float copy, the definition: a
subset of the batch, per-row top counts (0 included), float32 and bf16
logits."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.logprobs import batch_logprobs, logprob_table, read_table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_logprobs_equal_log_softmax(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 3000, generator=gen) * 3).to(dtype)
    rows, tokens, top = [3, 0, 4], [17, 2999, 5], [5, 0, 20]
    found = batch_logprobs(logits, rows, tokens, top)
    want = logits.float().log_softmax(-1)
    for (chosen, ids, values), row, token, k in zip(found, rows, tokens, top):
        assert chosen == pytest.approx(want[row, token].item(), abs=1e-5)
        assert len(ids) == len(values) == k
        assert list(values) == sorted(values, reverse=True) and len(set(ids)) == k
        assert list(values) == pytest.approx(want[row].topk(k).values.tolist(), abs=1e-5)
        # bf16 logits tie, so which of equal tokens comes first is free; their logprobs are not.
        assert list(values) == pytest.approx(want[row, list(ids)].tolist(), abs=1e-5)
        if dtype == torch.float32:
            assert list(ids) == want[row].topk(k).indices.tolist()


def test_every_row_and_none():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    found = batch_logprobs(logits, [0, 1], [4, 4], [3, 3])
    want = logits.log_softmax(-1)
    assert [list(f[1]) for f in found] == want.topk(3).indices.tolist()
    assert batch_logprobs(logits, [], [], []) == []


def test_the_table_takes_tokens_on_the_device_and_matches_the_lists():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 3000, generator=gen)
    rows, tokens, top = [2, 0], [7, 2999], [5, 2]
    table = logprob_table(logits, rows, torch.tensor(tokens), 5)
    assert table.shape == (2, 11) and table.dtype == torch.float64
    assert read_table(table.tolist(), top, 5) == batch_logprobs(logits, rows, tokens, top)
    want = logits.log_softmax(-1)
    assert table[1, 0].item() == pytest.approx(want[0, 2999].item(), abs=1e-5)
