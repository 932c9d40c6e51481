"""The Qwen3-VL vision tower: patch embed plus learned positions resampled
to each image, 2-D rotary, full-attention blocks (attention stays inside
each image's frame; no windows), the patch merger, and the DeepStack
mergers that read the hidden states after chosen blocks.

`forward` takes a packed batch of images of different sizes (no padding)
and returns one tensor per image, `[tokens_i, (1 + L) * out_hidden_size]`:
the merger's output, then DeepStack level 0, 1, ... L-1 side by side (L =
len(deepstack_visual_indexes)); Qwen3VL.split_features takes them apart.
One tensor per image keeps the encoder's transport and cache unchanged.
Parameter names match the checkpoint's (`model.visual.*`, mapped to
`visual.*` by the family).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.layers import LayerOps
from pipeline.models.qwen2_5_vl.vision import PatchEmbed, VisionAttention
from pipeline.models.qwen3_vl.config import VisionConfig
from pipeline.models.qwen3_vl.vision_layout import Grid, batch_layout
from pipeline.models.segments import SegmentPlan, plan_segments

_NORM_EPS = 1e-6  # fixed in the reference vision tower, not read from config


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=_NORM_EPS)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=_NORM_EPS)
        self.attn = VisionAttention(cfg)   # Qwen2.5-VL's: the same qkv, rotary and projection
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cos, sin, frames: SegmentPlan, ops: LayerOps | None = None):
        h = self.norm1(x)
        if ops is None:
            x = x + self.attn(h, cos, sin, frames)
        else:
            x = x + self.attn.forward_fused(h, cos, sin, frames, ops)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge**2 neighbouring patches -> one token of the language model's
    width. The main merger normalises each patch before concatenating
    them; the DeepStack mergers normalise the concatenation
    (`postshuffle`)."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.unit_dim = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.unit_dim if postshuffle else cfg.hidden_size, eps=_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.unit_dim, self.unit_dim)
        self.linear_fc2 = nn.Linear(self.unit_dim, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.unit_dim)) if self.postshuffle else self.norm(x).view(-1, self.unit_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


@dataclass(frozen=True)
class TowerPlan:
    """The grid-dependent inputs of one forward over a packed batch, on the device."""

    table_rows: torch.Tensor      # [patches, 4] position-table rows to blend
    table_weights: torch.Tensor   # [patches, 4]
    cos: torch.Tensor             # [patches, head_dim] float32
    sin: torch.Tensor
    frames: SegmentPlan           # one attention segment per frame
    units_per_image: tuple[int, ...]


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle=True) for _ in cfg.deepstack_visual_indexes)
        self.level_of_block = {block: level for level, block in enumerate(cfg.deepstack_visual_indexes)}
        self.unit = cfg.spatial_merge_size ** 2
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        self.ops: LayerOps | None = None   # set by fuse()

    def fuse(self, ops: LayerOps) -> None:
        """Rotate q and k with `ops`' fused kernel (pipeline.kernels.ops on a
        GPU: the float32 rotary in place, one kernel instead of a dozen ops
        and copies, about a quarter of an eager forward on the 4B tower).
        Its LayerNorms and GELU stay PyTorch's: LayerOps has no kernel for
        them."""
        self.ops = ops

    def _inv_freq(self) -> torch.Tensor:
        dim = self.cfg.head_dim // 2
        return 1.0 / (self.cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))

    def reset_buffers(self) -> None:
        """Recompute non-checkpoint buffers after materialising from meta."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    @property
    def out_dim(self) -> int:
        """Width of each image token's output: main embedding plus every level."""
        return (1 + len(self.deepstack_merger_list)) * self.cfg.out_hidden_size

    @property
    def dtype(self) -> torch.dtype:
        """The dtype its inputs are cast to."""
        return self.patch_embed.proj.weight.dtype

    def tokens_per_image(self, grid: Grid) -> int:
        t, h, w = grid
        return t * h * w // self.unit

    def plan(self, grids: list[Grid], device: torch.device) -> TowerPlan:
        """Everything a forward needs that depends only on the grids, on the
        device: a forward over a plan is device work only (what a CUDA graph
        capture needs)."""
        layout = batch_layout(grids, self.cfg.spatial_merge_size, self.cfg.position_grid_side, device)
        cos, sin = self._rotary(layout.positions)
        return TowerPlan(layout.table_rows, layout.table_weights, cos, sin,
                         plan_segments(layout.frame_seqlens, device), tuple(layout.units_per_image))

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> list[torch.Tensor]:
        plan = self.plan(grids, pixel_values.device)
        return list(self.embed_planned(pixel_values, plan).split(plan.units_per_image))

    def embed_planned(self, pixel_values: torch.Tensor, plan: TowerPlan) -> torch.Tensor:
        """[units of all images, out_dim], images in order."""
        x = self.patch_embed(pixel_values)
        positions = (self.pos_embed(plan.table_rows) * plan.table_weights[:, :, None]).sum(1)
        x = x + positions.to(x.dtype)
        levels = []
        for index, block in enumerate(self.blocks):
            x = block(x, plan.cos, plan.sin, plan.frames, self.ops)
            level = self.level_of_block.get(index)
            if level is not None:
                levels.append(self.deepstack_merger_list[level](x))
        return torch.cat([self.merger(x), *levels], dim=-1)

    def _rotary(self, positions: torch.Tensor):
        freqs = (positions[..., None].float() * self.inv_freq).flatten(1)   # [patches, rows then cols]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()
