"""Rotary embedding on q and k plus the K/V write into the paged cache, in
one kernel over the fused qkv projection's output.

Unfused this is a slice, a rotate-half (two slices, a negation, a cat), three
multiply/adds for the rotary, then an index_copy for each of K and V. Here
one program per token reads its qkv row, rotates the q and k heads with the
token's precomputed cos/sin (computed once per step, shared by all layers),
writes the rotated q to a fresh [tokens, heads, head_dim] tensor and the
rotated k and the untouched v into the cache slot `slot_mapping[token]`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.kernels import next_power_of_2
from pipeline.kernels.dependent_launch import launch_options, wait_then_release
from pipeline.models.layers import apply_rotary


@triton.jit
def _rotary_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                      qkv_stride, cs_stride, q_stride, cache_stride,
                      HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_KV: tl.constexpr,
                      BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr):
    wait_then_release(USE_GDC)
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    # q and k heads, each as two halves: rotate_half(x) = cat(-x2, x1).
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < HALF
    mask = (h < HEADS + KV_HEADS)[:, None] & j_mask[None, :]
    row = qkv_ptr + t * qkv_stride + h[:, None] * HEAD_DIM + j[None, :]
    x1 = tl.load(row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF, mask=mask, other=0.0).to(tl.float32)
    cs = t * cs_stride + j
    cos1 = tl.load(cos_ptr + cs, mask=j_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + cs + HALF, mask=j_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + cs, mask=j_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + cs + HALF, mask=j_mask, other=0.0).to(tl.float32)[None, :]
    out1 = x1 * cos1 - x2 * sin1
    out2 = x2 * cos2 + x1 * sin2
    is_q = (h < HEADS)[:, None]
    is_k = (h >= HEADS)[:, None]
    q_at = q_ptr + t * q_stride + h[:, None] * HEAD_DIM + j[None, :]
    tl.store(q_at, out1.to(q_ptr.dtype.element_ty), mask=mask & is_q)
    tl.store(q_at + HALF, out2.to(q_ptr.dtype.element_ty), mask=mask & is_q)
    k_head = tl.where(h < HEADS, 0, h - HEADS)  # clamped: q rows are masked off below
    k_at = k_cache_ptr + slot * cache_stride + k_head[:, None] * HEAD_DIM + j[None, :]
    tl.store(k_at, out1.to(k_cache_ptr.dtype.element_ty), mask=mask & is_k)
    tl.store(k_at + HALF, out2.to(k_cache_ptr.dtype.element_ty), mask=mask & is_k)
    # v heads: copied as they are.
    vh = tl.arange(0, BLOCK_KV)
    d = tl.arange(0, BLOCK_D)
    v_mask = (vh < KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    v_src = qkv_ptr + t * qkv_stride + (HEADS + KV_HEADS + vh[:, None]) * HEAD_DIM + d[None, :]
    v = tl.load(v_src, mask=v_mask, other=0.0)
    tl.store(v_cache_ptr + slot * cache_stride + vh[:, None] * HEAD_DIM + d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def _check(qkv: torch.Tensor, cos: torch.Tensor, k_slots: torch.Tensor, heads: int) -> None:
    tokens, all_heads, dim = qkv.shape
    kv_heads = (all_heads - heads) // 2
    if heads + 2 * kv_heads != all_heads or dim % 2:
        raise ValueError(f"qkv of {all_heads} heads of {dim} does not split into {heads} q heads and k, v")
    if qkv.stride(2) != 1 or qkv.stride(1) != dim:
        raise ValueError("qkv must be row-major within each token")
    if cos.shape != (tokens, dim) or cos.stride(1) != 1:
        raise ValueError(f"cos/sin must be [{tokens}, {dim}], got {tuple(cos.shape)}")
    if k_slots.shape[1:] != (kv_heads, dim) or not k_slots.is_contiguous():
        raise ValueError(f"cache slots must be contiguous [slots, {kv_heads}, {dim}], got {tuple(k_slots.shape)}")


def rotary_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                    k_slots: torch.Tensor, v_slots: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """qkv: [tokens, heads + 2 * kv_heads, head_dim] (q, k, v heads in that
    order); cos/sin: [tokens, head_dim]; k/v_slots: [slots, kv_heads,
    head_dim]. Writes rotated k and v at slot_mapping; returns rotated q."""
    _check(qkv, cos, k_slots, heads)
    tokens, all_heads, dim = qkv.shape
    kv_heads = (all_heads - heads) // 2
    q = qkv.new_empty(tokens, heads, dim)
    _rotary_kv_kernel[(tokens,)](
        qkv, cos, sin, slot_mapping, q, k_slots, v_slots,
        qkv.stride(0), cos.stride(0), q.stride(0), k_slots.stride(0),
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=dim, HALF=dim // 2, BLOCK_H=next_power_of_2(heads + kv_heads),
        BLOCK_HALF=next_power_of_2(dim // 2), BLOCK_KV=next_power_of_2(kv_heads), BLOCK_D=next_power_of_2(dim),
        num_warps=4, **launch_options())
    return q


def rotary_kv_write_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                              k_slots: torch.Tensor, v_slots: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """What the unfused decode path does (SelfAttention + an index_copy backend)."""
    kv_heads = (qkv.shape[1] - heads) // 2
    qk = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)
    k_slots.index_copy_(0, slot_mapping, qk[:, heads:])
    v_slots.index_copy_(0, slot_mapping, qkv[:, heads + kv_heads:])
    return qk[:, :heads].contiguous()
