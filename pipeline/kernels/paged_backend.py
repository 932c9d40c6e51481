"""The fast attention backends on the Triton kernels: for decode steps the
counterpart of GatherDecodeAttention (same inputs, one query per row), for
mixed steps the unified kernel over many sequences; each also carries the
fused norm/activation ops for the rest of the decoder layer.

Per layer it runs two kernels where the gather backend ran about a dozen:
rotary + K/V cache write, then paged attention reading K/V in place.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pipeline.kernels import gemv_rotary
from pipeline.kernels.decode_attention import paged_decode_attention, plan_splits
from pipeline.kernels.ops import TritonLayerOps
from pipeline.kernels.rotary_kv import rotary_kv_write
from pipeline.kernels.unified_attention import unified_attention
from pipeline.models.attention import AttentionBackend
from pipeline.models.layers import LayerOps


class PagedKVSlots(Protocol):
    """What the kernels read of a paged KV cache (the engine's PagedKVCache):
    keys of shape [layers, blocks, block_size, kv_heads, head_dim], and one
    layer's keys and values as [slots, kv_heads, head_dim] views."""

    keys: torch.Tensor
    block_size: int

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class TritonDecodeAttention(AttentionBackend):
    """Row i attends to keys 0..lengths[i]-1 of its block table; its new K/V
    goes to slot_mapping[i]. Padding rows point at the null block.
    `use_gemv`: see TritonLayerOps."""

    def __init__(self, cache: PagedKVSlots, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 lengths: torch.Tensor, max_len: int, num_sms: int, use_gemv: bool = False) -> None:
        self.cache = cache
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables
        self.lengths = lengths
        kv_heads = cache.keys.shape[3]
        # Fixed per (batch, max_len) bucket, so a captured graph's grid fits every replay.
        self.num_splits, self.split_len = plan_splits(block_tables.shape[0], kv_heads, max_len, num_sms)
        self.ops = TritonLayerOps(use_gemv)

    def attend(self, layer, q, k, v):
        k_slots, v_slots = self.cache.layer_slots(layer)
        k_slots.index_copy_(0, self.slot_mapping, k)
        v_slots.index_copy_(0, self.slot_mapping, v)
        return self._attention(q.contiguous(), k_slots, v_slots)

    def attend_packed(self, layer, qkv, cos, sin, heads):
        k_slots, v_slots = self.cache.layer_slots(layer)
        q = rotary_kv_write(qkv, cos, sin, heads, k_slots, v_slots, self.slot_mapping)
        return self._attention(q, k_slots, v_slots)

    def attend_projected(self, layer, x, weight, bias, cos, sin, heads, ops):
        # Where gemv runs the projection, its epilogue does the rotary and
        # cache write: one kernel a layer fewer.
        if ops is None or not self.ops.gemv_for(x, weight) or not gemv_rotary.fits(x.shape[0], weight):
            return super().attend_projected(layer, x, weight, bias, cos, sin, heads, ops)
        k_slots, v_slots = self.cache.layer_slots(layer)
        q = gemv_rotary.gemv_rotary_kv(x, weight, bias, cos, sin, heads, k_slots, v_slots, self.slot_mapping)
        return self._attention(q, k_slots, v_slots)

    def layer_ops(self) -> LayerOps:
        return self.ops

    def _attention(self, q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor) -> torch.Tensor:
        return paged_decode_attention(q, k_slots, v_slots, self.block_tables, self.lengths,
                                      self.cache.block_size, self.num_splits, self.split_len)


class TritonMixedAttention(AttentionBackend):
    """A mixed step's tokens (prefill chunks and decodes of many sequences,
    laid end to end) through the unified kernel: new K/V to slot_mapping,
    then causal paged attention per sequence. Every input is a device
    tensor of fixed size per token bucket (see MixedGraphs), so the launches
    are capturable."""

    def __init__(self, cache: PagedKVSlots, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 table_stride: torch.Tensor, cu_seqlens: torch.Tensor, context_lens: torch.Tensor,
                 programs: torch.Tensor) -> None:
        self.cache = cache
        self.slot_mapping = slot_mapping
        self.inputs = (block_tables, table_stride, cu_seqlens, context_lens, programs)
        self.ops = TritonLayerOps()

    def attend(self, layer, q, k, v):
        k_slots, v_slots = self.cache.layer_slots(layer)
        k_slots.index_copy_(0, self.slot_mapping, k)
        v_slots.index_copy_(0, self.slot_mapping, v)
        return unified_attention(q.contiguous(), k_slots, v_slots, *self.inputs, self.cache.block_size)

    def attend_packed(self, layer, qkv, cos, sin, heads):
        k_slots, v_slots = self.cache.layer_slots(layer)
        q = rotary_kv_write(qkv, cos, sin, heads, k_slots, v_slots, self.slot_mapping)
        return unified_attention(q, k_slots, v_slots, *self.inputs, self.cache.block_size)

    def layer_ops(self) -> LayerOps:
        return self.ops
