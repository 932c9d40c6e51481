"""The small-M matmul kernel (pipeline/kernels/gemv.py) against F.linear, run
on the CPU by Triton's interpreter: every multiply mode, split-K with uneven
and empty splits, K and N that are not multiples of the tile, with and
without bias; and the gated epilogue (gemv_silu_mul) against gemv then
silu_mul. Speed is scripts/gpu_gemv_bench.py's business, on a GPU.

Skipped where triton is not installed (CI).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the fused decode kernels are CUDA-only extras", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported without its interpreter; run this file alone", allow_module_level=True)
# Set before triton's first import, which fixes interpreter-or-compiler (see test_kernels.py).
os.environ["TRITON_INTERPRET"] = "1"
from pipeline.kernels.activation import silu_mul  # noqa: E402
from pipeline.kernels.gemv import GemvConfig, default_config, gemv, gemv_reference, gemv_silu_mul  # noqa: E402
from pipeline.kernels.ops import TritonLayerOps  # noqa: E402

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2),
             torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}

# Every mode, then split-K: 3 splits of K=200 in 32-wide tiles (3, 3, 1
# tiles), and 4 splits of 2 tiles (the last two splits get no K at all).
CONFIGS = {
    "defer": GemvConfig(block_n=16, block_k=64, mode="defer"),
    "reduce": GemvConfig(block_n=16, block_k=64, mode="reduce", num_stages=1),
    "dot": GemvConfig(block_n=16, block_k=64, mode="dot", num_warps=2),
    "reduce-split3": GemvConfig(block_n=8, block_k=32, mode="reduce", split_k=3),
    "dot-split2": GemvConfig(block_n=32, block_k=32, mode="dot", split_k=2, num_stages=2),
    "defer-split4-empty": GemvConfig(block_n=4, block_k=128, mode="defer", split_k=4, num_warps=2),
    # The whole K slice read in one load (before the wait, where PDL is on).
    "preload": GemvConfig(block_n=16, preload=True),
    "preload-2warps": GemvConfig(block_n=4, num_warps=2, preload=True),
}


def operands(M: int, N: int, K: int, dtype: torch.dtype, with_bias: bool, seed: int = 0):
    """x, weight (scaled so outputs are O(1)), bias or None."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype)
    weight = (torch.randn(N, K, generator=gen) * K ** -0.5).to(dtype)
    bias = (0.1 * torch.randn(N, generator=gen)).to(dtype) if with_bias else None
    return x, weight, bias


def check(x, weight, bias, config) -> None:
    got = gemv(x, weight, bias, config)
    # float32 of the same rounded inputs: what a float32-accumulating kernel should get.
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.dtype == x.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, **TOLERANCE[x.dtype])


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_uneven_shape_every_config(M, dtype, with_bias, name):
    check(*operands(M, 37, 200, dtype, with_bias), CONFIGS[name])


# The 3B model's projections shrunk 16x (qkv 2048->2560 with bias, down
# 11008->2048); K=688 is not a multiple of the 64-wide tile.
MODEL_LIKE = {"defer": GemvConfig(block_n=8, block_k=64, mode="defer"),
              "reduce": GemvConfig(block_n=16, block_k=128, mode="reduce"),
              "dot": GemvConfig(block_n=32, block_k=64, mode="dot"),
              "dot-split4": GemvConfig(block_n=16, block_k=64, mode="dot", split_k=4)}


@pytest.mark.parametrize("name", list(MODEL_LIKE))
@pytest.mark.parametrize("M", [1, 8])
def test_model_like_shapes(M, name):
    check(*operands(M, 160, 128, torch.bfloat16, True, seed=1), MODEL_LIKE[name])
    check(*operands(M, 128, 688, torch.bfloat16, False, seed=2), MODEL_LIKE[name])


def test_default_config_and_layouts():
    x, weight, bias = operands(4, 48, 96, torch.float16, True, seed=3)
    check(x, weight, bias, None)  # default_config picks the tile
    got = gemv(x.view(2, 2, 96), weight, bias)
    assert got.shape == (2, 2, 48)
    torch.testing.assert_close(got, gemv_reference(x, weight, bias).view(2, 2, 48), **TOLERANCE[torch.float16])
    assert gemv(x[0], weight).shape == (48,)
    # A strided x (every other column) is made contiguous, not misread.
    wide = torch.randn(4, 192).to(torch.float16)
    torch.testing.assert_close(gemv(wide[:, ::2], weight), gemv_reference(wide[:, ::2], weight),
                               **TOLERANCE[torch.float16])


