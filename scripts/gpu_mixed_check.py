"""The fast mixed-step path on the GPU, for scripts/gpu_engine_check.py:
the unified attention kernel at 3B sizes, one bf16 mixed step of the
3B-shaped model through MixedGraphs (captured) against the reference
backend, and mixed-step timings with and without the captured path."""

from __future__ import annotations

import time

import numpy as np
import torch

from pipeline.engine.engine import Engine
from pipeline.engine.mixed_graphs import MixedGraphs
from pipeline.engine.paged_attention import PagedKVCache, ReferencePagedAttention, SequenceSlice, StepLayout
from pipeline.sampling_params import SamplingParams
from pipeline.processing.processor import MultimodalPrompt

# (query_len, context_len): decodes, chunks from zero and after a context.
SPECS = ((1, 17), (1, 300), (1, 700), (300, 0), (700, 300), (5, 17), (1, 0))


def unified_equality(device: torch.device, compare) -> dict:
    """The unified kernel against per-sequence SDPA, bf16, 3B heads, a
    2048-token chunk after a context beside decodes, shuffled blocks, padding."""
    from pipeline.kernels import unified_attention as m

    gen = torch.Generator(device=device).manual_seed(2)
    specs = [(1, 1), (1, 17), (1, 1023), (2048, 300), (17, 0), (300, 4000)]
    blocks = [-(-(q + c) // 16) for q, c in specs]
    order = torch.randperm(sum(blocks) + 1, generator=gen, device=device)
    stride = max(blocks)
    tables = torch.full((len(specs), stride), sum(blocks) + 1, device=device)
    for row, used, first in zip(tables, blocks, np.cumsum([0] + blocks)):
        row[:used] = order[first:first + used]
    query = np.array([q for q, _ in specs] + [37])
    cu, context = [0] + np.cumsum(query).tolist(), [c for _, c in specs] + [-1]
    caches = [torch.randn((sum(blocks) + 2) * 16, 2, 128, generator=gen, device=device, dtype=torch.bfloat16)
              for _ in range(2)]
    q = torch.randn(cu[-1], 16, 128, generator=gen, device=device, dtype=torch.bfloat16)
    programs = np.zeros((m.max_programs(cu[-1], len(specs) + 8, m.block_q(16, 2)), 2), dtype=np.int64)
    m.plan_programs(query, m.block_q(16, 2), programs)
    as_device = lambda x: torch.tensor(x, device=device)  # noqa: E731
    got = m.unified_attention(q, *caches, tables.view(-1), as_device([stride]), as_device(cu), as_device(context),
                              torch.from_numpy(programs).to(device), 16)
    want = m.unified_attention_reference(q, *caches, tables.view(-1), stride, cu, context, 16)
    return {"unified_attention": compare(got, want)}


def _mixed_step(model, device: torch.device, fast: bool, bs: int = 16, num_blocks: int = 200):
    """Contexts prefilled alone through the reference backend into scattered
    blocks; then one mixed step of SPECS (an image-like embedding spliced
    into the fresh chunk) through MixedGraphs or the reference. Returns
    (sampled rows' logits in float32, cache)."""
    lang = model.spec.language
    cache = PagedKVCache(lang.num_layers, num_blocks + 1, bs, lang.kv_heads, lang.head_dim,
                         next(model.parameters()).dtype, device)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    rng = np.random.default_rng(0)
    slices, offset = [], 0
    with torch.inference_mode():
        for q, c in SPECS:
            table = tuple(order[:-(-(q + c) // bs)])
            order = order[len(table):]
            if c:
                ids = torch.tensor(rng.integers(0, lang.vocab_size, c), device=device)
                layout = StepLayout.build([SequenceSlice(0, c, 0, table)], bs, device)
                model(model.embed(ids), model.decode_positions(0, c, 0).to(device),
                      ReferencePagedAttention(cache, layout))
            slices.append(SequenceSlice(offset, q, c, table))
            offset += q
        ids = [int(x) for x in rng.integers(0, lang.vocab_size, offset)]
        positions = torch.cat([model.decode_positions(c, q, 0) for q, c in SPECS], dim=1)
        image = torch.randn(64, lang.hidden_size, generator=torch.Generator().manual_seed(3)).to(device) * 0.05
        image = image.to(next(model.parameters()).dtype)
        at = slices[3].offset + (slices[3].query_len - 64) // 2   # inside the fresh chunk
        rows = [s.offset + s.query_len - 1 for s in slices]
        if fast:
            graphs = MixedGraphs(model, cache, num_blocks, 2048, 16, 4096, device, use_graphs=True)
            first = graphs.run(ids, positions, slices, [(at, image)], rows).float()
            again = graphs.run(ids, positions, slices, [(at, image)], rows).float()   # a replay, same inputs
            return first, cache, (again - first).abs().max().item()
        embeds = model.embed(torch.tensor(ids, device=device))
        embeds[at:at + 64] = image
        layout = StepLayout.build(slices, bs, device)
        hidden = model(embeds, positions.to(device), ReferencePagedAttention(cache, layout))
        return model.logits(hidden[rows]).float(), cache, 0.0


def fused_mixed_equality(model: torch.nn.Module, exact: torch.nn.Module, device: torch.device) -> dict:
    """One mixed step of a bf16 model (fuse()d) through the reference backend
    and through MixedGraphs, each against the same step of `exact` (its
    float32 copy): the fused one's logits and K/V writes must be about as
    close to float32 as the reference's, and a second replay give the same."""
    truth, exact_cache, _ = _mixed_step(exact, device, False)
    want, want_cache, _ = _mixed_step(model, device, False)
    got, cache, replay_diff = _mixed_step(model, device, True)
    scale = truth.abs().max().item()

    def against_truth(logits, kv):
        # The null block (last) holds padding rows' K/V in the fused run only.
        kv_diff = max((kv.keys[:, :-1].float() - exact_cache.keys[:, :-1]).abs().max().item(),
                      (kv.values[:, :-1].float() - exact_cache.values[:, :-1]).abs().max().item())
        return {"max_abs_diff": (logits - truth).abs().max().item(), "kv_max_abs_diff": kv_diff,
                "top1_agree": (logits.argmax(-1) == truth.argmax(-1)).float().mean().item()}

    out = {"ref_max_abs": scale, "kv_max_abs": exact_cache.keys.abs().max().item(),
           "reference": against_truth(want, want_cache),
           "fused": dict(against_truth(got, cache), max_abs_diff_vs_bf16_reference=(got - want).abs().max().item()),
           "replay_max_abs_diff": replay_diff}
    ref, fused = out["reference"], out["fused"]
    out["ok"] = (fused["max_abs_diff"] <= 1.5 * ref["max_abs_diff"] + 0.01 * scale
                 and fused["kv_max_abs_diff"] <= 1.5 * ref["kv_max_abs_diff"] + 0.01 * out["kv_max_abs"]
                 and replay_diff == 0.0)
    return out


def mixed_step_ms(engine: Engine, prompt_len: int, repeats: int) -> float:
    """Median time of a step that prefills a new prompt's first chunk while
    the running requests decode (a new prompt joins before each timed step)."""
    times = []
    for i in range(repeats // 4):
        ids = [int(x) for x in np.random.default_rng(1000 + i).integers(0, 150000, prompt_len)]
        engine.add_request(f"mixed{i}", MultimodalPrompt(ids, [], []), [], SamplingParams(max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1000)
        engine.abort(f"mixed{i}")
    return float(np.median(times))


def mixed_step_timings(engine: Engine, prompt_len: int, repeats: int, batch: int) -> dict:
    """batchN_mixed_step_ms through the engine as configured; where that is
    the captured path, also the eager batched path it replaced
    (batchN_mixed_step_eager_ms), for before/after in one run."""
    out = {f"batch{batch}_mixed_step_ms": mixed_step_ms(engine, prompt_len, repeats)}
    mixed = engine.runner.mixed
    if mixed is not None:
        out[f"batch{batch}_mixed_graphs"] = len(mixed.graphs)
        engine.runner.mixed = None   # the runner falls back to MixedStepAttention
        try:
            out[f"batch{batch}_mixed_step_eager_ms"] = mixed_step_ms(engine, prompt_len, repeats)
        finally:
            engine.runner.mixed = mixed
    return out
