"""Fast mixed steps (prefill chunks beside decodes): the fused Triton forward
over static buffers, captured on CUDA as one graph per total-token bucket.

Eager, a mixed step of the 3B model made ~35 PyTorch calls per layer, and the
GPU box's host spends tens of microseconds on each: 74-117 ms per step for
~20 ms of GPU work. Here a layer is nine kernels (add+RMSNorm, qkv matmul,
rotary + K/V write, unified paged attention, o_proj, add+RMSNorm, gate_up,
SiLU*up, down) and, on CUDA, the whole forward is one graph replay.

Per step the host writes every input (token ids, M-RoPE positions, slot
mapping, sequence offsets, context lengths, the attention kernel's program
plan, the rows to sample, the block tables at this step's width) into one
pinned buffer and sends it in one copy; image embeddings are spliced into
the static embeds buffer (and their side levels into the static side
buffer) before the replay. A bucket's tokens past the real
ones form a padding sequence: K/V written to the null block, attention
output zero, logits never read.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline import kernels
from pipeline.cuda_graphs import capture_graph
from pipeline.engine.paged_attention import PagedKVCache, SequenceSlice

COARSE = 512   # above this many tokens, buckets step by it rather than doubling
MIN_TOKENS = 16   # the smallest bucket


def token_bucket(n: int, minimum: int) -> int:
    """The bucket of a step of n tokens: powers of two from `minimum` up to
    COARSE, then multiples of COARSE, so a full 2048-token chunk beside a
    few decodes pads by at most COARSE, not by another 2048 (whose GEMMs
    would cost as much as the real rows)."""
    if n > COARSE:
        return -(-n // COARSE) * COARSE
    size = minimum
    while size < n:
        size *= 2
    return size


class MixedGraphs:
    """Runs mixed steps of at most `max_tokens` tokens over at most
    `max_seqs` sequences, each of at most `max_len` tokens. On CUDA with
    `use_graphs`, each token bucket is captured on first use (or by
    capture_all at start-up) and replayed; elsewhere (the interpreter, in
    tests) the same forward runs eagerly."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, null_block: int, max_tokens: int,
                 max_seqs: int, max_len: int, device: torch.device, use_graphs: bool,
                 min_tokens: int = MIN_TOKENS) -> None:
        if not kernels.available(device):
            raise ValueError(f"fast mixed steps need triton and a CUDA device (or TRITON_INTERPRET=1), not {device}")
        from pipeline.kernels import unified_attention  # triton only where it runs
        self.plan = unified_attention
        lang = model.spec.language
        self.per_program = unified_attention.block_q(lang.num_attention_heads, lang.kv_heads)
        self.model, self.cache, self.null_block, self.device = model, cache, null_block, device
        self.use_graphs = use_graphs and device.type == "cuda"
        self.min_tokens = min_tokens
        self.max_tokens = token_bucket(max_tokens, min_tokens)
        self.max_seqs = max_seqs
        self.max_blocks = -(-max_len // cache.block_size)
        self.axes = model.spec.position_axes
        self._allocate(lang.hidden_size, next(model.parameters()).dtype)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # A pool apart from the decode graphs': graphs sharing one may reuse
        # each other's memory, safe only under an order of replays that two
        # independent families would have to keep.
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def _allocate(self, hidden: int, dtype: torch.dtype) -> None:
        mt, ms = self.max_tokens, self.max_seqs
        programs = self.plan.max_programs(mt, ms, self.per_program)
        sizes = dict(ids=mt, positions=self.axes * mt, slots=mt, sample=ms, cu=ms + 2, ctx=ms + 1, stride=1,
                     programs=2 * programs)
        self.at, start = {}, 0
        for name, size in sizes.items():
            self.at[name] = (start, start + size)
            start += size
        self.header = start
        size = self.header + ms * self.max_blocks
        pinned = self.device.type == "cuda"
        self.inputs = torch.zeros(size, dtype=torch.long, device=self.device)
        self.staging = torch.zeros(size, dtype=torch.long, pin_memory=pinned)
        self.embeds = torch.zeros(mt, hidden, dtype=dtype, device=self.device)
        # Side levels (spec.side_levels) of the image rows: zeros elsewhere,
        # so the rows one step wrote are cleared before the next.
        levels = self.model.spec.side_levels
        self.side = torch.zeros(mt, levels, hidden, dtype=dtype, device=self.device) if levels else None
        self.side_rows: list[tuple[int, int]] = []
        # Marks the last copy out of the pinned mirror: the host may not
        # rewrite the mirror while that copy can still be reading it.
        self.copied = torch.cuda.Event() if pinned else None

    def _view(self, name: str, tensor: torch.Tensor | None = None):
        lo, hi = self.at[name]
        return (self.inputs if tensor is None else tensor)[lo:hi]

    def run(self, token_ids: list[int], positions: torch.Tensor, slices: list[SequenceSlice],
            splices: list[tuple[int, torch.Tensor]], sample_rows: list[int]) -> torch.Tensor:
        """Logits [len(sample_rows), vocab] of the given flat rows of one step
        whose sequences are `slices` (laid end to end, as the runner builds
        them); `splices` are (row, embeddings) written over the token embeddings."""
        tokens = len(token_ids)
        if tokens > self.max_tokens or len(slices) > self.max_seqs:
            raise ValueError(f"mixed step of {tokens} tokens over {len(slices)} sequences exceeds the "
                             f"limits ({self.max_tokens}, {self.max_seqs})")
        tb = token_bucket(tokens, self.min_tokens)
        self._fill(token_ids, positions, slices, sample_rows, tb)
        self.embeds[:tb].copy_(self.model.embed(self._view("ids")[:tb]))
        self._splice(splices)
        if not self.use_graphs:
            return self._forward(tb)[:len(sample_rows)]
        if tb not in self.graphs:
            self.graphs[tb] = capture_graph(self.device, self.pool, lambda: self._forward(tb))
        graph, logits = self.graphs[tb]
        graph.replay()
        return logits[:len(sample_rows)]

    def _splice(self, splices: list[tuple[int, torch.Tensor]]) -> None:
        for row, count in self.side_rows:
            self.side[row:row + count].zero_()
        self.side_rows = []
        for row, rows in splices:
            main, levels = self.model.spec.split_rows(rows)
            self.embeds[row:row + rows.shape[0]].copy_(main)
            if levels is not None:
                self.side[row:row + rows.shape[0]].copy_(levels)
                self.side_rows.append((row, rows.shape[0]))

    def capture_all(self) -> int:
        """Capture every token bucket now, at start-up: a first capture (and
        the first Triton compiles) mid-serving would stall the whole batch.
        Returns the number of graphs."""
        if not self.use_graphs:
            return 0
        tb = self.min_tokens
        while tb <= self.max_tokens:
            if tb not in self.graphs:
                self._fill([], torch.zeros(self.axes, 0, dtype=torch.long), [], [], tb)   # padding only
                self.graphs[tb] = capture_graph(self.device, self.pool, lambda: self._forward(tb))
            tb = token_bucket(tb + 1, self.min_tokens)
        torch.cuda.synchronize(self.device)
        return len(self.graphs)

    def _fill(self, token_ids, positions: torch.Tensor, slices: list[SequenceSlice], sample_rows, tb: int) -> None:
        """Write one step's inputs into the pinned mirror and send them in
        one copy: the header, then the block tables at the step's width."""
        n, bs, null = len(token_ids), self.cache.block_size, self.null_block
        if self.copied is not None:
            self.copied.synchronize()
        host = self.staging.numpy()
        host[:self.header] = 0
        query = np.array([s.query_len for s in slices] + [tb - n], dtype=np.int64)   # + the padding sequence
        context = np.array([s.context_len for s in slices], dtype=np.int64)
        width = max([-(-(s.context_len + s.query_len) // bs) for s in slices], default=1)
        if len(slices) * width > self.max_seqs * self.max_blocks:
            raise ValueError(f"block tables of width {width} exceed the {self.max_blocks} blocks allowed")
        tables = host[self.header:self.header + len(slices) * width].reshape(len(slices), width)
        tables[:] = null
        for row, s in zip(tables, slices):
            used = s.block_table[:width]
            row[:len(used)] = used
        self._view("ids", host)[:n] = token_ids
        self._view("positions", host).reshape(self.axes, -1)[:, :n] = positions.cpu().numpy()
        slots = self._view("slots", host)
        slots[:tb] = null * bs + np.arange(tb) % bs
        if n:
            seq = np.repeat(np.arange(len(slices)), query[:-1])
            pos = context[seq] + np.arange(n) - np.repeat(np.cumsum(query[:-1]) - query[:-1], query[:-1])
            slots[:n] = tables[seq, pos // bs] * bs + pos % bs
        self._view("sample", host)[:len(sample_rows)] = sample_rows
        self._view("cu", host)[1:len(query) + 1] = np.cumsum(query)
        ctx = self._view("ctx", host)
        ctx[:len(slices)] = context
        ctx[len(slices)] = -1   # the padding sequence attends to nothing
        self._view("stride", host)[0] = width
        self.plan.plan_programs(query, self.per_program, self._programs(tb, host))
        end = self.header + len(slices) * width
        self.inputs[:end].copy_(self.staging[:end], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def _programs(self, tb: int, source: torch.Tensor | np.ndarray | None = None):
        count = self.plan.max_programs(tb, self.max_seqs, self.per_program)
        return self._view("programs", source)[:2 * count].reshape(count, 2)

    def _forward(self, tb: int) -> torch.Tensor:
        from pipeline.kernels.paged_backend import TritonMixedAttention  # triton only where it runs
        attn = TritonMixedAttention(self.cache, self._view("slots")[:tb], self.inputs[self.header:],
                                    self._view("stride"), self._view("cu"), self._view("ctx"), self._programs(tb))
        side = None if self.side is None else self.side[:tb]
        hidden = self.model(self.embeds[:tb], self._view("positions").view(self.axes, -1)[:, :tb], attn, side)
        return self.model.logits(hidden.index_select(0, self._view("sample")))
