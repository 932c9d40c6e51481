"""Paged KV cache and the reference attention backend over it.

The cache is one tensor per K and V: [layers, blocks, block_size, kv_heads,
head_dim]. A request owns a list of blocks (its block table); token i of a
request lives in slot (table[i // block_size], i % block_size).

The reference backend is plain PyTorch, runs anywhere (what CI runs), and
attends one sequence at a time with the same SDPA calls as the offline
contiguous cache, so both give the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.models.attention import AttentionBackend, causal_attention


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [slots, kv_heads, head_dim] views."""
        k, v = self.keys[layer], self.values[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])


@dataclass(frozen=True)
class SequenceSlice:
    """One request's part of a step: `query_len` tokens starting at flat
    position `offset` of the batch, preceded by `context_len` cached tokens."""

    offset: int
    query_len: int
    context_len: int
    block_table: Sequence[int]     # the request's BlockTable.view(): an int64 array


@dataclass(frozen=True)
class StepLayout:
    sequences: tuple[SequenceSlice, ...]
    slot_mapping: torch.Tensor       # [tokens] where each new token's K/V goes
    context_slots: tuple[torch.Tensor, ...]  # per sequence: slots of all its keys this step

    @classmethod
    def build(cls, sequences: list[SequenceSlice], block_size: int, device: torch.device) -> StepLayout:
        new_slots, all_slots = [], []
        for seq in sequences:
            table = torch.tensor(seq.block_table, dtype=torch.long)
            positions = torch.arange(seq.context_len + seq.query_len)
            slots = table[positions // block_size] * block_size + positions % block_size
            all_slots.append(slots.to(device))
            new_slots.append(slots[seq.context_len:])
        mapping = torch.cat(new_slots).to(device) if new_slots else torch.empty(0, dtype=torch.long)
        return cls(tuple(sequences), mapping, tuple(all_slots))


class ReferencePagedAttention(AttentionBackend):
    """Writes this step's K/V into the paged cache, then attends per sequence."""

    def __init__(self, cache: PagedKVCache, layout: StepLayout) -> None:
        self.cache = cache
        self.layout = layout

    def attend(self, layer, q, k, v):
        k_slots, v_slots = self.cache.layer_slots(layer)
        k_slots.index_copy_(0, self.layout.slot_mapping, k)
        v_slots.index_copy_(0, self.layout.slot_mapping, v)
        out = torch.empty_like(q)
        for seq, slots in zip(self.layout.sequences, self.layout.context_slots):
            keys = k_slots.index_select(0, slots).transpose(0, 1)[None]
            values = v_slots.index_select(0, slots).transpose(0, 1)[None]
            query = q[seq.offset:seq.offset + seq.query_len].transpose(0, 1)[None]
            out[seq.offset:seq.offset + seq.query_len] = causal_attention(
                query, keys, values, seq.context_len)[0].transpose(0, 1)
        return out
