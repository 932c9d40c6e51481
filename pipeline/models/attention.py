"""Attention backends: where keys and values live and how a layer attends.

A language model's layers call `backend.attend(layer, q, k, v)` and never see
the cache layout, so the same model code runs over the contiguous cache of
offline generation here and over the serving engine's paged cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F


class AttentionBackend(ABC):
    """Stores the keys/values of the tokens in this forward and attends.

    q: [tokens, q_heads, head_dim]; k, v: [tokens, kv_heads, head_dim], in the
    order the forward was given. Returns [tokens, q_heads, head_dim]. The
    backend owns its cache memory; the model owns nothing between steps.
    """

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ...


class ContiguousKVCache(AttentionBackend):
    """One sequence's keys and values in preallocated contiguous tensors.

    For offline generation and tests. The caller runs one forward over the
    next `n` tokens, then calls `commit(n)` to make them part of the context.
    """

    def __init__(self, num_layers: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_layers, capacity, kv_heads, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    def attend(self, layer, q, k, v):
        n = q.shape[0]
        end = self.length + n
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} tokens, {end} requested")
        self.keys[layer, self.length:end] = k
        self.values[layer, self.length:end] = v
        # [1, heads, tokens, dim]: the 4-D layout selects the same SDPA kernels
        # as the reference, whose float32 rounding the tests compare against.
        keys = self.keys[layer, :end].transpose(0, 1)[None]
        values = self.values[layer, :end].transpose(0, 1)[None]
        mask, causal = None, False
        if n > 1 and self.length == 0:
            causal = True  # no prefix: the built-in causal path (fused kernels, no mask)
        elif n > 1:
            # Query i sits at absolute position length+i and sees keys <= it.
            rows = torch.arange(n, device=q.device)[:, None] + self.length
            mask = torch.arange(end, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys, values, attn_mask=mask, is_causal=causal,
            scale=q.shape[-1] ** -0.5, enable_gqa=keys.shape[1] != q.shape[1])
        return out[0].transpose(0, 1)

    def commit(self, n: int) -> None:
        self.length += n
