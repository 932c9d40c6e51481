"""The Qwen2.5-VL vision tower: patch embed, 2-D rotary, window and full
attention blocks, patch merger.

`forward` takes a packed batch of images of different sizes (no padding) and
returns one embedding tensor per image, `[tokens_i, out_hidden_size]`.
Parameter names match the reference checkpoints (`visual.*`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.layers import GatedMLP, RMSNorm, varlen_attention
from pipeline.models.qwen2_5_vl.config import VisionConfig
from pipeline.models.qwen2_5_vl.vision_layout import Grid, batch_layout

_NORM_EPS = 1e-6  # fixed in the reference vision tower, not read from config


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, self.kernel, stride=self.kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        pixels = pixels.to(weight.dtype)
        if pixels.is_cuda:
            # The kernel equals the stride and patches arrive flattened, so the
            # convolution is one matmul; on GPUs that is much faster than conv3d.
            return F.linear(pixels, weight.reshape(weight.shape[0], -1))
        # Elsewhere keep the reference's own op: its float32 rounding then
        # matches bit for bit, which the CPU equality tests rely on.
        return self.proj(pixels.view(-1, weight.shape[1], *self.kernel)).view(pixels.shape[0], -1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seqlens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate_float(q, cos, sin), _rotate_float(k, cos, sin)
        out = varlen_attention(q, k, v, seqlens, scale=self.head_dim ** -0.5)
        return self.proj(out.reshape(n, -1))


def _rotate_float(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # The reference applies the vision rotary in float32 whatever the dtype.
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, _NORM_EPS)
        self.norm2 = RMSNorm(cfg.hidden_size, _NORM_EPS)
        self.attn = VisionAttention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=True)

    def forward(self, x, cos, sin, seqlens):
        x = x + self.attn(self.norm1(x), cos, sin, seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.unit_dim = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size, _NORM_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(self.unit_dim, self.unit_dim),
            nn.GELU(),
            nn.Linear(self.unit_dim, cfg.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.unit_dim))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        self.unit = cfg.spatial_merge_size ** 2
        self.window_units = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        self.full_attention = frozenset(cfg.fullatt_block_indexes)
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        dim = self.cfg.head_dim // 2
        return 1.0 / (self.cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))

    def reset_buffers(self) -> None:
        """Recompute non-checkpoint buffers after materialising from meta."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    @property
    def out_dim(self) -> int:
        return self.cfg.out_hidden_size

    def tokens_per_image(self, grid: Grid) -> int:
        t, h, w = grid
        return t * h * w // self.unit

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> list[torch.Tensor]:
        layout = batch_layout(grids, self.cfg.spatial_merge_size, self.window_units, pixel_values.device)
        x = self._to_window_order(self.patch_embed(pixel_values), layout.window_index)
        cos, sin = self._rotary(layout.positions, layout.window_index)
        for i, block in enumerate(self.blocks):
            seqlens = layout.frame_seqlens if i in self.full_attention else layout.window_seqlens
            x = block(x, cos, sin, seqlens)
        merged = self.merger(x).index_select(0, layout.reverse_index)
        return list(merged.split(layout.units_per_image))

    def _to_window_order(self, x: torch.Tensor, window_index: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return x.view(n // self.unit, self.unit, -1).index_select(0, window_index).view(n, -1)

    def _rotary(self, positions: torch.Tensor, window_index: torch.Tensor):
        freqs = positions[..., None].float() * self.inv_freq  # [patches, 2, dim/4]
        freqs = freqs.flatten(1)                              # rows then cols
        freqs = self._to_window_order(freqs, window_index)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()
