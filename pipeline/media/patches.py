"""Resized uint8 RGB pixels -> normalised patch rows, in torch on any device.

The GPU backends share these steps. Normalisation goes through the same
per-level table as `preprocess_images`, so for identical resized pixels the rows
are bit-identical to the Pillow path; every difference a GPU backend shows
comes from decoding (IDCT) and resampling, never from this step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# One source of truth for the float64-rescale-then-float32-normalise numerics;
# re-deriving them here could drift from the bit-exact reference path.
from pipeline.processing.image import CHANNELS, ImageProcessorConfig, _normalize_table


def normalize_table(cfg: ImageProcessorConfig, device: torch.device) -> torch.Tensor:
    """[3 * 256] float32 on `device`: the normalised value of each channel level."""
    return torch.from_numpy(_normalize_table(cfg)).to(device)


def patchify(rgb: torch.Tensor, cfg: ImageProcessorConfig, table: torch.Tensor) -> torch.Tensor:
    """One resized HWC uint8 image -> float32 [grid_h*grid_w, patch_dim] on its device.

    Same row layout as `preprocess_images`: merge-window major
    (grid_h/m, grid_w/m, m, m); each row is (C, T, p, p), the still image
    repeated across the T temporal slots.
    """
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    height, width, channels = rgb.shape
    if channels != CHANNELS or height % cfg.factor or width % cfg.factor:
        raise ValueError(f"patchify needs an HWC RGB image with sides divisible by {cfg.factor}, "
                         f"got shape {tuple(rgb.shape)}")
    gh, gw = height // p, width // p
    index = rgb.to(torch.int64) + torch.arange(channels, device=rgb.device) * 256
    normalized = table[index]
    blocks = normalized.view(gh // m, m, p, gw // m, m, p, channels).permute(0, 3, 1, 4, 6, 2, 5)
    rows = blocks.unsqueeze(5).expand(gh // m, gw // m, m, m, channels, t, p, p)
    return rows.reshape(gh * gw, channels * t * p * p)


def resize_bicubic(chw: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """CHW uint8 -> HWC uint8 of the given size, on the input's device.

    torch's antialiased bicubic uses Pillow's kernel (a = -0.5) and widens it
    when shrinking, as Pillow does; it differs from Pillow only in arithmetic
    (float32 here, 22-bit fixed point there), so results stay within a level
    or so. Same size is a copy, as in the reference.
    """
    if tuple(chw.shape[1:]) == (height, width):
        return chw.permute(1, 2, 0)
    image = chw.unsqueeze(0).to(torch.float32)
    resized = F.interpolate(image, size=(height, width), mode="bicubic", antialias=True,
                            align_corners=False)
    return resized.round_().clamp_(0, 255).to(torch.uint8)[0].permute(1, 2, 0)
