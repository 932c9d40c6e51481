"""Qwen3-VL's interleaved M-RoPE.

Qwen2.5-VL gives the temporal, height and width axes contiguous runs of
frequency bands; Qwen3-VL interleaves them, so every axis spans low and
high frequencies: band j takes the height position when j % 3 == 1 and
j < 3 * section[1], the width position when j % 3 == 2 and j < 3 *
section[2], and the temporal position otherwise.
"""

from __future__ import annotations

from pipeline.models.qwen2_5_vl.text import MultimodalRotary


def interleaved_band_axes(section: tuple[int, ...]) -> list[int]:
    """The position axis (0 t, 1 h, 2 w) of each of sum(section) bands."""
    bands = sum(section)
    axes = [0] * bands
    for axis in (1, 2):
        for band in range(axis, min(3 * section[axis], bands), 3):
            axes[band] = axis
    return axes


class InterleavedRotary(MultimodalRotary):
    """positions [3, T] -> cos, sin [T, head_dim], bands interleaved."""

    def band_axes(self) -> list[int]:
        return interleaved_band_axes(self.cfg.mrope_section)
