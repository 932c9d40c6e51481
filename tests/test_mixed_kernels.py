"""The fast mixed-step path on the CPU under Triton's interpreter: the unified
paged attention kernel against per-sequence SDPA, a whole mixed step of
MixedGraphs against the reference backend, and the engine with fast mixed
steps against offline generation.

Skipped where triton is not installed (CI), as tests/test_kernels.py is,
whose interpreter set-up this module shares by importing it.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the fused mixed-step kernels are CUDA-only extras", allow_module_level=True)
from test_kernels import close, small_model  # noqa: E402  (sets TRITON_INTERPRET=1 before triton loads)

# (query_len, context_len): decodes, chunks from zero and after a context;
# lengths 1, 17 and 300.
SPECS = [(1, 0), (1, 17), (1, 300), (17, 0), (17, 300), (300, 0), (5, 17), (300, 17)]


def unified_case(dtype, specs, padding, heads=16, kv_heads=2, dim=64, page=16, seed=0):
    """Random cache; each sequence's blocks shuffled through it; the table
    rows `stride` wide, padded with the null block; a padding sequence last."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-(q + c) // page) for q, c in specs]
    num_blocks = sum(blocks) + 2
    null = num_blocks - 1
    order = torch.randperm(num_blocks - 1, generator=gen).tolist()
    stride = max(blocks) + 1
    tables = torch.full((len(specs), stride), null)
    for row, used in zip(tables, blocks):
        row[:used] = torch.tensor(order[:used])
        order = order[used:]
    query = np.array([q for q, _ in specs] + [padding])
    cu = [0] + np.cumsum(query).tolist()
    context = [c for _, c in specs] + [-1]
    k_slots, v_slots = (torch.randn(num_blocks * page, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(cu[-1], heads, dim, generator=gen).to(dtype)
    return q, k_slots, v_slots, tables.view(-1), stride, query, cu, context, page


def launch_unified(case, heads=16, kv_heads=2, spare_seqs=0, per_program=None):
    """The kernel over `case` (from unified_case) with a grid planned for
    `spare_seqs` more sequences than it has (spare programs: no-ops), at
    `per_program` tokens a program (None: block_q's, as MixedGraphs plans)."""
    from pipeline.kernels import unified_attention as m

    q, k_slots, v_slots, tables, stride, query, cu, context, page = case
    planned = per_program or m.block_q(heads, kv_heads)
    programs = np.zeros((m.max_programs(cu[-1], len(query) + spare_seqs, planned), 2), dtype=np.int64)
    m.plan_programs(query, planned, programs)
    return m.unified_attention(q, k_slots, v_slots, tables, torch.tensor([stride]), torch.tensor(cu),
                               torch.tensor(context), torch.from_numpy(programs), page, per_program=per_program)


def reference(case, dtype=None):
    """unified_attention_reference over `case`, its tensors cast to `dtype`."""
    from pipeline.kernels.unified_attention import unified_attention_reference

    q, k_slots, v_slots, tables, stride, query, cu, context, page = case
    q, k_slots, v_slots = (t.to(dtype or t.dtype) for t in (q, k_slots, v_slots))
    return unified_attention_reference(q, k_slots, v_slots, tables, stride, cu, context, page)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unified_attention(dtype):
    """Mixed decodes and chunks, GQA 8:1, shuffled tables, padding tokens
    (zeros out) and spare programs (no-ops) in the grid."""
    case = unified_case(dtype, SPECS, padding=9)
    got = launch_unified(case, spare_seqs=3)
    close(got, reference(case))
    padding = case[6][-2]   # cu_seqlens: the padding sequence's first row
    assert torch.equal(got[padding:], torch.zeros_like(got[padding:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unified_attention_key_tiles(dtype):
    """head_dim 128 (the 3B model's) and contexts across several 64-key
    tiles: chunks longer than a program's 16 tokens after contexts longer
    than a tile, so programs run unmasked tiles, then diagonal ones (first
    query positions 126, 127 and 128: the keys visible to every row end one
    short of, at and one past a tile boundary); decodes either side of a
    boundary; a padding sequence. 16-bit inputs against the float32
    reference: only p's rounding for p @ v and the output's rounding differ
    (bf16: max error ~0.016)."""
    specs = [(150, 200), (1, 63), (1, 64), (40, 126), (17, 127), (40, 128), (1, 129), (33, 0), (70, 250)]
    case = unified_case(dtype, specs, padding=21, dim=128, seed=3)
    got = launch_unified(case, spare_seqs=2)
    want = reference(case, torch.float32)
    if dtype == torch.float32:
        close(got, want)
    else:
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2e-2)
    padding = case[6][-2]   # cu_seqlens: the padding sequence's first row
    assert torch.isfinite(got).all() and not got[padding:].any()


def test_unified_attention_other_tilings():
    """Plans of 8 and 32 tokens a program (64 and 256 rows) with 32-key
    tiles give the same; a plan the kernel cannot tile is refused."""
    case = unified_case(torch.float32, SPECS, padding=9)
    for per_program in (8, 32):
        close(launch_unified(case, per_program=per_program), reference(case))
    with pytest.raises(ValueError, match="power of two"):
        launch_unified(case, per_program=12)


def test_unified_attention_odd_group_and_small_head():
    """A group of 3 q heads per kv head and head dim 16: padded tiles masked."""
    case = unified_case(torch.float32, [(1, 40), (20, 0), (7, 9)], padding=0, heads=6, kv_heads=2, dim=16, page=8)
    close(launch_unified(case, heads=6, kv_heads=2), reference(case))


def test_plan_programs_covers_every_token_once():
    from pipeline.kernels import unified_attention as m

    query = np.array([1, 8, 9, 300, 1, 0, 37])
    programs = np.zeros((m.max_programs(int(query.sum()), 6, 8), 2), dtype=np.int64)
    m.plan_programs(query, 8, programs)
    covered = [(s, t) for s, first in programs.tolist() for t in range(first, min(first + 8, query[s]))]
    assert sorted(covered) == [(s, t) for s, n in enumerate(query) for t in range(n)]


def mixed_step(model, fast: bool, cache_init, dtype=torch.float32):
    """One step over three decodes, a chunk after a context, a prefill from
    zero (with an image embedding spliced in) and a one-token prefill, through
    MixedGraphs (fast) or the reference backend. Returns (sampled rows'
    logits, cache)."""
    from pipeline.engine.mixed_graphs import MixedGraphs
    from pipeline.engine.paged_attention import PagedKVCache, ReferencePagedAttention, SequenceSlice, StepLayout

    text = model.cfg.text
    cache = PagedKVCache(text.num_hidden_layers, 24, 16, text.num_key_value_heads, text.head_dim, dtype,
                         torch.device("cpu"))
    cache.keys.copy_(cache_init[0])
    cache.values.copy_(cache_init[1])
    specs = [(1, 0, [5]), (1, 17, [11, 2]), (1, 130, [3, 18, 0, 9, 14, 7, 1, 12, 16]), (17, 20, [4, 21, 6]),
             (30, 0, [19, 8]), (1, 0, [13])]
    slices, offset = [], 0
    for query_len, context_len, table in specs:
        slices.append(SequenceSlice(offset, query_len, context_len, tuple(table)))
        offset += query_len
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, text.vocab_size, (offset,), generator=gen).tolist()
    positions = torch.cat([model.decode_positions(c, q, 3 * i) for i, (q, c, _) in enumerate(specs)], dim=1)
    image = torch.randn(6, text.hidden_size, generator=gen).to(dtype)
    rows = [s.offset + s.query_len - 1 for s in slices if s.query_len != 17]   # the chunk is not due a sample
    with torch.inference_mode():
        if fast:
            graphs = MixedGraphs(model, cache, 23, max_tokens=96, max_seqs=8, max_len=400,
                                 device=torch.device("cpu"), use_graphs=False)
            return graphs.run(ids, positions, slices, [(25, image)], rows), cache
        embeds = model.embed(torch.tensor(ids))
        embeds[25:31] = image
        layout = StepLayout.build(slices, 16, torch.device("cpu"))
        hidden = model(embeds, positions, ReferencePagedAttention(cache, layout))
        return model.logits(hidden[rows]), cache


def test_mixed_step_equals_the_reference_backend():
    """float32: the same logits, the same sampled tokens and the same K/V
    written (padding tokens write only the null block, block 23)."""
    model = small_model(torch.float32)
    model.fuse()
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(2, 24, 16, 1, 32, generator=gen) for _ in range(2)]
    fast_logits, fast_cache = mixed_step(model, True, init)
    ref_logits, ref_cache = mixed_step(model, False, init)
    tolerance = dict(atol=1e-4, rtol=1e-4)
    assert fast_logits.shape == ref_logits.shape == (5, 300)
    torch.testing.assert_close(fast_logits, ref_logits, **tolerance)
    assert torch.equal(fast_logits.argmax(-1), ref_logits.argmax(-1))
    torch.testing.assert_close(fast_cache.keys[:, :23], ref_cache.keys[:, :23], **tolerance)
    torch.testing.assert_close(fast_cache.values[:, :23], ref_cache.values[:, :23], **tolerance)
    assert not torch.equal(fast_cache.keys[:, :23], init[0][:, :23])   # the step wrote something


def test_engine_with_fast_mixed_steps_equals_offline(tiny_dir):
    """The tiny checkpoint through the engine with every mixed step on the
    fused path (images spliced, chunks beside decodes): tokens equal to
    offline generation of each request alone."""
    from test_engine import make_request, offline, run_engine

    from pipeline.engine.engine import Engine, EngineConfig
    from pipeline.models.loader import load_model
    from pipeline.processing.processor import Processor

    loaded = load_model(tiny_dir)
    model, processor = loaded.model, Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id)
    requests = {f"r{i}": make_request(processor, i, i % 3) for i in range(4)}
    expected = {rid: offline(model, p, inp, 6) for rid, (p, _, inp) in requests.items()}
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, block_size=8, kv_cache_bytes=4 << 20,
                          fast_decode=True, fast_mixed=True)
    engine = Engine(model, processor.tokenizer, config, torch.device("cpu"))
    assert engine.runner.mixed is not None
    outputs, _ = run_engine(engine, model, requests, {0: ["r0", "r1"], 2: ["r2", "r3"]}, {}, max_tokens=6)
    assert outputs == expected
    assert engine.scheduler.block_pool.num_used == 0
