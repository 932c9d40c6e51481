"""Paged decode attention: one query token per sequence, keys and values read
in place from the paged cache through the block table (no gather copy).

Split-K ("flash decoding"): a batch-1 step has only `kv_heads` (2 for the 3B
model) units of work per sequence, far too few to fill a GPU, so each
sequence's key range is cut into `num_splits` pieces. Program (seq, kv_head,
split) attends the whole GQA group of q heads of that kv head to its piece
with an online softmax and writes an unnormalised partial (acc, max, sum);
a second kernel merges the pieces. With one split the first kernel writes
the output directly. (The split program that finished last merging them
instead, one launch a layer fewer, measured 13.7% slower on the batch-1
step: its serial merge of 32 splits of 8 heads was the layer's critical
path, where the merge kernel runs a program per head. Commit 2e83a7c.)

Shapes are static per (batch, max_len) bucket so the launches are CUDA-graph
capturable; a sequence's real length masks the rest, and a padding row (length
1, block table full of the null block) reads the null block's first slot.
Products run in float32 on tensor cores as tf32: bf16/fp16 values are exact in
tf32, and fp32 models get "ieee" so their results are not rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.kernels import next_power_of_2
from pipeline.kernels.dependent_launch import launch_options, wait_then_release


@triton.jit
def attend_tile(q, k_ptr, v_ptr, table_ptr, pos, valid, visible, m, l, acc, scale, cache_stride, kv_head, d, d_mask,
                HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step of q's rows over a tile of keys at positions
    `pos` of one sequence (`table_ptr`: its block table row), loaded where
    `valid`, scored where `visible` ([rows, tile], broadcastable). Returns
    the updated running max, sum and unnormalised output."""
    page = tl.load(table_ptr + pos // PAGE, mask=valid, other=0)
    rows = (page * PAGE + pos % PAGE) * cache_stride + kv_head * HEAD_DIM
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, out_ptr, acc_ptr, stats_ptr, scale,
                  q_stride, cache_stride, table_stride,
                  HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                  SPLIT_LEN: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, USE_GDC: tl.constexpr):
    wait_then_release(USE_GDC)
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    group = HEADS // KV_HEADS
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask, d_mask = g < group, d < HEAD_DIM
    heads = kv_head * group + g
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * q_stride + heads[:, None] * HEAD_DIM + d[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32)
    length = tl.load(lengths_ptr + seq).to(tl.int32)
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, length).to(tl.int32)
    m = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    for first in range(start, end, BLOCK_N):
        pos = first + n
        valid = pos < end
        m, l, acc = attend_tile(q, k_ptr, v_ptr, tables_ptr + seq * table_stride, pos, valid, valid[None, :],
                                m, l, acc, scale, cache_stride, kv_head, d, d_mask, HEAD_DIM, PAGE, PRECISION)
    if NUM_SPLITS == 1:
        out = acc / l[:, None]
        tl.store(out_ptr + seq * q_stride + heads[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Partials of row (seq, head) at [(seq * HEADS + head) * NUM_SPLITS + split].
        at = (seq * HEADS + heads) * NUM_SPLITS + split
        tl.store(acc_ptr + at[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
        tl.store(stats_ptr + at * 2, m, mask=g_mask)
        tl.store(stats_ptr + at * 2 + 1, l, mask=g_mask)


@triton.jit
def _merge_kernel(acc_ptr, stats_ptr, out_ptr, out_stride, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr):
    wait_then_release(USE_GDC)
    seq, head = tl.program_id(0), tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask, d_mask = sp < NUM_SPLITS, d < HEAD_DIM
    at = (seq * HEADS + head) * NUM_SPLITS + sp
    # A split past the sequence's end has max -inf and sum 0: weight 0.
    m = tl.load(stats_ptr + at * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(stats_ptr + at * 2 + 1, mask=s_mask, other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.exp(m - m_all)
    total = tl.sum(l * w, axis=0)
    acc = tl.load(acc_ptr + at[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(out_ptr + seq * out_stride + head * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def plan_splits(batch: int, kv_heads: int, max_len: int, num_sms: int, block_n: int = 32) -> tuple[int, int]:
    """(num_splits, split_len) for a bucket: enough programs to give every
    SM about two, each piece a whole number of BLOCK_N tiles."""
    tiles = triton.cdiv(max_len, block_n)
    splits = max(1, min(tiles, triton.cdiv(2 * num_sms, batch * kv_heads)))
    split_len = triton.cdiv(tiles, splits) * block_n
    return triton.cdiv(max_len, split_len), split_len


def paged_decode_attention(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                           block_tables: torch.Tensor, lengths: torch.Tensor, page: int,
                           num_splits: int, split_len: int, block_n: int = 32) -> torch.Tensor:
    """q: [batch, heads, head_dim] (one query per sequence, at its last
    position); k/v_slots: [slots, kv_heads, head_dim]; block_tables: [batch,
    width] block ids; lengths: [batch] keys per sequence, each at most
    num_splits * split_len and width * page. Returns [batch, heads, head_dim]."""
    batch, heads, dim = q.shape
    kv_heads = k_slots.shape[1]
    if heads % kv_heads or not q.is_contiguous() or not k_slots.is_contiguous() or not v_slots.is_contiguous():
        raise ValueError("paged_decode_attention wants contiguous q and cache, heads a multiple of kv_heads")
    if split_len % block_n or block_tables.stride(1) != 1:
        raise ValueError("split_len must be a multiple of block_n; block tables row-major")
    out = torch.empty_like(q)
    acc = stats = out  # unused with one split
    if num_splits > 1:
        acc = torch.empty(batch * heads * num_splits, dim, dtype=torch.float32, device=q.device)
        stats = torch.empty(batch * heads * num_splits, 2, dtype=torch.float32, device=q.device)
    block_d = next_power_of_2(dim)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    pdl = launch_options()
    _split_kernel[(batch, kv_heads, num_splits)](
        q, k_slots, v_slots, block_tables, lengths, out, acc, stats, dim ** -0.5,
        q.stride(0), k_slots.stride(0), block_tables.stride(0),
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=dim, PAGE=page, SPLIT_LEN=split_len, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, next_power_of_2(heads // kv_heads)), BLOCK_D=max(16, block_d), BLOCK_N=block_n,
        PRECISION=precision, num_warps=4, **pdl)
    if num_splits > 1:
        _merge_kernel[(batch, heads)](acc, stats, out, out.stride(0), HEADS=heads, HEAD_DIM=dim,
                                      NUM_SPLITS=num_splits, BLOCK_S=next_power_of_2(num_splits),
                                      BLOCK_D=block_d, num_warps=4, **pdl)
    return out


def paged_decode_attention_reference(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                                     block_tables: torch.Tensor, lengths: torch.Tensor, page: int) -> torch.Tensor:
    """Per sequence: gather its keys through the block table, then SDPA."""
    out = torch.empty_like(q)
    for i, n in enumerate(lengths.tolist()):
        pos = torch.arange(n, device=q.device)
        slots = block_tables[i, pos // page] * page + pos % page
        keys = k_slots.index_select(0, slots).transpose(0, 1)[None]
        values = v_slots.index_select(0, slots).transpose(0, 1)[None]
        out[i] = torch.nn.functional.scaled_dot_product_attention(
            q[i][None, :, None, :], keys, values, scale=q.shape[-1] ** -0.5,
            enable_gqa=keys.shape[1] != q.shape[1])[0, :, 0, :]
    return out