def test_default_config_never_splits_short_k():
    """Split-K costs a second launch: the K=2048 projections run without it."""
    for M in (1, 2, 4, 8, 16):
        for N in (2560, 2048, 22016, 151936):
            assert default_config(M, N, 2048).split_k == 1
        assert default_config(M, 2048, 11008).block_n * default_config(M, 2048, 11008).split_k <= 64


def test_default_config_preloads_one_row_where_the_slice_fits():
    assert default_config(1, 2560, 2048).preload and default_config(1, 2048, 2048).preload
    assert not default_config(2, 2560, 2048).preload      # two rows: not measured
    assert not default_config(1, 22016, 2048).preload     # 64-row blocks: too large a slice
    assert not default_config(1, 2048, 11008).preload     # down's K: too large a slice


def test_preload_refuses_a_slice_past_its_limit():
    x, weight, _ = operands(1, 8, 4096, torch.float32, False)
    with pytest.raises(ValueError, match="PRELOAD_MAX"):
        gemv(x, weight, None, GemvConfig(block_n=4, preload=True))


@pytest.mark.parametrize("bad, field", [(dict(mode="fma"), "mode"), (dict(block_n=12), "block_n"),
                                        (dict(mode="dot", block_k=8), "block_k"), (dict(split_k=0), "split_k"),
                                        (dict(num_warps=3), "num_warps"), (dict(num_stages=0), "num_stages"),
                                        (dict(preload=True, split_k=2), "preload")])
def test_config_validation_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        GemvConfig(**bad)


def test_mismatched_operands_rejected():
    x, weight, bias = operands(2, 8, 16, torch.float32, True)
    with pytest.raises(ValueError, match="does not match"):
        gemv(x[:, :8], weight)
    with pytest.raises(ValueError, match="bias"):
        gemv(x, weight, bias[:4])
    with pytest.raises(ValueError, match="K contiguous"):
        gemv(x, weight.t().contiguous().t())


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_gated_epilogue_is_gemv_then_silu_mul(M, dtype, with_bias, name):
    """Bit for bit: the epilogue rounds the projection to the dtype before
    the SiLU, as the stored output silu_mul reads; 37 outputs leave the last
    tile partial. Split-K configs take the two-kernel way."""
    x, weight, bias = operands(M, 2 * 37, 200, dtype, with_bias, seed=M)
    got = gemv_silu_mul(x, weight, bias, CONFIGS[name])
    want = silu_mul(gemv(x, weight, bias, CONFIGS[name]))
    assert got.shape == (M, 37) and got.dtype == dtype
    assert torch.equal(got, want)


def test_gated_default_config_and_layouts():
    x, weight, _ = operands(2, 2 * 48, 96, torch.bfloat16, False, seed=4)
    want = silu_mul(gemv(x, weight))
    assert torch.equal(gemv_silu_mul(x, weight), want)
    assert torch.equal(gemv_silu_mul(x.view(1, 2, 96), weight), want.view(1, 2, 48))
    with pytest.raises(ValueError, match="2 \\* hidden"):
        gemv_silu_mul(x, weight[:95])


def test_layer_ops_fuse_the_gate_only_where_gemv_runs():
    """TritonLayerOps.gated_linear: gemv_silu_mul at few rows with use_gemv,
    F.linear then silu_mul otherwise; the same values either way."""
    x, weight, _ = operands(1, 2 * 48, 96, torch.bfloat16, False, seed=5)
    fused, plain = TritonLayerOps(use_gemv=True), TritonLayerOps(use_gemv=False)
    assert torch.equal(fused.gated_linear(x, weight), silu_mul(gemv(x, weight)))
    torch.testing.assert_close(plain.gated_linear(x, weight).float(), fused.gated_linear(x, weight).float(),
                               **TOLERANCE[torch.bfloat16])
    many = operands(64, 96, 96, torch.bfloat16, False, seed=6)[0]
    assert torch.equal(fused.gated_linear(many, weight), silu_mul(F.linear(many, weight)))
