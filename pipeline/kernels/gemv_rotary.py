"""The fused q/k/v projection of a decode step with rotary and the K/V cache
write in its epilogue: gemv, then rotary_kv_write, as one kernel.

Rotary pairs element i of a head with element i + head_dim / 2, which a
plain gemv program, holding a few consecutive outputs, never has together.
Here a program's tile holds output pairs instead: tile row j is weight row
head * head_dim + i + (j % 2) * head_dim / 2 for pair i of that head, so the
tile's sums pair up as rotary wants them. q heads are rotated into a fresh
[tokens, heads, head_dim] tensor, k heads rotated into the cache slot
`slot_mapping[token]`, v heads written there as they are. The projection
is rounded to the model dtype before the rotary, as the stored output the
unfused rotary kernel reads, and the rotary's arithmetic is that kernel's,
so the results are bit for bit gemv then rotary_kv_write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.kernels import interpreting, next_power_of_2
from pipeline.kernels.dependent_launch import launch_options, release_dependents, wait_only
from pipeline.kernels.gemv import (MODE_IDS, GemvConfig, check_operands, default_config, multiply_preloaded,
                                   preload_rows, stream_rows, tile_rows)


@triton.jit
def _gemv_rotary_kv_kernel(x_ptr, w_ptr, bias_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                           M, K, x_stride, w_stride, cs_stride, q_stride, cache_stride,
                           HAS_BIAS: tl.constexpr, MODE: tl.constexpr, EVEN_K: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, NUM_STAGES: tl.constexpr,
                           HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           HALF: tl.constexpr, PAIRS: tl.constexpr, USE_GDC: tl.constexpr,
                           PRELOAD: tl.constexpr = False, BLOCK_KP: tl.constexpr = 1):
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    j = tl.arange(0, BLOCK_N)
    pair = tl.program_id(0) * PAIRS + j // 2
    rn = (pair // HALF) * HEAD_DIM + pair % HALF + (j % 2) * HALF
    n_mask = pair < (HEADS + 2 * KV_HEADS) * HALF
    if PRELOAD:   # the weight, before the wait: see GemvConfig.preload
        w = preload_rows(w_ptr, rn, n_mask, w_stride, K, BLOCK_KP)
    # The epilogue's bias, cos/sin and cache slots, loaded before the loop so
    # their latency hides under it. Released after the loop: the next
    # kernel is the attention, whose waiting programs would otherwise take
    # SM slots this grid still needs.
    wait_only(USE_GDC)
    p = tl.program_id(0) * PAIRS + tl.arange(0, PAIRS)   # the tile's pairs, as `pair` counts them
    head, i = p // HALF, p % HALF
    mask = m_mask[:, None] & (p < (HEADS + 2 * KV_HEADS) * HALF)[None, :]
    cs = rm[:, None] * cs_stride + i[None, :]
    cos1 = tl.load(cos_ptr + cs, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + cs + HALF, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + cs, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + cs + HALF, mask=mask, other=0.0).to(tl.float32)
    slot = tl.load(slots_ptr + rm, mask=m_mask, other=0)
    bias = tl.zeros((BLOCK_N,), tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    if PRELOAD:
        acc = multiply_preloaded(x_ptr, rm, m_mask, x_stride, w, K, BLOCK_KP)
    else:
        acc = stream_rows(x_ptr, w_ptr, rm, rn, m_mask, n_mask, 0, K, x_stride, w_stride,
                          MODE, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST_DOT, NUM_STAGES)
    release_dependents(USE_GDC)
    if HAS_BIAS:
        acc += bias[None, :]
    dtype = q_ptr.dtype.element_ty
    x1, x2 = tl.split(tl.reshape(acc.to(dtype).to(tl.float32), (BLOCK_M, PAIRS, 2)))
    rotated = (head < HEADS + KV_HEADS)[None, :]
    out1 = tl.where(rotated, x1 * cos1 - x2 * sin1, x1)
    out2 = tl.where(rotated, x2 * cos2 + x1 * sin2, x2)
    is_q = mask & (head < HEADS)[None, :]
    q_at = q_ptr + rm[:, None] * q_stride + (head * HEAD_DIM + i)[None, :]
    tl.store(q_at, out1.to(dtype), mask=is_q)
    tl.store(q_at + HALF, out2.to(dtype), mask=is_q)
    # k and v rows of this token's cache slot: head - HEADS is the k head,
    # and one kv_heads further, the v head.
    kv = tl.maximum(head - HEADS, 0)
    is_k = mask & (head >= HEADS)[None, :] & (kv < KV_HEADS)[None, :]
    is_v = mask & (kv >= KV_HEADS)[None, :]
    kv = tl.where(kv < KV_HEADS, kv, kv - KV_HEADS)
    at = slot.to(tl.int64)[:, None] * cache_stride + (kv * HEAD_DIM + i)[None, :]
    tl.store(k_cache_ptr + at, out1.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    tl.store(k_cache_ptr + at + HALF, out2.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    tl.store(v_cache_ptr + at, out1.to(v_cache_ptr.dtype.element_ty), mask=is_v)
    tl.store(v_cache_ptr + at + HALF, out2.to(v_cache_ptr.dtype.element_ty), mask=is_v)


def fits(tokens: int, weight: torch.Tensor) -> bool:
    """Whether gemv_rotary_kv can run this projection: its default config
    must be one pass over K (no split-K partials to meet elsewhere)."""
    return default_config(tokens, *weight.shape).split_k == 1


def _check(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
           k_slots: torch.Tensor, v_slots: torch.Tensor) -> int:
    """The operands' shapes; returns kv_heads."""
    (tokens, _), rows, dim = x.shape, weight.shape[0], cos.shape[-1]
    all_heads = rows // max(dim, 1)
    if dim < 2 or dim % 2 or rows % dim or all_heads <= heads or (all_heads - heads) % 2:
        raise ValueError(f"gemv_rotary_kv: {rows} weight rows do not split into {heads} q heads and k, v "
                         f"heads of {dim}")
    if cos.shape != (tokens, dim) or cos.stride(1) != 1 or sin.shape != cos.shape or sin.stride() != cos.stride():
        raise ValueError(f"gemv_rotary_kv: cos/sin must be alike [{tokens}, {dim}], got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    kv_heads = (all_heads - heads) // 2
    if k_slots.shape[1:] != (kv_heads, dim) or not k_slots.is_contiguous() or v_slots.shape != k_slots.shape \
            or not v_slots.is_contiguous():
        raise ValueError(f"gemv_rotary_kv: cache slots must be contiguous [slots, {kv_heads}, {dim}], got "
                         f"{tuple(k_slots.shape)} and {tuple(v_slots.shape)}")
    return kv_heads


def gemv_rotary_kv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                   sin: torch.Tensor, heads: int, k_slots: torch.Tensor, v_slots: torch.Tensor,
                   slot_mapping: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """rotary_kv_write(gemv(x, weight, bias).view(tokens, -1, head_dim), cos,
    sin, heads, k_slots, v_slots, slot_mapping) in one kernel: x [tokens,
    K]; weight [(heads + 2 * kv_heads) * head_dim, K], q then k then v rows;
    cos/sin [tokens, head_dim]. Writes k and v at slot_mapping; returns the
    rotated q [tokens, heads, head_dim]. `config`: gemv's (default_config
    if None); it must not split K (see `fits`)."""
    check_operands(x, weight, bias)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"gemv_rotary_kv wants x [tokens, K] with K contiguous, got {tuple(x.shape)}")
    kv_heads = _check(x, weight, cos, sin, heads, k_slots, v_slots)
    (tokens, K), rows, dim = x.shape, weight.shape[0], cos.shape[-1]
    cfg = config or default_config(tokens, rows, K)
    if cfg.split_k > 1 or cfg.block_n % 2:
        raise ValueError(f"gemv_rotary_kv: a config of split-K {cfg.split_k}, {cfg.block_n} rows a program: "
                         f"want one pass over K and whole pairs; see fits()")
    cfg.check_preload(K)
    q = x.new_empty(tokens, heads, dim)
    _gemv_rotary_kv_kernel[(triton.cdiv(rows, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, cos, sin, slot_mapping, q, k_slots, v_slots,
        tokens, K, x.stride(0), weight.stride(0), cos.stride(0), q.stride(0), k_slots.stride(0),
        HAS_BIAS=bias is not None, MODE=MODE_IDS[cfg.mode], EVEN_K=K % cfg.block_k == 0,
        BLOCK_M=tile_rows(tokens, cfg), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST_DOT=interpreting() and x.dtype == torch.bfloat16, NUM_STAGES=cfg.num_stages,
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=dim, HALF=dim // 2, PAIRS=cfg.block_n // 2,
        PRELOAD=cfg.preload, BLOCK_KP=next_power_of_2(K) if cfg.preload else 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options())
    return q
