"""The Qwen2 language model of Qwen2.5-VL with multimodal rotary (M-RoPE).

Works on flat token streams: `forward(embeds [T, H], positions [3, T], attn)`,
so the serving engine can pack prefill chunks and decodes of many requests
into one call and splice image embeddings before it. Parameter names match
the reference checkpoints (`model.*`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.attention import AttentionBackend
from pipeline.models.layers import GatedMLP, LayerOps, RMSNorm, apply_rotary, fuse_linears
from pipeline.models.qwen2_5_vl.config import TextConfig


class MultimodalRotary(nn.Module):
    """M-RoPE: each frequency band takes its angle from one of the three
    position axes (temporal, height, width), per `mrope_section`."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        self.register_buffer("axis_of_band", torch.tensor(self.band_axes()), persistent=False)

    def band_axes(self) -> list[int]:
        """The position axis of each of the head_dim/2 frequency bands: here
        contiguous runs (t bands, then h, then w); a family with another
        layout overrides this."""
        return [i % 3 for i, n in enumerate(self.cfg.mrope_section) for _ in range(n)]

    def _inv_freq(self) -> torch.Tensor:
        dim = self.cfg.head_dim
        return 1.0 / (self.cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))

    def reset_buffers(self) -> None:
        device = self.inv_freq.device
        self.inv_freq = self._inv_freq().to(device)
        self.axis_of_band = torch.tensor(self.band_axes(), device=device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions [3, T] -> cos, sin [T, head_dim] in `dtype`."""
        band_positions = positions.index_select(0, self.axis_of_band).T.float()  # [T, dim/2]
        freqs = band_positions * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class SelfAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.qkv: tuple[torch.Tensor, torch.Tensor] | None = None

    def fuse(self) -> None:
        """One matmul for q, k and v: the three weights move into one tensor
        and the projections become views of it (no extra memory)."""
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x, cos, sin, attn: AttentionBackend):
        if self.qkv is not None:
            return self._forward_packed(x, cos, sin, attn, None)
        n = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(n, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(n, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        return self.o_proj(attn.attend(self.layer, q, k, v).reshape(n, -1))

    def forward_fused(self, x, cos, sin, attn: AttentionBackend, ops: LayerOps):
        """forward() with both projections through ops.linear; a model
        never fuse()d keeps its plain projections."""
        if self.qkv is None:
            return self.forward(x, cos, sin, attn)
        return self._forward_packed(x, cos, sin, attn, ops)

    def _forward_packed(self, x, cos, sin, attn: AttentionBackend, ops: LayerOps | None):
        out = attn.attend_projected(self.layer, x, *self.qkv, cos, sin, self.heads, ops)
        linear = ops.linear if ops is not None else F.linear
        return linear(out.reshape(x.shape[0], -1), self.o_proj.weight, self.o_proj.bias)


class DecoderLayer(nn.Module):
    """`attention`: the layer's self-attention, Qwen2's SelfAttention if not
    given (another family passes its own; it needs fuse, forward and
    forward_fused with SelfAttention's signatures)."""

    def __init__(self, cfg: TextConfig, layer: int, attention: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention if attention is not None else SelfAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=False)

    def fuse(self) -> None:
        self.self_attn.fuse()
        self.mlp.fuse()

    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, delta, cos, sin, attn, ops: LayerOps):
        """forward() with each residual add fused into the norm after it: takes
        and returns (residual stream, the last sub-block's output not yet
        added), so the next layer's first norm does that add."""
        x, h = ops.add_rms_norm(x, delta, self.input_layernorm)
        x, h = ops.add_rms_norm(x, self.self_attn.forward_fused(h, cos, sin, attn, ops), self.post_attention_layernorm)
        return x, self.mlp.forward_fused(h, ops)


class TextModel(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = MultimodalRotary(cfg)

    def fuse(self) -> None:
        """Merge projections that read the same input into single matmuls
        (fewer, larger kernels: what decode speed on a GPU needs)."""
        for layer in self.layers:
            layer.fuse()

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        cos, sin = self.rotary(positions, embeds.dtype)  # once per forward, shared by all layers
        ops = attn.layer_ops()
        if ops is not None:
            x, delta = embeds, None
            for layer in self.layers:
                x, delta = layer.forward_fused(x, delta, cos, sin, attn, ops)
            return ops.add_rms_norm(x, delta, self.norm)[1]
        x = embeds
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)
