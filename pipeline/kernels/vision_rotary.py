"""The vision tower's rotary embedding on q and k, in place, in one kernel.

The reference rotates the vision tower's q and k in float32 whatever the
model dtype: a cast up, a rotate-half (two slices, a negation, a cat), two
multiplies and an add over [tokens, 2, heads, head_dim], a cast down and a
copy back into qkv. On an H200 those passes were about a quarter of the
3B checkpoint's tower forward (docs/benchmarks.md, vision profile). Here
one program per token loads its q and k heads as two halves, rotates them
in float32 and stores them back in the model dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.kernels import next_power_of_2


@triton.jit
def _rotate_qk_kernel(qkv_ptr, cos_ptr, sin_ptr, qkv_stride, cs_stride,
                      HEADS2: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)          # q heads, then k heads: contiguous in qkv's row
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < HALF
    mask = (h < HEADS2)[:, None] & j_mask[None, :]
    row = qkv_ptr + t * qkv_stride + h[:, None] * HEAD_DIM + j[None, :]
    x1 = tl.load(row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF, mask=mask, other=0.0).to(tl.float32)
    cs = t * cs_stride + j
    cos1 = tl.load(cos_ptr + cs, mask=j_mask, other=0.0)[None, :]
    cos2 = tl.load(cos_ptr + cs + HALF, mask=j_mask, other=0.0)[None, :]
    sin1 = tl.load(sin_ptr + cs, mask=j_mask, other=0.0)[None, :]
    sin2 = tl.load(sin_ptr + cs + HALF, mask=j_mask, other=0.0)[None, :]
    # rotate_half(x) = cat(-x2, x1); x * cos + rotate_half(x) * sin.
    tl.store(row, (x1 * cos1 - x2 * sin1).to(qkv_ptr.dtype.element_ty), mask=mask)
    tl.store(row + HALF, (x2 * cos2 + x1 * sin2).to(qkv_ptr.dtype.element_ty), mask=mask)


def rotate_qk_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qkv: [tokens, 3, heads, head_dim], row-major; cos/sin: float32
    [tokens, head_dim]. Rotates q and k (qkv[:, :2]) in place, computing in
    float32; v is untouched. Returns qkv."""
    if qkv.dim() != 4 or qkv.shape[1] != 3 or not qkv.is_contiguous():
        raise ValueError(f"rotate_qk_ wants a contiguous [tokens, 3, heads, head_dim] qkv, got {tuple(qkv.shape)}")
    tokens, _, heads, dim = qkv.shape
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (tokens, dim) or table.dtype != torch.float32 or table.stride(1) != 1:
            raise ValueError(f"{name} must be float32 [{tokens}, {dim}], got {table.dtype} {tuple(table.shape)}")
    if sin.stride() != cos.stride():
        raise ValueError("cos and sin must share one layout")
    if dim % 2:
        raise ValueError(f"head_dim {dim} must be even")
    if tokens:
        _rotate_qk_kernel[(tokens,)](qkv, cos, sin, qkv.stride(0), cos.stride(0),
                                     HEADS2=2 * heads, HEAD_DIM=dim, HALF=dim // 2,
                                     BLOCK_H=next_power_of_2(2 * heads), BLOCK_HALF=next_power_of_2(dim // 2),
                                     num_warps=4)
    return qkv
