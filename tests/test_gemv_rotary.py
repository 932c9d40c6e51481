"""The q/k/v projection with rotary and the K/V cache write in its epilogue
(pipeline/kernels/gemv_rotary.py), run on the CPU by Triton's interpreter:
bit for bit gemv then rotary_kv_write, for every multiply mode the default
config picks (1-3 rows) and for the weight read in one load (preload), K
whole and partial tiles, with and without bias; and the shapes it refuses.
The engine running it in every layer of a decode step is
tests/test_decode_matmul.py's business.

Skipped where triton is not installed (CI).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the fused decode kernels are CUDA-only extras", allow_module_level=True)
import test_kernels  # noqa: E402,F401  (sets TRITON_INTERPRET=1 before triton loads)

from pipeline.kernels.gemv import GemvConfig, default_config, gemv  # noqa: E402
from pipeline.kernels.gemv_rotary import fits, gemv_rotary_kv  # noqa: E402
from pipeline.kernels.rotary_kv import rotary_kv_write  # noqa: E402

HEADS, KV_HEADS, DIM, SLOTS = 4, 2, 32, 24


def operands(M: int, K: int, dtype: torch.dtype, with_bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows = (HEADS + 2 * KV_HEADS) * DIM
    x = torch.randn(M, K, generator=gen).to(dtype)
    weight = (torch.randn(rows, K, generator=gen) * K ** -0.5).to(dtype)
    bias = (0.1 * torch.randn(rows, generator=gen)).to(dtype) if with_bias else None
    angles = torch.randn(M, DIM // 2, generator=gen) * 3
    angles = torch.cat([angles, angles], -1)
    cache = torch.randn(2, SLOTS, KV_HEADS, DIM, generator=gen).to(dtype)
    slot_mapping = torch.tensor([5, 0, 23][:M])
    return x, weight, bias, angles.cos().to(dtype), angles.sin().to(dtype), cache, slot_mapping


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("M", [1, 2, 3])
@pytest.mark.parametrize("K", [64, 1024])
@pytest.mark.parametrize("preload", [False, True])
def test_fused_is_gemv_then_rotary_kv_write(dtype, with_bias, M, K, preload):
    """Default configs, and the weight read in one load (GemvConfig.preload)."""
    x, weight, bias, cos, sin, cache, slots = operands(M, K, dtype, with_bias)
    assert fits(M, weight)
    config = GemvConfig(block_n=4, preload=True) if preload else None
    got_k, got_v = cache[0].clone(), cache[1].clone()
    want_k, want_v = cache[0].clone(), cache[1].clone()
    q = gemv_rotary_kv(x, weight, bias, cos, sin, HEADS, got_k, got_v, slots, config)
    qkv = gemv(x, weight, bias, config).view(M, HEADS + 2 * KV_HEADS, DIM)
    want_q = rotary_kv_write(qkv, cos, sin, HEADS, want_k, want_v, slots)
    assert q.shape == (M, HEADS, DIM) and q.dtype == dtype
    assert torch.equal(q, want_q)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(got_k[untouched], cache[0][untouched])
    assert not torch.equal(got_k[slots], cache[0][slots])


def test_the_modes_covered():
    """M of 1-2 runs the deferred FMA, 3 the tensor-core dot (what the test above relies on)."""
    rows = (HEADS + 2 * KV_HEADS) * DIM
    assert [default_config(M, rows, 64).mode for M in (1, 2, 3)] == ["defer", "defer", "dot"]


def test_refuses_what_it_cannot_split_or_write():
    x, weight, bias, cos, sin, cache, slots = operands(1, 64, torch.float32, True)
    k, v = cache[0].clone(), cache[1].clone()
    with pytest.raises(ValueError, match="q heads"):
        gemv_rotary_kv(x, weight[:-DIM], None, cos, sin, HEADS, k, v, slots)
    with pytest.raises(ValueError, match="cos/sin"):
        gemv_rotary_kv(x, weight, bias, torch.cat([cos, cos]), torch.cat([sin, sin]), HEADS, k, v, slots)
    with pytest.raises(ValueError, match="cache slots"):
        gemv_rotary_kv(x, weight, bias, cos, sin, HEADS, k[:, :1], v[:, :1], slots)
    long_k = torch.randn(1, 8192)
    wide = torch.randn(weight.shape[0], 8192)
    assert not fits(1, wide)  # 8 row blocks of a long K: the config splits K
    with pytest.raises(ValueError, match="one pass over K"):
        gemv_rotary_kv(long_k, wide, None, cos, sin, HEADS, k, v, slots)
