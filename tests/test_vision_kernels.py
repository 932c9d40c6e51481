"""The vision tower on fused kernels (VisionTower.fuse, the default on CUDA),
on the CPU under Triton's interpreter: the in-place float32 rotary against
the reference ops, the zero-padded gate/up MLP against the plain one, and
whole tower forwards against the eager tower.

Skipped where triton is not installed; shares tests/test_kernels.py's
interpreter set-up by importing it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the fused vision kernels are CUDA-only extras", allow_module_level=True)
from test_kernels import close  # noqa: E402  (sets TRITON_INTERPRET=1 before triton loads)

from pipeline.models.layers import GatedMLP, rotate_float  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, heads, dim", [(7, 2, 16), (5, 3, 10)])
def test_rotate_qk_in_place_equals_float32_reference(dtype, tokens, heads, dim):
    from pipeline.kernels.vision_rotary import rotate_qk_

    gen = torch.Generator().manual_seed(tokens * heads)
    qkv = torch.randn(tokens, 3, heads, dim, generator=gen).to(dtype)
    angles = torch.randn(tokens, dim // 2, generator=gen)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    want = qkv.clone()
    want[:, :2] = rotate_float(want[:, :2], cos, sin)
    v_before = qkv[:, 2].clone()
    assert rotate_qk_(qkv, cos, sin) is qkv
    close(qkv, want)
    assert torch.equal(qkv[:, 2], v_before)   # v untouched
    # The rotation moved q and k: the check above is not vacuous.
    assert not torch.allclose(qkv[:, :2].float(), v_before[:, None].float().expand_as(qkv[:, :2]))


def test_rotate_qk_rejects_bad_layouts():
    from pipeline.kernels.vision_rotary import rotate_qk_

    qkv, table = torch.zeros(4, 3, 2, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="contiguous"):
        rotate_qk_(qkv.transpose(0, 1), table, table)
    with pytest.raises(ValueError, match="float32"):
        rotate_qk_(qkv, table.to(torch.bfloat16), table)
    with pytest.raises(ValueError, match="cos must be"):
        rotate_qk_(qkv, torch.zeros(3, 8), table)


@pytest.mark.parametrize("bias", [True, False])
def test_padded_gate_up_equals_plain_mlp(bias):
    """fuse(pad_to=64) pads 40 hidden units to 64 with zeros: the same output
    in float32, eager and on the fused kernels; the checkpoint parameters
    keep their shapes and values."""
    from pipeline.kernels.ops import TritonLayerOps

    torch.manual_seed(3)
    mlp = GatedMLP(24, 40, bias=bias)
    x = torch.randn(9, 24)
    want = mlp(x)
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    mlp.fuse(pad_to=64)
    assert mlp.gate_up[0].shape == (128, 24) and mlp.down[0].shape == (24, 64)
    after = mlp.state_dict()
    assert all(after[k].shape == v.shape and torch.equal(after[k], v) for k, v in before.items())
    torch.testing.assert_close(mlp(x), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mlp.forward_fused(x, TritonLayerOps()), want, atol=1e-5, rtol=1e-5)


def test_fused_tower_equals_eager_tower(tiny_dir):
    """The tiny checkpoint's tower on a packed batch of two images of
    different sizes (window and full-attention blocks): in float32 the
    fused forward equals the eager one; in bfloat16 it is no further from
    the float32 result than the eager bfloat16 forward is (the blocks round
    in other places, so the two bfloat16 results differ by rounding)."""
    from pipeline.kernels.ops import TritonLayerOps
    from pipeline.models.loader import load_model

    gen = torch.Generator().manual_seed(0)
    grids = [(1, 8, 12), (1, 4, 4)]

    def forwards(dtype):
        tower = load_model(tiny_dir).model.visual.to(dtype)
        dim = tower.patch_embed.proj.weight[0].numel()
        pixels = torch.randn(sum(t * h * w for t, h, w in grids), dim, generator=gen.manual_seed(0)).to(dtype)
        with torch.inference_mode():
            eager = torch.cat(tower(pixels, grids)).float()
            tower.fuse(TritonLayerOps())
            fused = torch.cat(tower(pixels, grids)).float()
        return eager, fused

    exact, fused32 = forwards(torch.float32)
    close(fused32, exact)
    eager16, fused16 = forwards(torch.bfloat16)
    eager_err = (eager16 - exact).abs().max().item()
    fused_err = (fused16 - exact).abs().max().item()
    assert 0 < eager_err and fused_err <= 1.5 * eager_err, (fused_err, eager_err)
