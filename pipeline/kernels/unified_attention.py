"""Paged attention for a flat batch of query tokens from many sequences:
prefill chunks of any length (with or without a cached context before them)
and single-token decodes in one launch, reading K/V in place from the paged
cache through per-sequence block tables, causal within each sequence.

Sequence i owns query rows cu_seqlens[i]..cu_seqlens[i+1] of q, whose first
token sits at position context_lens[i]; the query at position p attends keys
0..p. Program (pid, kv_head) takes up to BLOCK_Q consecutive query tokens of
one sequence (`programs[pid]` = (sequence, first token within it), planned on
the host) and the whole GQA group of q heads of that kv head: its rows are
(token, head) pairs, so each K/V tile is loaded once for the group.

Everything the launch reads is a device tensor, including the block tables'
row stride, so one captured launch serves any step of its token bucket: the
grid is fixed by the bucket, a program past the planned ones does nothing,
and a sequence with context_len < 0 (the bucket's padding tokens) attends to
nothing and gets zeros, so padding rows stay finite.
Products run in float32 (tf32 on tensor cores for bf16/fp16 inputs, whose
values it holds exactly; "ieee" for fp32 models), as the decode kernel does.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from pipeline.kernels import next_power_of_2
from pipeline.kernels.decode_attention import attend_tile

ROWS_PER_PROGRAM = 64   # (token, head) rows: q and acc tiles stay in registers at head_dim 128


@triton.jit
def _unified_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, stride_ptr, cu_ptr, ctx_ptr, programs_ptr, scale,
                    q_stride, cache_stride,
                    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr):
    pid, kv_head = tl.program_id(0), tl.program_id(1)
    group = HEADS // KV_HEADS
    seq = tl.load(programs_ptr + 2 * pid)
    first_q = tl.load(programs_ptr + 2 * pid + 1)
    q_begin = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_begin
    ctx = tl.load(ctx_ptr + seq)
    table_stride = tl.load(stride_ptr)
    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    tok = first_q + r // BLOCK_G
    g = r % BLOCK_G
    row_valid = (tok < q_len) & (g < group)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_rows = (q_begin + tok) * q_stride + (kv_head * group + g) * HEAD_DIM
    q_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    pos = ctx + tok
    # Keys up to the program's last query position; none for padding (ctx < 0).
    end = tl.where(ctx < 0, 0, ctx + tl.minimum(first_q + BLOCK_Q, q_len)).to(tl.int32)
    m = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32) - float("inf")
    l = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    # Key 0 is in the first tile and visible to every row, so m is finite
    # after it and later fully masked tiles add exp(-inf) = 0.
    for first in range(0, end, BLOCK_N):
        kpos = first + n
        k_valid = kpos < end
        m, l, acc = attend_tile(q, k_ptr, v_ptr, tables_ptr + seq * table_stride, kpos, k_valid,
                                k_valid[None, :] & (kpos[None, :] <= pos[:, None]), m, l, acc, scale,
                                cache_stride, kv_head, d, d_mask, HEAD_DIM, PAGE, PRECISION)
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(out_ptr + q_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask)


def block_q(heads: int, kv_heads: int) -> int:
    """Query tokens per program: ROWS_PER_PROGRAM rows of (token, head)."""
    return max(1, ROWS_PER_PROGRAM // next_power_of_2(heads // kv_heads))


def max_programs(tokens: int, seqs: int, per_program: int) -> int:
    """Programs a bucket of `tokens` query rows over at most `seqs` sequences
    (plus the padding one) can need: each may leave one partial block."""
    return -(-tokens // per_program) + seqs + 1


def plan_programs(query_lens: np.ndarray, per_program: int, out: np.ndarray) -> None:
    """Fill `out` ([programs, 2]: sequence, first query token) for sequences
    with `query_lens`; the unused tail points past the last sequence's rows
    (the last entry of query_lens, whose program then stores nothing)."""
    blocks = -(-query_lens // per_program)
    total = int(blocks.sum())
    if total > len(out):
        raise ValueError(f"{total} programs planned for a grid of {len(out)}")
    starts = np.repeat(np.cumsum(blocks) - blocks, blocks)
    out[:total, 0] = np.repeat(np.arange(len(query_lens)), blocks)
    out[:total, 1] = (np.arange(total) - starts) * per_program
    out[total:, 0] = len(query_lens) - 1
    out[total:, 1] = query_lens[-1] if len(query_lens) else 0


def unified_attention(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, block_tables: torch.Tensor,
                      table_stride: torch.Tensor, cu_seqlens: torch.Tensor, context_lens: torch.Tensor,
                      programs: torch.Tensor, page: int, block_n: int = 32) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k/v_slots: [slots, kv_heads, head_dim];
    block_tables: flat, sequence i's row at i * table_stride[0];
    cu_seqlens: [seqs + 1]; context_lens: [seqs] (< 0: padding, zeros out);
    programs: [grid, 2] from plan_programs. Returns [tokens, heads, head_dim]."""
    tokens, heads, dim = q.shape
    kv_heads = k_slots.shape[1]
    if heads % kv_heads or not q.is_contiguous() or not k_slots.is_contiguous() or not v_slots.is_contiguous():
        raise ValueError("unified_attention wants contiguous q and cache, heads a multiple of kv_heads")
    if programs.dim() != 2 or programs.shape[1] != 2 or not programs.is_contiguous():
        raise ValueError(f"programs must be a contiguous [grid, 2], got {tuple(programs.shape)}")
    out = torch.empty_like(q)
    group = next_power_of_2(heads // kv_heads)
    per_program = block_q(heads, kv_heads)
    _unified_kernel[(programs.shape[0], kv_heads)](
        q, k_slots, v_slots, out, block_tables, table_stride, cu_seqlens, context_lens, programs, dim ** -0.5,
        q.stride(0), k_slots.stride(0),
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=dim, PAGE=page, BLOCK_Q=per_program, BLOCK_G=group,
        BLOCK_D=max(16, next_power_of_2(dim)), BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=8 if dim >= 128 else 4)
    return out


def unified_attention_reference(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                                block_tables: torch.Tensor, table_stride: int, cu_seqlens: list[int],
                                context_lens: list[int], page: int) -> torch.Tensor:
    """Per sequence: gather its keys through the block table, then causal
    SDPA as the reference backend does; padding sequences give zeros."""
    from pipeline.models.attention import causal_attention

    out = torch.zeros_like(q)
    for i, ctx in enumerate(context_lens):
        lo, hi = cu_seqlens[i], cu_seqlens[i + 1]
        if ctx < 0 or hi == lo:
            continue
        pos = torch.arange(ctx + hi - lo, device=q.device)
        slots = block_tables[i * table_stride + pos // page] * page + pos % page
        keys = k_slots.index_select(0, slots).transpose(0, 1)[None]
        values = v_slots.index_select(0, slots).transpose(0, 1)[None]
        out[lo:hi] = causal_attention(q[lo:hi].transpose(0, 1)[None], keys, values, ctx)[0].transpose(0, 1)
    return out
