"""The Qwen2.5-VL vision tower: patch embed, 2-D rotary, window and full
attention blocks, patch merger.

`forward` takes a packed batch of images of different sizes (no padding) and
returns one embedding tensor per image, `[tokens_i, out_hidden_size]`.
Parameter names match the reference checkpoints (`visual.*`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.layers import GatedMLP, LayerOps, RMSNorm, rotate_float
from pipeline.models.qwen2_5_vl.config import VisionConfig
from pipeline.models.qwen2_5_vl.vision_layout import Grid, batch_layout
from pipeline.models.segments import SegmentPlan, plan_segments, segment_attention

_NORM_EPS = 1e-6  # fixed in the reference vision tower, not read from config
# fuse() pads the MLP's hidden width to a multiple of this (see GatedMLP.fuse).
_MLP_PAD = 64


class PatchEmbed(nn.Module):
    """`bias`: Qwen2.5-VL's projection has none, Qwen3-VL's has one."""

    def __init__(self, cfg: VisionConfig, bias: bool = False) -> None:
        super().__init__()
        self.kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, self.kernel, stride=self.kernel, bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        pixels = pixels.to(weight.dtype)
        if pixels.is_cuda:
            # The kernel equals the stride and patches arrive flattened, so the
            # convolution is one matmul; on GPUs that is much faster than conv3d.
            return F.linear(pixels, weight.reshape(weight.shape[0], -1), self.proj.bias)
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
                segments: SegmentPlan) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.num_heads, self.head_dim)
        qkv[:, :2] = rotate_float(qkv[:, :2], cos, sin)   # q and k in one pass
        out = segment_attention(qkv, segments, scale=self.head_dim ** -0.5)
        return self.proj(out.reshape(n, -1))

    def forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      segments: SegmentPlan, ops: LayerOps) -> torch.Tensor:
        n = x.shape[0]
        qkv = ops.rotate_qk_(self.qkv(x).view(n, 3, self.num_heads, self.head_dim), cos, sin)
        out = segment_attention(qkv, segments, scale=self.head_dim ** -0.5)
        return self.proj(out.reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, _NORM_EPS)
        self.norm2 = RMSNorm(cfg.hidden_size, _NORM_EPS)
        self.attn = VisionAttention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=True)

    def forward(self, x, cos, sin, segments: SegmentPlan):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))

    def forward_fused(self, x, delta, cos, sin, segments: SegmentPlan, ops: LayerOps):
        """forward() on fused kernels, each residual add folded into the norm
        after it: takes and returns (residual stream, the last sub-block's
        output not yet added), as the decoder layers do."""
        x, h = ops.add_rms_norm(x, delta, self.norm1)
        x, h = ops.add_rms_norm(x, self.attn.forward_fused(h, cos, sin, segments, ops), self.norm2)
        return x, self.mlp.forward_fused(h, ops)


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

    def forward_fused(self, x: torch.Tensor, delta: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.mlp(ops.add_rms_norm(x, delta, self.ln_q)[1].view(-1, self.unit_dim))


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
        self.ops: LayerOps | None = None   # set by fuse()

    def fuse(self, ops: LayerOps) -> None:
        """Run forwards on `ops`' fused kernels (pipeline.kernels.ops on a
        GPU): float32 rotary in place, residual adds folded into the norms,
        gate and up as one matmul over a zero-padded aligned width."""
        for block in self.blocks:
            block.mlp.fuse(pad_to=_MLP_PAD)
        self.ops = ops

    def _inv_freq(self) -> torch.Tensor:
        dim = self.cfg.head_dim // 2
        return 1.0 / (self.cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))

    def reset_buffers(self) -> None:
        """Recompute non-checkpoint buffers after materialising from meta."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    @property
    def out_dim(self) -> int:
        return self.cfg.out_hidden_size

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its inputs are cast to."""
        return self.patch_embed.proj.weight.dtype

    def tokens_per_image(self, grid: Grid) -> int:
        t, h, w = grid
        return t * h * w // self.unit

    def plan(self, grids: list[Grid], device: torch.device) -> TowerPlan:
        """Everything a forward needs that depends only on the grids: the
        host-to-device copies and the rotary tables. A forward over a plan is
        device work only (what a CUDA graph capture needs)."""
        layout = batch_layout(grids, self.cfg.spatial_merge_size, self.window_units, device)
        cos, sin = self._rotary(layout.positions, layout.window_index)
        return TowerPlan(layout.window_index, layout.reverse_index, cos, sin,
                         plan_segments(layout.frame_seqlens, device, layout.frame_rows),
                         plan_segments(layout.window_seqlens, device),
                         tuple(layout.units_per_image))

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> list[torch.Tensor]:
        plan = self.plan(grids, pixel_values.device)
        return list(self.embed_planned(pixel_values, plan).split(plan.units_per_image))

    def embed_planned(self, pixel_values: torch.Tensor, plan: TowerPlan) -> torch.Tensor:
        """[units of all images, out width], images in order."""
        x = self._to_window_order(self.patch_embed(pixel_values), plan.window_index)
        segments = [plan.frames if i in self.full_attention else plan.windows for i in range(len(self.blocks))]
        if self.ops is not None:
            delta = None
            for block, seg in zip(self.blocks, segments):
                x, delta = block.forward_fused(x, delta, plan.cos, plan.sin, seg, self.ops)
            return self.merger.forward_fused(x, delta, self.ops).index_select(0, plan.reverse_index)
        for block, seg in zip(self.blocks, segments):
            x = block(x, plan.cos, plan.sin, seg)
        return self.merger(x).index_select(0, plan.reverse_index)

    def _to_window_order(self, x: torch.Tensor, window_index: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return x.view(n // self.unit, self.unit, -1).index_select(0, window_index).view(n, -1)

    def _rotary(self, positions: torch.Tensor, window_index: torch.Tensor):
        freqs = positions[..., None].float() * self.inv_freq  # [patches, 2, dim/4]
        freqs = freqs.flatten(1)                              # rows then cols
        freqs = self._to_window_order(freqs, window_index)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


@dataclass(frozen=True)
class TowerPlan:
    """The grid-dependent inputs of one forward over a packed batch, on the device."""

    window_index: torch.Tensor    # [units] unit order for window attention
    reverse_index: torch.Tensor   # [units] undoes it after the merger
    cos: torch.Tensor             # [patches, head_dim] float32, window order
    sin: torch.Tensor
    frames: SegmentPlan           # full-attention blocks: one segment per frame
    windows: SegmentPlan          # window blocks
    units_per_image: tuple[int, ...]
