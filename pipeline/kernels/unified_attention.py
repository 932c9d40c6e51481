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

Tiling, as a flash-attention forward does it (the first version, 64 rows by
32 keys in tf32, made a 2048-token prefill step of the 3B model ~10 ms slower
than PyTorch's flash SDPA over 36 layers):
- 128 (token, head) rows per program (16 tokens x the 8-head group of the 3B
  model) and 64 keys per tile: twice the MMA work per K/V byte loaded;
- the key loop is split: tiles wholly below the program's first query
  position are visible to every row and run without masks; only the one or
  two tiles on the diagonal mask keys (past the end, and causally);
- the softmax runs in base 2 on scores prescaled by log2(e);
- the grid is flat (planned programs x kv heads) and runs from its end: a
  sequence's later query blocks have the most keys, and starting the
  longest work first shortens the tail.
At the 3B shape on sm_90 this compiles (Triton 3.9) to wgmma dots, cp.async
K/V pipelining, 214 registers a thread and no spills.

Precision: 16-bit models (bf16/fp16) keep q, k and v in their dtype for the
dots, accumulating in float32, and cast the probabilities p to that dtype
for p @ v, as FlashAttention does: beside the output's, that rounding of p
(relative 2^-9 for bf16) is the only one, and the bf16 tensor cores run at
twice the tf32 rate. float32 models multiply in "ieee" float32 (32-key
tiles, two stages: their tiles are twice the bytes), so the CPU tests hold
the kernel to the reference tightly.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from pipeline.kernels import interpreting, next_power_of_2

ROWS_PER_PROGRAM = 128   # (token, head) rows: a 128 x 128 fp32 accumulator fits 8 warps' registers
LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(ptrs, row_ok, d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_ROWS: tl.constexpr):
    """A [rows, BLOCK_D] tile; rows masked only where MASK_ROWS and columns
    only where BLOCK_D pads HEAD_DIM, so unmasked tiles load unpredicated."""
    if MASK_ROWS:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(d < HEAD_DIM)[None, :], other=0.0)
    return tile


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    if WIDEN:   # the interpreter multiplies bf16 tiles as their raw bits (triton#11584)
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _attend_keys(q, k_ptr, v_ptr, table_ptr, first, end, pos, m, l, acc, qk_scale, cache_stride, kv_head, d,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 PRECISION: tl.constexpr, WIDEN: tl.constexpr, DIAGONAL: tl.constexpr):
    """One online-softmax step (base 2: m and the scores are in log2 units)
    over keys first..first+BLOCK_N. Off the diagonal every key is below
    `end` and visible to every row: no masks. On it, keys past `end` are not
    loaded and key kpos is visible to the row at position `pos` iff kpos <= pos."""
    kpos = first + tl.arange(0, BLOCK_N)
    valid = kpos < end
    if DIAGONAL:
        page = tl.load(table_ptr + kpos // PAGE, mask=valid, other=0)
    else:
        page = tl.load(table_ptr + kpos // PAGE)
    rows = (page * PAGE + kpos % PAGE) * cache_stride + kv_head * HEAD_DIM
    k = _load_rows(k_ptr + rows[:, None] + d[None, :], valid, d, HEAD_DIM, BLOCK_D, DIAGONAL)
    s = _dot(q, tl.trans(k), PRECISION, WIDEN) * qk_scale
    if DIAGONAL:
        s = tl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    v = _load_rows(v_ptr + rows[:, None] + d[None, :], valid, d, HEAD_DIM, BLOCK_D, DIAGONAL)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, WIDEN)
    return m_new, l, acc


@triton.jit
def _unified_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, stride_ptr, cu_ptr, ctx_ptr, programs_ptr, qk_scale,
                    q_stride, cache_stride,
                    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    # Last planned program first: a sequence's later query blocks see the
    # most keys, and starting the longest work first shortens the tail.
    at = tl.num_programs(0) - 1 - tl.program_id(0)
    pid, kv_head = at // KV_HEADS, at % KV_HEADS
    group = HEADS // KV_HEADS
    seq = tl.load(programs_ptr + 2 * pid)
    first_q = tl.load(programs_ptr + 2 * pid + 1)
    q_begin = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_begin
    ctx = tl.load(ctx_ptr + seq)
    table_ptr = tables_ptr + seq * tl.load(stride_ptr)
    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    tok = first_q + r // BLOCK_G
    g = r % BLOCK_G
    row_valid = (tok < q_len) & (g < group)
    d = tl.arange(0, BLOCK_D)
    q_rows = (q_begin + tok) * q_stride + (kv_head * group + g) * HEAD_DIM
    q = _load_rows(q_ptr + q_rows[:, None] + d[None, :], row_valid, d, HEAD_DIM, BLOCK_D, True)
    pos = ctx + tok
    # Keys up to the program's last query position; none for padding
    # (ctx < 0) or a spare program (no query tokens). Keys below `full`
    # (whole tiles up to its first query position) are visible to all rows.
    last = tl.minimum(first_q + BLOCK_Q, q_len)
    end = tl.where((ctx < 0) | (first_q >= q_len), 0, ctx + last).to(tl.int32)
    # (Clamped at 0: integer // truncates toward zero for a padding ctx < 0.)
    full = tl.maximum(tl.minimum((ctx + first_q + 1) // BLOCK_N * BLOCK_N, end), 0).to(tl.int32)
    m = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32) - float("inf")
    l = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], dtype=tl.float32)
    # Key 0 is in the first tile and visible to every row, so m is finite
    # after it and later masked keys add exp2(-inf) = 0.
    for first in range(0, full, BLOCK_N):
        m, l, acc = _attend_keys(q, k_ptr, v_ptr, table_ptr, first, end, pos, m, l, acc, qk_scale, cache_stride,
                                 kv_head, d, HEAD_DIM, BLOCK_D, PAGE, BLOCK_N, PRECISION, WIDEN, False)
    for first in range(full, end, BLOCK_N):
        m, l, acc = _attend_keys(q, k_ptr, v_ptr, table_ptr, first, end, pos, m, l, acc, qk_scale, cache_stride,
                                 kv_head, d, HEAD_DIM, BLOCK_D, PAGE, BLOCK_N, PRECISION, WIDEN, True)
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(out_ptr + q_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & (d < HEAD_DIM)[None, :])


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
                      programs: torch.Tensor, page: int, per_program: int | None = None, block_n: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k/v_slots: [slots, kv_heads, head_dim];
    block_tables: flat, sequence i's row at i * table_stride[0];
    cu_seqlens: [seqs + 1]; context_lens: [seqs] (< 0: padding, zeros out);
    programs: [grid, 2] from plan_programs with `per_program` tokens per
    program (None: block_q(heads, kv_heads), as MixedGraphs plans).
    Returns [tokens, heads, head_dim]. block_n, num_warps, num_stages: None
    takes the defaults for q's dtype (scripts/gpu_unified_bench.py times
    other tilings)."""
    tokens, heads, dim = q.shape
    kv_heads = k_slots.shape[1]
    if heads % kv_heads or not q.is_contiguous() or not k_slots.is_contiguous() or not v_slots.is_contiguous():
        raise ValueError("unified_attention wants contiguous q and cache, heads a multiple of kv_heads")
    if programs.dim() != 2 or programs.shape[1] != 2 or not programs.is_contiguous():
        raise ValueError(f"programs must be a contiguous [grid, 2], got {tuple(programs.shape)}")
    if q.dtype != k_slots.dtype or q.dtype != v_slots.dtype:
        raise ValueError(f"q and cache dtypes differ: {q.dtype}, {k_slots.dtype}, {v_slots.dtype}")
    per_program = per_program or block_q(heads, kv_heads)
    if per_program & (per_program - 1):
        raise ValueError(f"per_program must be a power of two, got {per_program}")
    wide = q.dtype == torch.float32   # float32 tiles are twice the bytes: smaller and fewer in flight
    # Under the interpreter bf16 dots are widened to float32 (exact for the
    # bf16-rounded operands), so the tests see the GPU's products.
    widen = q.dtype == torch.bfloat16 and interpreting()
    out = torch.empty_like(q)
    _unified_kernel[(programs.shape[0] * kv_heads,)](
        q, k_slots, v_slots, out, block_tables, table_stride, cu_seqlens, context_lens, programs,
        dim ** -0.5 * LOG2E, q.stride(0), k_slots.stride(0),
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=dim, PAGE=page, BLOCK_Q=per_program,
        BLOCK_G=next_power_of_2(heads // kv_heads), BLOCK_D=max(16, next_power_of_2(dim)),
        BLOCK_N=block_n or (32 if wide else 64),
        # Only float32 operands read it: 16-bit ones always take the 16-bit MMA.
        PRECISION="ieee" if wide or widen else "tf32", WIDEN=widen,
        num_warps=num_warps or (8 if dim >= 128 else 4), num_stages=num_stages or (2 if wide else 3))
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
