"""Attention backends: where keys and values live and how a layer attends.

A language model's layers call `backend.attend(layer, q, k, v)` and never see
the cache layout, so the same model code runs over the contiguous cache of
offline generation here and over the serving engine's paged cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from pipeline.models.layers import LayerOps, apply_rotary


class AttentionBackend(ABC):
    """Stores the keys/values of the tokens in this forward and attends.

    q: [tokens, q_heads, head_dim]; k, v: [tokens, kv_heads, head_dim], in the
    order the forward was given. Returns [tokens, q_heads, head_dim]. The
    backend owns its cache memory; the model owns nothing between steps.
    """

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ...

    def attend_packed(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      heads: int) -> torch.Tensor:
        """Rotary, then attend, from one fused projection's output: qkv is
        [tokens, heads + 2 * kv_heads, head_dim] (q, k, v heads in that order,
        before rotary); cos/sin [tokens, head_dim]. A backend may fuse the
        rotary into its cache write; this default runs the plain ops."""
        kv_heads = (qkv.shape[1] - heads) // 2
        qk = apply_rotary(qkv[:, :heads + kv_heads], cos, sin)  # q and k in one pass
        return self.attend(layer, qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:])

    def attend_projected(self, layer: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         cos: torch.Tensor, sin: torch.Tensor, heads: int, ops: LayerOps | None) -> torch.Tensor:
        """attend_packed of the fused q/k/v projection of x [tokens, hidden]
        (weight: q, k then v rows), projected by ops.linear (F.linear without
        ops); head_dim is cos's width. A backend may fuse the projection
        with its rotary and cache write where ops are given; this default
        runs them in turn."""
        qkv = (ops.linear if ops is not None else F.linear)(x, weight, bias)
        return self.attend_packed(layer, qkv.view(x.shape[0], -1, cos.shape[-1]), cos, sin, heads)

    def layer_ops(self) -> LayerOps | None:
        """Fused norm/activation kernels the model should use in this forward,
        or None for its plain PyTorch ops. A forward's backend is its one
        context object, so the fast path's choice rides here."""
        return None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int) -> torch.Tensor:
    """Queries [1, heads, n, dim] at positions context_len.. attend to keys
    [1, kv_heads, context_len + n, dim] causally.

    The 4-D layout and the fused causal path for a prefill from zero select
    the same SDPA kernels as the reference implementation, whose float32
    rounding the equality tests compare against."""
    n, total = q.shape[2], k.shape[2]
    mask, causal = None, False
    if n > 1 and context_len == 0:
        causal = True
    elif n > 1:
        rows = torch.arange(n, device=q.device)[:, None] + context_len
        mask = torch.arange(total, device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          scale=q.shape[-1] ** -0.5, enable_gqa=k.shape[1] != q.shape[1])


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
        keys = self.keys[layer, :end].transpose(0, 1)[None]
        values = self.values[layer, :end].transpose(0, 1)[None]
        out = causal_attention(q.transpose(0, 1)[None], keys, values, self.length)
        return out[0].transpose(0, 1)

    def commit(self, n: int) -> None:
        self.length += n
