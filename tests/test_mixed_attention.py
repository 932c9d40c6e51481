"""The batched mixed-step attention gives what the per-sequence reference gives."""

from __future__ import annotations

import torch

from pipeline.engine.mixed_attention import MixedStepAttention
from pipeline.engine.paged_attention import PagedKVCache, ReferencePagedAttention, SequenceSlice, StepLayout


def _layout(block_size: int) -> StepLayout:
    # (query_len, context_len, block table): decodes of different lengths,
    # a prefill from zero, a chunk after a cached context, tables out of order.
    specs = [(1, 40, (7, 2, 9)), (5, 0, (3,)), (1, 3, (11,)), (6, 17, (4, 12)), (1, 1, (0,))]
    sequences, offset = [], 0
    for query_len, context_len, table in specs:
        sequences.append(SequenceSlice(offset, query_len, context_len, table))
        offset += query_len
    return StepLayout.build(sequences, block_size, torch.device("cpu"))


def test_mixed_step_attention_matches_the_reference():
    torch.manual_seed(0)
    block_size, heads, kv_heads, dim = 16, 8, 2, 32
    layout = _layout(block_size)
    tokens = sum(s.query_len for s in layout.sequences)
    outputs = []
    for backend_class in (ReferencePagedAttention, MixedStepAttention):
        torch.manual_seed(1)
        cache = PagedKVCache(2, 14, block_size, kv_heads, dim, torch.float32, torch.device("cpu"))
        cache.keys.normal_()
        cache.values.normal_()
        backend = backend_class(cache, layout)
        q, k, v = torch.randn(tokens, heads, dim), torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
        outputs.append((backend.attend(1, q, k, v), cache.keys.clone(), cache.values.clone()))
    (ref, ref_k, ref_v), (got, got_k, got_v) = outputs
    assert torch.equal(ref_k, got_k) and torch.equal(ref_v, got_v)   # same cache writes
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(ref[0], ref[5])   # rows differ: the comparison means something


def test_mixed_step_token_buckets():
    """Powers of two up to 512 tokens, then steps of 512: a full chunk beside
    a few decodes pads by less than 512 rows."""
    from pipeline.engine.mixed_graphs import token_bucket

    assert [token_bucket(n, 16) for n in (1, 16, 17, 300, 512, 513, 2048, 2080, 8192)] == \
        [16, 16, 32, 512, 512, 1024, 2048, 2560, 8192]
