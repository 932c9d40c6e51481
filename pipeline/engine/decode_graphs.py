"""Fast pure-decode steps: static-shaped inputs, one batched attention call
per layer, and (on CUDA) the whole forward captured once per shape bucket as
a CUDA graph and replayed.

A decode step has one query per request. Its keys are gathered from the
paged cache through the block tables into a padded [batch, L] layout and
masked by length, so every shape depends only on the (batch, L) bucket, not
on the requests: the forward is capturable. Padding rows read and write a
null block that no request owns (the cache has one block more than the
scheduler hands out).

Where Triton runs (CUDA), the forward instead uses the fused kernels of
pipeline.kernels: rotary + cache write and paged attention that reads K/V in
place (plus a small merge of its split-K partials), fused residual-add +
RMSNorm and SiLU * up: six small kernels per layer beside the four matmuls,
instead of about twenty. The matmuls run on cuBLAS, or with matmul="triton"
on the small-M Triton matmul (pipeline/kernels/gemv.py) in the buckets of
few rows, where the SiLU and (for a model whose attention asks the backend
to project q/k/v, attend_projected) the rotary + cache write run in the
gemvs' epilogues instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline import kernels
from pipeline.cuda_graphs import capture_graph
from pipeline.engine.paged_attention import PagedKVCache
from pipeline.models.attention import AttentionBackend

MATMULS = ("cublas", "triton")   # what a fused decode step's projections run on
MIN_LEN = 256   # the shortest context bucket
# Decode buckets up to this many rows launch the fused kernels with PDL
# where the engine allows it (kernels/dependent_launch.py): on an H200,
# batch 1 replayed 9% faster, batch 32 0.6% slower. 8 is where gemv stops
# serving any projection, so past it the step's kernels are longer.
DEPENDENT_LAUNCH_MAX_BATCH = 8


def _bucket(n: int, minimum: int) -> int:
    size = minimum
    while size < n:
        size *= 2
    return size


class GatherDecodeAttention(AttentionBackend):
    """One query per row; keys gathered by block table, masked by length."""

    def __init__(self, cache: PagedKVCache, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 lengths: torch.Tensor, max_len: int) -> None:
        bs = cache.block_size
        positions = torch.arange(max_len, device=block_tables.device)
        blocks = block_tables.gather(1, (positions // bs).expand(block_tables.shape[0], -1))
        self.gather = (blocks * bs + positions % bs).reshape(-1)   # [batch * max_len]
        self.mask = (positions[None, :] < lengths[:, None])[:, None, None, :]
        self.cache = cache
        self.slot_mapping = slot_mapping
        self.shape = (block_tables.shape[0], max_len)

    def attend(self, layer, q, k, v):
        k_slots, v_slots = self.cache.layer_slots(layer)
        k_slots.index_copy_(0, self.slot_mapping, k)
        v_slots.index_copy_(0, self.slot_mapping, v)
        batch, length = self.shape
        keys = k_slots.index_select(0, self.gather).view(batch, length, *k.shape[1:]).transpose(1, 2)
        values = v_slots.index_select(0, self.gather).view(batch, length, *v.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=self.mask,
                                             scale=q.shape[-1] ** -0.5, enable_gqa=keys.shape[1] != q.shape[1])
        return out[:, :, 0, :]


class DecodeGraphs:
    """Runs pure-decode batches through static buffers; on CUDA each
    (batch, length) bucket is captured on first use and replayed after.

    `fused`: run the Triton kernels; None picks them on CUDA when Triton is
    installed. True elsewhere needs TRITON_INTERPRET=1 (tests on the CPU).
    `matmul`: one of MATMULS; "triton" sends the projections of small
    buckets to gemv where it beats cuBLAS (pipeline/kernels/gemv.py,
    beats_cublas), the rest stay on cuBLAS. It is part of the fused path, so
    it turns that on. None: "triton" wherever the fused path runs on CUDA."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, null_block: int, max_batch: int,
                 max_len: int, device: torch.device, use_graphs: bool, min_len: int = MIN_LEN,
                 fused: bool | None = None, matmul: str | None = None) -> None:
        if matmul is None:
            cuda_kernels = device.type == "cuda" and kernels.available(device)
            matmul = "triton" if fused is not False and cuda_kernels else "cublas"
        if matmul not in MATMULS:
            raise ValueError(f"decode matmul {matmul!r}: want one of {MATMULS}")
        if matmul == "triton" and fused is False:
            raise ValueError("decode matmul 'triton' runs on the fused path; fused=False excludes it")
        self.matmul = matmul
        if fused is None:
            fused = matmul == "triton" or (device.type == "cuda" and kernels.available(device))
        if fused and not kernels.available(device):
            raise ValueError(f"fused decode kernels need triton and a CUDA device (or TRITON_INTERPRET=1), "
                             f"not {device}")
        self.fused = fused
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self.model = model
        self.cache = cache
        self.null_block = null_block
        self.device = device
        self.use_graphs = use_graphs and device.type == "cuda"
        self.min_len = min_len
        self.max_batch = _bucket(max_batch, 1)
        self.max_len = _bucket(max_len, min_len)
        max_blocks = -(-self.max_len // cache.block_size)
        # Every per-step input lives in one device buffer, filled from one
        # pinned host mirror by one copy: one transfer per step, not five.
        mb, axes = self.max_batch, model.spec.position_axes
        self.axes = axes
        self.header = (3 + axes) * mb   # token ids, a row per position axis, slots, lengths
        size = self.header + mb * max_blocks
        self.inputs = torch.zeros(size, dtype=torch.long, device=device)
        self.staging = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        self.token_ids = self.inputs[0:mb]
        self.positions = self.inputs[mb:(1 + axes) * mb].view(axes, mb)
        self.slot_mapping = self.inputs[(1 + axes) * mb:(2 + axes) * mb]
        self.lengths = self.inputs[(2 + axes) * mb:(3 + axes) * mb]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.last_bucket: tuple[int, int] | None = None   # the (batch, length) bucket of the last step
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._copied: torch.cuda.Event | None = None   # recorded after the last copy out of `staging`

    def run(self, token_ids: list[int], positions: torch.Tensor, block_tables: list[list[int]],
            context_lens: list[int], device_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, vocab] of one decode token per request; the token
        of row i sits at index context_lens[i] of its sequence.
        `device_tokens` [batch], on the device: the rows' input tokens as the
        last step sampled them, not read back yet (token_ids then holds
        placeholders)."""
        batch = len(token_ids)
        if batch > self.max_batch or max(context_lens) + 1 > self.max_len:
            raise ValueError("decode batch exceeds the captured limits")
        bb, lb = _bucket(batch, 1), _bucket(max(context_lens) + 1, self.min_len)
        self.last_bucket = (bb, lb)
        self._fill(token_ids, positions, block_tables, context_lens, bb, lb)
        if device_tokens is not None:
            self.token_ids[:batch].copy_(device_tokens)
        if not self.use_graphs:
            return self._forward(bb, lb)[:batch]
        if (bb, lb) not in self.graphs:
            self.graphs[(bb, lb)] = self._capture(bb, lb)
        graph, logits = self.graphs[(bb, lb)]
        graph.replay()
        return logits[:batch]

    def capture_up_to(self, max_len: int) -> int:
        """Capture every (batch, length) bucket up to `max_len` now, at start
        up: a first capture (and a first Triton compile) costs up to seconds,
        which mid-serving would stall every request in the batch. Returns the
        number of graphs captured."""
        if not self.use_graphs:
            return 0
        lengths, batches = [], []
        length = self.min_len
        while length <= min(max_len, self.max_len):
            lengths.append(length)
            length *= 2
        batch = 1
        while batch <= self.max_batch:
            batches.append(batch)
            batch *= 2
        for bb in batches:
            for lb in lengths:
                if (bb, lb) not in self.graphs:
                    # Padding rows only: every row reads and writes the null block.
                    self._fill([], torch.zeros(self.axes, 0, dtype=torch.long), [], [], bb, lb)
                    self.graphs[(bb, lb)] = self._capture(bb, lb)
        torch.cuda.synchronize(self.device)
        return len(self.graphs)

    def _fill(self, token_ids, positions, block_tables, context_lens, bb: int, lb: int) -> None:
        """Write one step's inputs into the pinned mirror, then copy them in
        one transfer. Of the block tables only the [bb, cols] a length-`lb`
        bucket reads are sent (the full width would be megabytes a step);
        they sit contiguously after the header, as that bucket's graph views
        them. Rows past the batch are padding: they point at the null block."""
        if self._copied is not None:
            # The last step's copy out of the mirror must be done before it is
            # written again: with the engine's decode ahead, nothing else has
            # waited for that step yet.
            self._copied.synchronize()
        n, mb, bs, null = len(token_ids), self.max_batch, self.cache.block_size, self.null_block
        cols = -(-lb // bs)
        host = self.staging.numpy()
        host[:self.header] = 0
        host[0:n] = token_ids
        host[mb:(1 + self.axes) * mb].reshape(self.axes, mb)[:, :n] = positions.cpu().numpy()
        slots, lengths = (1 + self.axes) * mb, (2 + self.axes) * mb
        host[slots:slots + bb] = null * bs
        host[slots:slots + n] = [t[c // bs] * bs + c % bs for t, c in zip(block_tables, context_lens)]
        host[lengths:lengths + bb] = 1
        host[lengths:lengths + n] = [c + 1 for c in context_lens]
        tables = host[self.header:self.header + bb * cols].reshape(bb, cols)
        tables[:] = null
        for row, table in zip(tables, block_tables):
            used = table[:cols]
            row[:len(used)] = used
        end = self.header + bb * cols
        self.inputs[:end].copy_(self.staging[:end], non_blocking=True)
        if self.inputs.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _tables(self, bb: int, lb: int) -> torch.Tensor:
        cols = -(-lb // self.cache.block_size)
        return self.inputs[self.header:self.header + bb * cols].view(bb, cols)

    def _forward(self, bb: int, lb: int) -> torch.Tensor:
        if not self.fused:
            attn = GatherDecodeAttention(self.cache, self.slot_mapping[:bb], self._tables(bb, lb),
                                         self.lengths[:bb], lb)
            return self._logits(bb, attn)
        # triton only where it runs
        from pipeline.kernels.dependent_launch import launching
        from pipeline.kernels.paged_backend import TritonDecodeAttention
        attn = TritonDecodeAttention(self.cache, self.slot_mapping[:bb], self._tables(bb, lb),
                                     self.lengths[:bb], lb, self.num_sms, self.matmul == "triton")
        with launching(bb <= DEPENDENT_LAUNCH_MAX_BATCH):
            return self._logits(bb, attn)

    def _logits(self, bb: int, attn) -> torch.Tensor:
        hidden = self.model(self.model.embed(self.token_ids[:bb]), self.positions[:, :bb], attn)
        return self.model.logits(hidden)

    def _capture(self, bb: int, lb: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        return capture_graph(self.device, self.pool, lambda: self._forward(bb, lb))
