"""Decode projections on the small-M Triton matmul (EngineConfig.decode_matmul
"triton"), on the CPU under Triton's interpreter: TritonLayerOps.linear
against F.linear, and the engine with it against offline generation.

Skipped where triton is not installed (CI), as tests/test_kernels.py is,
whose interpreter set-up this module shares by importing it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the fused decode kernels are CUDA-only extras", allow_module_level=True)
from test_kernels import close  # noqa: E402  (sets TRITON_INTERPRET=1 before triton loads)

from pipeline.engine.engine import Engine, EngineConfig  # noqa: E402


@pytest.fixture
def gemv_calls(monkeypatch):
    """Counts the gemv launches, as (kernel, x's shape): TritonLayerOps' plain
    and gated ones (the MLP's gate_up with its SiLU epilogue) and the decode
    backend's q/k/v projection with rotary in its epilogue; the real kernels
    still run."""
    from pipeline.kernels import gemv_rotary, ops

    calls = []

    def counting(kernel):
        def counted(x, weight, *rest):
            calls.append((kernel.__name__, tuple(x.shape)))
            return kernel(x, weight, *rest)
        return counted

    monkeypatch.setattr(ops, "gemv", counting(ops.gemv))
    monkeypatch.setattr(ops, "gemv_silu_mul", counting(ops.gemv_silu_mul))
    monkeypatch.setattr(gemv_rotary, "gemv_rotary_kv", counting(gemv_rotary.gemv_rotary_kv))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2])
def test_linear_small_m_equals_f_linear(gemv_calls, dtype, with_bias, rows):
    from pipeline.kernels.ops import TritonLayerOps

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 320, generator=gen).to(dtype)
    weight = (0.1 * torch.randn(72, 320, generator=gen)).to(dtype)
    bias = torch.randn(72, generator=gen).to(dtype) if with_bias else None
    got = TritonLayerOps(use_gemv=True).linear(x, weight, bias)
    assert got.shape == (rows, 72) and got.dtype == dtype
    close(got, F.linear(x, weight, bias))
    assert gemv_calls == [("gemv", (rows, 320))]


def test_gemv_routing_follows_the_h200_measurements():
    from pipeline.kernels.gemv import beats_cublas

    # 3B decode shapes: qkv/o_proj/down are narrow, gate_up and lm_head wide.
    assert [m for m in range(1, 33) if beats_cublas(m, 2560)] == [1, 2]
    assert [m for m in range(1, 33) if beats_cublas(m, 22016)] == list(range(1, 9))
    assert not beats_cublas(0, 2048)


def test_linear_stays_on_f_linear_past_the_threshold_or_when_off(gemv_calls):
    from pipeline.kernels.ops import TritonLayerOps

    gen = torch.Generator().manual_seed(9)
    weight, bias = torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen)
    many, few = torch.randn(3, 64, generator=gen), torch.randn(2, 64, generator=gen)
    assert torch.equal(TritonLayerOps(True).linear(many, weight, bias), F.linear(many, weight, bias))
    assert torch.equal(TritonLayerOps(False).linear(few, weight, bias), F.linear(few, weight, bias))
    assert torch.equal(TritonLayerOps().linear(few, weight), F.linear(few, weight))
    assert gemv_calls == []


def test_decode_matmul_is_validated(tiny_dir):
    from pipeline.models.loader import load_model
    from pipeline.processing.processor import Processor

    with pytest.raises(ValueError, match="decode_matmul='cutlass'"):
        EngineConfig(decode_matmul="cutlass")
    loaded = load_model(tiny_dir)
    tokenizer = Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id).tokenizer
    with pytest.raises(ValueError, match="needs fast decode"):
        Engine(loaded.model, tokenizer, EngineConfig(fast_decode=False, decode_matmul="triton"), torch.device("cpu"))


def test_engine_with_gemv_projections_equals_offline(tiny_dir, gemv_calls):
    """The tiny checkpoint through the engine, every pure-decode step on the
    fused path with its projections on gemv where it beats cuBLAS (1-2 rows):
    tokens equal to offline generation of each request alone. Mixed steps
    stay eager, so only decode steps reach gemv."""
    from test_engine import make_request, offline, run_engine

    from pipeline.models.loader import load_model
    from pipeline.processing.processor import Processor

    loaded = load_model(tiny_dir)
    model, processor = loaded.model, Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id)
    requests = {f"r{i}": make_request(processor, i, i % 3) for i in range(4)}
    expected = {rid: offline(model, p, inp, 6) for rid, (p, _, inp) in requests.items()}
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, block_size=8, kv_cache_bytes=4 << 20,
                          fast_decode=True, fast_mixed=False, decode_matmul="triton")
    engine = Engine(model, processor.tokenizer, config, torch.device("cpu"))
    assert engine.runner.decode.fused and engine.runner.mixed is None
    outputs, _ = run_engine(engine, model, requests, {0: ["r0", "r1"], 2: ["r2", "r3"]}, {}, max_tokens=6)
    assert outputs == expected
    assert engine.scheduler.block_pool.num_used == 0
    # Four projections per layer per decode step of 1-2 rows (the tiny
    # model's outputs are all narrow: the 4-row bucket stays on F.linear):
    # q/k/v with the rotary, o_proj, gate_up with the SiLU, down.
    layers = model.cfg.text.num_hidden_layers
    kinds = [kind for kind, _ in gemv_calls]
    steps = kinds.count("gemv_rotary_kv") // layers
    assert steps and len(gemv_calls) == 4 * layers * steps
    assert kinds.count("gemv_silu_mul") == kinds.count("gemv_rotary_kv") == kinds.count("gemv") / 2
    assert {shape[0] for _, shape in gemv_calls} <= {1, 2}


def test_default_decode_matmul_is_cublas_off_cuda(tiny_dir):
    """decode_matmul=None picks gemv only where the fused kernels run on
    CUDA: on the CPU, even with the interpreter on, projections stay on
    F.linear and the fused path stays off unless asked for."""
    from pipeline.models.loader import load_model
    from pipeline.processing.processor import Processor

    loaded = load_model(tiny_dir)
    tokenizer = Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id).tokenizer
    engine = Engine(loaded.model, tokenizer, EngineConfig(fast_decode=True, fast_mixed=False,
                                                          kv_cache_bytes=4 << 20), torch.device("cpu"))
    assert engine.runner.decode.matmul == "cublas" and not engine.runner.decode.fused
