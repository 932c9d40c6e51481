"""Qwen3-VL on the engine's fast paths (fused decode and mixed-step forwards
over static buffers, the Triton kernels under the interpreter): the
DeepStack levels of a chunk's image rows go through the mixed step's static
side buffer, and are cleared before the next step. Tokens equal offline
generation of each request alone."""

from __future__ import annotations

import test_kernels  # noqa: F401  (sets TRITON_INTERPRET=1 before triton loads)

import torch

from pipeline.engine.engine import Engine, EngineConfig
from test_engine import run_engine
from test_qwen3_vl_engine import make_request, offline, qwen3  # noqa: F401  (the fixture)


def test_engine_with_fast_decode_and_mixed_steps_equals_offline(qwen3):  # noqa: F811
    _, model, tokenizer = qwen3
    requests = {f"r{i}": make_request(20 + i, (i + 1) % 3) for i in range(4)}
    expected = {rid: offline(model, p, inp, 6) for rid, (p, _, inp) in requests.items()}
    config = EngineConfig(max_num_batched_tokens=32, max_num_seqs=4, block_size=8, kv_cache_bytes=4 << 20,
                          fast_decode=True, fast_mixed=True)
    engine = Engine(model, tokenizer, config, torch.device("cpu"))
    assert engine.runner.mixed is not None and engine.runner.mixed.side is not None
    outputs, _ = run_engine(engine, model, requests, {0: ["r0", "r1"], 2: ["r2", "r3"]}, {}, max_tokens=6)
    assert outputs == expected
    assert engine.scheduler.block_pool.num_used == 0
    # Only the last mixed step's image rows hold side levels: every earlier
    # step's were cleared before the next.
    mixed = engine.runner.mixed
    written = torch.zeros(mixed.side.shape[0], dtype=torch.bool)
    for row, count in mixed.side_rows:
        written[row:row + count] = True
    assert mixed.side[~written].abs().sum() == 0
