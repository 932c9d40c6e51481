"""The Qwen3 language model of Qwen3-VL: per-head RMSNorm of queries and
keys before rotary, an explicit head_dim, interleaved M-RoPE, and DeepStack
(image features from inner vision blocks added to the hidden states at
image positions after each of the first L decoder layers).

Works on flat token streams like Qwen2.5-VL's: `forward(embeds [T, H],
positions [3, T], attn, deepstack [T, L, H] | None)`. Parameter names match
the checkpoint's (`model.language_model.*`, mapped to `model.*`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.attention import AttentionBackend
from pipeline.models.layers import LayerOps, RMSNorm, apply_rotary, fuse_linears
from pipeline.models.qwen2_5_vl.text import DecoderLayer
from pipeline.models.qwen3_vl.config import TextConfig
from pipeline.models.qwen3_vl.rotary import InterleavedRotary


class SelfAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def fuse(self) -> None:
        """One matmul for q, k and v (see layers.fuse_linears)."""
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x, cos, sin, attn: AttentionBackend):
        if self.qkv is not None:
            return self._forward_packed(x, cos, sin, attn, F.linear)
        n = x.shape[0]
        q = apply_rotary(self.q_norm(self.q_proj(x).view(n, self.heads, self.head_dim)), cos, sin)
        k = apply_rotary(self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        return self.o_proj(attn.attend(self.layer, q, k, v).reshape(n, -1))

    def forward_fused(self, x, cos, sin, attn: AttentionBackend, ops: LayerOps):
        """forward() with the projections through ops.linear; a model never
        fuse()d keeps its plain projections."""
        if self.qkv is None:
            return self.forward(x, cos, sin, attn)
        return self._forward_packed(x, cos, sin, attn, ops.linear)

    def _forward_packed(self, x, cos, sin, attn: AttentionBackend, linear):
        n, heads, kv_heads = x.shape[0], self.heads, self.kv_heads
        qkv = linear(x, *self.qkv).view(n, heads + 2 * kv_heads, self.head_dim)
        # The norms go before rotary, which the backend may fuse into its cache write.
        qkv[:, :heads] = self.q_norm(qkv[:, :heads])
        qkv[:, heads:heads + kv_heads] = self.k_norm(qkv[:, heads:heads + kv_heads])
        out = attn.attend_packed(self.layer, qkv, cos, sin, heads)
        return linear(out.reshape(n, -1), self.o_proj.weight, self.o_proj.bias)


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, SelfAttention(cfg, i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = InterleavedRotary(cfg)

    def fuse(self) -> None:
        """Merge projections that read the same input into single matmuls."""
        for layer in self.layers:
            layer.fuse()

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                deepstack: torch.Tensor | None = None) -> torch.Tensor:
        """deepstack [T, L, H]: level i is added after layer i (zeros at
        text positions: adding them is exact, and the shapes stay fixed for
        CUDA graphs). None: no image in this forward."""
        cos, sin = self.rotary(positions, embeds.dtype)
        levels = 0 if deepstack is None else deepstack.shape[1]
        ops = attn.layer_ops()
        if ops is not None:
            x, delta = embeds, None
            for i, layer in enumerate(self.layers):
                x, delta = layer.forward_fused(x, delta, cos, sin, attn, ops)
                if i < levels:
                    # The reference adds the level to the layer's output, so
                    # that sum is made here, not folded into the next norm.
                    x, delta = x + delta, deepstack[:, i]
            return ops.add_rms_norm(x, delta, self.norm)[1]
        x = embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attn)
            if i < levels:
                x = x + deepstack[:, i]
        return self.norm(x)
